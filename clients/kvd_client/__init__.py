"""Typed Python client for kvd (async and sync), used by engines, kvctl and the load generator."""

from kvd_client.blocking import Client
from kvd_client.client import AsyncClient, RetryPolicy, Tls, default_target
from kvd_client.step_stream import StepStream
from kvd_client.errors import (
    AbortedError,
    AlreadyExistsError,
    DeadlineExceededError,
    DrainingError,
    FailedPreconditionError,
    InvalidArgumentError,
    KvdClientError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UNANSWERED,
    UnavailableError,
)
from kvd_client.session import EngineSession, Recovery
from kvd_api.v1 import kvd_pb2 as pb

__all__ = [
    "AbortedError", "AlreadyExistsError", "AsyncClient", "Client", "DeadlineExceededError", "DrainingError",
    "EngineSession", "Recovery", "RetryPolicy",
    "FailedPreconditionError", "InvalidArgumentError", "KvdClientError", "NotFoundError",
    "PermissionDeniedError", "ResourceExhaustedError", "StepStream", "Tls", "UnauthenticatedError",
    "UNANSWERED", "UnavailableError", "default_target", "pb",
]
