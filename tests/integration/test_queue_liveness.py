"""No request waits for ever: a queued request goes as soon as it fits, whatever made the
room (a request released with no blocks, a quota changed pool by pool, a prefix stored), and
one that can never fit any more after a quota change is rejected and told why, rather than
wait, and keep every request behind it waiting. In-process (a Node, kvd's calls), so the
moment a request could go is seen, not timed; over gRPC in test_tenants."""

from __future__ import annotations

import dataclasses

import pytest

from kvd.config import Config, PoolConfig, TenantConfig
from kvd.node import Node

PAGE_BYTES = 64
BLOCK_TOKENS = 4


def _node(device_pages: int = 4, tenants=(), **pool) -> Node:
    pools = tuple(PoolConfig(name=name, page_bytes=PAGE_BYTES, block_tokens=BLOCK_TOKENS,
                             device_pages=device_pages, host_pages=device_pages,
                             device_backend="host", link_bandwidth="1GiB/s", **pool)
                  for name in ("default", "decode"))
    return Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=pools,
                       tenants=tuple(tenants)))


def _admit(node: Node, rid: str, pages: int, tenant: str = "a", pool: str = "default",
           handoff: str = "") -> str:
    return node.admit(rid, tenant=tenant, pool=pool, prompt_tokens=pages * BLOCK_TOKENS,
                      output_tokens=0, priority=0, handoff_pool=handoff).decision


async def _hand_off(node: Node, rid: str) -> None:
    async for _ in node.handoff(rid):
        pass


def _queued(node: Node, pool: str = "default") -> list[str]:
    return list(node.runtime(pool).pool.queue)


async def test_a_lowered_limit_rejects_the_queued_request_it_shuts_out_and_lets_the_next_go():
    node = _node(tenants=(TenantConfig("a"), TenantConfig("b")))
    try:
        assert _admit(node, "running", 4, tenant="b") == "admitted"
        assert _admit(node, "big", 3, tenant="a") == "queued"  # first in line
        assert _admit(node, "small", 1, tenant="b") == "queued"  # behind it
        events = node.events.subscribe(kinds=("admission",))
        node.set_quota("a", "", limit=2)  # "big" can never go now
        assert "big" not in node.request_index and _queued(node) == ["small"]
        why = node.rejected_while_queued("big", "a")
        assert "needs 3 pages, over tenant 'a''s limit of 2 pages" in why
        assert node.rejected_while_queued("big", "b") is None  # not b's to learn
        rejected = events.queue.get_nowait()
        assert (rejected.request_id, rejected.detail["decision"]) == ("big", "rejected")
        await node.release("running")
        assert _queued(node) == [] and node.runtime_of("small").pool.name == "default"
        # The id is free again: admitted anew, its old rejection is forgotten.
        assert _admit(node, "big", 1, tenant="a") == "admitted"
        assert node.rejected_while_queued("big") is None
    finally:
        await node.aclose()


async def test_releasing_a_request_that_holds_no_block_lets_a_handoff_reservation_go():
    """The decode pool's room is its running requests' reservations: one released with no
    block left (handed off before it grew, or having freed all) frees room there too."""
    node = _node()
    try:
        assert _admit(node, "decoding", 4, pool="decode") == "admitted"  # no blocks yet
        assert _admit(node, "prefill", 2, handoff="decode") == "queued"
        assert node.runtime("default").pool.admission.why_waiting(
            node.runtime("default").pool.requests["prefill"]).startswith("handoff pool")
        await node.release("decoding")
        assert _queued(node) == [], "the prefill request waits though decode is empty"
    finally:
        await node.aclose()


async def test_a_limit_raised_in_every_pool_lets_a_request_waiting_on_its_handoff_pool_go():
    """A quota change is applied pool by pool: the prefill pool looked at its queue before the
    decode pool's limit was raised, and the request waiting for a decode reservation waited
    on until something else happened."""
    node = _node(device_pages=8, tenants=(TenantConfig("a", limit=2),))
    try:
        assert _admit(node, "first", 2, handoff="decode") == "admitted"
        await _hand_off(node, "first")  # now in decode: a holds its limit there
        assert _admit(node, "second", 2, handoff="decode") == "queued"
        node.set_quota("a", "", limit=4)
        assert _queued(node) == []
    finally:
        await node.aclose()


