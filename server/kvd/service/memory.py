"""kvd.v1.Memory: the service engines talk to."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from kvd import __version__, stats
from kvd.core import errors
from kvd.events import KINDS
from kvd.metrics import observe_rpc
from kvd.node import Node
from kvd.service import convert
from kvd.service.auth import Authenticator, Caller
from kvd.service.convert import (
    DECISIONS,
    handle,
    indices,
    intent_change,
    intent_fields,
    shared_handle,
)
from kvd.service.gate import CallGate, CallLimits, StepTurns
from kvd.service.register import MAX_STRING, Malformed
from kvd.service.status import local_message, status_of
from kvd.service.step import StepStreams
from kvd.service.unary import unary
from kvd_api.v1 import kvd_pb2 as pb
from kvd_api.v1 import kvd_pb2_grpc as pb_grpc

log = structlog.get_logger("kvd.service")

# Events kvd keeps for one watcher that does not read (about 600 bytes each).
MAX_EVENT_BUFFER = 16384


class MemoryService(pb_grpc.MemoryServicer):
    # Methods whose handler gets (bytes, message) pairs: a Step's bytes tell a repeated
    # read at a glance (see _reads_key).
    WITH_BYTES = ("Step",)

    def __init__(self, node: Node, auth: Authenticator, gate: CallGate | None = None,
                 turns: StepTurns | None = None) -> None:
        self.node = node
        self.auth = auth
        self.gate = gate or CallGate(0)
        self.turns = turns or StepTurns(0)
        self.limits = CallLimits(node.config.max_items_per_call,
                                 node.config.max_blocks_per_call)
        self.steps = StepStreams(node, auth, self.turns, self.limits)
        self.restricted = {p.name: frozenset(p.tenants) for p in node.config.pools
                           if p.tenants}

    def _may_use(self, pool: str, tenant: str) -> None:
        """Pools restricted to tenants (`[[pool]] tenants = [...]`) refuse the others."""
        allowed = self.restricted.get(pool)
        if allowed is not None and tenant not in allowed:
            raise errors.PermissionDenied(f"pool {pool!r} is not open to tenant {tenant!r}")

    def end_holds(self, holder: str) -> None:
        self.node.end_holds(holder)

    def _page_bytes(self, request_id: str) -> int:
        return self.node.runtime_of(request_id).pool.page_bytes

    @unary
    async def Admit(self, request: pb.AdmitRequest, caller: Caller) -> pb.AdmitResponse:
        tenant = request.tenant or caller.tenant or "default"
        if not caller.may_touch(tenant):
            raise errors.PermissionDenied(
                f"caller is tenant {caller.tenant!r}; it cannot admit for {tenant!r}")
        for pool in (request.pool or "default", request.handoff_pool):
            self._may_use(pool, tenant)
        result = self.node.admit(
            caller.ns + request.request_id,
            tenant=tenant,
            lease=caller.lease,
            pool=request.pool,
            prompt_tokens=request.prompt_tokens,
            output_tokens=request.expected_output_tokens,
            priority=request.priority,
            handoff_pool=request.handoff_pool,
        )
        return pb.AdmitResponse(
            decision=DECISIONS[result.decision],
            reason=result.reason,
            queue_position=result.queue_position,
            projected_pages=result.projected_pages,
        )

    @unary
    async def Allocate(self, request: pb.AllocateRequest, caller: Caller) -> pb.AllocateResponse:
        rid, ns = caller.ns + request.request_id, len(caller.ns)
        blocks, stall_s = await self.node.allocate(rid, request.num_blocks,
                                                     intent_fields(request.intent),
                                                     caller.scope, holder=caller.holder)
        page_bytes = self._page_bytes(rid)
        return pb.AllocateResponse(
            handles=[handle(b, page_bytes, ns) for b in blocks], stall_us=int(stall_s * 1e6)
        )

    @unary
    async def Access(self, request: pb.AccessRequest, caller: Caller) -> pb.AccessResponse:
        self.limits.check(len(request.block_indices), "block indices", blocks=True)
        rid, ns = caller.ns + request.request_id, len(caller.ns)
        blocks, stall_s, promoted = await self.node.access(rid, indices(request),
                                                             caller.scope, holder=caller.holder)
        page_bytes = self._page_bytes(rid)
        return pb.AccessResponse(
            handles=[handle(b, page_bytes, ns) for b in blocks],
            stall_us=int(stall_s * 1e6),
            num_promoted=promoted,
        )

    @unary
    async def Lookup(self, request: pb.LookupRequest, caller: Caller) -> pb.LookupResponse:
        self.limits.check(len(request.keys), "block keys", blocks=True)
        pool = request.pool or "default"
        self._may_use(pool, caller.tenant or "default")
        run = self.node.lookup(pool, request.namespace, list(request.keys))
        return pb.LookupResponse(num_hit=len(run), tiers=[int(b.tier) for b in run])

    @unary
    async def Store(self, request: pb.StoreRequest, caller: Caller) -> pb.StoreResponse:
        self.limits.check(len(request.keys), "block keys", blocks=True)
        rid = caller.ns + request.request_id
        blocks, fresh, stall_s = await self.node.store(
            rid, request.namespace, list(request.keys), caller.scope, holder=caller.holder)
        page_bytes = self._page_bytes(rid)
        return pb.StoreResponse(
            handles=[shared_handle(b, page_bytes, request.request_id, i)
                     for i, b in enumerate(blocks)],
            fresh=fresh, stall_us=int(stall_s * 1e6))

    @unary
    async def Commit(self, request: pb.CommitRequest, caller: Caller) -> pb.CommitResponse:
        self.limits.check(len(request.keys), "block keys", blocks=True)
        n = await self.node.commit(caller.ns + request.request_id, request.namespace,
                                   list(request.keys), caller.scope)
        return pb.CommitResponse(num_committed=n)

    @unary
    async def Load(self, request: pb.LoadRequest, caller: Caller) -> pb.LoadResponse:
        self.limits.check(len(request.keys), "block keys", blocks=True)
        rid = caller.ns + request.request_id
        blocks = await self.node.load(rid, request.namespace, list(request.keys),
                                      caller.scope, holder=caller.holder)
        page_bytes = self._page_bytes(rid)
        return pb.LoadResponse(handles=[shared_handle(b, page_bytes, request.request_id, i)
                                        for i, b in enumerate(blocks)])

    @unary
    async def UpdateIntents(self, request: pb.UpdateIntentsRequest,
                            caller: Caller) -> pb.UpdateIntentsResponse:
        self.limits.check(len(request.updates), "intent updates")
        scope = caller.scope
        changes = []
        updates = request.updates
        for start in range(0, len(updates), 256):  # the loop is served between slices
            if start:
                await asyncio.sleep(0)
            chunk = updates[start:start + 256]
            if any(len(u.request_id) > MAX_STRING for u in chunk):
                raise errors.InvalidArgument(
                    f"updates.request_id is longer than {MAX_STRING} characters")
            changes += [intent_change(u, caller.ns) for u in chunk]
        applied, prefetched = await self.node.update_intents(changes, scope)
        return pb.UpdateIntentsResponse(num_applied=applied, num_prefetched=prefetched)

    @unary
    async def Free(self, request: pb.FreeRequest, caller: Caller) -> pb.FreeResponse:
        if not request.block_indices:
            raise errors.InvalidArgument("name at least one block to free")
        self.limits.check(len(request.block_indices), "block indices", blocks=True)
        freed = await self.node.free(caller.ns + request.request_id,
                                       list(request.block_indices), caller.scope)
        return pb.FreeResponse(num_freed=freed)

    @unary
    async def Release(self, request: pb.ReleaseRequest, caller: Caller) -> pb.ReleaseResponse:
        freed, _ = await self.node.release(caller.ns + request.request_id, caller.scope)
        return pb.ReleaseResponse(num_freed=freed)

    @unary
    async def Evict(self, request: pb.EvictRequest, caller: Caller) -> pb.EvictResponse:
        # Victims may belong to any tenant: only the admin identity may ask.
        self.auth.require_admin(caller)
        moves = await self.node.evict(request.pool, request.num_pages)
        return pb.EvictResponse(
            evicted=[
                pb.EvictedBlock(
                    request_id=m.block.request.request_id,
                    block_index=m.block.index,
                    to_tier=int(m.dst_tier),
                )
                for m in moves
            ]
        )

    @unary
    async def ExportPool(self, request: pb.ExportPoolRequest,
                         caller: Caller) -> pb.ExportPoolResponse:
        rt = self.node.runtime(request.pool)
        if not caller.admin:  # the arenas are read and written whole: only its users
            self._may_use(rt.pool.name, caller.tenant)
        tiers = []
        for tier, key in ((pb.TIER_DEVICE, "device"), (pb.TIER_HOST, "host")):
            export = rt.arenas[key].export()
            tiers.append(
                pb.TierExport(
                    tier=tier,
                    backend=export.backend,
                    num_pages=export.num_pages,
                    shm_name=export.shm_name,
                    cuda_ipc_handle=export.cuda_ipc_handle,
                    cuda_device=export.cuda_device,
                    arena_bytes=export.arena_bytes,
                )
            )
        return pb.ExportPoolResponse(pool=rt.pool.name, page_bytes=rt.pool.page_bytes,
                                     tiers=tiers)

    @unary
    async def GetPoolStats(self, request: pb.GetPoolStatsRequest,
                           caller: Caller) -> pb.GetPoolStatsResponse:
        return pb.GetPoolStatsResponse(pools=[convert.pool_stats(stats.pool_figures(self.node, rt))
                                              for rt in self.node.runtimes(request.pool)],
                                       uptime_s=time.time() - self.node.started_at,
                                       version=__version__)

    @unary
    async def KeepAlive(self, request: pb.KeepAliveRequest, caller: Caller) -> pb.KeepAliveResponse:
        # Identifying the caller (in @unary) renewed its lease.
        return pb.KeepAliveResponse(lease_ttl_s=self.node.leases.ttl_s,
                                    leased=bool(caller.lease))

    @unary
    async def Explain(self, request: pb.ExplainRequest, caller: Caller) -> pb.ExplainResponse:
        account, pool, active = self.node.explain(caller.ns + request.request_id,
                                                    caller.scope)
        return convert.explain_response(account, pool, active, caller.scope)

    async def WaitAdmission(self, request: pb.WaitAdmissionRequest,
                            context: grpc.aio.ServicerContext) -> None:
        caller = None
        admitted = False
        try:
            if type(request) is Malformed:
                raise errors.InvalidArgument(request.message)
            caller = self.auth.identify(context)
            rid = caller.ns + request.request_id
            self.node.leases.stream_opened(caller.lease, caller.tenant)  # waiting holds it
            last = None
            while True:
                admitted, position, reason, changed = self.node.admission_state(
                    rid, caller.scope)
                if admitted:
                    await context.write(pb.AdmissionUpdate(decision=pb.DECISION_ADMITTED))
                    return
                if position != last:
                    last = position
                    await context.write(pb.AdmissionUpdate(
                        decision=pb.DECISION_QUEUED, queue_position=position, reason=reason))
                try:
                    await changed.wait()  # woken only when this request's answer changed
                finally:
                    if not changed.is_set():  # cancelled: nothing left waiting for it
                        rt = self.node.request_index.get(rid)
                        if rt is not None:
                            rt.waiters.forget(rid, changed)
        except errors.KvdError as exc:
            await context.abort(status_of(exc), local_message(exc, caller))
        finally:
            # However the stream ended (cancelled while waiting or while writing), a client
            # that stopped waiting no longer wants its still-queued request.
            if caller is not None:
                self.node.leases.stream_closed(caller.lease)
                rt = self.node.request_index.get(rid)
                queued = rt.pool.queue.get(rid) if rt is not None else None
                if not admitted and queued is not None and caller.may_touch(queued.tenant):
                    await self.node.release(rid)
                    log.info("queued request withdrawn", request_id=rid)

    async def Handoff(self, request: pb.HandoffRequest, context: grpc.aio.ServicerContext) -> None:
        started = time.perf_counter()
        code = "OK"
        caller = None
        try:
            if type(request) is Malformed:
                raise errors.InvalidArgument(request.message)
            caller = self.auth.identify(context)
            ns = len(caller.ns)
            if request.target_pool and not caller.admin:
                self._may_use(request.target_pool, caller.tenant)
            self.node.end_holds(caller.holder)  # its calls before are done
            # Closed however this handler ends, a cancel while writing included: the
            # handoff's owner is this call, and a caller that went away rolls it back now.
            async with contextlib.aclosing(self.node.handoff(
                    caller.ns + request.request_id, request.target_pool, caller.scope,
                    caller.holder)) as progress:
                async for p in progress:
                    page_bytes = self.node.runtime(p["pool"]).pool.page_bytes
                    await context.write(pb.HandoffProgress(
                        request_id=p["request_id"][ns:], pool=p["pool"],
                        blocks_done=p["blocks_done"], blocks_total=p["blocks_total"],
                        bytes_done=p["bytes_done"], bytes_total=p["bytes_total"],
                        done=p["done"],
                        handles=[handle(b, page_bytes, ns) for b in p["blocks"] or ()]))
        except errors.KvdError as exc:
            code = status_of(exc).name
            await context.abort(status_of(exc), local_message(exc, caller))
        except Exception as exc:  # the copy failed: rolled back, nothing half-moved
            code = "ABORTED"
            log.error("handoff failed", request_id=request.request_id, error=repr(exc))
            await context.abort(grpc.StatusCode.ABORTED,
                                f"handoff failed and was rolled back: {exc!r}")
        finally:
            observe_rpc("Handoff", code, time.perf_counter() - started)

    async def WatchEvents(self, request: pb.WatchEventsRequest,
                          context: grpc.aio.ServicerContext) -> None:
        try:
            if type(request) is Malformed:
                raise errors.InvalidArgument(request.message)
            caller = self.auth.identify(context)
            if request.buffer > MAX_EVENT_BUFFER:
                raise errors.InvalidArgument(f"buffer is at most {MAX_EVENT_BUFFER} events, "
                                             f"got {request.buffer}")
            unknown = set(request.kinds) - set(KINDS)
            if unknown:
                raise errors.InvalidArgument(f"unknown event kinds {sorted(unknown)}; "
                                             f"choose from {', '.join(KINDS)}")
            tenants = list(request.tenants)
            if not caller.admin:  # a tenant watches its own requests only
                if tenants and tenants != [caller.tenant]:
                    raise errors.PermissionDenied("a tenant may watch only its own events")
                tenants = [caller.tenant]
        except errors.KvdError as exc:
            await context.abort(status_of(exc), str(exc))
        bus = self.node.events
        try:
            sub = bus.subscribe(request.pools, tenants, request.kinds, request.buffer or 1024,
                                owner="" if caller.admin else caller.tenant)
        except errors.KvdError as exc:
            await context.abort(status_of(exc), str(exc))
        generation = self.auth.generation
        ns = len(caller.ns)  # a tenant sees only its own requests' events: their ids unprefixed
        try:
            while True:
                e = await bus.next(sub)
                if self.auth.generation != generation:
                    generation = self.auth.generation
                    try:
                        self.auth.identify(context)
                    except errors.KvdError as exc:
                        await context.abort(status_of(exc), str(exc))
                await context.write(pb.Event(seq=e.seq, time_s=e.at, kind=e.kind, pool=e.pool,
                               tenant=e.tenant, request_id=e.request_id[ns:], count=e.count,
                               detail=convert.redacted(e.detail, caller.scope), lost=e.lost))
        finally:
            bus.unsubscribe(sub)

    async def Step(self, request_iterator: AsyncIterator[tuple[bytes, pb.StepRequest]],
                   context: grpc.aio.ServicerContext) -> None:
        await self.steps.serve(request_iterator, context)
