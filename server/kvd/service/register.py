"""Registers kvd's servicers from their service descriptors, as the generated
add_*Servicer_to_server does, but with deserializers that never raise: a payload that is not
a valid kvd.v1 message becomes a Malformed marker, which the handlers answer with
INVALID_ARGUMENT (grpc itself would say UNKNOWN). So does a message with a string longer
than MAX_STRING: ids and names are kept, indexed and echoed in errors and events, so their
size is bounded where they enter."""

from __future__ import annotations

import asyncio
import contextlib
import functools

import grpc
import structlog
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from kvd.service.gate import CallGate
from kvd.service.status import status_of

log = structlog.get_logger("kvd.service")

# Characters in any string of a request (request ids, tenant and pool names).
MAX_STRING = 256
# Methods whose handlers check their own strings, and up to what size of message this
# module walks them instead. Both methods' only strings are request ids: UpdateIntents'
# handler checks them a slice at a time (a walk over a large batch would hold the loop), and
# Step's while it reads them anyway (the walk made every id a Python string once more, a
# fifth of an empty Step's cost in the server).
WALK_LIMIT = {"Step": 0, "UpdateIntents": 0}

_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}

# What a stream open when kvd stops is told (UNAVAILABLE): the client's retry policy waits
# for kvd to come back, and what it prints says why.
DRAINING = "kvd is draining"
# How long refuse() waits for a refused stream's first message.
FIRST_MESSAGE_S = 1.0


async def refuse(request, context, code: grpc.StatusCode, message: str,
                 wait_s: float = FIRST_MESSAGE_S):
    """End a call before its handler's work with `code` and `message`. A call whose client
    writes to it (Step, Peer Receive: `request` is the message iterator) is ended after its
    first message comes, or after `wait_s` without one. Ended before it, the client's first
    write crosses the status on the way, and when the status wins, grpc.aio ends the call on
    the client with its own INTERNAL "Internal error from Core" and the status is lost: a
    tenant at max_streams_per_tenant was told so by about 93 refused Step streams in 100,
    and the other 7 got grpc's words. After the first message, the status is what the
    client's next read returns."""
    if hasattr(request, "__anext__"):
        with contextlib.suppress(asyncio.TimeoutError, StopAsyncIteration, grpc.RpcError):
            await asyncio.wait_for(request.__anext__(), wait_s)
    await context.abort(code, message)


class OpenStreams:
    """The streams being served (Step, WatchEvents, WaitAdmission, Handoff). Engines keep a
    Step stream and an events stream open all the time: at a stop, waiting for them to end
    would wait out the whole grace period. drain() ends each with UNAVAILABLE "kvd is
    draining" (their handlers' own clean-up runs as for a client that went away); unary calls
    in flight finish."""

    # A Step stream waiting for its next message when the drain begins is told at that
    # message (an engine in step sends it at once), or after this long without one; a
    # stream that ends itself is ended after this long if it has not.
    LAST_READ_S = 1.0

    def __init__(self, limit: int = 0) -> None:
        self.tasks: set[asyncio.Task] = set()
        # Streams in the middle of a message (a Step being served): drain() lets each finish
        # it and reply; the stream ends when it looks for its next message.
        self.working: set[asyncio.Task] = set()
        # Streams a drain ends at their next message (Step): ended while its client writes
        # one, a stream's client sees grpc's INTERNAL "Internal error from Core", which its
        # retry policy does not retry, instead of UNAVAILABLE "kvd is draining".
        self.told_at_next: set[asyncio.Task] = set()
        # Streams that end themselves at a drain (health watches: after their NOT_SERVING).
        self.end_themselves: set[asyncio.Task] = set()
        self.draining = False
        # At most `limit` streams open per tenant (max_streams_per_tenant; 0: no limit),
        # counted by `owner(context)`: the tenant whose streams a new one counts among, or
        # None for one not counted (Authenticator.stream_owner). A stream past it is
        # refused, not made to wait: the gate's line is never used.
        self.per_tenant = CallGate(limit)
        self.owner = None
        # Why a caller counted as one kvd cannot identify is not (Authenticator.refusal):
        # refused at the limit, a caller with a bad token is told about its token.
        self.refusal = None
        self.refused: dict[str, int] = {}  # tenant -> its streams refused at the limit

    def serve(self, handler):
        @functools.wraps(handler)
        async def served(request, context):
            if self.draining:
                await refuse(request, context, grpc.StatusCode.UNAVAILABLE, DRAINING)
            gate = self.per_tenant
            owner = None if not gate.limit or self.owner is None else self.owner(context)
            if owner is not None and not gate.try_enter(owner):
                self.refused[owner] = self.refused.get(owner, 0) + 1
                why = self.refusal(context) if owner == "" and self.refusal else None
                if why is not None:  # its credentials are what it must fix, not the count
                    await refuse(request, context, status_of(why), str(why))
                who = f"tenant {owner!r} has" if owner else "callers kvd cannot identify have"
                await refuse(
                    request, context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{who} {gate.limit} streams open, the most kvd keeps open for one "
                    f"(max_streams_per_tenant): close one first")
            task = asyncio.current_task()
            self.tasks.add(task)
            try:
                await handler(request, context)
            except asyncio.CancelledError:
                if not self.draining or context.done():
                    raise  # the client went away (or the stream already ended)
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
            except grpc.aio.AbortError:
                raise  # the handler ended the stream with its status
            except Exception as exc:
                await abort_internal(context, handler.__name__, exc)
            finally:
                self.tasks.discard(task)
                if owner is not None:
                    gate.leave(owner)

        return served

    def drain(self) -> int:
        """End every open stream (those working, after their message; idle Step streams, at
        their next message or LAST_READ_S from now); how many there were."""
        self.draining = True
        loop = asyncio.get_running_loop()
        for task in self.tasks - self.working:
            if task in self.told_at_next or task in self.end_themselves:
                loop.call_later(self.LAST_READ_S, self._end_if_idle, task)
            else:
                task.cancel()
        return len(self.tasks)

    async def ended(self, timeout_s: float) -> None:
        """Waits, timeout_s at most, for the streams drain() ended to be done (no stream
        starts after a drain)."""
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout_s)

    def _end_if_idle(self, task: asyncio.Task) -> None:
        if not task.done() and task not in self.working:
            task.cancel()