async def test_a_prefix_stored_in_the_decode_pool_lets_a_handoff_reservation_go():
    """Blocks a request stores are shared, counted out of its working set: the room that
    leaves in the decode pool is room for the reservation waiting on it."""
    node = _node()
    try:
        assert _admit(node, "decoding", 3, pool="decode") == "admitted"
        assert _admit(node, "prefill", 2, handoff="decode") == "queued"
        await node.shared.store("decoding", "m", [b"k0", b"k1"])
        assert _queued(node) == []
    finally:
        await node.aclose()


@pytest.mark.parametrize("policy", ["lru", "intent"])
async def test_a_reloaded_config_rejects_what_can_never_go_and_admits_what_now_can(policy):
    node = _node(device_pages=8, tenants=(TenantConfig("a"), TenantConfig("b", limit=2)))
    try:
        await node.set_policy("default", policy)
        assert _admit(node, "b1", 2, tenant="b") == "admitted"
        assert _admit(node, "a1", 7, tenant="a") == "queued"  # no room beside b1
        assert _admit(node, "b2", 2, tenant="b") == "queued"  # b at its limit
        config = dataclasses.replace(node.config, tenants=(TenantConfig("a", limit=4),
                                                           TenantConfig("b", limit=4)))
        node.apply_tenants(config)  # SIGHUP: a1 can never go, b2 can now
        assert "limit of 4 pages" in node.rejected_while_queued("a1")
        assert _queued(node) == [] and node.runtime_of("b2").pool.name == "default"
    finally:
        await node.aclose()


async def test_the_requests_a_handoff_lets_in_are_announced():
    """A handoff's end releases its request from the prefill pool, which admits the request
    that waited for the room: the event feed says so, as engines that start queued requests
    from kvd's admission events (the vLLM connector) need."""
    node = _node()
    try:
        assert _admit(node, "prefilled", 4, handoff="decode") == "admitted"
        assert _admit(node, "waiting", 2) == "queued"
        events = node.events.subscribe(kinds=("admission",))
        await _hand_off(node, "prefilled")
        assert node.runtime("default").pool.requests["waiting"].state.value == "admitted"
        told = [events.queue.get_nowait() for _ in range(events.queue.qsize())]
        assert [(e.request_id, e.detail["decision"]) for e in told] == [("waiting", "admitted")]
    finally:
        await node.aclose()


@pytest.mark.parametrize("policy", ["lru", "intent"])
@pytest.mark.parametrize("ends", ["unpinned", "freed"])
async def test_a_request_waiting_for_pinned_pages_goes_once_the_pins_end(policy, ends):
    """Half the device is pinned: a request that needs all of it waits (a pinned page is no
    room, however soon the engine that holds it calls again). The pins end, by an intent
    update or by freeing the pinned blocks: the request goes at once. Neither looked at the
    queue, and it waited for whatever came next, in a pool with nothing else to come for
    ever."""
    from kvd.core.intent import IntentChange

    node = _node(policy=policy, admission="reservation")
    try:
        assert _admit(node, "pinner", 2) == "admitted"
        await node.allocate("pinner", 2, {"pin_requested": True}, holder="engine")
        why = node.admit("big", tenant="a", pool="default", prompt_tokens=4 * BLOCK_TOKENS,
                         output_tokens=0, priority=0).reason
        assert "needs 4 device pages; only 2 are free or evictable (2 of 4 pinned)" in why
        node.end_holds("engine")  # the pinned pages stay pinned: no room came
        assert _queued(node) == ["big"]
        events = node.events.subscribe(kinds=("admission",))
        if ends == "unpinned":
            await node.update_intents([IntentChange("pinner", i, {"pin_requested": False})
                                       for i in range(2)])
        else:
            await node.free("pinner", [0, 1])
        assert _queued(node) == []
        admitted = events.queue.get_nowait()
        assert (admitted.request_id, admitted.detail["decision"]) == ("big", "admitted")
        await node.allocate("big", 4)  # the whole device, as admitted
    finally:
        await node.aclose()
