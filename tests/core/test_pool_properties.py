"""Random operation sequences against the pool's invariants (hypothesis state machine).

Plans are left in flight and completed or aborted in any order, as the runtime's concurrent
copies would; every step checks every invariant, and a call that fails changes nothing.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvd.core.blocks import Phase, Priority, TierKind
from kvd.core.clock import FakeClock
from kvd.core.errors import BlocksInTransit, KvdError
from kvd.core.fairness import TenantQuota, effective_guarantees
from kvd.core.invariants import check_pool
from kvd.core.policies import policy_names
from kvd.core.intent import IntentChange
from kvd.core.pool import Pool

REQUEST_IDS = st.sampled_from(["r0", "r1", "r2", "r3"])
NAMESPACES = st.sampled_from(["m", "m|salt"])
KEYS = [b"h%d" % i for i in range(10)]
INTENT = st.fixed_dictionaries(
    {},
    optional={
        "priority": st.sampled_from([int(p) for p in Priority if p]),
        "phase": st.sampled_from([int(p) for p in Phase if p]),
        "pin_requested": st.booleans(),
        "deadline_us": st.integers(-10_000, 10_000_000),
        "recompute_cost_us": st.integers(0, 10_000),
        "request_priority": st.integers(0, 100),
        "is_draft": st.booleans(),
        "is_committed": st.booleans(),
        "recompute_ok": st.booleans(),
    },
)


# What a request may say of the shared blocks it uses; a priority is refused there.
SHARED_INTENT = st.none() | st.fixed_dictionaries(
    {}, optional={"pin_requested": st.booleans(),
                  "deadline_us": st.integers(-10_000, 10_000_000)}) | st.just({"priority": 3})


def fingerprint(pool: Pool):
    # Requests a step answered are held by request until victims are chosen: hold their
    # blocks now, so a call that only gets that far changes nothing it is compared on.
    pool.pages.holds.materialize()
    return (
        pool.device.num_free, pool.host.num_free, pool.reserved_pages, pool.num_pinned,
        pool.admission.working_set_pages, pool.admission.shared_uses,
        len(pool.policy), len(pool.requests), len(pool.queue),
        tuple(sorted((r.request_id, r.num_live_blocks, len(r.blocks), r.num_device_blocks,
                      len(r.shared)) for r in pool.requests.values())),
        tuple(sorted((k, b.committed) for k, b in pool.pages.named.items())),
        tuple(sorted(pool.tenancy.shared_adjust.items())),
    )


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.pending = []
        # holder -> the device page of each block of the requests a step answered at once
        # for it: the engine reads them there until its next call.
        self.told: dict[str, dict] = {}
        self.last_read: dict[str, list[str]] = {}  # each holder's last read_all

    def _do(self, op):
        before = fingerprint(self.pool)
        pins = dict(self.pool.tenancy.pinned_by_tenant)
        try:
            result = op()
        except (KvdError, BlocksInTransit):
            assert fingerprint(self.pool) == before, "a failed call changed the pool"
            return None
        self._check_pins(pins)
        plan = getattr(result, "plan", result)
        if plan is not None and hasattr(plan, "demotions"):
            for m in plan.demotions:
                assert not m.block.pinned, "a pinned block was chosen as a victim"
            if self.pool.policy.fair and plan.demotions:
                self._check_guarantees(plan)
            if plan.num_copies == 0:  # as the runtime does: nothing to copy, done at once
                self.pool.complete(plan)
            else:
                self.pending.append(plan)
        return result

    @initialize(sizes=st.lists(st.integers(1, 4), min_size=4, max_size=4),
                admission=st.sampled_from(["reservation", "working_set"]))
    def start_under_pressure(self, sizes, admission):
        """Four requests whose blocks overflow the device tier: all admitted under
        reservation admission, those past the device's working set queued under
        working-set admission."""
        self.pool = Pool("p", page_bytes=8, block_tokens=4, device_pages=6, host_pages=10,
                         policy="lru", clock=self.clock, max_queue=3, admission=admission,
                         quotas={"0": TenantQuota(guaranteed=2),
                                 "1": TenantQuota(weight=2, limit=8)})
        for i, n in enumerate(sizes):
            self.admit(f"r{i}", 4 * n, 0)
            self.allocate(f"r{i}", n)
            while self.pending:
                self.pool.complete(self.pending.pop())

    def _check_pins(self, before: dict[str, int]) -> None:
        """A tenant whose pins the call added has them, and every other tenant's pins or
        guarantee (scaled down when they overcommit the device tier), within the tier."""
        tenancy, capacity = self.pool.tenancy, self.pool.device.capacity
        now = tenancy.pinned_by_tenant
        guaranteed = effective_guarantees(tenancy.quotas, capacity)
        for tenant in now:
            if now[tenant] > before.get(tenant, 0):
                others = sum(max(now[t], guaranteed.get(t, 0.0))
                             for t in set(now) | set(guaranteed) if t != tenant)
                assert now[tenant] + others <= capacity + 1e-6, (tenant, dict(now), guaranteed)

    def _check_guarantees(self, plan):
        """No tenant was taken below its guarantee to make room for another tenant, in the
        pages charged to it (a shared page 1/k to each of its k tenants), counting the
        victims it owns. (A shared page is chosen among its owner's: a tenant using
        another's shared page loses its part of it when the owner pays.)"""
        evictor = plan.cause.tenant if plan.cause else None
        taken = Counter()
        for m in plan.demotions:
            b = m.block
            owner, payers = b.request.tenant, b.payers or (b.request.tenant,)
            if owner in payers:
                taken[owner] += 1 / len(payers)
        for tenant, n in taken.items():
            if tenant != evictor:
                # Victims still count as on the device until the plan completes.
                left = self.pool.tenancy.usage(tenant) - n
                assert left >= self.pool.tenancy.guaranteed(tenant) - 1e-6, (tenant, left)

    @rule(rid=REQUEST_IDS, prompt=st.integers(1, 12) | st.integers(-1, 30),
          output=st.integers(0, 10))
    def admit(self, rid, prompt, output):
        self._do(lambda: self.pool.admit(rid, tenant=rid[-1], prompt_tokens=prompt,
                                         output_tokens=output))

    @rule(rid=REQUEST_IDS, n=st.integers(1, 3) | st.integers(-1, 7))
    def allocate(self, rid, n):
        self._do(lambda: self.pool.allocate(rid, n))

    @rule(rid=REQUEST_IDS, blocks=st.none() | st.lists(st.integers(0, 4), max_size=3, unique=True)
          | st.lists(st.integers(-1, 8), max_size=4), holder=st.sampled_from(["", "a", "b"]))
    def access(self, rid, blocks, holder):
        """An engine's read of a request's blocks (a unary Access, or a Step's read that
        took the general path): with a holder, what is in place stays there until its next
        call, the blocks brought in once they land."""
        result = self._do(lambda: self.pool.access(rid, blocks, holder))
        if result is None or not holder or result.partial:
            return
        read = result.blocks if result.blocks is not None else result.request.live_blocks()
        told = self.told.setdefault(holder, {})
        for b in read:
            if b.tier is TierKind.DEVICE and not b.moving:
                told[b] = b.page

    @rule(rid=REQUEST_IDS, index=st.integers(0, 8), fields=INTENT, prefetch=st.booleans())
    def update_intent(self, rid, index, fields, prefetch):
        self._do(lambda: self.pool.update_intents([IntentChange(rid, index, fields, prefetch)]))

    @rule(rid=REQUEST_IDS, blocks=st.lists(st.integers(0, 8), min_size=1, max_size=3))
    def free(self, rid, blocks):
        self._do(lambda: self.pool.free(rid, blocks))

    @rule(rid=REQUEST_IDS, ns=NAMESPACES, start=st.integers(0, 6), n=st.integers(0, 4),
          commit=st.booleans(), intent=SHARED_INTENT)
    def store(self, rid, ns, start, n, commit, intent):
        """Prefixes from one chain of keys, so requests share their leading blocks."""
        keys = KEYS[start:start + n]
        stored = self._do(lambda: self.pool.store(rid, ns, keys, intent=intent)[0])
        if stored is not None and intent and intent.get("pin_requested"):
            named = self.pool.pages.named
            assert all(named[(ns, k)].pinned for k in keys if (ns, k) in named), \
                "a block stored with a pin is not pinned"
        if stored is not None and commit:
            self._do(lambda: self.pool.commit(rid, ns, keys))

    @rule(rid=REQUEST_IDS, ns=NAMESPACES, n=st.integers(1, 8), holder=st.sampled_from("ab"),
          intent=SHARED_INTENT)
    def load(self, rid, ns, n, holder, intent):
        run = self._do(lambda: self.pool.load(rid, ns, KEYS[:n], holder, intent))
        if run is not None and intent and intent.get("pin_requested"):
            assert all(b.pinned for b in run), "a block loaded with a pin is not pinned"
        if run is not None:
            assert [b.name for b in run] == [(ns, k) for k in KEYS[:len(run)]]
            assert all(b.committed and b.held and b.tier is not TierKind.NONE for b in run)

    @rule(rids=st.lists(REQUEST_IDS, max_size=3, unique=True), holder=st.sampled_from("ab"))
    def read_all(self, rids, holder):
        """A Step's reads answered at once, held for its stream until its next message."""
        _, _, answered = self.pool.read_all(rids)
        self.last_read[holder] = rids
        for req in answered:  # answered at once (perhaps from an answer kept): all in place
            assert all(b.tier is TierKind.DEVICE and not b.moving for b in req.live_blocks()), \
                f"{req.request_id} answered at once with a block off the device tier"
        self.pool.hold_read(answered, holder)
        told = self.told.setdefault(holder, {})
        for req in answered:
            for b in req.live_blocks():
                told[b] = b.page

    @rule(holder=st.sampled_from("ab"))
    def read_again(self, holder):
        """A decode step (the holder's last read again), as Node.read_again serves it: the
        holder's holds end (replaced in one step when they are of requests only), and the
        read is answered from the answer kept for the same ids, when it still holds."""
        rids = self.last_read.get(holder)
        if not rids:
            return
        if not self.pool.pages.holds.only_requests(holder):
            self._do(lambda: self.pool.end_holds(holder))
        if not self.pool.read_again("\0".join(rids), len(rids), None, holder):
            self._do(lambda: self.pool.end_holds(holder))  # what the general path does first
            self.told.pop(holder, None)
            return
        self.told[holder] = {b: b.page for rid in rids
                             for b in self.pool.requests[rid].live_blocks()}
        for b in self.told[holder]:
            assert b.tier is TierKind.DEVICE and not b.moving, \
                f"{b.request.request_id} answered again with a block off the device tier"

    @rule(holder=st.sampled_from("ab"))
    def end_holds(self, holder):
        self._do(lambda: self.pool.end_holds(holder))
        self.told.pop(holder, None)

    @rule(rid=REQUEST_IDS)
    def release(self, rid):
        self._do(lambda: self.pool.release(rid))

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        self._do(lambda: self.pool.evict(n))

    @rule(name=st.sampled_from(policy_names()))
    def set_policy(self, name):
        self.pool.set_policy(name)

    @rule(tenant=st.sampled_from("0123"), guaranteed=st.integers(0, 8),
          limit=st.none() | st.integers(0, 12), weight=st.floats(0.5, 4))
    def set_quota(self, tenant, guaranteed, limit, weight):
        self.pool.set_quota(tenant, TenantQuota(weight=weight, guaranteed=guaranteed,
                                                limit=limit))

    @rule(dt=st.floats(0, 1))
    def tick(self, dt):
        self.clock.advance(dt)

    @precondition(lambda self: self.pending)
    @rule(which=st.integers(0, 100), abort=st.booleans())
    def finish_plan(self, which, abort):
        plan = self.pending.pop(which % len(self.pending))
        if abort:
            self.pool.abort(plan)
        else:
            pinned_out = self.pool.complete(plan)
            if pinned_out:
                self._do(lambda: self.pool.prefetch(pinned_out))

    @invariant()
    def what_a_step_answered_stays_in_place(self):
        for holder, told in self.told.items():
            for b, page in told.items():
                req = b.request
                if self.pool.requests.get(req.request_id) is not req or \
                        req.blocks[b.index] is not b:
                    continue  # released or freed by its engine since
                assert b.tier is TierKind.DEVICE and not b.moving and b.page == page, (
                    f"{req.request_id} block {b.index}, answered for {holder}, moved "
                    "before its next call")

    @invariant()
    def consistent(self):
        assert check_pool(self.pool) == []
        assert self.pool.device.num_used <= self.pool.device.capacity
        if not self.pending:
            assert not any(b.moving for r in self.pool.requests.values()
                           for b in r.live_blocks())
            for r in self.pool.requests.values():
                for b in r.live_blocks():
                    if b.pinned and b.tier is TierKind.DEVICE:
                        assert b not in self.pool.policy


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
