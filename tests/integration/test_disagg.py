"""Disaggregated prefill and decode pools over real gRPC: reservation at admission, handoff
that moves the right bytes, all-or-nothing rollback, reservation expiry."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

import numpy as np
import pytest

from kvd_client import (AsyncClient, FailedPreconditionError, NotFoundError,
                        ResourceExhaustedError, pb)
from kvd_client.arena import MappedPool
from kvd_client.client import intent_update
from kvd_loadgen.local import LocalKvd

PAGE = 16 * 1024  # the tiny model: 1 KiB a token, 16 tokens a page

CONFIG = """
[server]
handoff_ttl_s = {ttl}
lease_ttl_s = {lease_ttl}

[[pool]]
name = "prefill"
model = "tiny"
device_pages = 8
host_pages = 32
admission = "reservation"

[[pool]]
name = "decode"
model = "tiny"
device_pages = 8
host_pages = 8
admission = "reservation"

[[link]]
source = "prefill"
target = "decode"
bandwidth = "{bandwidth}"
chunk = "16KiB"  # one page: handoff progress block by block
"""


def start(tmp_path, bandwidth="auto", ttl=30, lease_ttl=30):
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG.format(bandwidth=bandwidth, ttl=ttl, lease_ttl=lease_ttl))
    return LocalKvd("--config", str(config), workdir=tmp_path)


def _write(mapped: MappedPool, handles, seed: int) -> list[str]:
    """Write random bytes into these pages; returns each page's digest."""
    rng = np.random.default_rng(seed)
    digests = []
    for h in handles:
        data = rng.integers(0, 256, PAGE, dtype=np.uint8)
        mapped.write(h, data)
        digests.append(hashlib.sha256(data.tobytes()).hexdigest())
    return digests


async def fill(client, mapped, request_id, num_blocks, seed):
    """Allocate blocks and write random bytes into them; returns each block's digest."""
    return _write(mapped, (await client.allocate(request_id, num_blocks)).handles, seed)


async def digests_of(client, mapped, request_id):
    reply = await client.access(request_id)  # every block, made resident
    return [hashlib.sha256(mapped.page(h).tobytes()).hexdigest() for h in reply.handles]


async def stats(client, pool):
    return (await client.pool_stats(pool)).pools[0]


async def copying(client) -> None:
    """Until the handoff under way has claimed its reservation: its copies have begun."""
    for _ in range(100):
        if (await stats(client, "decode")).handoff_reserved_pages == 0:
            return
        await asyncio.sleep(0.02)


async def test_handoff_moves_the_right_bytes(tmp_path):
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as c:
            prefill = MappedPool(await c.export_pool("prefill"))
            decode = MappedPool(await c.export_pool("decode"))
            r = await c.admit("r1", 6 * 16, 32, pool="prefill", handoff_pool="decode")
            assert r.decision == pb.DECISION_ADMITTED
            assert (await stats(c, "decode")).handoff_reserved_pages == 8
            want = await fill(c, prefill, "r1", 6, seed=1)
            # Another request pushes some of r1's blocks to host in an 8-page device tier,
            # so the handoff copies from both tiers of the prefill pool.
            await c.admit("filler", 6 * 16, 0, pool="prefill")
            await fill(c, prefill, "filler", 6, seed=2)
            assert (await stats(c, "prefill")).num_demotions >= 4

            progress = [p async for p in c.handoff("r1")]
            assert progress[-1].done and progress[-1].blocks_done == 6
            assert [p.bytes_done for p in progress] == sorted(p.bytes_done for p in progress)
            assert progress[-1].bytes_total == 6 * PAGE
            handles = progress[-1].handles
            assert {h.pool for h in handles} == {"decode"}
            got = [hashlib.sha256(decode.page(h).tobytes()).hexdigest() for h in handles]
            assert got == want

            pre, dec = await stats(c, "prefill"), await stats(c, "decode")
            assert pre.num_requests == 1 and pre.reserved_pages == 6  # the filler's
            assert sum(t.used_pages for t in pre.tiers) == 6
            assert dec.handoff_reserved_pages == 0 and dec.reserved_pages == 8
            handoff_link = [link for link in pre.links if link.link == "prefill->decode"]
            assert handoff_link and handoff_link[0].bytes_total == 6 * PAGE
            # The request lives in decode now: it decodes there, and Access finds it.
            await c.allocate("r1", 2)
            assert (await digests_of(c, decode, "r1"))[:6] == want
            assert (await c.self_check()).ok
            await c.release("r1")
            assert (await stats(c, "decode")).reserved_pages == 0
            prefill.close()
            decode.close()


