"""Client: the calls of AsyncClient, blocking."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import os
import threading
from collections.abc import Coroutine

from kvd_client.client import AsyncClient

_shared_lock = threading.Lock()
_shared: tuple[int, asyncio.AbstractEventLoop, threading.Thread] | None = None


def _shared_loop() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """The event loop every Client of this process runs its calls on, in a thread of its
    own, started with the first Client and never closed.

    grpc.aio binds each loop that makes a call to its completion queue for the life of
    the process and hands every loop's completions out from whichever bound loop reads
    them first. A Client with a loop of its own that closed it left a closed loop bound:
    a completion for its channel that came after the close (its calls' last ones do)
    made the loop that read it raise "Event loop is closed" in grpc's reader, logged as
    an error in every other loop of the process, and each closed client kept its loop
    alive in grpc's table. One loop, never closed, has neither. A process forked from
    one that had it starts its own (the thread does not survive the fork)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared[0] != os.getpid():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="kvd-client", daemon=True)
            thread.start()
            _shared = (os.getpid(), loop, thread)
        return _shared[1:]


FORKED = ("this kvd client was made in process {pid}, which this process forked from: its "
          "calls run on a thread of that process, which a fork does not copy; make clients "
          "in the process that uses them, after it forks")


class Client:
    """The same calls as AsyncClient, blocking: derived from it (every public coroutine
    becomes a blocking call, every async stream a blocking iterator), run on an event loop
    in a background thread that the process's Clients share, so the two cannot drift
    apart. The async client's step_stream is left out: a blocking caller sends Steps with
    step()."""

    _ASYNC_ONLY = frozenset({"step_stream", "close", "wait_ready"})

    def __init__(self, target: str | None = None, **kw) -> None:
        self._loop, self._thread = _shared_loop()
        self._pid = os.getpid()  # the loop's thread runs in this process only
        self._tasks: set[asyncio.Task] = set()  # this client's calls under way
        self.closed = False

        async def connect() -> AsyncClient:
            return AsyncClient(target, **kw)

        self._client = self._run(connect())
        self.target = self._client.target

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _refuse_if_closed(self, coro: Coroutine) -> None:
        """A call on a closed client, or on one made in the process this one forked from,
        is refused, its coroutine closed unrun."""
        if self._pid != os.getpid():
            coro.close()
            raise RuntimeError(FORKED.format(pid=self._pid))
        if self.closed:
            coro.close()
            raise RuntimeError("this kvd client is closed")

    def _submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Run `coro` on the shared loop as one of this client's calls (close() ends it)."""
        self._refuse_if_closed(coro)

        async def tracked():
            # Closed between the check above and now: close() did not see this call.
            self._refuse_if_closed(coro)
            task = asyncio.current_task()
            self._tasks.add(task)
            try:
                return await coro
            finally:
                self._tasks.discard(task)

        return asyncio.run_coroutine_threadsafe(tracked(), self._loop)

    def _refuse_on_own_thread(self, what: str, coro: Coroutine | None = None) -> None:
        """A wait on the clients' thread, from that thread (a follow() callback), would
        wait for ever: refused (and `coro`, the call it would wait on, closed unrun)."""
        if threading.current_thread() is self._thread:
            if coro is not None:
                coro.close()
            raise RuntimeError(f"{what} on the clients' own thread (from a follow() "
                               "callback) would wait on itself")

    def _run(self, coro):
        self._refuse_on_own_thread("a blocking kvd call (use start())", coro)
        return self._submit(coro).result()

    def start(self, name: str, *args, **kwargs) -> concurrent.futures.Future:
        """Start the call `name` (any of the blocking calls) and return at once: a future of
        its reply, for a caller that must not wait on kvd (kvd_client errors, as the
        blocking call raises them, come out of its result())."""
        return self._submit(getattr(self._client, name)(*args, **kwargs))

    def follow(self, name: str, on_item, *args, **kwargs) -> concurrent.futures.Future:
        """Read the stream `name` (watch_events, say) in the background, calling
        `on_item(item)` on the clients' thread for each item, and return at once: a future
        that ends with the stream (kvd_client errors come out of its result()); cancel() it
        to stop reading. Every client's calls run on that thread: on_item must return
        soon, and may start() a call but not wait on one."""
        async def read():
            async for item in getattr(self._client, name)(*args, **kwargs):
                on_item(item)

        return self._submit(read())

    def _iterate(self, stream):
        """A blocking iterator over an async stream; closing it early closes the stream
        (which cancels the call), as does an exception raised in the thread while it waits
        for the next item (Ctrl-C)."""
        reading: list[asyncio.Task] = []  # the step under way on the loop, if any

        async def step():
            reading[:] = [asyncio.current_task()]
            return await anext(stream)

        async def stop():
            # A step the thread stopped waiting for still runs the stream: it is cancelled
            # (which ends the stream) before the stream is closed, as a stream cannot be
            # closed while it runs.
            for task in reading:
                task.cancel()
            await asyncio.gather(*reading, return_exceptions=True)
            await stream.aclose()

        try:
            while True:
                try:
                    yield self._run(step())
                except StopAsyncIteration:
                    return
        finally:
            if not self.closed:  # close() has ended the stream's call
                self._run(stop())

    def close(self) -> None:
        """Close the channel, then end this client's calls still under way (a follow()
        reading its stream, a start()ed call waiting for kvd, another thread's blocking
        call): cancelled and awaited, so their futures end (cancelled) rather than wait for
        ever. The shared loop goes on for the process's other clients."""
        if self.closed:
            return
        if self._pid != os.getpid():
            # Made before this process forked: its loop, channel and calls are the parent's
            # (closing the channel here would end the parent's connection).
            self.closed = True
            return
        self._refuse_on_own_thread("closing a kvd client")
        self.closed = True
        asyncio.run_coroutine_threadsafe(self._aclose(), self._loop).result()

    async def _aclose(self) -> None:
        await self._client.close()
        running = set(self._tasks)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until the channel is connected; TimeoutError after timeout_s."""
        self._run(self._client.wait_ready(timeout_s))


def _blocking(name: str, method):
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        def stream(self, *args, **kwargs):
            return self._iterate(getattr(self._client, name)(*args, **kwargs))
        return stream

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return self._run(getattr(self._client, name)(*args, **kwargs))
    return call


for _name, _method in vars(AsyncClient).items():
    if (not _name.startswith("_") and _name not in Client._ASYNC_ONLY
            and (inspect.iscoroutinefunction(_method) or inspect.isasyncgenfunction(_method))):
        setattr(Client, _name, _blocking(_name, _method))
