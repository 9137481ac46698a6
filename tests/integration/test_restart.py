"""Graceful restart: clients ride out kvd going away and coming back (RetryPolicy), and an
engine re-registers what it held in one call (EngineSession.recover)."""

from __future__ import annotations

import asyncio

import pytest

from kvd_client import (AsyncClient, DeadlineExceededError, EngineSession, KvdClientError,
                        RetryPolicy, pb)
from kvd_loadgen.local import LocalKvd

from .conftest import SMALL, answered_as


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


async def test_a_request_released_across_a_restart_is_not_recovered(tmp_path):
    # The engine finished "b" after kvd restarted and before it recovered: the release
    # found no "b" (NOT_FOUND), and the session raised and kept it, so recover() admitted
    # it again with its block, held for a request the engine had finished.
    kvd = LocalKvd(*SMALL, workdir=tmp_path).start()
    try:
        async with _riding_out_restarts(kvd.target) as c:
            session = EngineSession(c)
            for rid in ("a", "b"):
                assert (await session.admit(rid, 16, 16)).decision == pb.DECISION_ADMITTED
                await session.allocate(rid, 1)
            assert kvd.stop() == 0
            kvd.start()
            assert (await session.release("b")).num_freed == 0  # kvd had nothing of it
            assert "b" not in session.held
            assert sorted((await session.recover()).admitted) == ["a"]
            assert [r.request_id for r in await c.list_requests()] == ["a"]
    finally:
        kvd.stop()


@pytest.mark.parametrize("fault", ["undelivered", "lost"])
async def test_what_kvd_did_not_answer_is_settled_before_the_session_recovers(tmp_path,
                                                                            fault):
    # kvd did not answer a release, a free and an admit (or did them and the answers were
    # lost), and stayed up. recover() found every request still there (ALREADY_EXISTS) and
    # left it: kvd held "b", which the engine had finished, "a"'s freed block, and "c",
    # which the engine did not know it had (and could not admit again: ALREADY_EXISTS).
    kvd = LocalKvd(*SMALL, workdir=tmp_path).start()
    try:
        async with AsyncClient(kvd.target, timeout_s=10) as c:
            session = EngineSession(c)
            for rid, blocks in (("a", 3), ("b", 1)):
                assert (await session.admit(rid, 16 * blocks, 16)).decision == \
                    pb.DECISION_ADMITTED
                await session.allocate(rid, blocks)
            for method, call in (("release", session.release("b")),
                                 ("free", session.free("a", [1])),
                                 ("admit", session.admit("c", 16, 16))):
                with answered_as(c, method, fault), pytest.raises(KvdClientError):
                    await call
            assert set(session.held) == {"a"} and session.held["a"].blocks == [0, 2]

            assert (await session.recover()).admitted == {}
            assert [r.request_id for r in await c.list_requests()] == ["a"]
            assert (await c.pool_stats()).pools[0].tiers[0].used_pages == 2
            # What was settled is not sent again, and "c" may be admitted now.
            assert (await session.recover()).admitted == {}
            assert (await session.admit("c", 16, 16)).decision == pb.DECISION_ADMITTED
            assert (await c.self_check()).ok
    finally:
        kvd.stop()


async def test_an_admit_whose_answer_was_lost_may_be_made_again(tmp_path):
    # The engine tried "c" again at once: kvd had taken the first Admit, and the second
    # was refused ALREADY_EXISTS, so the engine could not run "c" through kvd at all.
    kvd = LocalKvd(*SMALL, workdir=tmp_path).start()
    try:
        async with AsyncClient(kvd.target, timeout_s=10) as c:
            session = EngineSession(c)
            with answered_as(c, "admit", "lost"), pytest.raises(DeadlineExceededError):
                await session.admit("c", 64, 16)
            assert (await session.admit("c", 16, 16)).decision == pb.DECISION_ADMITTED
            await session.allocate("c", 1)
            (info,) = await c.list_requests()  # the second Admit's: 32 tokens, 2 pages
            assert (info.request_id, info.reserved_pages) == ("c", 2)
            assert (await c.self_check()).ok
    finally:
        kvd.stop()