async def test_reservation_keeps_prefill_from_starting_what_decode_cannot_hold(tmp_path):
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as c:
            # decode holds 8 + 8 - 1 (transit headroom) = 15 pages; a and a2 reserve 14.
            a = await c.admit("a", 4 * 16, 4 * 16, pool="prefill", handoff_pool="decode")
            a2 = await c.admit("a2", 3 * 16, 3 * 16, pool="prefill", handoff_pool="decode")
            assert a.decision == a2.decision == pb.DECISION_ADMITTED
            b = await c.admit("b", 2 * 16, 2 * 16, pool="prefill", handoff_pool="decode")
            assert b.decision == pb.DECISION_QUEUED
            assert "handoff pool 'decode'" in b.reason
            # b spent nothing in prefill: it holds no pages and cannot allocate.
            with pytest.raises(FailedPreconditionError):
                await c.allocate("b", 1)
            huge = await c.admit("huge", 4 * 16, 6 * 16, pool="prefill",
                                 handoff_pool="decode")
            assert huge.decision == pb.DECISION_REJECTED and "decode" in huge.reason

            waiter = asyncio.ensure_future(_admitted(c, "b"))
            await c.allocate("a", 4)
            await c.handoff_all("a")
            await asyncio.sleep(0.2)
            assert not waiter.done()  # a's decode pages are still held by a
            await c.release("a")
            await asyncio.wait_for(waiter, 5)
            await c.allocate("b", 2)
            assert (await stats(c, "decode")).handoff_reserved_pages == 6 + 4
            # Releasing a request that never handed off releases its reservation too.
            await c.release("b")
            await c.release("a2")
            assert (await stats(c, "decode")).reserved_pages == 0
            assert (await c.self_check()).ok


async def _admitted(client, request_id):
    async for update in client.wait_admission(request_id):
        if update.decision == pb.DECISION_ADMITTED:
            return


async def test_cancelled_handoff_leaves_nothing_half_moved(tmp_path):
    # 64 KiB/s with 16 KiB pages: 7 blocks take ~1.75 s, so the cancel lands half-way.
    with start(tmp_path, bandwidth="64KiB/s") as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as c:
            prefill = MappedPool(await c.export_pool("prefill"))
            decode = MappedPool(await c.export_pool("decode"))
            await c.admit("r", 7 * 16, 16, pool="prefill", handoff_pool="decode")
            want = await fill(c, prefill, "r", 7, seed=3)
            seen = []
            async for p in c.handoff("r"):
                seen.append(p)
                if p.blocks_done >= 2:
                    break  # the caller goes away mid-copy
            assert 0 < seen[-1].blocks_done < 7 and not seen[-1].done
            for _ in range(100):  # the rollback waits for the chunk in flight
                dec = await stats(c, "decode")
                if dec.reserved_pages == 0:
                    break
                await asyncio.sleep(0.05)
            assert dec.reserved_pages == 0 and dec.num_requests == 0
            assert sum(t.used_pages for t in dec.tiers) == 0
            # The request is whole in prefill, byte for byte.
            assert await digests_of(c, prefill, "r") == want
            assert (await c.self_check()).ok
            # It may be handed off again: the decode pool is asked afresh.
            last = await c.handoff_all("r")
            assert last.done
            assert [hashlib.sha256(decode.page(h).tobytes()).hexdigest()
                    for h in last.handles] == want
            assert (await c.self_check()).ok
            prefill.close()
            decode.close()



@pytest.mark.parametrize("call", ["release", "free", "access", "allocate"])
async def test_a_call_on_a_request_during_its_handoff_acts_where_the_request_is(
        tmp_path, call):
    """A release, free or access of a request whose handoff is copying waits for the
    copies, and acts where the request is once they end: in the decode pool, as the
    handoff went through. They used to look for it in the prefill pool it had left, and
    answer NOT_FOUND while kvd held the request, whole, in decode: an engine that takes
    NOT_FOUND for 'released' (a session, a lease's reaper) left it there for good. An
    allocation is refused while the handoff runs: it was made in the prefill pool, and the
    handoff, which copies the blocks it began with, left the new ones behind and freed
    their pages under the engine that was writing them."""
    # 16 KiB/s with 16 KiB pages: 6 blocks take ~6 s; the call lands early in the copies,
    # even on a machine that stalls the test for a second or two.
    with start(tmp_path, bandwidth="16KiB/s") as kvd:
        async with AsyncClient(kvd.target, timeout_s=20) as c:
            await c.admit("r", 6 * 16, 32, pool="prefill", handoff_pool="decode")
            await c.allocate("r", 6)
            handing = asyncio.ensure_future(c.handoff_all("r"))
            await copying(c)
            left = 6
            if call == "release":
                await c.release("r")
                assert await c.list_requests() == []
                left = 0
            elif call == "free":
                assert (await c.free("r", [0, 1])).num_freed == 2
                left = 4
            elif call == "access":
                handles = (await c.access("r")).handles
                assert [(h.pool, h.block_index) for h in handles] == [
                    ("decode", i) for i in range(6)]
            else:
                with pytest.raises(FailedPreconditionError, match="being handed off"):
                    await c.allocate("r", 2)
            last = await handing
            # Done, handing out what the request still holds after the call.
            assert last.done and len(last.handles) == left
            assert [r.num_blocks for r in await c.list_requests()] == ([left] if left else [])
            # The handoff held the decode pages for the caller before the release went
            # through: released, they stay out of use until the caller's next call.
            await c.keep_alive()
            assert sum(t.used_pages for t in (await stats(c, "decode")).tiers) == left
            assert sum(t.used_pages for t in (await stats(c, "prefill")).tiers) == 0
            assert (await c.self_check()).ok



