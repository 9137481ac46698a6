"""kvd.v1.Memory: the service engines talk to."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from kvd import __version__, sliced, stats
from kvd.core import errors
from kvd.core.blocks import public_id
from kvd.node import Node
from kvd.service import convert
from kvd.service.auth import UNLEASED, Authenticator, Caller
from kvd.service.convert import (
    DECISIONS,
    add_handles_sliced,
    add_shared_handles,
    indices,
    intent_change,
    intent_fields,
)
from kvd.service.gate import CallGate, CallLimits, StepTurns
from kvd.service.register import MAX_STRING, OpenStreams
from kvd.service.step import StepStreams
from kvd.service.streams import Streams
from kvd.service.unary import reads_state, unary
from kvd_api.v1 import kvd_pb2 as pb
from kvd_api.v1 import kvd_pb2_grpc as pb_grpc


class MemoryService(pb_grpc.MemoryServicer):
    # Methods whose handler gets each message's bytes and parses them itself: a Step's bytes
    # tell a repeated read at a glance (see _read_all_start), and an engine's decode step
    # is answered with only its step_id parsed.
    RAW = ("Step",)
    # A handoff in flight is work a drain lets finish (a cut one rolls back): the other
    # streams are ended at once, a Step stream after the message it is serving.
    FINISH_AT_DRAIN = ("Handoff",)

    def __init__(self, node: Node, auth: Authenticator, gate: CallGate | None = None,
                 turns: StepTurns | None = None, streams: OpenStreams | None = None) -> None:
        self.node = node
        self.auth = auth
        self.gate = gate or CallGate(0)
        self.turns = turns or StepTurns(0)
        self.limits = CallLimits(node.config.max_items_per_call,
                                 node.config.max_blocks_per_call)
        self.steps = StepStreams(node, auth, self.turns, self.limits, streams or OpenStreams())
        self.streams = Streams(node, auth)

    def end_holds(self, holder: str) -> None:
        self.node.end_holds(holder)

    def answered(self, holder: str) -> None:
        self.node.answered(holder)

    def adopt(self, request, caller: Caller) -> None:
        """A call that hands out or changes something named a request: one handed off that
        no other client has taken up is the caller's lease's from now on (see
        LeaseTable.adopt). Calls that only read kvd's state (Explain) take up nothing."""
        leases = self.node.leases
        if leases.unclaimed:
            request_id = getattr(request, "request_id", "")
            if request_id:
                leases.adopt((caller.ns + request_id,), caller.lease, caller.tenant)

    def _page_bytes(self, request_id: str) -> int:
        return self.node.runtime_of(request_id).pool.page_bytes

    @unary
    async def Admit(self, request: pb.AdmitRequest, caller: Caller) -> pb.AdmitResponse:
        tenant = request.tenant or caller.tenant or "default"
        errors.check_printable("tenant", tenant)
        if not caller.may_touch(tenant):
            raise errors.PermissionDenied(
                f"caller is tenant {caller.tenant!r}; it cannot admit for {tenant!r}")
        for pool in (request.pool or "default", request.handoff_pool):
            self.node.may_use(pool, tenant)
        if not caller.lease and not caller.admin:
            raise errors.FailedPrecondition(UNLEASED)
        result = await self.node.admit_async(
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
        reply = pb.AllocateResponse(stall_us=int(stall_s * 1e6))
        await add_handles_sliced(reply.handles, blocks, self._page_bytes(rid), ns,
                                 self.node.slice_blocks)
        return reply

    @unary
    async def Access(self, request: pb.AccessRequest, caller: Caller) -> pb.AccessResponse:
        self.limits.check(len(request.block_indices), "block indices", blocks=True)
        rid, ns = caller.ns + request.request_id, len(caller.ns)
        blocks, stall_s, promoted = await self.node.access(rid, indices(request),
                                                             caller.scope, holder=caller.holder)
        reply = pb.AccessResponse(stall_us=int(stall_s * 1e6), num_promoted=promoted)
        # The blocks read that the request still has: one freed by another call while the
        # read waited for its copies is gone (its page with it).
        await add_handles_sliced(reply.handles, blocks, self._page_bytes(rid), ns,
                                 self.node.slice_blocks)
        return reply

    @unary
    @reads_state
    async def Lookup(self, request: pb.LookupRequest, caller: Caller) -> pb.LookupResponse:
        self.limits.check(len(request.keys), "block keys", blocks=True)
        pool = request.pool or "default"
        if not caller.admin:  # an engine with the admin identity serves any tenant
            self.node.may_use(pool, caller.tenant)
        run = self.node.shared.lookup(
            pool, self.auth.prefix_namespace(caller, request.namespace), list(request.keys))
        return pb.LookupResponse(num_hit=len(run), tiers=[int(b.tier) for b in run])

    @unary
    async def Store(self, request: pb.StoreRequest, caller: Caller) -> pb.StoreResponse:
        self.limits.check(len(request.keys), "block keys", blocks=True)
        rid = caller.ns + request.request_id
        blocks, fresh, stall_s = await self.node.shared.store(
            rid, self.auth.prefix_namespace(caller, request.namespace), list(request.keys),
            caller.scope, holder=caller.holder,
            intent=intent_fields(request.intent))
        reply = pb.StoreResponse(fresh=fresh, stall_us=int(stall_s * 1e6))
        await add_shared_handles(reply.handles, blocks, self._page_bytes(rid),
                                 request.request_id, self.node.slice_blocks)
        return reply

    @unary
    async def Commit(self, request: pb.CommitRequest, caller: Caller) -> pb.CommitResponse:
        self.limits.check(len(request.keys), "block keys", blocks=True)
        n = await self.node.shared.commit(
            caller.ns + request.request_id,
            self.auth.prefix_namespace(caller, request.namespace), list(request.keys),
            caller.scope)
        return pb.CommitResponse(num_committed=n)

    @unary
    async def Load(self, request: pb.LoadRequest, caller: Caller) -> pb.LoadResponse:
        self.limits.check(len(request.keys), "block keys", blocks=True)
        rid = caller.ns + request.request_id
        blocks = await self.node.shared.load(rid,
                                             self.auth.prefix_namespace(caller,
                                                                        request.namespace),
                                             list(request.keys), caller.scope,
                                             holder=caller.holder,
                                             intent=intent_fields(request.intent))
        reply = pb.LoadResponse()
        await add_shared_handles(reply.handles, blocks, self._page_bytes(rid),
                                 request.request_id, self.node.slice_blocks)
        return reply

    @unary
    async def UpdateIntents(self, request: pb.UpdateIntentsRequest,
                            caller: Caller) -> pb.UpdateIntentsResponse:
        self.limits.check(len(request.updates), "intent updates")
        scope = caller.scope
        changes = []
        updates = request.updates
        async for _, chunk in sliced.served_slices(updates, 256):
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
        reply = pb.EvictResponse()
        async for _, part in sliced.served_slices(moves, self.node.slice_blocks):
            for m in part:
                reply.evicted.add(
                    # A kept prefix block is no request's: its index is kvd's own record's.
                    request_id=public_id(m.block.request.request_id),
                    block_index=m.block.index if not m.block.request.keeper else 0,
                    to_tier=int(m.dst_tier))
        return reply

    @unary
    @reads_state
    async def ExportPool(self, request: pb.ExportPoolRequest,
                         caller: Caller) -> pb.ExportPoolResponse:
        rt = self.node.runtime(request.pool)
        if not caller.admin:  # the arenas are read and written whole: only its users
            self.node.may_use(rt.pool.name, caller.tenant)
        return convert.pool_export(rt)

    @unary
    @reads_state
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
    @reads_state
    async def Explain(self, request: pb.ExplainRequest, caller: Caller) -> pb.ExplainResponse:
        explained = self.node.explain(caller.ns + request.request_id, caller.scope)
        return convert.explain_response(explained, caller.scope)

    async def WaitAdmission(self, request: pb.WaitAdmissionRequest,
                            context: grpc.aio.ServicerContext) -> None:
        await self.streams.wait_admission(request, context)

    async def Handoff(self, request: pb.HandoffRequest, context: grpc.aio.ServicerContext) -> None:
        await self.streams.handoff(request, context)

    async def WatchEvents(self, request: pb.WatchEventsRequest,
                          context: grpc.aio.ServicerContext) -> None:
        await self.streams.watch_events(request, context)

    async def Step(self, request_iterator: AsyncIterator[bytes],
                   context: grpc.aio.ServicerContext) -> None:
        await self.steps.serve(request_iterator, context)
