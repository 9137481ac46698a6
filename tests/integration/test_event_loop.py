"""The event loop kvd and its load generator run grpc.aio on (kvd_client.eventloop).

grpc.aio wakes the loop with one byte a completion through a socket pair, and its reader
reads one byte a call. Under a flood the pair fills and grpc's poller thread blocks in its
write, after which the process takes one completion a loop iteration: every call waits
behind every completion queued before it. A process floods itself here (server and client
in one loop, 16 Step-like streams in lock-step) and a sampler looks, every 5 ms, whether
the pair's writing end can take a byte."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

from kvd import cli
from kvd_client import eventloop

FLOOD = textwrap.dedent("""
    import asyncio, gc, json, os, select, socket, sys, tempfile
    import grpc, uvloop
    from kvd_client import eventloop

    STREAMS, ROUNDS = 16, 500

    async def main(path):
        async def echo(messages, context):
            async for message in messages:
                yield message

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "t.Echo", {"S": grpc.stream_stream_rpc_method_handler(echo)}),))
        server.add_insecure_port("unix:" + path)
        await server.start()
        channel = grpc.aio.insecure_channel("unix:" + path)
        open_stream = channel.stream_stream("/t.Echo/S")
        # grpc's wake-up pair (the process's only Python-level unix sockets)
        pair = [s for s in gc.get_objects()
                if isinstance(s, socket.socket) and s.family == socket.AF_UNIX]
        full = []

        async def stream(i):
            call = open_stream()
            for r in range(ROUNDS):
                message = b"%d.%d" % (i, r)
                await call.write(message)
                assert await call.read() == message  # every reply, to its own stream
            await call.done_writing()

        async def sample():
            while True:
                _, writable, _ = select.select([], pair, [], 0)
                full.append(len(writable) < len(pair))
                await asyncio.sleep(0.005)

        sampler = asyncio.ensure_future(sample())
        await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(STREAMS))), 60)
        sampler.cancel()
        await channel.close()
        await server.stop(None)
        return {"sockets": len(pair), "samples": len(full), "full": sum(full)}

    with tempfile.TemporaryDirectory() as d:
        run = eventloop.run if sys.argv[1] == "kvd" else uvloop.run
        print(json.dumps(run(main(os.path.join(d, "s")))))
""")


def _flood(loop: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FLOOD, loop], capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_wake_up_pair_never_fills_on_kvds_loop():
    """On kvd's loop the pair is emptied each iteration: it never fills, and every stream
    gets each of its 500 replies (a wake-up lost would hang the flood past its timeout)."""
    result = _flood("kvd")
    assert result["sockets"] >= 2 and result["samples"] >= 20, result
    assert result["full"] == 0, result


def test_the_wake_up_pair_fills_on_plain_uvloop():
    """Why kvd's loop exists: the same flood on uvloop as it is fills grpc's pair. Should a
    grpc release read its wake-ups whole, this fails, and the drain can go."""
    result = _flood("plain")
    assert result["full"] > 0, result


def test_kvd_runs_on_its_loop():
    async def loop_type():
        return type(asyncio.get_running_loop())

    assert cli._run(loop_type()) is eventloop.Loop
