"""The one table from domain errors to gRPC status codes."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import grpc
import structlog

from kvd.core import errors
from kvd.metrics import observe_rpc
from kvd.service.gate import client_key
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


def unary(method: Callable) -> Callable:
    """Turn domain errors raised by a unary handler into their gRPC status (and time it);
    anything else is a bug: reported as INTERNAL by grpc, and the daemon serves on."""
    name = method.__name__

    @functools.wraps(method)
    async def handler(self, request, context):
        started = time.perf_counter()
        code = "OK"
        gate = self.gate
        key = None
        if gate.limit:
            key = client_key(context)
            await gate.enter(key)
        try:
            if type(request) is Malformed:
                raise errors.InvalidArgument(request.message)
            return await method(self, request, context)
        except errors.KvdError as exc:
            status = status_of(exc)
            code = status.name
            await context.abort(status, str(exc))
        except (ValueError, OverflowError, TypeError) as exc:
            # Out-of-range values that slipped past validation: the caller's input.
            code = "INVALID_ARGUMENT"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad argument: {exc}")
        finally:
            if key is not None:
                gate.leave(key)
            observe_rpc(name, code, time.perf_counter() - started)

    return handler
