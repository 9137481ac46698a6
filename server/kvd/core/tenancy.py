"""Tenancy: who holds, reserves, waits for and reads what in one pool, their quotas, and
their fair shares of its device tier (DESIGN.md, "What kvd decides": fairness in bytes).

The pool keeps these figures as it changes pages and requests; admission and the fair
policy read them from here, never from the pool.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from fractions import Fraction

from kvd.core.jobs import TokenBucket
from kvd.core.blocks import Request
from kvd.core.fairness import TenantQuota, effective_guarantees, water_fill

_DEFAULT_QUOTA = TenantQuota()


def tally(counts: Counter, key, delta) -> None:
    """counts[key] += delta, and the key gone once its count is back to 0: a tenant that held,
    reserved, queued or pinned something and no longer does is not among the keys of the
    counts that say so. (A Counter keeps the key: every tenant ever seen then stayed in the
    fair shares, admission's room and the eviction order, computed over all of them on every
    call: with a thousand gone, an admit, allocate and release took 4 to 8 ms, not 0.2.)"""
    left = counts[key] + delta
    if left:
        counts[key] = left
    else:
        counts.pop(key, None)


class Tenancy:
    """One pool's tenants. Counters are in pages (`waiting_by_tenant`: requests)."""

    def __init__(self, quotas: dict[str, TenantQuota] | None = None) -> None:
        self.quotas: dict[str, TenantQuota] = dict(quotas or {})
        # The device pages fair shares divide, set by the pool (its device tier, less the
        # free reserve under a fair policy: the reserve is the buffer tenants below their
        # share grow into).
        self.share_capacity = 0
        self.device_by_tenant: Counter[str] = Counter()  # resident blocks, by owner
        self.kept_by_tenant: Counter[str] = Counter()  # resident kept prefix blocks, by owner
        # Shared blocks' cost moved from their owner to the tenants using them, 1/k each for
        # k tenants (exact fractions, so moving and moving back leaves nothing behind):
        # a tenant's device usage is device_by_tenant + shared_adjust.
        self.shared_adjust: Counter[str] = Counter()
        # Device pages of kept prefix blocks nobody uses, by the tenants they are charged to
        # (1/k each, as the split): cache, not working set (see reserve_headroom).
        self.idle_kept: Counter[str] = Counter()
        # Per tenant: device pages of shared blocks (k > 1 payers) charged in part to it, and
        # the pages the split saves it (1 - 1/k each); and the kept blocks its requests use.
        # Kept as they change, so a reader of these figures (stats, Explain) walks none of the
        # kept blocks, of which a host tier holds hundreds of thousands.
        self.shared_pages: Counter[str] = Counter()
        self.shared_saved: Counter[str] = Counter()
        self.named_in_use: Counter[str] = Counter()
        # Blocks each tenant holds on the GPUs of the engines kvd follows (kvd.kv_events),
        # set by the node as their events come: who pays first in the fair order.
        self.engine_held: dict[str, float] = {}
        self.reserved_by_tenant: Counter[str] = Counter()  # admitted requests' reservations
        self.queued_by_tenant: Counter[str] = Counter()  # queued requests' projected pages
        self.waiting_by_tenant: Counter[str] = Counter()  # queued requests, not pages
        self.pinned_by_tenant: Counter[str] = Counter()  # each pinned block to one tenant
        # What each tenant's pins claim: every block its requests pin, a shared block pinned
        # by several tenants in each one's (its pin may pass to any of them: blocks.pin_tenant).
        self.pin_room_by_tenant: Counter[str] = Counter()
        self.blocks_read_by_tenant: Counter[str] = Counter()
        self._shares: dict[str, float] | None = None
        self._guarantees: dict[str, float] | None = None
        # Called when reserved, queued or kept pages change (demand_changed, kept_changed):
        # what the admission line's fair order is made of (see Admission).
        self.on_demand: Callable[[], None] | None = None

    def quota(self, tenant: str) -> TenantQuota:
        """The tenant's quota (the default one for a tenant the config does not name)."""
        return self.quotas.get(tenant) or _DEFAULT_QUOTA

    def set_quota(self, tenant: str, quota: TenantQuota) -> None:
        """Set a tenant's quota; fair shares are computed again."""
        self.quotas[tenant] = quota
        self._shares = self._guarantees = None

    def budget(self, req: Request, page_bytes: int, now: float) -> None:
        """Give a request the bandwidth buckets its tenant's quota asks for: a cap on its
        transfers, and a read budget (a second's worth of reads may come at once)."""
        quota = self.quota(req.tenant)
        if quota.request_bandwidth_cap:
            rate = quota.request_bandwidth_cap
            req.transfer_cap = TokenBucket(rate, max(rate / 10, page_bytes), now)
        if quota.read_budget:
            req.read_bucket = TokenBucket(quota.read_budget,
                                          max(quota.read_budget, page_bytes), now)

    def set_share_capacity(self, pages: int) -> None:
        """The pages fair shares divide (the policy decides what counts)."""
        self.share_capacity = pages
        self._shares = self._guarantees = None

    def kept_changed(self, tenant: str, delta: int) -> None:
        """A kept prefix page of the tenant came to (1) or left (-1) the device tier. Kept
        pages are demand too: else a tenant with no request running has no share, and its
        kept prefixes would be the first to go while another tenant floods the pool."""
        tally(self.kept_by_tenant, tenant, delta)
        self._shares = None
        if self.on_demand is not None:
            self.on_demand()

    def demand_changed(self) -> None:
        """Reserved or queued pages changed: fair shares are recomputed when next asked."""
        self._shares = None
        if self.on_demand is not None:
            self.on_demand()

    def fair_shares(self) -> dict[str, float]:
        """Each tenant's fair share of the device tier, over current demand (reserved,
        queued and kept prefix pages): weighted max-min with guarantees and limits."""
        if self._shares is None:
            reserved, queued, kept = (self.reserved_by_tenant, self.queued_by_tenant,
                                      self.kept_by_tenant)
            demand = {t: float(reserved[t] + queued[t] + kept[t])
                      for t in set(reserved) | set(queued) | set(kept)}
            self._shares = water_fill(self.share_capacity, demand, self.quotas)
        return self._shares

    def fair_share(self, tenant: str) -> float:
        """A tenant's fair share in pages: weighted max-min over current demand."""
        return self.fair_shares().get(tenant, 0.0)

    def usage(self, tenant: str) -> float:
        """Device pages the tenant's blocks hold, a shared page counting 1/k to each of the
        k tenants using it."""
        adjust = self.shared_adjust.get(tenant)
        used = self.device_by_tenant[tenant]
        return used + float(adjust) if adjust else used

    def usages(self) -> dict[str, float]:
        """usage() of every tenant holding device pages."""
        usages = {t: self.usage(t)
                  for t in set(self.device_by_tenant) | set(self.shared_adjust)}
        return {t: used for t, used in usages.items() if used}

    def split(self, owner: str, payers: tuple[str, ...], sign: int) -> None:
        """A shared device page owned by `owner` comes (sign 1) or goes (-1) for `payers`:
        its cost moves from the owner to them, 1/k each."""
        if payers == (owner,):
            return
        adjust = self.shared_adjust
        adjust[owner] -= sign
        part = Fraction(sign, len(payers))
        for tenant in payers:
            adjust[tenant] += part
        for tenant in (owner, *payers):
            if not adjust[tenant]:
                del adjust[tenant]
        if len(payers) > 1:
            saved = sign - part
            for tenant in payers:
                tally(self.shared_pages, tenant, sign)
                tally(self.shared_saved, tenant, saved)

    def idle_changed(self, payers: tuple[str, ...], sign: int) -> None:
        """A kept block charged to `payers` became (1) or stopped being (-1) an idle device
        page: in the device tier, named, used by no request."""
        idle = self.idle_kept
        # A whole page in an int where one tenant pays (a Fraction's arithmetic costs
        # microseconds, and a Store of 65,536 blocks made it half a second of the loop).
        part = sign if len(payers) == 1 else Fraction(sign, len(payers))
        for tenant in payers:
            idle[tenant] += part
            if not idle[tenant]:
                del idle[tenant]

    def guaranteed(self, tenant: str) -> float:
        """A tenant's guaranteed pages, scaled down when guarantees overcommit the pages
        fair shares divide (as they are in its fair share): what kvd honours. Unscaled, the
        tenant that grew first would keep all of its guarantee, and the others less than
        theirs."""
        if self._guarantees is None:
            self._guarantees = effective_guarantees(self.quotas, self.share_capacity)
        return self._guarantees.get(tenant, 0.0)

    def pin_claims(self, capacity: int, more: Mapping[str, int]) -> dict[str, float]:
        """Each tenant's claim on a `capacity`-page device tier that no other tenant's pins
        may take, once `more` pins are added (by tenant): the larger of its pins and its
        guarantee (scaled down when guarantees overcommit the tier). A guarantee counts
        whether or not its tenant uses it: unpinned pages taken from it are given back by
        eviction when its tenant comes, pinned ones never would be."""
        claims = {t: g for t, g in effective_guarantees(self.quotas, capacity).items() if g}
        pinned = self.pin_room_by_tenant
        for tenant in set(pinned) | set(more):
            pins = pinned[tenant] + more.get(tenant, 0)
            claims[tenant] = max(float(pins), claims.get(tenant, 0.0))
        return claims

    def headroom(self, tenant: str) -> int:
        """Device pages the tenant may still take before it reaches its fair share."""
        return int(self.fair_share(tenant) - self.usage(tenant) + 1e-6)

    def reserve_headroom(self, tenant: str) -> int:
        """Device pages the tenant's requests may take from the free reserve: up to its fair
        share, its idle kept prefixes not counted. They are cache that the reserve's refill
        takes back in the background; counting them would leave a tenant whose kept
        prefixes fill its share waiting on a demotion for every page its requests grow by."""
        idle = self.idle_kept.get(tenant)
        return int(self.fair_share(tenant) - self.usage(tenant) + float(idle or 0) + 1e-6)

    def over_share(self) -> list[str]:
        """Tenants holding more device pages than their fair share and their guarantee."""
        return [t for t, used in self.usages().items()
                if used > max(self.fair_share(t), self.guaranteed(t)) + 1e-6]

    def over_limit(self, tenant: str, more: int) -> bool:
        """Whether reserving `more` pages would take the tenant past its limit."""
        cap = self.quota(tenant).reserve_cap()
        return cap is not None and self.reserved_by_tenant[tenant] + more > cap

    def cap_words(self, tenant: str, style: str = "") -> str:
        """What over_limit holds the tenant to, in words ("its 8-page limit", or with
        style "of": "its limit of 8 pages")."""
        quota = self.quota(tenant)
        if quota.may_reserve is not None and quota.reserve_cap() == quota.may_reserve:
            return f"its {quota.may_reserve}-page part of its cluster limit"
        if style == "of":
            return f"its limit of {quota.limit} pages"
        return f"its {quota.limit}-page limit"

    def queue_share(self, tenant: str, max_queue: int) -> tuple[int, int]:
        """(requests the tenant has waiting, its share of a max_queue-entry queue): its
        weight's part among the tenants waiting, itself included."""
        waiting = [t for t, n in self.waiting_by_tenant.items() if n > 0]
        if tenant not in waiting:
            waiting.append(tenant)
        total = sum(self.quota(t).weight for t in waiting)
        share = max(1, int(max_queue * self.quota(tenant).weight / total))
        return self.waiting_by_tenant[tenant], share

    def names(self) -> set[str]:
        """Every tenant with a quota, or with pages held, reserved or queued."""
        return (set(self.quotas) | set(self.reserved_by_tenant) | set(self.queued_by_tenant)
                | set(self.device_by_tenant))
