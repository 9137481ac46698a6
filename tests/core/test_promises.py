"""The pool's promises under unlucky and hostile sequences: quotas hold on every path that
adds pages, pins never overcommit the device, a dropped block is never handed back as data,
and a block handed to the engine stays put until the engine is done with it."""

from __future__ import annotations

import itertools

import pytest

from kvd.core.blocks import Priority
from kvd.core.errors import HostShort, ResourceExhausted
from kvd.core.fairness import TenantQuota
from kvd.core.intent import IntentChange
from kvd.core.pages import PageTable
from kvd.core.transfer import MoveKind

from .conftest import settle


def grown(pool, rid: str, blocks: int, tenant: str = "t", holder: str = ""):
    """rid admitted for `blocks` blocks and grown to them one allocation at a time (each
    demoting the oldest block once the tenant is at its share), every copy done."""
    pool.admit(rid, tenant=tenant, prompt_tokens=16 * blocks, output_tokens=0)
    for _ in range(blocks):
        settle(pool, pool.allocate(rid, 1, holder=holder))
    return pool.requests[rid]


def test_tenant_limit_holds_when_a_request_grows_after_admission(make_pool):
    pool = make_pool(device_pages=64, host_pages=64,
                     quotas={"t": TenantQuota(limit=48)})
    # 16 tokens a page: admitted for 4 pages, then grown by Allocate.
    assert pool.admit("a", tenant="t", prompt_tokens=64, output_tokens=0).decision == "admitted"
    settle(pool, pool.allocate("a", 48))
    with pytest.raises(ResourceExhausted, match=r"limit of 48 pages.*48.*asks for 1"):
        pool.allocate("a", 1)
    assert pool.tenancy.reserved_by_tenant["t"] == 48
    assert pool.requests["a"].num_live_blocks == 48


def test_tenant_limit_counts_every_request_of_the_tenant(make_pool):
    pool = make_pool(device_pages=64, host_pages=64, quotas={"t": TenantQuota(limit=10)})
    pool.admit("a", tenant="t", prompt_tokens=16 * 5, output_tokens=0)
    pool.admit("b", tenant="t", prompt_tokens=16 * 5, output_tokens=0)
    settle(pool, pool.allocate("a", 5))
    with pytest.raises(ResourceExhausted, match="limit of 10 pages"):
        pool.allocate("a", 1)  # b's reservation counts too
    settle(pool, pool.allocate("b", 5))
    # A sliding window stays within what it holds: free one, allocate one.
    pool.free("a", [0])
    settle(pool, pool.allocate("a", 1))


def test_request_cap_holds_when_a_request_grows(make_pool):
    pool = make_pool(device_pages=64, host_pages=64,
                     quotas={"t": TenantQuota(max_request_pages=4)})
    assert pool.admit("a", tenant="t", prompt_tokens=32, output_tokens=0).decision == "admitted"
    settle(pool, pool.allocate("a", 4))
    with pytest.raises(ResourceExhausted, match="per-request cap of 4 pages"):
        pool.allocate("a", 1)
    assert pool.requests["a"].num_live_blocks == 4


def test_guarantee_of_another_tenant_holds_against_growth(make_pool):
    # g is guaranteed 6 of 8 device pages; t may not grow into them through Allocate.
    pool = make_pool(device_pages=8, host_pages=0, policy="fair",
                     quotas={"g": TenantQuota(guaranteed=6)}, reserve_pages=0)
    pool.admit("g1", tenant="g", prompt_tokens=16 * 6, output_tokens=0)
    settle(pool, pool.allocate("g1", 6))
    pool.admit("t1", tenant="t", prompt_tokens=16 * 2, output_tokens=0)
    settle(pool, pool.allocate("t1", 2))
    with pytest.raises(ResourceExhausted):
        pool.allocate("t1", 1)
    assert pool.tenancy.device_by_tenant["g"] == 6


