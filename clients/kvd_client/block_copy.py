"""Whole KV blocks between an engine's torch KV tensors and kvd's pages.

One kvd page holds one engine block of every layer, layer after layer. On the CPU the copies
are plain memcpys. On a GPU they run on a CUDA stream of their own: a page in kvd's GPU arena
is copied device to device; a page in host memory (shared memory, not page-locked) goes
through a page-locked staging buffer, one slot per block of the batch, so an asynchronous
copy never reads a slot that the next block's copy is already refilling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def as_tensor(page: Any) -> torch.Tensor:
    """A page from kvd_client.arena.MappedPool (numpy, or cupy for a GPU arena) as a uint8
    tensor sharing its memory."""
    if isinstance(page, np.ndarray):
        return torch.from_numpy(page)
    return torch.from_dlpack(page)


class BlockCopier:
    """Copies block `block_id` of every layer to or from one kvd page."""

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        self.layers = list(layers)
        for t in self.layers:
            if not t[0].is_contiguous():
                raise ValueError("kvd needs each block contiguous in its layer "
                                 f"(got shape {tuple(t.shape)}, strides {t.stride()})")
        self.block_bytes = sum(t[0].numel() * t.element_size() for t in self.layers)
        self.cuda = self.layers[0].is_cuda
        self.stream = torch.cuda.Stream(self.layers[0].device) if self.cuda else None
        self._staging: torch.Tensor | None = None

    def _views(self, block_id: int) -> list[torch.Tensor]:
        """Block `block_id` of every layer, as bytes."""
        return [t[block_id].reshape(-1).view(torch.uint8) for t in self.layers]

    def _scatter(self, src: torch.Tensor, block_id: int) -> None:
        offset = 0
        for dst in self._views(block_id):
            dst.copy_(src[offset:offset + dst.numel()], non_blocking=self.cuda)
            offset += dst.numel()

    def _gather(self, block_id: int, dst: torch.Tensor) -> None:
        offset = 0
        for src in self._views(block_id):
            dst[offset:offset + src.numel()].copy_(src, non_blocking=self.cuda)
            offset += src.numel()

    def _slots(self, n: int) -> torch.Tensor:
        """n page-locked staging slots of one block each (grown as batches need)."""
        if self._staging is None or self._staging.shape[0] < n:
            self._staging = torch.empty((max(n, 8), self.block_bytes), dtype=torch.uint8,
                                        pin_memory=True)
        return self._staging

    def load(self, pairs: Sequence[tuple[torch.Tensor, int]]) -> None:
        """Copy each (page, block_id): the page's bytes into the block. Returns when the
        bytes are in place."""
        if not self.cuda:
            for page, block_id in pairs:
                self._scatter(page, block_id)
            return
        slots = self._slots(len(pairs))
        sources = []
        for i, (page, _) in enumerate(pairs):
            if page.is_cuda:
                sources.append(page)
            else:
                slots[i].copy_(page)
                sources.append(slots[i])
        with torch.cuda.stream(self.stream):
            for src, (_, block_id) in zip(sources, pairs):
                self._scatter(src, block_id)
        self.stream.synchronize()

    def save(self, pairs: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Copy each (block_id, page): the block's bytes into the page, once the work queued
        on the current stream (the forward pass) has computed them."""
        if not self.cuda:
            for block_id, page in pairs:
                self._gather(block_id, page)
            return
        slots = self._slots(len(pairs))
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for i, (block_id, page) in enumerate(pairs):
                self._gather(block_id, page if page.is_cuda else slots[i])
        self.stream.synchronize()
        for i, (_, page) in enumerate(pairs):
            if not page.is_cuda:
                page.copy_(slots[i])
