"""The pool's mechanism on a fake clock (invariants are checked after every test)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.blocks import Changes, Phase, Priority, Request, TierKind
from kvd.core.errors import (
    AlreadyExists,
    BlocksInTransit,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from kvd.core.fairness import TenantQuota
from kvd.core.holds import OWN_HOLDER
from kvd.core.intent import IntentChange
from kvd.core.policies import policy_names

from .conftest import PoolFactory, settle


def test_admission_admits_queues_and_rejects_by_capacity(make_pool):
    pool = make_pool(device_pages=4, host_pages=5)  # 8 reservable pages of 16 tokens
    assert pool.admit("a", tenant="t", prompt_tokens=64, output_tokens=0).decision == "admitted"
    too_big = pool.admit("whale", tenant="t", prompt_tokens=80, output_tokens=0)
    assert too_big.decision == "rejected" and "never be resident" in too_big.reason
    assert pool.admit("b", tenant="t", prompt_tokens=60, output_tokens=4).decision == "admitted"
    queued = pool.admit("c", tenant="t", prompt_tokens=1, output_tokens=0)
    assert (queued.decision, queued.queue_position) == ("queued", 1)
    with pytest.raises(FailedPrecondition, match="queued"):
        pool.allocate("c", 1)
    freed, admitted = pool.release("a")
    assert freed == 0 and [r.request_id for r in admitted] == ["c"]


def test_admission_bad_input(make_pool):
    pool = make_pool()
    with pytest.raises(InvalidArgument):
        pool.admit("", tenant="t", prompt_tokens=1, output_tokens=0)
    with pytest.raises(InvalidArgument):
        pool.admit("x", tenant="t", prompt_tokens=0, output_tokens=0)
    with pytest.raises(InvalidArgument):
        pool.admit("x", tenant="t", prompt_tokens=-1, output_tokens=5)
    pool.admit("x", tenant="t", prompt_tokens=1, output_tokens=0)
    with pytest.raises(AlreadyExists):
        pool.admit("x", tenant="t", prompt_tokens=1, output_tokens=0)


def test_queue_is_bounded(make_pool):
    pool = make_pool(device_pages=1, host_pages=0, max_queue=2)
    pool.admit("a", tenant="t", prompt_tokens=16, output_tokens=0)
    pool.admit("b", tenant="t", prompt_tokens=16, output_tokens=0)
    pool.admit("c", tenant="t", prompt_tokens=16, output_tokens=0)
    with pytest.raises(ResourceExhausted, match="share of the 2-entry queue is 2"):
        pool.admit("d", tenant="t", prompt_tokens=16, output_tokens=0)


def test_one_tenant_filling_the_queue_does_not_shut_another_out(make_pool):
    pool = make_pool(device_pages=64, host_pages=0, max_queue=8)
    pool.set_quota("flood", TenantQuota(limit=1))
    pool.admit("f0", tenant="flood", prompt_tokens=16, output_tokens=0)
    for i in range(1, 9):  # each waits on flood's own 1-page limit
        assert pool.admit(f"f{i}", tenant="flood", prompt_tokens=16,
                          output_tokens=0).decision == "queued"
    with pytest.raises(ResourceExhausted, match="share"):
        pool.admit("f9", tenant="flood", prompt_tokens=16, output_tokens=0)
    # Another tenant, holding nothing, with 63 pages free: admitted at once.
    assert pool.admit("v", tenant="victim", prompt_tokens=16,
                      output_tokens=0).decision == "admitted"
    # And while flood's requests wait, half the queue is the victim's to wait in.
    pool.set_quota("victim", TenantQuota(limit=1))
    for i in range(4):
        assert pool.admit(f"v{i}", tenant="victim", prompt_tokens=16,
                          output_tokens=0).decision == "queued"
    with pytest.raises(ResourceExhausted, match="share of the 8-entry queue is 4"):
        pool.admit("v4", tenant="victim", prompt_tokens=16, output_tokens=0)
    with pytest.raises(ResourceExhausted, match="tenant 'flood' has 8"):
        pool.admit("f10", tenant="flood", prompt_tokens=16, output_tokens=0)


def test_allocation_demotes_lru_victims_and_copies_before_commit(make_pool):
    pool = make_pool(device_pages=2, host_pages=4)
    pool.admit("a", tenant="t", prompt_tokens=32, output_tokens=0)
    pool.admit("b", tenant="t", prompt_tokens=32, output_tokens=0)
    settle(pool, pool.allocate("a", 2))
    plan = pool.allocate("b", 1)
    (move,) = plan.demotions
    victim = move.block
    assert victim.index == 0 and victim.request.request_id == "a"
    # Until completion the page table still says the victim is on the device.
    assert victim.moving and victim.tier is TierKind.DEVICE
    assert plan.allocated[0].page == move.src_page
    with pytest.raises(BlocksInTransit):
        pool.free("a", [0])
    pool.complete(plan)
    assert victim.tier is TierKind.HOST and not victim.moving
    assert pool.counters.num_demotions == 1


def test_access_promotes_without_evicting_its_own_blocks(make_pool):
    pool = make_pool(device_pages=3, host_pages=4)
    pool.admit("a", tenant="t", prompt_tokens=48, output_tokens=0)
    settle(pool, pool.allocate("a", 3))
    pool.admit("b", tenant="t", prompt_tokens=16, output_tokens=0)
    settle(pool, pool.allocate("b", 1))  # demotes a:0
    result = pool.access("a", None)
    victims = {m.block.request.request_id for m in result.plan.demotions}
    assert victims == {"b"}  # a's resident blocks were protected
    settle(pool, result.plan)
    assert all(b.tier is TierKind.DEVICE for b in pool.get_request("a").live_blocks())


@pytest.mark.parametrize("policy", ["lru", "fair"])
def test_reading_more_blocks_than_the_device_holds_is_refused_as_such(make_pool, policy):
    # Grown past the device a block at a time (each allocation demotes the oldest), the
    # request cannot be read whole: no retry ever could, and the refusal says so rather
    # than that some pages could not be freed. Its parts read as ever.
    pool = make_pool(device_pages=3, host_pages=8, policy=policy)
    assert pool.admit("a", tenant="t", prompt_tokens=16 * 3,
                      output_tokens=0).decision == "admitted"
    for _ in range(5):
        settle(pool, pool.allocate("a", 1))
    with pytest.raises(InvalidArgument, match="reading 5 blocks at once.* holds 3 pages"):
        pool.access("a", None)
    with pytest.raises(InvalidArgument, match="reading 4 blocks at once"):
        pool.access("a", [0, 1, 2, 3])
    settle(pool, pool.access("a", [0, 1, 2]).plan)
    assert [b.tier for b in pool.get_request("a").live_blocks()[:3]] == [TierKind.DEVICE] * 3


def test_abort_restores_everything(make_pool):
    pool = make_pool(device_pages=2, host_pages=4)
    pool.admit("a", tenant="t", prompt_tokens=32, output_tokens=0)
    pool.admit("b", tenant="t", prompt_tokens=32, output_tokens=0)
    settle(pool, pool.allocate("a", 2))
    pool.abort(pool.allocate("b", 2))
    assert pool.get_request("b").num_live_blocks == 0
    assert pool.device.num_free == 0 and pool.host.num_free == 4
    assert len(pool.policy) == 2


def test_an_aborted_allocation_of_a_decode_critical_block_leaves_no_count_behind(make_pool):
    """The block marked decode-critical while its allocation's copies ran goes with the
    abort, and its request's decode-critical count with it (reads meter by that count)."""
    pool = make_pool(device_pages=2, host_pages=4)
    pool.admit("a", tenant="t", prompt_tokens=32, output_tokens=0)
    pool.admit("b", tenant="t", prompt_tokens=32, output_tokens=0)
    settle(pool, pool.allocate("a", 2))
    plan = pool.allocate("b", 1)  # a block of a's goes to the host first
    settle(pool, pool.update_intents(
        [IntentChange("b", 0, {"priority": int(Priority.DECODE_CRITICAL)})]))
    assert pool.get_request("b").num_critical == 1
    pool.abort(plan)
    assert pool.get_request("b").num_live_blocks == 0
    assert pool.get_request("b").num_critical == 0