@pytest.mark.parametrize("policy", ["fair", "fair:intent"])
def test_overcommitted_guarantees_protect_only_their_scaled_part(make_pool, policy):
    # 6 + 6 pages guaranteed on an 8-page device tier: each is honoured as 4 (kvd logs
    # that it scales them down). g, first, grew to 6; h then comes for its 4, and gets them
    # from g's 2 pages past its scaled guarantee and 2 free ones.
    pool = make_pool(device_pages=8, host_pages=16, policy=policy, reserve_pages=0,
                     quotas={"g": TenantQuota(guaranteed=6), "h": TenantQuota(guaranteed=6)})
    grown(pool, "g1", 6, tenant="g")
    assert pool.tenancy.guaranteed("g") == pytest.approx(4)
    assert pool.admit("h1", tenant="h", prompt_tokens=16 * 4,
                      output_tokens=0).decision == "admitted"
    settle(pool, pool.allocate("h1", 4))
    assert dict(pool.tenancy.device_by_tenant) == {"g": 4, "h": 4}


GUARANTEED_TO_OTHERS = "would take device pages of pool 'default' guaranteed to other tenants"


@pytest.mark.parametrize("policy", ["lru", "intent", "fair:intent"])
def test_a_pin_never_takes_pages_another_tenant_is_guaranteed(make_pool, policy):
    # g is guaranteed 3 of 8 device pages and uses none of them yet. t's unpinned pages may
    # fill them meanwhile (eviction gives them back when g comes); its pins may not, on any
    # path that pins: an allocation, an intent update, a shared block stored or loaded.
    pool = make_pool(device_pages=8, host_pages=16, policy=policy, reserve_pages=0,
                     quotas={"g": TenantQuota(guaranteed=3)})
    pool.admit("t1", tenant="t", prompt_tokens=16 * 8, output_tokens=0)
    settle(pool, pool.allocate("t1", 4, {"pin_requested": True}))
    settle(pool, pool.allocate("t1", 1))
    with pytest.raises(ResourceExhausted, match=GUARANTEED_TO_OTHERS):
        pool.allocate("t1", 2, {"pin_requested": True})
    settle(pool, pool.allocate("t1", 3))  # unpinned: into g's pages while g has no use
    assert pool.device.num_free == 0
    pin = {"pin_requested": True}
    # The fifth pin is the last t may have: 5 pinned + 3 guaranteed = the device tier.
    pool.update_intents([IntentChange("t1", 4, pin)])
    for change in ([IntentChange("t1", 5, pin)],
                   [IntentChange("t1", 5, {"priority": int(Priority.DECODE_CRITICAL)})]):
        with pytest.raises(ResourceExhausted, match=GUARANTEED_TO_OTHERS):
            pool.update_intents(change)
    # An unpin makes room for a pin in the same batch.
    pool.update_intents([IntentChange("t1", 0, {"pin_requested": False}),
                         IntentChange("t1", 5, pin)])
    with pytest.raises(ResourceExhausted, match=GUARANTEED_TO_OTHERS):
        pool.store("t1", "ns", [b"k0"], intent=pin)
    assert pool.num_pinned == 5 and pool.tenancy.pinned_by_tenant["t"] == 5
    # g comes for its guarantee: admitted, its pages taken back from t's unpinned ones, and
    # pinned by g itself.
    assert pool.admit("g1", tenant="g", prompt_tokens=16 * 3,
                      output_tokens=0).decision == "admitted"
    settle(pool, pool.allocate("g1", 3, {"pin_requested": True}))
    assert pool.tenancy.device_by_tenant["g"] == 3 and pool.num_pinned == 8


