"""The whole lifecycle of several requests against a real kvd, under memory pressure."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvd_client import AsyncClient, ResourceExhaustedError, pb
from kvd_client.arena import MappedPool
from kvd_loadgen.local import LocalKvd

from .conftest import SMALL


async def test_lifecycle_under_pressure_demotes_and_promotes(client):
    # 3 requests x 4 blocks = 12 blocks on 8 device pages: the third demotes the first.
    for rid in ("a", "b", "c"):
        reply = await client.admit(rid, prompt_tokens=64, output_tokens=0, tenant="t")
        assert reply.decision == pb.DECISION_ADMITTED
        assert reply.projected_pages == 4
        alloc = await client.allocate(rid, 4)
        assert len(alloc.handles) == 4
        assert all(h.tier == pb.TIER_DEVICE for h in alloc.handles)
    stats = (await client.pool_stats()).pools[0]
    assert stats.num_demotions == 4
    device, host = stats.tiers
    assert (device.used_pages, host.used_pages) == (8, 4)
    # Reading "a" again promotes its 4 blocks (demoting "b", the least recently used).
    access = await client.access("a")
    assert access.num_promoted == 4
    assert all(h.tier == pb.TIER_DEVICE for h in access.handles)
    stats = (await client.pool_stats()).pools[0]
    assert (stats.num_promotions, stats.num_demotions) == (4, 8)
    assert stats.bytes_moved == (4 + 8) * stats.page_bytes
    for rid in ("a", "b", "c"):
        assert (await client.release(rid)).num_freed == 4
    stats = (await client.pool_stats()).pools[0]
    assert [t.used_pages for t in stats.tiers] == [0, 0]


async def test_bytes_survive_demote_promote_cycles(client):
    """An engine stand-in maps the arenas, writes known bytes, forces them through several
    demote/promote cycles, and reads back byte-identical data."""
    mapped = MappedPool(await client.export_pool())
    try:
        rng = np.random.default_rng(7)
        await client.admit("victim", prompt_tokens=64)
        handles = (await client.allocate("victim", 4)).handles
        digests = []
        for h in handles:
            data = rng.integers(0, 256, mapped.page_bytes, dtype=np.uint8)
            mapped.write(h, data)
            digests.append(hashlib.sha256(data.tobytes()).hexdigest())
        await client.admit("pressure", prompt_tokens=128)
        await client.allocate("pressure", 8)
        for cycle in range(4):
            # Touch the pressure request so LRU demotes the victim, then read the victim back.
            await client.access("pressure")
            stats = (await client.pool_stats()).pools[0]
            access = await client.access("victim")
            assert access.num_promoted == 4, f"cycle {cycle}"
            now = [hashlib.sha256(mapped.page(h).tobytes()).hexdigest() for h in access.handles]
            assert now == digests, f"bytes changed in cycle {cycle}"
        assert stats.num_demotions >= 4 * 3
    finally:
        mapped.close()


async def test_step_stream_batches_a_whole_engine_step(client):
    for rid in ("s1", "s2"):
        await client.admit(rid, prompt_tokens=48)
    async with client.step_stream() as stream:
        reply = await stream.step(allocations=[("s1", 3), ("s2", 3)])
        assert reply.step_id == 1 and not reply.errors
        assert len(reply.allocated) == 6
        # Everything resident and already reported: nothing relocated.
        reply = await stream.step(accesses=[("s1", None), ("s2", [0, 1])])
        assert not reply.errors and not reply.relocated
        # A bad item is reported, and the rest of the step still happens.
        reply = await stream.step(accesses=[("nope", None), ("s1", [0])],
                                  releases=["s2"])
        assert [(e.section, e.item_index) for e in reply.errors] == [("accesses", 0)]
        assert reply.errors[0].code == 5  # NOT_FOUND
        stats = (await client.pool_stats()).pools[0]
        assert stats.num_requests == 1


async def test_a_repeated_read_sees_what_changed_between_steps(client):
    """An engine sends the same read every step; kvd answers a repeat from its last answer,
    but never one that something in between made stale."""
    for rid in ("r1", "r2"):  # 8 blocks on the 8 device pages
        await client.admit(rid, prompt_tokens=64)
        await client.allocate(rid, 4)
    async with client.step_stream() as stream:
        for _ in range(3):
            reply = await stream.step(read_all=["r1", "r2"])
            assert not reply.errors and not reply.relocated and not reply.stall_us
        # What the last step handed out stays in place until the stream's next message...
        with pytest.raises(ResourceExhaustedError, match="8 held by engines"):
            await client.evict(8)
        await stream.step()  # ...which ends those holds (and reads nothing)
        assert len((await client.evict(8)).evicted) == 8  # every block to the host tier
        reply = await stream.step(read_all=["r1", "r2"])  # the same bytes but for the id
        assert not reply.errors and reply.stall_us > 0
        assert sorted((h.request_id, h.block_index) for h in reply.relocated) == sorted(
            (rid, i) for rid in ("r1", "r2") for i in range(4))
        assert all(h.tier == pb.TIER_DEVICE for h in reply.relocated)
        reply = await stream.step(read_all=["r1", "r2"])
        assert not reply.errors and not reply.relocated and not reply.stall_us
    stats = (await client.pool_stats()).pools[0]
    assert stats.num_promotions == 8 and stats.tiers[0].used_pages == 8
    # 5 steps x 8 blocks, all counted though 4 of the steps were answered at once.
    assert stats.num_accesses == 5 * 8


async def test_a_decode_step_sees_what_other_calls_changed_since_the_last(kvd):
    """A decode step (the stream's last batch read again, and nothing else) is answered from
    what the stream kept of the last read, never past a change another call made in between:
    a block freed, blocks added, a request released."""
    async with AsyncClient(kvd.target, timeout_s=10) as engine, \
            AsyncClient(kvd.target, timeout_s=10) as other:
        for rid in ("r1", "r2"):
            await engine.admit(rid, prompt_tokens=64)
            await engine.allocate(rid, 2)
        async with engine.step_stream() as stream:
            for _ in range(2):
                reply = await stream.step(read_all=["r1", "r2"])
                assert not reply.errors and not reply.relocated
            await other.free("r1", [1])
            await other.allocate("r2", 2)
            reply = await stream.step(read_all=["r1", "r2"])  # 1 + 4 blocks now
            assert not reply.errors and not reply.relocated
            await other.release("r2")
            reply = await stream.step(read_all=["r1", "r2"])
            assert [(e.section, e.item_index, e.code) for e in reply.errors] == [
                ("read_all", 1, 5)]  # NOT_FOUND
        stats = (await engine.pool_stats()).pools[0]
        assert stats.num_accesses == 4 + 4 + 5 + 1
        assert (await engine.self_check()).ok


async def test_a_step_reading_many_blocks_by_index_reads_a_slice_at_a_time(tmp_path):
    """A Step's read naming more than slice_blocks blocks: resident, read a slice at a time
    (Node.access); some on the host tier, brought in, and their new pages reported; a bad
    index, an error for that item."""
    config = tmp_path / "kvd.toml"
    config.write_text("[server]\nslice_blocks = 4\n")
    with LocalKvd("--config", str(config), *SMALL, workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as client:
            await client.admit("r", prompt_tokens=128)
            async with client.step_stream() as stream:
                reply = await stream.step(allocations=[("r", 8)])
                pages = {h.block_index: h.page_index for h in reply.allocated}
                assert len(pages) == 8
                reply = await stream.step(accesses=[("r", list(range(8)))])
                assert not reply.errors and not reply.relocated and not reply.stall_us
                await stream.step()  # the engine is done with what it was handed
                evicted = await client.evict(4)
                out = {e.block_index for e in evicted.evicted}
                assert len(out) == 4
                reply = await stream.step(accesses=[("r", list(range(8))[::-1])])
                assert not reply.errors and reply.stall_us > 0
                assert {h.block_index for h in reply.relocated} == out
                reply = await stream.step(accesses=[("r", [0, 1, 2, 3, 99])])
                assert [(e.section, e.item_index, e.code) for e in reply.errors] == [
                    ("accesses", 0, 3)]  # INVALID_ARGUMENT
            check = await client.self_check()
            assert check.ok, list(check.problems)
