"""A request released, or its blocks freed, by someone else (another of the tenant's clients,
an operator, a lapsed lease) while its engine holds what a Step handed it: the engine may
still be writing those pages (its forward pass is under way), so no other request gets them
until the engine's next message, or until its holds lapse. Before, the release or free gave
them away at once, and the engine's writes landed in the next request's blocks."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvd.config import Config, PoolConfig
from kvd.core.clock import FakeClock
from kvd.node import Node
from kvd.service.auth import Caller
from kvd.service.streams import Streams
from kvd_client import AsyncClient, pb
from kvd_client.arena import MappedPool
from kvd_client.client import intent_update
from kvd_loadgen.local import LocalKvd

from .conftest import slow_link_kvd

DEVICE_PAGES = 8  # the kvd fixture's device tier (conftest.SMALL)
HOLD_S = 1.0  # its hold_s (the default)


def _bytes(seed: int, n: int, page_bytes: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, page_bytes, np.uint8) for _ in range(n)]


async def _handed(engine: AsyncClient, stream, how: str) -> list[pb.PageHandle]:
    """The engine's request "mine" fills the device tier; its stream's last message handed
    it every page: allocated them, or (`read`) a later step read them."""
    await engine.admit("mine", 16 * DEVICE_PAGES)
    handles = list((await stream.step(allocations=[("mine", DEVICE_PAGES)])).allocated)
    assert len(handles) == DEVICE_PAGES
    if how == "read":
        reply = await stream.step(read_all=["mine"])
        assert not reply.errors, reply.errors
    return handles


async def _another_request_waits(other: AsyncClient) -> asyncio.Future:
    """Another request allocates the device tier's worth: the only room is the pages of the
    blocks that went (released or freed), which their engine may still write, so it waits
    for them. Returns the
    allocation, still under way."""
    await other.admit("theirs", 16 * DEVICE_PAGES)
    theirs = asyncio.ensure_future(other.allocate("theirs", DEVICE_PAGES))
    await asyncio.sleep(0.3)
    assert not theirs.done(), (
        "pages that went while their engine held them went to another request: "
        f"{[h.page_index for h in (await theirs).handles]}")
    return theirs


@pytest.mark.parametrize("how", ["allocated", "read"])
@pytest.mark.parametrize("gone", ["released", "freed"])
async def test_pages_that_go_under_their_engine_wait_for_its_next_message(kvd, how, gone):
    """The request released, or its blocks freed, by another of the tenant's clients (a
    router, a second process of the engine, an operator) while the engine's forward pass
    writes them. Before, the free gave the pages to the next allocation at once, of any
    tenant, and the engine's writes landed in that request's blocks."""
    async with AsyncClient(kvd.target, timeout_s=10) as engine, \
            AsyncClient(kvd.target, timeout_s=10) as other:
        arena = MappedPool(await engine.export_pool())
        try:
            async with engine.step_stream() as stream:
                mine = await _handed(engine, stream, how)
                if gone == "released":
                    await other.release("mine")
                else:
                    freed = await other.free("mine", [h.block_index for h in mine])
                    assert freed.num_freed == DEVICE_PAGES
                theirs = await _another_request_waits(other)
                stats = (await other.pool_stats()).pools[0]
                assert stats.held_pages == DEVICE_PAGES  # shown as held: engines hold them
                for h, data in zip(mine, _bytes(1, DEVICE_PAGES, arena.page_bytes)):
                    arena.write(h, data)  # the engine's forward pass writes them
                assert not (await stream.step()).errors  # its next message: done with them
                handles = (await theirs).handles
            assert sorted(h.page_index for h in handles) == sorted(h.page_index for h in mine)
            wrote = _bytes(2, DEVICE_PAGES, arena.page_bytes)
            for h, data in zip(handles, wrote):
                arena.write(h, data)
            for h, data in zip(handles, wrote):
                assert arena.read(h).tobytes() == data.tobytes(), f"block {h.block_index}"
        finally:
            arena.close()
        check = await other.self_check()
        assert check.ok, list(check.problems)


async def test_blocks_an_engine_frees_itself_are_free_at_once(kvd):
    """The engine's own free ends its holds first (its next message): nothing is kept."""
    async with AsyncClient(kvd.target, timeout_s=2) as engine:
        async with engine.step_stream() as stream:
            mine = await _handed(engine, stream, "read")
            reply = await stream.step(frees=[("mine", [h.block_index for h in mine])])
            assert not reply.errors, reply.errors
            await engine.admit("next", 16 * DEVICE_PAGES)
            reply = await stream.step(allocations=[("next", DEVICE_PAGES)])
            assert not reply.errors, reply.errors
            assert len(reply.allocated) == DEVICE_PAGES


