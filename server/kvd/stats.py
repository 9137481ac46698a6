"""A node's figures, read once for every reader.

GetPoolStats, ListTenants, SetQuota, ListLinks and the Prometheus scrape all take their
figures from here, so a figure cannot be computed one way for kvctl and another for a
dashboard. Figures are plain values copied out of the core on the event loop: a reader on
another thread (the scrape) sees one consistent moment and never the live structures.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from kvd.core.blocks import TierKind
from kvd.core.counters import PoolCounters
from kvd.core.fairness import TenantQuota
from kvd.core.pool import Pool


@dataclass(slots=True, frozen=True)
class TierFigures:
    kind: TierKind
    backend: str
    capacity: int
    used: int
    pinned: int

    @property
    def free(self) -> int:
        return self.capacity - self.used


@dataclass(slots=True, frozen=True)
class TenantFigures:
    tenant: str
    pool: str
    quota: TenantQuota
    device_pages: int
    reserved_pages: int
    queued_pages: int
    pinned_pages: int
    fair_share_pages: int
    guaranteed_pages: float  # as honoured: scaled down when guarantees overcommit
    evictions_suffered: int
    evictions_caused: int
    # (the tenant whose evictions caused it, seconds), largest first.
    stalls_by_cause: list[tuple[str, float]]
    bytes_moved: int
    bytes_read: int
    # Device pages with a shared page counting 1/k to each of its k tenants; shared pages
    # charged in part to this tenant, and what the split saves it.
    charged_pages: float
    shared_pages: int
    shared_saved_pages: float
    # Blocks on the GPUs of the engines kvd follows (node-wide; kvd.kv_events), a block kvd
    # keeps under the same hash counting 1/k to each of its k tenants.
    engine_gpu_blocks: float = 0.0


@dataclass(slots=True, frozen=True)
class LinkTenantFigures:
    tenant: str
    bytes: int
    weight: float
    cap_bytes_per_s: float  # 0: none


@dataclass(slots=True, frozen=True)
class LinkFigures:
    name: str
    source_pool: str
    capacity_bps: float
    burst_bytes: int
    scheduling: str
    bytes_total: int
    transfers_total: int
    bytes_last_s: int
    busy_s: float
    queues: dict[str, tuple[int, int]]  # transfer class -> (transfers, bytes) waiting
    tenants: list[LinkTenantFigures]


@dataclass(slots=True, frozen=True)
class PoolFigures:
    name: str
    policy: str
    page_bytes: int
    block_tokens: int
    device: TierFigures
    host: TierFigures
    num_requests: int  # admitted (not queued)
    num_queued: int
    reserved_pages: int
    handoff_reserved_pages: int
    held_pages: int
    admission: str
    working_set_pages: int
    working_set_capacity_pages: int
    in_flight: int
    stuck: int
    self_check_problems: int  # the periodic self-check's last finding
    counters: PoolCounters
    # (victim tenant, cause tenant, policy) -> pages evicted.
    evictions: dict[tuple[str, str, str], int]
    # (victim tenant, cause tenant) -> seconds stalled.
    stall_by_cause: dict[tuple[str, str], float]
    bytes_read: int
    tenants: list[TenantFigures]
    links: list[LinkFigures]

    @property
    def tiers(self) -> tuple[TierFigures, TierFigures]:
        return self.device, self.host


@dataclass(slots=True, frozen=True)
class EngineFigures:
    """An engine kvd follows by its KV cache events."""

    name: str
    blocks_by_medium: dict[str, int]
    gpu_blocks_by_tenant: dict[str, float]
    batches: int
    events: int
    replayed: int
    lost: int
    bad: int
    malformed: int  # events not applied: malformed
    restarts: int  # times its publisher started over
    dropped: int  # hashes and media past kvd's bounds on what it follows of the engine


@dataclass(slots=True, frozen=True)
class NodeFigures:
    pools: list[PoolFigures]
    links: list[LinkFigures]
    uptime_s: float
    handoffs: dict[str, int]  # outcome -> count, and "bytes"
    leases_active: int
    leases_expired: int
    lease_released_requests: int
    engines: list[EngineFigures]
    self_check_runs: dict[str, int]  # result -> runs
    cluster: dict | None = None  # kvd.cluster.ClusterMember.describe(), with "reconciles"


def link_figures(node, link) -> LinkFigures:
    """A link's figures; the weights and caps shown are those of the pool it leaves."""
    sched = link.sched
    meter = sched.meter
    tenancy = node.runtime(link.source_pool).pool.tenancy
    tenants = []
    for tenant in sorted(set(meter.by_tenant) | set(sched.capped_tenants())):
        cap = sched.tenant_cap(tenant)
        tenants.append(LinkTenantFigures(tenant, meter.by_tenant.get(tenant, 0),
                                         tenancy.quota(tenant).weight,
                                         cap.rate if cap else 0.0))
    return LinkFigures(
        name=sched.name, source_pool=link.source_pool, capacity_bps=sched.capacity_bps,
        burst_bytes=sched.burst_bytes, scheduling=sched.scheduling,
        bytes_total=meter.bytes_total, transfers_total=meter.jobs_total,
        bytes_last_s=meter.bytes_in_last(1, node.clock.now()), busy_s=link.busy_s,
        queues=sched.queue_depths(), tenants=tenants)