async def test_list_requests_tells_a_handoffs_target_while_it_copies(tmp_path):
    """A request whose handoff copies has an entry in both pools: the target's, which holds
    the pages it is copied into, says "arriving" (it said "admitted", like the source's,
    as if the request were running twice)."""
    with start(tmp_path, bandwidth="16KiB/s") as kvd:  # 4 blocks: ~4 s of copies
        async with AsyncClient(kvd.target, timeout_s=20) as c:
            await c.admit("r", 4 * 16, 32, pool="prefill", handoff_pool="decode")
            await c.allocate("r", 4)

            async def states():
                return sorted((r.pool, r.state) for r in await c.list_requests())

            assert await states() == [("decode", "reserved"), ("prefill", "admitted")]
            handing = asyncio.ensure_future(c.handoff_all("r"))
            await copying(c)
            assert await states() == [("decode", "arriving"), ("prefill", "admitted")]
            assert (await handing).done
            assert await states() == [("decode", "admitted")]


async def test_a_handoff_keeps_the_indices_the_request_has_used(tmp_path):
    """An engine names blocks by index, and an index freed is never handed out again: a
    free sent twice (its first answer lost, as an engine session retries it) finds the
    block gone, not another. A handoff kept the indices of the blocks it carried, but
    forgot those freed after the last of them: the decode pool handed them out again, and
    the retried free of block 2 freed the block the engine had just written there."""
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as c:
            await c.admit("r", 4 * 16, 32, pool="prefill", handoff_pool="decode")
            await c.allocate("r", 4)
            await c.free("r", [2, 3])
            assert (await c.handoff_all("r")).done
            grown = (await c.allocate("r", 1)).handles
            assert [(h.pool, h.block_index) for h in grown] == [("decode", 4)]
            with pytest.raises(NotFoundError, match="freed"):
                await c.free("r", [2])  # the free sent again
            assert [h.block_index for h in (await c.access("r")).handles] == [0, 1, 4]
            assert (await c.self_check()).ok


async def test_a_handoff_carries_no_pins(tmp_path):
    """A pin claims device room in the pool it was made in: the blocks arrive in the decode
    pool unpinned (the prefill pool's pin ends with its request there), and the decode
    engine pins what it needs itself."""
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as c:
            await c.admit("r", 3 * 16, 32, pool="prefill", handoff_pool="decode")
            await c.allocate("r", 3)
            await c.update_intents([intent_update("r", 1, pin_requested=True)])

            async def pinned(pool):
                return (await stats(c, pool)).tiers[0].pinned_pages

            assert (await pinned("prefill"), await pinned("decode")) == (1, 0)
            assert (await c.handoff_all("r")).done
            assert (await pinned("prefill"), await pinned("decode")) == (0, 0)
            await c.update_intents([intent_update("r", 1, pin_requested=True)])
            assert (await pinned("prefill"), await pinned("decode")) == (0, 1)
            assert (await c.self_check()).ok


async def test_handoff_without_reservation_can_be_refused(tmp_path):
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as c:
            for rid, blocks in (("big", 4), ("big2", 3)):  # decode holds 15; these take 14
                r = await c.admit(rid, blocks * 16, blocks * 16, pool="decode")
                assert r.decision == pb.DECISION_ADMITTED
            await c.admit("late", 4 * 16, 16, pool="prefill")  # no handoff_pool
            await c.allocate("late", 4)
            with pytest.raises(ResourceExhaustedError, match="without a reservation"):
                await c.handoff_all("late", "decode")
            # Refused before anything moved: still whole in prefill.
            assert len((await c.access("late")).handles) == 4
            await c.release("big")
            last = await c.handoff_all("late", "decode")
            assert last.done and len(last.handles) == 4
            assert (await c.self_check()).ok


