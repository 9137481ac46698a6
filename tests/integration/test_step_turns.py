"""A tenant's Step streams take turns at kvd's loop while another tenant steps: one of its
streams' steps is served while the others wait, whatever else the tenant has in flight, and
a stream waiting for its engine's next message holds no turn. In-process (a Node, kvd's
StepStreams), so the order is seen, not timed."""

from __future__ import annotations

import asyncio
import time

from kvd.config import Config, PoolConfig
from kvd.node import Node
from kvd.service.auth import Caller
from kvd.service.gate import CallLimits, StepTurns
from kvd.service.register import OpenStreams
from kvd.service.step import StepStreams, _Turn
from kvd.waiters import ON_ROOM_WAIT
from kvd_api.v1 import kvd_pb2 as pb


def _node() -> Node:
    """A node in this process, one pool of 64 device pages."""
    return Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=(
        PoolConfig(model="tiny", page_bytes=4096, device_pages=64, host_pages=64),)))


def _streams(node: Node, turns: StepTurns, auth=None) -> StepStreams:
    return StepStreams(node, auth, turns, CallLimits(1024, 65536), OpenStreams())


async def _messages(n: int):
    for i in range(n):
        step = pb.StepRequest(step_id=i + 1, read_all=["r"])
        yield step.SerializeToString()  # Step handlers get the bytes (MemoryService.RAW)


async def test_a_tenants_streams_take_turns_while_another_tenant_steps():
    node = _node()
    try:
        turns = StepTurns(1)  # one turn per tenant
        streams = _streams(node, turns)
        flooder = Caller(tenant="flood", admin=False)
        assert turns.contended("victim", time.monotonic()) is False  # the victim stepped
        first, second = _Turn(turns, "flood"), _Turn(turns, "flood")
        # The flooder's first stream goes on at once: the tenant has a turn free.
        assert await streams._next(_messages(1).__aiter__(), flooder, first, "h1") is not None
        # Its second stream has a message ready too, but waits while the first has the turn,
        # though the tenant has no unary call in flight.
        waiting = asyncio.ensure_future(
            streams._next(_messages(1).__aiter__(), flooder, second, "h2"))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        first.leave()  # the first stream's reply is written
        assert await asyncio.wait_for(waiting, 1) is not None
        second.leave()
        # The victim, a tenant with one stream, goes on at once whenever it steps.
        victim = _Turn(turns, "victim")
        assert await asyncio.wait_for(streams._next(
            _messages(1).__aiter__(), Caller(tenant="victim", admin=False), victim, "h3"),
            1) is not None
        victim.leave()
        assert not turns.gate.busy("flood") and not turns.gate.busy("victim")
    finally:
        await node.aclose()


async def test_a_tenant_alone_is_not_gated():
    node = _node()
    try:
        turns = StepTurns(1)
        streams = _streams(node, turns)
        caller = Caller(tenant="only", admin=False)
        read = [streams._next(_messages(1).__aiter__(), caller, _Turn(turns, "only"), f"h{i}")
                for i in range(4)]
        # No other tenant steps: all four streams read at once, none holding a turn.
        assert all(m is not None for m in await asyncio.wait_for(asyncio.gather(*read), 1))
        assert not turns.gate.busy("only")
    finally:
        await node.aclose()


class _Inbox:
    """A stream's messages as its engine sends them (put), one awaited at a time."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, step_id: int) -> None:
        step = pb.StepRequest(step_id=step_id, read_all=["r"])
        self.queue.put_nowait((step.SerializeToString(), step))

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.queue.get()


async def test_a_stream_waiting_for_its_next_message_holds_no_turn():
    node = _node()
    try:
        turns = StepTurns(1)
        streams = _streams(node, turns)
        caller = Caller(tenant="a", admin=False)
        turns.contended("b", time.monotonic())  # another tenant steps
        quiet_inbox, quiet = _Inbox(), _Turn(turns, "a")
        # The quiet stream waits for its engine's next step.
        waiting = asyncio.ensure_future(streams._next(quiet_inbox, caller, quiet, "h1"))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        # A busy stream of the same tenant has its message: it takes the turn at once.
        busy_inbox, busy = _Inbox(), _Turn(turns, "a")
        busy_inbox.put(1)
        assert await asyncio.wait_for(streams._next(busy_inbox, caller, busy, "h2"), 1)
        assert busy.held and not quiet.held
        # The quiet stream's message comes while the busy one has the turn: it waits.
        quiet_inbox.put(1)
        await asyncio.sleep(0.01)
        assert not waiting.done()
        busy.leave()
        assert await asyncio.wait_for(waiting, 1) is not None and quiet.held
        quiet.leave()
        assert not turns.gate.busy("a")
    finally:
        await node.aclose()


class _Engine:
    """What StepStreams.serve sees of one engine's stream: its messages (bytes, as
    MemoryService.RAW hands them over), its metadata, and its replies. `reads`: False for
    an engine that never reads its replies, whose stream's writes then never complete."""

    def __init__(self, lease: str, reads: bool = True, served: list | None = None) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.replies: asyncio.Queue = asyncio.Queue()
        self.lease = lease
        self.reads = reads
        self.served = served  # where each reply written is noted (the stream's lease)

    async def messages(self):
        while (data := await self.inbox.get()) is not None:
            yield data

    def send(self, step_id: int) -> None:
        self.inbox.put_nowait(pb.StepRequest(step_id=step_id).SerializeToString())

    def invocation_metadata(self):
        return (("kvd-lease", self.lease),)

    def peer(self) -> str:
        return "unix:"

    async def write(self, reply) -> None:
        if not self.reads:
            await asyncio.Event().wait()  # flow control: the window stays full
        if self.served is not None:
            self.served.append(self.lease.rstrip("0123456789"))
        self.replies.put_nowait(reply)

    async def abort(self, code, message):
        raise AssertionError(f"aborted: {code} {message}")