def test_pins_never_exceed_the_device_tier(make_pool):
    pool = make_pool(device_pages=2, host_pages=4, policy="intent")
    pool.admit("a", tenant="ta", prompt_tokens=32, output_tokens=0)
    pool.admit("b", tenant="tb", prompt_tokens=16, output_tokens=0)
    settle(pool, pool.allocate("a", 2))
    settle(pool, pool.allocate("b", 1))
    crit = {"priority": int(Priority.DECODE_CRITICAL)}
    settle(pool, pool.update_intents([IntentChange("a", 0, crit), IntentChange("b", 0, crit)]))
    with pytest.raises(ResourceExhausted, match=r"2 of 2 pages already pinned \(by tenant: ta: 1, tb: 1\)"):
        pool.update_intents([IntentChange("a", 1, {"pin_requested": True})])
    assert pool.num_pinned == 2
    assert all(b.tier is TierKind.DEVICE for b in (pool.get_request("a").blocks[0],
                                                   pool.get_request("b").blocks[0]))
    with pytest.raises(ResourceExhausted, match="2 of 2 pinned"):
        pool.allocate("a", 1)


def test_lru_is_blind_to_pins_and_hints_until_the_access(make_pool):
    pool = make_pool(device_pages=2, host_pages=4, policy="lru")
    pool.admit("a", tenant="t", prompt_tokens=32, output_tokens=0)
    pool.admit("b", tenant="t", prompt_tokens=16, output_tokens=0)
    settle(pool, pool.allocate("a", 2))
    settle(pool, pool.allocate("b", 1))  # a:0 demoted
    crit = {"priority": int(Priority.DECODE_CRITICAL)}
    assert pool.update_intents([IntentChange("a", 0, crit, prefetch=True)]) is None
    result = pool.access("a", [0])  # the pin is honoured, but only once it is resident
    assert result.plan is not None
    settle(pool, result.plan)
    assert pool.counters.num_decode_critical_misses == 1
    assert pool.get_request("a").blocks[0] not in pool.policy


def test_allocation_carries_intent_and_refuses_overpinning(make_pool):
    pool = make_pool(device_pages=2, host_pages=4, policy="intent")
    pool.admit("a", tenant="t", prompt_tokens=32, output_tokens=0)
    plan = settle(pool, pool.allocate("a", 1, {"priority": int(Priority.HOT), "deadline_us": 5}))
    assert plan.allocated[0].priority is Priority.HOT
    settle(pool, pool.allocate("a", 1, {"pin_requested": True}))
    assert pool.num_pinned == 1 and pool.device.num_free == 0
    with pytest.raises(ResourceExhausted, match="1 of 2 pages already pinned"):
        pool.allocate("a", 2, {"pin_requested": True})
    with pytest.raises(InvalidArgument, match="request_priority"):
        pool.allocate("a", 1, {"request_priority": -1})


def test_marking_decode_critical_prefetches_a_demoted_block(make_pool):
    pool = make_pool(device_pages=2, host_pages=4, policy="intent")
    pool.admit("a", tenant="t", prompt_tokens=32, output_tokens=0)
    pool.admit("b", tenant="t", prompt_tokens=16, output_tokens=0)
    settle(pool, pool.allocate("a", 2))
    settle(pool, pool.allocate("b", 1))  # a:0 demoted
    first = pool.get_request("a").blocks[0]
    assert first.tier is TierKind.HOST
    plan = pool.update_intents([IntentChange("a", 0, {"priority": int(Priority.DECODE_CRITICAL)})])
    assert [m.block for m in plan.promotions] == [first]
    settle(pool, plan)
    assert first.tier is TierKind.DEVICE and first not in pool.policy
    result = pool.access("a", [0])
    assert result.plan is None
    assert pool.counters.num_decode_critical_misses == 0
    assert pool.counters.num_decode_critical_accesses == 1


def test_update_intents_is_all_or_nothing(make_pool):
    pool = make_pool()
    pool.admit("a", tenant="t", prompt_tokens=32, output_tokens=0)
    settle(pool, pool.allocate("a", 2))
    with pytest.raises(InvalidArgument, match="request_priority"):
        pool.update_intents([IntentChange("a", 0, {"priority": int(Priority.COLD)}),
                             IntentChange("a", 1, {"request_priority": 101})])
    assert pool.get_request("a").blocks[0].priority is Priority.WARM
    with pytest.raises(InvalidArgument, match="unknown priority"):
        pool.update_intents([IntentChange("a", 0, {"priority": 99})])
    with pytest.raises(InvalidArgument, match="out of range"):
        pool.update_intents([IntentChange("a", 7, {"priority": 1})])


def test_deadline_is_absolute_on_kvds_clock(make_pool):
    pool = make_pool(policy="deadline")
    pool.admit("a", tenant="t", prompt_tokens=16, output_tokens=0)
    settle(pool, pool.allocate("a", 1))
    now = pool.clock.now()
    pool.update_intents([IntentChange("a", 0, {"deadline_us": 2_000_000})])
    assert pool.get_request("a").blocks[0].deadline_at == pytest.approx(now + 2.0)


def test_free_and_release_return_every_page(make_pool):
    pool = make_pool(device_pages=4, host_pages=3)
    pool.admit("a", tenant="t", prompt_tokens=64, output_tokens=0)
    settle(pool, pool.allocate("a", 4))
    pool.admit("b", tenant="t", prompt_tokens=32, output_tokens=0)
    settle(pool, pool.allocate("b", 2))  # demotes a:0 and a:1 to the host tier
    pool.release("b")
    assert pool.free("a", [1, 3]) == 2
    with pytest.raises(NotFound, match="freed"):
        pool.access("a", [1])
    with pytest.raises(InvalidArgument, match="duplicate"):
        pool.free("a", [0, 0])
    assert pool.release("a")[0] == 2
    assert pool.device.num_free == 4 and pool.host.num_free == 3 and pool.reserved_pages == 0


def test_evict_is_atomic(make_pool):
    pool = make_pool(device_pages=4, host_pages=4)
    pool.admit("a", tenant="t", prompt_tokens=64, output_tokens=0)
    settle(pool, pool.allocate("a", 4))
    pool.update_intents([IntentChange("a", 0, {"pin_requested": True})])
    with pytest.raises(ResourceExhausted, match="3 evictable"):
        pool.evict(4)
    assert pool.device.num_free == 0
    plan = settle(pool, pool.evict(3))
    assert len(plan.demotions) == 3 and pool.device.num_free == 3


def test_host_full_drops_only_recomputable_victims(make_pool):
    pool = make_pool(device_pages=2, host_pages=1)
    pool.admit("a", tenant="t", prompt_tokens=16, output_tokens=0)
    pool.admit("b", tenant="t", prompt_tokens=16, output_tokens=0)
    settle(pool, pool.allocate("a", 1))
    settle(pool, pool.allocate("b", 1))
    settle(pool, pool.evict(1))  # a:0 -> host, which is now full
    with pytest.raises(ResourceExhausted, match="host tier full"):
        pool.evict(1)
    pool.update_intents([IntentChange("b", 0, {"recompute_ok": True})])
    (drop,) = settle(pool, pool.evict(1)).demotions
    assert drop.kind.value == "drop" and drop.block.request.request_id == "b"
    dropped = pool.get_request("b").blocks[0]
    assert dropped.tier is TierKind.NONE and pool.counters.num_drops == 1
    result = pool.access("b", [0])
    assert result.plan.promotions[0].kind.value == "rematerialize"
    assert result.plan.num_copies == 0
    settle(pool, result.plan)
    assert dropped.tier is TierKind.DEVICE


