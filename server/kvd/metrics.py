"""Prometheus metrics. State (pages, tenants, counters the core keeps anyway) is read at
scrape time from a snapshot taken on the event loop, so the hot path pays nothing for it;
only latencies are observed as they happen (RPCs, memory stalls).

Every metric is listed, one line each, in deploy/README.md.
"""

from __future__ import annotations

import asyncio
import gc
import platform
import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
import grpc
from google import protobuf
from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR,
                               CollectorRegistry, Histogram, Info, make_wsgi_app)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvd.background import FAILURES
from kvd.core.admission import Decision
from kvd.gcwalk import COLLECTIONS
from kvd.log import DroppingLogger
from kvd.stats import LinkFigures, NodeFigures, PoolFigures, node_figures

log = structlog.get_logger("kvd.metrics")

REGISTRY = CollectorRegistry()
# The standard collectors: process_* (CPU, resident memory, open files, start time),
# python_info, python_gc_*.
for _standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    REGISTRY.register(_standard)


def _build_info() -> dict[str, str]:
    from kvd import __version__

    return {"version": __version__, "python_version": platform.python_version(),
            "grpc_version": grpc.__version__, "protobuf_version": protobuf.__version__}


Info("kvd_build", "kvd's version and the versions it runs on (value 1)",
     registry=REGISTRY).info(_build_info())
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


LOOP_LAG_SECONDS = LoopHistogram(
    "kvd_event_loop_lag_seconds",
    "How late kvd's event loop woke for a timer due every 50 ms: what a step or call that "
    "arrived then waited behind the loop's other work, or the machine's", [],
    buckets=(1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1),
)
REGISTRY.register(LOOP_LAG_SECONDS)
# Each wake-up of an idle kvd costs 0.1-0.25 ms of CPU (measured on a 2-core VM): every 50 ms
# that is under 0.5% of a core. A timer due at any moment samples the wait a step arriving
# then would see, whatever the period: a shorter one only samples it more often.
LAG_PERIOD_S = 0.05


async def watch_loop_lag(histogram: LoopHistogram = LOOP_LAG_SECONDS,
                         period_s: float = LAG_PERIOD_S) -> None:
    """Observe, for ever, how late the loop wakes for a timer due every `period_s`. Every
    step and call kvd serves runs on this one loop: a lag is a wait all of them share,
    behind a handler that ran long or behind the machine's other threads and processes.
    (The loop's own clock ticks in milliseconds: under about 1 ms, a lag is noise.)"""
    clock = time.perf_counter
    while True:
        due = clock() + period_s
        await asyncio.sleep(period_s)
        histogram.observe((), max(0.0, clock() - due))


def _gc_families():
    """kvd's setting aside of long-lived objects from Python's collections (kvd.gcwalk)."""
    for make, name, doc, value in (
            (_gauge, "kvd_gc_set_aside_objects", "Objects set aside from Python's garbage "
             "collections: kept since start-up or a full collection that took long",
             gc.get_freeze_count()),
            (_counter, "kvd_gc_set_asides", "Full collections whose survivors kvd set aside "
             "(they took longer than 5 ms)", COLLECTIONS.set_asides),
            (_counter, "kvd_gc_full_walks", "Collections of everything, what was set aside "
             "too (every gc_full_walk_s)", COLLECTIONS.full_walks),
            (_counter, "kvd_gc_full_walk_freed_objects", "Unreachable objects the full walks "
             "found: cycles set aside while alive, freed late", COLLECTIONS.full_walk_freed),
            (_gauge, "kvd_gc_full_walk_last_seconds", "How long the last full walk held "
             "kvd's loop", COLLECTIONS.last_full_walk_s)):
        family = make(name, doc, [])
        family.add_metric([], value)
        yield family


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


