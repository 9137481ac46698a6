"""A call naming many blocks (an allocation, a free, a release, a store, a commit or a load
of shared prefix keys, the reply that hands out their pages, and the holds that end when its
engine calls again) is done a slice at a time, with kvd's loop served between slices:
another tenant's call goes on while it runs, rather than wait for all of it (a third of a
second for a 1M-token request's 65,536 blocks). And it keeps what a call promises whole:
refused whole when it may not be done, a bad index or key changes nothing, what another
call changes between slices is neither lost nor done twice, and an allocation, a store or
a load that fails or is cancelled part way gives back what it made.

The order of events, not time, says whether the loop was served: the other tenant's call is
started once the big one has begun, and must be answered while the big one is not done."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from kvd.config import Config, PoolConfig, TenantConfig
from kvd.core import errors
from kvd.core.blocks import TierKind
from kvd.core.errors import NoVictims
from kvd.core.intent import IntentChange
from kvd.node import Node
from kvd.service.auth import Authenticator
from kvd.service.memory import MemoryService
from kvd.shared import SharedBlocks
from kvd_api.v1 import kvd_pb2 as pb

PAGE = 64
SLICE = 16
BIG = 8 * SLICE


def _config(device_pages: int = 4 * BIG, host_pages: int = 4 * BIG, a_guaranteed: int = 0,
            **tenant_b) -> Config:
    return Config(socket="", tcp="127.0.0.1:0", slice_blocks=SLICE, hold_s=60.0,
                  pools=(PoolConfig(page_bytes=PAGE, block_tokens=1, device_pages=device_pages,
                                    host_pages=host_pages, policy="lru",
                                    device_backend="host", admission="reservation"),),
                  tenants=(TenantConfig("a", token="ta", guaranteed=a_guaranteed),
                           TenantConfig("b", token="tb", **tenant_b)))


@pytest.fixture
async def node():
    node = Node(_config())
    yield node
    await node.aclose()


async def _admit(node: Node, rid: str, tenant: str, blocks: int) -> None:
    result = await node.admit_async(rid, tenant=tenant, pool="", prompt_tokens=blocks,
                                    output_tokens=0, priority=0)
    assert result.decision.name == "ADMITTED", result


async def _first_slice_done(node: Node, rid: str) -> None:
    """Once a big store or load of rid's has checked its keys (a slice at a time too) and
    done its first slice: the loop is served while the rest waits."""
    for _ in range(1000):
        if node.request(rid).shared:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{rid}'s call made nothing in 1,000 turns of the loop")


async def _check(node: Node) -> None:
    await asyncio.sleep(0.01)  # holds ending a slice at a time are done
    assert await node.self_check() == []


async def _others_call_goes_on(node: Node, big) -> None:
    """Start `big` (a coroutine), let it begin, then make tenant b's small call: answered
    while the big call is not done. Returns once both are."""
    task = asyncio.ensure_future(big)
    await asyncio.sleep(0)  # the big call has begun: it holds the loop until it yields
    blocks, _, _ = await node.access("b0", None, holder="b")
    assert [b.tier for b in blocks] == [TierKind.DEVICE] * 4
    assert not task.done(), "the other tenant's call waited for all of the big one"
    return await task


async def _with_small_request(node: Node) -> None:
    await _admit(node, "b0", "b", 4)
    await node.allocate("b0", 4, holder="b")


async def _beside_a_big_request(node: Node) -> None:
    """Tenant b's small request, and tenant a's request of BIG blocks, held for a."""
    await _with_small_request(node)
    await _admit(node, "big", "a", BIG)
    await node.allocate("big", BIG, holder="a")


async def test_a_big_allocation_leaves_the_loop_to_others_and_hands_out_every_block(node):
    await _with_small_request(node)
    await _admit(node, "big", "a", BIG)
    blocks, _ = await _others_call_goes_on(node, node.allocate("big", BIG, holder="a"))
    assert [b.index for b in blocks] == list(range(BIG))
    assert len({b.page for b in blocks}) == BIG
    assert all(b.tier is TierKind.DEVICE and b.held for b in blocks)
    await _check(node)


async def test_a_big_free_leaves_the_loop_to_others_and_frees_each_block(node):
    await _beside_a_big_request(node)
    free = node.runtime("default").pool.device.num_free
    freed = await _others_call_goes_on(node, node.free("big", list(range(0, BIG, 2))))
    assert freed == BIG // 2
    req = node.request("big")
    assert [b.index for b in req.live] == list(range(1, BIG, 2))
    node.end_holds("a")
    assert node.runtime("default").pool.device.num_free == free + BIG // 2
    await _check(node)


async def test_a_big_release_leaves_the_loop_to_others_and_gives_back_every_page(node):
    await _beside_a_big_request(node)
    node.end_holds("a")
    await asyncio.sleep(0.01)
    free = node.runtime("default").pool.device.num_free
    freed, _ = await _others_call_goes_on(node, node.release("big"))
    assert freed == BIG
    assert "big" not in node.request_index
    assert node.runtime("default").pool.device.num_free == free + BIG
    await _check(node)


async def test_a_holders_many_holds_end_a_slice_at_a_time_and_all_of_them_end(node):
    await _beside_a_big_request(node)
    holds = node.runtime("default").pool.pages.holds
    node.end_holds("a")  # the engine called again (b holds its 4 blocks)
    assert 4 < holds.count <= 4 + BIG - SLICE, "ended whole, or not begun"
    assert await node.self_check() == []  # sound between slices too
    blocks, _, _ = await node.access("b0", None, holder="b")
    assert holds.count > 4, "the other tenant's call waited for all of them"
    await asyncio.sleep(0.01)
    assert holds.count == 4  # b's only: every one of a's blocks went back to the policy
    pool = node.runtime("default").pool
    assert all(b in pool.policy for b in node.request("big").live)
    await _check(node)


async def test_holds_ending_a_slice_at_a_time_serve_a_call_waiting_for_room():
    """The device full of blocks tenant a holds: b's allocation waits for room, and gets it
    as a's holds end, slice by slice, once a calls again."""
    node = Node(_config(device_pages=BIG, host_pages=BIG))
    try:
        await _admit(node, "big", "a", BIG)
        await node.allocate("big", BIG, holder="a")
        await _admit(node, "b1", "b", 2)
        waiting = asyncio.ensure_future(node.allocate("b1", 2, holder="b"))
        await asyncio.sleep(0.01)
        assert not waiting.done(), "took a page a holder holds"
        node.end_holds("a")
        blocks, _ = await asyncio.wait_for(waiting, 5)
        assert [b.tier for b in blocks] == [TierKind.DEVICE] * 2
        await _check(node)
    finally:
        await node.aclose()


