"""The Memory service's server streams other than Step: a queued request waiting for its
admission (WaitAdmission), a handoff's progress (Handoff), and the event feed (WatchEvents).
Each checks its caller once at the start; the streams outlive a unary call, so each also
says what happens when its caller goes away."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import structlog

from kvd.core import errors
from kvd.events import KINDS
from kvd.metrics import observe_rpc
from kvd.node import Node
from kvd.runtime import find_runtime
from kvd.service import convert
from kvd.service.auth import Authenticator
from kvd.service.convert import add_handles
from kvd.service.register import Malformed
from kvd.service.status import local_message, status_of
from kvd_api.v1 import kvd_pb2 as pb

log = structlog.get_logger("kvd.service")

# Events kvd keeps for one watcher that does not read (about 600 bytes each).
MAX_EVENT_BUFFER = 16384
# The header a WatchEvents stream opens with once its watcher is subscribed.
SUBSCRIBED = "kvd-subscribed"


class Streams:
    """WaitAdmission, Handoff and WatchEvents for the Memory service."""

    def __init__(self, node: Node, auth: Authenticator) -> None:
        self.node = node
        self.auth = auth

    async def wait_admission(self, request: pb.WaitAdmissionRequest,
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
                rejected = self.node.rejected_while_queued(rid, caller.scope)
                if rejected is not None:  # it could never be admitted any more
                    await context.write(pb.AdmissionUpdate(decision=pb.DECISION_REJECTED,
                                                           reason=rejected))
                    return
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

    async def handoff(self, request: pb.HandoffRequest, context: grpc.aio.ServicerContext) -> None:
        started = time.perf_counter()
        code = "OK"
        caller = None
        answered = False
        try:
            if type(request) is Malformed:
                raise errors.InvalidArgument(request.message)
            caller = self.auth.identify(context)
            ns = len(caller.ns)
            if request.target_pool:
                # The request's tenant, whoever asks: the admin may not put a request in a
                # pool its tenant may not use (Admit holds it to that too).
                rid = caller.ns + request.request_id
                tenant = (caller.tenant if not caller.admin
                          else self.node.runtime_of(rid).pool.requests[rid].tenant)
                self.node.may_use(request.target_pool, tenant)
            self.node.end_holds(caller.holder)  # its calls before are done
            # Closed however this handler ends, a cancel while writing included: the
            # handoff's owner is this call, and a caller that went away rolls it back now.
            async with contextlib.aclosing(self.node.handoff(
                    caller.ns + request.request_id, request.target_pool, caller.scope,
                    caller.holder, caller.lease)) as progress:
                async for p in progress:
                    # A peer's pool (PEER/POOL): its handles are the peer's to give.
                    page_bytes = (0 if "/" in p["pool"]
                                  else self.node.runtime(p["pool"]).pool.page_bytes)
                    reply = pb.HandoffProgress(
                        request_id=p["request_id"][ns:], pool=p["pool"],
                        blocks_done=p["blocks_done"], blocks_total=p["blocks_total"],
                        bytes_done=p["bytes_done"], bytes_total=p["bytes_total"],
                        done=p["done"])
                    # Those the request still has: a release or a free that waited for the
                    # copies runs as soon as they end, before this is written.
                    add_handles(reply.handles, p["blocks"] or (), page_bytes, ns)
                    if p["done"]:  # what it hands out lasts hold_s from here
                        self.node.answered(caller.holder)
                        answered = True
                    await context.write(reply)
        except errors.KvdError as exc:
            code = status_of(exc).name
            await context.abort(status_of(exc), local_message(exc, caller))
        except Exception as exc:  # the copy failed: rolled back, nothing half-moved
            code = "ABORTED"
            log.error("handoff failed", request_id=request.request_id, error=repr(exc))
            await context.abort(grpc.StatusCode.ABORTED,
                                f"handoff failed and was rolled back: {exc!r}")
        finally:
            if caller is not None and not answered:
                # Ended before its last message (the caller went away, or the copy failed),
                # which may have committed meanwhile and held the blocks it was to hand
                # out: those last hold_s from now, as a unary call's do from its end.
                self.node.answered(caller.holder)
            observe_rpc("Handoff", code, time.perf_counter() - started)

    async def watch_events(self, request: pb.WatchEventsRequest,
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
            for pool in request.pools:  # a pool it does not have names no event, ever
                find_runtime(self.node.pools, pool)
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
        scope = caller.scope  # a tenant sees only its own requests' events (convert.shown_id)
        try:
            # Headers now, before any event: they tell the watcher it is subscribed (every
            # event from here on reaches it, or a gap event counts it).
            await _send_headers(context, ((SUBSCRIBED, "1"),))
            while True:
                e = await bus.next(sub)
                if self.auth.generation != generation:
                    generation = self.auth.generation
                    try:
                        self.auth.identify(context)
                    except errors.KvdError as exc:
                        await context.abort(status_of(exc), str(exc))
                await context.write(pb.Event(
                    seq=e.seq, time_s=e.at, kind=e.kind, pool=e.pool, tenant=e.tenant,
                    request_id=convert.shown_id(e.tenant, e.request_id, scope), count=e.count,
                    detail=convert.redacted(e.detail, scope), lost=e.lost))
        finally:
            bus.unsubscribe(sub)


async def _send_headers(context: grpc.aio.ServicerContext, metadata) -> None:
    """Send the stream's headers, finishing the send even when the handler is cancelled
    meanwhile (a drain, the client gone): grpc takes headers whose send was cancelled for
    unsent, and sends them again with the status kvd then ends the stream with, which the
    call refuses; the status never goes and the caller waits for ever."""
    send = asyncio.ensure_future(context.send_initial_metadata(metadata))
    try:
        await asyncio.shield(send)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # failed: the stream is gone already
            await send
        raise
