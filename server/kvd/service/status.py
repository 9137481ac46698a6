"""The one table from domain errors to gRPC status codes."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import grpc
import structlog

from kvd.core import errors
from kvd.metrics import observe_rpc
from kvd.service.auth import unprefixed
from kvd.service.register import Malformed

log = structlog.get_logger("kvd.service")

STATUS_OF: dict[type[errors.KvdError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.Aborted: grpc.StatusCode.ABORTED,
}


def status_of(exc: errors.KvdError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL


def local_message(exc: errors.KvdError, caller) -> str:
    """The error as its caller (None: not identified yet) names things."""
    return unprefixed(str(exc), caller.ns if caller is not None else "")


def unary(method: Callable) -> Callable:
    """A unary handler `method(self, request, caller)`: the caller identified once (who, and
    whose lease, which the call renews), the client's call gate passed, domain errors turned
    into their gRPC status, the call timed. Anything else is a bug: reported as INTERNAL by
    grpc, and the daemon serves on."""
    name = method.__name__

    @functools.wraps(method)
    async def handler(self, request, context):
        started = time.perf_counter()
        code = "OK"
        gate = self.gate
        key = turn = None
        in_call = caller = None
        try:
            caller = self.auth.identify(context)
            if caller.lease and self.auth.leases is not None:
                # A client waiting on kvd is not silent: its lease cannot lapse mid-call.
                in_call = self.auth.leases
                in_call.stream_opened(caller.lease, caller.tenant)
            if gate.limit:
                # A client is its lease (the client library sends one), else its address.
                who = caller.lease or context.peer() or "?"
                if not gate.try_enter(who):
                    await gate.wait(who)
                key = who
            turns = getattr(self, "turns", None)
            if (turns is not None and not caller.admin
                    and turns.contended(caller.tenant, time.monotonic())):
                # While tenants compete, a tenant's calls and Step messages share its turns
                # (the operator's calls are not a tenant's and wait for none).
                turn = caller.tenant
                if not turns.gate.try_enter(turn):
                    await turns.gate.wait(turn)
            if type(request) is Malformed:
                raise errors.InvalidArgument(request.message)
            end_holds = getattr(self, "end_holds", None)
            if end_holds is not None:  # the caller is done with what it was handed before
                end_holds(caller.holder)
            return await method(self, request, caller)
        except errors.KvdError as exc:
            status = status_of(exc)
            code = status.name
            await context.abort(status, local_message(exc, caller))
        except (ValueError, OverflowError, TypeError) as exc:
            # Out-of-range values that slipped past validation: the caller's input.
            code = "INVALID_ARGUMENT"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad argument: {exc}")
        finally:
            if in_call is not None:
                in_call.stream_closed(caller.lease)
            if turn is not None:
                self.turns.gate.leave(turn)
            if key is not None:
                gate.leave(key)
            observe_rpc(name, code, time.perf_counter() - started)

    return handler