async def test_an_operators_evict_counts_holds_that_are_ending(node):
    await _admit(node, "big", "a", BIG)
    await node.allocate("big", BIG, holder="a")
    node.end_holds("a")
    moves = await node.evict("default", BIG)  # all of them: their holder called again
    assert len(moves) == BIG
    await _check(node)


@pytest.mark.parametrize("why", ["cap", "limit", "pins", "device"])
async def test_a_big_allocation_that_may_not_be_made_is_refused_whole(why):
    tenant_b = {"cap": {"max_request_pages": BIG}, "limit": {"limit": BIG + 4}}.get(why, {})
    # Tenant a's guarantee: b's pins may take 3 * BIG of the 4 * BIG device pages.
    node = Node(_config(a_guaranteed=BIG, **tenant_b))
    try:
        await _admit(node, "b0", "b", 4)
        await node.allocate("b0", 4, holder="b")
        await _admit(node, "big", "b", BIG)
        pool = node.runtime("default").pool
        free = pool.device.num_free
        num, intent = {"cap": (BIG + 1, None), "limit": (BIG + 1, None),
                       "pins": (3 * BIG + 1, {"pin_requested": True}),
                       "device": (4 * BIG + 1, None)}[why]
        with pytest.raises(errors.KvdError):
            await node.allocate("big", num, intent, holder="b")
        assert node.request("big").live == [], "made part of a call it refused"
        assert pool.device.num_free == free
        await _check(node)
    finally:
        await node.aclose()


@pytest.mark.parametrize("call", ["allocate", "store"])
async def test_a_big_call_refused_part_way_gives_back_what_it_made(call):
    """Between two of a's slices of pinned blocks (an allocation's, a store's of new keys)
    tenant b pins the rest of the device: a's next slice's pins would overcommit it, and
    what a's slices made goes back (its engine was told of none of it): the blocks, a
    store's uses and names, and their pages, at once."""
    node = Node(_config(device_pages=2 * BIG, host_pages=4 * BIG))
    try:
        await _admit(node, "big", "a", 2 * BIG)
        await _admit(node, "b1", "b", 2 * BIG)
        pool = node.runtime("default").pool
        pin = {"pin_requested": True}
        keys = _keys(2 * BIG)
        if call == "allocate":
            task = asyncio.ensure_future(node.allocate("big", 2 * BIG, pin, holder="a"))
            await asyncio.sleep(0)  # a's first slice
            made = len(node.request("big").live)
            assert 0 < made < 2 * BIG
        else:
            task, made = await _storing_part_way(node, keys, pin)
        await node.allocate("b1", 2 * BIG - made, pin, holder="b")
        with pytest.raises(errors.KvdError, match="given back"):
            await task
        assert node.request("big").live == [] and node.request("big").shared == []
        assert node.shared.lookup("default", NS, keys[:1]) == []
        assert pool.device.num_free == made  # at once: nobody was told of them
        assert pool.num_pinned == 2 * BIG - made
        await _check(node)
    finally:
        await node.aclose()


@pytest.mark.parametrize("call", ["allocate", "store"])
async def test_a_big_call_whose_next_slice_would_wait_for_room_is_made_whole(call):
    """Between two of a's slices (of an allocation, of a store of new keys) tenant b takes
    the rest of the device with pinned blocks: a would wait for room holding what it made.
    It gives that back and asks for all of it at once, which fails at once, as it would
    have had it come first."""
    node = Node(_config(device_pages=2 * BIG, host_pages=4 * BIG))
    try:
        await _admit(node, "big", "a", 2 * BIG)
        await _admit(node, "b1", "b", 2 * BIG)
        pool = node.runtime("default").pool
        if call == "allocate":
            task = asyncio.ensure_future(node.allocate("big", 2 * BIG, holder="a"))
            await asyncio.sleep(0)
            made = len(node.request("big").live)
        else:
            task, made = await _storing_part_way(node, _keys(2 * BIG))
        await node.allocate("b1", 2 * BIG - made, {"pin_requested": True}, holder="b")
        node.end_holds("b")  # b's engine wrote them: pinned, they stay
        with pytest.raises(errors.ResourceExhausted, match="pinned"):
            await asyncio.wait_for(task, 5)
        assert node.request("big").live == [] and node.request("big").shared == []
        assert pool.device.num_free == made
        await _check(node)
    finally:
        await node.aclose()