def test_set_policy_carries_evictable_blocks_over(make_pool):
    pool = make_pool(device_pages=4)
    pool.admit("a", tenant="t", prompt_tokens=64, output_tokens=0)
    settle(pool, pool.allocate("a", 4))
    assert pool.set_policy("intent") == "lru"
    assert len(pool.policy) == 4 and pool.policy.name == "intent"
    with pytest.raises(InvalidArgument, match="choose one of deadline, intent, lru, regret, reuse, fair"):
        pool.set_policy("belady")


def test_a_sliding_window_stays_within_its_reservation(make_pool):
    pool = make_pool(device_pages=4, host_pages=4)
    pool.admit("w", tenant="t", prompt_tokens=32, output_tokens=0)  # 2 pages
    settle(pool, pool.allocate("w", 2))
    for step in range(10):  # drop the oldest block, add a new one
        pool.free("w", [step])
        settle(pool, pool.allocate("w", 1))
    req = pool.get_request("w")
    assert (req.reserved_pages, req.num_live_blocks, len(req.blocks)) == (2, 2, 12)
    assert pool.reserved_pages == 2


class _IndexTable(list):
    """A request's index table that refuses to be walked: what a read costs must not grow
    with the blocks its request freed before."""

    def __iter__(self):
        raise AssertionError("walked the request's index table, freed slots and all")


@pytest.mark.parametrize("policy", policy_names())
def test_reads_walk_the_blocks_a_request_holds_not_those_it_freed(make_pool, policy):
    pool = make_pool(device_pages=8, host_pages=8, policy=policy)
    pool.admit("w", tenant="t", prompt_tokens=64, output_tokens=0)
    settle(pool, pool.allocate("w", 3))
    pool.admit("o", tenant="t", prompt_tokens=48, output_tokens=0)  # the evictions' victims
    settle(pool, pool.allocate("o", 3))
    for step in range(3, 500):  # a decode loop that gives back what it no longer attends to
        settle(pool, pool.allocate("w", 1))
        pool.free("w", [step])
    req = pool.get_request("w")
    assert (req.num_live_blocks, len(req.blocks)) == (3, 500)
    table, req.blocks = req.blocks, _IndexTable(req.blocks)
    try:
        for _ in range(3):
            pool.read_all(["w"])
            pool.record_reads()
            pool.access("w", None, holder="engine")
            pool.end_holds("engine")
            pool.read_all(["w"])
            pool.hold_read([req], "engine")
            # A decision: the reads held become holds, those pending are recorded.
            settle(pool, pool.evict(1))
            pool.end_holds("engine")
        settle(pool, pool.allocate("w", 1))
        pool.free("w", [500])
    finally:
        req.blocks = list(table)
    assert [b.index for b in req.live] == [0, 1, 2]
    assert pool.counters.num_accesses == 3 * 3 * 3


def test_fair_admission_counts_only_pages_above_other_tenants_shares(make_pool):
    pool = make_pool(device_pages=8, host_pages=16, policy="fair")
    pool.admit("whale", tenant="w", prompt_tokens=16 * 8, output_tokens=0)
    settle(pool, pool.allocate("whale", 8))  # the whale fills the device tier
    # A minnow's fair share is half the device: it may take up to 4 of the whale's pages.
    assert pool.admit("m1", tenant="m", prompt_tokens=16 * 4, output_tokens=0).decision == "admitted"
    settle(pool, pool.allocate("m1", 4))
    assert pool.tenancy.device_by_tenant["w"] == 4 and pool.tenancy.device_by_tenant["m"] == 4
    # A tenant at its share is still admitted, but runs within that share: its new request
    # takes the minnow tenant's own pages, and the whale keeps its share.
    assert pool.admit("m2", tenant="m", prompt_tokens=16 * 2, output_tokens=0).decision == "admitted"
    plan = settle(pool, pool.allocate("m2", 2))
    assert "m" in {move.block.request.tenant for move in plan.demotions}
    assert pool.tenancy.device_by_tenant["w"] >= int(pool.tenancy.fair_share("w"))


def test_a_request_bigger_than_its_share_is_admitted_to_stream_through_host(make_pool):
    pool = make_pool(device_pages=8, host_pages=32, policy="fair")
    pool.admit("minnow", tenant="m", prompt_tokens=16 * 3, output_tokens=0)
    settle(pool, pool.allocate("minnow", 3))
    # The whale needs 8 pages but its fair share is 4 (7 shareable, 1 is the reserve).
    assert pool.admit("whale", tenant="w", prompt_tokens=16 * 8, output_tokens=0).decision == "admitted"
    for _ in range(2):  # chunked prefill: the second chunk evicts the whale's own first one
        settle(pool, pool.allocate("whale", 4))
    assert pool.tenancy.device_by_tenant["m"] == 3  # the minnow, within its share, lost nothing
    assert pool.get_request("whale").num_live_blocks == 8


class _UnwalkedQueue(OrderedDict):
    """An admission queue that fails a test walking it whole."""

    def _walked(self, *args):
        raise AssertionError("the whole queue walked")

    values = items = keys = __iter__ = _walked


def test_another_tenants_calls_do_not_walk_the_queue_one_tenant_filled(make_pool):
    # Every run of the line (each admit, and each release's) found its head with a walk
    # of the whole queue, as did a handoff pool's room growing: with one tenant's 1,024
    # requests waiting there, another tenant's admit, allocate and release took 2.9 ms at
    # the median against 1.8 ms, and 10 ms at the 99th percentile against 4.
    pool = make_pool(device_pages=64, host_pages=0, max_queue=64)
    assert _admit_for(pool, "big", "flood", 60)
    for i in range(40):  # none fits until big goes
        assert pool.admit(f"f{i}", tenant="flood", prompt_tokens=16 * 10,
                          output_tokens=0).decision == "queued"
    queue = pool.queue
    pool.queue = pool.admission.queue = _UnwalkedQueue(queue)
    try:
        for i in range(3):
            assert _admit_for(pool, f"v{i}", "victim", 1)
            settle(pool, pool.allocate(f"v{i}", 1))
            pool.release(f"v{i}")
        assert pool.admission.handoff_waiting["elsewhere"] == 0
    finally:
        pool.queue = pool.admission.queue = queue
    pool.release("big")  # the line goes on as before: flood's first six fit
    assert [r for r in ("f0", "f5", "f6") if r in pool.queue] == ["f6"]


def test_queue_positions_are_sorted_again_only_when_the_order_may_have_moved(make_pool,
                                                                          monkeypatch):
    # Each WaitAdmission stream asks its request's position after every change that may
    # move it, and each ask sorted the whole queue: with a thousand waiting, a change that
    # moved them all held the event loop for about a second.
    pool = make_pool(device_pages=64, host_pages=0, max_queue=256)
    assert _admit_for(pool, "big", "flood", 60)
    assert _admit_for(pool, "other", "victim", 2)
    for i in range(100):
        tenant = "flood" if i % 4 else "victim"
        assert pool.admit(f"q{i}", tenant=tenant, prompt_tokens=16 * 10,
                          output_tokens=0).decision == "queued"
    admission = pool.admission
    keys = 0
    queue_key = admission._queue_key

    def counted(req):
        nonlocal keys
        keys += 1
        return queue_key(req)

    monkeypatch.setattr(admission, "_queue_key", counted)
    positions = {f"q{i}": admission.queue_position(f"q{i}") for i in range(100)}
    assert sorted(positions.values()) == list(range(1, 101))
    assert keys <= 100 * 2  # one sort for all of them (n log n comparisons of n keys)
    keys = 0
    for i in range(3):  # another tenant comes and goes: nobody's position moves
        assert _admit_for(pool, f"v{i}", "third", 1)
        settle(pool, pool.allocate(f"v{i}", 1))
        pool.release(f"v{i}")
        assert admission.queue_positions() == positions
    assert keys <= 3 * 10  # runs of the line look at each tenant's first, not the queue
    pool.release("other")  # victim's standing changes: the order may move, and is sorted
    assert admission.queue_positions() == {
        r.request_id: i for i, r in enumerate(sorted(pool.queue.values(), key=queue_key), 1)}


