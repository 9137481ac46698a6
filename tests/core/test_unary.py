"""The wrapper every unary handler runs in tells the caller's bad input from kvd's own
failure: a domain error is the caller's status; anything else is a bug, said as INTERNAL
(never as the caller's bad argument) and logged whole, and the daemon serves on."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvd.core import errors
from kvd.service.auth import Caller
from kvd.service.gate import CallGate, StepTurns
from kvd.service.unary import unary


class _Aborted(grpc.aio.AbortError):  # what grpc.aio's abort() raises
    pass


class _Context:
    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise _Aborted

    def peer(self) -> str:
        return "unix:test"


class _Auth:
    leases = None

    def identify(self, context) -> Caller:
        return Caller(tenant="t", admin=False, lease=getattr(context, "lease", ""))


class _Service:
    gate = CallGate(0)
    auth = _Auth()

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    @unary
    async def Stats(self, request, caller: Caller):
        raise self.exc


@pytest.mark.parametrize("exc", [ValueError("Value out of range: -10"),
                                 OverflowError("int too big"), TypeError("bad"),
                                 KeyError("pool"), ZeroDivisionError("division by zero")])
async def test_a_failure_inside_kvd_is_internal_not_the_callers_bad_argument(exc):
    context = _Context()
    with pytest.raises(_Aborted):
        await _Service(exc).Stats(object(), context)
    code, details = context.status
    assert code is grpc.StatusCode.INTERNAL
    assert details.startswith(f"kvd failed serving Stats: {type(exc).__name__}")
    assert "bug in kvd" in details


async def test_a_domain_error_is_the_callers_status():
    context = _Context()
    with pytest.raises(_Aborted):
        await _Service(errors.InvalidArgument("num_blocks must be positive")).Stats(
            object(), context)
    assert context.status == (grpc.StatusCode.INVALID_ARGUMENT, "num_blocks must be positive")


class _StreamContext(_Context):
    def done(self) -> bool:
        return False


@pytest.mark.parametrize("exc", [ValueError("Value out of range: 4295120896"),
                                 KeyError("pool")])
async def test_a_stream_that_fails_inside_kvd_ends_internal(exc):
    """Streams (Step, WatchEvents, WaitAdmission, Receive) went out as grpc's UNKNOWN
    'Unexpected <class ...>', and kvd's log said nothing."""
    from kvd.service.register import OpenStreams

    async def Step(request_iterator, context):
        raise exc

    context = _StreamContext()
    with pytest.raises(_Aborted):
        await OpenStreams().serve(Step)(iter(()), context)
    code, details = context.status
    assert code is grpc.StatusCode.INTERNAL
    assert details.startswith(f"kvd failed serving Step: {type(exc).__name__}")


async def test_a_stream_ended_with_its_own_status_keeps_it():
    from kvd.service.register import OpenStreams

    async def Step(request_iterator, context):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad step")

    context = _StreamContext()
    with pytest.raises(_Aborted):
        await OpenStreams().serve(Step)(iter(()), context)
    assert context.status == (grpc.StatusCode.INVALID_ARGUMENT, "bad step")


class _LeasedContext(_Context):
    def __init__(self, lease: str) -> None:
        super().__init__()
        self.lease = lease


class _Blocking:
    """A service whose Stats waits until let go; its tenant competes with another."""

    def __init__(self) -> None:
        self.gate = CallGate(16)
        self.turns = StepTurns(1)
        self.auth = _Auth()
        self.go = asyncio.Event()
        self.running = self.most = 0  # calls inside the handler: now, and at most

    @unary
    async def Stats(self, request, caller: Caller):
        self.running += 1
        self.most = max(self.most, self.running)
        await self.go.wait()
        self.running -= 1
        return "done"


async def test_a_call_cancelled_in_its_tenants_line_gives_back_no_turn_it_never_had():
    """A unary call cancelled while it waited for its tenant's turn gave one back all the
    same: the next call in the line then ran beside the turn's holder, and when both ended
    the gate's count went below zero, which failed the call (KeyError) and leaked its
    client's slot in the call gate."""
    service = _Blocking()
    service.turns.contended("other", time.monotonic())  # another tenant: calls take turns
    holder = asyncio.ensure_future(service.Stats(object(), _LeasedContext("c1")))
    await asyncio.sleep(0.01)
    cancelled = asyncio.ensure_future(service.Stats(object(), _LeasedContext("c2")))
    queued = asyncio.ensure_future(service.Stats(object(), _LeasedContext("c3")))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    await asyncio.sleep(0.01)
    assert service.most == 1  # the next in line still waits for the holder's turn
    service.go.set()
    assert await asyncio.wait_for(holder, 1) == "done"
    assert await asyncio.wait_for(queued, 1) == "done"
    assert not service.turns.gate.busy("t") and not service.turns.members
    assert not any(service.gate.busy(c) for c in ("c1", "c2", "c3"))
