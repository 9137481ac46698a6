"""An empty gRPC server (unary echo, and bidi ping-pong on raw bytes: `Stream` echoes each
message, `Ack` answers each with a two-byte message, as small as a Step reply that hands out
nothing): the baseline kvd's control-plane overhead is measured against, run the same way kvd
runs (grpc.aio, uvloop, unix socket, its own process)."""

from __future__ import annotations

import argparse
import asyncio
import signal

import grpc
import uvloop

SERVICE = "kvd.bench.Echo"


async def _unary(request: bytes, context) -> bytes:
    return request


async def _stream(request_iterator, context):
    async for message in request_iterator:
        yield message


ACK = b"\x08\x01"  # a StepResponse with step_id 1


async def _ack(request_iterator, context):
    async for _ in request_iterator:
        yield ACK


async def serve(socket: str) -> None:
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Stream": grpc.stream_stream_rpc_method_handler(_stream),
        "Ack": grpc.stream_stream_rpc_method_handler(_ack),
    })
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    uvloop.run(serve(parser.parse_args().socket))


if __name__ == "__main__":
    main()