def test_guarantees_that_overcommit_the_device_leave_others_no_pins(make_pool):
    # 12 pages guaranteed on an 8-page device tier count as the whole tier.
    pool = make_pool(device_pages=8, host_pages=16, reserve_pages=0,
                     quotas={"g": TenantQuota(guaranteed=6), "h": TenantQuota(guaranteed=6)})
    pool.admit("t1", tenant="t", prompt_tokens=16, output_tokens=0)
    with pytest.raises(ResourceExhausted, match=r"others pin or are guaranteed 8 \(by tenant: "):
        pool.allocate("t1", 1, {"pin_requested": True})
    pool.admit("g1", tenant="g", prompt_tokens=16 * 5, output_tokens=0)
    settle(pool, pool.allocate("g1", 4, {"pin_requested": True}))  # within its 4 of 8
    with pytest.raises(ResourceExhausted, match="guaranteed to other tenants"):
        pool.allocate("g1", 1, {"pin_requested": True})


def test_a_guarantee_raised_over_pins_holds_against_new_ones(make_pool):
    # Pins already taken stay when another tenant's guarantee grows past what they leave;
    # none may be added until they end, and then only within what the guarantee leaves.
    pool = make_pool(device_pages=8, host_pages=16, reserve_pages=0)
    pool.admit("t1", tenant="t", prompt_tokens=16 * 7, output_tokens=0)
    settle(pool, pool.allocate("t1", 6, {"pin_requested": True}))
    pool.set_quota("g", TenantQuota(guaranteed=4))
    assert pool.num_pinned == 6
    with pytest.raises(ResourceExhausted, match=GUARANTEED_TO_OTHERS):
        pool.allocate("t1", 1, {"pin_requested": True})
    unpin = {"pin_requested": False}
    pool.update_intents([IntentChange("t1", i, unpin) for i in (0, 1, 2)])
    with pytest.raises(ResourceExhausted, match=GUARANTEED_TO_OTHERS):
        pool.update_intents([IntentChange("t1", i, {"pin_requested": True}) for i in (0, 1)])
    pool.update_intents([IntentChange("t1", 0, {"pin_requested": True})])
    assert pool.tenancy.pinned_by_tenant["t"] == 4


def test_duplicate_unpin_in_one_batch_cannot_overcommit_pins(make_pool):
    # Every device page pinned by r; s's two blocks wait on the host tier. Unpinning r2
    # twice frees one pin, not two: pinning s0 and s1 as well would make 5 pins on 4 pages.
    pool = make_pool(device_pages=4, host_pages=8)
    pool.admit("s", tenant="t", prompt_tokens=16 * 2, output_tokens=0)
    settle(pool, pool.allocate("s", 2))
    pool.admit("r", tenant="t", prompt_tokens=16 * 4, output_tokens=0)
    settle(pool, pool.allocate("r", 4, {"pin_requested": True}))
    assert pool.num_pinned == 4
    unpin, pin = {"pin_requested": False}, {"pin_requested": True}
    with pytest.raises(ResourceExhausted, match="pinning 1 more"):
        pool.update_intents([IntentChange("r", 2, unpin), IntentChange("r", 2, unpin),
                             IntentChange("s", 0, pin), IntentChange("s", 1, pin)])
    assert pool.num_pinned == 4 and pool.requests["r"].blocks[2].pinned  # nothing changed
    # Unpin two, pin two: allowed, and counted once each.
    pool.update_intents([IntentChange("r", 2, unpin), IntentChange("r", 3, unpin),
                         IntentChange("r", 2, unpin), IntentChange("s", 0, pin),
                         IntentChange("s", 1, pin)])
    assert pool.num_pinned == 4
    assert sum(b.pinned for r in ("r", "s") for b in pool.requests[r].live_blocks()) == 4
    for plan in [pool.access("s", None).plan]:
        settle(pool, plan)


