"""What a Step's reads hand the engine stays where the reply says until the engine's next
message: a read later in the same step cannot take the pages of a request the step already
answered as resident."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvd_client import AsyncClient, pb
from kvd_client.client import intent_update
from kvd_client.arena import MappedPool
from kvd_loadgen.local import LocalKvd

from .conftest import SMALL, slow_link_kvd


def _write(mapped, rng, data: dict, handles) -> None:
    """The engine writes bytes of its own into each page handed out, and remembers them."""
    for h in handles:
        data[h.request_id, h.block_index] = rng.integers(0, 256, mapped.page_bytes,
                                                         dtype=np.uint8)
        mapped.write(h, data[h.request_id, h.block_index])


async def test_a_later_read_in_a_step_cannot_evict_a_request_the_step_answered(tmp_path):
    # Reservation admission lets 10 blocks run on 8 device pages: the step below reads
    # more than the device holds.
    with LocalKvd(*SMALL, "--admission", "reservation", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as client:
            mapped = MappedPool(await client.export_pool())
            try:
                await _check(client, mapped)
            finally:
                mapped.close()
            assert (await client.self_check()).ok


async def _check(client, mapped):
    rng = np.random.default_rng(3)
    where: dict[tuple[str, int], pb.PageHandle] = {}  # what the engine was last told
    data: dict[tuple[str, int], np.ndarray] = {}
    for rid, n in (("big", 6), ("small", 4)):
        await client.admit(rid, 16 * n)
    async with client.step_stream() as stream:
        for rid, n in (("big", 6), ("small", 4)):  # small's 4 push 2 of big's to the host
            reply = await stream.step(allocations=[(rid, n)])
            _write(mapped, rng, data, reply.allocated)
            for h in reply.allocated:
                where[rid, h.block_index] = h
        # small is resident (answered at once); big needs 2 blocks back, and the only other
        # pages are small's.
        reply = await stream.step(read_all=["small", "big"])
        failed = {["small", "big"][e.item_index] for e in reply.errors
                  if e.section == "read_all"}
        assert all(e.code == 8 for e in reply.errors), reply.errors  # RESOURCE_EXHAUSTED
        for h in reply.relocated:
            where[h.request_id, h.block_index] = h
        # Before its next message, the engine reads every request the step gave it.
        for (rid, index), h in where.items():
            if rid in failed:
                continue
            assert h.tier == pb.TIER_DEVICE, (rid, index)
            assert np.array_equal(mapped.read(h), data[rid, index]), (
                f"{rid} block {index}: its page holds other bytes than the engine wrote")
        assert "small" not in failed


async def test_a_step_reading_more_than_the_device_holds_is_told_at_once(tmp_path):
    """Its own holds end only at its next message: the read that finds no room beside them
    is refused (the engine splits the step) instead of waiting for them to lapse and then
    evicting what the step already handed out."""
    with LocalKvd(*SMALL, "--admission", "reservation", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as client:
            mapped = MappedPool(await client.export_pool())
            try:
                rng = np.random.default_rng(5)
                data = {}
                for rid, n in (("a", 6), ("b", 6), ("filler", 8)):
                    await client.admit(rid, 16 * n)
                    _write(mapped, rng, data, (await client.allocate(rid, n)).handles)
                async with client.step_stream() as stream:  # a and b are on the host now
                    reply = await stream.step(accesses=[("a", None), ("b", None)])
                    assert [(e.section, e.item_index, e.code) for e in reply.errors] == [
                        ("accesses", 1, 8)], reply.errors
                    assert "smaller steps" in reply.errors[0].message
                    told = {h.block_index: h for h in reply.relocated if h.request_id == "a"}
                    assert sorted(told) == list(range(6))
                    for index, h in told.items():  # read before the engine's next message
                        assert np.array_equal(mapped.read(h), data["a", index]), index
            finally:
                mapped.close()
            assert (await client.self_check()).ok


async def test_two_engines_reading_past_the_device_at_once_both_get_answers(tmp_path):
    """Two engines' steps each hold what they read so far and want more room than is left:
    neither's holds end while its step waits, so each is told (or served once the other's
    holds end), and what each was handed holds the bytes written there."""
    # A slow link (8 pages a second): both engines' first reads are still being copied when
    # their second ask for room, so each holds half the device while the other waits.
    with slow_link_kvd(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as a, \
                AsyncClient(kvd.target, timeout_s=10) as b, \
                AsyncClient(kvd.target, timeout_s=10) as admin:
            mapped = MappedPool(await admin.export_pool())
            try:
                rng = np.random.default_rng(9)
                data = {}
                for client, rids in ((a, ("a1", "a2")), (b, ("b1", "b2"))):
                    for rid in rids:
                        await client.admit(rid, 4 * 16)
                        _write(mapped, rng, data, (await client.allocate(rid, 4)).handles)
                await admin.admit("filler", 8 * 16)
                await admin.allocate("filler", 8)  # every other block to the host
                await admin.release("filler")
                async def engine(client, rids):
                    """A step, its pages read before the next message (which follows)."""
                    async with client.step_stream() as stream:
                        reply = await stream.step(accesses=[(rid, None) for rid in rids])
                        assert all(e.code == 8 for e in reply.errors), reply.errors
                        failed = {rids[e.item_index] for e in reply.errors}
                        read = 0
                        for h in reply.relocated:
                            if h.request_id not in failed:
                                read += 1
                                assert np.array_equal(mapped.read(h),
                                                      data[h.request_id, h.block_index])
                        await stream.step()  # gives the step's pages back
                        return read

                served = await asyncio.wait_for(asyncio.gather(
                    engine(a, ("a1", "a2")), engine(b, ("b1", "b2"))), 20)
                assert sum(served) >= 4  # at least one request was read
            finally:
                mapped.close()
            assert (await admin.self_check()).ok


@pytest.mark.parametrize("reads", [1, 2, 3])
async def test_a_request_a_step_answered_at_once_is_not_evicted_before_the_engines_next_message(
        tmp_path, reads):
    """The engine reads a request's pages after the reply that says they are in place, until
    its next message: another engine's allocation meanwhile waits for them (or for the hold to
    lapse) instead of taking them and writing its own bytes there. Likewise after a decode
    step that reads the same batch again (`reads` steps in a row), which the Step handler
    answers from what it kept of the first."""
    with LocalKvd(*SMALL, workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as a, \
                AsyncClient(kvd.target, timeout_s=10) as b:
            mapped = MappedPool(await a.export_pool())
            try:
                rng = np.random.default_rng(11)
                data: dict = {}
                await a.admit("x", 8 * 16)
                told = {h.block_index: h for h in (await a.allocate("x", 8)).handles}
                _write(mapped, rng, data, told.values())
                await b.admit("y", 4 * 16)
                async with a.step_stream() as stream:
                    for _ in range(reads):
                        reply = await stream.step(read_all=["x"])  # every page in place
                        assert not reply.errors and not reply.relocated
                    # Another engine wants 4 pages now; the device holds only x's.
                    grow = asyncio.ensure_future(b.allocate("y", 4))
                    done, _ = await asyncio.wait([grow], timeout=0.3)
                    if done:  # took x's pages: write there as an engine would
                        _write(mapped, rng, {}, grow.result().handles)
                    for index, h in told.items():  # the engine reads x before its next step
                        assert np.array_equal(mapped.read(h), data["x", index]), (
                            f"x block {index}: its page holds another engine's bytes")
                    await stream.step()  # x's pages are given back: y gets its room
                    y = await asyncio.wait_for(grow, 10)
                    assert len(y.handles) == 4
            finally:
                mapped.close()
            assert (await a.self_check()).ok


ENGINES = 10  # per tenant

TWO_TENANTS = """
[server]
hold_s = 5  # a step waiting for holds to lapse takes seconds; one that does not, ms

