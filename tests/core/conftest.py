"""Core test fixtures: pools on a fake clock, with the invariants checked after every test."""

from __future__ import annotations

import pytest

from kvd.core.clock import FakeClock
from kvd.core.invariants import check_pool
from kvd.core.pool import Pool


class PoolFactory:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.pools: list[Pool] = []

    def __call__(self, device_pages=8, host_pages=16, policy="lru", **kw) -> Pool:
        pool = Pool(
            kw.pop("name", "default"),
            page_bytes=kw.pop("page_bytes", 64),
            block_tokens=kw.pop("block_tokens", 16),
            device_pages=device_pages,
            host_pages=host_pages,
            policy=policy,
            clock=self.clock,
            # These tests drive eviction and paging, which need more admitted than the
            # device holds; working-set admission has tests of its own.
            admission=kw.pop("admission", "reservation"),
            **kw,
        )
        self.pools.append(pool)
        return pool


@pytest.fixture
def make_pool():
    factory = PoolFactory()
    yield factory
    for pool in factory.pools:
        assert check_pool(pool) == []


def settle(pool: Pool, plan):
    """Complete a plan as the runtime would after copying its bytes."""
    if plan is not None:
        pool.complete(plan)
    return plan
