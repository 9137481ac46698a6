"""Exceptions for kvd's gRPC status codes: catch the class, read .code and .details."""

from __future__ import annotations

import grpc


class KvdClientError(Exception):
    code = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class InvalidArgumentError(KvdClientError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(KvdClientError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(KvdClientError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhaustedError(KvdClientError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(KvdClientError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDeniedError(KvdClientError):
    code = grpc.StatusCode.PERMISSION_DENIED


class UnauthenticatedError(KvdClientError):
    code = grpc.StatusCode.UNAUTHENTICATED


class UnavailableError(KvdClientError):
    code = grpc.StatusCode.UNAVAILABLE


class DrainingError(UnavailableError):
    """kvd is stopping: it ended this call (an open stream) or refused it. Retryable as any
    UNAVAILABLE: a restarted kvd, or another replica, answers the retry."""


# The message kvd ends open streams with when it drains (kvd.service.register.DRAINING).
DRAINING = "kvd is draining"


class DeadlineExceededError(KvdClientError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class AbortedError(KvdClientError):
    """The operation failed part-way and kvd undid it (a handoff whose copy failed)."""

    code = grpc.StatusCode.ABORTED


# kvd did not answer (gone, or the call timed out): what the call asked may or may not have
# been done.
UNANSWERED = (UnavailableError, DeadlineExceededError)

_BY_CODE = {
    cls.code: cls
    for cls in (InvalidArgumentError, NotFoundError, AlreadyExistsError, ResourceExhaustedError,
                FailedPreconditionError, PermissionDeniedError, UnauthenticatedError,
                UnavailableError, DeadlineExceededError, AbortedError)
}


def from_rpc_error(err: grpc.RpcError) -> KvdClientError:
    return from_status(err.code(), err.details() or "")


def from_status(code: grpc.StatusCode, details: str) -> KvdClientError:
    if code == grpc.StatusCode.UNAVAILABLE and details == DRAINING:
        return DrainingError(DRAINING)
    cls = _BY_CODE.get(code, KvdClientError)
    return cls(details, code)