async def test_a_released_requests_stored_blocks_wait_for_its_engines_next_call(kvd):
    """The engine stored prefix blocks (fresh ones: it writes them, then commits) and is
    writing them when someone else releases its request: they were never committed, so
    they go with it, but their pages wait for the engine's next call like its own blocks'."""
    keys = [bytes([i]) * 16 for i in range(DEVICE_PAGES)]
    async with AsyncClient(kvd.target, timeout_s=10) as engine, \
            AsyncClient(kvd.target, timeout_s=10) as other:
        arena = MappedPool(await engine.export_pool())
        try:
            await engine.admit("mine", 16 * DEVICE_PAGES)
            stored = await engine.store("mine", "ns", keys)
            assert list(stored.fresh) == [True] * DEVICE_PAGES
            mine = list(stored.handles)
            await other.release("mine")  # while the engine writes the blocks
            theirs = await _another_request_waits(other)
            for h, data in zip(mine, _bytes(1, DEVICE_PAGES, arena.page_bytes)):
                arena.write(h, data)  # the engine's late writes
            await engine.keep_alive()  # its next call: it is done with them
            handles = (await theirs).handles
            assert sorted(h.page_index for h in handles) == sorted(h.page_index for h in mine)
            assert (await engine.lookup("ns", keys)).num_hit == 0  # never committed
        finally:
            arena.close()
        check = await other.self_check()
        assert check.ok, list(check.problems)


async def test_a_released_requests_pages_come_free_when_its_engines_holds_lapse(kvd):
    """An engine that never sends again (stalled, or gone without closing its stream) keeps
    the pages no longer than its holds last (hold_s, 1 s by default)."""
    async with AsyncClient(kvd.target, timeout_s=10) as engine, \
            AsyncClient(kvd.target, timeout_s=10) as other:
        async with engine.step_stream() as stream:
            await engine.admit("mine", 16 * DEVICE_PAGES)
            sent = time.monotonic()  # the holds begin after this, and last hold_s
            reply = await stream.step(allocations=[("mine", DEVICE_PAGES)])
            assert len(reply.allocated) == DEVICE_PAGES
            await other.release("mine")
            await other.admit("theirs", 16 * DEVICE_PAGES)
            handles = (await other.allocate("theirs", DEVICE_PAGES)).handles
            held = time.monotonic() - sent
            assert len(handles) == DEVICE_PAGES
            assert held >= HOLD_S, f"got the engine's pages {held:.2f} s after it was handed them"
            assert not (await stream.step()).errors  # the engine, back, finds nothing amiss
        check = await other.self_check()
        assert check.ok, list(check.problems)


async def test_an_engines_own_release_frees_its_pages_at_once(kvd):
    """The engine's own release ends its holds first (its next message): nothing is kept,
    and the next request gets the pages without waiting."""
    async with AsyncClient(kvd.target, timeout_s=2) as engine:
        async with engine.step_stream() as stream:
            await _handed(engine, stream, "allocated")
            reply = await stream.step(releases=["mine"])
            assert not reply.errors, reply.errors
            await engine.admit("next", 16 * DEVICE_PAGES)
            reply = await stream.step(allocations=[("next", DEVICE_PAGES)])
            assert not reply.errors, reply.errors
            assert len(reply.allocated) == DEVICE_PAGES
        check = await engine.self_check()
        assert check.ok, list(check.problems)