def _admit_for(pool, rid: str, tenant: str, pages: int) -> bool:
    return pool.admit(rid, tenant=tenant, prompt_tokens=16 * pages,
                      output_tokens=0).decision == "admitted"


def test_queue_admits_the_tenant_furthest_below_its_share_first(make_pool):
    pool = make_pool(device_pages=8, host_pages=1)  # 8 reservable pages
    pool.admit("a1", tenant="a", prompt_tokens=16 * 6, output_tokens=0)
    pool.admit("b1", tenant="b", prompt_tokens=16 * 2, output_tokens=0)
    assert pool.admit("a2", tenant="a", prompt_tokens=16 * 2, output_tokens=0).decision == "queued"
    assert pool.admit("b2", tenant="b", prompt_tokens=16 * 2, output_tokens=0).decision == "queued"
    # a arrived first, but holds 6 pages against a fair share of 4; b holds 2 of its 4.
    assert pool.admission.queue_position("b2") == 1 and pool.admission.queue_position("a2") == 2
    _, admitted = pool.release("b1")  # room for one of them: b's, not first-come a's
    assert [r.request_id for r in admitted] == ["b2"]
    assert pool.admission.queue_position("a2") == 1


def test_limits_and_per_request_caps_reject_or_queue(make_pool):
    from kvd.core.fairness import TenantQuota

    pool = make_pool(device_pages=8, host_pages=16,
                     quotas={"t": TenantQuota(limit=6, max_request_fraction=0.5)})
    over_cap = pool.admit("big", tenant="t", prompt_tokens=16 * 5, output_tokens=0)
    assert over_cap.decision == "rejected" and "per-request cap of 4" in over_cap.reason
    assert pool.admit("r1", tenant="t", prompt_tokens=16 * 4, output_tokens=0).decision == "admitted"
    waiting = pool.admit("r2", tenant="t", prompt_tokens=16 * 3, output_tokens=0)
    assert waiting.decision == "queued" and "6-page limit" in waiting.reason
    admitted = pool.set_quota("t", TenantQuota(limit=8, max_request_fraction=0.5))
    assert [r.request_id for r in admitted] == ["r2"]


@pytest.mark.parametrize("admission", ["reservation", "working_set"])
def test_a_request_waiting_on_its_own_tenants_cap_holds_nobody_else_up(make_pool, admission):
    """a's part of its cluster limit here is 6 pages and a holds 4: a's next request, of 4,
    waits for a's own requests to finish, which nothing another tenant does can hasten. It
    keeps its place in line (first: a is furthest below its fair share) but holds nobody
    of another tenant up: b's request, which fits, goes in at once. a's own smaller request
    behind it, which would fit under a's cap, keeps waiting behind it: else a stream of
    those would take the room a's first waits for."""
    from kvd.core.fairness import TenantQuota

    pool = make_pool(device_pages=32, host_pages=32, policy="fair", admission=admission,
                     quotas={"a": TenantQuota(may_reserve=6)})
    assert pool.admit("a1", tenant="a", prompt_tokens=16 * 4, output_tokens=0).decision == "admitted"
    assert pool.admit("b1", tenant="b", prompt_tokens=16 * 8, output_tokens=0).decision == "admitted"
    waiting = pool.admit("a2", tenant="a", prompt_tokens=16 * 4, output_tokens=0)
    assert waiting.decision == "queued" and "cluster limit" in waiting.reason
    assert pool.admit("a3", tenant="a", prompt_tokens=16 * 2, output_tokens=0).decision == "queued"
    passed = pool.admit("b2", tenant="b", prompt_tokens=16 * 4, output_tokens=0)
    assert passed.decision == "admitted", passed.reason
    assert list(pool.queue) == ["a2", "a3"]
    _, admitted = pool.release("a1")  # a's own room back: a's requests go, in their order
    assert [r.request_id for r in admitted] == ["a2", "a3"]


@pytest.mark.parametrize("admission", ["reservation", "working_set"])
def test_a_request_waiting_on_its_tenants_cap_in_the_handoff_pool_holds_nobody_up(
        make_pool, admission):
    """a holds its 4-page limit in the decode pool (a request handed off and decoding
    there); a's next prefill request waits for a decode reservation that only a's own
    requests finishing can make room for. b's request behind it, whose decode reservation
    fits, is admitted at once rather than wait for a's decode to end."""
    from kvd.core.fairness import TenantQuota
    from kvd.core.reservation import PoolReserver

    pools = {}
    reserver = PoolReserver(lambda name: pools[name], ttl_s=30)
    pools["decode"] = decode = make_pool(name="decode", device_pages=32, host_pages=32,
                                         admission=admission,
                                         quotas={"a": TenantQuota(limit=4)})
    pools["prefill"] = prefill = make_pool(name="prefill", device_pages=32, host_pages=32,
                                           admission=admission, reserver=reserver)
    assert decode.admit("a0", tenant="a", prompt_tokens=16 * 4,
                        output_tokens=0).decision == "admitted"
    waiting = prefill.admit("a1", tenant="a", prompt_tokens=16 * 2, output_tokens=0,
                            handoff_pool="decode")
    assert waiting.decision == "queued" and "4-page limit" in waiting.reason
    passed = prefill.admit("b1", tenant="b", prompt_tokens=16 * 2, output_tokens=0,
                           handoff_pool="decode")
    assert passed.decision == "admitted", passed.reason
    assert list(prefill.queue) == ["a1"]
    decode.release("a0")
    assert [r.request_id for r in prefill.admit_waiting()] == ["a1"]
    for rid in ("a1", "b1"):  # never handed off: the decode reservations go too
        prefill.release(rid)
        decode.release(rid)


def test_explain_data_names_the_evictor_and_charges_it_the_stall(make_pool):
    pool = make_pool(device_pages=4, host_pages=8, policy="lru")
    pool.admit("minnow", tenant="m", prompt_tokens=32, output_tokens=0)
    settle(pool, pool.allocate("minnow", 2))
    pool.admit("whale", tenant="w", prompt_tokens=64, output_tokens=0)
    settle(pool, pool.allocate("whale", 4))  # pushes the minnow out
    result = pool.access("minnow", None)
    settle(pool, result.plan)
    pool.record_stall(0.5, result.plan)
    account = pool.attribution.account("minnow")
    assert account.evictions_suffered == {("w", "whale"): 2}
    assert account.stall_s_by_cause == {("w", "whale"): pytest.approx(0.5)}
    assert pool.attribution.account("whale").evictions_caused[("m", "minnow")] == 2
    assert pool.attribution.stall_s_by_cause[("m", "w")] == pytest.approx(0.5)
    pool.release("minnow")
    assert pool.attribution.account("minnow").stall_s == pytest.approx(0.5)  # kept after release


