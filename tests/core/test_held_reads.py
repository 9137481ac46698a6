"""Requests a step read and holds by request (Holds.hold_requests): their blocks are out of
every choice of victims, and a choice that finds its victims elsewhere costs nothing for
them.

An engine holds what its step read until its next message; with long contexts that is
hundreds of thousands of blocks. Holding each of them at every choice of victims (and
handing each back at the engine's next message) made another tenant's one-block
allocation cost as much as the engine's whole read.
"""

from __future__ import annotations

import pytest

from kvd.core.blocks import TierKind
from kvd.core.errors import NoVictims
from kvd.core.policies import policy_names

from .conftest import settle


def _read_and_hold(pool, rid: str, holder: str) -> None:
    """A step's read of the request, answered at once and held by request."""
    general, _, answered = pool.read_all([rid])
    assert general == []
    pool.hold_read(answered, holder)


def test_a_choice_of_victims_elsewhere_holds_none_of_what_a_step_read(make_pool):
    pool = make_pool(device_pages=72, host_pages=16, policy="lru")
    pool.admit("cold", tenant="b", prompt_tokens=16 * 8, output_tokens=0)
    settle(pool, pool.allocate("cold", 8))  # read longest ago: LRU's victims
    pool.admit("hot", tenant="a", prompt_tokens=16 * 64, output_tokens=0)
    settle(pool, pool.allocate("hot", 64))
    _read_and_hold(pool, "hot", "engine")
    assert pool.device.num_free == 0
    pool.admit("grow", tenant="b", prompt_tokens=16 * 4, output_tokens=0)
    for _ in range(4):  # each allocation chooses a victim: one of cold's blocks
        settle(pool, pool.allocate("grow", 1))
    cold = pool.get_request("cold")
    assert sum(b.tier is TierKind.HOST for b in cold.live) == 4
    # None of hot's 64 blocks was held one by one, nor taken out of the policy and put
    # back at the engine's next message: the choices cost nothing for them.
    assert pool.pages.holds.count == 0
    hot = pool.get_request("hot")
    assert all(b in pool.policy for b in hot.live)
    pool.end_holds("engine")


@pytest.mark.parametrize("policy", policy_names())
def test_blocks_a_step_read_are_never_chosen_however_the_policy_ranks_them(make_pool, policy):
    pool = make_pool(device_pages=8, host_pages=16, policy=policy)
    pool.admit("hot", tenant="a", prompt_tokens=16 * 6, output_tokens=0)
    settle(pool, pool.allocate("hot", 6))  # the largest request, and read longest ago
    pool.admit("cold", tenant="b", prompt_tokens=16 * 2, output_tokens=0)
    settle(pool, pool.allocate("cold", 2))
    _read_and_hold(pool, "hot", "engine")
    hot = pool.get_request("hot")
    pages = [b.page for b in hot.live]
    pool.admit("grow", tenant="b", prompt_tokens=16 * 3, output_tokens=0)
    # Three pages wanted, two can go: the engine's next message lets the others go.
    with pytest.raises(NoVictims):
        pool.allocate("grow", 3)
    assert [(b.tier, b.page, b.moving) for b in hot.live] == [
        (TierKind.DEVICE, page, False) for page in pages]
    settle(pool, pool.allocate("grow", 2))  # the cold request's pages
    assert [(b.tier, b.page) for b in hot.live] == [(TierKind.DEVICE, p) for p in pages]
    assert all(b.tier is TierKind.HOST for b in pool.get_request("cold").live)
    pool.end_holds("engine")
    assert all(b in pool.policy for b in hot.live)