class KvdCollector(Collector):
    """The node's figures (kvd.stats, the builder GetPoolStats and ListTenants use too), taken
    on the event loop at scrape time, as Prometheus families."""

    def __init__(self, node, loop: asyncio.AbstractEventLoop, gates: dict | None = None,
                 streams=None) -> None:
        self.node = node
        self.loop = loop
        self.gates = gates or {}  # name -> CallGate, whose waits are counted
        self.streams = streams  # OpenStreams: streams open and refused by tenant

    async def _take(self) -> tuple[NodeFigures, dict[str, int], dict[str, int]]:
        streams = self.streams
        if streams is None:
            return node_figures(self.node), {}, {}
        return node_figures(self.node), streams.per_tenant.running(), dict(streams.refused)

    def collect(self):
        figures, open_by, refused = asyncio.run_coroutine_threadsafe(
            self._take(), self.loop).result(timeout=5)
        up = _gauge("kvd_uptime_seconds", "Seconds since kvd started", [])
        up.add_metric([], figures.uptime_s)
        yield up
        yield from _pool_families(figures.pools)
        yield from _tenant_families(figures.pools)
        yield from _link_families(figures.links)
        yield from _node_families(figures)
        waits = _counter("kvd_gate_waits", "Calls that waited in their line at a gate: a "
                         "client's unary calls past max_calls_per_client (client_calls), a "
                         "tenant's calls and Step messages while tenants compete "
                         "(tenant_turns)", ["gate"])
        for name, gate in self.gates.items():
            waits.add_metric([name], gate.num_waited)  # an int read whole from this thread
        yield waits
        dropped = _counter("kvd_log_lines_dropped", "Log lines kvd could not write (the reader "
                           "of its log went away) and went on without", [])
        dropped.add_metric([], DroppingLogger.dropped)
        yield dropped
        failed = _counter("kvd_background_task_failures", "Failures of a task kvd runs beside "
                          "the calls (each started again a second later; should be 0)", ["task"])
        for task, count in list(FAILURES.items()):
            failed.add_metric([task], count)
        yield failed
        yield from _gc_families()
        if self.streams is not None:
            opened = _gauge("kvd_streams_open", "Streams a tenant keeps open (Step, "
                            "WaitAdmission, WatchEvents, Handoff; those of the admin "
                            "token are not counted)", ["tenant"])
            for tenant, count in open_by.items():
                opened.add_metric([tenant], count)
            yield opened
            cut = _counter("kvd_streams_refused", "Streams refused because their tenant had "
                           "max_streams_per_tenant open", ["tenant"])
            for tenant, count in refused.items():
                cut.add_metric([tenant], count)
            yield cut


PREFIX_OPS = ("looked_up", "hits", "loaded", "stored")  # kvd_prefix_blocks' op label


