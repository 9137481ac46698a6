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


class DeadlineExceededError(KvdClientError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class AbortedError(KvdClientError):
    """The operation failed part-way and kvd undid it (a handoff whose copy failed)."""

    code = grpc.StatusCode.ABORTED


_BY_CODE = {
    cls.code: cls
    for cls in (InvalidArgumentError, NotFoundError, AlreadyExistsError, ResourceExhaustedError,
                FailedPreconditionError, PermissionDeniedError, UnauthenticatedError,
                UnavailableError, DeadlineExceededError, AbortedError)
}


def from_rpc_error(err: grpc.RpcError) -> KvdClientError:
    code = err.code()
    cls = _BY_CODE.get(code, KvdClientError)
    return cls(err.details() or "", code)