def tenant_figures(node, pool: Pool, tenant: str,
                   shared_figures: dict[str, tuple[int, float]] | None = None
                   ) -> TenantFigures:
    """A tenant's standing in one pool. The pool's reads must be recorded (snapshot()).
    `shared_figures`: the pool's Prefixes.shared_figures(), when the caller has them."""
    ten, att = pool.tenancy, pool.attribution
    if shared_figures is None:
        shared_figures = pool.prefixes.shared_figures()
    shared, saved = shared_figures.get(tenant, (0, 0.0))
    return TenantFigures(
        tenant=tenant, pool=pool.name, quota=ten.quota(tenant),
        device_pages=ten.device_by_tenant[tenant],
        reserved_pages=ten.reserved_by_tenant[tenant],
        queued_pages=ten.queued_by_tenant[tenant],
        pinned_pages=ten.pinned_by_tenant[tenant],
        fair_share_pages=ten.fair_share(tenant),
        guaranteed_pages=ten.guaranteed(tenant),
        evictions_suffered=att.evictions_suffered[tenant],
        evictions_caused=att.evictions_caused[tenant],
        stalls_by_cause=[(cause, secs) for (victim, cause), secs
                         in att.stall_s_by_cause.most_common() if victim == tenant],
        bytes_moved=sum(link.sched.meter.by_tenant.get(tenant, 0)
                        for link in node.links_of(pool.name)),
        bytes_read=ten.blocks_read_by_tenant[tenant] * pool.page_bytes,
        charged_pages=ten.usage(tenant), shared_pages=shared, shared_saved_pages=saved,
        engine_gpu_blocks=node.engine_holdings.gpu_by_tenant.get(tenant, 0.0))


def pool_figures(node, rt, tenants: str | None = None) -> PoolFigures:
    """A pool's figures, its reads of the last steps included, with those of every tenant
    the pool knows (declared, or holding, reserving or queueing), or only of `tenants` when
    given."""
    pool = rt.pool.snapshot()
    ten = pool.tenancy
    names = sorted(t for t in ten.names() if tenants in (None, t))
    shared = pool.prefixes.shared_figures()
    return PoolFigures(
        name=pool.name, policy=pool.policy.name, page_bytes=pool.page_bytes,
        block_tokens=pool.block_tokens,
        device=TierFigures(TierKind.DEVICE, rt.arenas["device"].backend, pool.device.capacity,
                           pool.device.num_used, pool.num_pinned),
        host=TierFigures(TierKind.HOST, rt.arenas["host"].backend, pool.host.capacity,
                         pool.host.num_used, 0),
        num_requests=len(pool.requests) - len(pool.queue) - pool.prefixes.num_keepers,
        num_queued=len(pool.queue),
        reserved_pages=pool.reserved_pages,
        handoff_reserved_pages=pool.reservations.reserved_pages(),
        held_pages=pool.pages.holds.count + len(pool.pages.holds.kept),
        admission=pool.admission.mode,
        working_set_pages=pool.admission.working_set_used(),
        working_set_capacity_pages=pool.pages.share_capacity,
        in_flight=len(rt.transit), stuck=len(node.stuck.get(pool.name, ())),
        self_check_problems=node.health.problems.get(pool.name, 0),
        counters=copy.deepcopy(pool.counters),
        evictions=dict(pool.attribution.evictions_by_pair),
        stall_by_cause=dict(pool.attribution.stall_s_by_cause),
        bytes_read=sum(ten.blocks_read_by_tenant.values()) * pool.page_bytes,
        tenants=[tenant_figures(node, pool, t, shared) for t in names],
        links=[link_figures(node, link) for link in node.links_of(pool.name)])


def engine_figures(node) -> list[EngineFigures]:
    held = node.engine_holdings
    return [EngineFigures(res.engine, held.media.get(res.engine, {}),
                          held.gpu.get(res.engine, {}),
                          res.num_batches, res.num_events, res.num_replayed, res.num_lost,
                          res.num_bad, res.num_malformed, res.num_restarts, res.num_dropped)
            for res in node.engines.residency.values()]


def node_figures(node) -> NodeFigures:
    """Every pool's figures, the links, handoffs and leases."""
    leases = node.leases
    return NodeFigures(
        pools=[pool_figures(node, rt) for rt in node.runtimes()],
        links=[link_figures(node, link) for link in node.links()],
        uptime_s=time.time() - node.started_at, handoffs=dict(node.handoff_counts),
        leases_active=len(leases.leases), leases_expired=leases.num_expired,
        lease_released_requests=leases.num_requests_released,
        engines=engine_figures(node), self_check_runs=dict(node.health.runs),
        cluster=(dict(node.cluster.describe(), reconciles=dict(node.cluster.reconciles),
                      members=len(node.cluster.picture.nodes))
                 if node.cluster is not None else None))
