"""A batch of intent updates across pools: every group checked before any applies, so a bad
item changes nothing; a big batch in slices, so no call holds the event loop for long.

Each prefetch plan the batch makes is started the moment it is made (a copy owns its blocks
from then on): a caller cut off between two slices, or a slice that fails, never leaves the
slices before it with blocks marked in transit that nothing will move."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from kvd.core.errors import KvdError
from kvd.core.intent import IntentChange
from kvd.core.transfer import TransferPlan
from kvd.runtime import PoolRuntime

# A batch of more intent updates than SLICED (an engine step's worth; ~5 us each) is
# checked and applied a slice at a time, with the loop served in between.
SLICED = 256
INTENT_SLICE = 32
CHECK_SLICE = 128


async def apply(changes: Sequence[IntentChange],
                runtime_of: Callable[[str], PoolRuntime]) -> tuple[int, int]:
    """Apply updates grouped by pool (runtime_of: a request's pool, or the caller's error);
    returns (updates applied, blocks prefetched)."""
    by_pool: dict[PoolRuntime, list[IntentChange]] = {}
    sliced = len(changes) > SLICED
    for i, change in enumerate(changes):
        if sliced and i and i % CHECK_SLICE == 0:
            await asyncio.sleep(0)
        by_pool.setdefault(runtime_of(change.request_id), []).append(change)
    copies: list[Awaitable[float]] = []
    if sliced:
        prefetched = await _apply_sliced(by_pool, copies)
    else:
        if len(by_pool) > 1:  # one pool's update checks its group whole before it applies
            for rt, group in by_pool.items():
                final: dict = {}
                rt.pool.check_intents(group, final)
                rt.pool.intents.check_pins(final)
        prefetched = sum(_applied(rt, rt.pool.update_intents(group), copies)
                         for rt, group in by_pool.items())
    for copy in copies:
        await copy
    return len(changes), prefetched


def _applied(rt: PoolRuntime, plan: TransferPlan | None,
             copies: list[Awaitable[float]]) -> int:
    """A group or slice was applied: its unpinned blocks may be victims now, and its
    prefetch plan starts at once (its copy, if any, added to `copies`); the blocks it
    prefetches."""
    rt.room_may_have_changed()
    if plan is None:
        return 0
    run = rt.start(plan)
    if callable(run):
        copies.append(run())
    return len(plan.promotions)


async def _apply_sliced(by_pool: dict[PoolRuntime, list[IntentChange]],
                        copies: list[Awaitable[float]]) -> int:
    """A big batch is checked whole, then applied a slice at a time, with the loop served
    between slices: no call holds it for more than a fraction of a millisecond. A slice that
    fails because another call changed things meanwhile (released a request the batch names,
    pinned the device full) leaves the slices before it applied, and says so."""
    for rt, group in by_pool.items():
        final: dict = {}
        for start in range(0, len(group), CHECK_SLICE):
            await asyncio.sleep(0)
            rt.pool.check_intents(group[start:start + CHECK_SLICE], final)
        rt.pool.intents.check_pins(final)
    prefetched = done = 0
    for rt, group in by_pool.items():
        for start in range(0, len(group), INTENT_SLICE):
            await asyncio.sleep(0)
            part = group[start:start + INTENT_SLICE]
            try:
                plan = rt.pool.update_intents(part)
            except KvdError as exc:
                if done:
                    exc.args = (f"{exc.args[0]} (changed by another call while this batch "
                                f"was applied; {done} of its updates were)",)
                raise
            prefetched += _applied(rt, plan, copies)
            done += len(part)
    return prefetched
