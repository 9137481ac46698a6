"""The event loop kvd's processes run grpc.aio on: uvloop, with grpc's completion wake-ups
drained.

grpc.aio hands completions to the loop through a socket pair. Its poller thread takes each
completion from gRPC core, queues it, and writes one byte to the pair; on the loop, the
reader drains the whole queue but reads one byte a call. Whenever completions come faster
than the loop's iterations, bytes pile up: each call leaves all but one of the bytes of the
completions it handled. The pair's buffer holds about 270 of them (a unix socket charges
each write of a byte about 770 bytes of the 208 KiB it may hold). Once it is full,
the poller blocks in its write until the loop reads a byte, which it does once an iteration:
from then on the process takes one completion an iteration. Every call waits behind every
completion queued before its own, a loop iteration each. A tenant flooding kvd from 64 Step
streams and an intent-batch loop kept kvd there for whole seconds, and another tenant's
steps reached their handler 20-40 ms after they were sent, while no pass of kvd's loop
took more than about 4 ms.

`run` and `new_event_loop` give a loop that, before grpc's reader, reads every byte but the
one that reader takes. The pair then stays empty between iterations and the poller never
blocks. No completion is lost: each is queued before its byte is written, and the reader
that follows drains the queue after those bytes are read.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import socket
import termios
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")

# grpc.aio's completion queue on the loop: its reader is this class's `_handle_events`.
_GRPC_QUEUE = "PollerCompletionQueue"


def _is_grpc_wakeup(fd, callback) -> bool:
    func = getattr(callback, "func", callback)  # grpc registers a functools.partial
    owner = getattr(func, "__self__", None)
    return isinstance(fd, socket.socket) and type(owner).__name__ == _GRPC_QUEUE


def _draining(sock: socket.socket, callback: Callable) -> Callable:
    """`callback` (grpc's reader, which reads one byte) with the other bytes read first."""
    fd = sock.fileno()
    pending = array.array("i", [0])

    def drain_then_handle(*args):
        fcntl.ioctl(fd, termios.FIONREAD, pending)
        if pending[0] > 1:
            try:
                sock.recv(pending[0] - 1, socket.MSG_DONTWAIT)
            except BlockingIOError:  # pragma: no cover - the bytes were counted as there
                pass
        return callback(*args)

    return drain_then_handle


class Loop(uvloop.Loop):
    """uvloop, with grpc.aio's completion wake-ups drained (see the module's docstring)."""

    def add_reader(self, fd, callback, *args):
        if _is_grpc_wakeup(fd, callback):
            callback = _draining(fd, callback)
        return super().add_reader(fd, callback, *args)


def new_event_loop() -> asyncio.AbstractEventLoop:
    return Loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on kvd's loop."""
    return uvloop.run(main, loop_factory=new_event_loop)