def _pool_families(pools: list[PoolFigures]):
    info = _gauge("kvd_pool_info", "A pool's policy, page size and tier backends (value 1)",
                  ["pool", "policy", "page_bytes", "device_backend", "host_backend"])
    pages = _gauge("kvd_pool_pages", "Pages by pool, tier and state", ["pool", "tier", "state"])
    queue = _gauge("kvd_admission_queue_depth", "Requests waiting for admission", ["pool"])
    flight = _gauge("kvd_transfers_in_flight", "Transfer plans being copied", ["pool"])
    adm = _counter("kvd_admissions", "Admission decisions", ["pool", "decision"])
    moves = _counter("kvd_page_moves", "Pages moved between tiers", ["pool", "direction"])
    moved = _counter("kvd_moved_bytes", "Bytes copied between tiers", ["pool", "direction"])
    problems = _gauge("kvd_self_check_problems", "Problems the last periodic self-check "
                      "found in a pool's bookkeeping (0: sound)", ["pool"])
    stuck = _gauge("kvd_stuck_transfers", "Transfers in flight without progress past the "
                   "bound, or blocks in transit that nothing owns (should be 0)", ["pool"])
    hres = _gauge("kvd_handoff_reserved_pages", "Pages a pool holds for requests not yet "
                  "handed off to it", ["pool"])
    wset = _gauge("kvd_working_set_pages", "Device pages the running requests' working sets "
                  "take (what each grows to by its end)", ["pool"])
    wcap = _gauge("kvd_working_set_capacity_pages", "Device pages working-set admission "
                  "keeps the running requests' working sets within", ["pool"])
    prefixes = _counter("kvd_prefix_blocks", "Prefix blocks: keys engines looked up, the "
                        "blocks found for them, blocks loaded, and blocks committed (stored)",
                        ["pool", "op"])
    # Counters of the core with one label, the pool: (family, PoolCounters field).
    plain = [(_counter(name, doc, ["pool"]), field) for name, doc, field in (
        ("kvd_drops", "Pages dropped for the engine to recompute", "num_drops"),
        ("kvd_lost_blocks", "Dropped blocks handed back zeroed, flagged for the engine to "
         "recompute", "num_lost_blocks"),
        ("kvd_prefetches", "Blocks promoted ahead of their access", "num_prefetches"),
        ("kvd_decode_critical_accesses", "Reads of decode-critical blocks",
         "num_decode_critical_accesses"),
        ("kvd_decode_critical_misses", "Decode-critical reads that found the block off the "
         "device", "num_decode_critical_misses"),
        ("kvd_deadline_misses", "Blocks made resident after their deadline",
         "num_deadline_misses"))]
    for p in pools:
        name, c = p.name, p.counters
        info.add_metric([name, p.policy, str(p.page_bytes), p.device.backend, p.host.backend], 1)
        for tier in p.tiers:
            label = tier.kind.name.lower()
            pages.add_metric([name, label, "used"], tier.used)
            pages.add_metric([name, label, "free"], tier.free)
        pages.add_metric([name, "device", "pinned"], p.device.pinned)
        pages.add_metric([name, "device", "held"], p.held_pages)
        queue.add_metric([name], p.num_queued)
        flight.add_metric([name], p.in_flight)
        stuck.add_metric([name], p.stuck)
        problems.add_metric([name], p.self_check_problems)
        hres.add_metric([name], p.handoff_reserved_pages)
        wset.add_metric([name], p.working_set_pages)
        wcap.add_metric([name], p.working_set_capacity_pages)
        for decision in Decision:
            adm.add_metric([name, decision], getattr(c, f"num_{decision}"))
        for direction, n in (("device_to_host", c.num_demotions),
                             ("host_to_device", c.num_promotions)):
            moves.add_metric([name, direction], n)
            moved.add_metric([name, direction], n * p.page_bytes)
        for op in PREFIX_OPS:
            prefixes.add_metric([name, op], getattr(c, f"num_prefix_{op}"))
        for family, field in plain:
            family.add_metric([name], getattr(c, field))
    yield from (info, pages, queue, flight, adm, moves, moved, stuck, problems, hres, wset,
                wcap, prefixes)
    yield from (family for family, _ in plain)


def _tenant_families(pools: list[PoolFigures]):
    stall = _counter("kvd_tenant_stall_seconds",
                     "Memory stall of a tenant's requests, by the tenant whose evictions "
                     "caused it", ["pool", "tenant", "cause_tenant"])
    ev = _counter("kvd_evictions", "Pages evicted from the device tier",
                  ["pool", "policy", "victim_tenant", "cause_tenant"])
    reads = _counter("kvd_read_bytes", "Attention reads engines reported (blocks accessed), "
                     "in bytes", ["pool", "tenant"])
    labels = ["pool", "tenant"]
    gauges = [(_gauge(name, doc, labels), field) for name, doc, field in (
        ("kvd_tenant_device_pages", "Device pages a tenant holds", "device_pages"),
        ("kvd_tenant_fair_share_pages", "A tenant's fair share of the device tier",
         "fair_share_pages"),
        ("kvd_tenant_guaranteed_pages", "A tenant's guaranteed pages, as honoured "
                                        "(scaled down when guarantees overcommit the pool)",
         "guaranteed_pages"),
        ("kvd_tenant_reserved_pages", "Pages reserved by a tenant's requests",
         "reserved_pages"),
        ("kvd_tenant_queued_pages", "Pages a tenant's queued requests ask for",
         "queued_pages"))]
    limit = _gauge("kvd_tenant_limit_pages", "A tenant's page limit (0: none)", labels)
    for p in pools:
        for (victim, cause), seconds in p.stall_by_cause.items():
            stall.add_metric([p.name, victim, cause or "(engine)"], seconds)
        for (victim, cause, policy), n in p.evictions.items():
            ev.add_metric([p.name, policy, victim, cause or "(engine)"], n)
        for t in p.tenants:
            for family, field in gauges:
                family.add_metric([p.name, t.tenant], getattr(t, field))
            limit.add_metric([p.name, t.tenant], t.quota.limit or 0)
            if t.bytes_read:
                reads.add_metric([p.name, t.tenant], t.bytes_read)
    yield from (stall, ev, reads, limit)
    yield from (family for family, _ in gauges)


