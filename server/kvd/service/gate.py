"""Per-client fairness on the server: at most `limit` unary calls of one client run at once.

grpc.aio runs every call as a task on one event loop, first come first served: a client that
keeps hundreds of calls in flight puts hundreds of tasks ahead of every other client's call and
Step message. The gate makes each client's extra calls wait in a line of their own, so the
loop round-robins across clients instead of across calls. A client is its lease (the client
library sends one per client), else its peer address.
"""

from __future__ import annotations

import asyncio


class CallGate:
    def __init__(self, limit: int) -> None:
        self.limit = limit  # 0: no gate
        self._running: dict[str, int] = {}
        self._waiting: dict[str, asyncio.Queue] = {}
        self.num_waited = 0

    def try_enter(self, key: str) -> bool:
        """Take a slot at once if the client has one free (no coroutine on the common path)."""
        running = self._running.get(key, 0)
        if running < self.limit:
            self._running[key] = running + 1
            return True
        return False

    async def enter(self, key: str) -> None:
        if not self.try_enter(key):
            await self.wait(key)

    async def wait(self, key: str) -> None:
        """Wait in the client's line for a slot that leave() hands over (after try_enter
        found none)."""
        waiters = self._waiting.setdefault(key, asyncio.Queue())
        turn = asyncio.get_running_loop().create_future()
        waiters.put_nowait(turn)
        self.num_waited += 1
        try:
            await turn  # leave() hands its slot over: _running is unchanged
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.leave(key)  # the slot came just as the caller gave up: pass it on
            raise

    def leave(self, key: str) -> None:
        waiters = self._waiting.get(key)
        while waiters is not None and not waiters.empty():
            turn = waiters.get_nowait()
            if not turn.done():
                turn.set_result(None)
                return
        if waiters is not None:
            del self._waiting[key]
        running = self._running[key] - 1
        if running:
            self._running[key] = running
        else:
            del self._running[key]
