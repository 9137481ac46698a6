"""Prometheus metrics. State (pages, tenants, counters the core keeps anyway) is read at
scrape time from a snapshot taken on the event loop, so the hot path pays nothing for it;
only latencies are observed as they happen (RPCs, memory stalls).

Every metric is listed, one line each, in deploy/README.md.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left

import structlog
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvd.core.admission import Decision

log = structlog.get_logger("kvd.metrics")

REGISTRY = CollectorRegistry()
STALL_SECONDS = Histogram(
    "kvd_stall_seconds", "Memory stall of one access (waiting for promotions)", ["pool"],
    registry=REGISTRY,
    buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1, 5),
)


class LoopHistogram(Collector):
    """A histogram observed only on the event loop: one bisect and two additions per
    observation. prometheus_client's Histogram takes a lock twice per observation, which on
    the Step and unary hot paths cost as much as some handlers; here the buckets are counted
    plainly and made cumulative when a scrape asks (from the exporter's thread: a scrape may
    see a sum one observation ahead of or behind its counts, never a torn bucket)."""

    def __init__(self, name: str, documentation: str, labelnames: list[str],
                 buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.bounds = list(buckets)
        self._les = [floatToGoString(b) for b in buckets] + ["+Inf"]
        self._series: dict[tuple[str, ...], list] = {}  # labels -> [counts per bucket, sum]

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = [[0] * (len(self.bounds) + 1), 0.0]
        series[0][bisect_left(self.bounds, value)] += 1
        series[1] += value

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, (counts, total) in list(self._series.items()):
            cumulative, running = [], 0
            for le, n in zip(self._les, list(counts)):
                running += n
                cumulative.append((le, running))
            family.add_metric(list(labels), cumulative, total)
        yield family


RPC_SECONDS = LoopHistogram(
    "kvd_rpc_duration_seconds", "Time kvd spent on an RPC (a Step message for Step), by code",
    ["method", "code"],
    buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1),
)
REGISTRY.register(RPC_SECONDS)


def observe_rpc(method: str, code: str, seconds: float) -> None:
    RPC_SECONDS.observe((method, code), seconds)


def _snapshot(node) -> dict:
    """Everything a scrape reports, read on the event loop (consistent, and race-free)."""
    pools = []
    for name, rt in node.pools.items():
        pool = rt.pool
        pool.snapshot()  # the counters include the reads of the last steps
        c = pool.counters
        att, ten = pool.attribution, pool.tenancy
        pools.append({
            "pool": name,
            "policy": pool.policy.name,
            "page_bytes": pool.page_bytes,
            "backends": {k: a.backend for k, a in rt.arenas.items()},
            "tiers": {"device": (pool.device.capacity, pool.device.num_used, pool.num_pinned),
                      "host": (pool.host.capacity, pool.host.num_used, 0)},
            "queue": len(pool.queue),
            "in_flight": rt.num_in_flight,
            "held": pool.num_held,
            "stuck": len(node.stuck.get(name, ())),
            "counters": {k: getattr(c, k) for k in (
                "num_admitted", "num_queued", "num_rejected", "num_demotions",
                "num_promotions", "num_drops", "num_prefetches", "num_lost_blocks",
                "num_decode_critical_accesses", "num_decode_critical_misses",
                "num_deadline_misses", "stall_seconds_total")},
            "evictions": dict(att.evictions_by_pair),
            "stall_by_cause": dict(att.stall_s_by_cause),
            "tenants": {t: (ten.device_by_tenant[t], ten.fair_share(t), ten.guaranteed(t),
                            ten.quota(t).limit or 0, ten.reserved_by_tenant[t],
                            ten.queued_by_tenant[t])
                        for t in ten.names()},
            "reads": {t: n * pool.page_bytes for t, n in ten.blocks_read_by_tenant.items()},
            "handoff_reserved": pool.handoff_reserved_pages(),
        })
    now = node.clock.now()
    links = [link.stats(now) for link in node.links()]
    leases = node.leases
    return {"pools": pools, "uptime_s": time.time() - node.started_at, "links": links,
            "handoffs": dict(node.handoff_counts),
            "leases": (len(leases.leases), leases.num_expired, leases.num_requests_released)}


class KvdCollector(Collector):
    def __init__(self, node, loop: asyncio.AbstractEventLoop) -> None:
        self.node = node
        self.loop = loop

    async def _take(self) -> dict:
        return _snapshot(self.node)

    def collect(self):
        s = asyncio.run_coroutine_threadsafe(self._take(), self.loop).result(timeout=5)

        def gauge(name, doc, labels):
            return GaugeMetricFamily(name, doc, labels=labels)

        def counter(name, doc, labels):
            return CounterMetricFamily(name, doc, labels=labels)

        up = gauge("kvd_uptime_seconds", "Seconds since kvd started", [])
        up.add_metric([], s["uptime_s"])
        yield up
        info = gauge("kvd_pool_info", "A pool's policy, page size and tier backends (value 1)",
                     ["pool", "policy", "page_bytes", "device_backend", "host_backend"])
        pages = gauge("kvd_pool_pages", "Pages by pool, tier and state", ["pool", "tier", "state"])
        queue = gauge("kvd_admission_queue_depth", "Requests waiting for admission", ["pool"])
        flight = gauge("kvd_transfers_in_flight", "Transfer plans being copied", ["pool"])
        adm = counter("kvd_admissions", "Admission decisions", ["pool", "decision"])
        moves = counter("kvd_page_moves", "Pages moved between tiers", ["pool", "direction"])
        moved = counter("kvd_moved_bytes", "Bytes copied between tiers", ["pool", "direction"])
        drops = counter("kvd_drops", "Pages dropped for the engine to recompute", ["pool"])
        lost = counter("kvd_lost_blocks", "Dropped blocks handed back zeroed, flagged for the "
                       "engine to recompute", ["pool"])
        stuck = gauge("kvd_stuck_transfers", "Transfers in flight without progress past the "
                      "bound, or blocks in transit that nothing owns (should be 0)", ["pool"])
        pre = counter("kvd_prefetches", "Blocks promoted ahead of their access", ["pool"])
        dca = counter("kvd_decode_critical_accesses", "Reads of decode-critical blocks", ["pool"])
        dcm = counter("kvd_decode_critical_misses",
                      "Decode-critical reads that found the block off the device", ["pool"])
        dlm = counter("kvd_deadline_misses", "Blocks made resident after their deadline",
                      ["pool"])
        stall = counter("kvd_stall_seconds_by_cause",
                        "Memory stall of a tenant's requests, by the tenant whose evictions "
                        "caused it", ["pool", "tenant", "cause_tenant"])
        ev = counter("kvd_evictions", "Pages evicted from the device tier",
                     ["pool", "policy", "victim_tenant", "cause_tenant"])
        t_pages = gauge("kvd_tenant_device_pages", "Device pages a tenant holds",
                        ["pool", "tenant"])
        t_share = gauge("kvd_tenant_fair_share_pages", "A tenant's fair share of the device tier",
                        ["pool", "tenant"])
        t_guar = gauge("kvd_tenant_guaranteed_pages", "A tenant's guaranteed pages",
                       ["pool", "tenant"])
        t_lim = gauge("kvd_tenant_limit_pages", "A tenant's page limit (0: none)",
                      ["pool", "tenant"])
        t_res = gauge("kvd_tenant_reserved_pages", "Pages reserved by a tenant's requests",
                      ["pool", "tenant"])
        t_q = gauge("kvd_tenant_queued_pages", "Pages a tenant's queued requests ask for",
                    ["pool", "tenant"])
        for p in s["pools"]:
            name = p["pool"]
            info.add_metric([name, p["policy"], str(p["page_bytes"]), p["backends"]["device"],
                             p["backends"]["host"]], 1)
            for tier, (capacity, used, pinned) in p["tiers"].items():
                pages.add_metric([name, tier, "used"], used)
                pages.add_metric([name, tier, "free"], capacity - used)
                if tier == "device":
                    pages.add_metric([name, tier, "pinned"], pinned)
                    pages.add_metric([name, tier, "held"], p["held"])
            queue.add_metric([name], p["queue"])
            flight.add_metric([name], p["in_flight"])
            c = p["counters"]
            for decision in Decision:
                adm.add_metric([name, decision], c[f"num_{decision}"])
            moves.add_metric([name, "device_to_host"], c["num_demotions"])
            moves.add_metric([name, "host_to_device"], c["num_promotions"])
            moved.add_metric([name, "device_to_host"], c["num_demotions"] * p["page_bytes"])
            moved.add_metric([name, "host_to_device"], c["num_promotions"] * p["page_bytes"])
            drops.add_metric([name], c["num_drops"])
            lost.add_metric([name], c["num_lost_blocks"])
            stuck.add_metric([name], p["stuck"])
            pre.add_metric([name], c["num_prefetches"])
            dca.add_metric([name], c["num_decode_critical_accesses"])
            dcm.add_metric([name], c["num_decode_critical_misses"])
            dlm.add_metric([name], c["num_deadline_misses"])
            for (victim, cause), seconds in p["stall_by_cause"].items():
                stall.add_metric([name, victim, cause or "(engine)"], seconds)
            for (victim, cause, policy), n in p["evictions"].items():
                ev.add_metric([name, policy, victim, cause or "(engine)"], n)
            for tenant, (used, share, guaranteed, limit, reserved, queued) in p["tenants"].items():
                t_pages.add_metric([name, tenant], used)
                t_share.add_metric([name, tenant], share)
                t_guar.add_metric([name, tenant], guaranteed)
                t_lim.add_metric([name, tenant], limit)
                t_res.add_metric([name, tenant], reserved)
                t_q.add_metric([name, tenant], queued)
        yield from (info, pages, queue, flight, adm, moves, moved, drops, lost, stuck, pre,
                    dca, dcm, dlm,
                    stall, ev, t_pages, t_share, t_guar, t_lim, t_res, t_q)
        cap = gauge("kvd_link_capacity_bytes_per_second", "A link's configured or measured "
                    "capacity", ["link", "scheduling"])
        lbytes = counter("kvd_link_bytes", "Bytes a link moved, by the tenant that paid",
                         ["link", "tenant"])
        busy = counter("kvd_link_busy_seconds", "Seconds a link spent copying", ["link"])
        lq = gauge("kvd_link_queued_transfers", "Transfers waiting on a link, by class",
                   ["link", "transfer_class"])
        lqb = gauge("kvd_link_queued_bytes", "Bytes waiting on a link, by class",
                    ["link", "transfer_class"])
        for link in s["links"]:
            cap.add_metric([link["name"], link["scheduling"]], link["capacity_bps"])
            for tenant, n in link["by_tenant"].items():
                lbytes.add_metric([link["name"], tenant], n)
            busy.add_metric([link["name"]], link["busy_s"])
            for cls, (jobs, nbytes) in link["queues"].items():
                lq.add_metric([link["name"], cls], jobs)
                lqb.add_metric([link["name"], cls], nbytes)
        reads = counter("kvd_read_bytes", "Attention reads engines reported (blocks accessed), "
                        "in bytes", ["pool", "tenant"])
        hres = gauge("kvd_handoff_reserved_pages", "Pages a pool holds for requests not yet "
                     "handed off to it", ["pool"])
        for p in s["pools"]:
            for tenant, n in p["reads"].items():
                reads.add_metric([p["pool"], tenant], n)
            hres.add_metric([p["pool"]], p["handoff_reserved"])
        hand = counter("kvd_handoffs", "Handoffs by outcome (completed, rolled_back, failed, "
                       "refused, cancelled, reservations_expired)", ["outcome"])
        for outcome, n in s["handoffs"].items():
            if outcome != "bytes":
                hand.add_metric([outcome], n)
        hbytes = counter("kvd_handoff_bytes", "Bytes handed off between pools", [])
        hbytes.add_metric([], s["handoffs"].get("bytes", 0))
        yield from (cap, lbytes, busy, lq, lqb, reads, hres, hand, hbytes)
        active, expired, released = s["leases"]
        g = gauge("kvd_leases", "Client leases kvd is tracking", [])
        g.add_metric([], active)
        yield g
        e = counter("kvd_lease_expirations", "Leases expired (their client went silent)", [])
        e.add_metric([], expired)
        yield e
        r = counter("kvd_lease_released_requests", "Requests released by lease expiry", [])
        r.add_metric([], released)
        yield r


def serve_metrics(address: str, node, loop):
    """Expose /metrics on HOST:PORT; returns the HTTP server (or None when it cannot bind,
    which is logged: metrics are worth a warning, not a failed start)."""
    host, _, port = address.rpartition(":")
    collector = KvdCollector(node, loop)
    try:
        REGISTRY.register(collector)
    except ValueError:
        # The names are registered already: a second daemon in one process (tests only).
        # The first daemon's collector keeps answering; kvd itself runs one node.
        pass
    try:
        server, _thread = start_http_server(int(port), addr=host or "0.0.0.0", registry=REGISTRY)
    except OSError as exc:
        log.warning("metrics disabled: cannot listen", address=address, error=str(exc))
        REGISTRY.unregister(collector)
        return None, None
    log.info("metrics listening", address=f"http://{host}:{server.server_port}/metrics")
    return server, collector