def _link_families(links: list[LinkFigures]):
    cap = _gauge("kvd_link_capacity_bytes_per_second", "A link's configured or measured "
                 "capacity", ["link", "scheduling"])
    lbytes = _counter("kvd_link_bytes", "Bytes a link moved, by the tenant that paid",
                      ["link", "tenant"])
    busy = _counter("kvd_link_busy_seconds", "Seconds a link spent copying", ["link"])
    lq = _gauge("kvd_link_queued_transfers", "Transfers waiting on a link, by class",
                ["link", "transfer_class"])
    lqb = _gauge("kvd_link_queued_bytes", "Bytes waiting on a link, by class",
                 ["link", "transfer_class"])
    for link in links:
        cap.add_metric([link.name, link.scheduling], link.capacity_bps)
        for t in link.tenants:
            if t.bytes:
                lbytes.add_metric([link.name, t.tenant], t.bytes)
        busy.add_metric([link.name], link.busy_s)
        for cls, (jobs, nbytes) in link.queues.items():
            lq.add_metric([link.name, cls], jobs)
            lqb.add_metric([link.name, cls], nbytes)
    yield from (cap, lbytes, busy, lq, lqb)


def _node_families(figures: NodeFigures):
    hand = _counter("kvd_handoffs", "Handoffs by outcome (completed, rolled_back, failed, "
                    "refused, cancelled, reservations_expired; received and received_rolled_back "
                    "from peers)", ["outcome"])
    for outcome, n in figures.handoffs.items():
        if outcome != "bytes":
            hand.add_metric([outcome], n)
    hbytes = _counter("kvd_handoff_bytes", "Bytes handed off between pools", [])
    hbytes.add_metric([], figures.handoffs.get("bytes", 0))
    leases = _gauge("kvd_leases", "Client leases holding requests or open streams", [])
    leases.add_metric([], figures.leases_active)
    expired = _counter("kvd_lease_expirations", "Leases expired (their client went silent)", [])
    expired.add_metric([], figures.leases_expired)
    released = _counter("kvd_lease_released_requests", "Requests released by lease expiry", [])
    released.add_metric([], figures.lease_released_requests)
    runs = _counter("kvd_self_check_runs", "Periodic self-checks by result (ok, failed; "
                    "skipped: the pool was copying, or the check's child could not be "
                    "made or did not answer)", ["result"])
    for result, n in figures.self_check_runs.items():
        runs.add_metric([result], n)
    yield from (hand, hbytes, leases, expired, released, runs)
    if figures.cluster is not None:
        yield from _cluster_families(figures.cluster)
    yield from _engine_families(figures.engines)


def _cluster_families(view: dict):
    up = _gauge("kvd_cluster_etcd_up", "1 while etcd answers; 0: deciding on the last "
                "picture of the cluster", [])
    up.add_metric([], 1 if view["etcd_up"] else 0)
    age = _gauge("kvd_cluster_picture_age_seconds", "How old this node's picture of the "
                 "others is (0 while etcd answers; -1: none yet)", [])
    age.add_metric([], view["picture_age_s"])
    nodes = _gauge("kvd_cluster_nodes", "Nodes in this node's picture of the cluster", [])
    nodes.add_metric([], view["members"])
    runs = _counter("kvd_cluster_reconciles", "Reconciles with etcd by result", ["result"])
    for result, n in view["reconciles"].items():
        runs.add_metric([result], n)
    labels = ["pool", "tenant"]
    reserved = _gauge("kvd_cluster_tenant_reserved_pages", "A tenant's pages reserved over "
                      "the whole cluster", labels)
    share = _gauge("kvd_cluster_tenant_share_pages", "A tenant's fair share of the cluster's "
                   "device pages", labels)
    limit = _gauge("kvd_cluster_tenant_limit_pages", "A tenant's cluster limit (0: none)",
                   labels)
    entitled = _gauge("kvd_cluster_tenant_entitlement_pages", "A tenant's part of its cluster "
                      "share on this node (a floor here)", labels)
    may = _gauge("kvd_cluster_tenant_may_reserve_pages", "The most this node may reserve for "
                 "a tenant now (its part of the cluster limit; -1: none)", labels)
    for t in view["tenants"]:
        key = [t["pool"], t["tenant"]]
        reserved.add_metric(key, t["reserved_pages"])
        share.add_metric(key, t["share_pages"])
        limit.add_metric(key, t["limit_pages"])
        here = next((n for n in t["nodes"] if n["node"] == view["node"]), None)
        entitled.add_metric(key, here["entitlement_pages"] if here else 0)
        may.add_metric(key, here["may_reserve_pages"] if here else 0)
    yield from (up, age, nodes, runs, reserved, share, limit, entitled, may)


