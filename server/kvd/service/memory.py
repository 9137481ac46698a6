"""kvd.v1.Memory: the service engines talk to."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import grpc
import structlog

from kvd import __version__
from kvd.core import errors
from kvd.core.pool import AccessResult
from kvd.node import Node
from kvd.events import KINDS
from kvd import stats
from kvd.service import convert
from kvd.service.convert import DECISIONS, handle, indices, intent_change, intent_fields
from kvd.metrics import observe_rpc
from kvd.service.auth import Authenticator, namespace, unprefixed
from kvd.service.gate import CallGate, StepTurns
from kvd.service.register import MAX_STRING, WALK_BYTES, Malformed
from kvd.service.status import local_message, status_of, unary
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
        self.max_items = node.config.max_items_per_call
        self.max_blocks = node.config.max_blocks_per_call
        self.restricted = {p.name: frozenset(p.tenants) for p in node.config.pools
                           if p.tenants}

    def _may_use(self, pool: str, tenant: str) -> None:
        """Pools restricted to tenants (`[[pool]] tenants = [...]`) refuse the others."""
        allowed = self.restricted.get(pool)
        if allowed is not None and tenant not in allowed:
            raise errors.PermissionDenied(f"pool {pool!r} is not open to tenant {tenant!r}")

    def _bounded(self, num: int, what: str, blocks: bool = False) -> None:
        """Work per call is bounded: a call with more items than max_items_per_call (or
        block indices than max_blocks_per_call) is refused whole, before any of it is done."""
        limit, key = ((self.max_blocks, "max_blocks_per_call") if blocks
                      else (self.max_items, "max_items_per_call"))
        if num > limit:
            raise errors.InvalidArgument(
                f"{num} {what} in one call; at most {limit} ({key}): split the batch")

    def end_holds(self, holder: str) -> None:
        self.node.end_holds(holder)

    def _page_bytes(self, request_id: str) -> int:
        return self.node.runtime_of(request_id).pool.page_bytes

    @unary
    async def Admit(self, request, caller):
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
    async def Allocate(self, request, caller):
        rid, ns = caller.ns + request.request_id, len(caller.ns)
        blocks, stall_s = await self.node.allocate(rid, request.num_blocks,
                                                     intent_fields(request.intent),
                                                     caller.scope, holder=caller.holder)
        page_bytes = self._page_bytes(rid)
        return pb.AllocateResponse(
            handles=[handle(b, page_bytes, ns) for b in blocks], stall_us=int(stall_s * 1e6)
        )

    @unary
    async def Access(self, request, caller):
        self._bounded(len(request.block_indices), "block indices", blocks=True)
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
    async def UpdateIntents(self, request, caller):
        self._bounded(len(request.updates), "intent updates")
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
    async def Free(self, request, caller):
        if not request.block_indices:
            raise errors.InvalidArgument("name at least one block to free")
        self._bounded(len(request.block_indices), "block indices", blocks=True)
        freed = await self.node.free(caller.ns + request.request_id,
                                       list(request.block_indices), caller.scope)
        return pb.FreeResponse(num_freed=freed)

    @unary
    async def Release(self, request, caller):
        freed, _ = await self.node.release(caller.ns + request.request_id, caller.scope)
        return pb.ReleaseResponse(num_freed=freed)

    @unary
    async def Evict(self, request, caller):
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
    async def ExportPool(self, request, caller):
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
    async def GetPoolStats(self, request, caller):
        runtimes = (
            [self.node.runtime(request.pool)] if request.pool else self.node.pools.values()
        )
        return pb.GetPoolStatsResponse(pools=[convert.pool_stats(stats.pool_figures(self.node, rt))
                                              for rt in runtimes],
                                       uptime_s=time.time() - self.node.started_at,
                                       version=__version__)

    @unary
    async def KeepAlive(self, request, caller):
        # Identifying the caller (in @unary) renewed its lease.
        return pb.KeepAliveResponse(lease_ttl_s=self.node.leases.ttl_s,
                                    leased=bool(caller.lease))

    @unary
    async def Explain(self, request, caller):
        account, pool, active = self.node.explain(caller.ns + request.request_id,
                                                    caller.scope)
        return explain_response(account, pool, active, caller.scope)

    async def WaitAdmission(self, request, context):
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
                            rt.forget_waiter(rid, changed)
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

    async def Handoff(self, request, context):
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
                        done=p["done"], handles=[handle(b, page_bytes, ns) for b in p["blocks"] or ()]))
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

    async def WatchEvents(self, request, context):
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
                               detail=_redacted(e.detail, caller.scope), lost=e.lost))
        finally:
            bus.unsubscribe(sub)

    async def Step(self, request_iterator, context):
        try:
            caller = self.auth.identify(context)
        except errors.KvdError as exc:
            await context.abort(status_of(exc), str(exc))
        leases = self.node.leases
        leases.stream_opened(caller.lease, caller.tenant)  # an open stream holds the lease
        # What one step hands out is held until the stream's next message (the engine's
        # forward pass in between writes and reads those pages).
        holder = f"stream:{id(context)}:{time.monotonic_ns()}"
        node = self.node
        node.end_holds(caller.holder)  # the client's unary calls before are done too
        auth = self.auth
        generation = auth.generation
        turns, who = self.turns, caller.tenant or "admin"
        loop = asyncio.get_running_loop()
        messages = request_iterator.__aiter__()
        turn = False  # holding one of the tenant's turns at the loop
        try:
            while True:
                # A tenant's only active stream reads at once; one among several waits its turn.
                if (not caller.admin and turns.contended(who, time.monotonic())
                        and turns.gate.busy(who)):
                    if not turns.gate.try_enter(who):
                        await turns.gate.wait(who)
                    turn = True
                    read = asyncio.ensure_future(messages.__anext__())

                    def idle() -> None:  # nothing to send yet: the turn goes to another stream
                        nonlocal turn
                        if turn:
                            turn = False
                            turns.gate.leave(who)

                    timer = loop.call_later(turns.IDLE_S, idle)
                    try:
                        data, step = await read
                    except StopAsyncIteration:
                        break
                    finally:
                        timer.cancel()
                        read.cancel()
                else:
                    try:
                        data, step = await messages.__anext__()
                    except StopAsyncIteration:
                        break
                if type(step) is Malformed:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, step.message)
                # Fewer bytes can hold no more items or block indices, nor ids unwalked.
                if len(data) > min(self.max_items, self.max_blocks, WALK_BYTES):
                    try:
                        if len(data) > WALK_BYTES:  # register.py walked the smaller ones
                            _check_step_ids(step)
                        items, blocks = _step_items(step)
                        self._bounded(items, "items (updates, frees, releases, allocations, "
                                      "accesses and reads)")
                        self._bounded(blocks, "block indices", blocks=True)
                    except errors.KvdError as exc:
                        await context.abort(status_of(exc), str(exc))
                if auth.generation != generation:  # identities were reloaded: still valid?
                    generation = auth.generation
                    try:
                        auth.identify(context)
                    except errors.KvdError as exc:
                        await context.abort(status_of(exc), str(exc))
                node.end_holds(holder)
                started = time.perf_counter()
                reply = await self._step(step, caller.scope, _reads_key(data), holder,
                                         caller.ns)
                observe_rpc("Step", "OK", time.perf_counter() - started)
                await context.write(reply)
                if turn:
                    turns.gate.leave(who)
                    turn = False
        finally:
            if turn:
                turns.gate.leave(who)
            node.end_holds(holder)
            leases.stream_closed(caller.lease)

    async def _step(self, step: pb.StepRequest, scope: str | None = None,
                    reads_key: bytes | None = None, holder: str = "", ns: str = ""
                    ) -> pb.StepResponse:
        """One engine step: intents, frees, releases, allocations, accesses, in that order.
        A bad item is reported in `errors`; the rest of the step goes on. `reads_key`, when
        given, is equal for two steps only when their read_all lists are equal. `ns`: the
        namespace of the caller's request ids (see Caller.ns)."""
        node = self.node
        reply = pb.StepResponse(step_id=step.step_id)
        cut = len(ns)
        read_all = [ns + r for r in step.read_all] if ns else step.read_all
        # Only the sections the step has: most steps are just read_all, and each look at an
        # empty repeated field costs a wrapper object on the hot path.
        present = {field.number for field, _ in step.ListFields()}
        general = None  # read_all's requests left for the general path, once it has run
        if present <= _READS_ONLY:  # nothing comes before read_all: run it now
            general = (self._read_all(read_all, reply, scope, reads_key, cut)
                       if present else ())
            if not general:
                return reply
        started = time.perf_counter()
        stalled = False
        if _INTENTS in present:
            try:
                await node.update_intents([intent_change(u, ns) for u in step.intents],
                                            scope)
            except errors.KvdError as exc:
                _step_error(reply, "intents", 0, exc, ns)
        for i, item in enumerate(step.frees if _FREES in present else ()):
            try:
                await node.free(ns + item.request_id, list(item.block_indices), scope)
            except errors.KvdError as exc:
                _step_error(reply, "frees", i, exc, ns)
        for i, item in enumerate(step.releases if _RELEASES in present else ()):
            try:
                await node.release(ns + item.request_id, scope)
            except errors.KvdError as exc:
                _step_error(reply, "releases", i, exc, ns)
        for i, item in enumerate(step.allocations if _ALLOCATIONS in present else ()):
            try:
                rid = ns + item.request_id
                blocks, stall_s = await node.allocate(rid, item.num_blocks,
                                                        intent_fields(item.intent), scope,
                                                        holder=holder)
                stalled |= stall_s > 0
                page_bytes = node.runtime_of(rid).pool.page_bytes
                reply.allocated.extend(handle(b, page_bytes, cut) for b in blocks)
            except errors.KvdError as exc:
                _step_error(reply, "allocations", i, exc, ns)
        items: list = []  # (section, index, request_id, block indices or None)
        if general is None:
            general = (self._read_all(read_all, reply, scope, None, cut)
                       if _READ_ALL in present else ())
        if general:
            positions = {rid: i for i, rid in enumerate(read_all)}
            items += [("read_all", positions[rid], rid, None) for rid in general]
        items += [("accesses", i, ns + item.request_id,
                   None if item.all_blocks else list(item.block_indices))
                  for i, item in enumerate(step.accesses if _ACCESSES in present else ())]
        pending = []
        for section, i, rid, idx in items:
            try:
                reading = await node.begin_access(rid, idx, scope, holder)
                if reading.copying is not None:
                    pending.append((section, i, reading))
                    continue
                stalled = stalled or reading.stall_s > 0
                if reading.result.request.maybe_relocated:
                    _relocated(reply, reading.result, reading.page_bytes, cut)
            except errors.KvdError as exc:
                _step_error(reply, section, i, exc, ns)
        for section, i, reading in pending:
            # The copies run concurrently in the worker pool; await them in turn.
            try:
                await reading.wait()
            except Exception as exc:  # a failed copy: the plan was aborted
                reply.errors.append(pb.StepError(section=section, item_index=i,
                                                 code=grpc.StatusCode.INTERNAL.value[0],
                                                 message=f"copy failed: {exc}"))
                continue
            stalled = True
            _relocated(reply, reading.result, reading.page_bytes, cut)
        if stalled:
            reply.stall_us = int((time.perf_counter() - started) * 1e6)
        return reply

    def _read_all(self, request_ids, reply: pb.StepResponse, scope: str | None,
                  key: bytes | None = None, cut: int = 0) -> list[str]:
        """Answer the requests every pool can read at once (reporting relocated blocks);
        return those that need the general access path (or get an error there)."""
        general, relocated = self.node.read_all(request_ids, scope, key)
        for req, page_bytes in relocated:
            _relocated(reply, AccessResult(None, None, req), page_bytes, cut)
        return general