class _Auth:
    generation = 0

    def identify(self, context) -> Caller:
        return Caller(tenant="a", admin=False, lease=f"a/{context.lease}")


async def test_a_stream_whose_engine_reads_no_replies_holds_no_turn():
    """A step's reply is written after the step gives its turn back: an engine that stops
    reading its replies (its stream's window full, the write waiting for ever) kept its
    tenant's turn, and while tenants competed every other stream and call of the tenant
    waited behind it."""
    node = _node()
    turns = StepTurns(1)
    streams = _streams(node, turns, _Auth())

    async def other_tenant_steps():
        while True:
            turns.contended("b", time.monotonic())
            await asyncio.sleep(0.01)

    deaf, live = _Engine("deaf", reads=False), _Engine("live")
    served = [asyncio.ensure_future(streams.serve(e.messages(), e)) for e in (deaf, live)]
    b = asyncio.ensure_future(other_tenant_steps())
    try:
        await asyncio.sleep(0.02)
        deaf.send(1)
        await asyncio.sleep(0.05)  # its step is served; its reply is never taken
        for step_id in (1, 2, 3):
            live.send(step_id)
            reply = await asyncio.wait_for(live.replies.get(), 2)
            assert reply.step_id == step_id
        assert not turns.gate.busy("a")  # nobody holds a turn while the deaf write waits
    finally:
        b.cancel()
        for task in served:
            task.cancel()
        await asyncio.gather(b, *served, return_exceptions=True)
        await node.aclose()


class _Tenants:
    """Callers whose tenant is their lease's name up to its first digit ("flood3": flood)."""

    generation = 0

    def identify(self, context) -> Caller:
        return Caller(tenant=context.lease.rstrip("0123456789"), admin=False,
                      lease=context.lease)


async def _flood_steps_before_the_victims(per_tenant: int, streams_of_flood: int,
                                          streams_of_victim: int = 1) -> int:
    """How many of a flooding tenant's steps kvd serves before another tenant's, when the
    flood's messages (one on each of its streams) came just before the other's message (on
    the first of its streams; the others stay open and quiet)."""
    node = _node()
    turns = StepTurns(per_tenant)
    streams = _streams(node, turns, _Tenants())
    order: list[str] = []
    flood = [_Engine(f"flood{i}", served=order) for i in range(streams_of_flood)]
    victims = [_Engine(f"victim{i}", served=order) for i in range(streams_of_victim)]
    served = [asyncio.ensure_future(streams.serve(e.messages(), e))
              for e in (*flood, *victims)]
    try:
        victim = victims[0]
        victim.send(1)
        await asyncio.wait_for(victim.replies.get(), 2)  # the victim steps: tenants compete
        order.clear()
        for engine in flood:
            engine.send(1)
        victim.send(2)
        await asyncio.wait_for(victim.replies.get(), 2)
        return order.index("victim")
    finally:
        for task in served:
            task.cancel()
        await asyncio.gather(*served, return_exceptions=True)
        await node.aclose()
        assert not turns.members and not turns.gate.busy("flood")


async def test_a_flood_of_ready_steps_does_not_go_ahead_of_another_tenants_step():
    """A Step message whose step never waits is served whole in one turn of kvd's loop, in
    the order the messages came: a tenant with a message ready on each of 16 streams put 16
    steps ahead of another tenant's step, whatever its turns. While tenants compete, a step
    that takes its tenant's turn at once lets the loop serve what is ready before it is
    served: the tenant's other streams wait in its line, and another tenant's step waits for
    at most the turns in progress, or for none when it is all its tenant has open."""
    assert await _flood_steps_before_the_victims(0, 16) == 16  # no turns: arrival order
    assert await _flood_steps_before_the_victims(1, 16) == 0
    assert await _flood_steps_before_the_victims(4, 16) == 0
    # A victim with a second stream open holds its turn over a pass too.
    assert await _flood_steps_before_the_victims(1, 16, 2) == 1
    assert await _flood_steps_before_the_victims(4, 16, 2) == 4


