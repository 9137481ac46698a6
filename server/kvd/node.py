"""The daemon's state: its pools, their arenas, and which pool each request lives in.

The async operations here are what the gRPC servicers call; they know nothing of protobuf.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import structlog

from kvd.assembly import Links, build_pool
from kvd.config import Config
from kvd.core.admission import AdmitResult, Decision
from kvd.core.attribution import RequestAccount
from kvd.core.blocks import Block, Request, RequestState
from kvd.core.clock import Clock, MonotonicClock
from kvd.core.errors import (AlreadyExists, InvalidArgument, KvdError, NotFound,
                             PermissionDenied)
from kvd.core.holds import OWN_HOLDER
from kvd.core.intent import IntentChange
from kvd.core.prefix import Shares
from kvd.core.reservation import PoolReserver, Verdict
from kvd.events import EventBus, PlanEvents, publish_admitted
from kvd.handoff import Handoffs
from kvd import intent_batch
from kvd.health import Health
from kvd.kv_events import EngineEvents, Holdings, walk_holdings
from kvd.leases import LeaseTable
from kvd.quotas import Quotas
from kvd.links import Link
from kvd.metrics import STALL_SECONDS
from kvd.peers import Peers, RemoteReserver, Reservers, is_remote
from kvd.runtime import PoolRuntime, StartedAccess, find_runtime
from kvd import sliced
from kvd.shared import SharedBlocks

T = TypeVar("T")
log = structlog.get_logger("kvd.node")

# Queued requests rejected after a quota or policy change whose reason kvd keeps for their
# WaitAdmission streams (a client that learns it later finds the request gone).
REJECTED_KEPT = 4096
# The most of the event loop's time the walks of what the followed engines hold may take
# (see follow_engine_holdings): the walks come further apart while they take longer.
ENGINE_WALK_SHARE = 0.05


@dataclass(slots=True)
class Explained:
    """What Explain answers: a request's account, its pool, whether it is active, and what
    shared blocks cost it and its tenant."""

    account: RequestAccount
    pool: str
    active: bool
    request_shares: Shares
    tenant_shares: Shares


class Node:
    """A node's pools by name and its requests by id: the one thing the gRPC servicers call,
    for Step as for unary calls."""

    def __init__(self, config: Config, clock: Clock | None = None) -> None:
        self.config = config
        self._restricted = {p.name: frozenset(p.tenants) for p in config.pools if p.tenants}
        self.clock = clock or MonotonicClock()
        self.started_at = time.time()
        self._executor = ThreadPoolExecutor(config.workers, thread_name_prefix="kvd-copy")
        self.pools: dict[str, PoolRuntime] = {}
        self.leases = LeaseTable(self.clock, config.lease_ttl_s)
        # Holders whose Step message is being served: their holds do not lapse meanwhile
        # (what the step handed out earlier must stay while it waits for more room).
        self.serving: set[str] = set()
        # Pools whose holds end a slice at a time now (see end_holds), and a slice's blocks.
        self._ending: set[PoolRuntime] = set()
        self.slice_blocks = config.slice_blocks
        # Each open Step stream's holder, and the lease of the client that opened it: a
        # client's handoff does not wait for its own streams (see Handoffs.handoff).
        self.stream_leases: dict[str, str] = {}
        # The Step messages being served, from their arrival to their reply's write (the
        # Step service's own set: StepStreams): the pools' deferred work waits for them.
        self.stepping: set = set()
        self.events = EventBus()
        self.request_index: dict[str, PoolRuntime] = {}
        # Requests taken out of a queue they could never leave (see settle_queues): id ->
        # (tenant, why), the latest REJECTED_KEPT, for their WaitAdmission streams.
        self.rejected: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self.link_table = Links(config, self.clock, self._executor, self.pools)
        self.peers = Peers(config)  # other nodes' kvds, for handoffs across nodes
        self._peer_retry: asyncio.Task | None = None
        self.handoffs = Handoffs(config, self.clock, self.pools, self.request_index,
                                 self.link_table, self.events, self.peers,
                                 left=self.leases.detach, handed=self.leases.handed)
        self.health = Health(self.pools, self.index_problems)
        self.engines = EngineEvents(config.engines)
        self.engine_holdings = Holdings()  # as last walked: see follow_engine_holdings
        # A prefill pool reserves its requests' decode pages in the others through this.
        reserver = Reservers(PoolReserver(lambda name: self.pools[name].pool,
                                          config.handoff_ttl_s), RemoteReserver(self.peers))
        plan_events = PlanEvents(self.events,
                                 lambda pool, s: STALL_SECONDS.labels(pool).observe(s))
        try:
            for pc in config.pools:
                self.pools[pc.name] = build_pool(pc, config, self.clock, self.link_table,
                                                 reserver, plan_events,
                                                 lambda: bool(self.stepping))
                self.pools[pc.name].pool.pages.holds.serving = self.serving
            for lc in config.links:
                self.link_table.handoff[(lc.source, lc.target)] = \
                    self.link_table.build_handoff(lc)
        except BaseException:
            self.close()
            raise
        self.quotas = Quotas(self.pools, self.link_table, self.events, self.clock)
        self.cluster = None  # kvd.cluster.ClusterMember, when [cluster] names etcd
        self.shared = SharedBlocks(self.runtime, self.runtime_of, self._room_grew,
                                   self.handoffs.refuse_while_under_way, self.slice_blocks)
        # Pools whose line's fair order moved since it last ran (see _order_moved).
        self._moved: dict[str, PoolRuntime] = {}
        self._settle_soon = False
        for rt in self.pools.values():
            rt.pool.admission.on_order_moved = functools.partial(self._order_moved, rt)
        self.apply_tenants(config)

    # ------------------------------------------------------------------ lookup

    def runtime(self, pool: str) -> PoolRuntime:
        return find_runtime(self.pools, pool or "default")

    def may_use(self, pool: str, tenant: str) -> None:
        """Pools restricted to tenants (`[[pool]] tenants = [...]`) refuse the others, whoever
        asks for them: the tenant, the admin identity or a peer kvd."""
        allowed = self._restricted.get(pool)
        if allowed is not None and tenant not in allowed:
            raise PermissionDenied(f"pool {pool!r} is not open to tenant {tenant!r}")

    def runtimes(self, pool: str = "") -> list[PoolRuntime]:
        """The named pool's runtime, or every pool's ("")."""
        return [self.runtime(pool)] if pool else list(self.pools.values())

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

    def links(self) -> list[Link]:
        return self.link_table.all()

    def links_of(self, pool: str) -> list[Link]:
        """A pool's device<->host link and the handoff links leaving it."""
        self.runtime(pool)  # NotFound for an unknown pool
        return self.link_table.of(pool)

    @property
    def handoff_counts(self) -> Counter:
        return self.handoffs.counts

    # ------------------------------------------------------------------ engine operations

    def admit(self, request_id: str, *, tenant: str, pool: str, prompt_tokens: int,
              output_tokens: int, priority: int, lease: str = "",
              handoff_pool: str = "") -> AdmitResult:
        if request_id in self.request_index:
            where = self.request_index[request_id].pool.name
            raise AlreadyExists(f"request {request_id!r} already exists in pool {where!r}")
        rt = self.runtime(pool)
        if handoff_pool and not is_remote(handoff_pool):
            self.handoffs.check_pair(rt, self.runtime(handoff_pool))
        self.rejected.pop(request_id, None)  # an id is free again once it was rejected
        result = rt.pool.admit(request_id, tenant=tenant or "default",
                               prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                               priority=priority, handoff_pool=handoff_pool)
        if result.decision is not Decision.REJECTED:
            self.request_index[request_id] = rt
            self.leases.attach(lease, tenant or "default", request_id)
            rt.waiters.notify()
        self.events.publish("admission", pool=rt.pool.name, tenant=tenant or "default",
                            request_id=request_id, count=result.projected_pages,
                            decision=result.decision, reason=result.reason)
        publish_admitted(self.events, rt.pool.name, rt.pool.admission.take_newly_admitted())
        self._settle_lines()  # a handoff reservation it made moved its handoff pool's line
        return result

    async def admit_async(self, request_id: str, *, tenant: str, pool: str,
                          prompt_tokens: int, output_tokens: int, priority: int,
                          lease: str = "", handoff_pool: str = "") -> AdmitResult:
        """admit(), asking a peer first when the handoff pool is another node's: its
        reservation there is made (or refused) before this node decides."""
        if is_remote(handoff_pool):
            if request_id in self.request_index:
                where = self.request_index[request_id].pool.name
                raise AlreadyExists(f"request {request_id!r} already exists in pool {where!r}")
            rt = self.runtime(pool)
            probe = rt.pool.admission.new_request(request_id, tenant or "default",
                                                  prompt_tokens, output_tokens, priority,
                                                  handoff_pool)
            try:
                verdict = await self.peers.reserve(probe, rt.pool.page_bytes,
                                                   rt.pool.block_tokens)
            except asyncio.CancelledError:
                # The caller went away while the peer answered: the peer may have
                # reserved already, and nothing here would ever claim it.
                self._unclaimed(handoff_pool, request_id)
                raise
        try:
            result = self.admit(request_id, tenant=tenant, pool=pool,
                                prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                                priority=priority, lease=lease, handoff_pool=handoff_pool)
        except KvdError:
            # Refused here after the peer reserved (the tenant's share of the queue is
            # full, say): nothing will claim the reservation.
            if is_remote(handoff_pool) and verdict is Verdict.OK:
                self._unclaimed(handoff_pool, request_id)
            raise
        if is_remote(handoff_pool) and result.decision is Decision.REJECTED:
            if verdict is Verdict.OK:  # rejected here for reasons of its own
                self.peers.unreserve(handoff_pool, request_id)
            self.peers.verdicts.pop(request_id, None)
        return result

    def _unclaimed(self, handoff_pool: str, request_id: str) -> None:
        """Give back a reservation the peer may hold for request_id that no request here
        will claim; unless a request under that id was admitted here since (the peer's
        reservation is then that request's)."""
        if request_id not in self.request_index:
            self.peers.unreserve(handoff_pool, request_id)

    async def retry_peers(self) -> None:
        """Ask the peers again for requests queued here because a peer said not now; those
        it reserves for may be admitted."""
        waiting = [(rt, req) for rt in self.pools.values() for req in rt.pool.queue.values()
                   if is_remote(req.handoff_pool)
                   and self.peers.verdicts.get(req.request_id, (None,))[0] is not Verdict.OK]
        if not waiting:
            return
        answers = await asyncio.gather(*(self.peers.reserve(req, rt.pool.page_bytes,
                                                            rt.pool.block_tokens)
                                         for rt, req in waiting), return_exceptions=True)
        for rt, req in waiting:
            if rt.pool.requests.get(req.request_id) is not req:
                # Released while the peer answered: its release gave back what the peer
                # held then, and the answer may be a reservation made since.
                self._unclaimed(req.handoff_pool, req.request_id)
        for rt in {rt for (rt, _), verdict in zip(waiting, answers) if verdict is Verdict.OK}:
            admitted = rt.pool.admit_waiting()
            publish_admitted(self.events, rt.pool.name, admitted)
            rt.waiters.notify()

    def allocate(self, request_id: str, num_blocks: int, intent: dict | None = None,
                 scope: str | None = None, holder: str = ""
                 ) -> Awaitable[tuple[list[Block], float]]:
        """New blocks for a request; with a holder, held for it until its next call (the
        engine writes them meanwhile). Refused while the request is handed off: its blocks
        are those the handoff copies, and one added meanwhile would be left behind. More
        than a slice's worth are made a slice at a time (see sliced). (The caller awaits
        the one that does it: an engine step's allocation pays no coroutine of its own.)"""
        if num_blocks > self.slice_blocks:
            return sliced.allocate(self, request_id, num_blocks, intent, scope, holder)
        return self.allocate_at_once(request_id, num_blocks, intent, scope, holder)

    async def allocate_at_once(self, request_id: str, num_blocks: int,
                               intent: dict | None = None, scope: str | None = None,
                               holder: str = "", wait: bool = True
                               ) -> tuple[list[Block], float]:
        """allocate(), in one go. `wait=False`: BlocksInTransit where it would wait for room
        or for blocks in transit (see PoolRuntime.run)."""
        rt = self.runtime_of(request_id, scope)
        self.handoffs.refuse_while_under_way(request_id, "allocate")
        plan = await rt.run(lambda: rt.pool.allocate(request_id, num_blocks, intent,
                                                     holder=holder), holder=holder, wait=wait)
        stall_s = await rt.execute(plan) if plan.num_copies else rt.complete_now(plan)
        self.events.publish("allocation", pool=rt.pool.name, tenant=plan.cause.tenant,
                            request_id=request_id, count=len(plan.allocated))
        return plan.allocated, stall_s

    def access(self, request_id: str, indices: Sequence[int] | None,
               scope: str | None = None, holder: str = ""
               ) -> Awaitable[tuple[list[Block], float, int]]:
        """Read blocks now, waiting for those brought in: (blocks, stall, promoted). More
        than a slice's indices, or a whole request with more than a slice's blocks to bring
        in, are read a slice at a time (see sliced)."""
        if self.reads_in_slices(request_id, indices, scope):
            return sliced.access(self, request_id, indices, scope, holder)
        return self.access_at_once(request_id, indices, scope, holder)

    def reads_in_slices(self, request_id: str, indices: Sequence[int] | None,
                        scope: str | None = None) -> bool:
        """Whether a read is done a slice at a time: it names more than a slice's blocks, or
        reads a whole request (None) with more than a slice's not on the device. (A whole
        request on the device is read at once: it is held by request, not block by block.)"""
        if indices is not None:
            return len(indices) > self.slice_blocks
        rt = self.request_index.get(request_id)
        req = None if rt is None else rt.pool.requests.get(request_id)
        return (req is not None and req.state is RequestState.ADMITTED
                and req.num_live_blocks - req.num_device_blocks > self.slice_blocks
                and (scope is None or req.tenant == scope))

    async def access_at_once(self, request_id: str, indices: Sequence[int] | None,
                             scope: str | None = None, holder: str = ""
                             ) -> tuple[list[Block], float, int]:
        """access(), in one go."""
        started = await self.begin_access(request_id, indices, scope, holder)
        stall_s = await started.wait()
        result = started.result
        promoted = len(result.plan.promotions) if result.plan else 0
        blocks = result.blocks if result.blocks is not None else result.request.live_blocks()
        return blocks, stall_s, promoted

    async def begin_access(self, request_id: str, indices: Sequence[int] | None,
                           scope: str | None = None, holder: str = "", wait: bool = True
                           ) -> StartedAccess:
        """An access whose copies may run on while the caller starts others (a Step's
        reads); StartedAccess.wait() finishes it. `wait=False`: NoVictims where it would
        wait for room (see PoolRuntime.begin_access)."""
        _, started = await self._follow(
            request_id, scope, lambda rt: rt.begin_access(request_id, indices, holder, wait))
        return started

    def read_all(self, request_ids: Sequence[str], scope: str | None,
                 key: bytes | None = None
                 ) -> tuple[list[str], list[tuple[Request, int]], list]:
        """A step reads every block of these requests: each pool answers those it can at
        once (see Pool.read_all). Returns the ids left for begin_access (or their error
        there), and the requests read whose blocks moved since the engine was told, with
        their pool's page size, and each pool with the requests it answered (for hold_read).
        `key` identifies request_ids (see Pool.read_all)."""
        general = request_ids
        relocated: list[tuple[Request, int]] = []
        answered = []
        for rt in self.pools.values():
            if rt.line_stalled():
                continue  # its reads join the line: the general path (see RoomLine)
            general, moved, read = rt.pool.read_all(general, scope, key)
            key = None  # the next pool reads what this one left
            if moved:
                relocated += [(req, rt.pool.page_bytes) for req in moved]
            if read:
                answered.append((rt, read))
            if not general:
                break
        return general, relocated, answered

    def read_again(self, key: bytes, count: int, scope: str | None, holder: str) -> bool:
        """A step that reads what the holder's last read (the same `count` ids, `key`) and
        nothing else, answered by the pool that answered all of that one at once, without
        looking at each request again (see Pool.read_again), the holder's last holds ended;
        whether it was: False when its answer no longer holds (read_all then answers it,
        after end_holds)."""
        rt = next(iter(self.pools.values()), None)  # read_all offers it the ids whole
        if rt is None or rt.line_stalled():
            return False
        if len(self.pools) > 1 or not rt.pool.pages.holds.only_requests(holder):
            self.end_holds(holder)  # else the read's holds take the place of the last's
        return rt.pool.read_again(key, count, scope, holder)

    def hold_read(self, answered: list, holder: str) -> None:
        """The requests read_all answered are held for the step's holder until its next
        message: nothing may evict what the engine was told is in place while it reads."""
        for rt, requests in answered:
            rt.pool.hold_read(requests, holder)

    def end_holds(self, holder: str) -> None:
        """The holder called again, or went away: the pages it was handed are evictable (a
        slice of them now, the rest in turns of the loop of their own: see Holds.end)."""
        for rt in self.pools.values():
            holds = rt.pool.pages.holds
            if not holds.has(holder) or holds.end_if_only_requests(holder):
                continue  # nothing left the policy: no room changed
            if rt.pool.end_holds(holder, self.slice_blocks):
                rt.room_may_have_changed()  # for the operations waiting in its room line
            if holds.ending and rt not in self._ending:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # called off the loop (a test's engine): all now
                    while rt.pool.end_more_holds(None):
                        pass
                    rt.room_may_have_changed()
                    continue
                self._ending.add(rt)
                loop.call_soon(self._end_more_holds, rt)

    def answered(self, holder: str) -> None:
        """The holder's call or Step message was answered now: what it holds was handed out
        now, and lasts hold_s from here (Holds.renew). Until then it does not lapse."""
        for rt in self.pools.values():
            rt.pool.pages.holds.renew(holder)

    def _end_more_holds(self, rt: PoolRuntime) -> None:
        """End the next slice of a pool's holds that end a slice at a time, and come back in
        the loop's next turn while some are left."""
        try:
            more = rt.pool.end_more_holds(self.slice_blocks)
            rt.room_may_have_changed()
        except BaseException:
            self._ending.discard(rt)
            raise
        if more:
            asyncio.get_running_loop().call_soon(self._end_more_holds, rt)
        else:
            self._ending.discard(rt)

    def lapse_holds(self, max_age_s: float) -> int:
        """End holds older than max_age_s (a holder that never calls again): liveness over
        the engine's claim on a page it was handed long ago. kvd's own holds (a read's swap
        rounds, a handoff's reads of shared blocks) last until the work ends, which it does."""
        now = self.clock.now()
        stale = {h for rt in self.pools.values()
                 for h, since in rt.pool.pages.holds.since().items()
                 if now - since > max_age_s and h not in self.serving
                 and not h.startswith(OWN_HOLDER)}
        for holder in stale:
            self.end_holds(holder)
        return len(stale)

    async def update_intents(self, changes: Sequence[IntentChange], scope: str | None = None
                             ) -> tuple[int, int]:
        """Apply a batch of intent updates, all or none (see intent_batch.apply)."""
        pinned = [rt.pool.num_pinned for rt in self.pools.values()]
        try:
            return await intent_batch.apply(changes, lambda rid: self.runtime_of(rid, scope))
        finally:
            for rt, before in zip(self.pools.values(), pinned):
                self.unpinned(rt, before)

    def free(self, request_id: str, indices: Sequence[int], scope: str | None = None
             ) -> Awaitable[int]:
        """Give back blocks of a request (more than a slice's worth a slice at a time, see
        sliced); the number freed. (Awaited by the caller, as allocate.)"""
        if len(indices) > self.slice_blocks:
            return sliced.free(self, request_id, indices, scope)
        return self.free_at_once(request_id, indices, scope)

    async def free_at_once(self, request_id: str, indices: Sequence[int],
                           scope: str | None = None) -> int:
        """free(), in one go."""
        pinned = 0

        def free(rt: PoolRuntime) -> int:
            nonlocal pinned
            pinned = rt.pool.num_pinned
            return rt.pool.free(request_id, indices)

        rt, freed = await self._follow(request_id, scope,
                                       lambda rt: rt.run(functools.partial(free, rt)))
        rt.room_may_have_changed()
        self.unpinned(rt, pinned)
        return freed

    async def _follow(self, request_id: str, scope: str | None,
                      call: Callable[[PoolRuntime], Awaitable[T]]) -> tuple[PoolRuntime, T]:
        """call(rt) on the request's pool runtime; returns the runtime and call's result.
        A call that waits out the request's blocks in transit may find a handoff moved the
        request to its target pool meanwhile (a handoff holds the blocks until its copies
        end): it runs again there. (Run again in the pool the request had left, it answered
        NOT_FOUND for a request kvd still held.)"""
        while True:
            rt = self.runtime_of(request_id, scope)
            try:
                return rt, await call(rt)
            except NotFound:
                if self.request_index.get(request_id, rt) is rt:
                    raise  # gone, or never moved: the pool's answer stands

    def unpinned(self, rt: PoolRuntime, before: int) -> None:
        """Pins ended in a pool (an unpin, a pinned block freed): the device pages they
        claimed are room for what waits in its queue, and in the queues that wait for
        handoff reservations there."""
        if rt.pool.num_pinned < before:
            self._room_grew(rt)

    async def release(self, request_id: str, scope: str | None = None
                      ) -> tuple[int, list[Request]]:
        req = None

        def release(rt: PoolRuntime) -> tuple[int, list[Request]]:
            nonlocal req
            req = rt.pool.requests.get(request_id)
            return rt.pool.release(request_id)

        self.runtime_of(request_id, scope)  # NOT_FOUND (or not the caller's) at once
        await self.handoffs.settled(request_id)
        # A long request's blocks, and its uses of many shared blocks, go a slice at a
        # time first (see sliced).
        releasing = self.shared.releasing
        mine = request_id not in releasing  # a second release racing the first: its own
        releasing.add(request_id)
        try:
            freed_first = await sliced.free_down(self, request_id, scope)
            if await sliced.end_uses_down(self, request_id, scope) or freed_first:
                await self.handoffs.settled(request_id)
            rt, (freed, admitted) = await self._follow(
                request_id, scope, lambda rt: rt.run(functools.partial(release, rt)))
        finally:
            if mine:
                releasing.discard(request_id)
        freed += freed_first
        tenant = req.tenant
        rt.room_may_have_changed()
        self._forget(req)
        # Its pages are free, or only reserved ones (a request handed off that grew no
        # block, or freed them all): either way requests queued elsewhere for room here
        # may go now.
        self.handoffs.kick_queues(rt.pool.name)
        rt.waiters.notify()
        self.events.publish("release", pool=rt.pool.name, tenant=tenant,
                            request_id=request_id, count=freed)
        publish_admitted(self.events, rt.pool.name, admitted)
        return freed, admitted

    def _forget(self, req: Request) -> None:
        """A request left its pool (released, or rejected from its queue): its id, its
        lease's hold on it, and a handoff reservation it never used go."""
        request_id = req.request_id
        del self.request_index[request_id]
        if is_remote(req.handoff_pool):  # never handed off: the peer's reservation goes
            self.peers.unreserve(req.handoff_pool, request_id)
        elif req.handoff_pool:  # never handed off: its reservation goes too
            self.handoffs.drop_reservation(req.handoff_pool, request_id)
        self.leases.detach(request_id)

    def _room_grew(self, rt: PoolRuntime) -> None:
        """Admission room grew in a pool without a release (a prefix stored or loaded is
        shared, counted out of its request's working set; a quota changed, see
        settle_queues), or the line's fair order moved (see _order_moved): the pool's
        queue, and the queues whose requests wait for handoff reservations there, go
        again."""
        admitted = rt.pool.admit_waiting() if rt.pool.queue else []
        if admitted:
            rt.waiters.notify()
            publish_admitted(self.events, rt.pool.name, admitted)
        self.handoffs.kick_queues(rt.pool.name)

    def _order_moved(self, rt: PoolRuntime) -> None:
        """A tenant's reserved, queued or kept pages moved in a pool whose requests wait
        (Admission._demand_moved): the fair order of its line may now put at the head a
        request that fits. The line runs again once the operation that moved it is done,
        not in its middle: on the event loop's next turn, before anything else runs there
        (or, called with no loop running, at the end of the node's call, see admit)."""
        self._moved[rt.pool.name] = rt
        if not self._settle_soon:
            try:
                asyncio.get_running_loop().call_soon(self._settle_lines)
            except RuntimeError:
                return
            self._settle_soon = True

    def _settle_lines(self) -> None:
        """Run again the lines whose fair order moved (_order_moved)."""
        try:
            while self._moved:
                _, rt = self._moved.popitem()
                self._room_grew(rt)  # its admissions may move a handoff pool's order
        finally:
            self._settle_soon = False

    def settle_queues(self) -> None:
        """After a quota or policy change: each queued request that can never be admitted
        now is rejected (its WaitAdmission streams and the event feed are told why, see
        rejected_while_queued), and then every pool's queue goes again (_room_grew), once
        the change is in force in all of them: a request waits on its handoff pool's room
        too, and a change applied pool by pool left one whose handoff pool changed after it
        waiting."""
        for rt in self.pools.values():
            rejected = rt.pool.take_never_fitting()
            for req, why in rejected:
                self._forget(req)
                self.rejected[req.request_id] = (req.tenant, why)
                while len(self.rejected) > REJECTED_KEPT:
                    self.rejected.popitem(last=False)
                log.info("queued request rejected", pool=rt.pool.name,
                         request_id=req.request_id, tenant=req.tenant, reason=why)
                self.events.publish("admission", pool=rt.pool.name, tenant=req.tenant,
                                    request_id=req.request_id, count=req.projected_pages,
                                    decision=Decision.REJECTED, reason=why)
            if rejected:
                rt.waiters.notify()
        for rt in self.pools.values():
            self._room_grew(rt)

    def rejected_while_queued(self, request_id: str, scope: str | None = None) -> str | None:
        """Why kvd rejected this request from its queue (settle_queues), if it did lately
        and the caller may know (its tenant's, or the admin's); None otherwise."""
        entry = self.rejected.get(request_id)
        if entry is None or (scope is not None and entry[0] != scope):
            return None
        return entry[1]

    async def expire_forever(self, period_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.handoffs.expire_reservations()
            self.lapse_holds(self.config.hold_s)
            self.check_stuck()
            if self.peers.verdicts and (self._peer_retry is None or self._peer_retry.done()):
                # In a task of its own: a peer that does not answer must not hold up the
                # expiry of holds and reservations here.
                self._peer_retry = asyncio.ensure_future(self.retry_peers())

    async def follow_engine_holdings(self, period_s: float = 1.0) -> None:
        """What the followed engines hold (for the fair order: who holds more on their
        GPUs pays first; and for stats and metrics), walked again every period_s, or less
        often while a walk holds the event loop for more than ENGINE_WALK_SHARE of the time
        between two."""
        while True:
            holdings, spent = await walk_holdings(
                self.engines.residency, [rt.pool.pages.by_hash for rt in self.pools.values()])
            self.engine_holdings = holdings
            for rt in self.pools.values():
                rt.pool.tenancy.engine_held = holdings.gpu_by_tenant
            await asyncio.sleep(max(period_s, spent / ENGINE_WALK_SHARE))

    def handoff(self, request_id: str, target: str = "", scope: str | None = None,
                holder: str = "", lease: str = "") -> AsyncIterator[dict]:
        """Copy a request's blocks to its handoff pool, yielding progress (see
        Handoffs.handoff); the caller may touch only requests of `scope`. `holder`, `lease`:
        the caller's; its own holds (its unary calls' and its lease's Step streams') do
        not hold the copy up."""
        def own(h: str) -> bool:
            return h == holder or (bool(lease) and self.stream_leases.get(h) == lease)

        return self.handoffs.handoff(self.runtime_of(request_id, scope), request_id, target,
                                     holder, own)

    def explain(self, request_id: str, scope: str | None = None) -> Explained:
        """A request's account (active or recently released), its pool, whether active, and
        what shared blocks cost it and its tenant."""
        if not request_id:
            raise InvalidArgument("request_id must not be empty")
        for rt in self.pools.values():
            pool = rt.pool
            account = pool.attribution.account(request_id)
            if account is not None and (scope is None or account.tenant == scope):
                pool = pool.snapshot()
                req = pool.requests.get(request_id)
                active = request_id in pool.attribution.active
                return Explained(
                    account, pool.name, active,
                    pool.prefixes.request_shares(req) if active and req else Shares(),
                    pool.prefixes.tenant_shares(account.tenant))
        raise NotFound(f"kvd knows nothing of request {request_id!r} (never admitted, or "
                       "released long ago)")

    def admission_state(self, request_id: str, scope: str | None = None):
        """(admitted?, queue position, reason, the event that fires on the next change)."""
        rt = self.runtime_of(request_id, scope)
        req = rt.pool.requests[request_id]
        if req.state is RequestState.ADMITTED:
            return True, 0, "", None
        position = rt.pool.admission.queue_position(request_id)
        why = rt.pool.admission.why_waiting(req)
        return False, position, why, rt.waiters.event(request_id, position)

    # ------------------------------------------------------------------ tenants

    def apply_tenants(self, config: Config) -> None:
        """Every pool's quotas from the config (at start and on SIGHUP)."""
        self.quotas.apply(config)
        self.settle_queues()

    def set_quota(self, tenant: str, pool: str, **changes) -> list[str]:
        """Change the given fields of a tenant's quota (see Quotas.set)."""
        pools = self.quotas.set(tenant, self.runtimes(pool), **changes)
        self.settle_queues()
        return pools

    async def evict(self, pool: str, num_pages: int) -> list:
        """The operator's: num_pages victims demoted now; their moves. More than a slice's
        worth are chosen a slice at a time (see sliced)."""
        rt = self.runtime(pool)
        if num_pages > self.slice_blocks:
            return await sliced.evict(self, rt, num_pages)
        # Victims in transit come free when their copies finish: wait for them as any
        # operation that needs room does (not for engines' holds: see Pool.evict).
        plan = await rt.run(lambda: rt.pool.evict(num_pages))
        await rt.execute(plan)
        return plan.demotions

    async def set_policy(self, pool: str, policy: str) -> str:
        rt = self.runtime(pool)
        previous = rt.pool.set_policy(policy)
        self.settle_queues()  # a fair policy's free reserve leaves less for working sets
        log.info("policy changed", pool=rt.pool.name, policy=policy, previous=previous)
        self.events.publish("policy", pool=rt.pool.name, policy=policy, previous=previous)
        return previous

    def check_stuck(self) -> list[str]:
        return self.health.check_stuck()

    @property
    def stuck(self) -> dict[str, list[str]]:
        """What check_stuck() last found, by pool."""
        return self.health.stuck

    async def self_check(self) -> list[str]:
        return await self.health.self_check()

    def index_problems(self) -> list[str]:
        """The node's request index against its pools: each request a pool holds (bar a
        keeper of named blocks, a handoff reservation, and a handoff's target while its
        pages are copied in) is indexed to that pool, and each indexed request is admitted
        or queued there. A request in a pool and not in the index is no one's: no call
        reaches it, nothing releases it, and its id is taken there for good."""
        problems = []
        for name, rt in self.pools.items():
            for request_id, req in rt.pool.requests.items():
                if (req.keeper or req.state is RequestState.RESERVED
                        or self.handoffs.arriving(request_id, rt)):
                    continue
                indexed = self.request_index.get(request_id)
                if indexed is not rt:
                    where = ("not indexed" if indexed is None
                             else f"indexed to {indexed.pool.name!r}")
                    problems.append(f"{name}: request {request_id!r} is in the pool, {where}")
        for request_id, rt in self.request_index.items():
            req = rt.pool.requests.get(request_id)
            if req is None or req.state is RequestState.RESERVED:
                problems.append(f"{rt.pool.name}: request {request_id!r} is indexed to the "
                                "pool, not admitted or queued there")
        return problems

    async def drain(self, timeout_s: float | None = None) -> bool:
        return await self.health.drain(timeout_s)

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
        if self._peer_retry is not None:
            self._peer_retry.cancel()
        await self.engines.aclose()
        # A refill due would start its copies after the links close, into closed arenas.
        refills = [r for rt in self.pools.values() if (r := rt.stop_refills()) is not None]
        if refills:
            _, late = await asyncio.wait(refills,
                                         timeout=max(0.0, deadline - time.monotonic()))
            for refill in late:
                refill.cancel()
        quiet = await self.drain(max(0.0, deadline - time.monotonic()))
        pending = {t for t in self.handoffs.in_flight if not t.done()}
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
        await self.peers.close()
        await asyncio.get_running_loop().run_in_executor(None, self.close)
