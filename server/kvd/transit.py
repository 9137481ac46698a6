"""Blocks in transit and who owns them: the task copying them (a plan's, or a handoff's), so
whoever needs a block waits for that task, and a check can tell a slow copy from a block
nothing will ever finish moving."""

from __future__ import annotations

import asyncio
import time

from kvd.core.blocks import Block, Request
from kvd.core.transfer import TransferPlan
from kvd.links import Transfer

# Blocks in transit with no owner for this long are stuck (see InTransit.stuck).
ORPHANED_AFTER_S = 1.0


class InTransit:
    """One pool's plans in flight and the owners of its blocks in transit."""

    def __init__(self, pool_name: str) -> None:
        self.pool_name = pool_name
        self._owner: dict[Block, asyncio.Future] = {}
        self._plans: set[TransferPlan] = set()
        # Plans in flight: their transfer, the bytes it had done and since when (stuck()).
        self._progress: dict[TransferPlan, list] = {}
        # Since when some block waited on has been in transit with no owner (None: none).
        self._unowned_since: float | None = None
        # Requests with blocks in transit that no plan owns, since when (see stuck()).
        self._orphans_seen: dict[Request, float] = {}

    def __len__(self) -> int:
        """Plans whose copies are under way."""
        return len(self._plans)

    def copying(self, plan: TransferPlan, transfer: Transfer, task: asyncio.Future) -> None:
        """A plan's transfer went to the link; `task` completes the plan when it is copied."""
        self.track(plan, task)
        self._progress[plan] = [transfer, 0, time.monotonic()]

    def track(self, plan: TransferPlan, task: asyncio.Future) -> None:
        """A plan is in flight in `task`: whoever needs its blocks waits for it, and checks
        see it (a handoff's plans come here directly)."""
        self._plans.add(plan)
        self.hold_for(plan.blocks(), task)

    def hold_for(self, blocks: list[Block], task: asyncio.Future) -> None:
        """Whoever needs these blocks waits for `task` (a handoff copying them)."""
        for b in blocks:
            self._owner[b] = task

    def finish(self, plan: TransferPlan) -> None:
        """A plan is no longer in flight (completed or aborted)."""
        self.finish_blocks(plan.blocks())
        self._plans.discard(plan)
        self._progress.pop(plan, None)

    def finish_blocks(self, blocks: list[Block]) -> None:
        """Nobody needs to wait for these blocks any more."""
        owner = self._owner
        for block in blocks:
            owner.pop(block, None)

    async def wait_for(self, blocks: list[Block]) -> None:
        """Wait until these blocks' transfers finish (no blocks: until any transfer does)."""
        if blocks:
            futures = {f for b in blocks if (f := self._owner.get(b)) is not None
                       and not f.done()}
        else:
            futures = set(self._owner.values())
            if futures:
                await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
                return
        if futures:
            await asyncio.wait(futures)
        else:
            # Moving but not yet registered (the planner's task registers it next), or, if
            # that lasts, owned by nobody: a bug that stuck() reports. Never spin.
            await asyncio.sleep(0.0005 if self._unowned_since is None else 0.05)
            self._note_unowned(blocks)

    def _note_unowned(self, blocks: list[Block]) -> None:
        unowned = [b for b in blocks if b.moving and b not in self._owner]
        if not unowned:
            self._unowned_since = None
        elif self._unowned_since is None:
            self._unowned_since = time.monotonic()

    def stuck(self, requests, bound_s: float) -> list[str]:
        """What has been in flight without progress for longer than bound_s: blocks of
        `requests` in transit that no plan or handoff owns, and plans whose bytes stopped
        moving."""
        now = time.monotonic()
        problems = []
        owner = self._owner
        seen, self._orphans_seen = self._orphans_seen, {}
        for req in requests:
            if not req.num_moving_blocks:
                continue
            orphans = [b for b in req.live if b.moving
                       and (b not in owner or owner[b].done())]
            if not orphans:
                continue
            # A plan's blocks go unowned for an instant between its planning and its start:
            # only what stays so is reported.
            since = self._orphans_seen[req] = seen.get(req, now)
            if now - since >= ORPHANED_AFTER_S:
                problems.append(f"{self.pool_name}: {len(orphans)} block(s) of request "
                                f"{req.request_id[:64]!r} in transit with no owner for "
                                f"{now - since:.1f} s")
        for plan, entry in self._progress.items():
            transfer, done, since = entry
            if transfer.job.bytes_done != done:
                entry[1], entry[2] = transfer.job.bytes_done, now
            elif now - since > bound_s:
                problems.append(f"{self.pool_name}: a {plan.reason} plan moved no byte for "
                                f"{now - since:.0f} s ({transfer.job.bytes_done} of "
                                f"{transfer.job.bytes_total} bytes done)")
        return problems

    async def quiesce(self, timeout_s: float | None = None) -> bool:
        """Wait until no transfer is in flight (for checks and shutdown), at most timeout_s.
        False: some still were."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            pending = {f for f in self._owner.values() if not f.done()}
            if not pending:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            await asyncio.wait(pending, timeout=left)
