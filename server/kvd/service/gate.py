"""Fairness on the server: at most `limit` calls of one key run at once (a client's unary
calls; below, a tenant's turns at the loop while tenants compete).

grpc.aio runs every call as a task on one event loop, first come first served: a client that
keeps hundreds of calls in flight, each waiting inside kvd (for copies, for room), puts
hundreds of tasks and their copies ahead of every other client's call and Step message. (A
call that never suspends runs whole in one turn of the loop, and never meets the gate's
limit.) The gate makes each client's extra calls wait in a line of their own, so the loop
and the links round-robin across clients instead of across calls. A client is its lease
(the client library sends one per client), else its peer address.
"""

from __future__ import annotations

import asyncio

from kvd.core import errors


class CallGate:
    def __init__(self, limit: int, limits: dict[str, int] | None = None) -> None:
        self.limit = limit  # 0: no gate
        self.limits = limits or {}  # keys with a limit of their own (weighted tenants)
        self._running: dict[str, int] = {}
        self._waiting: dict[str, asyncio.Queue] = {}
        self.num_waited = 0

    def try_enter(self, key: str) -> bool:
        """Take a slot at once if the client has one free (no coroutine on the common path)."""
        running = self._running.get(key, 0)
        if running < self.limits.get(key, self.limit):
            self._running[key] = running + 1
            return True
        return False

    def running(self) -> dict[str, int]:
        """Each key with calls running now, and how many (a copy)."""
        return dict(self._running)

    def busy(self, key: str) -> bool:
        """Whether the key has a call running (or waiting) now."""
        return key in self._running

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


class StepTurns:
    """Turns at kvd's loop for Step streams while tenants compete.

    A Step message costs kvd's one event loop the same whether it is served for a victim
    or for a flood: the loop serves messages in arrival order, so a tenant with 64 streams
    sending as fast as they can puts 64 steps ahead of another tenant's every step. While
    another tenant has stepped within WINDOW_S, a stream that has read its next message
    takes one of its tenant's turns (`per_tenant` times the tenant's weight, at least 1)
    before the step is served, and gives it back before the reply is written: the flood's
    steps wait in its own line, and another tenant's step waits for at most the turns in
    progress. A tenant alone is never gated.

    A step that never waits inside kvd runs whole in one pass of the loop, so its turn would
    be taken and given back before any other message is looked at, and the flood's messages
    would be served in arrival order all the same. A turn taken at once is therefore held
    over one pass of the loop before the step is served (take): what is ready meanwhile
    runs first, the tenant's other messages to wait in its line, another tenant's to take
    a turn of its own. Only by a tenant with something else open that could take a turn (a
    second stream, a call): a tenant's only stream has nothing of its own to queue behind
    it, and its step goes on at once.
    """

    WINDOW_S = 0.05

    def __init__(self, per_tenant: int) -> None:
        self.gate = CallGate(per_tenant)
        self._last: dict[str, float] = {}  # tenant -> when it last stepped
        # tenant -> its open Step streams and its calls taking or holding a turn
        self.members: dict[str, int] = {}

    def join(self, tenant: str) -> None:
        """A Step stream of the tenant opened, or a call of its goes to take a turn (part
        when it ends)."""
        self.members[tenant] = self.members.get(tenant, 0) + 1

    def part(self, tenant: str) -> None:
        left = self.members[tenant] - 1
        if left:
            self.members[tenant] = left
        else:
            del self.members[tenant]

    def configure(self, weights: dict[str, float]) -> None:
        base = self.gate.limit
        self.gate.limits = {t: max(1, round(base * w)) for t, w in weights.items()}

    async def take(self, tenant: str) -> None:
        """Take one of the tenant's turns, in its line if they are all taken; one free is
        held over one pass of the loop first, unless the tenant has nothing else open (see
        join). Returns holding it; raises holding none."""
        if not self.gate.try_enter(tenant):
            await self.gate.wait(tenant)
            return
        if self.members.get(tenant, 0) <= 1:
            return  # nothing else of the tenant's could queue behind it
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.gate.leave(tenant)
            raise

    def contended(self, tenant: str, now: float) -> bool:
        """Whether another tenant stepped within WINDOW_S (and note that this one did)."""
        if not self.gate.limit:
            return False
        last = self._last
        last[tenant] = now
        if len(last) == 1:
            return False
        for other, at in list(last.items()):
            if now - at > self.WINDOW_S:
                del last[other]  # quiet tenants are forgotten: the table stays small
            elif other != tenant:
                return True
        return False


class CallLimits:
    """Work per call is bounded: a call with more items than max_items_per_call (or block
    indices than max_blocks_per_call) is refused whole, before any of it is done."""

    def __init__(self, max_items: int, max_blocks: int) -> None:
        self.max_items = max_items
        self.max_blocks = max_blocks

    def check(self, num: int, what: str, blocks: bool = False) -> None:
        limit, key = ((self.max_blocks, "max_blocks_per_call") if blocks
                      else (self.max_items, "max_items_per_call"))
        if num > limit:
            raise errors.InvalidArgument(
                f"{num} {what} in one call; at most {limit} ({key}): split the batch")
