"""Conformance of every registered policy, then what is specific to each."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.blocks import Block, Phase, Priority, Request, RequestState, TierKind
from kvd.core.clock import FakeClock
from kvd.core.policies import make_policy, policy_names


class FakeTenancy:
    """Usage is what the test says; every tenant's fair share is 1 page."""

    def __init__(self, usage=None, shares=None, guaranteed=None, engine_held=None):
        self._usage = usage or {}
        self._shares = shares or {}
        self._guaranteed = guaranteed or {}
        self.engine_held = engine_held or {}

    def usage(self, tenant):
        return self._usage.get(tenant, 100)

    def fair_share(self, tenant):
        return self._shares.get(tenant, 1.0)

    def guaranteed(self, tenant):
        return self._guaranteed.get(tenant, 0)


def _blocks(n: int, tenant: str = "t", rid: str = "r") -> list[Block]:
    req = Request(rid, tenant, "default", 0, n, RequestState.ADMITTED)
    return [Block(req, i, TierKind.DEVICE, i) for i in range(n)]


@pytest.fixture(params=policy_names())
def policy(request):
    return make_policy(request.param, FakeClock(), FakeTenancy())


def test_choose_is_atomic_and_exact(policy):
    assert policy.choose(0) == []  # none wanted of none held (a refill of an empty policy)
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


def test_evict_skips_the_protected_and_changes_nothing_when_it_cannot(policy):
    blocks = _blocks(6, rid="a") + _blocks(4, tenant="u", rid="b")
    for i, b in enumerate(blocks):
        b.last_access = float(i)
        policy.insert(b)
    order = policy.choose(len(blocks))
    protected = set(order[:3])  # the three the policy would take first
    assert policy.evict(8, protected=protected) is None
    assert policy.choose(len(blocks)) == order and len(policy) == 10
    victims = policy.evict(5, protected=protected)
    assert len(victims) == 5 and not protected & set(victims)
    assert all(v not in policy for v in victims) and len(policy) == 5
    assert all(b in policy for b in protected)
    assert policy.choose(3, protected=protected) is None


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
    blocks[0].last_access = 1.0  # the pool stamps the read, then touches
    policy.touch(blocks[0])
    assert policy.choose(2) == [blocks[1], blocks[2]]



def test_lru_records_a_read_of_a_whole_request_as_one_entry():
    """An engine's step reads every block of each request it runs. LRU records such a read
    as one entry in its queue, which the request's blocks stand at, not one per block: with
    long contexts, moving each block held the event loop (every other tenant's calls) for a
    step's hundreds of thousands of blocks. The order is the one moving each would leave."""
    policy = make_policy("lru", FakeClock())
    long = _blocks(4096, rid="long")
    req = long[0].request
    req.live = list(long)
    cold = _blocks(1, rid="cold")
    for b in [*long, *cold]:
        policy.insert(b)
    entries = policy._order._count
    for _ in range(3):  # three steps
        policy.touch_requests([req])
    assert policy._order._count == entries + 3
    assert policy.choose(1) == cold
    assert policy.choose(4097) == [*cold, *long]


class _CountedWalks(list):
    """A request's live blocks that count the walks over them."""

    walks = 0

    def __iter__(self):
        self.walks += 1
        return super().__iter__()


@pytest.mark.parametrize("name", ["lru", "regret"])
def test_recency_policies_record_whole_request_reads_without_walking_their_blocks(name):
    """lru and regret record a step's read of a whole request without walking its blocks
    (each step of a long context's engine walked hundreds of thousands), and choose as
    moving each block to the back of its queue would."""
    policy = make_policy(name, FakeClock())
    blocks = _blocks(64, rid="long")
    req = blocks[0].request
    cold = _blocks(1, rid="cold")
    for b in [*blocks, *cold]:
        policy.insert(b)
    req.live = _CountedWalks(blocks)
    for _ in range(3):
        policy.touch_requests([req])
        policy.touch_request(req)
    assert req.live.walks == 0
    assert policy.choose(65) == [*cold, *blocks]