_FIELDS = pb.StepRequest.DESCRIPTOR.fields_by_name
_INTENTS, _FREES, _RELEASES, _ALLOCATIONS, _ACCESSES, _READ_ALL = (
    _FIELDS[name].number
    for name in ("intents", "frees", "releases", "allocations", "accesses", "read_all"))
_READS_ONLY = frozenset({_FIELDS["step_id"].number, _READ_ALL})


def _check_step_ids(step: pb.StepRequest) -> None:
    ids = itertools.chain((u.request_id for u in step.intents),
                          (r.request_id for r in step.releases),
                          (a.request_id for a in step.allocations), step.read_all,
                          (f.request_id for f in step.frees),
                          (a.request_id for a in step.accesses))
    if any(len(i) > MAX_STRING for i in ids):
        raise errors.InvalidArgument(f"a request_id is longer than {MAX_STRING} characters")


def _step_items(step: pb.StepRequest) -> tuple[int, int]:
    """A step's items (requests named, updates), and its block indices."""
    items = (len(step.intents) + len(step.releases) + len(step.allocations)
             + len(step.read_all) + len(step.frees) + len(step.accesses))
    return items, (sum(len(f.block_indices) for f in step.frees)
                   + sum(len(a.block_indices) for a in step.accesses))


def _reads_key(data: bytes) -> bytes:
    """A Step message's bytes without its step_id (field 1, a varint, which protobuf writes
    first): equal for two steps that differ in nothing else, as an engine's steps that read
    the same batch do. (A message written otherwise only misses the shortcut.)"""
    if data[:1] != b"\x08":
        return data
    end = 1
    while data[end] & 0x80:  # the varint's continuation bytes (the message parsed: complete)
        end += 1
    return data[end + 1:]


