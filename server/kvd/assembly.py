"""How a node is put together from its config: each pool's arenas, page table and runtime,
and the links that carry its copies (a device<->host link per pool, and pool->pool links
for handoffs, made on first use when the config declares none)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import structlog

from kvd.config import Config, LinkConfig, PoolConfig, bytes_of
from kvd.core.attribution import Attribution
from kvd.core.bandwidth import LinkScheduler
from kvd.core.clock import Clock
from kvd.core.errors import InvalidArgument
from kvd.core.pool import Pool
from kvd.core.reservation import Reserver
from kvd.core.transfer import TransferPlan
from kvd.links import Link, measure_copy_bandwidth
from kvd.memory.arena import ShmArena
from kvd.memory.copier import PageCopier
from kvd.runtime import PoolRuntime, record_later

log = structlog.get_logger("kvd.node")


def make_arenas(pc: PoolConfig) -> dict[str, object]:
    """Allocate a pool's device and host arenas on the configured backend."""
    from kvd.memory.cuda import gpu_available

    page_bytes = pc.resolved_page_bytes
    use_gpu = pc.device_backend == "cupy" or (pc.device_backend == "auto" and gpu_available())
    if use_gpu:
        if not gpu_available():
            raise InvalidArgument(f"pool {pc.name!r}: device_backend=cupy but no GPU/CuPy here")
        from kvd.memory.cuda import CupyArena, pin_host_arena

        device = CupyArena(pc.device_pages, page_bytes, device=pc.gpu)
        host = ShmArena(pc.host_pages, page_bytes, label=f"{pc.name}-host", backend="pinned-shm")
        pin_host_arena(host)
    else:
        device = ShmArena(pc.device_pages, page_bytes, label=f"{pc.name}-dev",
                          backend="host-standin")
        host = ShmArena(pc.host_pages, page_bytes, label=f"{pc.name}-host")
    return {"device": device, "host": host}



def build_pool(pc: PoolConfig, config: Config, clock: Clock, links: Links,
               reserver: Reserver, on_plan_done: Callable[[TransferPlan, float], None],
               busy: Callable[[], bool]) -> PoolRuntime:
    """A pool, its arenas and its device<->host link, ready to serve. `busy`: whether Step
    messages are being served (the pool's deferred recording of reads waits for them: see
    record_later)."""
    pool = Pool(
        pc.name,
        page_bytes=pc.resolved_page_bytes,
        block_tokens=pc.block_tokens,
        device_pages=pc.device_pages,
        host_pages=pc.host_pages,
        policy=pc.policy,
        clock=clock,
        max_queue=pc.max_queue,
        admission=pc.admission,
        attribution=Attribution(config.eviction_ledger, config.explain_keep),
        reserver=reserver,
        defer=functools.partial(record_later, busy=busy),
    )
    arenas = make_arenas(pc)
    try:
        chunk = max(links.chunk_bytes(pc.link_chunk, pc.link_bandwidth), pool.page_bytes)
        # A CUDA copy always goes through the stream in a worker; host copies of a few KiB
        # are faster on the event loop than handed to a thread and back.
        inline = -1 if arenas["device"].backend == "cupy" else config.inline_copy_bytes
        link = links.make(f"{pc.name}:device<->host", pc.link_bandwidth, pc.link_burst,
                          chunk, pc.link_scheduling, pc.link_aging_ms, pool, inline)
    except BaseException:
        for arena in arenas.values():
            arena.close()
        raise
    runtime = PoolRuntime(pool, arenas, PageCopier(arenas["device"], arenas["host"]),
                          link, chunk, on_plan_done)
    log.info(
        "pool ready",
        pool=pc.name,
        device_backend=arenas["device"].backend,
        host_backend=arenas["host"].backend,
        device_pages=pc.device_pages,
        host_pages=pc.host_pages,
        page_bytes=pool.page_bytes,
        policy=pool.policy.name,
        link_bandwidth=f"{link.sched.capacity_bps / 2**20:.0f}MiB/s",
        link_scheduling=link.sched.scheduling,
    )
    return runtime


# A link to a peer kvd with no bandwidth configured: 10 Gb/s.
REMOTE_DEFAULT_BANDWIDTH = "1.25GB"