def test_pin_flip_flop_in_one_batch_counts_the_final_state(make_pool):
    pool = make_pool(device_pages=2, host_pages=8)
    pool.admit("r", tenant="t", prompt_tokens=16 * 2, output_tokens=0)
    settle(pool, pool.allocate("r", 2, {"pin_requested": True}))
    pool.admit("s", tenant="t", prompt_tokens=16, output_tokens=0)
    # Unpin and re-pin r0, then unpin r1 twice: the batch ends with 1 pinned block.
    pool.update_intents([IntentChange("r", 0, {"pin_requested": False}),
                         IntentChange("r", 0, {"pin_requested": True}),
                         IntentChange("r", 1, {"pin_requested": False}),
                         IntentChange("r", 1, {"pin_requested": False})])
    assert pool.num_pinned == 1
    assert sum(b.pinned for b in pool.requests["r"].live_blocks()) == 1


def test_dropped_block_comes_back_flagged_and_zeroed_never_as_data(make_pool):
    # A one-page host tier: of two recompute_ok victims, one is demoted and one dropped.
    # When read again the dropped one must come back marked lost (its page to be zeroed by
    # the runtime), the demoted one intact.
    pool = make_pool(device_pages=4, host_pages=1)
    pool.admit("a", tenant="t", prompt_tokens=32, output_tokens=0)
    settle(pool, pool.allocate("a", 2, {"recompute_ok": True}))
    plan = settle(pool, pool.evict(2))
    assert sorted(m.kind.value for m in plan.demotions) == ["demote", "drop"]
    a = pool.requests["a"]
    dropped = next(m.block for m in plan.demotions if m.kind is MoveKind.DROP)
    result = pool.access("a", None)
    kinds = {m.block.index: m.kind for m in result.plan.promotions}
    assert kinds[dropped.index] is MoveKind.REMATERIALIZE
    settle(pool, result.plan)
    assert [b.lost for b in a.live_blocks()] == [b is dropped for b in a.live_blocks()]
    assert pool.counters.num_lost_blocks == 1
    assert a.account.num_recomputes == 1


def test_a_request_alone_under_fair_reads_every_block_the_device_holds(make_pool):
    # Six device pages under `fair`, one of them the free reserve: a request grown a block at
    # a time has its sixth in a free page's stead on the host (a tenant at its fair share
    # demotes rather than take the reserve). Reading all six then has nothing to evict but
    # its own blocks, which the read keeps; it takes the reserve rather than being refused
    # for as long as nothing changes (for ever, alone in the pool).
    pool = make_pool(device_pages=6, host_pages=10, policy="fair")
    assert pool.pages.reserve_pages == 1
    r = grown(pool, "r", 6)
    assert r.num_device_blocks == 5 and pool.device.num_free == 1
    settle(pool, pool.access("r", None).plan)
    assert r.num_device_blocks == 6 and pool.device.num_free == 0
    # Over its share by the reserve's page, which the refill takes back once it may.
    refill = settle(pool, pool.refill_plan())
    assert [m.block.request for m in refill.demotions] == [r]
    assert pool.device.num_free == 1


def test_the_reserve_taken_as_a_last_resort_comes_back_for_a_tenant_below_its_share(make_pool):
    # A tenant over its share reads a request that fills the device but for the reserve's
    # page; another tenant arriving below its share still grows, at once, by the refill's
    # taking the page back or by evicting the first tenant's blocks.
    pool = make_pool(device_pages=6, host_pages=10, policy="fair")
    grown(pool, "r", 6, tenant="a")
    settle(pool, pool.access("r", None).plan)
    pool.admit("s", tenant="b", prompt_tokens=16 * 2, output_tokens=0)
    settle(pool, pool.allocate("s", 2))
    assert pool.requests["s"].num_device_blocks == 2
    assert pool.tenancy.device_by_tenant["a"] == 4


