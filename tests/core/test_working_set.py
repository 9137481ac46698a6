"""Working-set admission: admitted requests' pages (what each grows to by its end, a shared
prefix page once, a whale under a fair policy counted for its fair share) stay within the
device tier; the rest wait in fair order (invariants checked after every test)."""

from __future__ import annotations

import pytest

from kvd.core.errors import InvalidArgument, ResourceExhausted
from kvd.core.fairness import TenantQuota

from .conftest import settle

NS = "m"


def _decision(pool, rid, pages, tenant="t", output_pages=0):
    """Admit a request of `pages` prompt pages (16 tokens each) and `output_pages` more."""
    return pool.admit(rid, tenant=tenant, prompt_tokens=16 * pages,
                      output_tokens=16 * output_pages)


@pytest.mark.parametrize("policy", ["lru", "intent", "deadline", "reuse", "regret"])
def test_admission_stops_where_the_working_sets_fill_the_device(make_pool, policy):
    pool = make_pool(device_pages=8, host_pages=32, policy=policy, admission="working_set")
    assert _decision(pool, "a", 3, output_pages=2).decision == "admitted"  # grows to 5
    waits = _decision(pool, "b", 4)
    assert waits.decision == "queued"
    assert "working set" in waits.reason and "5 of the 8" in waits.reason
    behind = _decision(pool, "c", 1)  # behind b: fair order, not size
    assert behind.decision == "queued"
    assert "waits its turn behind 1 request(s) ahead of it" in behind.reason
    assert pool.admission.working_set_used() == 5
    _, admitted = pool.release("a")
    assert [r.request_id for r in admitted] == ["b", "c"]
    assert pool.admission.working_set_used() == 5


def test_reservation_admission_over_subscribes_the_device(make_pool):
    pool = make_pool(device_pages=8, host_pages=32, admission="reservation")
    assert _decision(pool, "a", 3, output_pages=2).decision == "admitted"
    assert _decision(pool, "b", 4).decision == "admitted"
    assert pool.admission.working_set_used() == 9  # counted, not enforced


def test_a_request_alone_is_admitted_whatever_it_takes(make_pool):
    pool = make_pool(device_pages=8, host_pages=32, admission="working_set")
    assert _decision(pool, "a", 8).decision == "admitted"
    assert _decision(pool, "b", 1).decision == "queued"


def test_growth_past_the_reservation_counts_and_holds_the_queue(make_pool):
    pool = make_pool(device_pages=8, host_pages=32, admission="working_set")
    assert _decision(pool, "a", 2).decision == "admitted"
    settle(pool, pool.allocate("a", 2))
    settle(pool, pool.allocate("a", 3))  # past its 2 projected pages
    assert pool.admission.working_set_used() == 5
    assert _decision(pool, "b", 4).decision == "queued"
    pool.free("a", [0])  # held pages, not reserved ones: the working set stays
    assert pool.admission.working_set_used() == 5
    pool.release("a")
    assert pool.admission.working_set_used() == 4  # b's


def test_shared_prefix_blocks_are_not_a_working_set(make_pool):
    """A request's prompt stored or loaded as shared blocks is copied in by the engine (Load
    hands it out until the engine's next call); its steps read its own blocks."""
    pool = make_pool(device_pages=10, host_pages=32, admission="working_set")
    keys = [b"k0", b"k1", b"k2", b"k3"]
    assert _decision(pool, "a", 4, output_pages=2).decision == "admitted"  # 6 pages
    settle(pool, pool.store("a", NS, keys)[0])
    pool.commit("a", NS, keys)
    assert pool.admission.shared_uses == 4
    assert pool.admission.working_set_used() == 2  # its output, still to come
    assert _decision(pool, "b", 5, output_pages=2).decision == "admitted"  # 2 + 7 <= 10
    assert _decision(pool, "c", 2).decision == "queued"  # 2 + 7 + 2 > 10
    pool.load("b", NS, keys)  # b's first 4 pages are a's
    assert pool.admission.shared_uses == 8
    assert pool.admission.working_set_used() == 2 + 3
    _, admitted = pool.release("b")  # room for c
    assert [r.request_id for r in admitted] == ["c"]
    pool.release("a")
    assert pool.admission.shared_uses == 0
    assert pool.admission.working_set_used() == 2