async def test_a_copy_that_fails_under_a_steps_allocation_is_that_items_error():
    # A step allocates a block for which kvd must first demote a victim, and the copy
    # fails (a device error, say). The plan is rolled back; the step reports the item, as
    # it reports a read whose copy failed, and goes on: the engine's stream is not ended
    # with gRPC's UNKNOWN for one copy, and the victim keeps its page and bytes.
    node = Node(Config(socket="", tcp="127.0.0.1:0", metrics="", inline_copy_bytes=0,
                       pools=(PoolConfig(model="tiny", device_pages=4, host_pages=8,
                                         policy="lru", admission="reservation"),)))
    try:
        streams = StepStreams(node, None, StepTurns(1), CallLimits(1024, 65536),
                              OpenStreams())
        rt = node.pools["default"]
        for rid in ("a", "b"):
            node.admit(rid, tenant="t", pool="", prompt_tokens=16, output_tokens=0,
                       priority=0)
        blocks, _ = await node.allocate("a", 4)
        device = rt.arenas["device"].pages
        for b in blocks:
            device[b.page] = b.index + 1
        copy, failures = rt.copier.copy_runs, []

        def failing_once(*args, **kwargs):
            if not failures:
                failures.append(1)
                raise OSError("injected copy failure")
            return copy(*args, **kwargs)

        rt.copier.copy_runs = failing_once
        step = pb.StepRequest(step_id=1, allocations=[pb.AllocateRequest(request_id="b",
                                                                         num_blocks=1)])
        reply = await streams.step(step, [], None, None, "engine-b")
        assert failures  # the copy was tried, and failed
        (error,) = reply.errors
        assert (error.section, error.item_index) == ("allocations", 0)
        assert error.code == 13 and "injected copy failure" in error.message  # INTERNAL
        assert not reply.allocated and not node.pools["default"].pool.requests["b"].live
        again = await streams.step(pb.StepRequest(step_id=2, allocations=step.allocations),
                                   [], None, None, "engine-b")
        assert not again.errors and len(again.allocated) == 1
        node.end_holds("engine-b")  # the engine's next message
        await asyncio.wait_for(node.access("a", None), timeout=5)
        for b in node.pools["default"].pool.requests["a"].live:
            assert (device[b.page] == b.index + 1).all(), f"a's block {b.index}"
        assert await node.self_check() == []
    finally:
        await node.aclose()


async def test_a_release_waiting_for_a_handoff_gives_its_streams_turn_back():
    """A step that releases a request whose handoff is under way waits for the handoff to
    end (it then acts wherever the request is), which takes as long as the copies do; the
    tenant's turn goes back meanwhile, as it does while a step waits for room, so its other
    streams step on."""
    node = _node()
    try:
        turns = StepTurns(1)
        streams = _streams(node, turns)
        flooder = Caller(tenant="flood", admin=False)
        node.admit("r", tenant="flood", pool="default", prompt_tokens=16, output_tokens=0,
                   priority=0)
        # A handoff of r under way until `copied` is set (the task Handoffs.handoff keeps).
        copied = asyncio.Event()
        handoff = node.handoffs._handing_off["r"] = asyncio.ensure_future(copied.wait())
        handoff.add_done_callback(lambda _: node.handoffs._handing_off.pop("r"))
        turns.contended("victim", time.monotonic())  # another tenant steps
        first, second = _Turn(turns, "flood"), _Turn(turns, "flood")
        assert await streams._next(_messages(1).__aiter__(), flooder, first, "h1") is not None

        async def releasing_step():  # as StepStreams.serve runs it, its turn held
            ON_ROOM_WAIT.set(first.leave)
            return await streams.step(pb.StepRequest(
                step_id=1, releases=[pb.ReleaseRequest(request_id="r")]), [], "flood",
                holder="h1")

        step = asyncio.ensure_future(releasing_step())
        other = asyncio.ensure_future(
            streams._next(_messages(1).__aiter__(), flooder, second, "h2"))
        assert await asyncio.wait_for(other, 1) is not None  # stepped while r's waits
        assert not step.done()
        copied.set()
        reply = await asyncio.wait_for(step, 1)
        assert not reply.errors and "r" not in node.request_index
        second.leave()
        assert not turns.gate.busy("flood")
    finally:
        await node.aclose()
