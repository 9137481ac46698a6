"""kvd.v1.Memory/Step: an engine's forward passes as one stream.

Each message is one engine step (intents, frees, releases, allocations, then reads); its
reply hands out the pages, reports blocks that moved, and lists the items that failed while
the rest of the step went on. What one step hands out stays held until the stream's next
message: the engine's forward pass in between writes and reads those pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from kvd.core import errors
from kvd.core.blocks import by_index
from kvd.core.reads import AccessResult
from kvd.metrics import observe_rpc
from kvd.node import Node
from kvd.service.auth import Authenticator, Caller, unprefixed
from kvd.service.convert import (TOLD, Told, add_handles, add_handles_sliced, indices,
                                 intent_change, intent_fields)
from kvd.service.gate import CallLimits, StepTurns
from kvd.service.register import (DRAINING, MAX_STRING, WALK_LIMIT, Malformed,
                                  OpenStreams, refuse, safe_parser)
from kvd.service.status import status_of
from kvd.waiters import ON_ROOM_WAIT
from kvd_api.v1 import kvd_pb2 as pb

_FIELDS = pb.StepRequest.DESCRIPTOR.fields_by_name
_INTENTS, _FREES, _RELEASES, _ALLOCATIONS, _ACCESSES, _READ_ALL = (
    _FIELDS[name].number
    for name in ("intents", "frees", "releases", "allocations", "accesses", "read_all"))
_READS_ONLY = frozenset({_FIELDS["step_id"].number, _READ_ALL})
# The sections of items that each name a request (request_id).
_SECTIONS = frozenset({_INTENTS, _FREES, _RELEASES, _ALLOCATIONS, _ACCESSES})
# A Step message's bytes parsed (the handler gets them raw, see MemoryService.RAW): the
# StepRequest, or Malformed. Its repeated fields are taken out with a slice (field[:]):
# upb's containers have no __iter__, and a for loop over one ends on an IndexError.
_PARSE = safe_parser(pb.StepRequest.FromString, WALK_LIMIT["Step"])


class _Turn:
    """A tenant's turn at the loop, held by one stream while tenants compete: a tenant's only
    active stream goes on at once; one among several waits its turn."""

    __slots__ = ("turns", "who", "held")

    def __init__(self, turns: StepTurns, who: str) -> None:
        self.turns = turns
        self.who = who
        self.held = False

    async def take(self) -> None:
        """Take one of the tenant's turns (StepTurns.take)."""
        await self.turns.take(self.who)
        self.held = True

    def leave(self) -> None:
        if self.held:
            self.held = False
            self.turns.gate.leave(self.who)


