"""Whole KV blocks between torch KV tensors and kvd pages (kvd_client.block_copy), the copies
the vLLM connector makes: every layer's block lands in its place in the page and comes back
byte-exact, for a batch of blocks at once. The GPU test runs the CUDA stream and the
page-locked staging path; it is skipped where there is no CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvd_client.block_copy import BlockCopier, as_tensor

NUM_BLOCKS = 64


def _layers(device: str) -> list[torch.Tensor]:
    # vLLM's CPU layout for one layer: (blocks, 2 (k, v), kv heads, block tokens, head dim).
    gen = torch.Generator().manual_seed(7)
    return [torch.randn((NUM_BLOCKS, 2, 1, 32, 64), generator=gen).to(torch.bfloat16)
            .to(device) for _ in range(2)]


def _round_trip(layers: list[torch.Tensor], pages: list[torch.Tensor]) -> None:
    copier = BlockCopier(layers)
    block_ids = list(range(NUM_BLOCKS - 1, -1, -1))  # not in page order
    expected = [[t[b].clone() for t in layers] for b in block_ids]
    copier.save(list(zip(block_ids, pages)))
    # Page p holds block block_ids[p] of layer 0, then of layer 1.
    first = layers[0][block_ids[0]].reshape(-1).view(torch.uint8).cpu()
    assert torch.equal(pages[0][:first.numel()].cpu(), first)
    for t in layers:
        t.zero_()
    copier.load(list(zip(pages, block_ids)))
    for b, blocks in zip(block_ids, expected):
        for t, want in zip(layers, blocks):
            assert torch.equal(t[b], want), f"block {b} came back wrong"


def test_blocks_round_trip_through_host_pages():
    layers = _layers("cpu")
    block_bytes = sum(t[0].numel() * t.element_size() for t in layers)
    arena = np.zeros((NUM_BLOCKS, block_bytes), np.uint8)
    _round_trip(layers, [as_tensor(arena[i]) for i in range(NUM_BLOCKS)])
    assert arena.any(axis=1).all()  # every page was written through the numpy view


def test_a_block_that_is_not_contiguous_is_refused():
    layer = torch.zeros((4, 2, 1, 32, 64)).transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        BlockCopier([layer])


@pytest.mark.gpu
def test_blocks_round_trip_on_a_gpu_through_staging_and_device_pages():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    layers = _layers("cuda")
    block_bytes = sum(t[0].numel() * t.element_size() for t in layers)
    # Host pages as kvd's shared memory is: ordinary, not page-locked. A batch of 64 through
    # the staging slots: one shared slot would hand later blocks' bytes to earlier ones.
    host = np.zeros((NUM_BLOCKS, block_bytes), np.uint8)
    _round_trip(layers, [as_tensor(host[i]) for i in range(NUM_BLOCKS)])
    device = torch.zeros((NUM_BLOCKS, block_bytes), dtype=torch.uint8, device="cuda")
    _round_trip(layers, [device[i] for i in range(NUM_BLOCKS)])