class Links:
    """A node's links: each pool's device<->host link (its runtime's) and the pool->pool
    handoff links, by (source, target)."""

    def __init__(self, config: Config, clock: Clock, executor: ThreadPoolExecutor,
                 pools: Mapping[str, PoolRuntime]) -> None:
        self.config = config
        self.clock = clock
        self.executor = executor
        self.pools = pools  # read only: the pools links join
        self.handoff: dict[tuple[str, str], Link] = {}
        self._measured_bps: float | None = None

    def all(self) -> list[Link]:
        return [rt.link for rt in self.pools.values()] + list(self.handoff.values())

    def of(self, pool: str) -> list[Link]:
        """A pool's device<->host link and the handoff links leaving it."""
        return [self.pools[pool].link] + [link for (source, _), link in
                                          self.handoff.items() if source == pool]

    def handoff_link(self, source: str, target: str) -> Link:
        """The source->target link, made (with the source pool's tenant caps) on first use."""
        link = self.handoff.get((source, target))
        if link is None:
            link = self.build_handoff(LinkConfig(source, target))
            apply_caps(link, self.pools[source].pool, self.clock.now())
            self.handoff[(source, target)] = link
        return link

    def build_handoff(self, lc: LinkConfig) -> Link:
        src = self.pools[lc.source]
        bandwidth = lc.bandwidth
        if "/" in lc.target:  # to a peer kvd: the network, and its chunks leave from a worker
            if bandwidth == "auto":  # a copy test here says nothing of the network
                bandwidth = REMOTE_DEFAULT_BANDWIDTH
                log.warning("no bandwidth for the link to a peer; assuming 10 Gb/s",
                            link=f"{lc.source}->{lc.target}")
            inline = -1
        else:
            dst = self.pools[lc.target]
            inline = (-1 if any(rt.arenas["device"].backend == "cupy" for rt in (src, dst))
                      else self.config.inline_copy_bytes)
        chunk = max(self.chunk_bytes(lc.chunk, bandwidth), src.pool.page_bytes)
        return self.make(f"{lc.source}->{lc.target}", bandwidth, lc.burst, chunk,
                         lc.scheduling, lc.aging_ms, src.pool, inline)

    def chunk_bytes(self, chunk, bandwidth) -> int:
        """The piece transfers are copied in. auto: half a millisecond of the link's
        capacity (64 KiB to 4 MiB): small enough that a decode-critical promotion waits
        little behind a chunk in flight, large enough that the per-chunk cost (a hand-off to
        a copy thread) stays small against the copy."""
        if chunk != "auto":
            return int(bytes_of(chunk))
        capacity = self._measured_bandwidth() if bandwidth == "auto" else bytes_of(bandwidth)
        return int(min(4 << 20, max(64 << 10, capacity * 0.0005)))

    def _measured_bandwidth(self) -> float:
        if self._measured_bps is None:
            self._measured_bps = measure_copy_bandwidth()
            log.info("link bandwidth measured (links set to auto use it)",
                     bytes_per_s=round(self._measured_bps),
                     mib_per_s=round(self._measured_bps / 2**20))
        return self._measured_bps

    def make(self, name: str, bandwidth, burst, chunk: int, scheduling: str,
             aging_ms: float, pool: Pool, inline: int) -> Link:
        capacity = (self._measured_bandwidth() if bandwidth == "auto"
                    else bytes_of(bandwidth))
        # The burst is at least one chunk, so every chunk can go. By default it is 5 ms of
        # traffic and at least two chunks: the worker's timer wakes up to a millisecond late,
        # and with room for only one chunk the credit it would earn meanwhile is lost.
        burst = max(bytes_of(burst), chunk) if bytes_of(burst) else max(capacity / 200,
                                                                         2 * chunk)
        sched = LinkScheduler(name, capacity_bps=capacity, burst_bytes=burst,
                              now=self.clock.now(), scheduling=scheduling,
                              aging_s=aging_ms / 1000, quantum_bytes=chunk,
                              weight_of=lambda tenant: pool.tenancy.quota(tenant).weight)
        return Link(sched, self.clock, self.executor, inline, pool.name)


def apply_caps(link: Link, pool: Pool, now: float) -> None:
    """Tenants' bandwidth caps on a link, from their quotas in the pool it leaves."""
    for tenant in set(pool.tenancy.quotas) | set(link.sched.capped_tenants()):
        q = pool.tenancy.quota(tenant)
        cap = link.sched.tenant_cap(tenant)
        if cap is None and q.bandwidth_cap is None:
            continue
        if cap is not None and (cap.rate, cap.burst) == (q.bandwidth_cap, q.bandwidth_burst):
            continue
        link.sched.set_tenant_cap(tenant, q.bandwidth_cap, q.bandwidth_burst, now)
        log.info("bandwidth cap set", link=link.name, tenant=tenant,
                 bytes_per_s=q.bandwidth_cap)