@pytest.mark.parametrize("policy", ["lru", "intent", "regret"])
def test_read_all_answers_at_once_and_records_the_reads_before_any_decision(make_pool, policy):
    pool = make_pool(device_pages=4, host_pages=8, policy=policy)
    deferred = []
    pool.defer = deferred.append  # as the runtime does: the reads are recorded on a later turn
    t0 = make_pool.clock.now()
    for rid in ("old", "new"):
        pool.admit(rid, tenant="t", prompt_tokens=32, output_tokens=0)
        settle(pool, pool.allocate(rid, 2))
        make_pool.clock.advance(1.0)
    general, relocated, answered = pool.read_all(["old", "gone"])
    assert general == ["gone"] and relocated == [] and answered == [pool.requests["old"]]
    assert deferred == [pool.record_some_reads]  # one call scheduled, nothing recorded yet
    assert pool.counters.num_accesses == 0
    assert {b.last_access for b in pool.requests["old"].blocks} == {t0}
    pool.read_all(["old"])
    assert len(deferred) == 1  # already scheduled
    # The next decision sees the reads: "old" was read last, so "new" pays for the room.
    plan = pool.evict(2)
    assert {m.block.request.request_id for m in plan.demotions} == {"new"}
    assert pool.counters.num_accesses == 4
    assert {b.last_access for b in pool.requests["old"].blocks} == {t0 + 2.0}
    settle(pool, plan)
    deferred[0]()  # the scheduled call finds nothing left to record
    assert pool.counters.num_accesses == 4


@pytest.mark.parametrize("policy", ["lru", "intent", "deadline", "regret", "reuse", "fair"])
@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 3), st.one_of(
    st.sampled_from([[0, 1, 2], [3, 1], [4, 0, 4]]),  # batches read again and again
    st.lists(st.integers(0, 4), max_size=6))), min_size=1, max_size=12))
def test_reads_recorded_together_leave_what_one_by_one_would(policy, steps):
    """Steps read faster than the runtime records them: recording them all at once leaves
    the same recency, reuse distances, counters, metering and eviction order as recording
    each step's reads as it came (a step repeating the last one is answered without checks
    and recorded with it)."""
    factory = PoolFactory()
    pools = [factory(device_pages=32, host_pages=8, policy=policy) for _ in range(2)]
    now_, later = pools
    deferred = []
    later.defer = deferred.append
    rids = [f"r{i}" for i in range(5)]
    for pool in pools:
        for rid in rids:
            pool.admit(rid, tenant="t", prompt_tokens=48, output_tokens=0)
            settle(pool, pool.allocate(rid, 3))
        crit = {"priority": int(Priority.DECODE_CRITICAL)}
        settle(pool, pool.update_intents([IntentChange("r1", 0, crit)]))
    for advance_ms, read in steps:
        factory.clock.advance(advance_ms / 1000)
        for pool in pools:
            pool.read_all([rids[i] for i in read])
    assert later.counters.num_accesses == 0  # nothing recorded until asked
    assert now_.counters.num_accesses == 3 * sum(len(read) for _, read in steps)
    later.record_reads()

    def state(pool):
        blocks = [b for rid in rids for b in pool.requests[rid].blocks]
        return ([(b.last_access, b.reuse_s) for b in blocks],
                [pool.requests[rid].blocks_read for rid in rids],
                dict(pool.tenancy.blocks_read_by_tenant), pool.counters,
                [(b.request.request_id, b.index) for b in pool.policy.choose(14)])
    assert state(later) == state(now_)
    assert len(deferred) == (1 if any(read for _, read in steps) else 0)


@pytest.mark.parametrize("policy", ["fair", "fair:lru", "fair:intent", "fair:deadline",
                                    "fair:regret", "lru", "reuse", "intent", "deadline",
                                    "regret"])
@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(
    st.integers(1, 3),
    st.sampled_from([[0, 1, 2, 3], [0, 1, 2, 3], [1, 3], []]),
    st.sampled_from(["grow", "free", "grow held", "critical", "calm", "priority", "priority 1",
                     "none"]),
    st.integers(0, 3)), min_size=1, max_size=16))
def test_reads_left_pending_across_block_changes_leave_what_recording_first_would(policy,
                                                                                  steps):
    """An engine's Step message ends the holds of its last, then updates intents (a block
    decode-critical or not any more, a request's priority), allocates and frees, then reads.
    Under a policy that orders each request's blocks apart, those changes leave the reads
    pending; recorded later (or first thing when an eviction must choose) they leave
    the recency, reuse distances, metering, counters and eviction order that recording them
    before each change leaves."""
    factory = PoolFactory()
    pools = [factory(device_pages=40, host_pages=40, policy=policy, admission="reservation")
             for _ in range(2)]
    first, later = pools
    later.defer = lambda fn: None  # recorded only when something needs them
    rids = [f"r{i}" for i in range(4)]
    grown = {pool: {rid: [] for rid in rids} for pool in pools}
    expected = [0, 0]  # blocks read, decode-critical blocks read
    for pool in pools:
        for rid in rids:
            pool.admit(rid, tenant=rid[-1] if rid != "r3" else "0", prompt_tokens=48,
                       output_tokens=64)
            settle(pool, pool.allocate(rid, 3))
        crit = {"priority": int(Priority.DECODE_CRITICAL)}
        settle(pool, pool.update_intents([IntentChange("r1", 0, crit)]))
    base = (first.counters.num_accesses, first.counters.num_decode_critical_accesses)
    for advance_ms, read, op, who in steps:
        factory.clock.advance(advance_ms / 1000)
        rid = rids[who]
        for pool in pools:
            pool.end_holds("e")
            if op in ("grow", "grow held") and len(grown[pool][rid]) < 3:
                plan = pool.allocate(rid, 1, holder="e" if op == "grow held" else "")
                settle(pool, plan)
                grown[pool][rid].append(plan.allocated[0].index)
            elif op == "free" and grown[pool][rid]:
                pool.free(rid, [grown[pool][rid].pop(0)])
            elif op in ("critical", "calm"):
                phase = Phase.DECODE if op == "critical" else Phase.PREFILL
                settle(pool, pool.update_intents([IntentChange(rid, 1, {"phase": phase})]))
            elif op in ("priority", "priority 1"):  # a block (or two) in a class of its own
                index = 1 if op == "priority 1" else 2
                settle(pool, pool.update_intents([IntentChange(rid, index,
                                                               {"request_priority": 7})]))
        factory.clock.advance(advance_ms / 1000)
        for i in read:  # what the reads must count, from the blocks as they are now
            live = [b for b in first.requests[rids[i]].blocks if b is not None]
            expected[0] += len(live)
            expected[1] += sum(b.decode_critical for b in live)
        for pool in pools:
            pool.read_all([rids[i] for i in read])
        first.record_reads()
    before = (first.counters.num_accesses, first.counters.num_decode_critical_accesses)
    assert later.counters.num_accesses <= first.counters.num_accesses
    # An eviction's choice records the pending reads first: the same victims.
    evicted = [[(m.block.request.request_id, m.block.index) for m in settle(p, p.evict(5))
                .demotions] for p in pools]
    assert evicted[0] == evicted[1]
    later.record_reads()
    assert _read_state(later, rids) == _read_state(first, rids)
    # The steps' reads added exactly what they read.
    assert (first.counters.num_accesses, first.counters.num_decode_critical_accesses) == (
        before[0], before[1]) and before[0] - base[0] == expected[0] and (
        before[1] - base[1] == expected[1])


@pytest.mark.parametrize("policy", ["lru", "regret", "intent", "deadline", "fair:intent",
                                    "fair:deadline", "fair"])
