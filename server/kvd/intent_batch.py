"""A batch of intent updates across pools: every group checked before any applies, so a bad
item changes nothing; a big batch in slices, so no call holds the event loop for long."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from kvd.core.intent import IntentChange
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
    if sliced:
        plans = await _apply_sliced(by_pool)
    else:
        plans = [(rt, rt.pool.update_intents(group)) for rt, group in by_pool.items()]
    prefetched = 0
    for rt, _ in plans:
        rt.room_may_have_changed()  # an unpinned block may be a victim now
    for rt, plan in plans:
        if plan is not None:
            prefetched += len(plan.promotions)
            await rt.execute(plan)
    return len(changes), prefetched


async def _apply_sliced(by_pool: dict[PoolRuntime, list[IntentChange]]) -> list:
    """A big batch is checked whole, then applied a slice at a time, with the loop served
    between slices: no call holds it for more than a fraction of a millisecond. (A slice
    that fails because another call changed things meanwhile leaves the slices before it
    applied.)"""
    for rt, group in by_pool.items():
        final: dict = {}
        for start in range(0, len(group), CHECK_SLICE):
            await asyncio.sleep(0)
            rt.pool.check_intents(group[start:start + CHECK_SLICE], final)
        rt.pool.intents.check_pins(final)
    plans = []
    for rt, group in by_pool.items():
        for start in range(0, len(group), INTENT_SLICE):
            await asyncio.sleep(0)
            plans.append((rt, rt.pool.update_intents(group[start:start + INTENT_SLICE])))
    return plans