@pytest.mark.parametrize("name", ["lru", "regret"])
def test_a_long_request_read_whole_is_walked_once_as_it_is_evicted_a_batch_at_a_time(name):
    """The run a whole read left at the front is replaced by its blocks when victims are
    chosen from it: each batch after walks what it takes, not the request's blocks again
    (most of them gone: a walk per batch)."""
    policy = make_policy(name, FakeClock())
    blocks = _blocks(4096, rid="long")
    req = blocks[0].request
    for b in blocks:
        policy.insert(b)
    req.live = _CountedWalks(blocks)
    policy.touch_requests([req])
    for start in range(0, 4096, 64):  # evicted 64 at a time
        victims = policy.choose(64)
        assert victims == blocks[start:start + 64]
        policy.take(victims)
    assert len(policy) == 0 and req.live.walks == 1

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


def test_intent_keeps_the_blocks_the_engine_needs_soonest_within_a_priority():
    """The engine's target decode step is its hint of the next use: within a priority the
    block needed furthest ahead goes first (Belady's choice on the hint), a block with no
    target before any with one; priority still comes first."""
    policy = make_policy("intent", FakeClock())
    soon, later, unknown, cold_soon = _blocks(4)
    for b in (soon, later, unknown):
        b.priority = Priority.HOT
    soon.target_decode_step, later.target_decode_step = 10, 500
    cold_soon.priority, cold_soon.target_decode_step = Priority.COLD, 1
    soon.request_priority, later.request_priority = 0, 100  # the hint outranks it
    for b in (soon, later, unknown, cold_soon):
        policy.insert(b)
    assert policy.choose(4) == [cold_soon, unknown, later, soon]
    later.target_decode_step = 5  # the engine says it is needed first now
    policy.reorder(later)
    assert policy.choose(3) == [cold_soon, unknown, soon]


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


def _holding(name: str, n: int):
    """A new policy holding n fresh blocks of one request, and the blocks."""
    policy = make_policy(name, FakeClock())
    blocks = _blocks(n)
    for b in blocks:
        policy.insert(b)
    return policy, blocks


@pytest.mark.parametrize("name", ["intent", "deadline"])
def test_classed_policies_stay_compact_under_reads_and_reorders(name):
    policy, blocks = _holding(name, 100)
    for t in range(100):
        for b in blocks:
            b.last_access = float(t)
            b.priority = Priority.HOT if t % 2 else Priority.COLD
            b.deadline_at = float(t % 7)
            policy.reorder(b)
        assert policy.choose(1) == [blocks[0]]
    assert len(policy._keys) <= 2 * len(policy._classes) + 64 + 1
    assert sum(map(len, policy._classes.values())) == len(blocks)


@pytest.mark.parametrize("name", ["intent", "deadline"])
def test_classed_policies_evict_least_recently_read_first_within_a_class(name):
    policy, blocks = _holding(name, 6)
    blocks[0].last_access = 1.0  # read after the others were queued (not touched: lazy)
    blocks[2].last_access = 2.0
    assert policy.choose(1) == [blocks[1]]
    assert policy.choose(6) == [blocks[1], blocks[3], blocks[4], blocks[5], blocks[0],
                                blocks[2]]
    policy.remove(blocks[1])
    blocks[3].last_access = 3.0
    assert policy.choose(2) == [blocks[4], blocks[5]]
    assert policy.choose(1) == [blocks[4]]


def test_fair_takes_from_the_tenant_most_over_its_share_and_its_largest_request():
    tenancy = FakeTenancy(usage={"whale": 60, "minnow": 10}, shares={"whale": 35, "minnow": 35})
    policy = make_policy("fair:lru", FakeClock(), tenancy)
    whale = _blocks(50, "whale", "w1") + _blocks(10, "whale", "w2")
    minnow = _blocks(10, "minnow", "m1")
    for b in minnow + whale:
        policy.insert(b)
    victims = policy.choose(10)
    assert all(v.request.request_id == "w1" for v in victims)  # the whale's big request pays
    assert victims == whale[:10]  # in the base policy's (LRU) order


def test_fair_spreads_victims_as_usage_falls():
    tenancy = FakeTenancy(usage={"a": 12, "b": 10}, shares={"a": 10, "b": 10})
    policy = make_policy("fair", FakeClock(), tenancy)
    for b in _blocks(12, "a", "a1") + _blocks(10, "b", "b1"):
        policy.insert(b)
    victims = policy.choose(6)
    by_tenant = [v.request.tenant for v in victims]
    # a is 1.2x its share, so it pays until level with b; then they alternate.
    assert by_tenant[:2] == ["a", "a"] and by_tenant.count("b") >= 2


