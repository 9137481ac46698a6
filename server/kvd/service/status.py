"""The one table from domain errors to gRPC status codes."""

from __future__ import annotations

import functools
from collections.abc import Callable

import grpc
import structlog

from kvd.core import errors

log = structlog.get_logger("kvd.service")

STATUS_OF: dict[type[errors.KvdError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}


def status_of(exc: errors.KvdError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL


def unary(method: Callable) -> Callable:
    """Turn domain errors raised by a unary handler into their gRPC status; anything else
    is a bug: logged with its traceback and reported as INTERNAL, and the daemon serves on."""

    @functools.wraps(method)
    async def handler(self, request, context):
        try:
            return await method(self, request, context)
        except errors.KvdError as exc:
            await context.abort(status_of(exc), str(exc))
        except (ValueError, OverflowError, TypeError) as exc:
            # Out-of-range values that slipped past validation: the caller's input.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad argument: {exc}")

    return handler