def test_a_read_that_brings_blocks_in_holds_the_rest_by_request(make_pool):
    pool = make_pool(device_pages=8, host_pages=16, policy="lru")
    pool.admit("r", tenant="a", prompt_tokens=16 * 5, output_tokens=0)
    settle(pool, pool.allocate("r", 5))
    pool.admit("c", tenant="b", prompt_tokens=16 * 3, output_tokens=0)
    settle(pool, pool.allocate("c", 3))
    pool.access("r", [1, 2, 3, 4])  # block 0 is read longest ago: the operator's victim
    pool.access("c", None)
    settle(pool, pool.evict(1))
    r = pool.get_request("r")
    assert [b.tier for b in r.live] == [TierKind.HOST] + [TierKind.DEVICE] * 4
    result = pool.access("r", None, holder="engine")  # brings block 0 in (to its page)
    settle(pool, result.plan)
    # The block brought in is held by itself; the four that were there, by request.
    assert pool.pages.holds.count == 1
    assert all(b in pool.policy for b in r.live[1:])
    pool.admit("g", tenant="b", prompt_tokens=16 * 4, output_tokens=0)
    settle(pool, pool.allocate("g", 3))  # c's blocks go, read after r's were
    assert all(b.tier is TierKind.HOST for b in pool.get_request("c").live)
    # r's blocks were read longest ago, and LRU offers them first: held, they stay.
    settle(pool, pool.allocate("g", 1))
    assert all(b.tier is TierKind.DEVICE and not b.moving for b in r.live)
    assert sum(b.tier is TierKind.HOST for b in pool.get_request("g").live) == 1
    pool.end_holds("engine")


def test_a_fair_choice_leaves_what_a_step_read_out_without_holding_it(make_pool):
    pool = make_pool(device_pages=20, host_pages=32, policy="fair")
    pool.admit("hot", tenant="a", prompt_tokens=16 * 12, output_tokens=0)
    settle(pool, pool.allocate("hot", 12))  # tenant a's largest request: fair's first pick
    pool.admit("cold", tenant="a", prompt_tokens=16 * 8, output_tokens=0)
    settle(pool, pool.allocate("cold", 8))
    _read_and_hold(pool, "hot", "engine")
    pool.admit("b", tenant="b", prompt_tokens=16 * 4, output_tokens=0)
    for _ in range(4):  # tenant a is over its share: its pages go, the cold request's
        settle(pool, pool.allocate("b", 1))
    assert sum(b.tier is TierKind.HOST for b in pool.get_request("cold").live) == 4
    hot = pool.get_request("hot")
    assert all(b.tier is TierKind.DEVICE for b in hot.live)
    # Left out of each choice, never held one by one and put back.
    assert pool.pages.holds.count == 0
    assert all(b in pool.policy for b in hot.live)
    pool.end_holds("engine")


def test_a_fair_choice_for_a_read_of_a_whole_request_leaves_it_out_as_one(make_pool,
                                                                           monkeypatch):
    pool = make_pool(device_pages=72, host_pages=16, policy="fair")
    pool.admit("r", tenant="a", prompt_tokens=16 * 64, output_tokens=0)
    settle(pool, pool.allocate("r", 64))
    pool.admit("c", tenant="a", prompt_tokens=16 * 9, output_tokens=0)
    settle(pool, pool.allocate("c", 8))
    settle(pool, pool.evict(1))  # the largest request pays: one of r's blocks goes
    r = pool.get_request("r")
    assert sum(b.tier is TierKind.HOST for b in r.live) == 1
    settle(pool, pool.allocate("c", 1))  # the device is full again
    looked_at = []
    policy_type = type(pool.policy)
    contains = policy_type.__contains__
    monkeypatch.setattr(policy_type, "__contains__",
                        lambda self, b: looked_at.append(b) or contains(self, b))
    result = pool.access("r", None, holder="engine")  # brings it back, for c's blocks
    monkeypatch.undo()
    settle(pool, result.plan)
    assert {m.block.request.request_id for m in result.plan.demotions} == {"c"}
    assert all(b.tier is TierKind.DEVICE for b in r.live)
    # The choice left r out as one request, not by looking at each of its 63 blocks.
    assert len(looked_at) < 8
    pool.end_holds("engine")