def test_fair_makes_the_tenant_holding_more_on_the_engines_gpus_pay_first():
    # Equal in kvd's device tier, both over their shares; "e" also holds 6 blocks on the
    # engines' GPUs (from their KV events): it pays first, until it falls to the other's
    # ratio; what each holds in kvd still decides how far it may be taken.
    tenancy = FakeTenancy(usage={"e": 8, "q": 8}, shares={"e": 4, "q": 4},
                          engine_held={"e": 6})
    policy = make_policy("fair", FakeClock(), tenancy=tenancy)
    for b in _blocks(8, tenant="e", rid="re") + _blocks(8, tenant="q", rid="rq"):
        policy.insert(b)
    victims = policy.choose(4)
    assert [v.request.tenant for v in victims] == ["e"] * 4
    tenancy.engine_held = {}
    assert policy.choose(1)[0].request.tenant in ("e", "q")  # a tie without it


def test_fair_never_takes_guaranteed_pages_for_another_tenant():
    tenancy = FakeTenancy(usage={"g": 5, "x": 3}, shares={"g": 1, "x": 10}, guaranteed={"g": 5})
    policy = make_policy("fair", FakeClock(), tenancy)
    for b in _blocks(5, "g", "g1") + _blocks(3, "x", "x1"):
        policy.insert(b)
    assert {v.request.tenant for v in policy.choose(3, for_tenant="x")} == {"x"}
    assert policy.choose(4, for_tenant="x") is None  # the 4th would be guaranteed
    assert policy.choose(4, for_tenant="g") is not None  # g may give up its own pages


def test_fair_over_a_base_policy_uses_that_order_inside_a_request():
    policy = make_policy("fair:intent", FakeClock(), FakeTenancy())
    assert policy.name == "fair:intent" and policy.uses_intent
    hot, cold = _blocks(2)
    hot.priority, cold.priority = Priority.HOT, Priority.COLD
    policy.insert(hot)
    policy.insert(cold)
    assert policy.choose(1) == [cold]


def test_fair_makes_the_tenant_that_needs_room_pay_when_nobody_is_over_share():
    tenancy = FakeTenancy(usage={"w": 10, "m": 10}, shares={"w": 10, "m": 10})
    policy = make_policy("fair", FakeClock(), tenancy)
    for b in _blocks(10, "w", "w1") + _blocks(10, "m", "m1"):
        policy.insert(b)
    assert {v.request.tenant for v in policy.choose(4, for_tenant="w")} == {"w"}
    assert {v.request.tenant for v in policy.choose(4, for_tenant="m")} == {"m"}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "remove", "touch", "choose"]),
                          st.integers(0, 3), st.integers(0, 7), st.integers(0, 100)),
                max_size=80))
def test_reuse_chooses_requests_by_furthest_next_read_then_blocks_by_last_read(ops):
    """choose(n) against the order the policy promises, worked out from scratch: requests
    by predicted next read (furthest first; among equal ones the one predicted longest
    ago), each request's blocks most recently read first. The heap behind it keeps stale
    entries as requests are re-predicted (later or sooner) and emptied; no choice may see
    one."""
    policy = make_policy("reuse", FakeClock())
    reqs = [Request(f"r{j}", "t", "default", 0, 8, RequestState.ADMITTED) for j in range(4)]
    blocks = [[Block(r, i, TierKind.DEVICE, 8 * j + i) for i in range(8)]
              for j, r in enumerate(reqs)]
    held: dict = {}  # request -> its blocks in the policy, least recently read first
    predicted: dict = {}  # request -> (next read, when predicted)
    for now, (op, j, i, x) in enumerate(ops):
        req = reqs[j]
        mine = held.get(req, [])
        if op == "insert":
            out = [b for b in blocks[j] if b not in mine]
            if not out:
                continue
            block = out[i % len(out)]
            block.last_access, block.reuse_s = float(now), float(x)  # x: sooner or later
            policy.insert(block)
            held.setdefault(req, []).append(block)
            predicted[req] = (block.last_access + block.reuse_s, now)
        elif op == "remove" and mine:
            policy.remove(block := mine[i % len(mine)])
            mine.remove(block)
            if not mine:
                del held[req], predicted[req]
        elif op == "touch" and mine:
            block = mine[i % len(mine)]
            block.last_access, block.reuse_s = float(now), float(x)
            policy.touch(block)
            mine.remove(block)
            mine.append(block)
            predicted[req] = (block.last_access + block.reuse_s, now)
        elif op == "choose":
            order = sorted(held, key=lambda r: (-predicted[r][0], predicted[r][1]))
            want = [b for r in order for b in reversed(held[r])]
            n = 1 + x % (len(want) + 1)
            got = policy.choose(n)
            assert got == (want[:n] if n <= len(want) else None)
            assert policy.choose(n) == got  # choosing changed nothing
        assert len(policy) == sum(map(len, held.values()))


