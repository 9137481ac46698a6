"""How a link orders the chunks waiting on it: two strategies behind one interface.

`FairQueues` serves by transfer class (with aging, so none starves), then across tenants by
weight with deficit round robin, skipping a job its tenant's or request's caps hold back.
`FifoQueue` is the baseline without budgets: one queue in arrival order, no classes, no caps.
The scheduler (core.bandwidth.LinkScheduler) paces what either lets through.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Protocol

from kvd.core.jobs import Job, TokenBucket, TransferClass


class LinkQueues(Protocol):
    """The waiting jobs of one link, in the order the strategy serves them."""

    name: str

    def submit(self, job: Job) -> None:
        """Queue a job behind those of its class and tenant (fifo: behind every job)."""

    def cancel(self, job: Job) -> bool:
        """Take a queued job off (False when it is not queued)."""

    def peek(self, now: float) -> tuple[Job | None, float]:
        """The job whose chunk would go next, changing nothing; or (None, t): nothing may
        start before t (math.inf: nothing waits)."""

    def take(self, peeked: Job, now: float) -> Job:
        """Commit to the next chunk of peeked's class; returns the job that sends it."""

    def dequeue(self, job: Job) -> None:
        """The job (at the head of its queue) sent its last chunk."""

    def blocked_until(self, job: Job, now: float) -> float:
        """When the job's caps and gates let its next chunk start (now: they do)."""

    def charge(self, job: Job, size: int, now: float) -> None:
        """A chunk of `size` bytes of job starts now: charge the caps that hold it."""


class FifoQueue:
    """Arrival order, nothing else."""

    name = "fifo"

    def __init__(self) -> None:
        self._jobs: deque[Job] = deque()

    def submit(self, job: Job) -> None:
        """Queue a job at the end."""
        self._jobs.append(job)

    def cancel(self, job: Job) -> bool:
        try:
            self._jobs.remove(job)
        except ValueError:
            return False
        return True

    def peek(self, now: float) -> tuple[Job | None, float]:
        return (self._jobs[0], now) if self._jobs else (None, math.inf)

    def take(self, peeked: Job, now: float) -> Job:
        return peeked

    def dequeue(self, job: Job) -> None:
        self._jobs.popleft()

    def blocked_until(self, job: Job, now: float) -> float:
        return now

    def charge(self, job: Job, size: int, now: float) -> None:
        pass


