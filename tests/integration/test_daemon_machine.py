"""Random sequences of the daemon's whole API (admission, allocation, reads, intents, frees,
releases, evictions, handoffs and their cancellation, quota changes, the cluster's part of a
tenant's limit moving, policy switches, reloaded tenants), under every policy, both admission
modes and tier sizes from a handful of pages to several hundred, with real arenas and real
copies.

The engine side writes a distinct pattern into every block it is handed and checks it on
every read: a block kvd hands back must hold exactly what the engine wrote, unless kvd says
it must be recomputed, and then its page holds zeros (nothing of another request). After
every step the daemon's invariants hold (SelfCheck), no tenant holds more than its limit, no
request more than its cap, pins never exceed the device, a pin never takes a page another
tenant is guaranteed, nothing is left in transit, and no queued request that could go
now waits (nor one behind a request that waits on its own tenant's cap).

KVD_MACHINE_EXAMPLES sets the examples per policy (the suite's default is small; `make
soak` runs many more).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvd.config import Config, LinkConfig, PoolConfig, TenantConfig
from kvd.core.admission import counted_pages
from kvd.core.blocks import Priority, RequestState, TierKind
from kvd.core.errors import KvdError
from kvd.core.fairness import effective_guarantees
from kvd.core.policies import policy_names
from kvd.core.intent import IntentChange
from kvd.node import Node

PAGE_BYTES = 64
EXAMPLES = int(os.environ.get("KVD_MACHINE_EXAMPLES", "20"))
STEPS = int(os.environ.get("KVD_MACHINE_STEPS", "50"))
REQUESTS = [f"r{i}" for i in range(6)]
TENANTS = ("a", "b")
PREFIX_KEYS = [b"key%d" % i for i in range(8)]
LIMIT_B = 0.5  # tenant b may hold at most half the pool's device pages
CAP_A = 0.75  # tenant a's requests at most three quarters of it


def pattern(request_id: str, index: int, generation: int) -> np.ndarray:
    """What the engine writes into a block: distinct per request, block and rewrite."""
    seed = (hash(request_id) & 0xFFFF) * 1_000_003 + index * 7919 + generation * 31 + 1
    return np.random.default_rng(seed).integers(1, 256, PAGE_BYTES, dtype=np.uint8)


class DaemonMachine(RuleBasedStateMachine):
    policy = "lru"

    @initialize(device_pages=st.sampled_from([3, 5, 8, 16, 64, 300]),
                host_ratio=st.sampled_from([0, 1, 1, 2, 4]),
                admission=st.sampled_from(["working_set", "working_set", "reservation"]),
                slice_blocks=st.sampled_from([256, 2, 3]))
    def start(self, device_pages, host_ratio, admission, slice_blocks=256):
        self.loop = asyncio.new_event_loop()
        self.device_pages = device_pages
        limit_b = max(1, int(device_pages * LIMIT_B))
        pools = tuple(
            PoolConfig(name=name, page_bytes=PAGE_BYTES, block_tokens=4,
                       device_pages=device_pages, host_pages=device_pages * host_ratio,
                       policy=self.policy, device_backend="host", admission=admission,
                       link_bandwidth="1GiB/s", link_chunk=str(PAGE_BYTES * 4))
            for name in ("default", "decode"))
        self.config = Config(
            socket="", tcp="127.0.0.1:0", pools=pools, hold_s=1.0,
            links=(LinkConfig("default", "decode", bandwidth="1GiB/s",
                              chunk=str(PAGE_BYTES * 2)),),
            tenants=(TenantConfig("a", max_request_fraction=CAP_A),
                     TenantConfig("b", limit=limit_b)),
            # Calls naming more than a slice of blocks go a slice at a time, and holds end
            # so: slices of two or three blocks put those paths under every rule.
            slice_blocks=slice_blocks)
        self.daemon = self.loop.run_until_complete(self._make())
        self.written: dict[tuple[str, int], int] = {}  # (request, block) -> generation
        self.live: dict[str, str] = {}  # request -> tenant, as the engine believes
        self.generation = 0
        self.holder = "engine"

    async def _make(self) -> Node:
        return Node(self.config)

    def teardown(self):
        if hasattr(self, "daemon"):
            self.loop.run_until_complete(asyncio.wait_for(self.daemon.aclose(), 30))
            self.loop.close()

    # ------------------------------------------------------------------ the engine's side

    def run(self, coro):
        """One engine call: what it was handed before is no longer in use (as the service
        does at every call), then the call, bounded (nothing may hang). The reply reaches
        the engine a moment later: kvd's background work (a refill, a prefetch) runs in
        between, as it does while a reply crosses the socket."""

        async def call_then_reply():
            self.daemon.end_holds(self.holder)  # on the loop, as the service does
            result = await coro
            await asyncio.sleep(0.001)
            return result

        return self.loop.run_until_complete(asyncio.wait_for(call_then_reply(), 30))

    def arena(self, pool: str):
        return self.daemon.runtime(pool).arenas["device"].pages

    def write(self, block) -> None:
        self.generation += 1
        rid = block.request.request_id
        self.arena(block.request.pool)[block.page] = pattern(rid, block.index, self.generation)
        self.written[(rid, block.index)] = self.generation

    def check_read(self, blocks, lost: set[int]) -> None:
        for b in blocks:
            rid = b.request.request_id
            assert b.tier is TierKind.DEVICE, f"{b} handed out off the device"
            page = self.arena(b.request.pool)[b.page]
            if b.index in lost:
                assert not page.any(), f"{b} came back for recompute holding bytes"
                self.write(b)  # the engine recomputes it
                continue
            want = pattern(rid, b.index, self.written[(rid, b.index)])
            assert np.array_equal(page, want), f"{b}: bytes differ from what was written"

    # ------------------------------------------------------------------ rules

    @rule(rid=st.sampled_from(REQUESTS), tenant=st.sampled_from(TENANTS),
          share=st.integers(1, 8), handoff=st.booleans(),
          decode=st.sampled_from([False, False, True]))
    def admit(self, rid, tenant, share, handoff, decode=False):
        """A request admitted to the prefill pool (handed off to the decode pool later, or
        not), or now and then to the decode pool itself: its line then holds requests
        that the prefill pool's admissions reorder, with the reservations they make."""
        pages = max(1, share * self.device_pages // 10)  # sized to the pool: pressure
        try:
            result = self.daemon.admit(rid, tenant=tenant,
                                       pool="decode" if decode else "default",
                                       prompt_tokens=pages * 4, output_tokens=4, priority=0,
                                       lease="", handoff_pool="decode" if handoff and not decode
                                       else "")
        except KvdError:
            return
        if result.decision != "rejected":
            self.live[rid] = tenant
        if result.decision == "queued" and "working set" in result.reason:
            self._check_guarantee_admits(rid, tenant, result.reason)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), share=st.integers(1, 6), recompute=st.booleans(),
          pin=st.integers(0, 3))
    def allocate(self, data, share, recompute, pin):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        num = max(1, share * self.device_pages // 10)
        pin = pin == 0  # pins now and then
        intent = {"recompute_ok": recompute} | ({"pin_requested": True} if pin else {})
        pool = self.daemon.runtime_of(rid).pool
        tenant = self.live[rid]
        before = pool.tenancy.reserved_by_tenant[tenant]
        pins = self._pins()
        try:
            blocks, _ = self.run(self.daemon.allocate(rid, num, intent, holder=self.holder))
        except KvdError:
            return
        self._check_new_pins(pins)
        for b in blocks:
            self.write(b)
        # Growth after admission is held to the tenant's limit in force now.
        limit = pool.tenancy.quota(tenant).limit
        if limit is not None and pool.tenancy.reserved_by_tenant[tenant] > before:
            assert pool.tenancy.reserved_by_tenant[tenant] <= limit, (tenant, limit)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), all_blocks=st.booleans())
    def access(self, data, all_blocks):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self._request(rid)
        if req is None or req.state is not RequestState.ADMITTED:
            return
        live = [b.index for b in req.live_blocks()]
        indices = None if all_blocks or not live else sorted(
            data.draw(st.sets(st.sampled_from(live), min_size=1)))
        try:
            blocks, _, _ = self.run(self.daemon.access(rid, indices, holder=self.holder))
        except KvdError:
            return
        lost = {b.index for b in blocks if b.lost}
        for b in blocks:
            b.lost = False  # the reply told the engine (as the service's handle() does)
        self.check_read(blocks, lost)

    def tier_pages(self, block):
        rt = self.daemon.runtime(block.request.pool)
        return rt.arenas["device" if block.tier is TierKind.DEVICE else "host"].pages

    @precondition(lambda self: self.live)
    @rule(data=st.data(), start=st.integers(0, 4), n=st.integers(1, 4), commit=st.booleans(),
          pin=st.integers(0, 3), writes=st.booleans())
    def store(self, data, start, n, commit, pin, writes):
        """Prefix blocks from one chain of keys: requests share their leading blocks. The
        engine writes the blocks it is told to (`writes`), then commits what it stored;
        or its engine dies before writing, and it commits only what it was told needs no
        writing (a client reading StoreResponse.fresh to the letter)."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        keys = PREFIX_KEYS[start:start + n]
        intent = {"pin_requested": True} if pin == 0 else None
        pins = self._pins()
        try:
            shared = self.daemon.shared
            blocks, fresh, _ = self.run(shared.store(rid, "m", keys, holder=self.holder,
                                                     intent=intent))
        except KvdError:
            return
        self._check_new_pins(pins)
        for b, new, key in zip(blocks, fresh, keys):
            assert b.name == ("m", key) and not (new and b.committed)
            if new and writes:
                assert b.tier is not TierKind.NONE
                self.tier_pages(b)[b.page] = pattern(key.hex(), 0, 0)
        done = keys if writes else [k for k, new in zip(keys, fresh) if not new]
        if commit and done:
            self.loop.run_until_complete(self.daemon.shared.commit(rid, "m", done))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 8), pin=st.integers(0, 3))
    def load(self, data, n, pin):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        intent = {"pin_requested": True} if pin == 0 else None
        pins = self._pins()
        try:
            blocks = self.run(self.daemon.shared.load(rid, "m", PREFIX_KEYS[:n],
                                                      holder=self.holder, intent=intent))
        except KvdError:
            return
        self._check_new_pins(pins)
        for b, key in zip(blocks, PREFIX_KEYS):
            assert b.name == ("m", key) and b.tier is not TierKind.NONE
            assert np.array_equal(self.tier_pages(b)[b.page], pattern(key.hex(), 0, 0)), \
                f"{b}: shared bytes differ from what was written"

    @precondition(lambda self: self.live)
    @rule(data=st.data(), pin=st.booleans(), priority=st.sampled_from(list(Priority)[1:]),
          twice=st.booleans())
    def update_intents(self, data, pin, priority, twice):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self._request(rid)
        if req is None or not req.live_blocks():
            return
        index = data.draw(st.sampled_from([b.index for b in req.live_blocks()]))
        change = IntentChange(rid, index, {"pin_requested": pin, "priority": int(priority)})
        pins = self._pins()
        try:
            self.run(self.daemon.update_intents([change] * (2 if twice else 1)))
        except KvdError:
            return
        self._check_new_pins(pins)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self._request(rid)
        if req is None or not req.live_blocks():
            return
        index = data.draw(st.sampled_from([b.index for b in req.live_blocks()]))
        try:
            self.run(self.daemon.free(rid, [index]))
        except KvdError:
            return
        self.written.pop((rid, index), None)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        try:
            self.run(self.daemon.release(rid))
        except KvdError:
            pass
        self._forget(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), share=st.integers(1, 6), read=st.booleans(), free=st.booleans())
    def gone_under_the_engine(self, data, share, read, free):
        """The engine is handed a request's pages (it allocates blocks, or reads them all);
        someone else (an operator, another of the tenant's clients) then releases the
        request, or frees some of those blocks, and another engine allocates at once; the
        engine, mid-step, writes what it was handed. The other engine's blocks must not be
        in the pages that went: they stay out of use until the engine's next call."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        pool = self.daemon.runtime_of(rid).pool.name
        others = sorted(r for r in self.live
                        if r != rid and (req := self._request(r)) is not None
                        and req.state is RequestState.ADMITTED and req.pool == pool)
        if others:
            other = data.draw(st.sampled_from(others))
        else:  # the other engine's request is admitted now
            free = [r for r in REQUESTS if r not in self.live]
            if not free:
                return
            other = free[0]
            self.admit(other, data.draw(st.sampled_from(TENANTS)), share, False,
                       decode=pool == "decode")
            req = self._request(other)
            if req is None or req.state is not RequestState.ADMITTED:
                return
        num = max(1, share * self.device_pages // 10)
        try:
            if read:
                handed, _, _ = self.run(self.daemon.access(rid, None, holder=self.holder))
            else:
                handed, _ = self.run(self.daemon.allocate(rid, num, holder=self.holder))
        except KvdError:
            return
        for b in handed:
            if b.lost or not read:
                b.lost = False
                self.write(b)
        if free:  # some of them: the rest stay the engine's
            if not handed:
                return
            handed = data.draw(st.lists(st.sampled_from(handed), min_size=1, unique=True))
        freed = [b.index for b in handed]
        handed = [(b.request.pool, b.page) for b in handed]

        async def release_then_allocate():
            try:  # not the engine's call: its holds stay
                if free:
                    await self.daemon.free(rid, sorted(freed))
                else:
                    await self.daemon.release(rid)
            except KvdError:
                return None
            # The other engine's allocation, written the moment its reply comes.
            task = asyncio.ensure_future(self.daemon.allocate(other, num, holder="other"))
            await asyncio.sleep(0.01)
            return task

        task = self.loop.run_until_complete(asyncio.wait_for(release_then_allocate(), 30))
        if not free:
            self._forget(rid)
        elif task is None:
            return  # nothing was freed: what the engine writes is its own
        else:
            for index in freed:
                self.written.pop((rid, index), None)
        blocks = []
        if task is not None and task.done():
            try:
                blocks, _ = task.result()
            except KvdError:
                pass
            for b in blocks:
                self.write(b)
        for pool, page in handed:  # the engine's late writes
            self.arena(pool)[page] = pattern(rid, -1, 0)
        self.check_read(blocks, set())
        # The engine's next call; the other engine's allocation, if it waited for the
        # released pages, gets them now, and it is done with them at once.
        self.daemon.end_holds(self.holder)
        if task is not None and not task.done():
            try:
                blocks, _ = self.loop.run_until_complete(asyncio.wait_for(task, 30))
            except KvdError:
                blocks = []
            for b in blocks:
                self.write(b)
        self.daemon.end_holds("other")

    @rule(share=st.integers(1, 5), pool=st.sampled_from(["default", "decode"]))
    def evict(self, share, pool):
        num = max(1, share * self.device_pages // 10)
        try:
            self.run(self.daemon.evict(pool, num))
        except KvdError:
            pass

    @precondition(lambda self: self.live)
    @rule(data=st.data(), cancel_after=st.sampled_from([None, 0, 1]),
          under_the_engine=st.booleans())
    def handoff(self, data, cancel_after, under_the_engine):
        """The engine hands its request off; or (`under_the_engine`) a router does, just
        after the engine read the request, while its forward pass still writes the pages:
        the decode pool must get what the engine wrote before its next call."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if not under_the_engine:
            self.run(self._handoff(rid, cancel_after))
            return
        try:
            handed, _, _ = self.run(self.daemon.access(rid, None, holder=self.holder))
        except KvdError:
            handed = []
        lost = {b.index for b in handed if b.lost}
        for b in handed:
            b.lost = False
        self.check_read(handed, lost)

        async def router_then_engine():
            task = asyncio.ensure_future(self._handoff(rid, cancel_after))
            holds = self.daemon.runtime("default").pool.pages.holds
            for _ in range(1000):  # until it waits for the engine, or is over
                if task.done() or holds.watchers:
                    break
                await asyncio.sleep(0.001)
            for b in handed:  # the engine's forward pass, late
                if b.request.request_id == rid:
                    self.write(b)
            self.daemon.end_holds(self.holder)  # the engine's next call
            await task

        self.loop.run_until_complete(asyncio.wait_for(router_then_engine(), 30))

    async def _handoff(self, rid, cancel_after):
        req = self._request(rid)
        named = self.daemon.runtime("default").pool.pages.named
        prefix = ([b.name for b in req.shared if b.committed and named.get(b.name) is b]
                  if req is not None and req.pool != "decode" else [])
        stream = self.daemon.handoff(rid, "decode")
        seen = 0
        try:
            async for progress in stream:
                if progress["done"]:
                    # The engine reads its blocks in the decode pool: same bytes; and the
                    # shared prefix it used came along, under the same names.
                    self.check_read(progress["blocks"], set())
                    decode = self.daemon.runtime("decode").pool.pages.named
                    for name in prefix:
                        b = decode[name]
                        assert b.committed and b.tier is not TierKind.NONE, b
                        assert np.array_equal(self.tier_pages(b)[b.page],
                                              pattern(name[1].hex(), 0, 0)), \
                            f"{b}: the prefix came to decode with other bytes"
                    return
                if cancel_after is not None and seen >= cancel_after:
                    return
                seen += 1
        except KvdError:
            return
        finally:
            await stream.aclose()

    @rule(tenant=st.sampled_from(TENANTS), limit=st.integers(1, 40))
    def lower_or_raise_limit(self, tenant, limit):
        """Quotas change at run time: what is admitted stays, growth past it is refused,
        and a queued request past it is rejected."""
        try:
            self.daemon.set_quota(tenant, "", limit=limit, create=True)
        except KvdError:
            pass  # below the tenant's guarantee: refused, nothing changes
        self._forget_rejected()

    @rule(tenant=st.sampled_from(TENANTS), pool=st.sampled_from(["default", "decode"]),
          part=st.sampled_from([None, 0, 1, 2, 4, 16]))
    def cluster_part(self, tenant, pool, part):
        """The cluster's picture moves this node's part of a tenant's cluster-wide limit
        (what the tenant may reserve here now, as kvd.cluster reconciles it): a request past
        it waits, none is rejected for it."""
        layer = dict(self.daemon.quotas.cluster)
        if part is None:
            layer.pop((tenant, pool), None)
        else:
            layer[(tenant, pool)] = {"may_reserve": part}
        if self.daemon.quotas.set_cluster(layer):
            self.daemon.settle_queues()
            for rt in self.daemon.runtimes():
                rt.waiters.notify()
                rt.room_may_have_changed()
        self._forget_rejected()

    @rule(pool=st.sampled_from(["default", "decode"]), policy=st.sampled_from(policy_names()))
    def switch_policy(self, pool, policy):
        """An operator switches a pool's policy with blocks held, pinned and in flight."""
        self.run(self.daemon.set_policy(pool, policy))
        self._forget_rejected()

    @rule(weights=st.tuples(st.sampled_from([0.5, 1.0, 4.0]), st.sampled_from([0.5, 1.0, 4.0])),
          guaranteed=st.tuples(st.integers(0, 3), st.integers(0, 3)),
          limit_a=st.sampled_from([0, 1, 4, 40]))
    def reload_tenants(self, weights, guaranteed, limit_a):
        """SIGHUP: the config's tenants again, with other weights, guarantees and limits
        (tenant a's per-request cap, which the invariants check, stays)."""
        limit_b = max(1, int(self.device_pages * LIMIT_B))
        tenants = (TenantConfig("a", weight=weights[0], guaranteed=guaranteed[0],
                                limit=limit_a and max(limit_a, guaranteed[0]),
                                max_request_fraction=CAP_A),
                   TenantConfig("b", weight=weights[1], guaranteed=guaranteed[1],
                                limit=max(limit_b, guaranteed[1])))
        self.daemon.apply_tenants(dataclasses.replace(self.config, tenants=tenants))
        self._forget_rejected()

    # ------------------------------------------------------------------ bookkeeping

    def _check_guarantee_admits(self, rid, tenant, reason):
        """A request waiting for room among the running working sets is past its tenant's
        guarantee: what its tenant runs (its requests' own pages, summed here) and its
        charge exceed the pages the tenant is guaranteed; within them it goes in at once,
        whatever other tenants' working sets hold."""
        req = self._request(rid)
        if reason.startswith("handoff pool"):  # its reservation in the decode pool waits
            pool = self.daemon.runtime("decode").pool
            charge = pool.admission.projected_pages(req.prompt_tokens, req.output_tokens)
        else:
            pool = self.daemon.runtime(req.pool).pool
            charge = pool.admission.working_set_charge(req)
        running = sum(counted_pages(r) for r in pool.requests.values()
                      if r.tenant == tenant and r.state is not RequestState.QUEUED)
        guaranteed = pool.tenancy.guaranteed(tenant)
        assert running + charge > guaranteed + 1e-6, (
            f"{rid} of tenant {tenant} waits for other tenants' working sets in pool "
            f"{pool.name!r} with "
            f"{running} + {charge} of its {guaranteed:g} guaranteed pages: {reason}")

    def _head(self, pool):
        """The first queued request in fair order of a tenant whose first is not capped."""
        capped = set()
        for req in sorted(pool.queue.values(), key=pool.admission._queue_key):
            if req.tenant in capped:
                continue
            if not self._capped(pool, req):
                return req
            capped.add(req.tenant)
        return None

    def _capped(self, pool, req) -> bool:
        """Whether a queued request waits on its own tenant's limit, in its pool or in the
        decode pool it will be handed off to."""
        if pool.tenancy.over_limit(req.tenant, req.projected_pages):
            return True
        if not req.handoff_pool:
            return False
        decode = self.daemon.runtime(req.handoff_pool).pool
        pages = decode.admission.projected_pages(req.prompt_tokens, req.output_tokens)
        return decode.tenancy.over_limit(req.tenant, pages)

    def _request(self, rid):
        rt = self.daemon.request_index.get(rid)
        return rt.pool.requests.get(rid) if rt is not None else None

    def _pins(self) -> dict[str, dict[str, int]]:
        """Each pool's pins by tenant."""
        return {name: dict(rt.pool.tenancy.pinned_by_tenant)
                for name, rt in self.daemon.pools.items()}

    def _check_new_pins(self, before: dict[str, dict[str, int]]) -> None:
        """A tenant whose pins a call added has them, and every other tenant's pins or
        guarantee (whichever is larger), within the device tier: no pin took a page another
        tenant is guaranteed (the guarantees in force now; scaled down when they add up to
        more than the tier)."""
        for name, rt in self.daemon.pools.items():
            tenancy, cap = rt.pool.tenancy, rt.pool.device.capacity
            now = tenancy.pinned_by_tenant
            guaranteed = effective_guarantees(tenancy.quotas, cap)
            for tenant in now:
                if now[tenant] > before[name].get(tenant, 0):
                    others = sum(max(now[t], guaranteed.get(t, 0.0))
                                 for t in set(now) | set(guaranteed) if t != tenant)
                    assert now[tenant] + others <= cap + 1e-6, (name, tenant, dict(now),
                                                                 guaranteed)

    def _forget_rejected(self):
        """Queued requests kvd rejected after the change (they could never be admitted any
        more): gone, and told so; none it still holds."""
        for rid in [r for r in self.live if r in self.daemon.rejected]:
            assert rid not in self.daemon.request_index, rid
            self._forget(rid)

    def _forget(self, rid):
        self.live.pop(rid, None)
        for key in [k for k in self.written if k[0] == rid]:
            del self.written[key]

    @invariant()
    def promises_hold(self):
        if not hasattr(self, "daemon"):
            return
        # A handoff its caller gave up on rolls back in the background: done first.
        in_flight = list(self.daemon.handoffs.in_flight)
        if in_flight:
            self.loop.run_until_complete(asyncio.wait_for(
                asyncio.gather(*in_flight, return_exceptions=True), 30))
        problems = self.loop.run_until_complete(asyncio.wait_for(self.daemon.self_check(), 30))
        assert problems == [], problems
        for rt in self.daemon.pools.values():
            pool = rt.pool
            assert pool.num_pinned <= pool.device.capacity
            assert len(rt.transit) == 0 and pool.pages.num_moving_blocks() == 0, "left in transit"
            cap = int(CAP_A * pool.device.capacity)
            for req in pool.requests.values():
                if (req.tenant == "a" and req.state is RequestState.ADMITTED
                        and not req.keeper):
                    held = req.num_live_blocks + len(req.shared)
                    assert held <= max(cap, req.projected_pages), req
        # Nothing waits for ever in a pool that runs nothing: no request there will end to
        # make room, so the head of its line (past the tenants that wait on their own caps:
        # in an idle pool only the cluster's part of a limit, which the cluster moves to
        # where the demand is) can only be waiting for its handoff reservation in the decode
        # pool (whose requests end), and the rest behind it.
        pool = self.daemon.runtime("default").pool
        if pool.queue and not any(r.state is not RequestState.QUEUED and not r.keeper
                                  for r in pool.requests.values()):
            head = self._head(pool)
            why = pool.admission.why_waiting(head) if head is not None else ""
            assert head is None or why.startswith("handoff pool"), (
                f"{head.request_id} waits for ever: {why}")
        # No queued request could go now: whatever made room (a release, a free, a hold
        # ended, a copy done, a quota or policy changed) or moved the line's fair order (a
        # tenant's reserved, queued or kept pages) ran the line again. The first of
        # each line in fair order, past the tenants whose first waits on their own cap
        # (here or in the decode pool: room no other tenant's request takes or frees), does
        # not fit, and nobody behind it is within a guarantee that lets it pass.
        for rt in self.daemon.pools.values():
            admission = rt.pool.admission
            head = self._head(rt.pool)
            assert head is None or not admission.can_admit(head), (
                f"{rt.pool.name}: {head.request_id} could go now, yet waits: "
                f"{admission.why_waiting(head)}")
            passing = admission._guaranteed_in_line()
            assert passing is None, f"{rt.pool.name}: {passing.request_id} could go now"
        # The engine's view and kvd's agree: every block it wrote is still known.
        for (rid, index) in self.written:
            req = self._request(rid)
            if req is not None and index < len(req.blocks):
                assert req.blocks[index] is not None, f"{rid}[{index}] vanished"



@pytest.mark.parametrize("policy", policy_names())
def test_daemon_keeps_its_promises(policy):
    machine = type(f"DaemonMachine_{policy.replace(':', '_')}", (DaemonMachine,),
                   {"policy": policy})
    machine.TestCase.settings = settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
        suppress_health_check=list(HealthCheck))
    machine.TestCase().runTest()


class _Draws:
    """data.draw for a replayed example: the values it drew, in order."""

    def __init__(self, *values) -> None:
        self.values = list(values)

    def draw(self, strategy):
        return self.values.pop(0)


def _line_behind_tenant_a(machine) -> None:
    """Replayed from an example this machine found: tenant a runs r0 and queues r4 and r5,
    and tenant b's r3 waits behind a's requests, b being further over its fair share."""
    machine.start(device_pages=64, host_ratio=0, admission="working_set")
    machine.admit(handoff=False, rid="r0", share=5, tenant="b")  # over b's limit
    machine.admit(handoff=False, rid="r0", share=1, tenant="a")
    machine.store(commit=False, data=_Draws("r0"), n=1, pin=0, start=0, writes=False)
    cold = {"pin": False, "priority": Priority.COLD, "twice": False}
    machine.update_intents(data=_Draws("r0", 0), **cold)
    machine.allocate(data=_Draws("r0"), pin=0, recompute=False, share=4)
    machine.update_intents(data=_Draws("r0", 0), **cold)
    machine.admit(handoff=False, rid="r4", share=7, tenant="a")
    machine.admit(handoff=False, rid="r5", share=1, tenant="a")
    machine.update_intents(data=_Draws("r0", 0), **cold)
    machine.store(commit=False, data=_Draws("r0"), n=1, pin=0, start=0, writes=False)
    machine.allocate(data=_Draws("r5"), pin=0, recompute=False, share=1)
    machine.admit(handoff=False, rid="r1", share=2, tenant="b")
    machine.admit(handoff=False, rid="r3", share=1, tenant="b")
    machine.promises_hold()
    pool = machine.daemon.runtime("default").pool
    assert pool.requests["r3"].state is RequestState.QUEUED  # behind a's requests


@pytest.mark.parametrize("grows", ["allocation", "store"])
def test_a_tenant_growing_past_its_reservation_lets_in_the_lines_new_head(grows):
    """Found by this machine: tenant a's request grew past what it had reserved (blocks
    allocated, or prefix blocks stored), which put a further over its fair share, so
    tenant b's queued request went to the head of the line in fair order, and fitted; but
    only a release, a free or a quota change ran the line again, and it waited."""
    machine = type("DaemonMachine_deadline", (DaemonMachine,), {"policy": "deadline"})()
    try:
        _line_behind_tenant_a(machine)
        pool = machine.daemon.runtime("default").pool
        reserved = pool.requests["r0"].reserved_pages
        if grows == "allocation":
            machine.allocate(data=_Draws("r0"), pin=0, recompute=False, share=1)
        else:
            machine.store(commit=False, data=_Draws("r0"), n=7, pin=1, start=1, writes=True)
        assert pool.requests["r0"].reserved_pages > reserved
        assert pool.requests["r3"].state is RequestState.ADMITTED
        machine.promises_hold()
    finally:
        machine.teardown()
