"""Moves a transfer plan's bytes between arenas, off the event loop."""

from __future__ import annotations

import numpy as np

from kvd.core.blocks import TierKind
from kvd.core.transfer import TransferPlan


class PageCopier:
    """Copies pages of one pool between its device and host arenas.

    With numpy arenas, a worker thread does np.copyto (which releases the GIL for large
    copies); with a CuPy device arena, a CUDA stream does it. Demotions are copied before
    promotions: an incoming block may take the page a victim is leaving.
    """

    def __init__(self, device, host) -> None:
        self.device = device
        self.host = host
        self._gpu = device.backend == "cupy"

    def _arena(self, tier: TierKind):
        return self.device if tier is TierKind.DEVICE else self.host

    def copy_plan(self, plan: TransferPlan) -> int:
        """Copy every byte the plan moves; returns the number of bytes copied."""
        copied = 0
        for moves in (plan.demotions, plan.promotions):
            for m in moves:
                if m.copies_bytes:
                    self.copy_page(m.src_tier, m.src_page, m.dst_tier, m.dst_page)
                    copied += self.device.page_bytes
        return copied

    def copy_page(self, src_tier: TierKind, src_page: int, dst_tier: TierKind, dst_page: int):
        src, dst = self._arena(src_tier), self._arena(dst_tier)
        if self._gpu:
            from kvd.memory.cuda import copy_device_host

            copy_device_host(src.pages, [src_page], dst.pages, [dst_page], self.device.stream)
        else:
            np.copyto(dst.pages[dst_page], src.pages[src_page])
