"""The daemon's state: its pools, their arenas, and which pool each request lives in.

The async operations here are what the gRPC servicers call; they know nothing of protobuf.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog

from kvd.config import Config, LinkConfig, PoolConfig, bytes_of
from kvd.core.bandwidth import Job, LinkScheduler, TransferClass
from kvd.core.attribution import Attribution, RequestAccount
from kvd.core.blocks import Block, Request, RequestState, TierKind
from kvd.core.clock import Clock, MonotonicClock
from kvd.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from kvd.core.fairness import TenantQuota
from kvd.core.invariants import check_pool
from kvd.core.intent import IntentChange
from kvd.core.admission import AdmitResult, Decision
from kvd.core.pool import Pool
from kvd.core.reservation import PoolReserver
from kvd.core.transfer import MoveKind, Reason, TransferPlan
from kvd.links import Link, Transfer, TransferCancelled, measure_copy_bandwidth
from kvd.events import EventBus
from kvd.leases import LeaseTable
from kvd.metrics import STALL_SECONDS
from kvd.memory.arena import ShmArena
from kvd.memory.copier import PageCopier, chunk_runs, copy_between, page_runs
from kvd.runtime import PoolRuntime, record_later

# A batch of more intent updates than SLICED (an engine step's worth; ~5 us each) is
# checked and applied a slice at a time, with the loop served in between.
SLICED = 256
INTENT_SLICE = 32
CHECK_SLICE = 128

log = structlog.get_logger("kvd.daemon")

# A transfer whose bytes have not moved for this long is reported as stuck (a link capped
# to a crawl can legitimately take seconds per chunk; nothing legitimate takes this long).
STUCK_AFTER_S = 30.0
# How long SelfCheck waits for transfers in flight to finish before checking anyway.
SELF_CHECK_WAIT_S = 5.0


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
        pin_host_arena(host.pages)
    else:
        device = ShmArena(pc.device_pages, page_bytes, label=f"{pc.name}-dev",
                          backend="host-standin")
        host = ShmArena(pc.host_pages, page_bytes, label=f"{pc.name}-host")
    return {"device": device, "host": host}


def _settle_handoff(task: asyncio.Task) -> None:
    """A handoff whose caller went away failed or rolled back with nobody to tell: it was
    logged and counted; mark its exception retrieved."""
    if not task.cancelled():
        task.exception()


class Daemon:
    """Pools by name and requests by id; every engine operation goes through here."""

    def __init__(self, config: Config, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        self.started_at = time.time()
        self._executor = ThreadPoolExecutor(config.workers, thread_name_prefix="kvd-copy")
        self.pools: dict[str, PoolRuntime] = {}
        # A prefill pool reserves its requests' decode pages in the others through this.
        self._reserver = PoolReserver(lambda name: self.pools[name].pool, config.handoff_ttl_s)
        self.leases = LeaseTable(self.clock, config.lease_ttl_s)
        self.events = EventBus()
        self.request_index: dict[str, PoolRuntime] = {}
        self._measured_bps: float | None = None
        # pool->pool links for handoff, by (source, target); made on first use when the
        # config does not declare one.
        self.handoff_links: dict[tuple[str, str], Link] = {}
        self.handoffs_in_flight: set[asyncio.Task] = set()
        # Requests with a Handoff under way: a second one is refused at once (it used to
        # start too, and claim a reservation the first had rolled back).
        self._handing_off: set[str] = set()
        # What check_stuck() last found, by pool (a metric, SelfCheck and a log line).
        self.stuck: dict[str, list[str]] = {}
        self.handoff_counts: Counter = Counter()
        try:
            for pc in config.pools:
                self.pools[pc.name] = self._build_pool(pc)
            for lc in config.links:
                self.handoff_links[(lc.source, lc.target)] = self._build_handoff_link(lc)
        except BaseException:
            self.close()
            raise
        self.apply_tenants(config)

    def _build_pool(self, pc: PoolConfig) -> PoolRuntime:
        pool = Pool(
            pc.name,
            page_bytes=pc.resolved_page_bytes,
            block_tokens=pc.block_tokens,
            device_pages=pc.device_pages,
            host_pages=pc.host_pages,
            policy=pc.policy,
            clock=self.clock,
            max_queue=pc.max_queue,
            attribution=Attribution(self.config.eviction_ledger, self.config.explain_keep),
            reserver=self._reserver,
            defer=record_later,
        )
        arenas = make_arenas(pc)
        chunk = max(self._chunk_bytes(pc.link_chunk, pc.link_bandwidth), pool.page_bytes)
        # A CUDA copy always goes through the stream in a worker; host copies of a few KiB
        # are faster on the event loop than handed to a thread and back.
        inline = -1 if arenas["device"].backend == "cupy" else self.config.inline_copy_bytes
        link = self._make_link(f"{pc.name}:device<->host", pc.link_bandwidth, pc.link_burst,
                               chunk, pc.link_scheduling, pc.link_aging_ms, pool, inline)
        runtime = PoolRuntime(pool, arenas, PageCopier(arenas["device"], arenas["host"]),
                              link, chunk)
        runtime.on_plan_done.append(self._on_plan_done)
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

    def _chunk_bytes(self, chunk, bandwidth) -> int:
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

    def _make_link(self, name: str, bandwidth, burst, chunk: int, scheduling: str,
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
        return Link(sched, self.clock, self._executor, inline, pool.name)

    def _build_handoff_link(self, lc: LinkConfig) -> Link:
        src = self.runtime(lc.source)
        chunk = max(self._chunk_bytes(lc.chunk, lc.bandwidth), src.pool.page_bytes)
        inline = -1 if any(rt.arenas["device"].backend == "cupy"
                           for rt in (src, self.runtime(lc.target))) else self.config.inline_copy_bytes
        return self._make_link(f"{lc.source}->{lc.target}", lc.bandwidth, lc.burst, chunk,
                               lc.scheduling, lc.aging_ms, src.pool, inline)

    def handoff_link(self, source: str, target: str) -> Link:
        link = self.handoff_links.get((source, target))
        if link is None:
            link = self._build_handoff_link(LinkConfig(source, target))
            self._apply_link_caps(link, self.runtime(source).pool)
            self.handoff_links[(source, target)] = link
        return link

    def links(self) -> list[Link]:
        return [rt.link for rt in self.pools.values()] + list(self.handoff_links.values())

    def links_of(self, pool: str) -> list[Link]:
        """A pool's device<->host link and the handoff links leaving it."""
        return [self.runtime(pool).link] + [link for (source, _), link in
                                            self.handoff_links.items() if source == pool]

    def _on_plan_done(self, plan: TransferPlan, stall_s: float) -> None:
        if plan.reason is Reason.ACCESS and stall_s > 0:
            STALL_SECONDS.labels(plan.pool).observe(stall_s)
        events = self.events
        if not events.subscriptions:
            return  # nobody watching: skip grouping the victims
        cause = plan.cause
        if plan.demotions:
            victims: dict = {}
            for m in plan.demotions:
                key = (m.block.request.request_id, m.block.request.tenant)
                victims[key] = victims.get(key, 0) + 1
            for (rid, tenant), n in victims.items():
                events.publish("eviction", pool=plan.pool, tenant=tenant, request_id=rid,
                               count=n, reason=plan.reason,
                               cause_tenant=cause.tenant if cause else "",
                               cause_request=cause.request_id if cause else "")
        lost: dict = {}
        for m in plan.promotions:
            if m.kind is MoveKind.REMATERIALIZE:
                key = (m.block.request.request_id, m.block.request.tenant)
                lost[key] = lost.get(key, 0) + 1
        for (rid, tenant), n in lost.items():
            # Blocks whose bytes were dropped came back as zeroed pages: the engine recomputes.
            events.publish("recompute", pool=plan.pool, tenant=tenant, request_id=rid,
                           count=n, reason=plan.reason)
        if plan.promotions:
            events.publish("promotion", pool=plan.pool,
                           tenant=cause.tenant if cause else "",
                           request_id=cause.request_id if cause else "",
                           count=len(plan.promotions), reason=plan.reason,
                           stall_s=f"{stall_s:.6f}")

    # ------------------------------------------------------------------ lookup

    def runtime(self, pool: str) -> PoolRuntime:
        try:
            return self.pools[pool or "default"]
        except KeyError:
            raise NotFound(
                f"no pool {pool!r}; this kvd has {', '.join(sorted(self.pools))}"
            ) from None

    def runtime_of(self, request_id: str, scope: str | None = None) -> PoolRuntime:
        """The pool runtime of a request the caller may touch (scope: its tenant; None: any)."""
        if not request_id:
            raise InvalidArgument("request_id must not be empty")
        try:
            rt = self.request_index[request_id]
        except KeyError:
            raise NotFound(f"no request {request_id!r}; admit it first") from None
        if scope is not None and rt.pool.requests[request_id].tenant != scope:
            # The same answer as for an id nobody holds: whether another tenant uses an id
            # is not this caller's to learn.
            raise NotFound(f"no request {request_id!r}; admit it first")
        return rt

    def request(self, request_id: str) -> Request:
        return self.runtime_of(request_id).pool.get_request(request_id)

    # ------------------------------------------------------------------ engine operations

    def admit(self, request_id: str, *, tenant: str, pool: str, prompt_tokens: int,
              output_tokens: int, priority: int, lease: str = "",
              handoff_pool: str = "") -> AdmitResult:
        if request_id in self.request_index:
            where = self.request_index[request_id].pool.name
            raise AlreadyExists(f"request {request_id!r} already exists in pool {where!r}")
        rt = self.runtime(pool)
        if handoff_pool:
            self._check_handoff_pair(rt, self.runtime(handoff_pool))
        result = rt.pool.admit(request_id, tenant=tenant or "default",
                               prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                               priority=priority, handoff_pool=handoff_pool)
        if result.decision is not Decision.REJECTED:
            self.request_index[request_id] = rt
            self.leases.attach(lease, tenant or "default", request_id)
            rt.notify_queue()
        self.events.publish("admission", pool=rt.pool.name, tenant=tenant or "default",
                            request_id=request_id, count=result.projected_pages,
                            decision=result.decision, reason=result.reason)
        for other in rt.pool.take_newly_admitted():
            self.events.publish("admission", pool=rt.pool.name, tenant=other.tenant,
                                request_id=other.request_id, count=other.projected_pages,
                                decision=Decision.ADMITTED, reason="from the queue")
        return result

    async def allocate(self, request_id: str, num_blocks: int, intent: dict | None = None,
                       scope: str | None = None, holder: str = ""
                       ) -> tuple[list[Block], float]:
        """New blocks for a request; with a holder, held for it until its next call (the
        engine writes them meanwhile)."""
        rt = self.runtime_of(request_id, scope)
        plan = await rt.run(lambda: rt.pool.allocate(request_id, num_blocks, intent,
                                                     holder=holder))
        stall_s = await rt.execute(plan) if plan.num_copies else rt.complete_now(plan)
        self.events.publish("allocation", pool=rt.pool.name, tenant=plan.cause.tenant,
                            request_id=request_id, count=len(plan.allocated))
        return plan.allocated, stall_s

    async def access(self, request_id: str, indices: Sequence[int] | None,
                     scope: str | None = None, holder: str = ""
                     ) -> tuple[list[Block], float, int]:
        rt = self.runtime_of(request_id, scope)
        result = await rt.access(request_id, indices, holder)
        stall_s = await rt.execute(result.plan) if result.plan else 0.0
        if stall_s:
            rt.pool.record_stall(stall_s, result.plan)
        promoted = len(result.plan.promotions) if result.plan else 0
        blocks = result.blocks if result.blocks is not None else result.request.live_blocks()
        return blocks, stall_s, promoted

    def end_holds(self, holder: str) -> None:
        """The holder called again, or went away: the pages it was handed are evictable."""
        for rt in self.pools.values():
            if not rt.pool.holds(holder):
                continue
            admitted = rt.pool.end_holds(holder)
            rt.room_may_have_changed()
            if admitted:
                rt.notify_queue()
                self._publish_admitted(rt.pool, admitted)

    def lapse_holds(self, max_age_s: float) -> int:
        """End holds older than max_age_s (a holder that never calls again): liveness over
        the engine's claim on a page it was handed long ago."""
        now = self.clock.now()
        stale = {h for rt in self.pools.values()
                 for h, since in rt.pool.holders().items() if now - since > max_age_s}
        for holder in stale:
            self.end_holds(holder)
        return len(stale)

    def _publish_admitted(self, pool: Pool, admitted: list[Request]) -> None:
        for other in admitted:
            self.events.publish("admission", pool=pool.name, tenant=other.tenant,
                                request_id=other.request_id, count=other.projected_pages,
                                decision=Decision.ADMITTED, reason="from the queue")

    async def update_intents(self, changes: Sequence[IntentChange], scope: str | None = None
                             ) -> tuple[int, int]:
        """Apply updates grouped by pool. Validation of every group happens before any group
        applies, so a bad item changes nothing."""
        by_pool: dict[PoolRuntime, list[IntentChange]] = {}
        sliced = len(changes) > SLICED
        for i, change in enumerate(changes):
            if sliced and i and i % CHECK_SLICE == 0:
                await asyncio.sleep(0)
            by_pool.setdefault(self.runtime_of(change.request_id, scope), []).append(change)
        if sliced:
            # A big batch is checked whole, then applied a slice at a time, with the loop
            # served between slices: no call holds it for more than a fraction of a
            # millisecond. (A slice that fails because another call changed things
            # meanwhile leaves the slices before it applied.)
            for rt, group in by_pool.items():
                final: dict = {}
                for start in range(0, len(group), CHECK_SLICE):
                    await asyncio.sleep(0)
                    rt.pool.check_intents(group[start:start + CHECK_SLICE], final)
                rt.pool.check_pins(final)
            plans = []
            for rt, group in by_pool.items():
                for start in range(0, len(group), INTENT_SLICE):
                    await asyncio.sleep(0)
                    plans.append((rt, rt.pool.update_intents(group[start:start + INTENT_SLICE])))
        else:
            plans = [(rt, rt.pool.update_intents(group)) for rt, group in by_pool.items()]
        prefetched = 0
        for rt, _ in plans:
            rt.room_may_have_changed()  # an unpinned block may be a victim now
        for rt, plan in plans:
            if plan is not None:
                prefetched += len(plan.promotions)
                await rt.execute(plan)
        return len(changes), prefetched

    async def free(self, request_id: str, indices: Sequence[int], scope: str | None = None
                   ) -> int:
        rt = self.runtime_of(request_id, scope)
        freed = await rt.run(lambda: rt.pool.free(request_id, indices))
        rt.room_may_have_changed()
        return freed

    async def release(self, request_id: str, scope: str | None = None
                      ) -> tuple[int, list[Request]]:
        rt = self.runtime_of(request_id, scope)
        req = rt.pool.requests[request_id]
        tenant = req.tenant
        freed, admitted = await rt.run(lambda: rt.pool.release(request_id))
        rt.room_may_have_changed()
        del self.request_index[request_id]
        if req.handoff_pool:  # never handed off: its reservation goes too
            self._drop_reservation(req.handoff_pool, request_id)
        if admitted or freed:
            self._kick_handoff_queues(rt.pool.name)
        self.leases.detach(request_id)
        rt.notify_queue()
        self.events.publish("release", pool=rt.pool.name, tenant=tenant,
                            request_id=request_id, count=freed)
        self._publish_admitted(rt.pool, admitted)
        return freed, admitted

    # ------------------------------------------------------------------ disaggregation

    def _check_handoff_pair(self, src: PoolRuntime, dst: PoolRuntime) -> None:
        if src is dst:
            raise InvalidArgument(f"a request cannot hand off to its own pool {src.pool.name!r}")
        a, b = src.pool, dst.pool
        if (a.page_bytes, a.block_tokens) != (b.page_bytes, b.block_tokens):
            raise FailedPrecondition(
                f"pools {a.name!r} and {b.name!r} lay blocks out differently "
                f"({a.page_bytes} vs {b.page_bytes} bytes, {a.block_tokens} vs "
                f"{b.block_tokens} tokens a page): kvd hands off block for block"
            )

    def _drop_reservation(self, pool: str, request_id: str) -> bool:
        rt = self.pools.get(pool)
        req = rt.pool.requests.get(request_id) if rt else None
        if req is None or req.state is not RequestState.RESERVED:
            return False
        rt.pool.release(request_id)
        self._kick_handoff_queues(pool)
        return True

    def _kick_handoff_queues(self, target: str) -> None:
        """Pages came free in `target`: prefill requests queued for a reservation there may
        go now."""
        for rt in self.pools.values():
            pool = rt.pool
            if any(r.handoff_pool == target for r in pool.queue.values()):
                admitted = pool.admit_waiting()
                self._publish_admitted(pool, admitted)
                if admitted:
                    rt.notify_queue()

    def expire_reservations(self) -> int:
        """Release decode reservations no handoff claimed in time (their prefill requests
        stay; a later Handoff says the reservation lapsed)."""
        expired = 0
        for rt in list(self.pools.values()):
            for request_id in rt.pool.expired_reservations():
                tenant = rt.pool.requests[request_id].tenant
                rt.pool.release(request_id)
                expired += 1
                self.handoff_counts["reservations_expired"] += 1
                log.warning("handoff reservation expired", pool=rt.pool.name,
                            request_id=request_id, tenant=tenant)
                self.events.publish("handoff", pool=rt.pool.name, tenant=tenant,
                                    request_id=request_id, reason="reservation expired")
            if expired:
                self._kick_handoff_queues(rt.pool.name)
        return expired

    async def expire_forever(self, period_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.expire_reservations()
            self.lapse_holds(self.config.hold_s)
            self.check_stuck()

    async def handoff(self, request_id: str, target: str = "", scope: str | None = None,
                      holder: str = "") -> AsyncIterator[dict]:
        """Copy a request's blocks to its handoff pool under the pool->pool link's budget,
        yielding progress; all or nothing. The work runs in a task of its own, so a caller
        that goes away cancels it between chunks and it rolls back cleanly. The blocks the
        last message hands out are held for `holder` until its next call."""
        src = self.runtime_of(request_id, scope)
        req = src.pool.get_admitted(request_id)
        target = target or req.handoff_pool
        if not target:
            raise FailedPrecondition(
                f"request {request_id!r} was admitted without a handoff pool; name target_pool")
        if req.handoff_pool and target != req.handoff_pool:
            raise InvalidArgument(f"request {request_id!r} reserved pages in pool "
                                  f"{req.handoff_pool!r}, not {target!r}")
        dst = self.runtime(target)
        self._check_handoff_pair(src, dst)
        reservation = dst.pool.requests.get(request_id)
        # Checked before anything is reserved: a refused second call must leave nothing.
        if ((reservation is not None and reservation.state is not RequestState.RESERVED)
                or request_id in self._handing_off):
            raise FailedPrecondition(f"request {request_id!r} is being handed off already")
        if reservation is None:
            # None made at admission (or it lapsed, or a handoff was rolled back): the
            # target decides only now, and a refusal means the prefill was spent for nothing.
            try:
                dst.pool.reserve(request_id, req.tenant, prompt_tokens=req.prompt_tokens,
                                 output_tokens=req.output_tokens, priority=req.priority,
                                 ttl_s=self.config.handoff_ttl_s)
            except ResourceExhausted as exc:
                self.handoff_counts["refused"] += 1
                had = ("its reservation lapsed or a handoff was rolled back"
                       if req.handoff_pool else "it was admitted without a reservation")
                raise ResourceExhausted(f"{exc}; {had}") from None
            req.handoff_pool = target

        progress: asyncio.Queue = asyncio.Queue()
        cancel = asyncio.Event()
        task = asyncio.ensure_future(self._handoff(src, dst, req, progress, cancel, holder))
        self._handing_off.add(request_id)
        task.add_done_callback(lambda _: self._handing_off.discard(request_id))
        self.handoffs_in_flight.add(task)
        task.add_done_callback(_settle_handoff)
        task.add_done_callback(self.handoffs_in_flight.discard)
        try:
            while True:
                getter = asyncio.ensure_future(progress.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    item = getter.result()
                    yield item
                    if item["done"]:
                        return
                    continue
                getter.cancel()
                task.result()  # raises what failed the handoff
                while not progress.empty():
                    item = progress.get_nowait()
                    yield item
                return
        finally:
            if not task.done():
                cancel.set()  # the caller went away: roll back between chunks
                self.handoff_counts["cancelled"] += 1

    async def _handoff(self, src: PoolRuntime, dst: PoolRuntime, req: Request,
                       progress: asyncio.Queue, cancel: asyncio.Event, holder: str) -> None:
        request_id = req.request_id
        blocks = await src.run(lambda: src.pool.begin_handoff(request_id),
                               undo=src.pool.end_handoff)
        this = asyncio.current_task()
        for b in blocks:  # whoever needs these blocks waits for the handoff
            src._inflight[b] = this
        try:
            dst.pool.claim(request_id)  # gone if it lapsed meanwhile
        except BaseException:
            src._finish_blocks(blocks)
            src.pool.end_handoff(blocks)
            src.room_may_have_changed()
            raise
        plan = None
        demoted = False
        try:
            if blocks:
                indices = [b.index for b in blocks]  # the engine's indices stay
                plan = await dst.run(lambda: dst.pool.allocate(
                    request_id, len(blocks), indices=indices, reason=Reason.HANDOFF))
                dst._plans.add(plan)
                for b in plan.blocks():
                    dst._inflight[b] = this
                if plan.demotions:  # room in the decode pool first, over its own link
                    await self._copy_demotions(dst, plan)
                demoted = True
                await self._copy_handoff(src, dst, blocks, plan, progress, cancel)
            if cancel.is_set():
                raise TransferCancelled()
        except BaseException as exc:
            # All or nothing: the request stays whole in the prefill pool; the target pages
            # and the reservation go.
            if plan is not None:
                if demoted:  # victims' bytes are on host now: finish those moves only
                    dst.pool.complete(TransferPlan(dst.pool.name, Reason.HANDOFF, plan.cause,
                                                   demotions=plan.demotions))
                    dst.pool.abort(TransferPlan(dst.pool.name, Reason.HANDOFF, plan.cause,
                                                allocated=plan.allocated))
                else:
                    dst.pool.abort(plan)
                dst._finish(plan)
            self._end_handoff(src, dst, request_id, blocks, release=dst.pool)
            self.handoff_counts["failed" if not isinstance(exc, TransferCancelled)
                                else "rolled_back"] += 1
            log.info("handoff rolled back", request_id=request_id, source=src.pool.name,
                     target=dst.pool.name, error=repr(exc))
            self.events.publish("handoff", pool=src.pool.name, tenant=req.tenant,
                                request_id=request_id, reason=f"rolled back: {exc!r}")
            raise
        # Commit: the blocks live in the target; the prefill pages go.
        if plan is not None:
            dst.pool.complete(plan)
            dst._finish(plan)
        self._end_handoff(src, dst, request_id, blocks, release=src.pool)
        self.request_index[request_id] = dst
        self.handoff_counts["completed"] += 1
        self.handoff_counts["bytes"] += len(blocks) * src.pool.page_bytes
        dst_req = dst.pool.requests[request_id]
        dst_req.bytes_moved += len(blocks) * src.pool.page_bytes
        if holder:  # the engine reads what the last message hands it: nothing may move it
            dst.pool.hold(holder, dst_req.live_blocks())
        src.notify_queue()
        self.events.publish("handoff", pool=dst.pool.name, tenant=req.tenant,
                            request_id=request_id, count=len(blocks), reason="completed")
        progress.put_nowait(self._progress(dst_req, len(blocks), len(blocks),
                                           src.pool.page_bytes, finished=True))

    def _end_handoff(self, src: PoolRuntime, dst: PoolRuntime, request_id: str,
                     blocks: list[Block], release: Pool) -> None:
        """The source blocks are free to move again; the request goes from `release` (the
        target on a rollback, the source on commit); waiters for room in either may go."""
        src._finish_blocks(blocks)
        src.pool.end_handoff(blocks)
        release.release(request_id)
        src.room_may_have_changed()
        dst.room_may_have_changed()
        self._kick_handoff_queues(dst.pool.name)

    @staticmethod
    def _progress(req: Request, done: int, total: int, page_bytes: int,
                  finished: bool = False) -> dict:
        return {"request_id": req.request_id, "pool": req.pool, "blocks_done": done,
                "blocks_total": total, "bytes_done": done * page_bytes,
                "bytes_total": total * page_bytes, "done": finished,
                "blocks": req.live_blocks() if finished else None}

    def _handoff_job(self, req: Request, chunks: list[list[tuple]], page_bytes: int) -> Job:
        """A handoff's copies wait on the link as an access does, under the request's cap."""
        return Job(TransferClass.ACCESS, req.tenant, req.request_id,
                   [sum(run[4] for run in chunk) * page_bytes for chunk in chunks],
                   self.clock.now(),
                   caps=(req.transfer_cap,) if req.transfer_cap is not None else ())

    async def _copy_demotions(self, dst: PoolRuntime, plan: TransferPlan) -> None:
        runs = page_runs((m.src_tier, m.src_page, m.dst_tier, m.dst_page)
                         for m in plan.demotions if m.copies_bytes)
        if not runs:
            return
        chunks = chunk_runs(runs, dst.chunk_pages)
        job = self._handoff_job(plan.cause, chunks, dst.pool.page_bytes)
        transfer = Transfer(job, chunks, dst.copier.copy_runs,
                            asyncio.get_running_loop().create_future())
        dst.link.submit(transfer)
        await transfer.future

    async def _copy_handoff(self, src: PoolRuntime, dst: PoolRuntime, blocks: list[Block],
                            plan: TransferPlan, progress: asyncio.Queue,
                            cancel: asyncio.Event) -> None:
        link = self.handoff_link(src.pool.name, dst.pool.name)
        src_arenas = {TierKind.DEVICE: src.arenas["device"], TierKind.HOST: src.arenas["host"]}
        dst_device = dst.arenas["device"]
        pairs = [(block.tier, block.page, TierKind.DEVICE, new.page)
                 for block, new in zip(blocks, plan.allocated)]
        chunk_pages = max(1, int(link.sched.quantum) // src.pool.page_bytes)
        chunks = chunk_runs(page_runs(pairs), chunk_pages) if pairs else []
        if not chunks:
            return
        page_bytes = src.pool.page_bytes
        req = blocks[0].request
        job = self._handoff_job(req, chunks, page_bytes)
        total = len(blocks)
        dst_req = dst.pool.requests[req.request_id]

        def copy(runs):
            for src_tier, src_page, _dst_tier, dst_page, num in runs:
                copy_between(src_arenas[src_tier], src_page, dst_device, dst_page, num)

        def on_chunk(j: Job):
            pages = j.bytes_done // page_bytes
            progress.put_nowait(self._progress(dst_req, pages, total, page_bytes))

        transfer = Transfer(job, chunks, copy, asyncio.get_running_loop().create_future(),
                            on_chunk=on_chunk)
        link.submit(transfer)
        canceller = asyncio.ensure_future(cancel.wait())
        try:
            await asyncio.wait({transfer.future, canceller},
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            canceller.cancel()
        if not transfer.future.done():
            link.cancel(transfer)
        await transfer.future

    def explain(self, request_id: str, scope: str | None = None
                ) -> tuple[RequestAccount, str, bool]:
        """A request's account (active or recently released), its pool, and whether active."""
        if not request_id:
            raise InvalidArgument("request_id must not be empty")
        for rt in self.pools.values():
            account = rt.pool.attribution.account(request_id)
            if account is not None and (scope is None or account.tenant == scope):
                return account, rt.pool.name, request_id in rt.pool.attribution.active
        raise NotFound(f"kvd knows nothing of request {request_id!r} (never admitted, or "
                       "released long ago)")

    def admission_state(self, request_id: str, scope: str | None = None):
        """(admitted?, queue position, reason, the event that fires on the next change)."""
        rt = self.runtime_of(request_id, scope)
        req = rt.pool.requests[request_id]
        if req.state is RequestState.ADMITTED:
            return True, 0, "", None
        position = rt.pool.queue_position(request_id)
        return False, position, rt.pool.why_waiting(req), rt.queue_event(request_id, position)

    # ------------------------------------------------------------------ tenants

    def apply_tenants(self, config: Config) -> None:
        """Set every pool's quotas from the config (at start and on SIGHUP); tenants no
        longer declared fall back to the default quota. Changes are logged."""
        for rt in self.pools.values():
            pool = rt.pool
            quotas = {t.name: t.quota_for(pool.name, pool.page_bytes) for t in config.tenants}
            promised = sum(q.guaranteed for q in quotas.values())
            if promised > pool.device.capacity:
                log.warning("guarantees overcommitted: scaled down proportionally",
                            pool=pool.name, guaranteed_pages=promised,
                            device_pages=pool.device.capacity,
                            scale=round(pool.device.capacity / promised, 4))
            for tenant in set(pool.tenancy.quotas) | set(quotas):
                new = quotas.get(tenant, TenantQuota())
                if pool.tenancy.quotas.get(tenant) != new:
                    log.info("quota set", pool=pool.name, tenant=tenant, weight=new.weight,
                             guaranteed=new.guaranteed, limit=new.limit)
                    pool.set_quota(tenant, new)
                    self.events.publish("quota", pool=pool.name, tenant=tenant,
                                        weight=new.weight, guaranteed=new.guaranteed,
                                        limit=new.limit or 0)
            self._apply_link_caps(rt.link, pool)
            rt.notify_queue()
        for (source, _), link in self.handoff_links.items():
            self._apply_link_caps(link, self.runtime(source).pool)

    def _apply_link_caps(self, link: Link, pool: Pool) -> None:
        """Tenants' bandwidth caps on a link, from their quotas in the pool it leaves."""
        now = self.clock.now()
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

    def set_quota(self, tenant: str, pool: str, **changes) -> list[str]:
        """Change the given fields of a tenant's quota in one pool ("" = every pool); None
        for limit or a per-request cap means none."""
        if not tenant:
            raise InvalidArgument("tenant must not be empty")
        for key, value in changes.items():
            # NaN passes every comparison and infinity is no quota: neither may reach the
            # policies (or the log, which must stay JSON).
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidArgument(f"{key} must be a finite number, got {value}")
        if "weight" in changes and not changes["weight"] > 0:
            raise InvalidArgument("weight must be positive")
        fraction = changes.get("max_request_fraction")
        if fraction is not None and not 0 <= fraction <= 1:
            raise InvalidArgument("max_request_fraction is 0..1")
        runtimes = [self.runtime(pool)] if pool else list(self.pools.values())
        for rt in runtimes:
            old = rt.pool.tenancy.quota(tenant)
            new = dataclasses.replace(old)
            for key, value in changes.items():
                setattr(new, key, value)
            if new.limit is not None and new.guaranteed > new.limit:
                raise InvalidArgument(f"pool {rt.pool.name!r}: guaranteed ({new.guaranteed} "
                                      f"pages) would be above limit ({new.limit} pages)")
        for rt in runtimes:
            old = rt.pool.tenancy.quota(tenant)
            new = dataclasses.replace(old)
            for key, value in changes.items():
                setattr(new, key, value)
            rt.pool.set_quota(tenant, new)
            self._apply_link_caps(rt.link, rt.pool)
            rt.notify_queue()
            self.events.publish("quota", pool=rt.pool.name, tenant=tenant, weight=new.weight,
                                guaranteed=new.guaranteed, limit=new.limit or 0)
            log.info("quota changed", pool=rt.pool.name, tenant=tenant, weight=new.weight,
                     guaranteed=new.guaranteed, limit=new.limit,
                     max_request_pages=new.max_request_pages,
                     max_request_fraction=new.max_request_fraction)
        return [rt.pool.name for rt in runtimes]

    def tenants(self, pool: str = "") -> list[tuple[str, Pool]]:
        """(tenant, pool) pairs known to each pool: declared or seen."""
        runtimes = [self.runtime(pool)] if pool else list(self.pools.values())
        out = []
        for rt in runtimes:
            p = rt.pool
            names = p.tenancy.names()
            out += [(name, p) for name in sorted(names)]
        return out

    async def evict(self, pool: str, num_pages: int) -> list:
        rt = self.runtime(pool)
        # Victims in transit or held by engines come free soon: wait for them as any
        # operation that needs room does.
        plan = await rt.run(lambda: rt.pool.evict(num_pages))
        await rt.execute(plan)
        return plan.demotions

    async def set_policy(self, pool: str, policy: str) -> str:
        rt = self.runtime(pool)
        previous = rt.pool.set_policy(policy)
        log.info("policy changed", pool=rt.pool.name, policy=policy, previous=previous)
        self.events.publish("policy", pool=rt.pool.name, policy=policy, previous=previous)
        return previous

    def check_stuck(self) -> list[str]:
        """Transfers without progress for STUCK_AFTER_S, and blocks in transit that nothing
        owns: logged when first found, kept for the metric and SelfCheck."""
        found = []
        for name, rt in self.pools.items():
            problems = rt.stuck(STUCK_AFTER_S)
            for problem in set(problems) - set(self.stuck.get(name, ())):
                log.error("transfer stuck", pool=name, problem=problem)
            self.stuck[name] = problems
            found += problems
        return found

    async def self_check(self) -> list[str]:
        problems = []
        for rt in self.pools.values():
            await rt.quiesce(timeout_s=SELF_CHECK_WAIT_S)  # a slow link may still be busy
            rt.pool.snapshot()
            problems.extend(check_pool(rt.pool))
        return problems + self.check_stuck()

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for transfers in flight, at most timeout_s in all; False: some still were."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        quiet = True
        for rt in self.pools.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            quiet &= await rt.quiesce(left)
        return quiet

    def close(self) -> None:
        for rt in self.pools.values():
            rt.close()
        self.pools.clear()
        self._executor.shutdown(wait=True)

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Let transfers and handoffs in flight finish, at most timeout_s; then stop the
        links (a copy already handed to a worker finishes: close() waits for the workers
        before it unmaps the arenas)."""
        deadline = time.monotonic() + timeout_s
        quiet = await self.drain(timeout_s)
        pending = {t for t in self.handoffs_in_flight if not t.done()}
        if pending:
            _, pending = await asyncio.wait(pending,
                                            timeout=max(0.0, deadline - time.monotonic()))
        if not quiet or pending:
            log.error("shutting down with transfers still in flight; abandoning them",
                      handoffs=len(pending), stuck=self.check_stuck())
            for task in pending:
                task.cancel()
        for link in self.links():
            await link.aclose()
        await asyncio.get_running_loop().run_in_executor(None, self.close)
