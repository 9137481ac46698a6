"""Client: the calls of AsyncClient, blocking."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading

from kvd_client.client import AsyncClient


class Client:
    """The same calls as AsyncClient, blocking: derived from it (every public coroutine
    becomes a blocking call, every async stream a blocking iterator), run on an event loop
    of the client's own in a background thread, so the two cannot drift apart. The async
    client's step_stream is left out: a blocking caller sends Steps with step()."""

    _ASYNC_ONLY = frozenset({"step_stream", "close", "wait_ready"})

    def __init__(self, target: str | None = None, **kw) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvd-client",
                                        daemon=True)
        self._thread.start()

        async def connect() -> AsyncClient:
            return AsyncClient(target, **kw)

        try:
            self._client = self._run(connect())
        except BaseException:
            self._stop()
            raise
        self.target = self._client.target

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def start(self, name: str, *args, **kwargs) -> concurrent.futures.Future:
        """Start the call `name` (any of the blocking calls) and return at once: a future of
        its reply, for a caller that must not wait on kvd (kvd_client errors, as the
        blocking call raises them, come out of its result())."""
        return asyncio.run_coroutine_threadsafe(
            getattr(self._client, name)(*args, **kwargs), self._loop)

    def follow(self, name: str, on_item, *args, **kwargs) -> concurrent.futures.Future:
        """Read the stream `name` (watch_events, say) in the background, calling
        `on_item(item)` on the client's thread for each item, and return at once: a future
        that ends with the stream (kvd_client errors come out of its result()); cancel() it
        to stop reading."""
        async def read():
            async for item in getattr(self._client, name)(*args, **kwargs):
                on_item(item)

        return asyncio.run_coroutine_threadsafe(read(), self._loop)

    def _iterate(self, stream):
        """A blocking iterator over an async stream; closing it early closes the stream
        (which cancels the call)."""
        async def step():
            return await anext(stream)

        try:
            while True:
                try:
                    yield self._run(step())
                except StopAsyncIteration:
                    return
        finally:
            self._run(stream.aclose())

    def close(self) -> None:
        if self._thread.is_alive():
            self._run(self._aclose())
            self._stop()

    async def _aclose(self) -> None:
        """Close the channel, then end what still runs on the client's loop (a follow()
        reading its stream, a start()ed call waiting for kvd): cancelled and awaited, so
        their futures end (cancelled) rather than wait for ever on a stopped loop."""
        await self._client.close()
        running = asyncio.all_tasks() - {asyncio.current_task()}
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

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