def test_an_engine_step_records_no_reads_and_leaves_the_exact_order(policy):
    """An engine step ends its holds, grows and frees blocks, then reads. Under LRU, whose
    order is every block's last read or insert (and regret's, level by level), and under
    the policies that queue a block with the last read they have seen (intent, deadline,
    alone or under fair), the reads of the steps before
    stay pending across those changes (recording them at each change cost a step as much as
    the rest of it), and recorded later they leave the order recording them first leaves:
    a block allocated or let go by a hold between two reads stands between those reads'
    blocks (under intent and deadline, within its class)."""
    factory = PoolFactory()
    pools = [factory(device_pages=64, host_pages=16, policy=policy) for _ in range(2)]
    first, later = pools
    later.defer = lambda fn: None  # recorded only when something needs them
    rids = ["a", "b", "c", "d"]
    for pool in pools:
        for rid in rids:
            pool.admit(rid, tenant="t", prompt_tokens=32, output_tokens=64)
            settle(pool, pool.allocate(rid, 2))
        first.record_reads()
    steps = [(["a", "b"], "c", None), (["c"], "d", "e"), (["a"], "b", None),
             (["d", "b"], "a", "e"), (["b"], "c", "e")]
    for batch, grow, holder in steps:
        factory.clock.advance(0.01)
        for pool in pools:
            pool.end_holds("e")
            settle(pool, pool.allocate(grow, 1, holder=holder or ""))
        accesses = later.counters.num_accesses
        factory.clock.advance(0.01)
        for pool in pools:
            pool.read_all(batch)
        first.record_reads()
        if batch != steps[0][0]:
            assert later.counters.num_accesses == accesses, "a block change recorded reads"
    for pool in pools:
        pool.end_holds("e")
    assert later.reads.pending
    later.record_reads()
    assert _read_state(later, rids) == _read_state(first, rids)


def _read_state(pool, rids):
    """What recording reads leaves: each live block's recency and reuse distance, the
    metering by request and tenant, the counters, and the eviction order."""
    blocks = [b for rid in rids for b in pool.requests[rid].blocks if b is not None]
    return ([(b.request.request_id, b.index, b.last_access, b.reuse_s) for b in blocks],
            [pool.requests[rid].blocks_read for rid in rids],
            dict(pool.tenancy.blocks_read_by_tenant), pool.counters,
            [(b.request.request_id, b.index) for b in pool.policy.choose(len(pool.policy))])


def _not_readable(pool, rids):
    """The requests a read must not answer at once: some live block off the device tier or
    moving (what the checks the answers skip would find)."""
    return [rid for rid in rids
            if any(b.tier is not TierKind.DEVICE or b.moving
                   for b in pool.requests[rid].live_blocks())]


def _blocks_read(pool, batch) -> int:
    """Read the batch, answered at once; the blocks the read counted (the pool's count, which
    each request's and each tenant's metering must match)."""

    def metered():
        requests = [pool.requests[rid] for rid in dict.fromkeys(batch)]  # each once
        by_tenant = pool.tenancy.blocks_read_by_tenant
        return (pool.counters.num_accesses, sum(req.blocks_read for req in requests),
                sum(by_tenant[tenant] for tenant in {req.tenant for req in requests}))

    before = metered()
    assert pool.read_all(batch)[:2] == ([], [])
    pool.record_reads()
    counted, by_request, by_tenant = (now - then for now, then in zip(metered(), before))
    assert by_request == by_tenant == counted
    return counted


def test_a_read_answered_before_follows_blocks_added_freed_and_moved(make_pool):
    """An engine's steps read the same batch while they grow and free its requests: the
    answer kept for the batch must count the blocks as they are, and must not be given once
    a block of the batch has left the device tier, even by an eviction inside an allocation
    (which, unlike the pool's other methods, forgets no answer)."""
    pool = make_pool(device_pages=6, host_pages=8, policy="lru")
    for rid in ("a", "b", "c"):
        pool.admit(rid, tenant="t", prompt_tokens=64, output_tokens=0)
    settle(pool, pool.allocate("a", 2))
    settle(pool, pool.allocate("b", 2))
    batch = ["a", "b"]

    def read() -> int:
        return _blocks_read(pool, batch)

    assert read() == 4
    assert read() == 4  # answered from the answer kept
    settle(pool, pool.allocate("a", 1))  # a block added: counted
    assert read() == 5
    pool.free("b", [0])  # a block freed: not counted
    assert read() == 4
    settle(pool, pool.update_intents([IntentChange("a", 2, {"phase": Phase.DECODE})]))
    critical = pool.counters.num_decode_critical_accesses
    assert read() == 4
    assert pool.counters.num_decode_critical_accesses == critical + 1  # now decode-critical
    # c's three blocks need a page that only an eviction frees: a block of the batch (the
    # least recently read) leaves the device tier from inside allocate().
    plan = pool.allocate("c", 3)
    gone = _not_readable(pool, batch)
    assert gone  # the eviction took one of the batch's blocks
    assert pool.read_all(batch)[0] == gone  # in transit: the general path
    settle(pool, plan)
    assert pool.read_all(batch)[0] == _not_readable(pool, batch) == gone  # on the host now


def test_a_kept_answer_counts_a_request_named_twice_at_each_place(make_pool):
    """A batch that names a request twice counts its blocks twice, as they are now, also
    after blocks were added to it and freed since the answer was kept."""
    pool = make_pool(device_pages=8, host_pages=8, policy="lru")
    for rid in ("a", "b"):
        pool.admit(rid, tenant="t", prompt_tokens=64, output_tokens=0)
        settle(pool, pool.allocate(rid, 1))
    batch = ["a", "b", "a"]

    def read() -> int:
        return _blocks_read(pool, batch)

    assert read() == 3
    settle(pool, pool.allocate("a", 2))
    assert read() == 7
    pool.free("a", [0])
    assert read() == 5


def test_a_kept_answer_outlived_by_its_changes_is_given_again_in_full(make_pool, monkeypatch):
    """Changes keep only the last LIMIT requests noted: an answer kept from before them
    cannot know which of its requests changed, and must look at all of them again."""
    monkeypatch.setattr(Changes, "LIMIT", 4)
    pool = make_pool(device_pages=16, host_pages=8, policy="lru")
    for rid in ("a", "b", "c"):
        pool.admit(rid, tenant="t", prompt_tokens=64, output_tokens=0)
        settle(pool, pool.allocate(rid, 1))

    def read(batch) -> int:
        return _blocks_read(pool, batch)

    assert read(["a", "b"]) == 2
    settle(pool, pool.allocate("a", 1))  # noted first: forgotten by what comes next
    for _ in range(2):
        settle(pool, pool.allocate("c", 1))
        pool.free("c", [len(pool.requests["c"].blocks) - 1])
    assert read(["a", "b"]) == 3


def test_a_new_block_still_being_placed_is_not_answered_at_once(make_pool):
    """A block allocated into a page whose victim is still being copied out is moving: a
    read of its request waits on the general path, though the request was answered before."""
    pool = make_pool(device_pages=4, host_pages=8, policy="lru")
    for rid in ("a", "b"):
        pool.admit(rid, tenant="t", prompt_tokens=64, output_tokens=0)
    settle(pool, pool.allocate("a", 2))
    settle(pool, pool.allocate("b", 2))
    assert pool.read_all(["b"])[:2] == ([], [])
    plan = pool.allocate("b", 1)  # the device is full: a's oldest block makes room
    assert plan.demotions and plan.allocated[0].moving
    assert pool.read_all(["b"])[0] == ["b"]
    settle(pool, plan)
    assert pool.read_all(["b"])[:2] == ([], [])


def test_a_repeated_read_all_is_checked_again_once_anything_changed(make_pool):
    pool = make_pool(device_pages=4, host_pages=8, policy="lru")
    for rid in ("a", "b"):
        pool.admit(rid, tenant="t", prompt_tokens=32, output_tokens=0)
        settle(pool, pool.allocate(rid, 2))
    assert pool.read_all(["a", "b"])[:2] == ([], [])
    assert pool.read_all(["a", "b"])[:2] == ([], [])  # answered from the last answer
    assert pool.read_all(["a\0b"])[:2] == (["a\0b"], [])  # joins alike, is not the same read
    assert pool.read_all(["a", "b"], key=b"k")[:2] == ([], [])  # a caller's key for the list
    assert pool.read_all(["a", "b"], key=b"k")[:2] == ([], [])
    assert pool.read_all(["a", "b"])[:2] == ([], [])  # the same list without the key: checked
    with pytest.raises(InvalidArgument, match=r"control characters \(found \\x00\)"):
        pool.admit("c\0d", tenant="t", prompt_tokens=16, output_tokens=0)
    assert pool.read_all(["a", "b"], tenant="other")[:2] == (["a", "b"], [])  # not another scope
    plan = pool.evict(2)  # the pool changed: "a" (read longest ago) leaves the device tier
    assert pool.read_all(["a", "b"])[:2] == (["a"], [])  # in transit: the general path
    settle(pool, plan)
    assert pool.read_all(["a", "b"])[:2] == (["a"], [])  # on the host tier now
    pool.release("b")
    assert pool.read_all(["b"])[:2] == (["b"], [])  # gone: the general path says so
    assert pool.counters.num_accesses == 5 * 4 + 2 + 2  # each read answered at once counts


