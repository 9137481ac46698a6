"""Graceful restart: clients ride out kvd going away and coming back (RetryPolicy), and an
engine re-registers what it held in one call (EngineSession.recover)."""

from __future__ import annotations

import asyncio

from kvd_client import AsyncClient, EngineSession, RetryPolicy, pb
from kvd_loadgen.local import LocalKvd

from .conftest import SMALL


async def test_a_client_rides_out_a_restart_and_re_registers(tmp_path):
    kvd = LocalKvd(*SMALL, workdir=tmp_path).start()
    try:
        async with AsyncClient(kvd.target, timeout_s=30,
                               retry=RetryPolicy(max_attempts=30, max_backoff_s=0.2)) as c:
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