def _relocated(reply: pb.StepResponse, result, page_bytes: int, cut: int = 0) -> None:
    """Report accessed blocks whose device page changed since the engine was last told."""
    req = result.request
    blocks = result.blocks if result.blocks is not None else req.live_blocks()
    moved = [b for b in blocks if b.epoch != b.seen_epoch]
    if moved:
        reply.relocated.extend(handle(b, page_bytes, cut) for b in moved)
    if len(blocks) == req.num_live_blocks:
        req.maybe_relocated = False


def _step_error(reply: pb.StepResponse, section: str, index: int, exc: errors.KvdError,
                ns: str = "") -> None:
    reply.errors.append(
        pb.StepError(section=section, item_index=index, code=status_of(exc).value[0],
                     message=unprefixed(str(exc), ns))
    )


def explain_response(account, pool: str, active: bool, scope: str | None = None
                     ) -> pb.ExplainResponse:
    """A request's account; a tenant (scope) sees other tenants' requests by tenant only."""
    def cause(key):
        return pb.Cause(tenant=key[0], request_id=_redact(key[0], key[1], scope))

    return pb.ExplainResponse(
        request_id=_redact(account.tenant, account.request_id, scope),
        tenant=account.tenant,
        pool=pool,
        active=active,
        stall_seconds=account.stall_s,
        num_stalls=account.num_stalls,
        stalls_by_cause=[pb.StallShare(cause=cause(k), stall_seconds=v)
                         for k, v in account.stall_s_by_cause.most_common()],
        evictions_suffered=[pb.EvictionCount(other=cause(k), count=v)
                            for k, v in account.evictions_suffered.most_common()],
        evictions_caused=[pb.EvictionCount(other=cause(k), count=v)
                          for k, v in account.evictions_caused.most_common()],
        num_recomputes=account.num_recomputes,
    )


def _redacted(detail: dict, scope: str | None) -> dict:
    if "cause_request" in detail and scope is not None:
        return {**detail, "cause_request": _redact(detail["cause_tenant"],
                                                   detail["cause_request"], scope)}
    return detail


def _redact(tenant: str, request_id: str, scope: str | None) -> str:
    """A request id as this caller may see it: the admin (None) sees all, whole; a tenant
    sees its own without their namespace and other tenants' not at all."""
    if scope is None:
        return request_id
    return request_id.removeprefix(namespace(scope)) if tenant == scope else ""
