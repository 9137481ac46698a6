"""The one table from domain errors to gRPC status codes."""

from __future__ import annotations

import grpc

from kvd.core import errors
from kvd.service.auth import unprefixed

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