def test_a_read_under_fair_takes_the_reserve_rather_than_wait_on_others_holds(make_pool):
    # Tenant t at its fair share (5 of 6 pages; the sixth is the free reserve): r has four
    # blocks on the device and one on the host, s one block on the device held by an engine
    # until its next call. Reading r has nothing to evict but s's held block: it takes the
    # free page now instead of waiting on the other engine's next call (which, with engines
    # always holding something, kept it waiting for as long as they ran).
    pool = make_pool(device_pages=6, host_pages=10, policy="fair")
    r = grown(pool, "r", 5)
    grown(pool, "s", 1, holder="h")
    assert (r.num_device_blocks, pool.device.num_free) == (4, 1)
    plan = settle(pool, pool.access("r", None).plan)
    assert not plan.demotions and len(plan.promotions) == 1
    assert r.num_device_blocks == 5 and pool.requests["s"].num_device_blocks == 1


def test_a_read_under_fair_leaves_the_reserve_whole_when_the_host_is_full(make_pool,
                                                                         monkeypatch):
    # Tenant t at its share: r holds four device blocks and two on a full two-page host, s
    # one device block that cannot be recomputed; the sixth page is the free reserve. Reading
    # r whole would need s's block gone, and it has nowhere to go: the read is refused (the
    # engine frees or releases), and the reserve is not spent on a tenant at its share, as it
    # is where nothing could be taken at all. Nothing changed. Admission under a fair policy
    # keeps a host page free for the swap (see the test below), so this state takes the
    # capacity it had before it did: the rule stands for pages admission does not count.
    monkeypatch.setattr(PageTable, "capacity_pages", property(lambda pages: pages.tiers_pages))
    pool = make_pool(device_pages=6, host_pages=2, policy="fair")
    r, s = grown(pool, "r", 6), grown(pool, "s", 1)
    assert (r.num_device_blocks, pool.device.num_free, pool.host.num_free) == (4, 1, 0)
    with pytest.raises(HostShort, match="host tier full") as refused:
        pool.access("r", None)
    assert refused.value.possible == 0
    assert (r.num_device_blocks, s.num_device_blocks, pool.device.num_free) == (4, 1, 1)


def read_whole(pool, rid: str) -> int:
    """Read every block of rid, in rounds as the runtime does; returns the rounds taken."""
    for rounds in range(1, 65):
        result = pool.access(rid, None)
        settle(pool, result.plan)
        if not result.partial:
            return rounds
    raise AssertionError(f"reading {rid} whole never ended")


@pytest.mark.parametrize("policy", ["lru", "fair", "fair:intent", "fair:lru"])
@pytest.mark.parametrize("device,host", [(6, 2), (6, 7), (7, 4), (8, 9), (12, 7)])
@pytest.mark.parametrize("requests,tenants", [(2, 1), (3, 1), (4, 1), (3, 2), (4, 2)])
def test_every_block_admission_lets_in_can_be_read(make_pool, policy, device, host,
                                                   requests, tenants):
    # Requests grow one block at a time, in turns, until the pool refuses them, each up to
    # its tenant's fair share (a read of more is refused under a fair policy, as it should
    # be). Then each is read whole, in every order. Under a fair policy admission must
    # leave the spare host page a swap needs beside the device's free reserve: were the
    # reserve that spare page, with the host full a tenant at its share could not spend
    # it, and every read that had to swap would be refused while LRU served the same
    # reads (small devices, where the reserve and the headroom are both one page).
    pool = make_pool(device_pages=device, host_pages=host, policy=policy)
    cap = pool.pages.share_capacity // tenants
    rids = [f"r{i}" for i in range(requests)]
    for i, rid in enumerate(rids):
        pool.admit(rid, tenant=f"t{i % tenants}", prompt_tokens=16, output_tokens=0)
    grew = True
    while grew:
        grew = False
        for rid in rids:
            if pool.requests[rid].num_live_blocks < cap:
                try:
                    settle(pool, pool.allocate(rid, 1))
                    grew = True
                except ResourceExhausted:
                    pass
    for order in itertools.permutations(rids):
        for rid in order:
            read_whole(pool, rid)
            assert pool.requests[rid].num_device_blocks == pool.requests[rid].num_live_blocks
