"""A tenant's Step streams take turns at kvd's loop while another tenant steps: one of its
streams reads its next message while the others wait, whatever else the tenant has in flight.
In-process (a Node, kvd's StepStreams), so the order is seen, not timed."""

from __future__ import annotations

import asyncio
import time

from kvd.config import Config, PoolConfig
from kvd.node import Node
from kvd.service.auth import Caller
from kvd.service.gate import CallLimits, StepTurns
from kvd.service.register import OpenStreams
from kvd.service.step import StepStreams, _Turn
from kvd_api.v1 import kvd_pb2 as pb


async def _messages(n: int):
    for i in range(n):
        step = pb.StepRequest(step_id=i + 1, read_all=["r"])
        yield step.SerializeToString(), step


async def test_a_tenants_streams_take_turns_while_another_tenant_steps():
    node = Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=(
        PoolConfig(model="tiny", page_bytes=4096, device_pages=64, host_pages=64),)))
    try:
        turns = StepTurns(1)  # one turn per tenant
        streams = StepStreams(node, None, turns, CallLimits(1024, 65536), OpenStreams())
        flooder = Caller(tenant="flood", admin=False)
        assert turns.contended("victim", time.monotonic()) is False  # the victim stepped
        first, second = _Turn(turns, "flood"), _Turn(turns, "flood")
        # The flooder's first stream reads at once: the tenant has a turn free.
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
        # The victim, a tenant with one stream, reads at once whenever it steps.
        victim = _Turn(turns, "victim")
        assert await asyncio.wait_for(streams._next(
            _messages(1).__aiter__(), Caller(tenant="victim", admin=False), victim, "h3"),
            1) is not None
        victim.leave()
        assert not turns.gate.busy("flood") and not turns.gate.busy("victim")
    finally:
        await node.aclose()


async def test_a_tenant_alone_is_not_gated():
    node = Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=(
        PoolConfig(model="tiny", page_bytes=4096, device_pages=64, host_pages=64),)))
    try:
        turns = StepTurns(1)
        streams = StepStreams(node, None, turns, CallLimits(1024, 65536), OpenStreams())
        caller = Caller(tenant="only", admin=False)
        read = [streams._next(_messages(1).__aiter__(), caller, _Turn(turns, "only"), f"h{i}")
                for i in range(4)]
        # No other tenant steps: all four streams read at once, none holding a turn.
        assert all(m is not None for m in await asyncio.wait_for(asyncio.gather(*read), 1))
        assert not turns.gate.busy("only")
    finally:
        await node.aclose()