async def test_a_queued_request_goes_in_when_the_release_leaves_it_kept_pages(tmp_path):
    """Under a fair policy, admission counts a page's room where it will be free: the
    released request's kept pages are, once the engine calls again, and the request
    waiting for them is admitted at the release, not left queued with nothing to run its
    line again (the engine's next call makes no admission decision)."""
    args = ("--model", "tiny", "--block-tokens", "16", "--device-pages", "8",
            "--host-pages", "0", "--admission", "reservation", "--policy", "fair")
    with LocalKvd(*args, workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as engine, \
                AsyncClient(kvd.target, timeout_s=10) as other:
            async with engine.step_stream() as stream:
                await engine.admit("mine", 16 * 4)
                assert len((await stream.step(allocations=[("mine", 4)])).allocated) == 4
                # The rest of the device: pinned, so the only room left is "mine"'s.
                await other.admit("pinned", 16 * 4)
                assert len((await other.allocate("pinned", 4)).handles) == 4
                await other.update_intents([intent_update("pinned", i, pin_requested=True)
                                            for i in range(4)])
                await other.admit("next", 16 * 4)
                assert await _state(other, "next") == "queued"
                await other.release("mine")
                assert await _state(other, "next") == "admitted"
                await stream.step()  # the engine is done with the released pages
                assert len((await other.allocate("next", 4)).handles) == 4
            check = await other.self_check()
            assert check.ok, list(check.problems)


async def _state(client: AsyncClient, rid: str) -> str:
    return next(r.state for r in await client.list_requests() if r.request_id == rid)


# On a slow_link_kvd whose host link moves two 8 KiB pages a second: a read that brings
# LONG_READ blocks in takes about 3 s (one page goes at once, the link's burst), twice
# LONG_HOLD_S.
LONG_HOLD_S = 1.5
LONG_READ = 7


@pytest.mark.parametrize("call", ["Access", "Step"])
async def test_what_a_read_longer_than_hold_s_hands_out_stays_held_after_its_reply(
        tmp_path, call):
    """A read that waits seconds for its copies (a slow link; a big read) holds its blocks
    from the moment it is planned. Its holds lapsed hold_s from then: a unary call's while
    it still waited (nothing kept them from lapsing), so the reply handed out pages
    nobody held; a step's at kvd's next look after the reply. Another call could take the
    pages while the engine read them. What a call hands out is held for hold_s from its
    reply."""
    with slow_link_kvd(tmp_path, bandwidth="16KiB/s",
                       server=f"hold_s = {LONG_HOLD_S}\n") as kvd:
        async with AsyncClient(kvd.target, timeout_s=20) as engine, \
                AsyncClient(kvd.target, timeout_s=20) as operator:
            await engine.admit("r", 16 * LONG_READ)
            assert len((await engine.allocate("r", LONG_READ)).handles) == LONG_READ
            await engine.keep_alive()  # written: the engine is done with the pages
            assert len((await operator.evict(LONG_READ)).evicted) == LONG_READ
            async with engine.step_stream() as stream:
                if call == "Access":
                    reply = await engine.access("r")
                    handed = reply.handles
                else:
                    reply = await stream.step(accesses=[("r", list(range(LONG_READ)))])
                    assert not reply.errors, reply.errors
                    handed = reply.relocated
                answered = time.monotonic()
                assert reply.stall_us > 2 * LONG_HOLD_S * 1e6 * 0.9  # the link took so long
                assert len(handed) == LONG_READ
                assert (await operator.pool_stats()).pools[0].held_pages == LONG_READ
                # kvd looks for stale holds once a second: it has looked since the reply.
                await asyncio.sleep(1.05 - (time.monotonic() - answered))
                assert (await operator.pool_stats()).pools[0].held_pages == LONG_READ
                await asyncio.sleep(LONG_HOLD_S + 1.1 - (time.monotonic() - answered))
                assert (await operator.pool_stats()).pools[0].held_pages == 0  # lapsed
            check = await operator.self_check()
            assert check.ok, list(check.problems)


async def test_holds_lapse_hold_s_after_their_calls_reply_and_not_before():
    """In the node, on a clock moved by hand: what a call holds does not lapse while the call
    is under way however long it waits, and lapses hold_s after its reply."""
    clock = FakeClock()
    node = Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=(
        PoolConfig(page_bytes=4096, device_pages=8, host_pages=8),)), clock)
    try:
        await node.admit_async("r", tenant="", pool="", prompt_tokens=64, output_tokens=0,
                               priority=0)
        await node.allocate("r", 4, holder="h")
        holds = node.runtime("default").pool.pages.holds
        clock.advance(10.0)  # the call waits for copies, or for room for more
        assert node.lapse_holds(1.0) == 0 and holds.count_of("h") == 4
        node.answered("h")  # its reply
        clock.advance(0.9)
        assert node.lapse_holds(1.0) == 0 and holds.count_of("h") == 4
        clock.advance(0.2)
        assert node.lapse_holds(1.0) == 1 and not holds.has("h")
    finally:
        await node.aclose()