def test_a_decode_step_holds_its_read_where_the_last_holds_were_taken_block_by_block(make_pool):
    """A step's read is held by request until victims are looked for, then block by block. The
    decode step after (the same read again, see Node.read_again) ends those holds and holds
    its read in their place: victims looked for after it still cannot take those pages."""
    pool = make_pool(device_pages=4, host_pages=16, policy="lru")
    pool.admit("x", tenant="t", prompt_tokens=64, output_tokens=0)
    settle(pool, pool.allocate("x", 4))  # the whole device
    pool.admit("y", tenant="t", prompt_tokens=16, output_tokens=0)
    _, _, answered = pool.read_all(["x"])
    pool.hold_read(answered, "engine")
    with pytest.raises(BlocksInTransit):  # the caller waits for the holds to end
        pool.allocate("y", 1)  # only x's pages, held
    assert not pool.pages.holds.only_requests("engine")  # held block by block now
    pool.end_holds("engine")
    assert pool.read_again("x", 1, None, "engine")  # the kept answer still holds
    with pytest.raises(BlocksInTransit):
        pool.allocate("y", 1)
    assert all(b.tier is TierKind.DEVICE for b in pool.requests["x"].live_blocks())
    pool.end_holds("engine")
    settle(pool, pool.allocate("y", 1))  # the engine's next call gave them back


@pytest.mark.parametrize("policy", policy_names())
def test_an_access_that_finds_no_room_leaves_the_eviction_order_as_it_was(make_pool, policy):
    # The blocks an access reads are protected from its own evictions. They used to be taken
    # out of the policy and put back around the call, so an access that failed for lack of
    # room still moved them to the back of the eviction order (under lru: most recently used,
    # though nothing was read).
    pool = make_pool(device_pages=5, host_pages=16, policy=policy)
    for rid, tokens in (("r", 48), ("u", 16), ("p", 48)):
        pool.admit(rid, tenant="t", prompt_tokens=tokens, output_tokens=0)
    settle(pool, pool.allocate("r", 2))
    settle(pool, pool.evict(2))  # r's first two blocks go to the host tier
    pool.clock.advance(1.0)
    settle(pool, pool.allocate("r", 1))
    pool.clock.advance(1.0)
    settle(pool, pool.allocate("u", 1))
    settle(pool, pool.allocate("p", 3, {"pin_requested": True}))
    assert pool.device.num_free == 0 and len(pool.policy) == 2
    order = pool.policy.choose(2)
    with pytest.raises(ResourceExhausted, match="cannot free 2 device page"):
        pool.access("r", None)  # needs 2 pages; only u's block is evictable
    assert pool.policy.choose(2) == order
    if policy == "lru":
        assert [b.request.request_id for b in order] == ["r", "u"]


@pytest.mark.parametrize("policy", policy_names())
@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 3), steps=st.lists(st.tuples(
    st.integers(0, 3),
    st.sampled_from([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [4, 2], [1, 1, 3], []]),
    st.sampled_from(["grow", "free", "release", "none", "none"]),
    st.integers(0, 4),
    st.integers(0, 3)), min_size=1, max_size=14))
def test_reads_recorded_a_slice_at_a_time_leave_what_recording_each_step_would(
        policy, size, steps):
    """The runtime records a batch of reads a few requests at a time, the event loop serving
    steps in between: reads, frees, allocations and releases come between the slices. That
    leaves the recency, reuse distances, metering, counters and eviction order that
    recording each step's reads as it came leaves."""
    factory = PoolFactory()
    pools = [factory(device_pages=48, host_pages=48, policy=policy, admission="reservation")
             for _ in range(2)]
    first, later = pools
    due = []  # the calls later's reads are deferred to, as the runtime makes them
    later.defer = due.append
    later.reads.slice = size
    rids = [f"r{i}" for i in range(5)]
    grown = {pool: {rid: [] for rid in rids} for pool in pools}
    for pool in pools:
        for rid in rids:
            pool.admit(rid, tenant=rid[-1], prompt_tokens=48, output_tokens=64)
            settle(pool, pool.allocate(rid, 3))
    for advance_ms, read, op, who, calls in steps:
        factory.clock.advance(advance_ms / 1000)
        rid = rids[who]
        for pool in pools:
            if op == "grow" and len(grown[pool][rid]) < 3:
                plan = pool.allocate(rid, 1)
                settle(pool, plan)
                grown[pool][rid].append(plan.allocated[0].index)
            elif op == "free" and grown[pool][rid]:
                pool.free(rid, [grown[pool][rid].pop(0)])
            elif op == "release":
                pool.release(rid)
                pool.admit(rid, tenant=rid[-1], prompt_tokens=48, output_tokens=64)
                settle(pool, pool.allocate(rid, 3))
                grown[pool][rid] = []
            pool.read_all([rids[i] for i in read])
        first.record_reads()
        for _ in range(calls):  # the loop's turns before the next step
            if due and due.pop(0)():
                due.append(later.record_some_reads)  # more left: again on the next turn
        # Reads left to record always have a call due: none waits for a decision to come.
        assert due or not (later.reads.pending or later.reads._recording)
        assert later.counters.num_accesses <= first.counters.num_accesses
    assert len(due) <= 1  # never more than one call due
    later.record_reads()
    assert _read_state(later, rids) == _read_state(first, rids)


class _Unwalked(dict):
    """A pool's request table that refuses to be walked: looking for the blocks in transit
    must not cost a walk of every request (a call waiting for room looked, and the stuck
    check four times a second)."""

    def __iter__(self):
        raise AssertionError("walked every request to find the blocks in transit")

    values = items = keys = __iter__


@pytest.mark.parametrize("policy", policy_names())
def test_blocks_in_transit_are_found_without_walking_every_request(make_pool, policy):
    pool = make_pool(device_pages=8, host_pages=16, policy=policy)
    for i in range(4):
        pool.admit(f"r{i}", tenant="t", prompt_tokens=32, output_tokens=0)
        settle(pool, pool.allocate(f"r{i}", 2))
    pool.admit("new", tenant="t", prompt_tokens=32, output_tokens=0)
    plan = pool.allocate("new", 2)  # two victims demoted, two new blocks written
    table = pool.pages.requests
    moving = {r.request_id: r.num_moving_blocks for r in table.values() if r.num_moving_blocks}
    assert sum(moving.values()) == 4 and "new" in moving
    pool.pages.requests = _Unwalked(table)
    try:
        assert pool.pages.num_moving_blocks() == 4
        assert {r.request_id: r.num_moving_blocks
                for r in pool.pages.moving_requests()} == moving
    finally:
        pool.pages.requests = table
    settle(pool, plan)
    assert pool.pages.num_moving_blocks() == 0 and not pool.pages.moving_requests()


