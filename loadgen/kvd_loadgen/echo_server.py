"""An empty gRPC server (unary echo and bidi ping-pong on raw bytes): the baseline kvd's
control-plane overhead is measured against, run the same way kvd runs (grpc.aio, uvloop,
unix socket, its own process)."""

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


async def serve(socket: str) -> None:
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Stream": grpc.stream_stream_rpc_method_handler(_stream),
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