class FairQueues:
    """By class with aging, then deficit round robin across tenants by weight, under caps."""

    name = "fair"

    def __init__(self, *, now: float, aging_s: float, quantum_bytes: int,
                 weight_of: Callable[[str], float], caps: dict[str, TokenBucket]) -> None:
        self.aging_s = aging_s
        self.quantum = quantum_bytes
        self._weight_of = weight_of
        self._caps = caps  # the scheduler's per-tenant caps, shared
        # class -> tenant -> queue of jobs (tenants in round-robin order).
        self._queues: list[OrderedDict[str, deque[Job]]] = [OrderedDict() for _ in TransferClass]
        self._deficit: list[dict[str, float]] = [{} for _ in TransferClass]
        self._turn: list[str | None] = [None for _ in TransferClass]
        self._last_served: list[float] = [now for _ in TransferClass]

    def submit(self, job: Job) -> None:
        """Queue a job behind those of its class and tenant."""
        queues = self._queues[job.cls]
        if job.tenant not in queues:
            queues[job.tenant] = deque()
            self._deficit[job.cls][job.tenant] = 0.0
        queues[job.tenant].append(job)

    def cancel(self, job: Job) -> bool:
        queue = self._queues[job.cls].get(job.tenant)
        if queue is None or job not in queue:
            return False
        queue.remove(job)
        if not queue:
            self._drop_tenant(job.cls, job.tenant)
        return True

    def _drop_tenant(self, cls: int, tenant: str) -> None:
        del self._queues[cls][tenant]
        del self._deficit[cls][tenant]
        if self._turn[cls] == tenant:
            self._turn[cls] = None

    def blocked_until(self, job: Job, now: float) -> float:
        size = job.chunk_bytes
        at = now
        cap = self._caps.get(job.tenant)
        if cap is not None:
            at = max(at, cap.ready_at(size, now))
        for bucket in job.caps:
            at = max(at, bucket.ready_at(size, now))
        for gate in job.gates:
            at = max(at, gate.in_debt_until(now))
        return at

    def charge(self, job: Job, size: int, now: float) -> None:
        cap = self._caps.get(job.tenant)
        if cap is not None:
            cap.consume(size, now)
        for bucket in job.caps:
            bucket.consume(size, now)

    def peek(self, now: float) -> tuple[Job | None, float]:
        earliest = math.inf
        for cls in self._class_order(now):
            job, at = self._drr(cls, now, commit=False)
            if job is not None:
                return job, now
            earliest = min(earliest, at)
        return None, earliest

    def take(self, peeked: Job, now: float) -> Job:
        job, _ = self._drr(peeked.cls, now, commit=True)
        assert job is not None
        self._deficit[job.cls][job.tenant] -= job.chunk_bytes
        self._last_served[job.cls] = now
        return job

    def dequeue(self, job: Job) -> None:
        queue = self._queues[job.cls][job.tenant]
        queue.popleft()
        if not queue:
            self._drop_tenant(job.cls, job.tenant)

    def _class_order(self, now: float) -> list[int]:
        """Non-empty classes, best first. A class's rank improves by one for every aging_s
        it has gone unserved with work waiting (since its oldest job arrived, or since it
        last sent a chunk); at equal rank the longer-starved goes first. So a starved class
        gets a chunk every few aging_s, and its backlog cannot outrank the classes above it
        wholesale."""
        ranked = []
        for cls, queues in enumerate(self._queues):
            if not queues:
                continue
            oldest = min(q[0].enqueued_at for q in queues.values())
            since = max(oldest, self._last_served[cls])
            aged = int((now - since) / self.aging_s)
            ranked.append((max(0, cls - aged), since, cls))
        ranked.sort()
        return [cls for _, _, cls in ranked]

    def _drr(self, cls: int, now: float, commit: bool) -> tuple[Job | None, float]:
        """Deficit round robin over the class's tenants, skipping capped ones. Without
        commit, only looks (returns the job that would go); with commit, updates deficits
        and rotation for the job it returns."""
        queues = self._queues[cls]
        deficit = self._deficit[cls]
        eligible = []
        earliest = math.inf
        for tenant, queue in queues.items():
            at = self.blocked_until(queue[0], now)
            if at <= now:
                eligible.append(tenant)
            else:
                earliest = min(earliest, at)
        if not eligible:
            return None, earliest
        if not commit:
            return queues[eligible[0]][0], now
        # Classic DRR: a tenant's turn starts with its quantum (by weight) added to its
        # deficit; it sends while the deficit covers its next chunk, then goes to the back.
        ok = set(eligible)
        turns = 0  # turns begun since one could send
        while True:
            tenant = next(iter(queues))
            if tenant in ok:
                job = queues[tenant][0]
                if self._turn[cls] != tenant:
                    self._turn[cls] = tenant
                    deficit[tenant] += self._quantum_of(tenant)
                    turns += 1
                if deficit[tenant] >= job.chunk_bytes:
                    return job, now
                if turns == len(ok):
                    self._skip_rounds(queues, deficit, ok)
                    turns = 0
            self._turn[cls] = None
            queues.move_to_end(tenant)

    def _quantum_of(self, tenant: str) -> float:
        return self.quantum * max(self._weight_of(tenant), 1e-6)

    def _skip_rounds(self, queues: OrderedDict[str, deque[Job]], deficit: dict[str, float],
                     ok: set[str]) -> None:
        """A round in which every eligible tenant began a turn and none could send: the rounds
        after it in which none would either are given at once, each tenant the quanta they
        would have given it, rather than gone round one at a time (a tenant of weight w alone
        would take 1/w rounds a chunk, on kvd's loop). The next round then sends, as the
        rounds skipped would have ended."""
        quanta = {t: self._quantum_of(t) for t in ok}
        need = {t: (queues[t][0].chunk_bytes - deficit[t]) / q for t, q in quanta.items()}
        rounds = max(0, math.ceil(min(need.values())) - 1)
        for t, q in quanta.items():
            deficit[t] += rounds * q
        # The first to send must, whatever the rounding of the sums above.
        first = min(ok, key=need.__getitem__)
        deficit[first] = max(deficit[first], queues[first][0].chunk_bytes - quanta[first])
