"""Graceful restart: clients ride out kvd going away and coming back (RetryPolicy), and an
engine re-registers what it held in one call (EngineSession.recover)."""

from __future__ import annotations

import asyncio

from kvd_client import AsyncClient, EngineSession, RetryPolicy, pb
from kvd_loadgen.local import LocalKvd

from .conftest import SMALL


def _riding_out_restarts(target: str) -> AsyncClient:
    """A client whose calls wait for kvd to come back."""
    return AsyncClient(target, timeout_s=30,
                       retry=RetryPolicy(max_attempts=30, max_backoff_s=0.2))


async def test_a_client_rides_out_a_restart_and_re_registers(tmp_path):
    kvd = LocalKvd(*SMALL, workdir=tmp_path).start()
    try:
        async with _riding_out_restarts(kvd.target) as c:
            session = EngineSession(c)
            for rid, blocks in (("a", 3), ("b", 2), ("c", 1)):
                assert (await session.admit(rid, 16 * blocks, 16)).decision == \
                    pb.DECISION_ADMITTED
                await session.allocate(rid, blocks)
            await session.free("a", [1])
            await session.release("c")

            assert kvd.stop() == 0  # SIGTERM: drains and exits 0
            # A call made while kvd is down waits for it instead of failing...
            restart = asyncio.get_running_loop().run_in_executor(None, kvd.start)
            stats = (await c.pool_stats()).pools[0]
            await restart
            # ...and finds a kvd that kept its configuration but no requests or pages.
            assert stats.num_requests == 0 and stats.tiers[0].capacity_pages == 8

            recovery = await session.recover()
            assert recovery.queued == [] and recovery.refused == {}
            assert sorted(recovery.admitted) == ["a", "b"]
            assert sorted(recovery.admitted["a"]) == [0, 2]  # a's live blocks, new pages
            assert len(recovery.admitted["b"]) == 2
            stats = (await c.pool_stats()).pools[0]
            assert stats.num_requests == 2 and stats.tiers[0].used_pages == 4
            # A second recover finds them there and changes nothing.
            assert (await session.recover()).admitted == {}
            assert (await c.self_check()).ok
    finally:
        kvd.stop()


LIMITED = """
[[pool]]
model = "tiny"
block_tokens = 16
device_pages = 8
host_pages = 32

[[tenant]]
name = "default"
limit = 3
"""


async def test_a_request_kvd_cannot_give_its_blocks_back_does_not_stop_the_others(tmp_path):
    # kvd comes back with a tenant limit of 3 pages. "big" held 4 blocks (more than its
    # admission projected): admitted again, it cannot have them, and recover() went no
    # further than it, raising; "small" was never recovered. A request kvd queues holds
    # no block of the ones it held before.
    kvd = LocalKvd(*SMALL, workdir=tmp_path).start()
    try:
        async with _riding_out_restarts(kvd.target) as c:
            session = EngineSession(c)
            for rid, blocks in (("big", 4), ("small", 1), ("late", 2)):
                assert (await session.admit(rid, 16, 16)).decision == pb.DECISION_ADMITTED
                await session.allocate(rid, blocks)
            assert kvd.stop() == 0
            (tmp_path / "kvd.toml").write_text(LIMITED)
            kvd = LocalKvd("--config", str(tmp_path / "kvd.toml"), workdir=tmp_path).start()

            recovery = await session.recover()
            assert "limit of 3 pages" in recovery.refused["big"] and "big" not in session.held
            assert list(recovery.admitted) == ["small"]
            assert recovery.queued == ["late"] and session.held["late"].blocks == []
            stats = (await c.pool_stats()).pools[0]
            # big released again: small is in with its block, late waits.
            assert (stats.num_requests, stats.num_queued, stats.tiers[0].used_pages) == \
                (1, 1, 1)
            assert (await c.self_check()).ok
    finally:
        kvd.stop()
