"""Who waits on a pool, and how they are woken: WaitAdmission streams for their request's
answer, and operations that found no device room while pages were in transit."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from contextvars import ContextVar

from kvd.core.errors import BlocksInTransit, KvdError, ResourceExhausted, untraced

# WaitAdmission streams one request may have (each holds a little of kvd's memory).
MAX_WAITERS = 8
# What the room line hands a waiter whose own blocks are in transit: wait for them, retry.
RETRY = object()

# What a task gives back before it waits in line for room: a Step stream's turn at the
# loop (see StepStreams.serve). The room it waits for may be held by streams of its tenant
# waiting for that very turn, whose next message would end their holds.
ON_ROOM_WAIT: ContextVar[Callable[[], None] | None] = ContextVar("kvd_on_room_wait",
                                                                 default=None)


def give_back_turn() -> None:
    """The task is about to wait on others: give back what it holds that they may need (a
    Step stream's turn, see ON_ROOM_WAIT)."""
    if (give_back := ON_ROOM_WAIT.get()) is not None:
        give_back()


# How long the operation next in line for room waits before the others stop going first
# (see RoomLine.stalled). Engines' holds come and go each step, a few milliseconds apart.
STALLED_AFTER_S = 0.1


class AdmissionWaiters:
    """WaitAdmission streams: each sleeps on an event set only when its request's answer
    changed (admitted, gone, or another queue position than the one it told)."""

    def __init__(self, positions: Callable[[], dict[str, int]],
                 version: Callable[[], int] = lambda: -1) -> None:
        self._positions = positions  # request id -> queue position, one ordering for all
        # How many times the positions were worked out (-1: every time they are asked for).
        self._version = version
        # request id -> (the position it was told, its event).
        self._waiters: dict[str, list[tuple[int, asyncio.Event]]] = {}
        # The positions' version at the last notify. A waiter is told a position of the
        # version it registers at, never an older one than this (versions only go up): while
        # the version stands, every waiter's position does.
        self._notified = -1

    def event(self, request_id: str, position: int) -> asyncio.Event:
        """An event set when the request's answer changes from `position` (the one its
        waiter has just told)."""
        waiters = self._waiters.setdefault(request_id, [])
        if len(waiters) >= MAX_WAITERS:
            raise ResourceExhausted(f"{len(waiters)} WaitAdmission streams wait on this "
                                    f"request already; at most {MAX_WAITERS}")
        event = asyncio.Event()
        waiters.append((position, event))
        return event

    def notify(self) -> None:
        """The admission queue may have changed: wake the waiters whose answer did (one
        ordering of the queue for all of them; the others sleep on)."""
        if not self._waiters:
            return
        positions = self._positions()
        version = self._version()
        if version == self._notified != -1:
            return  # the positions every waiter was told stand
        self._notified = version
        for request_id, waiters in list(self._waiters.items()):
            position = positions.get(request_id, 0)
            keep = [(told, event) for told, event in waiters if told == position]
            for told, event in waiters:
                if told != position:
                    event.set()
            if keep:
                self._waiters[request_id] = keep
            else:
                del self._waiters[request_id]

    def forget(self, request_id: str, event: asyncio.Event) -> None:
        """A waiter went away without being woken."""
        waiters = self._waiters.get(request_id)
        if waiters is not None:
            waiters[:] = [(p, e) for p, e in waiters if e is not event]
            if not waiters:
                del self._waiters[request_id]


class RoomLine:
    """Operations that found no device room while pages were in transit or held, in line
    for it: served as transfers complete and holds end, best rank first, then in arrival
    order.

    Room freed while others keep stepping is taken again at once: each engine's read holds
    its pages until its next call, a few milliseconds later, and an operation that needs
    the pages of several engines at once finds them all free at no instant. Once the one
    next in line has waited STALLED_AFTER_S, the line is `stalled`: operations that would
    take device pages join it instead of trying first (see PoolRuntime.run), the engines'
    holds end as they call again, and the line goes first."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        # (rank, arrival, joined at, op, future)
        self._line: list[tuple[int, int, float, Callable, asyncio.Future]] = []
        self._arrivals = itertools.count()
        self._clock = clock

    def __bool__(self) -> bool:
        return bool(self._line)

    def join(self, op: Callable, rank: int) -> asyncio.Future:
        """Wait in line: the future gets op's result once it found room (or RETRY when the
        op then waited on blocks in transit, or the op's exception)."""
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._line, (rank, next(self._arrivals), self._clock(), op, future))
        return future

    def stalled(self) -> bool:
        """Whether the operation next in line has waited STALLED_AFTER_S or more."""
        line = self._line
        while line and line[0][4].done():  # its caller gave up
            heapq.heappop(line)
        return bool(line) and self._clock() - line[0][2] >= STALLED_AFTER_S

    def serve(self) -> None:
        """Room may have come free: call waiting operations in line until one still finds
        none."""
        line = self._line
        while line:
            _, _, _, op, future = line[0]
            if future.done():  # its caller gave up
                heapq.heappop(line)
                continue
            try:
                result = op()
            except BlocksInTransit as busy:
                if not busy.blocks:
                    return  # still no room: the line waits for the next transfer
                heapq.heappop(line)
                future.set_result(RETRY)
                continue
            except BaseException as exc:
                heapq.heappop(line)
                # A refusal goes to its caller without the frames it passed through here
                # (which keep this future, and so it: a cycle); a bug's keeps them.
                future.set_exception(untraced(exc) if isinstance(exc, KvdError) else exc)
                continue
            heapq.heappop(line)
            future.set_result(result)