class StepStreams:
    """Serves Step streams for the Memory service."""

    def __init__(self, node: Node, auth: Authenticator, turns: StepTurns,
                 limits: CallLimits, streams: OpenStreams) -> None:
        self.streams = streams
        self.node = node
        node.stepping = streams.working  # the messages the node's deferred work waits for
        self.auth = auth
        self.turns = turns
        self.limits = limits

    async def serve(self, request_iterator, context) -> None:
        try:
            caller = self.auth.identify(context)
        except errors.KvdError as exc:
            await refuse(request_iterator, context, status_of(exc), str(exc))
        node = self.node
        node.leases.stream_opened(caller.lease, caller.tenant)  # an open stream holds it
        holder = f"stream:{id(context)}:{time.monotonic_ns()}"
        node.stream_leases[holder] = caller.lease
        node.end_holds(caller.holder)  # the client's unary calls before are done too
        turn = _Turn(self.turns, caller.tenant or "admin")
        # A step that waits for device room gives its tenant's turn back meanwhile: the
        # room may be held by the tenant's other streams, whose next messages (which end
        # their holds) wait for the turn.
        ON_ROOM_WAIT.set(turn.leave)
        messages = request_iterator.__aiter__()
        generation = self.auth.generation
        streams = self.streams
        task = asyncio.current_task()
        # The read_all bytes of the last message that passed the checks, and its read_all
        # ids (with the caller's namespace): an engine reads the same batch step after step,
        # and its ids are checked and made Python strings once.
        checked = checked_read_all = None
        # Whether the bytes from there on hold nothing but read_all entries (None: not
        # known yet): a message with those and a step_id before them only reads, and its
        # step_id is the one before them.
        checked_reads_only: bool | None = None
        parse = _PARSE
        ns = caller.ns
        streams.told_at_next.add(task)
        self.turns.join(turn.who)
        # What the latest reply told: the engine heard it once it sends again; a stream
        # that ends first has it told again (Told.retell).
        told = Told()
        TOLD.set(told)
        try:
            while (data := await self._next(messages, caller, turn, holder)) is not None:
                told.heard()
                if streams.draining:  # told now: its client has written the message
                    await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
                streams.working.add(task)  # a drain lets this message finish
                reply = None
                if (checked_reads_only and checked_read_all and data.endswith(checked)
                        and _only_step_id(data, start := len(data) - len(checked))
                        and self.auth.generation == generation):
                    # The engine's decode step: a step_id, then the same batch as the last
                    # message read and nothing else. The bytes after the step_id parsed in
                    # the last message, and field by field a message parses as its parts
                    # do; the step_id's own bytes (a tag, then a varint that ends where
                    # the batch begins) are, up to nine varint bytes, a StepResponse with
                    # that step_id, which is the reply. A longer varint is parsed.
                    head = (data[:start] if start <= _ECHOED else
                            _reply_of(parse(data[:start])))
                    if head is not None:
                        started = time.perf_counter()
                        if node.read_again(checked, len(checked_read_all), caller.scope,
                                           holder):
                            reply = head
                if reply is not None:
                    problem = None
                else:
                    step = parse(data)
                    start = None if type(step) is Malformed else _read_all_start(data)
                    key = None if start is None else data[start:]
                    if key is not None and key == checked:
                        problem = self._check(data, step, start)
                        read_all = checked_read_all
                        if checked_reads_only is None and problem is None:
                            checked_reads_only = _reads_only(key)
                    else:
                        problem = self._check(data, step)
                        read_all = step.read_all[:] if problem is None else None
                        if ns and read_all:
                            read_all = [ns + r for r in read_all]
                        checked, checked_read_all = key, read_all
                        checked_reads_only = None
                if problem is not None:
                    await context.abort(*problem)
                if reply is None:
                    if self.auth.generation != generation:  # identities reloaded: still valid?
                        generation = self.auth.generation
                        try:
                            self.auth.identify(context)
                        except errors.KvdError as exc:
                            await context.abort(status_of(exc), str(exc))
                    node.end_holds(holder)
                    started = time.perf_counter()
                    node.serving.add(holder)  # its holds may not lapse while it is served
                    try:
                        reply = await self.step(step, read_all, caller.scope, key, holder, ns)
                    finally:
                        node.serving.discard(holder)
                        node.answered(holder)  # its holds last hold_s from the reply
                    if node.leases.unclaimed and caller.lease:
                        # The requests it names that were handed off are its (adopt).
                        node.leases.adopt(_named(step, read_all, ns), caller.lease,
                                          caller.tenant)
                observe_rpc("Step", "OK", time.perf_counter() - started)
                # The turn goes back before the reply is written: the write needs none, and
                # it waits for as long as the engine does not read (its stream's window
                # full), while the tenant's other streams and calls would wait for the turn.
                turn.leave()
                await context.write(reply)
                streams.working.discard(task)
                if streams.draining:
                    # Told with the answer to its next message, which an engine in step
                    # sends at once: ended while it writes, its client would see grpc's
                    # "Internal error from Core" instead.
                    with contextlib.suppress(asyncio.TimeoutError, StopAsyncIteration):
                        await asyncio.wait_for(messages.__anext__(), streams.LAST_READ_S)
                        told.heard()
                    await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        finally:
            streams.told_at_next.discard(task)
            streams.working.discard(task)
            turn.leave()
            self.turns.part(turn.who)
            told.retell(node.pools)  # its last reply may not have been read
            node.end_holds(holder)
            node.stream_leases.pop(holder, None)
            node.leases.stream_closed(caller.lease)

    async def _next(self, messages, caller: Caller, turn: _Turn, holder: str):
        """The stream's next message (its bytes), or None at its end; while tenants compete,
        returned in one of the tenant's turns (see StepTurns).

        The message is read before the turn is taken, and ends the holds of the last
        before the stream waits for its turn: those holds may be the device room the
        stream that has the turn waits for, and the engine has read what it was handed
        once it sends its next message. (A turn taken before the read would be held while
        the engine computes its next step, and a tenant's streams would queue for turns
        they cannot use yet.)"""
        try:
            message = await messages.__anext__()
        except StopAsyncIteration:
            return None
        if not caller.admin and self.turns.contended(turn.who, time.monotonic()):
            self.node.end_holds(holder)
            await turn.take()
        return message

    def _check(self, data: bytes, step, read_all_start: int | None = None
               ) -> tuple[grpc.StatusCode, str] | None:
        """The status a malformed or oversized message ends the stream with; None when the
        message is sound. `read_all_start`: where its read_all begins, when the bytes from
        there on are those of a message that passed (only the rest is looked at)."""
        if type(step) is Malformed:
            return grpc.StatusCode.INVALID_ARGUMENT, step.message
        limits = self.limits
        try:
            # Fewer bytes hold no longer id.
            if (len(data) if read_all_start is None else read_all_start) > MAX_STRING:
                _check_step_ids(step, read_all_start is None)
            # Fewer bytes can hold no more items or block indices.
            if len(data) > min(limits.max_items, limits.max_blocks):
                items, blocks = _step_items(step)
                limits.check(items, "items (updates, frees, releases, allocations, "
                             "accesses and reads)")
                limits.check(blocks, "block indices", blocks=True)
        except errors.KvdError as exc:
            return status_of(exc), str(exc)
        return None

    async def step(self, step: pb.StepRequest, read_all: list[str],
                   scope: str | None = None, reads_key: bytes | None = None,
                   holder: str = "", ns: str = "") -> pb.StepResponse:
        """One engine step: intents, frees, releases, allocations, accesses, in that order.
        A bad item is reported in `errors`; the rest of the step goes on. `read_all`: the
        step's read_all ids in kvd (each with `ns`, the namespace of the caller's request
        ids, see Caller.ns). `reads_key`, when given, is equal for two steps only when their
        read_all lists are."""
        reply = pb.StepResponse(step_id=step.step_id)
        # Only the sections the step has: most steps are just read_all, and each look at an
        # empty repeated field costs a wrapper object on the hot path.
        present = _sections(step)
        general = None  # read_all's requests left for the general path, once it has run
        if present <= _READS_ONLY:  # nothing comes before read_all: run it now
            general = (self._read_all(read_all, reply, scope, reads_key, len(ns), holder)
                       if present else ())
            if not general:
                return reply
        started = time.perf_counter()
        stalled = await self._writes(step, present, reply, scope, holder, ns)
        if general is None:
            general = (self._read_all(read_all, reply, scope, reads_key, len(ns), holder)
                       if _READ_ALL in present else ())
        items: list = []  # (section, index, request_id, block indices or None)
        if general:
            positions = {rid: i for i, rid in enumerate(read_all)}
            items += [("read_all", positions[rid], rid, None) for rid in general]
        items += [("accesses", i, ns + item.request_id, indices(item))
                  for i, item in enumerate(step.accesses[:] if _ACCESSES in present else ())]
        if items:
            stalled |= await self._reads(items, reply, scope, holder, ns)
        if stalled:
            reply.stall_us = int((time.perf_counter() - started) * 1e6)
        return reply

    async def _writes(self, step: pb.StepRequest, present: set[int], reply: pb.StepResponse,
                      scope: str | None, holder: str, ns: str) -> bool:
        """A step's intents, frees, releases and allocations; whether any of them stalled."""
        node = self.node
        stalled = False
        if _INTENTS in present:
            try:
                await node.update_intents([intent_change(u, ns) for u in step.intents[:]], scope)
            except errors.KvdError as exc:
                _step_error(reply, "intents", 0, exc, ns)
            except Exception as exc:  # a prefetch's copy failed: rolled back
                _copy_failed(reply, "intents", 0, exc)
        for i, item in enumerate(step.frees[:] if _FREES in present else ()):
            try:
                await node.free(ns + item.request_id, item.block_indices[:], scope)
            except errors.KvdError as exc:
                _step_error(reply, "frees", i, exc, ns)
        for i, item in enumerate(step.releases[:] if _RELEASES in present else ()):
            try:
                await node.release(ns + item.request_id, scope)
            except errors.KvdError as exc:
                _step_error(reply, "releases", i, exc, ns)
        for i, item in enumerate(step.allocations[:] if _ALLOCATIONS in present else ()):
            try:
                rid = ns + item.request_id
                blocks, stall_s = await node.allocate(rid, item.num_blocks,
                                                      intent_fields(item.intent), scope,
                                                      holder=holder)
                stalled |= stall_s > 0
                page_bytes = node.runtime_of(rid).pool.page_bytes
                if len(blocks) > node.slice_blocks:
                    await add_handles_sliced(reply.allocated, blocks, page_bytes, len(ns),
                                             node.slice_blocks)
                else:
                    add_handles(reply.allocated, blocks, page_bytes, len(ns))
            except errors.KvdError as exc:
                _step_error(reply, "allocations", i, exc, ns)
            except Exception as exc:  # a victim's copy out failed: rolled back
                _copy_failed(reply, "allocations", i, exc)
        return stalled

    async def _reads(self, items: list, reply: pb.StepResponse, scope: str | None,
                     holder: str, ns: str) -> bool:
        """The reads that need the general access path; whether any of them stalled."""
        stalled = False
        pending = []
        for section, i, rid, idx in items:
            try:
                if self.node.reads_in_slices(rid, idx, scope):
                    stalled = await self._read_many(reply, section, i, rid, idx, scope,
                                                    holder, ns) or stalled
                    continue
                reading = await self.node.begin_access(rid, idx, scope, holder)
                if reading.copying is not None:
                    pending.append((section, i, reading))
                    continue
                stalled = stalled or reading.stall_s > 0
                if reading.result.request.maybe_relocated:
                    _relocated(reply, reading.result, reading.page_bytes, len(ns))
            except errors.KvdError as exc:
                _step_error(reply, section, i, exc, ns)
        for section, i, reading in pending:
            # The copies run concurrently in the worker pool; await them in turn.
            try:
                await reading.wait()
            except Exception as exc:  # a failed copy: the plan was aborted
                _copy_failed(reply, section, i, exc)
                continue
            stalled = True
            _relocated(reply, reading.result, reading.page_bytes, len(ns))
        return stalled

    async def _read_many(self, reply: pb.StepResponse, section: str, i: int, rid: str,
                         idx, scope: str | None, holder: str, ns: str) -> bool:
        """A read of more than a slice's blocks (by index, or a request's with more than a
        slice's to bring in): a slice at a time (Node.access, see sliced), its copies, if
        any, waited for here; the blocks it read whose pages the engine was not told of
        reported. Whether it stalled."""
        try:
            blocks, stall_s, _ = await self.node.access(rid, idx, scope, holder)
        except errors.KvdError:
            raise
        except Exception as exc:  # a failed copy: the plan was aborted
            _copy_failed(reply, section, i, exc)
            return False
        rt = self.node.runtime_of(rid, scope)
        req = rt.pool.requests.get(rid)
        if req is not None and blocks:
            _relocated(reply, AccessResult(blocks, None, req), rt.pool.page_bytes, len(ns))
        return stall_s > 0

    def _read_all(self, request_ids, reply: pb.StepResponse, scope: str | None,
                  key: bytes | None = None, cut: int = 0, holder: str = "") -> list[str]:
        """Answer the requests every pool can read at once (reporting relocated blocks);
        return those that need the general access path (or get an error there). The
        requests answered are held for the holder until its next message: neither this
        step's later reads nor another engine's may evict them while the engine reads."""
        general, relocated, answered = self.node.read_all(request_ids, scope, key)
        for req, page_bytes in relocated:
            _relocated(reply, AccessResult(None, None, req), page_bytes, cut)
        if holder and answered:
            self.node.hold_read(answered, holder)
        return general