async def abort_internal(context, method: str, exc: Exception) -> None:
    """End a call that failed inside kvd: INTERNAL, said to be a bug in kvd (never the
    caller's bad argument: input is refused by validation with its own status), its
    traceback logged; the daemon serves on."""
    log.error("a call failed inside kvd", method=method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"kvd failed serving {method}: {type(exc).__name__}: "
                        f"{str(exc)[:200]} (a bug in kvd; its log has the rest)")


class Malformed:
    """A request whose bytes did not decode."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error

    @property
    def message(self) -> str:
        return f"the request is not a valid kvd.v1 message: {self.error}"


def _long_string(message, path: str = "") -> str | None:
    """The path of a string field longer than MAX_STRING, if any."""
    for field, value in message.ListFields():
        kind = field.type
        if kind == _STRING:
            if (max(map(len, value)) if field.is_repeated else len(value)) > MAX_STRING:
                return f"{path}{field.name}"
        elif kind == _MESSAGE:
            if field.message_type.GetOptions().map_entry:
                continue  # event details and the like: not sent by clients
            for item in (value if field.is_repeated else (value,)):
                found = _long_string(item, f"{path}{field.name}.")
                if found:
                    return found
    return None


_STRING, _MESSAGE = FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE


def safe_parser(parse, walk_limit: float = float("inf")):
    """`parse` (a message class's FromString) made to return Malformed instead of raising,
    and for a string longer than MAX_STRING (messages up to walk_limit bytes are walked)."""

    def deserialize(data: bytes):
        try:
            message = parse(data)
        except (DecodeError, ValueError) as exc:
            return Malformed(str(exc))
        # A string over the bound needs that many bytes: short messages are not walked.
        if MAX_STRING < len(data) <= walk_limit and (field := _long_string(message)):
            return Malformed(f"{field} is longer than {MAX_STRING} characters")
        return message

    return deserialize


def _passing_bytes(serialize):
    """A response serializer for a method that also answers with bytes it already has."""

    def serializer(message) -> bytes:
        return message if type(message) is bytes else serialize(message)

    return serializer


def add_service(server: grpc.aio.Server, servicer, service, raw=(),
                streams: OpenStreams | None = None, finish=()) -> None:
    """Serve every method of `service` (a ServiceDescriptor) from `servicer`; the methods
    named in `raw` get each request's bytes, and parse them themselves (with safe_parser),
    and may answer with a reply's bytes;
    its streaming methods' calls are kept in `streams` (ended at a drain), except those
    named in `finish`, which a drain lets finish as it does unary calls."""
    handlers = {}
    for method in service.methods:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        factory = _FACTORIES[(method.client_streaming, method.server_streaming)]
        walk_limit = WALK_LIMIT.get(method.name, float("inf"))
        parse = None if method.name in raw else safe_parser(request.FromString, walk_limit)
        served = getattr(servicer, method.name)
        streaming = method.client_streaming or method.server_streaming
        if streams is not None and streaming and method.name not in finish:
            served = streams.serve(served)
        serialize = (_passing_bytes(response.SerializeToString) if method.name in raw
                     else response.SerializeToString)
        handlers[method.name] = factory(served, request_deserializer=parse,
                                        response_serializer=serialize)
    # Generic handlers only. grpc.aio also takes "registered" method handlers, but with kvd's
    # ~30 methods registered every call cost ~45 us more server CPU (measured with registered
    # and plain callers alike), a sixth of an empty call.
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
