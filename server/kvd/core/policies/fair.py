"""Memory-fair eviction: the tenant most above its fair share pays first, and within it the
largest request pays first ("progressive taxation", seed 000); the page order inside a
request comes from a base policy (reuse by default; lru, intent, deadline or regret).

Guaranteed pages are never taken to serve another tenant. Victim selection is O(T) per victim
for T tenants and O(1) in resident pages: each tenant's requests sit in buckets by their
evictable pages (sizes kept sorted, and there are few distinct sizes), and each request has
its own base policy.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter, OrderedDict
from collections.abc import Collection

from kvd.core.blocks import Block, Request
from kvd.core.clock import Clock
from kvd.core.policies.base import EvictionPolicy
from kvd.core.policies.classed import LastReadQueued
from kvd.core.tenancy import Tenancy, tally


_NONE: Counter = Counter()  # no protected blocks (never written to)


class _RequestsBySize:
    """One tenant's requests by how many evictable pages each has: a bucket per size (oldest
    arrival first) and the sizes in use, sorted."""

    def __init__(self) -> None:
        self.buckets: dict[int, OrderedDict[Request, None]] = {}
        self.sizes: list[int] = []

    def move(self, req: Request, old: int, new: int) -> None:
        if old:
            bucket = self.buckets[old]
            del bucket[req]
            if not bucket:
                del self.buckets[old]
                del self.sizes[bisect_left(self.sizes, old)]
        if new:
            bucket = self.buckets.get(new)
            if bucket is None:
                bucket = self.buckets[new] = OrderedDict()
                insort(self.sizes, new)
            bucket[req] = None

    def largest(self, taken: Counter[Request]) -> tuple[Request, int]:
        """The request with the most pages left after `taken`, and how many it can give
        before another is larger."""
        best, best_left, second_left = None, -1, 0
        for size in reversed(self.sizes):
            if size <= second_left:
                break  # nothing smaller can beat the best two
            for req in self.buckets[size]:
                left = size - taken[req]
                if left > best_left:
                    best, best_left, second_left = req, left, max(best_left, 0)
                else:
                    second_left = max(second_left, left)
                if size <= second_left:
                    break
        return best, max(1, best_left - second_left + 1)


class FairPolicy(LastReadQueued):
    """Two steps: which tenant pays (usage / fair share, largest first; never below its
    guarantee for another tenant's sake), then which of its pages (largest request first, in
    the base policy's order)."""

    name = "fair"
    fair = True
    per_request_order = True

    def __init__(self, clock: Clock, tenancy: Tenancy, base: type[EvictionPolicy]) -> None:
        super().__init__(clock)
        self.tenancy = tenancy
        self.base = base
        self.name = f"fair:{base.name}"
        self.uses_intent = base.uses_intent
        self.eager_touch = base.eager_touch
        # A base that reads recency lazily (at its choice, from block.last_access) orders a
        # block by whether its read was recorded before it was queued: the inserts are
        # logged while reads are pending, and the reads recorded late are given to the
        # blocks queued after them (see LastReadQueued).
        self.per_request_order = base.eager_touch
        self.orders_late_reads = not base.eager_touch
        self._by_request: dict[Request, EvictionPolicy] = {}
        self._by_size: dict[str, _RequestsBySize] = {}
        self._held_by_tenant: Counter[str] = Counter()
        self._num = 0

    def insert(self, block: Block) -> None:
        req = block.request
        sub = self._by_request.get(req)
        if sub is None:
            sub = self._by_request[req] = self.base(self.clock)
        sub.insert(block)
        held = len(sub)
        by_size = self._by_size.get(req.tenant)
        if by_size is None:
            by_size = self._by_size[req.tenant] = _RequestsBySize()
        by_size.move(req, held - 1, held)
        self._held_by_tenant[req.tenant] += 1
        self._num += 1
        if self.late_inserts is not None:
            self.late_inserts.append((next(self._seq), block))

    def remove(self, block: Block) -> None:
        req = block.request
        sub = self._by_request[req]
        sub.remove(block)
        held = len(sub)
        self._by_size[req.tenant].move(req, held + 1, held)
        tally(self._held_by_tenant, req.tenant, -1)
        self._num -= 1
        if not held:
            del self._by_request[req]

    def touch(self, block: Block) -> None:
        self._by_request[block.request].touch(block)

    def touch_many(self, blocks) -> None:
        # A read passes one request's blocks: hand each request's run of them to its own
        # base policy in one call rather than block by block.
        run: list[Block] = []
        req = None
        for block in blocks:
            if block is None:
                continue
            if block.request is not req:
                self._touch_run(req, run)
                req, run = block.request, []
            run.append(block)
        self._touch_run(req, run)

    def touch_request(self, req: Request) -> None:
        sub = self._by_request.get(req)
        if sub is not None:
            sub.touch_request(req)

    def _touch_run(self, req: Request | None, blocks: list[Block]) -> None:
        sub = self._by_request.get(req) if req is not None else None
        if sub is not None and blocks:
            sub.touch_many(blocks)

    def reorder(self, block: Block) -> None:
        queue = block.queue
        self._by_request[block.request].reorder(block)
        if self.late_inserts is not None and block.queue is not queue:
            # Queued again by its base (a class of its own, see ClassedPolicy.reorder):
            # an insert, as far as the reads recorded late go.
            self.late_inserts.append((next(self._seq), block))

    def on_evicted(self, block: Block) -> None:
        sub = self._by_request.get(block.request)
        if sub is not None:
            sub.on_evicted(block)

    def __len__(self) -> int:
        return self._num

    def num_of(self, requests: Collection[Request]) -> int:
        """How many blocks of these requests the policy holds."""
        return sum(len(sub) for req in requests
                   if (sub := self._by_request.get(req)) is not None)

    def __contains__(self, block: Block) -> bool:
        sub = self._by_request.get(block.request)
        return sub is not None and block in sub

    def choose(self, n: int, for_tenant: str | None = None,
               protected: Collection[Block] = (), held: Collection[Request] = ()
               ) -> list[Block] | None:
        """See EvictionPolicy.choose; none of the blocks of `held` either (requests an engine
        holds by request, see Holds: as if they had left the policy)."""
        # Protected blocks still count in their tenant's usage but cannot be given: they start
        # as unavailable, so no tenant or request is asked for pages it cannot give.
        unavailable_by_tenant: Counter[str] = _NONE
        unavailable_by_request: Counter[Request] = _NONE
        if protected or held:
            unavailable_by_tenant, unavailable_by_request = Counter(), Counter()
            for block in protected:
                if block in self:
                    unavailable_by_tenant[block.request.tenant] += 1
                    unavailable_by_request[block.request] += 1
            for req in held:
                sub = self._by_request.get(req)
                if sub is not None:  # all of its blocks here, its protected ones counted
                    unavailable_by_tenant[req.tenant] += len(sub) - unavailable_by_request[req]
                    unavailable_by_request[req] = len(sub)
        if n > self._num - unavailable_by_tenant.total():
            return None
        # First decide how many pages each request gives (usage falls as victims are taken,
        # so they spread), in batches that end where the order could change; then ask each
        # request's base policy once.
        taken_by_tenant: Counter[str] = Counter()
        taken_by_request: Counter[Request] = Counter()
        left = n
        while left:
            paying = self._paying_tenant(taken_by_tenant, unavailable_by_tenant, for_tenant)
            if paying is None:
                return None  # what is left is guaranteed to other tenants
            tenant, tenant_batch = paying
            req, req_batch = self._by_size[tenant].largest(
                taken_by_request + unavailable_by_request
                if unavailable_by_request is not _NONE else taken_by_request)
            k = max(1, min(left, tenant_batch, req_batch))
            taken_by_request[req] += k
            taken_by_tenant[tenant] += k
            left -= k
        victims: list[Block] = []
        for req, k in taken_by_request.items():
            victims.extend(self._by_request[req].choose(k, protected=protected))
        return victims

    def _paying_tenant(self, taken: Counter[str], unavailable: Counter[str],
                       for_tenant: str | None) -> tuple[str, int] | None:
        """The tenant most above its fair share pays, and how many pages it can give before
        another would. Another tenant pays for `for_tenant` only while it is above both its
        fair share and its guarantee; when none is, the tenant that needs the room pays with
        its own pages."""
        ranked = []
        engine_held = self.tenancy.engine_held
        for tenant, owned in self._held_by_tenant.items():
            evictable = owned - taken[tenant] - unavailable[tenant]
            if evictable <= 0:
                continue
            usage = self.tenancy.usage(tenant) - taken[tenant]
            share = max(self.tenancy.fair_share(tenant), 1e-9)
            floor = 0.0
            if tenant != for_tenant:
                guaranteed = self.tenancy.guaranteed(tenant)
                floor = max(guaranteed, share) if for_tenant is not None else guaranteed
                # Pages go whole: a tenant charged for part of a shared page can be above
                # its guarantee by less than the page it would give.
                if usage <= floor + 1e-6 or usage - 1 < guaranteed - 1e-6:
                    continue
            # The order counts what the tenant holds on the engines' GPUs too: of two
            # tenants over their shares here, the one holding more there pays first.
            held = usage + engine_held.get(tenant, 0.0)
            ranked.append((held / share, tenant, usage, share, evictable, floor, held))
        if not ranked:
            return None
        ranked.sort(reverse=True)
        ratio, tenant, usage, share, evictable, floor, held = ranked[0]
        batch = min(evictable, int(usage - floor) if floor else evictable)
        if len(ranked) > 1:  # until it falls to the next tenant's ratio
            batch = min(batch, int(held - ranked[1][0] * share) + 1)
        return tenant, max(1, batch)
