"""Runs a pool's decisions: executes transfer plans off the event loop, waits for blocks in
transit, and measures stalls. The core decides; this module makes the bytes follow."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import TypeVar

import structlog

from kvd.core.blocks import Block, TierKind
from kvd.core.errors import BlocksInTransit
from kvd.core.pool import AccessResult, Pool
from kvd.core.transfer import TransferPlan
from kvd.memory.copier import PageCopier

T = TypeVar("T")
log = structlog.get_logger("kvd.runtime")


class PoolRuntime:
    """One pool, its arenas, and the transfers in flight."""

    def __init__(self, pool: Pool, arenas: dict, copier: PageCopier, executor: Executor,
                 inline_copy_bytes: int = 64 * 1024) -> None:
        self.pool = pool
        # Plans that copy at most this much run on the event loop (host arenas only: a CUDA
        # copy always goes through the stream in a worker).
        self.inline_copy_bytes = inline_copy_bytes if copier.device.backend != "cupy" else -1
        self.arenas = arenas
        self.copier = copier
        self._executor = executor
        self._inflight: dict[Block, asyncio.Future] = {}
        self._refilling = False
        # Set (and replaced) whenever the admission queue may have changed.
        self.queue_changed = asyncio.Event()
        self._plans: set[TransferPlan] = set()
        self.on_plan_done: list[Callable[[TransferPlan, float], None]] = []

    def notify_queue(self) -> None:
        """Wake WaitAdmission streams: positions may have moved or requests been admitted."""
        self.queue_changed.set()
        self.queue_changed = asyncio.Event()

    @property
    def busy(self) -> bool:
        return bool(self._plans)

    async def access(self, request_id: str, indices) -> AccessResult:
        """pool.access, waiting out transfers; an access that waited for its own blocks'
        promotion (started by a prefetch that came too late) counts those as misses."""
        try:
            return self.pool.access(request_id, indices)
        except BlocksInTransit as busy:
            late = [b for b in busy.blocks if b.tier is not TierKind.DEVICE]
            await self.wait_for(busy.blocks)
        result = await self.run(lambda: self.pool.access(request_id, indices))
        self.pool.note_late(late)
        return result

    async def run(self, op: Callable[[], T]) -> T:
        """Call a pool operation, waiting out blocks in transit and calling again."""
        try:  # the common case: nothing in the way, no suspension
            return op()
        except BlocksInTransit as busy:
            await self.wait_for(busy.blocks)
        while True:
            try:
                return op()
            except BlocksInTransit as busy:
                await self.wait_for(busy.blocks)

    async def wait_for(self, blocks: list[Block]) -> None:
        """Wait until these blocks' transfers finish (no blocks: until any transfer does)."""
        if blocks:
            futures = {self._inflight[b] for b in blocks if b in self._inflight}
        else:
            futures = set(self._inflight.values())
            if futures:
                await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
                return
        if futures:
            await asyncio.wait(futures)
        else:  # moving but not yet registered: let the planner's task register it
            await asyncio.sleep(0.0005)

    def complete_now(self, plan: TransferPlan) -> float:
        """Complete a plan whose bytes are already where they belong."""
        self._completed(plan, self.pool.complete(plan), 0.0)
        return 0.0

    def _completed(self, plan: TransferPlan, pinned_out: list[Block], stall_s: float) -> None:
        self._notify(plan, stall_s)
        if plan.reason != "reserve" and not self._refilling:
            self._refill_soon()
        if pinned_out and self.pool.policy.uses_intent:  # pinned while demoted: bring back
            run = self.start(self.pool.prefetch(pinned_out))
            if callable(run):
                asyncio.ensure_future(run())

    def _refill_soon(self) -> None:
        """Top up the fair policy's free reserve in the background, off every request's path."""
        if self.pool.reserve_pages <= self.pool.device.num_free or not self.pool.policy.fair:
            return
        self._refilling = True

        async def refill():
            try:
                plan = self.pool.refill_plan()
                if plan is not None:
                    await self.execute(plan)
            finally:
                self._refilling = False

        asyncio.ensure_future(refill())

    def start(self, plan: TransferPlan | None) -> float | Callable[[], Awaitable[float]]:
        """Begin a plan. Returns the stall in seconds when the plan is already complete (no
        copy, or a small copy done inline), or a factory for the awaitable that copies in a
        worker and returns the stall."""
        if plan is None:
            return 0.0
        if plan.num_copies == 0:
            return self.complete_now(plan)
        if plan.num_copies * self.pool.page_bytes <= self.inline_copy_bytes:
            # A few KiB copy faster than a hand-off to a worker thread and back: do it here.
            started = time.perf_counter()
            try:
                self.copier.copy_plan(plan)
            except BaseException:
                self.pool.abort(plan)
                raise
            stall_s = time.perf_counter() - started
            self._completed(plan, self.pool.complete(plan), stall_s)
            return stall_s
        future = asyncio.get_running_loop().create_future()
        for block in plan.blocks():
            self._inflight[block] = future
        self._plans.add(plan)
        return lambda: self._execute(plan, future)

    async def execute(self, plan: TransferPlan | None) -> float:
        """Copy a plan's bytes and complete it; returns seconds spent waiting (the stall)."""
        run = self.start(plan)
        return await run() if callable(run) else run

    async def _execute(self, plan: TransferPlan, future: asyncio.Future) -> float:
        # The copy and the page-table update run in a task of their own: a caller that gives
        # up (a deadline, a cancelled stream) stops waiting, but the plan still finishes, so
        # no page is ever left half-moved or handed out while a thread still writes into it.
        return await asyncio.shield(asyncio.ensure_future(self._copy_and_complete(plan, future)))

    async def _copy_and_complete(self, plan: TransferPlan, future: asyncio.Future) -> float:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self.copier.copy_plan, plan)
        except BaseException:
            self.pool.abort(plan)  # the copy itself failed: nothing moved
            self._finish(plan, future)
            raise
        pinned_out = self.pool.complete(plan)
        stall_s = time.perf_counter() - started
        self._finish(plan, future)
        self._completed(plan, pinned_out, stall_s)
        return stall_s

    def _finish(self, plan: TransferPlan, future: asyncio.Future) -> None:
        for block in plan.blocks():
            if self._inflight.get(block) is future:
                del self._inflight[block]
        self._plans.discard(plan)
        if not future.done():
            future.set_result(None)

    def _notify(self, plan: TransferPlan, stall_s: float) -> None:
        for listener in self.on_plan_done:
            listener(plan, stall_s)

    async def quiesce(self) -> None:
        """Wait until no transfer is in flight (for checks and shutdown)."""
        while self._inflight:
            await asyncio.wait(set(self._inflight.values()))

    def close(self) -> None:
        for arena in self.arenas.values():
            arena.close()