async def test_unclaimed_reservation_expires(tmp_path):
    with start(tmp_path, ttl=0.5) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as c:
            await c.admit("slow", 4 * 16, 16, pool="prefill", handoff_pool="decode")
            assert (await stats(c, "decode")).handoff_reserved_pages == 5
            for _ in range(60):
                await asyncio.sleep(0.1)
                if (await stats(c, "decode")).handoff_reserved_pages == 0:
                    break
            assert (await stats(c, "decode")).handoff_reserved_pages == 0
            # The prefill request stays; a later handoff asks decode again, and gets it.
            await c.allocate("slow", 2)
            assert (await c.handoff_all("slow")).done
            assert (await c.self_check()).ok


async def test_handoff_errors(tmp_path):
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as c:
            with pytest.raises(Exception, match="no request"):
                await c.handoff_all("ghost")
            await c.admit("x", 16, 16, pool="prefill")
            with pytest.raises(FailedPreconditionError, match="without a handoff pool"):
                await c.handoff_all("x")
            with pytest.raises(Exception, match="own pool"):
                await c.handoff_all("x", "prefill")
            with pytest.raises(Exception, match="no pool"):
                await c.admit("y", 16, 16, pool="prefill", handoff_pool="nowhere")
            with pytest.raises(Exception, match="prompt tokens"):
                await c.admit("z", 0, 16, pool="prefill", handoff_pool="decode")
            assert (await c.self_check()).ok


async def test_handed_off_pages_stay_put_until_the_engine_calls_again(tmp_path):
    # What the last message hands out is the engine's to read: another client's allocation
    # in the decode pool may not demote those blocks and write over their pages meanwhile.
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as c, \
                AsyncClient(kvd.target, timeout_s=10) as other:
            prefill = MappedPool(await c.export_pool("prefill"))
            decode = MappedPool(await c.export_pool("decode"))
            await c.admit("r1", 6 * 16, 16, pool="prefill", handoff_pool="decode")
            want = await fill(c, prefill, "r1", 6, seed=5)
            await other.admit("filler", 8 * 16, 0, pool="decode")

            async def crowd():  # needs every device page of the decode pool
                for h in (await other.allocate("filler", 8)).handles:
                    decode.page(h)[:] = 0xEE

            last = await c.handoff_all("r1")
            crowding = asyncio.ensure_future(crowd())
            await asyncio.sleep(0.3)
            got = [hashlib.sha256(decode.page(h).tobytes()).hexdigest() for h in last.handles]
            assert got == want
            assert not crowding.done()  # it waits for the engine's next call
            assert await digests_of(c, decode, "r1") == want  # the next call: moved, intact
            await asyncio.wait_for(crowding, 5)
            assert (await c.self_check()).ok
            prefill.close()
            decode.close()


async def test_a_dropped_block_brought_back_unread_is_not_handed_off_as_data(tmp_path):
    # A prefill pool without a host tier: a recompute_ok victim is dropped. A pin brings it
    # back to the device as a zeroed page the engine has not been told of (a reply that
    # hands the block out says recompute): a handoff then would give decode those zeros as
    # the block's bytes. It is refused until the engine has read the block (and recomputed).
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG.format(bandwidth="auto", ttl=30, lease_ttl=30).replace(
        "device_pages = 8\nhost_pages = 32",
        'device_pages = 4\nhost_pages = 0\npolicy = "intent"  # brings pinned blocks back'))
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as c:
            prefill = MappedPool(await c.export_pool("prefill"))
            decode = MappedPool(await c.export_pool("decode"))
            await c.admit("r1", 16, 16, pool="prefill", handoff_pool="decode")
            (want,) = await fill(c, prefill, "r1", 1, seed=3)
            await c.update_intents([intent_update("r1", 0, recompute_ok=True)])
            (evicted,) = (await c.evict(1, pool="prefill")).evicted
            assert evicted.to_tier == pb.TIER_UNSPECIFIED  # dropped
            await c.update_intents([intent_update("r1", 0, pin_requested=True)])
            for _ in range(100):  # the pinned block is brought back in the background
                if (await stats(c, "prefill")).num_lost_blocks:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the pinned block was not brought back")
            with pytest.raises(FailedPreconditionError, match=r"blocks \[0\] of request "
                               r"'r1' were dropped for the engine to recompute"):
                await c.handoff_all("r1")
            (handle,) = (await c.access("r1")).handles
            assert handle.recompute and not prefill.page(handle).any()
            rng = np.random.default_rng(3)  # the engine recomputes the block
            prefill.write(handle, rng.integers(0, 256, PAGE, dtype=np.uint8))
            (moved,) = (await c.handoff_all("r1")).handles
            assert hashlib.sha256(decode.page(moved).tobytes()).hexdigest() == want
            assert (await c.self_check()).ok
            prefill.close()
            decode.close()


