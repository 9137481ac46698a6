"""Tenants' quotas and fair shares, modelled on cgroup v2 memory.

`guaranteed` is like memory.min (never taken from the tenant to serve another, and a floor
under its fair share), `limit` like memory.max (a hard cap), `weight` its share of the rest. Fair share is weighted
max-min over current demand (water-filling): what one tenant does not use flows to the others
and comes back when it needs it.
"""

from __future__ import annotations

from dataclasses import dataclass


# The most pages a quota's guarantee, limit or per-request cap may count: the API tells them
# in uint32 fields (TenantInfo), and a tenant's figures must stay readable to everyone.
MAX_QUOTA_PAGES = 2**32 - 1

# The weights a tenant may have. Only their ratios matter, and a ratio up to 10^12 is more
# than any node's tenants differ by; outside these bounds the shares' arithmetic loses
# (1 beside 2^53 is nothing to a float) and then breaks (1e308 twice is infinity).
MIN_WEIGHT = 1e-6
MAX_WEIGHT = 1e6


def weight_problem(value: float) -> str:
    """Why `value` cannot be a tenant's weight ("" when it can)."""
    if not MIN_WEIGHT <= value <= MAX_WEIGHT:  # NaN included
        return f"must be from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}, got {value:g}"
    return ""


@dataclass(slots=True)
class TenantQuota:
    """One tenant's quota in one pool, in pages."""

    weight: float = 1.0
    guaranteed: int = 0
    limit: int | None = None  # None: no cap beyond the pool
    # Per-request cap: pages, and/or a fraction of the pool's device tier.
    max_request_pages: int | None = None
    max_request_fraction: float | None = None
    # Bandwidth, bytes per second (None: no cap): on the tenant's transfers over each link
    # (with a burst in bytes), on each of its requests' transfers, and each request's
    # attention reads (a request over its read budget has its promotions held).
    bandwidth_cap: float | None = None
    bandwidth_burst: float | None = None
    request_bandwidth_cap: float | None = None
    read_budget: float | None = None
    # From the cluster (kvd.core.cluster): the most this node may reserve for the tenant now,
    # its part of a cluster-wide limit. A request over it waits; only `limit` rejects.
    may_reserve: int | None = None

    def reserve_cap(self) -> int | None:
        """The most the tenant may have reserved here: its limit, or its part of the
        cluster's, whichever is smaller (None: no cap)."""
        limit, part = self.limit, self.may_reserve
        if part is None:
            return limit
        return part if limit is None else min(limit, part)

    def request_cap(self, device_pages: int) -> int | None:
        """The per-request cap in pages on a device tier of `device_pages` (the smaller of the two
        caps; None: none)."""
        caps = []
        if self.max_request_pages:
            caps.append(self.max_request_pages)
        if self.max_request_fraction:
            caps.append(int(self.max_request_fraction * device_pages))
        return min(caps) if caps else None


def effective_guarantees(quotas: dict[str, TenantQuota], capacity: int) -> dict[str, float]:
    """Guarantees as they can be honoured: scaled down proportionally when they add up to more
    than the capacity."""
    total = sum(q.guaranteed for q in quotas.values())
    if total <= capacity or total == 0:
        return {t: float(q.guaranteed) for t, q in quotas.items()}
    scale = capacity / total
    return {t: q.guaranteed * scale for t, q in quotas.items()}


def water_fill(capacity: float, demand: dict[str, float], quotas: dict[str, TenantQuota]
               ) -> dict[str, float]:
    """Each tenant's fair share of `capacity` pages given its current demand.

    A water level rises until the capacity is used: each tenant's share is its weight times the
    level, but never less than its (effective) guarantee and never more than what it wants (up
    to its limit). A guarantee is a floor, not a bonus: a tenant whose weighted share already
    exceeds its guarantee gets no more for having one. What a tenant does not want flows to the
    others, and comes back when it asks.
    """
    default = TenantQuota()
    guarantees = effective_guarantees({t: quotas.get(t, default) for t in demand}, int(capacity))
    top, floor, weight = {}, {}, {}
    for tenant, want in demand.items():
        q = quotas.get(tenant, default)
        top[tenant] = max(0.0, float(want if q.limit is None else min(want, q.limit)))
        floor[tenant] = min(top[tenant], guarantees[tenant])
        weight[tenant] = max(q.weight, 0.0)

    if sum(top.values()) <= capacity:
        return dict(top)  # everyone gets all they want
    level = _refined(_level(capacity, top, floor, weight), capacity, top, floor, weight)
    return {t: min(top[t], max(floor[t], level * weight[t])) for t in demand}


def _refined(level: float, capacity: float, top: dict[str, float], floor: dict[str, float],
             weight: dict[str, float]) -> float:
    """`level` made exact to the rounding of one sum. _level's running slope adds weights
    and takes them away again, which loses a small weight beside a big one (1e-6 beside
    4096 came out 3e-7 short, and so did that tenant's share). The total is linear around
    the level: a step along the slope of the tenants between floor and top there, summed
    afresh, lands on the capacity (a second step, should the first cross a kink)."""
    for _ in range(2):
        total = slope = 0.0
        for tenant, w in weight.items():
            share = level * w
            if share <= floor[tenant]:
                total += floor[tenant]
            elif share >= top[tenant]:
                total += top[tenant]
            else:
                total += share
                slope += w
        if slope <= 0 or total == capacity:
            break
        level = max(0.0, level + (capacity - total) / slope)
    return level


def _level(capacity: float, top: dict[str, float], floor: dict[str, float],
           weight: dict[str, float]) -> float:
    """The water level at which the shares add up to `capacity`, which the tops exceed.

    The total is piecewise linear in the level: a tenant's share stays at its floor up to
    floor/weight, rises by its weight from there to top/weight, and stays at its top after.
    The points where a slope changes are walked in order, and the level solved in the piece
    where the total reaches the capacity: exact, and one sort's work. Shares are recomputed
    whenever demand changes, on the allocation path."""
    base = sum(floor.values())  # the total is base + slope * level between two points
    if base >= capacity:
        return 0.0
    slope = 0.0
    points = []
    for tenant, w in weight.items():
        if w > 0 and top[tenant] > floor[tenant]:
            points.append((floor[tenant] / w, w, -floor[tenant]))  # leaves its floor
            points.append((top[tenant] / w, -w, top[tenant]))  # reaches its top
    points.sort()
    for at, dw, dbase in points:
        if slope > 0 and base + slope * at >= capacity:
            break
        slope += dw
        base += dbase
    else:
        return points[-1][0] if points else 0.0
    return (capacity - base) / slope
