"""Conformance of every registered policy, then what is specific to each."""

from __future__ import annotations

import pytest

from kvd.core.blocks import Block, Phase, Priority, Request, RequestState, TierKind
from kvd.core.clock import FakeClock
from kvd.core.policies import POLICIES, make_policy


def _blocks(n: int, tenant: str = "t", rid: str = "r") -> list[Block]:
    req = Request(rid, tenant, "default", 0, n, RequestState.ADMITTED)
    return [Block(req, i, TierKind.DEVICE, i) for i in range(n)]


@pytest.fixture(params=sorted(POLICIES))
def policy(request):
    return make_policy(request.param, FakeClock())


def test_choose_is_atomic_and_exact(policy):
    blocks = _blocks(5)
    for b in blocks:
        policy.insert(b)
    assert policy.choose(6) is None
    assert len(policy) == 5
    victims = policy.choose(3)
    assert len(victims) == 3 and len(set(victims)) == 3
    assert all(v in policy for v in victims)
    assert policy.choose(3) == victims  # choosing changed nothing
    for v in victims:
        policy.remove(v)
    assert set(policy.choose(2)) == set(blocks) - set(victims)
    assert policy.choose(3) is None


def test_removed_blocks_are_never_chosen(policy):
    blocks = _blocks(50)
    for b in blocks:
        policy.insert(b)
    for b in blocks[::2]:
        policy.remove(b)
    for b in blocks[1::2]:
        b.last_access += 1
        policy.touch(b)
    chosen = policy.choose(25)
    assert set(chosen) == set(blocks[1::2])


def test_lru_order():
    clock = FakeClock()
    policy = make_policy("lru", clock)
    blocks = _blocks(4)
    for b in blocks:
        policy.insert(b)
    policy.touch(blocks[0])
    assert policy.choose(2) == [blocks[1], blocks[2]]


def test_intent_order():
    policy = make_policy("intent", FakeClock())
    hot, warm, cold, done, draft, cheap, expensive = _blocks(7)
    hot.priority, warm.priority, cold.priority = Priority.HOT, Priority.WARM, Priority.COLD
    done.phase = Phase.DONE
    draft.is_draft = True
    cheap.priority = expensive.priority = Priority.WARM
    cheap.recompute_cost_us, expensive.recompute_cost_us = 10, 10_000
    warm.recompute_cost_us = 5_000
    low_req = _blocks(1, rid="low")[0]
    low_req.request_priority, warm.request_priority = 0, 50
    cheap.request_priority = expensive.request_priority = 50
    for b in (hot, warm, cold, done, draft, cheap, expensive, low_req):
        policy.insert(b)
    assert policy.choose(8) == [done, draft, cold, low_req, cheap, warm, expensive, hot]


def test_intent_reorders_when_told():
    policy = make_policy("intent", FakeClock())
    a, b = _blocks(2)
    policy.insert(a)
    policy.insert(b)
    assert policy.choose(1) == [a]
    a.priority = Priority.HOT
    policy.reorder(a)
    assert policy.choose(1) == [b]


def test_deadline_evicts_furthest_next_use_first():
    policy = make_policy("deadline", FakeClock())
    soon, later, never, tie_slack, tie_tight = _blocks(5)
    soon.deadline_at, later.deadline_at = 1.0, 5.0
    tie_slack.deadline_at = tie_tight.deadline_at = 3.0
    tie_slack.slack_us, tie_tight.slack_us = 1_000, 10
    for b in (soon, later, never, tie_slack, tie_tight):
        policy.insert(b)
    assert policy.choose(5) == [never, later, tie_slack, tie_tight, soon]


def test_regret_protects_blocks_wanted_back_soon():
    clock = FakeClock()
    policy = make_policy("regret", clock)
    regretted, other = _blocks(2)
    regretted.last_access, other.last_access = 0.0, 0.1
    policy.insert(regretted)
    policy.insert(other)
    assert policy.choose(1) == [regretted]
    policy.remove(regretted)
    policy.on_evicted(regretted)
    clock.advance(0.1)  # wanted back within the window: a regret
    policy.on_promoted(regretted)
    regretted.last_access = clock.now()
    policy.insert(regretted)
    assert policy.num_regrets == 1 and regretted.regret_level == 1
    # Other is touched after it, but regretted keeps a head start of one window (0.5 s)...
    clock.advance(0.2)
    other.last_access = clock.now()
    policy.touch(other)
    assert policy.choose(1) == [other]
    # ...which decays: touched later than that, other outranks it again.
    clock.advance(0.4)
    other.last_access = clock.now()
    policy.touch(other)
    assert policy.choose(1) == [regretted]


def test_heap_policies_stay_compact_under_many_touches():
    policy = make_policy("intent", FakeClock())
    blocks = _blocks(100)
    for b in blocks:
        policy.insert(b)
    for t in range(100):
        for b in blocks:
            b.last_access = float(t)
            policy.touch(b)
    assert len(policy._heap) <= 2 * len(blocks) + 64 + 1
    assert policy.choose(1) == [blocks[0]]
