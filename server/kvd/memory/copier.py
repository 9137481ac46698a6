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
        runs = plan_runs(plan)
        self.copy_runs(runs)
        return sum(run[4] for run in runs) * self.device.page_bytes

    def copy_runs(self, runs) -> None:
        for src_tier, src_page, dst_tier, dst_page, num in runs:
            self.copy_pages(src_tier, src_page, dst_tier, dst_page, num)

    def copy_pages(self, src_tier: TierKind, src_page: int, dst_tier: TierKind, dst_page: int,
                   num: int = 1) -> None:
        src, dst = self._arena(src_tier), self._arena(dst_tier)
        if self._gpu:
            from kvd.memory.cuda import copy_device_host

            copy_device_host(src.pages, range(src_page, src_page + num), dst.pages,
                             range(dst_page, dst_page + num), self.device.stream)
        else:
            np.copyto(dst.pages[dst_page:dst_page + num], src.pages[src_page:src_page + num])


def copy_between(src, src_page: int, dst, dst_page: int, num: int) -> None:
    """Copy num pages between two arenas of different pools (a handoff): numpy on host
    arenas, a CUDA stream when either side is a CuPy arena (GPU to GPU: peer copy)."""
    if src.backend == "cupy" or dst.backend == "cupy":
        from kvd.memory.cuda import copy_device_host

        stream = (dst if dst.backend == "cupy" else src).stream
        copy_device_host(src.pages, range(src_page, src_page + num), dst.pages,
                         range(dst_page, dst_page + num), stream)
    else:
        np.copyto(dst.pages[dst_page:dst_page + num], src.pages[src_page:src_page + num])


def plan_runs(plan: TransferPlan) -> list[tuple]:
    """The plan's copies as runs: demotions first (an incoming block may take the page a
    victim is leaving), then promotions."""
    runs = []
    for moves in (plan.demotions, plan.promotions):
        runs += page_runs(
            (m.src_tier, m.src_page, m.dst_tier, m.dst_page) for m in moves if m.copies_bytes
        )
    return runs


def chunk_runs(runs, chunk_pages: int) -> list[list[tuple]]:
    """Runs split into chunks of at most chunk_pages pages each, in order."""
    chunks: list[list[tuple]] = []
    current: list[tuple] = []
    room = chunk_pages
    for src_tier, src_page, dst_tier, dst_page, num in runs:
        while num:
            take = min(num, room)
            current.append((src_tier, src_page, dst_tier, dst_page, take))
            src_page, dst_page, num, room = src_page + take, dst_page + take, num - take, room - take
            if room == 0:
                chunks.append(current)
                current, room = [], chunk_pages
    if current:
        chunks.append(current)
    return chunks


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


def read_pages(arena, page: int, num: int) -> bytes:
    """num consecutive pages of an arena as bytes (to send them to another node)."""
    if arena.backend == "cupy":
        import cupy

        return cupy.asnumpy(arena.pages[page:page + num]).tobytes()
    return arena.pages[page:page + num].tobytes()


def write_pages(arena, page: int, data: bytes) -> None:
    """Whole pages of bytes (from another node) into consecutive pages of an arena."""
    rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, arena.page_bytes)
    if arena.backend == "cupy":
        arena.pages[page:page + len(rows)].set(rows)
    else:
        arena.pages[page:page + len(rows)] = rows