async def test_a_handoff_takes_the_shared_prefix_its_request_used_along(tmp_path):
    # r1 prefilled on a 3-block prefix it stored and committed, 2 of those blocks already
    # in decode's pool too (another request stored them there), and 2 blocks of its own.
    # The handoff copies its own blocks and the prefix block decode lacks; in decode the
    # request loads its whole prefix, byte for byte, and prefill keeps the prefix for
    # others.
    keys = [b"p0", b"p1", b"p2"]
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as c:
            prefill = MappedPool(await c.export_pool("prefill"))
            decode = MappedPool(await c.export_pool("decode"))
            rng = np.random.default_rng(5)
            prefix = {k: rng.integers(0, 256, PAGE, dtype=np.uint8) for k in keys}
            await c.admit("other", 16 * 2, 0, pool="decode")
            for h in (await c.store("other", "m", keys[:2])).handles:
                decode.write(h, prefix[keys[h.block_index]])
            await c.commit("other", "m", keys[:2])
            await c.admit("r1", 16 * 5, 16, pool="prefill", handoff_pool="decode")
            for h in (await c.store("r1", "m", keys)).handles:
                prefill.write(h, prefix[keys[h.block_index]])
            await c.commit("r1", "m", keys)
            own = await fill(c, prefill, "r1", 2, seed=6)
            done = await c.handoff_all("r1")
            assert [hashlib.sha256(decode.page(h).tobytes()).hexdigest()
                    for h in done.handles] == own
            assert (await c.lookup("m", keys, pool="decode")).num_hit == 3
            loaded = (await c.load("r1", "m", keys)).handles
            assert {h.pool for h in loaded} == {"decode"}
            assert [bytes(decode.page(h)) for h in loaded] == [prefix[k].tobytes()
                                                               for k in keys]
            assert (await c.lookup("m", keys, pool="prefill")).num_hit == 3
            (link,) = [k for k in (await stats(c, "prefill")).links
                       if k.link == "prefill->decode"]
            assert link.bytes_total == 3 * PAGE  # its 2 blocks and the prefix block decode lacked
            # Each pool counts the blocks published in it: decode, other's two and the one
            # the handoff brought; and the loads it served.
            counted = {}
            for pool in ("prefill", "decode"):
                figures = await stats(c, pool)
                counted[pool] = (figures.num_prefix_stored, figures.num_prefix_loaded)
            assert counted == {"prefill": (3, 0), "decode": (3, 3)}
            assert (await c.self_check()).ok
            prefill.close()
            decode.close()


async def test_a_release_while_a_handoff_carries_only_prefix_blocks_is_not_undone(tmp_path):
    """A request with no blocks of its own (only the prefix it stored) hands off: the copies
    carry its prefix blocks. A release meanwhile found no block of its own held by the
    handoff, so it did not wait: it released the request, and the handoff then made it
    live in decode again, with no lease and no engine: never released."""
    keys = [b"q0", b"q1", b"q2"]
    with start(tmp_path, bandwidth="16KiB/s") as kvd:  # 3 prefix blocks: ~3 s of copies
        async with AsyncClient(kvd.target, timeout_s=20) as c:
            prefill = MappedPool(await c.export_pool("prefill"))
            try:
                await c.admit("r", 16 * 3, 16, pool="prefill", handoff_pool="decode")
                for h in (await c.store("r", "m", keys)).handles:
                    prefill.write(h, np.full(PAGE, h.block_index + 1, np.uint8))
                await c.commit("r", "m", keys)
                handing = asyncio.ensure_future(c.handoff_all("r"))
                await copying(c)
                await c.release("r")  # answered once the request is gone, wherever it was
                with contextlib.suppress(Exception):
                    await handing
                assert await c.list_requests() == []
                assert (await stats(c, "decode")).num_requests == 0
                with pytest.raises(NotFoundError):
                    await c.access("r")
                assert (await c.self_check()).ok
            finally:
                prefill.close()