[[pool]]
model = "tiny"
block_tokens = 16
device_pages = 16
host_pages = 256
admission = "reservation"
policy = "lru"

[[tenant]]
name = "a"
token = "a-token"

[[tenant]]
name = "b"
token = "b-token"
"""


async def test_engines_of_competing_tenants_over_a_full_device_all_keep_stepping(tmp_path):
    """Two tenants, ten engines each, every engine a client of its own reading a request of
    its own: together nearly four times what the device holds, so steps wait for pages the
    others' last steps read. Tenants compete, so each tenant's streams take turns; an
    engine's next message must end its holds whether or not it has its tenant's turn yet.
    Otherwise the stream with the turn waits for room that streams waiting for the turn
    hold, until their holds lapse (hold_s, here 5 s): no step may take that long."""
    config = tmp_path / "kvd.toml"
    config.write_text(TWO_TENANTS)
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        slowest = []

        async def engine(token, rid):
            async with AsyncClient(kvd.target, token=token, timeout_s=90) as client:
                await client.admit(rid, 16 * 3)
                await client.allocate(rid, 3)  # held for the client until its next call
                async with client.step_stream() as stream:
                    for _ in range(30):
                        started = time.monotonic()
                        reply = await stream.step(read_all=[rid])
                        slowest.append(time.monotonic() - started)
                        assert not reply.errors, reply.errors
                await client.release(rid)

        # Each engine's 30 steps take well under a second when the holds end as they should.
        await asyncio.wait_for(asyncio.gather(*(engine(f"{t}-token", f"{t}{i}") for t in "ab"
                                                for i in range(ENGINES))), 60)
        assert len(slowest) == 2 * ENGINES * 30
        assert max(slowest) < 2.5, sorted(slowest)[-5:]


async def test_what_a_reply_the_engine_never_read_told_is_told_again(tmp_path):
    # A step brings back r's two blocks, one demoted (to a new page), one dropped (back as
    # a zeroed page to recompute); the stream ends before the engine reads that reply (it
    # restarted, or the connection broke). kvd cannot know the engine heard: the next read
    # of r, on a new stream, tells it again where both blocks are and that one is lost,
    # rather than letting the engine use the old page and take zeros for its bytes.
    with LocalKvd("--model", "tiny", "--block-tokens", "16", "--device-pages", "4",
                  "--host-pages", "1", "--admission", "reservation", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as client:
            await client.admit("r", 32, 0)
            await client.allocate("r", 2)
            await client.update_intents([intent_update("r", i, recompute_ok=True)
                                         for i in (0, 1)])
            evicted = (await client.evict(2)).evicted
            dropped = {e.block_index for e in evicted if e.to_tier == pb.TIER_UNSPECIFIED}
            assert len(dropped) == 1
            await client.admit("other", 16 * 2, 0)
            await client.allocate("other", 2)
            call = client.memory.Step(metadata=client.metadata)
            await call.write(pb.StepRequest(step_id=1, accesses=[
                pb.AccessRequest(request_id="r", all_blocks=True)]))
            for _ in range(200):  # the step has brought r back; its reply goes unread
                stats = (await client.pool_stats()).pools[0]
                if stats.num_promotions and stats.num_lost_blocks:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            call.cancel()
            await asyncio.sleep(0.2)  # kvd sees the stream end
            async with client.step_stream() as stream:
                reply = await stream.step(read_all=["r"])
            told = {h.block_index: h for h in reply.relocated}
            assert sorted(told) == [0, 1], reply
            assert {i for i, h in told.items() if h.recompute} == dropped
            async with client.step_stream() as stream:  # the engine heard: said once
                assert not (await stream.step(read_all=["r"])).relocated
            now = {h.block_index: h.page_index for h in (await client.access("r")).handles}
            assert {i: h.page_index for i, h in told.items()} == now
            assert (await client.self_check()).ok
