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
            runs = page_runs(
                (m.src_tier, m.src_page, m.dst_tier, m.dst_page) for m in moves if m.copies_bytes
            )
            for src_tier, src_page, dst_tier, dst_page, num in runs:
                self.copy_pages(src_tier, src_page, dst_tier, dst_page, num)
                copied += num * self.device.page_bytes
        return copied

    def copy_pages(self, src_tier: TierKind, src_page: int, dst_tier: TierKind, dst_page: int,
                   num: int = 1) -> None:
        src, dst = self._arena(src_tier), self._arena(dst_tier)
        if self._gpu:
            from kvd.memory.cuda import copy_device_host

            copy_device_host(src.pages, range(src_page, src_page + num), dst.pages,
                             range(dst_page, dst_page + num), self.device.stream)
        else:
            np.copyto(dst.pages[dst_page:dst_page + num], src.pages[src_page:src_page + num])


def page_runs(moves):
    """Coalesce (src_tier, src_page, dst_tier, dst_page) moves into runs of consecutive pages
    on both sides, so a request's blocks move in one copy rather than one per page."""
    runs: list[list] = []
    for src_tier, src_page, dst_tier, dst_page in sorted(moves):
        if runs:
            last = runs[-1]
            if (last[0] == src_tier and last[2] == dst_tier and last[1] + last[4] == src_page
                    and last[3] + last[4] == dst_page):
                last[4] += 1
                continue
        runs.append([src_tier, src_page, dst_tier, dst_page, 1])
    return [tuple(run) for run in runs]