async def test_a_store_while_its_request_is_handed_off_never_hands_out_a_page_to_lose(
        tmp_path):
    """A store by a request whose handoff copies placed a new page in prefill and told the
    engine to write it; the handoff's commit then let go of the uncommitted block, its page
    went to another request, and the engine's write landed in that request's block. A store
    is refused while its request is handed off, as an allocation is."""
    with start(tmp_path, bandwidth="16KiB/s") as kvd:  # 6 blocks: ~4 s of copies
        async with AsyncClient(kvd.target, timeout_s=20) as c, \
                AsyncClient(kvd.target, timeout_s=20) as other:
            prefill = MappedPool(await c.export_pool("prefill"))
            try:
                await c.admit("r", 16 * 6, 16, pool="prefill", handoff_pool="decode")
                await c.allocate("r", 6)
                handing = asyncio.ensure_future(c.handoff_all("r"))
                await copying(c)
                try:
                    to_write = (await c.store("r", "m", [b"k"])).handles
                except FailedPreconditionError as exc:
                    assert "being handed off" in str(exc)
                    to_write = []
                assert (await handing).done
                await other.admit("x", 16 * 8, 0, pool="prefill")
                mine = (await other.allocate("x", 8)).handles  # every prefill page
                for h in mine:
                    prefill.write(h, np.full(PAGE, 7, np.uint8))
                for h in to_write:  # r's engine writes what its store told it to
                    prefill.write(h, np.full(PAGE, 1, np.uint8))
                assert all((prefill.read(h) == 7).all()
                           for h in (await other.access("x")).handles)
                assert to_write == []
                assert (await c.lookup("m", [b"k"], pool="prefill")).num_hit == 0
                assert (await c.self_check()).ok
            finally:
                prefill.close()


async def test_a_handed_off_request_is_the_decode_engines_once_it_takes_it_up(tmp_path):
    """The decode engine's first call naming a request handed to its pool makes it its
    lease's: the prefill engine going away no longer releases a request being decoded
    (it did: the request was its lease's to the end). Until then the prefill engine's
    lease holds it, as before."""
    with start(tmp_path, lease_ttl=1.0) as kvd:
        async with AsyncClient(kvd.target) as decode, AsyncClient(kvd.target) as watcher:
            async with AsyncClient(kvd.target) as prefill:
                for rid in ("taken", "untaken"):
                    await prefill.admit(rid, prompt_tokens=2 * 16, output_tokens=16,
                                        pool="prefill", handoff_pool="decode")
                    await prefill.allocate(rid, 2)
                    assert (await prefill.handoff_all(rid, "decode")).done
                for _ in range(8):  # the prefill engine still calls: both stay
                    await prefill.keep_alive()
                    await decode.keep_alive()
                    await asyncio.sleep(0.25)
                assert {r.request_id for r in await watcher.list_requests()} == {
                    "taken", "untaken"}
                assert len((await decode.access("taken")).handles) == 2  # taken up
                await watcher.explain("untaken")  # a look takes up nothing
            # The prefill engine is gone: what no decode engine took up goes with its lease.
            for _ in range(12):
                await decode.keep_alive()
                await watcher.keep_alive()
                await asyncio.sleep(0.25)
            assert {r.request_id: r.pool for r in await watcher.list_requests()} == {
                "taken": "decode"}, ("the request the decode engine took up must stay, and "
                                     "only it")


HOLD_S = 1.0  # the daemon's hold_s (the default)


async def _engine_handed(engine: AsyncClient, stream, how: str) -> list[pb.PageHandle]:
    """The engine's request r1 (6 blocks) in the prefill pool, its pages handed to the engine
    by its last call: a unary Allocate, a Step's allocation, or a later Step's read."""
    await engine.admit("r1", 6 * 16, 16, pool="prefill", handoff_pool="decode")
    if how == "unary":
        return list((await engine.allocate("r1", 6)).handles)
    handles = list((await stream.step(allocations=[("r1", 6)])).allocated)
    if how == "read":
        reply = await stream.step(read_all=["r1"])
        assert not reply.errors, reply.errors
    return handles


@contextlib.asynccontextmanager
async def _pools_and_handoff_events(client: AsyncClient):
    """The prefill and decode arenas mapped, and the reasons of the handoff events the
    client sees from now on, as they come."""
    prefill = MappedPool(await client.export_pool("prefill"))
    decode = MappedPool(await client.export_pool("decode"))
    events: list[str] = []
    subscribed = asyncio.Event()

    async def watch():
        async for event in client.watch_events(kinds=["handoff"], on_subscribed=subscribed.set):
            events.append(event.detail.get("reason", ""))

    watching = asyncio.ensure_future(watch())
    try:
        await asyncio.wait_for(subscribed.wait(), 10)
        yield prefill, decode, events
    finally:
        watching.cancel()
        prefill.close()
        decode.close()


