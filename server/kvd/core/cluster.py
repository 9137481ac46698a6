"""A tenant's quota over a cluster of kvds: from every node's report of one pool (its device
capacity, and per tenant the pages reserved, queued and wanted), what this node may give the
tenant. Pure arithmetic on a picture; kvd.cluster gets the picture from etcd and applies the
result through the tenants' quotas.

- The cluster-wide fair share: weighted max-min (water-filling) of the cluster's device pages
  over the tenants' cluster-wide demand, the cluster quotas' guarantees as floors and limits
  as caps (kvd.core.fairness.water_fill, as one node does for its own pages).
- A node's part of it, its *entitlement*: the share split between the nodes in proportion to
  where the tenant's demand is. It is the tenant's guarantee on this node (never taken to
  serve another tenant; a node whose entitlements add up past its capacity scales them down,
  as it does guarantees it was given).
- A cluster limit L: what is not reserved yet anywhere, L - sum(reserved), is split between
  the nodes: first each node with requests waiting gets room for its smallest one, the node
  whose demand is least served first, while the room lasts (split by pages alone, a small
  queue beside a large one never got enough for a whole request); the rest by where
  requests wait (each node one share more, so a request arriving on a calm node is not
  refused outright). A node may reserve for the tenant what it has reserved plus its part. Every node computes this from the same picture,
  so the parts add up to L; a node's picture of the others is at most one reconcile interval
  old, so the tenant can pass L by at most what the other nodes reserved in that interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvd.core.fairness import TenantQuota, water_fill


@dataclass(frozen=True, slots=True)
class NodeReport:
    """One node's figures for one pool, as it published them."""

    node: str
    capacity: int  # device pages
    reserved: dict[str, int] = field(default_factory=dict)  # tenant -> pages reserved
    queued: dict[str, int] = field(default_factory=dict)  # tenant -> pages waiting
    demand: dict[str, int] = field(default_factory=dict)  # reserved + queued + kept
    smallest: dict[str, int] = field(default_factory=dict)  # its smallest waiting request

    def to_json(self) -> dict:
        return {"capacity": self.capacity, "reserved": self.reserved, "queued": self.queued,
                "demand": self.demand, "smallest": self.smallest}

    @classmethod
    def from_json(cls, node: str, data: object) -> NodeReport:
        """The figures as to_json() wrote them; ValueError for anything else (a map where
        one belongs, finite numbers of pages)."""
        if not isinstance(data, dict):
            raise ValueError(f"a pool's figures are a map, got {type(data).__name__}")

        def pages(key: str) -> dict[str, int]:
            by_tenant = data.get(key, {})
            if not isinstance(by_tenant, dict):
                raise ValueError(f"{key} is a map of tenants, got {type(by_tenant).__name__}")
            return {str(t): _pages(n) for t, n in by_tenant.items()}

        return cls(node, _pages(data["capacity"]), pages("reserved"), pages("queued"),
                   pages("demand"), pages("smallest"))


def _pages(n: object) -> int:
    """A number of pages as published (at least 0); ValueError unless a finite number."""
    if type(n) is not int and not (type(n) is float and math.isfinite(n)):
        raise ValueError(f"a number of pages, got {n!r}")
    return max(0, int(n))


@dataclass(frozen=True, slots=True)
class ClusterQuota:
    """A tenant's quota over the whole cluster, in pages of the pool."""

    weight: float = 1.0
    guaranteed: int = 0
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class Entitlement:
    """What the cluster picture gives a tenant on this node."""

    reserved: int  # cluster-wide, pages
    demand: int  # cluster-wide
    share: float  # its cluster-wide fair share
    guaranteed: int  # its entitlement here: a floor on this node
    may_reserve: int | None  # the most this node may reserve for it now (None: no limit)


def entitlements(me: str, reports: list[NodeReport],
                 quotas: dict[str, ClusterQuota]) -> dict[str, Entitlement]:
    """Each tenant with a cluster quota: its entitlement on node `me` (whose report is among
    `reports`) from the picture `reports`."""
    mine = next((r for r in reports if r.node == me), None)
    if mine is None:
        return {}
    capacity = sum(r.capacity for r in reports)
    tenants = {t for r in reports for t in r.demand} | set(quotas)
    demand = {t: float(sum(r.demand.get(t, 0) for r in reports)) for t in tenants}
    shares = water_fill(capacity, {t: d for t, d in demand.items() if d > 0}, {
        t: TenantQuota(weight=q.weight, guaranteed=q.guaranteed, limit=q.limit)
        for t, q in quotas.items()})
    out = {}
    for tenant, quota in quotas.items():
        share = shares.get(tenant, 0.0)
        wanted = demand.get(tenant, 0.0)
        here = mine.demand.get(tenant, 0) / wanted if wanted else 0.0
        reserved = sum(r.reserved.get(tenant, 0) for r in reports)
        may_reserve = None
        if quota.limit is not None:
            part = _parts(max(0, quota.limit - reserved), reports, tenant)[me]
            may_reserve = mine.reserved.get(tenant, 0) + part
        out[tenant] = Entitlement(
            reserved=reserved, demand=int(wanted), share=share,
            guaranteed=min(mine.capacity, math.floor(share * here + 1e-9)),
            may_reserve=may_reserve)
    return out


def _parts(room: int, reports: list[NodeReport], tenant: str) -> dict[str, int]:
    """The unreserved room of a cluster limit, split between the nodes: room for each node's
    smallest waiting request first, the node whose demand is least served first, while the
    room lasts; then the rest by pages waiting, each node one share more. Adds up to at most
    `room`."""
    parts = {r.node: 0 for r in reports}
    # The node whose demand is served least first: its part of the tenant's demand reserved.
    firsts = sorted((r.reserved.get(tenant, 0) / max(r.demand.get(tenant, 0), 1),
                     r.smallest[tenant], r.node) for r in reports if r.smallest.get(tenant))
    for _, pages, node in firsts:
        if pages > room:
            break
        parts[node] += pages
        room -= pages
    waiting = {r.node: r.queued.get(tenant, 0) + 1 for r in reports}
    total = sum(waiting.values())
    for node, weight in waiting.items():
        parts[node] += math.floor(room * weight / total)
    return parts
