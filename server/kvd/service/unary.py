"""The wrapper every unary handler runs in: who calls, whose lease it renews, the client's
call gate and the tenant's turn, the caller's earlier holds ended, domain errors turned into
their gRPC status, and the call timed. Handlers get the request and the Caller, and return
the response: they translate, nothing else."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable

import grpc

from kvd.core import errors
from kvd.metrics import observe_rpc
from kvd.service.auth import Caller
from kvd.service.register import Malformed, abort_internal
from kvd.service.status import local_message, status_of

Handler = Callable[[object, object, Caller], Awaitable[object]]


def reads_state(method: Handler) -> Handler:
    """Marks a handler that only reads kvd's state (hands out nothing, changes nothing): the
    caller's holds stay (see unary). An engine may ask such things while it copies into or
    out of the pages it was handed: which kvd answers before it commits, say. (KeepAlive
    ends them: it is how an engine with nothing else to call says it is done.)"""
    method.keeps_holds = True
    return method


def unary(method: Handler) -> Callable:
    """A unary handler `method(self, request, caller)`: the caller identified once (who, and
    whose lease, which the call renews), the client's call gate passed, the caller's earlier
    holds ended (it is done with what it was handed: unless the handler only reads_state),
    domain errors turned into their gRPC status, the call timed. Anything else is a bug:
    reported as INTERNAL, logged, and the daemon serves on."""
    name = method.__name__
    ends_holds = not getattr(method, "keeps_holds", False)

    @functools.wraps(method)
    async def handler(self, request, context):
        started = time.perf_counter()
        code = "OK"
        gate = self.gate
        key = turn = member = None
        in_call = caller = answered = None
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
                # (the operator's calls are not a tenant's and wait for none). Held once
                # take returns: a call cancelled in the line has none to give back.
                member = caller.tenant
                turns.join(member)
                await turns.take(member)
                turn = member
            if type(request) is Malformed:
                raise errors.InvalidArgument(request.message)
            end_holds = getattr(self, "end_holds", None) if ends_holds else None
            if end_holds is not None:  # the caller is done with what it was handed before
                end_holds(caller.holder)
                answered = self.answered
            reply = await method(self, request, caller)
            if caller.lease and ends_holds:
                adopt = getattr(self, "adopt", None)
                if adopt is not None:  # a request handed off is its decode engine's
                    adopt(request, caller)
            return reply
        except errors.KvdError as exc:
            status = status_of(exc)
            code = status.name
            await context.abort(status, local_message(exc, caller))
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            code = "INTERNAL"
            await abort_internal(context, name, exc)
        finally:
            if answered is not None:  # what the call holds lasts hold_s from its reply
                answered(caller.holder)
            if in_call is not None:
                in_call.stream_closed(caller.lease)
            if turn is not None:
                self.turns.gate.leave(turn)
            if member is not None:
                self.turns.part(member)
            if key is not None:
                gate.leave(key)
            observe_rpc(name, code, time.perf_counter() - started)

    return handler