class _Engine:
    """An engine's identity for a handler called in process."""

    generation = 0

    def identify(self, context) -> Caller:
        return Caller(tenant="t", admin=False, lease="t/engine")


class _Writing:
    """A Handoff call's context whose writes of progress wait until the call is cancelled
    (an engine that went away with the progress unread)."""

    def __init__(self) -> None:
        self.written: list[pb.HandoffProgress] = []

    async def write(self, reply: pb.HandoffProgress) -> None:
        self.written.append(reply)
        await asyncio.get_running_loop().create_future()

    async def abort(self, code, details) -> None:
        raise AssertionError(f"aborted: {code} {details}")


async def test_what_a_handoff_cancelled_after_its_commit_holds_lapses():
    """The engine goes away while the handoff's progress is written, and the copy commits
    meanwhile: the last message, which hands out the blocks in the decode pool, is never
    written, but those blocks are held for the engine. Before, they stayed held for good
    (until the client's next call, which a client gone may never make): the hold counted
    from a reply that never came. Now they lapse hold_s after the call ends."""
    pools = tuple(PoolConfig(name=name, page_bytes=65536, device_pages=16, host_pages=16)
                  for name in ("default", "decode"))
    node = Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=pools))
    try:
        engine = _Engine().identify(None)
        rid = engine.ns + "r"  # as kvd keeps the tenant's request "r"
        node.admit(rid, tenant="t", pool="", prompt_tokens=16 * 8, output_tokens=0,
                   priority=0, handoff_pool="decode")
        await node.allocate(rid, 8)  # two chunks of the link: progress before the last
        context = _Writing()
        call = asyncio.ensure_future(Streams(node, _Engine()).handoff(
            pb.HandoffRequest(request_id="r"), context))
        for _ in range(5000):  # its copies run in kvd's worker threads
            await asyncio.sleep(0.001)
            if node.runtime_of(rid).pool.name == "decode" and context.written:
                break
        else:
            raise AssertionError("the handoff did not commit in 5 s")
        assert context.written and not any(p.done for p in context.written)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        holds = node.runtime("decode").pool.pages.holds
        holder = engine.holder
        assert holds.count_of(holder) == 8  # nothing may move them while the engine reads
        await asyncio.sleep(0.01)
        assert node.lapse_holds(0.005) == 1, f"held for good: {holds.since()}"
        assert not holds.has(holder)
    finally:
        await node.aclose()
