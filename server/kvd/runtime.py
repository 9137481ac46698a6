"""Runs a pool's decisions: executes transfer plans off the event loop, waits for blocks in
transit, and measures stalls. The core decides; this module makes the bytes follow."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

import structlog

from kvd.core.blocks import Block
from kvd.core.errors import BlocksInTransit
from kvd.core.pool import Pool
from kvd.core.transfer import TransferPlan
from kvd.memory.copier import PageCopier

T = TypeVar("T")
log = structlog.get_logger("kvd.runtime")


class PoolRuntime:
    """One pool, its arenas, and the transfers in flight."""

    def __init__(self, pool: Pool, arenas: dict, copier: PageCopier, executor: Executor) -> None:
        self.pool = pool
        self.arenas = arenas
        self.copier = copier
        self._executor = executor
        self._inflight: dict[Block, asyncio.Future] = {}
        self._plans: set[TransferPlan] = set()
        self.on_plan_done: list[Callable[[TransferPlan, float], None]] = []

    @property
    def busy(self) -> bool:
        return bool(self._plans)

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
        futures = {self._inflight[b] for b in blocks if b in self._inflight}
        if futures:
            await asyncio.wait(futures)
        else:  # moving but not yet registered: let the planner's task register it
            await asyncio.sleep(0)

    def complete_now(self, plan: TransferPlan) -> float:
        """Complete a plan that copies nothing (its pages were free)."""
        self.pool.complete(plan)
        self._notify(plan, 0.0)
        return 0.0

    def start(self, plan: TransferPlan | None) -> Callable | None:
        """Register a plan's blocks as in flight. Returns an awaitable factory, or None when the
        plan needed no copy and has already completed."""
        if plan is None:
            return None
        if plan.num_copies == 0:
            self.complete_now(plan)
            return None
        future = asyncio.get_running_loop().create_future()
        for block in plan.blocks():
            self._inflight[block] = future
        self._plans.add(plan)
        return lambda: self._execute(plan, future)

    async def execute(self, plan: TransferPlan | None) -> float:
        """Copy a plan's bytes and complete it; returns seconds spent waiting (the stall)."""
        run = self.start(plan)
        if run is None:
            return 0.0
        return await run()

    async def _execute(self, plan: TransferPlan, future: asyncio.Future) -> float:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            await asyncio.shield(loop.run_in_executor(self._executor, self.copier.copy_plan, plan))
        except BaseException:
            self.pool.abort(plan)
            self._finish(plan, future)
            raise
        pinned_out = self.pool.complete(plan)
        stall_s = time.perf_counter() - started
        self._finish(plan, future)
        self._notify(plan, stall_s)
        if pinned_out:  # pinned while being demoted: bring them back
            run = self.start(self.pool.prefetch(pinned_out))
            if run is not None:
                asyncio.ensure_future(run())
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
