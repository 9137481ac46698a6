"""WatchEvents: ordered, numbered, filtered; a stalled watcher loses events (and is told how
many) without slowing kvd down."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kvd.config import Config, PoolConfig
from kvd.node import Node
from kvd.service.auth import Caller
from kvd.service.register import OpenStreams
from kvd.service.streams import Streams
from kvd_api.v1 import kvd_pb2_grpc as pb_grpc
from kvd_client import AsyncClient, pb


async def _collect(client, n, subscribed: asyncio.Event, **filters):
    events = []
    async for event in client.watch_events(on_subscribed=subscribed.set, **filters):
        events.append(event)
        if len(events) == n:
            return events


async def test_events_arrive_in_order_without_gaps(kvd):
    async with AsyncClient(kvd.target) as client:
        subscribed = asyncio.Event()
        watcher = asyncio.ensure_future(_collect(client, 3 * 3 + 1, subscribed))
        await asyncio.wait_for(subscribed.wait(), 10)
        for rid in ("a", "b", "c"):  # admit, allocate, (read,) release: 3 events each
            await client.admit(rid, 64, tenant="t")
            await client.allocate(rid, 4)
            await client.access(rid)
            await client.release(rid)
        await client.set_policy("fair")
        events = await asyncio.wait_for(watcher, 10)
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps
    kinds = [e.kind for e in events]
    assert kinds[:3] == ["admission", "allocation", "release"]
    assert kinds.count("admission") == 3 and kinds[-1] == "policy"
    assert events[0].detail["decision"] == "admitted" and events[1].count == 4


async def test_filters_by_kind_and_tenant(kvd):
    async with AsyncClient(kvd.target) as client:
        subscribed = asyncio.Event()
        watcher = asyncio.ensure_future(_collect(client, 2, subscribed, kinds=["eviction"],
                                                 tenants=["m"]))
        await asyncio.wait_for(subscribed.wait(), 10)
        await client.admit("minnow", 32, tenant="m")
        await client.allocate("minnow", 2)
        await client.admit("whale", 16 * 8, tenant="w")
        await client.allocate("whale", 8)  # evicts the minnow's 2 pages
        await client.admit("other", 16, tenant="w")
        await client.allocate("other", 1)  # evicts a whale page: filtered out
        await client.access("minnow")  # evicts whale pages: filtered out
        await client.release("whale")
        await client.admit("whale2", 16 * 8, tenant="w")
        await client.allocate("whale2", 8)  # evicts the minnow again
        events = await asyncio.wait_for(watcher, 10)
    assert all(e.kind == "eviction" and e.tenant == "m" for e in events)
    assert events[0].detail["cause_request"] == "whale" and events[0].count == 2


async def test_a_watch_of_a_pool_kvd_does_not_have_is_refused_at_once(kvd):
    # A typo in a pool name watched in silence for ever: no event ever names it.
    from kvd_client import NotFoundError

    async with AsyncClient(kvd.target) as client:
        with pytest.raises(NotFoundError, match="no pool 'defualt'; this kvd has default"):
            await asyncio.wait_for(anext(client.watch_events(pools=["default", "defualt"])),
                                   5)


async def test_a_watcher_told_it_is_subscribed_sees_the_next_event(kvd):
    # Told by the stream's headers, a watcher need not sleep and hope: the admission made
    # the moment it is told is its first event, every time.
    async with AsyncClient(kvd.target) as client:
        for i in range(20):
            subscribed = asyncio.Event()
            events = client.watch_events(kinds=["admission"], on_subscribed=subscribed.set)
            first = asyncio.ensure_future(anext(events))
            await asyncio.wait_for(subscribed.wait(), 10)
            await client.admit(f"s{i}", 16)
            assert (await asyncio.wait_for(first, 10)).request_id == f"s{i}"
            await events.aclose()
            await client.release(f"s{i}")


async def test_a_refused_watch_is_never_told_it_is_subscribed(kvd):
    from kvd_client import InvalidArgumentError

    told = []
    async with AsyncClient(kvd.target) as client:
        with pytest.raises(InvalidArgumentError, match="unknown event kinds"):
            await asyncio.wait_for(anext(client.watch_events(
                kinds=["admision"], on_subscribed=lambda: told.append(1))), 5)
    assert told == []


async def test_a_stalled_watcher_gets_a_gap_marker_and_kvd_stays_fast(kvd):
    # A really stuck reader: no window growth, a 1 KiB stream window, so kvd's sends back up
    # into its own bounded buffer almost at once.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    async with AsyncClient(kvd.target) as client, \
            grpc.aio.insecure_channel(kvd.target, options=options) as channel:
        call = pb_grpc.MemoryStub(channel).WatchEvents(
            pb.WatchEventsRequest(kinds=["admission", "release"], buffer=16))
        stream = call.__aiter__()
        first = asyncio.ensure_future(stream.__anext__())
        # One admission after another until the watcher has its first: it is told only what
        # happens once kvd has its call, which on a busy machine can come after the first
        # admission on the client's own connection.
        for i in range(200):
            await client.admit(f"w{i}", 16)
            await client.release(f"w{i}")
            done, _ = await asyncio.wait({first}, timeout=0.05)
            if done:
                break
        await asyncio.wait_for(first, 10)
        # The watcher now reads nothing while kvd publishes thousands of events.
        latencies = []
        for i in range(1500):
            t0 = time.perf_counter()
            await client.admit(f"x{i + 1}", 16)
            latencies.append(time.perf_counter() - t0)
            await client.release(f"x{i + 1}")
        latencies.sort()
        assert latencies[len(latencies) // 2] < 0.01  # p50 of an Admit while it lags
        # Read from now on (a read given up would cancel the call): what it kept, then a gap
        # marker, and where grpc let a little through during the flood, the event that found
        # room for that marker and more kept and lost after it. A marker goes in at a
        # publish that finds room: the admission after the flood, once the watcher has
        # read what was there.
        received: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            while True:
                received.put_nowait(await stream.__anext__())

        reader = asyncio.ensure_future(read())
        events = []
        while not events or events[-1].kind != "gap":
            events.append(await asyncio.wait_for(received.get(), 10))
        while True:
            try:
                events.append(await asyncio.wait_for(received.get(), 0.5))
            except asyncio.TimeoutError:
                break
        await client.admit("after", 16)
        while events[-1].request_id != "after":
            events.append(await asyncio.wait_for(received.get(), 10))
        reader.cancel()
        gaps = [e for e in events if e.kind == "gap"]
        kept = [e for e in events if e.kind != "gap"]
        assert gaps and all(g.lost > 0 for g in gaps) and len(kept) < 200
        assert [e.seq for e in kept] == sorted({e.seq for e in kept})  # in order, no repeats
        # What it got plus what it was told it lost accounts for every event in between.
        first, last = kept[0].seq, kept[-1].seq
        assert last - first + 1 == len(kept) + sum(g.lost for g in gaps)
        call.cancel()


def test_kvctl_events_follows_the_stream(kvd):
    kvctl = str(Path(sys.executable).with_name("kvctl"))
    proc = subprocess.Popen([kvctl, "--target", kvd.target, "events", "--json", "--count", "2",
                             "--kind", "admission"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    # It says on stderr when it is watching: the next two admissions are its two events.
    assert proc.stderr.readline() == f"kvctl: watching kvd's events at {kvd.target}\n"

    async def admit_two() -> None:
        async with AsyncClient(kvd.target) as client:
            for rid in ("e0", "e1"):
                await client.admit(rid, 16)

    asyncio.run(admit_two())
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert [json.loads(line)["request_id"] for line in out.splitlines()] == ["e0", "e1"]


class _Admin:
    generation = 0

    def identify(self, context) -> Caller:
        return Caller(tenant="", admin=True)


async def test_a_drain_while_the_subscribed_header_is_sent_still_ends_the_watch(tmp_path):
    # kvd's drain cancels each open stream, and the stream then ends with UNAVAILABLE. A
    # WatchEvents stream cancelled while its subscribed header was being sent never ended:
    # grpc had the header out, but took it for unsent, and the status kvd then sent was
    # lost; the watcher waited for the whole grace period (a kvctl events in a drain, once).
    # Here the drain lands at that moment, on kvd's own handler and stream wrapper, served
    # by a real grpc server.
    node = Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=(
        PoolConfig(model="tiny", page_bytes=4096, device_pages=8, host_pages=8),)))
    streams = OpenStreams()
    watch = streams.serve(Streams(node, _Admin()).watch_events)

    async def drained_at_once(request, context):
        def drain() -> None:  # the handler's first wait is the header's send
            streams.draining = True
            task.cancel()

        task = asyncio.current_task()
        asyncio.get_running_loop().call_soon(drain)
        await watch(request, context)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvd.v1.Memory", {
        "WatchEvents": grpc.unary_stream_rpc_method_handler(
            drained_at_once, request_deserializer=pb.WatchEventsRequest.FromString,
            response_serializer=pb.Event.SerializeToString)}),))
    sock = tmp_path / "watch.sock"
    server.add_insecure_port(f"unix:{sock}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
            for _ in range(5):
                call = pb_grpc.MemoryStub(channel).WatchEvents(pb.WatchEventsRequest())
                assert await asyncio.wait_for(call.code(), 5) == grpc.StatusCode.UNAVAILABLE
                assert "draining" in await call.details()
                streams.draining = False
    finally:
        await server.stop(0)
        await node.aclose()