def test_a_whale_under_a_fair_policy_is_counted_for_its_fair_share(make_pool):
    pool = make_pool(device_pages=50, host_pages=200, policy="fair", admission="working_set")
    share = pool.pages.share_capacity  # 49: the free reserve is nobody's
    for i in range(4):  # minnows: 4 x 5 pages, written
        assert _decision(pool, f"m{i}", 5, tenant="minnows").decision == "admitted"
        settle(pool, pool.allocate(f"m{i}", 5))
    whale = _decision(pool, "w", 40, tenant="whale")
    assert whale.decision == "admitted"
    req = pool.get_request("w")
    fair = pool.tenancy.fair_share("whale")
    assert req.working_set_cap is not None and req.working_set_cap <= fair < 40
    assert pool.admission.working_set_used() == 20 + req.working_set_cap <= share
    # The whale streams through its 40 pages in chunks, evicting its own: the minnows'
    # pages stay on the device.
    for _ in range(8):
        settle(pool, pool.allocate("w", 5))
    assert pool.tenancy.device_by_tenant["minnows"] == 20
    assert pool.tenancy.device_by_tenant["whale"] < 40


def test_a_whale_with_a_shared_prefix_counts_its_own_pages_up_to_its_share(make_pool):
    """A whale's shared prefix blocks are no more its working set than anyone's: it counts
    its own pages, up to its fair share. Its prefix was taken off what its share counted,
    so a whale with a long prefix counted below zero: the working sets read less than the
    device held (kvd's stats refused to answer: "Value out of range: -10" on a uint), and
    admission let in what did not fit."""
    pool = make_pool(device_pages=50, host_pages=200, policy="fair", admission="working_set")
    share = pool.pages.share_capacity
    for i in range(4):  # minnows: 4 x 5 pages, written
        assert _decision(pool, f"m{i}", 5, tenant="minnows").decision == "admitted"
        settle(pool, pool.allocate(f"m{i}", 5))
    assert _decision(pool, "w", 40, tenant="whale").decision == "admitted"
    cap = pool.get_request("w").working_set_cap
    assert cap is not None and 10 < cap < 30
    keys = [b"p%d" % i for i in range(30)]  # its prompt's first 30 pages: a shared prefix
    settle(pool, pool.store("w", NS, keys)[0])
    pool.commit("w", NS, keys)
    assert pool.admission.working_set_used() == 20 + 10  # its 10 own pages, within its cap
    late = share - 30 + 1  # one page more than the device has room for
    assert _decision(pool, "late", late, tenant="minnows").decision == "queued"
    _, admitted = pool.release("w")
    assert [r.request_id for r in admitted] == ["late"]
    assert pool.admission.working_set_used() == 20 + late


def test_under_a_plain_policy_a_big_request_waits_for_the_whole_device(make_pool):
    pool = make_pool(device_pages=50, host_pages=200, policy="lru", admission="working_set")
    for i in range(4):
        assert _decision(pool, f"m{i}", 5, tenant="minnows").decision == "admitted"
    assert _decision(pool, "w", 40, tenant="whale").decision == "queued"


def test_an_unknown_admission_mode_is_refused(make_pool):
    with pytest.raises(InvalidArgument, match="admission mode"):
        make_pool(admission="greedy")


def test_a_handoff_reservation_waits_for_the_working_set_room_of_the_decode_pool(make_pool):
    decode = make_pool(device_pages=8, host_pages=32, admission="working_set")
    assert _decision(decode, "running", 5).decision == "admitted"
    with pytest.raises(ResourceExhausted, match="working sets hold 5 of the 8"):
        decode.reservations.reserve("incoming", "t", prompt_tokens=64, output_tokens=0,
                                    priority=0, ttl_s=30)
    decode.reservations.reserve("small", "t", prompt_tokens=48, output_tokens=0,
                                priority=0, ttl_s=30)  # 3 pages fit beside the 5
    assert decode.admission.working_set_used() == 8