@pytest.mark.parametrize("how", ["unary", "step", "read"])
async def test_a_handoff_another_client_asks_for_waits_for_the_engines_writes(tmp_path, how):
    """A router (another client of the tenant) hands the request off while its engine's
    forward pass still writes the pages its last call handed it: the copy waits for the
    engine's next call. Before, it copied at once, and the decode pool got what the pages
    held half-way (here: nothing the engine wrote)."""
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as engine, \
                AsyncClient(kvd.target, timeout_s=10) as router, \
                _pools_and_handoff_events(router) as (prefill, decode, events):
            async with engine.step_stream() as stream:
                handles = await _engine_handed(engine, stream, how)
                handing = asyncio.ensure_future(router.handoff_all("r1"))
                await asyncio.sleep(0.3)
                assert not handing.done(), \
                    "the handoff copied the pages while their engine still wrote them"
                want = _write(prefill, handles, seed=7)  # the forward pass, late
                if how == "unary":
                    await engine.keep_alive()  # its next call: done with them
                else:
                    assert not (await stream.step()).errors
                last = await asyncio.wait_for(handing, 10)
            assert last.done and len(last.handles) == 6
            got = [hashlib.sha256(decode.page(h).tobytes()).hexdigest()
                   for h in last.handles]
            assert got == want
            assert "waiting for the next call of the engines holding it" in events
            assert (await router.self_check()).ok


async def test_an_engines_own_handoff_does_not_wait_for_its_step_stream(tmp_path):
    """The engine hands its request off once its forward pass is done with it: neither its
    unary calls' holds nor its own Step stream's (the same lease) hold the copy up."""
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as engine, \
                _pools_and_handoff_events(engine) as (prefill, decode, events):
            async with engine.step_stream() as stream:
                handles = await _engine_handed(engine, stream, "read")
                want = _write(prefill, handles, seed=8)
                last = await engine.handoff_all("r1")
                assert [hashlib.sha256(decode.page(h).tobytes()).hexdigest()
                        for h in last.handles] == want
                for _ in range(100):  # the event feed catches up with the handoff
                    if "completed" in events:
                        break
                    await asyncio.sleep(0.01)
                assert events and events[-1] == "completed"
                assert "waiting for the next call of the engines holding it" not in events


async def test_a_handoff_waits_for_an_engine_that_never_calls_again_no_longer_than_its_holds(
        tmp_path):
    """An engine that never sends again (stalled, or gone without closing its stream) holds
    the handoff up no longer than its holds last (hold_s): nothing is stuck."""
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as engine, \
                AsyncClient(kvd.target, timeout_s=10) as router:
            async with engine.step_stream() as stream:
                loop = asyncio.get_running_loop()
                sent = loop.time()  # the holds begin after this, and last hold_s
                await _engine_handed(engine, stream, "step")
                last = await asyncio.wait_for(router.handoff_all("r1"), 10)
                waited = loop.time() - sent
                assert last.done and len(last.handles) == 6
                assert waited >= HOLD_S, f"handed off {waited:.2f} s after the engine's step"
                assert not (await stream.step()).errors  # the engine, back, finds no error
            assert (await router.self_check()).ok


