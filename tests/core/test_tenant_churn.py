"""Tenants come and go: fair shares, admission's room and the eviction order are computed
over the tenants a pool knows, on every call; one that held, reserved, queued or pinned
something and no longer does must not stay among them (with a few thousand of them gone,
each admission took milliseconds, and longer the more had come and gone)."""

from __future__ import annotations

import pytest

from kvd.core.blocks import TierKind
from kvd.core.intent import IntentChange

from .conftest import settle


@pytest.mark.parametrize("policy", ["lru", "fair", "intent"])
def test_tenants_that_come_and_go_leave_nothing_behind(make_pool, policy):
    pool = make_pool(device_pages=8, host_pages=4, policy=policy)
    pool.admit("live", tenant="live", prompt_tokens=64, output_tokens=0)
    settle(pool, pool.allocate("live", 4))
    for i in range(20):
        gone = f"gone{i}"
        assert pool.admit(f"{gone}-run", tenant=gone, prompt_tokens=48,
                          output_tokens=0).decision == "admitted"
        settle(pool, pool.allocate(f"{gone}-run", 3))
        pool.update_intents([IntentChange(f"{gone}-run", 0, {"pin_requested": True})])
        settle(pool, pool.access(f"{gone}-run", None).plan)
        # More than the pool has room for beside what runs: it waits in the queue.
        waiting = pool.admit(f"{gone}-wait", tenant=gone, prompt_tokens=16 * 8,
                             output_tokens=0)
        assert waiting.decision == "queued"
        assert gone in pool.tenancy.names()
        assert pool.tenancy.fair_share(gone) > 0
        pool.release(f"{gone}-wait")
        pool.release(f"{gone}-run")
    assert pool.tenancy.names() == {"live"}
    assert set(pool.tenancy.fair_shares()) <= {"live"}
    assert set(pool.tenancy.usages()) == {"live"}
    # What runs is served as before: the live tenant reads its blocks, in the device tier.
    read = pool.access("live", None)
    settle(pool, read.plan)
    blocks = read.request.live_blocks()
    assert len(blocks) == 4 and all(b.tier is TierKind.DEVICE for b in blocks)