def _check_step_ids(step: pb.StepRequest, read_all: bool = True) -> None:
    """Refuse a step naming an id longer than MAX_STRING (ids are kept, indexed and echoed;
    a StepRequest's only strings are its request ids: test_step_ids_are_its_only_strings).
    `read_all`: whether its read_all is looked at too."""
    for field, value in step.ListFields():
        number = field.number
        if number == _READ_ALL:
            long = read_all and max(map(len, value)) > MAX_STRING
        elif number in _SECTIONS:
            long = any(len(item.request_id) > MAX_STRING for item in value)
        else:
            continue
        if long:
            raise errors.InvalidArgument(f"{field.name}: a request_id is longer than "
                                         f"{MAX_STRING} characters")


def _sections(step: pb.StepRequest) -> set[int]:
    """The field numbers of the sections a step has (only those: each look at an empty
    repeated field costs a wrapper object)."""
    return {field.number for field, _ in step.ListFields()}


def _reads_only(key: bytes) -> bool:
    """Whether a message's bytes from its read_all on (see _read_all_start) hold read_all
    entries and nothing else: not even a step_id, which would stand for the message's."""
    return _sections(pb.StepRequest.FromString(key)) == {_READ_ALL}


def _only_step_id(data: bytes, start: int) -> bool:
    """Whether a Step message's bytes before `start` (where the bytes its last message read
    from begin) are one step_id field, or none: its tag, then a varint's bytes (whether the
    varint is a valid one is for the parser to say)."""
    if start == 0:
        return True
    if data[0] != _STEP_ID_TAG:
        return False
    pos = 1
    while pos < start and data[pos] & 0x80:  # the varint's bytes
        pos += 1
    return pos + 1 == start


