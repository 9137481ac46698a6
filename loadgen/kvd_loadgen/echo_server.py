"""An empty gRPC server (unary echo, and bidi ping-pong on raw bytes: `Stream` echoes each
message, `Ack` answers each with a two-byte message, as small as a Step reply that hands out
nothing): the baseline kvd's control-plane overhead is measured against, run the same way kvd
runs (grpc.aio on kvd's event loop, unix socket, its own process).

`Work<us>` (e.g. `Work60`) is `Ack` made to spend `us` microseconds of CPU time on each
message before it answers: the empty server with a handler of that cost, which tells what a
handler may cost for the server to keep a given share of the empty server's throughput."""

from __future__ import annotations

import argparse
import asyncio
import functools
import signal
import time

import grpc

from kvd_client import eventloop

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


async def _work(ns: int, request_iterator, context):
    clock = time.thread_time_ns
    async for _ in request_iterator:
        until = clock() + ns
        while clock() < until:
            pass
        yield ACK


class _WorkHandlers(grpc.GenericRpcHandler):
    """`Work<us>` for any whole number of microseconds."""

    PREFIX = f"/{SERVICE}/Work"

    def __init__(self) -> None:
        self._handlers: dict[int, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details):
        method = handler_call_details.method
        digits = method.removeprefix(self.PREFIX)
        if digits == method or not digits.isdigit():
            return None
        us = int(digits)
        if us not in self._handlers:
            self._handlers[us] = grpc.stream_stream_rpc_method_handler(
                functools.partial(_work, us * 1000))
        return self._handlers[us]


async def serve(socket: str) -> None:
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Stream": grpc.stream_stream_rpc_method_handler(_stream),
        "Ack": grpc.stream_stream_rpc_method_handler(_ack),
    })
    server.add_generic_rpc_handlers((handler, _WorkHandlers()))
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
    eventloop.run(serve(parser.parse_args().socket))


if __name__ == "__main__":
    main()