async def test_two_big_allocations_on_a_device_too_small_for_both_each_get_theirs():
    """Made a slice at a time side by side, each would come to hold half the device and wait
    for the other's holds to end, which end only at the other's next call, after its
    allocation: until the holds lapsed. The one that would wait gives back and waits whole;
    the other finishes, its engine calls again, and the first gets its pages."""
    node = Node(_config(device_pages=2 * BIG, host_pages=4 * BIG))
    try:
        for rid, tenant in (("a1", "a"), ("b1", "b")):
            await _admit(node, rid, tenant, 3 * BIG // 2)

        async def engine(rid: str, holder: str):
            blocks, _ = await node.allocate(rid, 3 * BIG // 2, holder=holder)
            assert all(b.tier is TierKind.DEVICE for b in blocks)
            node.end_holds(holder)  # it wrote them, and calls again
            return len(blocks)

        assert await asyncio.wait_for(asyncio.gather(engine("a1", "a"), engine("b1", "b")),
                                      10) == [3 * BIG // 2] * 2
        await _check(node)
    finally:
        await node.aclose()


async def test_a_big_allocation_cancelled_part_way_gives_back_what_it_made(node):
    await _admit(node, "big", "a", BIG)
    task = asyncio.ensure_future(node.allocate("big", BIG, holder="a"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert 0 < len(node.request("big").live) < BIG
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert node.request("big").live == []
    await _check(node)


@pytest.mark.parametrize("bad", ["out_of_range", "freed", "duplicate"])
async def test_a_big_free_naming_a_bad_index_frees_nothing(node, bad):
    await _admit(node, "big", "a", BIG)
    await node.allocate("big", BIG, holder="a")
    await node.free("big", [BIG - 1])
    indices = list(range(BIG - 1)) + {"out_of_range": [BIG], "freed": [BIG - 1],
                                      "duplicate": [0]}[bad]
    with pytest.raises(errors.KvdError):
        await node.free("big", indices)
    assert len(node.request("big").live) == BIG - 1
    await _check(node)


async def test_a_big_free_racing_another_free_of_the_same_blocks_frees_each_once(node):
    task = await _freeing_all(node)
    assert await node.free("big", list(range(BIG - SLICE, BIG))) == SLICE  # the last slice
    assert await task == BIG - SLICE
    assert node.request("big").live == []
    await _check(node)


async def test_a_big_free_racing_a_release_ends_with_the_request(node):
    task = await _freeing_all(node)
    await node.release("big")
    assert 0 < await task < BIG
    assert "big" not in node.request_index
    await _check(node)


async def _reading_part_way(node: Node, indices: list[int]) -> asyncio.Task:
    """A read of tenant a's big request by these indices, under way: checked whole, its
    first slice read and held for holder "r"."""
    holds = node.runtime("default").pool.pages.holds
    task = asyncio.ensure_future(node.access("big", indices, holder="r"))
    for _ in range(1000):
        await asyncio.sleep(0)
        if holds.has("r"):
            assert not task.done(), "read whole"
            return task
    raise AssertionError("the read read nothing in 1,000 turns of the loop")


async def test_a_big_read_by_index_leaves_the_loop_to_others_and_reads_every_block(node):
    await _beside_a_big_request(node)
    node.end_holds("a")
    pool = node.runtime("default").pool
    accesses = pool.counters.num_accesses
    indices = list(range(BIG))[::-1]
    blocks, stall_s, promoted = await _others_call_goes_on(
        node, node.access("big", indices, holder="r"))
    req = node.request("big")
    assert blocks == [req.blocks[i] for i in indices]
    assert promoted == 0 and stall_s == 0
    assert pool.pages.holds.count_of("r") == BIG
    assert pool.counters.num_accesses == accesses + 4 + BIG  # b's read of 4, then a's
    await _check(node)


@pytest.mark.parametrize("bad", ["out of range", "freed", "twice"])
async def test_a_big_read_naming_a_bad_index_reads_nothing(node, bad):
    await _admit(node, "big", "a", BIG)
    await node.allocate("big", BIG, holder="a")
    node.end_holds("a")
    await node.free("big", [BIG - 1])
    indices = list(range(BIG - 1)) + [{"out of range": BIG, "freed": BIG - 1, "twice": 0}[bad]]
    pool = node.runtime("default").pool
    accesses = pool.counters.num_accesses
    why = {"out of range": "out of range", "freed": "was freed", "twice": "duplicate"}[bad]
    with pytest.raises(errors.KvdError, match=why):
        await node.access("big", indices, holder="r")
    assert pool.counters.num_accesses == accesses
    assert not pool.pages.holds.has("r")
    await _check(node)


async def _big_written(node: Node):
    """Tenant a's request of BIG blocks, each page written with its block's byte, its
    engine done with them (holds ended); the device tier's pages."""
    await _admit(node, "big", "a", BIG)
    blocks, _ = await node.allocate("big", BIG, holder="a")
    device = node.runtime("default").arenas["device"].pages
    for b in blocks:
        device[b.page] = np.full(PAGE, b.index % 251, np.uint8)
    node.end_holds("a")
    return device


async def test_a_big_read_of_blocks_off_the_device_brings_every_one_in_with_its_bytes(node):
    device = await _big_written(node)
    moved = await node.evict("default", BIG // 2)
    assert len(moved) == BIG // 2
    read, _, promoted = await node.access("big", list(range(BIG)), holder="r")
    assert promoted == BIG // 2
    assert all(b.tier is TierKind.DEVICE and b.held for b in read)
    for b in read:
        assert (device[b.page] == b.index % 251).all()
    await _check(node)


async def test_a_big_read_whose_later_blocks_go_out_meanwhile_brings_them_in(node):
    device = await _big_written(node)
    task = await _reading_part_way(node, list(range(BIG)))
    # The next slice's blocks go out, the oldest not held (those read are, for the read's
    # holder): one slice, evicted whole.
    moved = await node.evict("default", SLICE)
    assert {m.block.index for m in moved} == set(range(SLICE, 2 * SLICE))
    read, _, promoted = await task
    assert [b.index for b in read] == list(range(BIG))
    assert promoted == SLICE
    assert all(b.tier is TierKind.DEVICE and b.held for b in read)
    for b in read:
        assert (device[b.page] == b.index % 251).all()
    await _check(node)


async def _read_a_slice_at_a_time(node: Node, indices: list[int] | None):
    """Holder r's read of tenant a's big request (by these indices, None: whole), checked
    to bring in a slice at most at each turn of the loop; the read's answer."""
    req = node.request("big")

    def brought() -> int:  # the request's blocks on the device or on their way there
        return sum(b.tier is TierKind.DEVICE or b.moving for b in req.live)

    task = asyncio.ensure_future(node.access("big", indices, holder="r"))
    seen = [brought()]
    while not task.done():
        await asyncio.sleep(0)
        seen.append(brought())
    steps = [after - before for before, after in zip(seen, seen[1:])]
    assert max(steps) <= SLICE, f"{max(steps)} blocks brought in at one turn of the loop"
    return await task


@pytest.mark.parametrize("named", ["by index", "whole"])
async def test_a_big_read_bringing_blocks_in_does_so_a_slice_at_a_time(node, named):
    """A read that brings many blocks in (its request's, demoted meanwhile) planned every
    promotion, and then completed every one, in one turn of the loop each: a third of a
    second for a 1M-token request. Each turn of the loop now brings in a slice at most, and
    the read still brings every block in with its bytes."""
    device = await _big_written(node)
    moved = await node.evict("default", BIG // 2)
    assert len(moved) == BIG // 2
    indices = list(range(BIG)) if named == "by index" else None
    read, _, promoted = await _read_a_slice_at_a_time(node, indices)
    assert promoted == BIG // 2
    assert [b.index for b in read] == list(range(BIG))
    assert all(b.tier is TierKind.DEVICE and b.held for b in read)
    for b in read:
        assert (device[b.page] == b.index % 251).all()
    await _check(node)


async def test_a_big_read_meeting_a_prefetch_under_way_waits_for_it_a_slice_at_a_time():
    """A prefetch of one of the blocks a big read brings in is under way when the read's
    first slice comes to it: the read waits for that copy, which ends whatever anyone
    holds, and goes on a slice at a time. (Went whole: the rest brought in at one turn.)"""
    config = _config()
    pool = dataclasses.replace(config.pools[0], link_bandwidth="64KiB/s", link_burst="64",
                               policy="intent")  # whose intents prefetch
    node = Node(dataclasses.replace(config, inline_copy_bytes=0, pools=(pool,)))
    try:
        device = await _big_written(node)
        assert len(await node.evict("default", BIG // 2)) == BIG // 2
        req = node.request("big")
        first = min(b.index for b in req.live if b.tier is TierKind.HOST)
        prefetch = asyncio.ensure_future(
            node.update_intents([IntentChange("big", first, {}, prefetch=True)]))
        for _ in range(100):
            await asyncio.sleep(0)
            if req.blocks[first].moving:
                break
        else:
            raise AssertionError("the prefetch did not start")
        read, _, _ = await _read_a_slice_at_a_time(node, None)
        await prefetch
        assert [b.index for b in read] == list(range(BIG))
        for b in read:
            assert b.tier is TierKind.DEVICE and (device[b.page] == b.index % 251).all()
        node.end_holds("r")
        await _check(node)
    finally:
        await node.aclose()


async def test_a_big_read_the_device_cannot_hold_beside_pinned_blocks_is_refused():
    """The read brings its blocks in a slice at a time, holding those on the device first:
    when the only room left is what it holds itself, it is refused (the device cannot hold
    it), not left waiting for its own holds to end, which end at its caller's next call."""
    node = Node(_config(device_pages=BIG + 4))
    try:
        device = await _big_written(node)
        assert len(await node.evict("default", BIG // 2)) == BIG // 2
        await _admit(node, "b0", "b", BIG // 2)  # the room the evict made, pinned
        await node.allocate("b0", BIG // 2, {"pin_requested": True}, holder="b")
        node.end_holds("b")  # written
        with pytest.raises(errors.ResourceExhausted, match="device"):
            await asyncio.wait_for(node.access("big", None, holder="r"), 5)
        node.end_holds("r")  # its caller's next call
        await node.release("b0")
        read, _, promoted = await node.access("big", None, holder="r")
        assert promoted == BIG // 2
        for b in read:
            assert (device[b.page] == b.index % 251).all()
        await _check(node)
    finally:
        await node.aclose()


async def test_an_operators_big_evict_leaves_the_loop_to_others_and_moves_every_byte(node):
    await _with_small_request(node)  # b's 4 blocks, held for b: not victims
    device = await _big_written(node)
    host = node.runtime("default").arenas["host"].pages
    moves = await _others_call_goes_on(node, node.evict("default", BIG))
    assert sorted(m.block.index for m in moves) == list(range(BIG))
    req = node.request("big")
    assert all(b.tier is TierKind.HOST and not b.moving for b in req.live)
    for b in req.live:
        assert (host[b.page] == b.index % 251).all()
    read, _, promoted = await node.access("big", None, holder="r")
    assert promoted == BIG
    for b in node.request("big").live:
        assert (device[b.page] == b.index % 251).all()
    await _check(node)


async def test_an_operators_big_evict_of_more_than_there_are_victims_moves_nothing(node):
    await _with_small_request(node)
    await _big_written(node)
    with pytest.raises(errors.ResourceExhausted, match="evictable"):
        await node.evict("default", BIG + 1)  # b's blocks are held
    assert all(b.tier is TierKind.DEVICE and not b.moving for b in node.request("big").live)
    await _check(node)


async def test_an_operators_big_evict_whose_victims_go_meanwhile_ends_short(node):
    await _big_written(node)
    task = asyncio.ensure_future(node.evict("default", BIG))
    for _ in range(1000):
        await asyncio.sleep(0)
        if any(b.tier is not TierKind.DEVICE or b.moving for b in node.request("big").live):
            break
    else:
        raise AssertionError("the evict moved nothing in 1,000 turns of the loop")
    assert not task.done(), "evicted whole"
    await node.release("big")
    moves = await task
    assert SLICE <= len(moves) < BIG
    await _check(node)


async def test_a_big_read_racing_a_release_ends_with_the_request(node):
    await _beside_a_big_request(node)
    node.end_holds("a")
    task = await _reading_part_way(node, list(range(BIG)))
    await node.release("big")  # its blocks freed a slice at a time, the last first
    try:
        read, _, _ = await task
    except errors.NotFound as exc:  # as a read done whole is answered once it went
        assert "released" in str(exc)
    else:  # done between the release's slices: what it freed first was not read
        assert SLICE <= len(read) < BIG
        assert [b.index for b in read] == list(range(len(read)))
    assert "big" not in node.request_index
    await _check(node)


async def test_a_big_read_whose_request_is_released_between_its_slices_is_not_found(
        node, monkeypatch):
    # The release done whole between the read's first slice and its second (the race
    # above leaves where it lands to the loop): the read answers as one done whole does
    # once its request went, NOT_FOUND, not FAILED_PRECONDITION.
    await _beside_a_big_request(node)
    node.end_holds("a")
    begin = node.begin_access
    slices = []

    async def begin_then_release(*args, **kwargs):
        started = await begin(*args, **kwargs)
        slices.append(len(args[1]))
        if len(slices) == 1:
            await node.release("big")
        return started

    monkeypatch.setattr(node, "begin_access", begin_then_release)
    with pytest.raises(errors.NotFound, match="released while it was read"):
        await node.access("big", list(range(BIG)), holder="r")
    assert slices == [SLICE]
    assert "big" not in node.request_index
    node.end_holds("r")
    await _check(node)


async def test_two_big_reads_each_holding_what_the_other_needs_both_go():
    # Two engines each read a request of 96 blocks, 64 of them on the device and 32 on the
    # host; the device holds 128. Each read holds its 64 first (the slices bringing the
    # rest in must not evict them), then needs 32 pages: only the other read's holds are
    # left. Neither call has answered, so neither's holds end or lapse: both waited for
    # ever. A read whose slice would wait for room holding what it read lets go of that
    # and reads whole, holding nothing while it waits, as a read done whole does.
    node = Node(_config(device_pages=BIG, host_pages=4 * BIG))
    try:
        size, off = 6 * SLICE, 2 * SLICE
        for rid, tenant in (("ra", "a"), ("rb", "b")):
            await _admit(node, rid, tenant, size)
        await node.allocate("rb", off)
        await node.evict("default", off)  # rb's first 32 to the host
        await node.allocate("ra", size)
        await node.evict("default", off)  # ra's first 32
        await node.allocate("rb", size - off)  # the device is full
        for rid in ("ra", "rb"):
            tiers = [b.tier for b in node.request(rid).live]
            assert tiers == [TierKind.HOST] * off + [TierKind.DEVICE] * (size - off)
        reads = {asyncio.ensure_future(node.access(rid, None, holder=rid))
                 for rid in ("ra", "rb")}
        done, reads = await asyncio.wait(reads, timeout=5,
                                         return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "both reads waited for the other's holds"
        first = done.pop().result()[0]
        assert len(first) == size
        assert all(b.tier is TierKind.DEVICE and not b.moving for b in first)
        node.end_holds(first[0].request.request_id)  # its engine's next call
        done, _ = await asyncio.wait(reads, timeout=5)
        assert done, "the second read did not go once the first's engine called again"
        second = done.pop().result()[0]
        assert len(second) == size and second[0].request is not first[0].request
        assert all(b.tier is TierKind.DEVICE and not b.moving for b in second)
        for rid in ("ra", "rb"):
            node.end_holds(rid)
        await _check(node)
    finally:
        await node.aclose()


async def _freeing_all(node: Node) -> asyncio.Task:
    """Tenant a's request of BIG blocks, and a free of all of them under way: checked whole,
    its first slice freed."""
    await _admit(node, "big", "a", BIG)
    await node.allocate("big", BIG, holder="a")
    task = asyncio.ensure_future(node.free("big", list(range(BIG))))
    while len(node.request("big").live) == BIG:
        await asyncio.sleep(0)
    return task


# ------------------------------------------------------------------ a big store of shared blocks

NS = "big-calls"


def _keys(n: int, chain: str = "k") -> list[bytes]:
    return [b"%s%d" % (chain.encode(), i) for i in range(n)]


async def test_a_big_store_leaves_the_loop_to_others_and_stores_every_key(node):
    await _with_small_request(node)
    await _admit(node, "big", "a", BIG)
    keys = _keys(BIG)
    blocks, fresh, _ = await _others_call_goes_on(
        node, node.shared.store("big", NS, keys, holder="a"))
    assert fresh == [True] * BIG, "a new key's block is the engine's to write"
    assert [b.name for b in blocks] == [(NS, k) for k in keys]
    assert len({b.page for b in blocks}) == BIG
    assert all(b.tier is TierKind.DEVICE and b.held for b in blocks)
    assert node.request("big").shared == blocks
    assert await node.shared.commit("big", NS, keys) == BIG
    # Another request's big store finds every one of them, written.
    await _admit(node, "again", "a", BIG)
    found, fresh, _ = await node.shared.store("again", NS, keys, holder="a2")
    assert found == blocks and fresh == [False] * BIG
    await _check(node)


async def test_a_big_store_whose_holds_end_part_way_holds_what_its_engine_writes(node):
    """Another call of the same holder ends its holds between two of a store's slices: every
    block the store then tells its engine to write is held for it again (else an eviction
    could give the page the engine is writing to another request)."""
    await _admit(node, "big", "a", BIG)
    task = asyncio.ensure_future(node.shared.store("big", NS, _keys(BIG), holder="a"))
    await _first_slice_done(node, "big")
    assert 0 < len(node.request("big").shared) < BIG
    node.end_holds("a")  # the holder's next call, while the store goes on
    blocks, fresh, _ = await task
    assert all(fresh)
    assert all(b.held for b in blocks), "told to write a block nobody holds"
    await _check(node)


async def test_two_big_stores_of_the_same_keys_side_by_side_share_every_block(node):
    """Their slices interleave: each finds what the other placed (not yet written, so both
    are told to write it: the same tokens, the same bytes), and no key gets two blocks."""
    keys = _keys(BIG)
    for rid in ("s1", "s2"):
        await _admit(node, rid, "a" if rid == "s1" else "b", BIG)
    (b1, f1, _), (b2, f2, _) = await asyncio.gather(
        node.shared.store("s1", NS, keys, holder="a"),
        node.shared.store("s2", NS, keys, holder="b"))
    assert b1 == b2 and len({id(b) for b in b1}) == BIG
    assert f1 == f2 == [True] * BIG
    assert await node.shared.commit("s2", NS, keys) == BIG
    await _check(node)


@pytest.mark.parametrize("why", ["duplicate", "pins", "cap"])
async def test_a_big_store_that_may_not_be_made_is_refused_whole(why):
    node = Node(_config(a_guaranteed=BIG, **({"max_request_pages": BIG}
                                             if why == "cap" else {})))
    try:
        await _admit(node, "big", "b", BIG)
        pool = node.runtime("default").pool
        free = pool.device.num_free
        keys, intent = {"duplicate": (_keys(BIG) + [b"k0"], None),
                        "pins": (_keys(3 * BIG + 1), {"pin_requested": True}),
                        "cap": (_keys(BIG + 1), None)}[why]
        with pytest.raises(errors.KvdError):
            await node.shared.store("big", NS, keys, holder="b", intent=intent)
        assert node.request("big").shared == [], "stored part of a call it refused"
        assert pool.device.num_free == free
        assert node.shared.lookup("default", NS, keys[:1]) == []
        await _check(node)
    finally:
        await node.aclose()


async def _storing_part_way(node: Node, keys: list[bytes], intent: dict | None = None):
    """Tenant a's store of these keys under way: its first slice stored; (task, blocks so
    far)."""
    task = asyncio.ensure_future(node.shared.store("big", NS, keys, holder="a",
                                                   intent=intent))
    await _first_slice_done(node, "big")
    made = len(node.request("big").shared)
    assert 0 < made < len(keys)
    return task, made


async def test_a_big_store_giving_back_keeps_what_another_request_uses_too():
    """What a's slices found, or placed and another request then stored too, stays with the
    blocks' other users when a's store gives back: only a's uses go."""
    node = Node(_config(device_pages=2 * BIG, host_pages=4 * BIG))
    try:
        await _admit(node, "big", "a", 2 * BIG)
        await _admit(node, "other", "a", 2 * SLICE)
        await _admit(node, "b1", "b", 2 * BIG)
        keys = _keys(2 * BIG)
        old, _, _ = await node.shared.store("other", NS, keys[:SLICE // 2], holder="o")
        await node.shared.commit("other", NS, keys[:SLICE // 2])
        task, made = await _storing_part_way(node, keys)
        # another request of a's stores what a's first slice placed, not yet written
        placed, fresh, _ = await node.shared.store("other", NS, keys[SLICE // 2:made],
                                                   holder="o")
        assert all(fresh)
        node.end_holds("o")  # its engine wrote them (a's store holds them still)
        await node.allocate("b1", 2 * BIG - made, {"pin_requested": True}, holder="b")
        node.end_holds("b")
        # a's next slice would wait for its own holds: given back, a's holds of what it
        # stored end with them, and stored whole it fails at once (rather than wait for
        # its own holds to lapse).
        with pytest.raises(errors.ResourceExhausted, match="pinned"):
            await asyncio.wait_for(task, 5)
        assert node.request("big").shared == []
        assert node.request("other").shared == old + placed
        assert node.shared.lookup("default", NS, keys[:1]) == old[:1]
        await _check(node)
    finally:
        await node.aclose()


async def test_a_big_store_cancelled_part_way_gives_back_what_it_stored(node):
    await _admit(node, "big", "a", BIG)
    pool = node.runtime("default").pool
    free = pool.device.num_free
    task, _ = await _storing_part_way(node, _keys(BIG))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert node.request("big").shared == []
    assert pool.device.num_free == free
    await _check(node)


async def test_a_big_store_racing_a_release_ends_with_the_request(node):
    await _admit(node, "big", "a", BIG)
    task, _ = await _storing_part_way(node, _keys(BIG))
    await node.release("big")
    with pytest.raises(errors.KvdError, match="released"):
        await task
    assert "big" not in node.request_index
    await _admit(node, "big", "a", BIG)  # the same id again: nothing of the old store
    assert node.request("big").shared == []
    await _check(node)


async def test_a_release_of_a_request_using_many_shared_blocks_leaves_the_loop_to_others(node):
    """Its uses end a slice at a time: what it stored and committed stays for others to
    find, what it never committed goes with it, its pages free once its engine calls
    again."""
    await _with_small_request(node)
    pool = node.runtime("default").pool
    free = pool.device.num_free
    await _admit(node, "big", "a", BIG)
    keys = _keys(BIG)
    blocks, _, _ = await node.shared.store("big", NS, keys, holder="a")
    await node.shared.commit("big", NS, keys[:BIG // 2])
    freed, _ = await _others_call_goes_on(node, node.release("big"))
    assert freed == 0  # it had no blocks of its own
    assert "big" not in node.request_index
    assert node.shared.lookup("default", NS, keys) == blocks[:BIG // 2]
    node.end_holds("a")
    await asyncio.sleep(0.01)
    assert pool.device.num_free == free - BIG // 2
    await _check(node)


async def test_a_big_commit_leaves_the_loop_to_others_and_commits_every_key(node):
    await _with_small_request(node)
    await _admit(node, "big", "a", BIG)
    keys = _keys(BIG)
    blocks, _, _ = await node.shared.store("big", NS, keys, holder="a")
    assert await _others_call_goes_on(node, node.shared.commit("big", NS, keys)) == BIG
    assert node.shared.lookup("default", NS, keys) == blocks
    await _check(node)


async def test_a_big_commit_naming_a_key_it_did_not_store_commits_nothing(node):
    await _admit(node, "big", "a", BIG)
    keys = _keys(BIG)
    await node.shared.store("big", NS, keys, holder="a")
    with pytest.raises(errors.InvalidArgument, match="did not store"):
        await node.shared.commit("big", NS, keys + [b"never stored"])
    assert node.shared.lookup("default", NS, keys) == []
    await _check(node)


async def test_a_big_commit_racing_a_release_ends_with_the_request(node):
    await _admit(node, "big", "a", BIG)
    keys = _keys(BIG)
    await node.shared.store("big", NS, keys, holder="a")
    task = asyncio.ensure_future(node.shared.commit("big", NS, keys))
    await asyncio.sleep(0)
    await node.release("big")
    with pytest.raises(errors.FailedPrecondition, match="released"):
        await task
    assert "big" not in node.request_index
    await _check(node)


@pytest.mark.parametrize("size", ["small", "big"])
async def test_a_commit_while_its_request_is_released_is_refused_as_released(node, size):
    """The release of a request using many shared blocks ends its uses a slice at a time
    first, the newest first: a commit of its keys meanwhile is told the request is being
    released, not that it stored none of them."""
    await _admit(node, "big", "a", BIG)
    keys = _keys(BIG)
    await node.shared.store("big", NS, keys, holder="a")
    releasing = asyncio.ensure_future(node.release("big"))
    for _ in range(1000):
        await asyncio.sleep(0)
        if len(node.request("big").shared) < BIG:
            break
    else:
        raise AssertionError("the release ended no use in 1,000 turns of the loop")
    with pytest.raises(errors.FailedPrecondition, match="being released"):
        await node.shared.commit("big", NS, keys[-SLICE:] if size == "small" else keys)
    await releasing
    assert "big" not in node.request_index
    await _check(node)


async def _stored(node: Node, n: int) -> tuple[list[bytes], list]:
    """n keys stored and committed by tenant b's request "s" (its engine done with them):
    (keys, blocks)."""
    await _admit(node, "s", "b", n)
    keys = _keys(n)
    blocks, _, _ = await node.shared.store("s", NS, keys, holder="b")
    await node.shared.commit("s", NS, keys)
    node.end_holds("b")
    await asyncio.sleep(0.01)  # its holds end a slice at a time
    return keys, blocks


async def test_a_big_load_leaves_the_loop_to_others_and_loads_every_key(node):
    await _with_small_request(node)
    keys, stored = await _stored(node, BIG)
    await _admit(node, "big", "a", BIG)
    blocks = await _others_call_goes_on(node, node.shared.load("big", NS, keys, holder="a"))
    assert blocks == stored
    assert node.request("big").shared == stored
    assert all(b.held for b in blocks)
    await _check(node)


async def test_a_big_load_ends_its_run_where_a_key_went_between_slices():
    """A key evicted (dropped: no host tier) between two of its slices ends the run there,
    as it would have had it gone before the load."""
    node = Node(_config(host_pages=0))
    try:
        keys, stored = await _stored(node, BIG)
        await _admit(node, "big", "a", BIG)
        task = asyncio.ensure_future(node.shared.load("big", NS, keys, holder="a"))
        await _first_slice_done(node, "big")
        made = len(node.request("big").shared)
        assert 0 < made < BIG
        await node.evict("default", BIG - made)  # all that is not held: the rest of them
        blocks = await task
        assert blocks == stored[:made] == node.request("big").shared
        assert node.shared.lookup("default", NS, keys) == stored[:made]
        await _check(node)
    finally:
        await node.aclose()


async def test_a_big_load_refused_part_way_gives_back_its_uses():
    """Between two of a's slices of a pinned load tenant b pins the rest of the device: a's
    next slice's pins would overcommit it, and a uses and pins none of the keys."""
    node = Node(_config(device_pages=2 * BIG, host_pages=4 * BIG))
    try:
        keys, stored = await _stored(node, BIG)
        await _admit(node, "big", "a", BIG)
        await _admit(node, "b1", "b", 2 * BIG - SLICE)
        await node.allocate("b1", 2 * BIG - SLICE, holder="b")
        pool = node.runtime("default").pool
        pin = {"pin_requested": True}
        task = asyncio.ensure_future(node.shared.load("big", NS, keys, holder="a",
                                                      intent=pin))
        await _first_slice_done(node, "big")
        made = len(node.request("big").shared)
        assert made == SLICE and pool.num_pinned == made
        # b pins its blocks: with the keys a pins, the device is pinned full
        await node.update_intents([IntentChange("b1", i, pin)
                                   for i in range(2 * BIG - SLICE)])
        with pytest.raises(errors.KvdError, match="given back"):
            await task
        assert node.request("big").shared == []
        assert pool.num_pinned == 2 * BIG - SLICE  # b's alone
        assert node.shared.lookup("default", NS, keys) == stored  # the cache stays
        node.end_holds("b")
        await _check(node)
    finally:
        await node.aclose()


async def test_a_big_load_given_back_and_then_refused_whole_gives_back_once(node, monkeypatch):
    """Its next slice would wait (given back, loaded whole), and the whole load is refused:
    what the first slice loaded went back once, not again as the refusal unwinds (its
    uses, counted twice, left the invariants broken)."""
    keys, _ = await _stored(node, BIG)
    await _admit(node, "big", "a", BIG)
    real, calls = SharedBlocks._load, []

    async def load(self, rt, rid, namespace, part, holder, intent, wait=True):
        calls.append(len(part))
        if len(calls) == 2:
            raise NoVictims()  # the next slice would wait in a stalled room line
        if len(calls) == 3:
            raise errors.ResourceExhausted("refused whole")
        return await real(self, rt, rid, namespace, part, holder, intent, wait)

    monkeypatch.setattr(SharedBlocks, "_load", load)
    with pytest.raises(errors.ResourceExhausted, match="refused whole"):
        await node.shared.load("big", NS, keys, holder="a")
    assert calls == [SLICE, SLICE, BIG]
    assert node.request("big").shared == []
    await _check(node)


async def test_a_big_load_cancelled_part_way_gives_back_its_uses(node):
    keys, stored = await _stored(node, BIG)
    await _admit(node, "big", "a", BIG)
    task = asyncio.ensure_future(node.shared.load("big", NS, keys, holder="a"))
    await _first_slice_done(node, "big")
    assert 0 < len(node.request("big").shared) < BIG
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert node.request("big").shared == []
    assert not any(b.held for b in stored), "held for an engine told of none of them"
    await _check(node)


class _Context:
    """A unary call's context as MemoryService's handlers use it (the caller's token)."""

    def __init__(self, token: str) -> None:
        self.token = token

    def invocation_metadata(self):
        return (("authorization", f"Bearer {self.token}"),)

    def peer(self) -> str:
        return "unix:test"

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


@pytest.mark.parametrize("call", ["Allocate", "Access", "Store", "Load"])
async def test_a_big_reply_is_made_a_slice_at_a_time_and_hands_out_every_page(call):
    """The service's reply to a call handing out many pages: another tenant's call goes on
    while it is made, and each handle names its block's page (a shared block's: at its
    key's position), whose bytes are the block's where they were written."""
    node = Node(_config())
    service = MemoryService(node, Authenticator(node.config, node.leases))
    device = node.runtime("default").arenas["device"].pages
    written = call in ("Access", "Load")
    try:
        await _with_small_request(node)
        await _admit(node, "a/big", "a", BIG)
        keys = _keys(BIG)
        if call == "Allocate":
            request = pb.AllocateRequest(request_id="big", num_blocks=BIG)
        elif call == "Access":
            blocks, _ = await node.allocate("a/big", BIG)
            for b in blocks:
                device[b.page] = np.full(PAGE, b.index % 251, np.uint8)
            request = pb.AccessRequest(request_id="big", all_blocks=True)
        else:
            request = pb.StoreRequest(request_id="big", keys=keys)
        if call == "Load":
            stored = await service.Store(request, _Context("ta"))
            for h in stored.handles:
                device[h.page_index] = np.full(PAGE, h.block_index % 251, np.uint8)
            await service.Commit(pb.CommitRequest(request_id="big", keys=keys),
                                 _Context("ta"))
            await _admit(node, "a/reader", "a", BIG)
            request = pb.LoadRequest(request_id="reader", keys=keys)
        reply = await _others_call_goes_on(
            node, getattr(service, call)(request, _Context("ta")))
        assert [h.block_index for h in reply.handles] == list(range(BIG))
        req = node.request("a/big")
        blocks = req.live if call in ("Allocate", "Access") else req.shared
        assert [h.page_index for h in reply.handles] == [b.page for b in blocks]
        if call == "Load":
            assert node.request("a/reader").shared == blocks
        for h in reply.handles if written else ():
            assert (device[h.page_index] == h.block_index % 251).all()
        await _check(node)
    finally:
        await node.aclose()