def test_reuse_evicts_the_furthest_predicted_next_read():
    policy = make_policy("reuse", FakeClock())
    fast = _blocks(2, rid="fast")  # read every 20 ms: next read at 10.02
    slow = _blocks(2, rid="slow")  # read every 90 ms: next read at 10.09
    for b in fast + slow:
        b.last_access = 10.0
    for b in fast:
        b.reuse_s = 0.02
    for b in slow:
        b.reuse_s = 0.09
    scan = _blocks(3, rid="scan")  # a cyclic scan, 50 ms period, read in block order
    for i, b in enumerate(scan):
        b.last_access, b.reuse_s = 9.9 + 0.01 * i, 0.05
    for b in fast + slow + scan:
        policy.insert(b)
    # The slow request's pages are needed last; within the scan, the block read last is
    # needed last (MRU is Belady's choice for a cyclic scan).
    victims = policy.choose(7)
    assert victims[:2] == list(reversed(slow))
    assert victims[2:4] == list(reversed(fast))
    assert victims[4:] == list(reversed(scan))
    # A read moves a block to the back of its request's line and re-predicts the request.
    scan[0].last_access = 10.2
    policy.touch(scan[0])
    assert policy.choose(1) == [scan[0]]


_REUSE_OPS = st.lists(st.tuples(
    st.sampled_from(["insert", "remove", "touch", "touch many", "read whole"]),
    st.integers(0, 1), st.lists(st.integers(0, 11), min_size=1, max_size=4)),
    min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops=_REUSE_OPS)
def test_reuse_keeps_each_requests_blocks_in_the_order_a_list_would(ops):
    """reuse orders each request's blocks by their reads: a block inserted or read alone
    goes to the end, and a read of the whole request leaves its blocks in index order. It
    reorders only the blocks that came to the end since the request was last in order, and
    those before them with a higher index: the order must be what moving each block in
    index order would leave."""
    policy = make_policy("reuse", FakeClock())
    reqs = [_blocks(12, rid=f"r{i}") for i in range(2)]
    for blocks in reqs:
        blocks[0].request.live = list(blocks)
    model: list[list[Block]] = [[], []]  # each request's held blocks, in order
    for op, r, indices in ops:
        blocks, order = reqs[r], model[r]
        picked = [blocks[i] for i in dict.fromkeys(indices)]
        if op == "insert":
            for b in picked:
                if b not in order:
                    policy.insert(b)
                    order.append(b)
        elif op == "remove":
            for b in picked:
                if b in order:
                    policy.remove(b)
                    order.remove(b)
        elif op == "touch":
            if picked[0] in order:
                policy.touch(picked[0])
                order.remove(picked[0])
                order.append(picked[0])
        elif op == "touch many":
            policy.touch_many(picked)
            for b in picked:
                if b in order:
                    order.remove(b)
                    order.append(b)
        else:
            policy.touch_request(blocks[0].request)
            order.sort(key=lambda b: b.index)
        for i in range(2):
            assert list(policy._blocks.get(reqs[i][0].request, ())) == model[i]


def test_reuse_puts_a_long_request_back_in_order_without_walking_its_blocks():
    """A long request read whole step after step, a few of its blocks brought back or
    grown between reads (put at the end, out of index order): each read put every block
    back in index order by walking all of them (under `fair`, whose base is reuse, a
    whale's every step walked its 65,536 blocks on the loop other tenants wait on)."""
    policy = make_policy("reuse", FakeClock())
    blocks = _blocks(4096, rid="long")
    req = blocks[0].request
    for b in blocks:
        if b.index not in (100, 4000):
            policy.insert(b)
    req.live = _CountedWalks(blocks)
    policy.insert(blocks[4000])  # brought back after the others: out of order
    policy.insert(blocks[100])
    policy.touch_request(req)
    assert list(policy._blocks[req]) == blocks
    assert req.live.walks == 0
    policy.remove(blocks[4095])
    policy.insert(blocks[4095])  # in order: nothing to put back
    policy.touch_request(req)
    assert list(policy._blocks[req]) == blocks and req.live.walks == 0