async def test_a_router_that_goes_away_while_its_handoff_waits_leaves_nothing(tmp_path):
    """The caller cancels while the handoff waits for the engine: the reservation goes
    back to the decode pool, and the request stays whole in prefill."""
    with start(tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as engine, \
                AsyncClient(kvd.target, timeout_s=10) as router:
            async with engine.step_stream() as stream:
                await _engine_handed(engine, stream, "step")
                handing = asyncio.ensure_future(router.handoff_all("r1"))
                await asyncio.sleep(0.3)
                handing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await handing
                for _ in range(100):
                    dec = await stats(engine, "decode")
                    if dec.reserved_pages == 0:
                        break
                    await asyncio.sleep(0.02)
                assert dec.reserved_pages == 0 and dec.num_requests == 0
                assert not (await stream.step(read_all=["r1"])).errors  # still in prefill
                assert (await stats(engine, "prefill")).num_requests == 1
                last = await engine.handoff_all("r1")  # asked afresh, by its engine
                assert last.done and len(last.handles) == 6
            assert (await router.self_check()).ok


# A prefill pool whose link to its host tier crawls (a page's demotion takes 2 s once the
# link spent its burst, a page) beside a handoff link that copies a page in half a second.
CRAWLING_HOST = CONFIG.format(bandwidth="32KiB", ttl=30, lease_ttl=30).replace(
    "device_pages = 8\nhost_pages = 32",
    'device_pages = 3\nhost_pages = 8\nlink_bandwidth = "8KiB"\nlink_chunk = "16KiB"\n'
    'link_burst = "1"').replace("block by block", 'block by block\nburst = "1"')


async def test_a_handoff_commits_while_a_block_its_request_stored_is_moving(tmp_path):
    """The handoff's commit releases the request in prefill, with the block it stored and
    never committed; the operator's eviction was demoting that block as the copies ended.
    The release was refused (blocks in transit) half-way through the commit: the handoff
    failed, and the request was left in both pools, its decode entry no one's, its id
    taken there for good. The commit waits for the demotion."""
    (tmp_path / "kvd.toml").write_text(CRAWLING_HOST)
    with LocalKvd("--config", str(tmp_path / "kvd.toml"), workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=20) as c, \
                AsyncClient(kvd.target, timeout_s=20) as operator:
            prefill = MappedPool(await c.export_pool("prefill"))
            decode = MappedPool(await c.export_pool("decode"))
            try:
                await c.admit("r", 16 * 2, 16, pool="prefill", handoff_pool="decode")
                own = await fill(c, prefill, "r", 2, seed=8)
                _write(prefill, (await c.store("r", "m", [b"k"])).handles, seed=9)
                await c.keep_alive()  # written: its pages are no longer the engine's
                # r's first block goes to host at once, spending the host link's burst.
                (first,) = (await operator.evict(1, pool="prefill")).evicted
                assert (first.block_index, first.to_tier) == (0, pb.TIER_HOST)
                handing = asyncio.ensure_future(c.handoff_all("r"))
                await copying(c)
                # r's blocks are the handoff's: k alone can go, 2 s on the host link; r's
                # second block crosses to decode in half a second.
                evicting = asyncio.ensure_future(operator.evict(1, pool="prefill"))
                done = await handing
                assert done.done and done.pool == "decode"
                assert [hashlib.sha256(decode.page(h).tobytes()).hexdigest()
                        for h in done.handles] == own
                assert len((await evicting).evicted) == 1
                assert [(r.request_id, r.pool) for r in await c.list_requests()] == [
                    ("r", "decode")]
                assert (await stats(c, "prefill")).num_demotions == 2
                assert (await c.self_check()).ok
                await c.release("r")
                for pool in ("prefill", "decode"):
                    assert (await stats(c, pool)).num_requests == 0
                await c.admit("r", 16, 0, pool="prefill", handoff_pool="decode")  # free again
            finally:
                prefill.close()
                decode.close()


async def test_a_rolled_back_handoff_leaves_decode_while_a_victim_of_its_moves(tmp_path):
    """A handoff carrying a prefix block is cancelled while it copies it; as its carry ends,
    its holds on the request's pages in decode end, and an allocation waiting there for room
    takes one of them as its victim, whose demotion begins at once. The rollback's release
    in decode was then refused (blocks in transit): the request stayed there, no one's,
    its id taken there for good. The rollback waits for the demotion."""
    config = CRAWLING_HOST.replace('device_pages = 8\nhost_pages = 8',
                                   'device_pages = 2\nhost_pages = 8')
    (tmp_path / "kvd.toml").write_text(config)
    with LocalKvd("--config", str(tmp_path / "kvd.toml"), workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=20) as c, \
                AsyncClient(kvd.target, timeout_s=20) as other:
            prefill = MappedPool(await c.export_pool("prefill"))
            try:
                await c.admit("r", 16 * 2, 0, pool="prefill", handoff_pool="decode")
                _write(prefill, (await c.store("r", "m", [b"p"])).handles, seed=12)
                await c.commit("r", "m", [b"p"])
                own = await fill(c, prefill, "r", 1, seed=13)
                await other.admit("y", 16, 0, pool="decode")
                stream = c.handoff("r")
                async for progress in stream:
                    if progress.blocks_done == 1:
                        break  # r's block is in decode; the prefix block crosses next
                await asyncio.sleep(0.1)  # both decode pages are the handoff's now
                growing = asyncio.ensure_future(other.allocate("y", 1))
                await asyncio.sleep(0.1)
                assert not growing.done(), "y took a page the handoff holds"
                await stream.aclose()  # the caller goes away: the handoff rolls back
                assert len((await growing).handles) == 1
                assert (await stats(c, "decode")).num_demotions == 1  # y's victim, r's
                for _ in range(100):
                    if (await stats(c, "decode")).num_requests == 1:
                        break
                    await asyncio.sleep(0.05)
                assert [(r.request_id, r.pool) for r in await c.list_requests()] == [
                    ("r", "prefill"), ("y", "decode")]
                assert (await c.self_check()).ok
                assert await digests_of(c, prefill, "r") == own  # whole in prefill
                await c.release("r")
                await other.release("y")
                await c.admit("r", 16, 0, pool="decode")  # the id is free there again
            finally:
                prefill.close()