def test_a_block_index_past_the_last_a_request_may_have_is_refused(make_pool):
    """A handoff places blocks at the indices they had, gaps included, and a request's blocks
    are a list by index: block 49,609,919 of a one-block request was a list that long, made
    in 12 s on kvd's loop. Past MAX_BLOCK_INDEX it is refused, and nothing changes."""
    from kvd.core.pages import MAX_BLOCK_INDEX
    from kvd.core.transfer import Reason

    pool = make_pool(device_pages=4, host_pages=4)
    pool.admit("r", tenant="t", prompt_tokens=16, output_tokens=0)
    with pytest.raises(InvalidArgument, match=f"past the last a request may have "
                                              f"\\({MAX_BLOCK_INDEX}\\)"):
        pool.allocate("r", 1, indices=[49609919], reason=Reason.HANDOFF)
    assert pool.requests["r"].blocks == [] and pool.device.num_used == 0
    settle(pool, pool.allocate("r", 1, indices=[MAX_BLOCK_INDEX], reason=Reason.HANDOFF))
    assert [b.index for b in pool.requests["r"].live_blocks()] == [MAX_BLOCK_INDEX]
    pool.release("r")


def test_a_free_keeps_the_pages_another_holder_reads_until_its_next_call(make_pool):
    """Blocks freed while another holder holds them (by request, its step's read, or by
    block, its allocation) keep their pages out of use until that holder calls again; a
    holder whose read moved on to other requests keeps nothing of the ones it left."""
    pool = make_pool(device_pages=4, host_pages=16, policy="lru")
    for rid in ("a", "b"):
        pool.admit(rid, tenant="t", prompt_tokens=32, output_tokens=0)
        settle(pool, pool.allocate(rid, 1))
    _, _, answered = pool.read_all(["a"])
    pool.hold_read(answered, "reader")  # by request: its blocks stay in the policy
    _, _, answered = pool.read_all(["b"])
    pool.hold_read(answered, "other")
    pool.end_holds("other")
    _, _, answered = pool.read_all(["a"])  # a read of a new list: "other" holds a now
    pool.hold_read(answered, "other")
    settle(pool, pool.allocate("b", 1, holder="writer"))  # by block: it writes it
    page_a = pool.requests["a"].blocks[0].page
    page_b = pool.requests["b"].blocks[1].page
    pool.free("a", [0])
    pool.free("b", [0, 1])  # b's first block nobody holds now: its page comes free
    assert pool.pages.holds.kept == {page_a: {"reader", "other"}, page_b: {"writer"}}
    assert pool.device.num_free == 2  # the one free before, and b's first block's
    pool.end_holds("reader")
    assert pool.device.num_free == 2  # "other" still reads a's old page
    pool.end_holds("other")
    pool.end_holds("writer")
    assert pool.device.num_free == 4 and not pool.pages.holds.kept


def test_a_handoff_knows_the_holders_that_may_still_write_a_request_and_their_next_calls(
        make_pool):
    """Holds.writers: the clients' holders of a request's device blocks, by block (an
    allocation) or by request (a step's read), kvd's own not among them; called_again says
    when each called again (its holds ended, were replaced by a new read's, or lapsed), and
    the watchers are told each time."""
    pool = make_pool(device_pages=8, host_pages=16, policy="lru")
    for rid in ("a", "b"):
        pool.admit(rid, tenant="t", prompt_tokens=32, output_tokens=0)
        settle(pool, pool.allocate(rid, 1))
    holds = pool.pages.holds
    told = []
    holds.watchers.append(lambda: told.append(1))
    _, _, answered = pool.read_all(["a"])
    pool.hold_read(answered, "reader")
    settle(pool, pool.allocate("a", 1, holder="writer"))
    holds.hold(OWN_HOLDER + "work", pool.requests["a"].live_blocks())
    _, _, answered = pool.read_all(["b"])
    pool.hold_read(answered, "elsewhere")
    writers = holds.writers(pool.requests["a"])
    assert set(writers) == {"reader", "writer"}
    assert not any(holds.called_again(h, e) for h, e in writers.items())
    assert set(holds.writers(pool.requests["b"])) == {"elsewhere"}
    holds.hold_again("reader", [pool.requests["a"]])  # its next step reads a again (the
    # fast path: a read of the same requests replaces its entry)
    assert holds.called_again("reader", writers["reader"]) and told == [1]
    pool.end_holds("writer")
    assert holds.called_again("writer", writers["writer"]) and told == [1, 1]
    assert holds.end_if_only_requests("elsewhere")  # (the node's way for reads only)
    assert told == [1, 1, 1]
    pool.end_holds(OWN_HOLDER + "work")
    assert set(holds.writers(pool.requests["a"])) == {"reader"}  # its new read's


class _CountedLookups:
    """A module's TierKind that counts the lookups of its members."""

    def __init__(self, real) -> None:
        self.real, self.lookups = real, 0

    def __getattr__(self, name: str):
        self.lookups += 1
        return getattr(self.real, name)


@pytest.mark.parametrize("policy", policy_names())
def test_a_whole_read_missing_a_few_blocks_looks_at_those_only(make_pool, monkeypatch,
                                                                policy):
    """A read of a whole long request that misses a few blocks (under `fair`, a request over
    its share reads this way every step: the refill demotes, its read brings back) found
    them by looking at each of its blocks, and checked each for a copy under way, on a copy
    of its list of blocks, on the loop every other tenant's call waits on."""
    import kvd.core.reads as reads

    pool = make_pool(device_pages=600, host_pages=16, policy=policy)
    pool.admit("long", tenant="t", prompt_tokens=16 * 512, output_tokens=0)
    settle(pool, pool.allocate("long", 512))
    req = pool.requests["long"]
    settle(pool, pool.evict(3))
    gone = sorted(b.index for b in req.live if b.tier is TierKind.HOST)
    assert len(gone) == 3
    tiers = _CountedLookups(TierKind)
    checked: list[int] = []
    monkeypatch.setattr(reads, "TierKind", tiers)
    monkeypatch.setattr(reads, "check_still", lambda blocks: checked.append(len(blocks)))
    copies = []
    monkeypatch.setattr(Request, "live_blocks", lambda req: copies.append(req) or [])
    result = pool.access("long", None)
    monkeypatch.undo()
    assert [m.block.index for m in result.plan.promotions] == gone
    assert tiers.lookups == 0 and checked == [] and copies == []
    assert result.blocks is None  # the request's live blocks, when the caller wants them
    settle(pool, result.plan)
    assert req.num_device_blocks == 512 and not req.off_device


def test_a_whole_read_reports_the_blocks_that_moved_without_looking_at_the_others(make_pool):
    """The reply to a whole read through the general path reports the blocks whose page
    changed since the engine was told: it found them by looking at each block of the
    request (65,536 a step for a long context over its share under `fair`)."""
    from kvd.service.step import _relocated
    from kvd_api.v1 import kvd_pb2 as pb

    from .test_policies import _CountedWalks

    pool = make_pool(device_pages=600, host_pages=16, policy="lru")
    pool.admit("long", tenant="t", prompt_tokens=16 * 512, output_tokens=0)
    settle(pool, pool.allocate("long", 512))
    req = pool.requests["long"]
    reply = pb.StepResponse()
    _relocated(reply, pool.access("long", None), pool.page_bytes)  # told of every page
    settle(pool, pool.evict(3))
    result = pool.access("long", None)
    settle(pool, result.plan)
    moved = sorted(m.block.index for m in result.plan.promotions)
    assert result.blocks is None  # the whole request: the caller takes its live blocks
    result.blocks = _CountedWalks(req.live_blocks())  # or a list of them all
    reply = pb.StepResponse()
    _relocated(reply, result, pool.page_bytes)
    assert [h.block_index for h in reply.relocated] == moved
    assert [h.page_index for h in reply.relocated] == [req.blocks[i].page for i in moved]
    assert result.blocks.walks == 0
    reply = pb.StepResponse()
    _relocated(reply, pool.access("long", None), pool.page_bytes)
    assert list(reply.relocated) == []  # told once