@pytest.mark.parametrize("policy", ["lru", "intent", "fair", "fair:intent"])
def test_a_tenants_guarantee_admits_it_while_others_working_sets_fill_the_device(make_pool,
                                                                                 policy):
    """g is guaranteed 6 of 12 device pages and runs nothing; t's requests fill the device
    meanwhile (an idle guarantee is anyone's to use). g's request of 4 pages is within its
    guarantee: it goes in at once and takes its pages from t's, rather than wait for t's
    requests to end. Past its guarantee g waits as anyone does, and so does t while the
    working sets exceed the device."""
    pool = make_pool(device_pages=12, host_pages=48, policy=policy, reserve_pages=0,
                     admission="working_set", quotas={"g": TenantQuota(guaranteed=6)})
    for i in range(3):
        assert _decision(pool, f"t{i}", 4, tenant="t").decision == "admitted"
        settle(pool, pool.allocate(f"t{i}", 4))
    assert pool.device.num_free == 0
    admitted = _decision(pool, "g1", 4, tenant="g")
    assert admitted.decision == "admitted", admitted.reason
    settle(pool, pool.allocate("g1", 4))
    assert dict(pool.tenancy.device_by_tenant) == {"t": 8, "g": 4}
    assert pool.admission.working_set_by_tenant == {"t": 12, "g": 4}
    past = _decision(pool, "g2", 4, tenant="g")  # 8 pages of g's: past its 6
    assert past.decision == "queued" and "working set" in past.reason
    assert _decision(pool, "t3", 1, tenant="t").decision == "queued"
    pool.release("g2")
    pool.release("t3")


def test_a_guarantee_admits_only_what_it_covers(make_pool):
    """A request bigger than its tenant's guarantee gets nothing from it at admission: it
    waits for room in the device as any other (here behind t's working sets)."""
    pool = make_pool(device_pages=12, host_pages=48, reserve_pages=0,
                     admission="working_set", quotas={"g": TenantQuota(guaranteed=3)})
    assert _decision(pool, "t0", 12, tenant="t").decision == "admitted"
    assert _decision(pool, "g1", 4, tenant="g").decision == "queued"
    assert pool.admission.working_set_by_tenant == {"t": 12}
    _, admitted = pool.release("t0")
    assert [r.request_id for r in admitted] == ["g1"]
    assert pool.admission.working_set_by_tenant == {"g": 4}


def test_a_guarantee_makes_room_for_its_tenants_handoff_reservation(make_pool):
    """The decode pool reserves a handed-off request's pages as it admits: within its
    tenant's guarantee, whatever other tenants' working sets hold there; past it, not."""
    decode = make_pool(device_pages=8, host_pages=32, admission="working_set",
                       quotas={"g": TenantQuota(guaranteed=3)})
    assert _decision(decode, "running", 8, tenant="t").decision == "admitted"
    decode.reservations.reserve("in-g", "g", prompt_tokens=48, output_tokens=0,
                                priority=0, ttl_s=30)  # 3 pages: g's guarantee
    with pytest.raises(ResourceExhausted, match="working sets hold 11 of the 8"):
        decode.reservations.reserve("past-g", "g", prompt_tokens=16, output_tokens=0,
                                    priority=0, ttl_s=30)
    assert decode.admission.working_set_by_tenant == {"t": 8, "g": 3}


def test_a_guaranteed_request_does_not_wait_behind_another_tenants_request(make_pool):
    """c's big request waits at the head of the line for room; g's small one, within g's
    guarantee, comes after it and goes in at once rather than wait behind it."""
    pool = make_pool(device_pages=12, host_pages=48, reserve_pages=0,
                     admission="working_set", quotas={"g": TenantQuota(guaranteed=4)})
    assert _decision(pool, "t0", 12, tenant="t").decision == "admitted"
    assert _decision(pool, "c0", 6, tenant="c").decision == "queued"
    admitted = _decision(pool, "g1", 3, tenant="g")
    assert admitted.decision == "admitted", admitted.reason
    assert list(pool.queue) == ["c0"]
    # Past g's guarantee, g's next request keeps its place behind c's.
    assert _decision(pool, "g2", 2, tenant="g").decision == "queued"
    assert list(pool.queue) == ["c0", "g2"]
    _, admitted = pool.release("t0")
    assert [r.request_id for r in admitted] == ["c0", "g2"]
