"""The read hot path: an engine step reads every block of its running requests
(DESIGN.md, "What kvd decides": what a step's reads cost and record).

Most steps read requests whose blocks are all resident and still; such a read is answered
from a few per-request counters, and recording it (recency for the policy, read metering,
counters) is left for later: nothing in the reply depends on it. `Reads` answers, keeps what
it answered as `ReadRecord`s, and hands them over merged (`take`) for the pool to record —
soon, and in any case before any other pool method, so every decision sees the reads in the
order they came.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd.core.blocks import Request, RequestState
from kvd.core.clock import Clock


class ReadRecord:
    """Reads answered and not yet recorded: every block of `requests` was read `times`
    times, last at `at`, and the time before at `before` (None: once)."""

    __slots__ = ("at", "before", "requests", "times")

    def __init__(self, at: float, requests: list[Request]) -> None:
        self.at = at
        self.before: float | None = None
        self.requests = requests
        self.times = 1


class LastRead:
    """The last read answered wholly at once (see Reads.answer)."""

    __slots__ = ("key", "count", "tenant", "requests")

    def __init__(self, key: str | bytes, count: int, tenant: str | None,
                 requests: list[Request]) -> None:
        self.key = key
        self.count = count
        self.tenant = tenant
        self.requests = requests


class Reads:
    """One pool's answered, unrecorded reads. `requests` is the pool's request table (read
    only here)."""

    def __init__(self, requests: dict[str, Request], clock: Clock) -> None:
        self._requests = requests
        self.clock = clock
        self.pending: list[ReadRecord] = []
        # The last answer given wholly at once, while nothing else happened to the pool
        # (the pool calls forget() before any other method): the same step again needs no
        # checks. Its key is the caller's, else the request ids joined by NUL (ids hold no
        # NUL, so equal joins of as many ids are equal lists; one string compares faster
        # than 64 scattered ones).
        self._last: LastRead | None = None

    def answer(self, request_ids: Sequence[str], tenant: str | None = None,
               key: bytes | None = None) -> tuple[list[str], list[Request], bool]:
        """Read every block of each request now. Returns the ids left for the general path
        (blocks not all resident and still, unknown ids, other tenants' than `tenant`), the
        requests read whose blocks moved since the engine was told, and whether this read
        is the first pending (the pool then has them recorded soon).

        `key`, when given, stands for request_ids in telling a repeated read: bytes equal
        only for equal lists (the Step message without its id)."""
        if key is None:
            request_ids = list(request_ids)  # their strings made once: joined and looked up
            key = "\0".join(request_ids)
        last = self._last
        pending = self.pending
        if (last is not None and last.key == key and last.count == len(request_ids)
                and last.tenant == tenant):
            # An engine reads its batch every step: nothing changed since this read was
            # answered (any change goes through a pool method, which forgets the answer).
            now = self.clock.now()
            if pending and pending[-1].requests is last.requests:
                record = pending[-1]  # the reads of the same steps, recorded as one
                record.before, record.at = record.at, now
                record.times += 1
                return [], [], False
            pending.append(ReadRecord(now, last.requests))
            return [], [], len(pending) == 1
        requests = self._requests
        admitted = RequestState.ADMITTED
        general: list[str] = []
        relocated: list[Request] = []
        read: list[Request] = []
        for rid in request_ids:
            req = requests.get(rid)
            if (req is None or req.state is not admitted or req.num_moving_blocks
                    or req.num_device_blocks != req.num_live_blocks
                    or (tenant is not None and req.tenant != tenant)):
                general.append(rid)
                continue
            read.append(req)
            if req.maybe_relocated:
                relocated.append(req)
        if not read:
            return general, relocated, False
        if not general and not relocated:
            self._last = LastRead(key, len(request_ids), tenant, read)
        pending.append(ReadRecord(self.clock.now(), read))
        return general, relocated, len(pending) == 1

    def forget(self) -> None:
        """The pool is about to change: the last answer may no longer hold."""
        self._last = None

    def take(self) -> list[tuple[Request, float, float | None, int]]:
        """The pending reads, merged, as (request, last read, the read before or None, times)
        in the order of the last reads; none pending after.

        Steps that come faster than the pool records them leave several reads pending, often
        of the same requests (an engine reads its batch every step). Nothing happened to the
        pool in between, so each request's blocks need only their last read, and the one
        before it for the reuse distance; the counts add up, and the policy sees the requests
        in the order of their last reads, as recording the reads one by one would leave
        them. Requests released meanwhile are left out."""
        pending, self.pending = self.pending, []
        if not pending:
            return []
        admitted = RequestState.ADMITTED
        if len(pending) == 1 and pending[0].times == 1:
            at = pending[0].at
            return [(r, at, None, 1) for r in pending[0].requests if r.state is admitted]
        # request -> [request, last, the read before, count, the record of the last]
        latest: dict[Request, list] = {}
        for i, record in enumerate(reversed(pending)):
            at, before, count = record.at, record.before, record.times
            for req in reversed(record.requests):
                entry = latest.get(req)
                if entry is None:
                    latest[req] = [req, at, before, count, i]
                else:
                    if entry[4] == i:  # named twice in one step: read twice at its time
                        entry[2] = at
                    elif entry[2] is None:
                        entry[2] = at
                    entry[3] += count
        return [(e[0], e[1], e[2], e[3]) for e in reversed(latest.values())
                if e[0].state is admitted]