# The longest step_id field (tag and varint) whose bytes are answered as they came: a
# varint of up to nine bytes holds less than 2**63, and parses whatever its padding; past
# that a varint may overflow, and only the parser says whether it is one.
_ECHOED = 10


def _reply_of(head) -> pb.StepResponse | None:
    """The reply to a decode step whose bytes before its batch parsed to `head` (None when
    they did not)."""
    return None if type(head) is Malformed else pb.StepResponse(step_id=head.step_id)


def _named(step: pb.StepRequest, read_all: list[str] | None, ns: str) -> list[str]:
    """The request ids a step names (in kvd: with the caller's namespace)."""
    return [*(read_all or ()), *(ns + item.request_id for section in (
        step.intents, step.frees, step.releases, step.allocations, step.accesses)
        for item in section[:])]


def _step_items(step: pb.StepRequest) -> tuple[int, int]:
    """A step's items (requests named, updates), and its block indices."""
    items = (len(step.intents) + len(step.releases) + len(step.allocations)
             + len(step.read_all) + len(step.frees) + len(step.accesses))
    return items, (sum(len(f.block_indices) for f in step.frees[:])
                   + sum(len(a.block_indices) for a in step.accesses[:]))


# Fields a Step message's read_all is looked for behind; past them, its steps are checked
# whole (an engine's steps carry a handful of sections before their reads).
_MAX_WALK = 32
_READ_ALL_TAG = (_READ_ALL << 3) | 2  # a length-delimited field 7: one byte
_STEP_ID_TAG = _FIELDS["step_id"].number << 3  # a varint field 1: one byte