def _engine_families(engines):
    """The engines kvd follows by their KV cache events."""
    blocks = _gauge("kvd_engine_blocks", "Blocks an engine holds, by medium, as its KV cache "
                    "events say", ["engine", "medium"])
    gpu = _gauge("kvd_engine_gpu_blocks", "Blocks on an engine's GPU by tenant (a block kvd "
                 "keeps under the same hash counts 1/k to each of its k tenants)",
                 ["engine", "tenant"])
    batches = _counter("kvd_engine_event_batches", "KV event batches applied, by how they "
                       "came (live, replayed) and batches lost (the publisher no longer had "
                       "them) or undecodable (bad)", ["engine", "outcome"])
    events = _counter("kvd_engine_events", "KV cache events applied", ["engine"])
    malformed = _counter("kvd_engine_events_malformed", "KV cache events kvd could not apply "
                         "(not a map, or block hashes or medium of the wrong kind)", ["engine"])
    dropped = _counter("kvd_engine_events_dropped", "Block hashes and media an engine's "
                       "events named past what kvd follows of it (max_blocks, 8 media): not "
                       "followed", ["engine"])
    restarts = _counter("kvd_engine_restarts", "Times an engine's event publisher started "
                        "over (its sequence numbers back from the start, or TensorRT-LLM's "
                        "`created`): what it held before was forgotten", ["engine"])
    for e in engines:
        for medium, n in e.blocks_by_medium.items():
            blocks.add_metric([e.name, medium], n)
        for tenant, n in e.gpu_blocks_by_tenant.items():
            gpu.add_metric([e.name, tenant], n)
        for outcome, n in (("live", e.batches - e.replayed), ("replayed", e.replayed),
                           ("lost", e.lost), ("bad", e.bad)):
            batches.add_metric([e.name, outcome], n)
        events.add_metric([e.name], e.events)
        malformed.add_metric([e.name], e.malformed)
        dropped.add_metric([e.name], e.dropped)
        restarts.add_metric([e.name], e.restarts)
    yield from (blocks, gpu, batches, events, malformed, dropped, restarts)


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # every scrape and probe would be a log line
        pass


def http_app(ready: Callable[[], bool], detail: Callable[[], str] = lambda: ""):
    """/metrics (Prometheus exposition), /healthz (the process answers), /readyz (kvd is
    serving and not draining: 200, else 503); 404 for any other path."""
    metrics = make_wsgi_app(REGISTRY)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)
        if path == "/healthz":  # alive; what it is deciding on, where that matters
            status, body = "200 OK", ("ok\n" + detail()).encode()
        elif path == "/readyz":
            status, body = (("200 OK", b"ready\n") if ready()
                            else ("503 Service Unavailable", b"not ready\n"))
        else:
            status, body = "404 Not Found", b"not found: kvd serves /metrics, /healthz, /readyz\n"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                                ("Content-Length", str(len(body)))])
        return [body]

    return app


def serve_metrics(address: str, node, loop, ready: Callable[[], bool],
                  detail: Callable[[], str] = lambda: "", gates: dict | None = None,
                  streams=None):
    """Serve http_app on HOST:PORT in a thread of its own; returns the server. Raises
    OSError when it cannot listen: an operator who asked for metrics gets them or an error
    (metrics = "" runs without)."""
    host, _, port = address.rpartition(":")
    collector = KvdCollector(node, loop, gates, streams)
    try:
        REGISTRY.register(collector)
    except ValueError:
        # The names are registered already: a second daemon in one process (tests only).
        # The first daemon's collector keeps answering; kvd itself runs one node.
        pass
    try:
        server = make_server(host or "0.0.0.0", int(port), http_app(ready, detail),
                             _ThreadingServer, handler_class=_QuietHandler)
    except OSError:
        REGISTRY.unregister(collector)
        raise
    threading.Thread(target=server.serve_forever, name="kvd-metrics", daemon=True).start()
    log.info("metrics listening", address=f"http://{host}:{server.server_port}/metrics")
    return server