def _read_all_start(data: bytes) -> int | None:
    """Where a parsed Step message's read_all begins: the offset of its first read_all
    entry (len(data) when it has none), found by walking the fields before it; None when
    more than _MAX_WALK come first or a tag takes more than one byte.

    Protobuf writes fields in the order of their numbers and read_all's is the highest, so
    an engine's read_all closes its message, and its steps that read the same batch end in
    the same bytes whatever they allocate and free before. The bytes from that offset on
    parse alike wherever they stand, and no read_all entry comes before them: equal bytes
    there, equal read_all."""
    pos, end = 0, len(data)
    try:
        for _ in range(_MAX_WALK):
            if pos >= end:
                return end if pos == end else None
            tag = data[pos]
            if tag == _READ_ALL_TAG:
                return pos
            if tag & 0x80:  # a field numbered over 15: none of StepRequest's
                return None
            pos += 1
            wire = tag & 7
            if wire == 0:  # a varint
                while data[pos] & 0x80:
                    pos += 1
                pos += 1
            elif wire == 2:  # a length, then that many bytes
                length = shift = 0
                while (byte := data[pos]) & 0x80:
                    length |= (byte & 0x7F) << shift
                    shift += 7
                    pos += 1
                pos += 1 + (length | (byte << shift))
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                return None
    except IndexError:
        return None
    return None


def _relocated(reply: pb.StepResponse, result, page_bytes: int, cut: int = 0) -> None:
    """Report accessed blocks whose device page changed since the engine was last told. A
    read of the whole request reports those its `untold` lists, without looking at the
    others (a long request read whole through the general path every step)."""
    req = result.request
    blocks = result.blocks
    whole = blocks is None or len(blocks) == req.num_live_blocks
    if whole:
        moved = sorted((b for b in req.untold if b.epoch != b.seen_epoch), key=by_index)
    else:
        moved = [b for b in blocks if b.epoch != b.seen_epoch]
    if moved:
        add_handles(reply.relocated, moved, page_bytes, cut)
    if whole:
        req.untold.clear()  # each told now, or seen already
        req.maybe_relocated = False


def _copy_failed(reply: pb.StepResponse, section: str, index: int, exc: Exception) -> None:
    """An item whose copy between tiers failed (its plan rolled back, and the failure logged
    where it happened): INTERNAL for that item, and the step goes on."""
    reply.errors.append(pb.StepError(section=section, item_index=index,
                                     code=grpc.StatusCode.INTERNAL.value[0],
                                     message=f"copy failed: {exc}"))


def _step_error(reply: pb.StepResponse, section: str, index: int, exc: errors.KvdError,
                ns: str = "") -> None:
    reply.errors.append(
        pb.StepError(section=section, item_index=index, code=status_of(exc).value[0],
                     message=unprefixed(str(exc), ns))
    )
