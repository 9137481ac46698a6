"""Links and the transfer scheduler: which page copy goes next on a link, and when.

A link is a path pages move along (device<->host inside a pool, pool->pool for handoff) with
a capacity in bytes per second. Every transfer is a job of chunks; the scheduler hands out one
chunk at a time:

- by class: decode-critical promotions, then promotions an access or allocation waits on,
  then prefetches, then write-back nobody waits on; a class left unserved for `aging_s` per
  class is served as if one class higher for one chunk, so none starves;
- within a class, across tenants by weight: deficit round robin over per-tenant queues, so an
  idle tenant's share goes to the others (work-conserving);
- under hard caps: token buckets per tenant and per request skip a capped job (the link then
  serves someone else), and a request over its read budget has its promotions held;
- under pacing: the link's own token bucket, whose burst is at least one chunk, so a link at
  B bytes/s never starts more than burst + B*T bytes in any T seconds.

`fifo` scheduling is the baseline without budgets: one queue in arrival order, no classes, no
caps, still paced. The two orders are strategies (core.link_queues); what waits is a Job
(core.jobs). Pure logic on a Clock's time; the runtime does the copying.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvd.core.jobs import Job, TokenBucket, TransferClass
from kvd.core.link_queues import FairQueues, FifoQueue, LinkQueues


@dataclass
class LinkMeter:
    """What a link moved: totals, by tenant, and bytes per whole second (recent history)."""

    bytes_total: int = 0
    jobs_total: int = 0
    by_tenant: Counter = field(default_factory=Counter)
    by_class: Counter = field(default_factory=Counter)
    # (second, bytes started in that second), the last `history_s` seconds.
    history: deque = field(default_factory=deque)
    history_s: int = 120

    def add(self, tenant: str, cls: TransferClass, nbytes: int, now: float) -> None:
        """A chunk of `nbytes` of a tenant's transfer of class `cls` started now."""
        self.bytes_total += nbytes
        self.by_tenant[tenant] += nbytes
        self.by_class[cls] += nbytes
        second = math.floor(now)
        if self.history and self.history[-1][0] == second:
            self.history[-1][1] += nbytes
        else:
            self.history.append([second, nbytes])
            while self.history and self.history[0][0] <= second - self.history_s:
                self.history.popleft()

    def bytes_in_last(self, seconds: float, now: float) -> int:
        """Bytes started in the last `seconds` whole seconds before the current one."""
        current = math.floor(now)
        return sum(b for s, b in self.history if current - seconds <= s < current)


_STRATEGIES = ("fair", "fifo")


class LinkScheduler:
    """The transfer scheduler of one link: its queues (a strategy, fair or fifo) decide
    which chunk is next; the scheduler paces it, charges it and meters it."""

    def __init__(self, name: str, *, capacity_bps: float, burst_bytes: float, now: float,
                 scheduling: str = "fair", aging_s: float = 0.05, quantum_bytes: int = 1 << 18,
                 weight_of: Callable[[str], float] | None = None) -> None:
        if scheduling not in _STRATEGIES:
            raise ValueError(f"link scheduling is fair or fifo, got {scheduling!r}")
        if aging_s <= 0 or quantum_bytes <= 0:
            raise ValueError("aging_s and quantum_bytes must be positive")
        self.name = name
        self.capacity_bps = float(capacity_bps)
        self.pacer = TokenBucket(capacity_bps, burst_bytes, now)
        self.quantum = quantum_bytes
        self._caps: dict[str, TokenBucket] = {}
        self.queues: LinkQueues = (
            FairQueues(now=now, aging_s=aging_s, quantum_bytes=quantum_bytes,
                       weight_of=weight_of or (lambda tenant: 1.0), caps=self._caps)
            if scheduling == "fair" else FifoQueue())
        self.queued_jobs = Counter()  # by class
        self.queued_bytes = Counter()
        self.meter = LinkMeter()

    # ------------------------------------------------------------------ configuration

    @property
    def scheduling(self) -> str:
        """The strategy's name: fair or fifo."""
        return self.queues.name

    @property
    def serves_by_class(self) -> bool:
        """Whether transfer classes order what goes first (fair does; fifo does not)."""
        return isinstance(self.queues, FairQueues)

    @property
    def burst_bytes(self) -> float:
        """Bytes the link may start at once after being idle (its pacer's burst)."""
        return self.pacer.burst

    def set_tenant_cap(self, tenant: str, rate: float | None, burst: float | None,
                       now: float) -> None:
        """A hard cap on what one tenant moves over this link (None: no cap). Only fair
        scheduling honours caps."""
        if rate is None:
            self._caps.pop(tenant, None)
        else:
            self._caps[tenant] = TokenBucket(rate, burst or max(rate / 10, self.quantum), now)

    def tenant_cap(self, tenant: str) -> TokenBucket | None:
        """A tenant's cap on this link (None: none)."""
        return self._caps.get(tenant)

    def capped_tenants(self) -> list[str]:
        """Tenants with a cap on this link."""
        return list(self._caps)

    # ------------------------------------------------------------------ queueing

    def __len__(self) -> int:
        return sum(self.queued_jobs.values())

    def submit(self, job: Job) -> None:
        """Queue a job; its chunks go out as the strategy and the pacer allow."""
        if not job.chunks or any(c <= 0 for c in job.chunks):
            raise ValueError("a job needs chunks of positive size")
        self.queues.submit(job)
        self.queued_jobs[job.cls] += 1
        self.queued_bytes[job.cls] += job.bytes_total - job.bytes_done

    def cancel(self, job: Job) -> bool:
        """Take a job off the queue (False when it is not queued: done, or never submitted)."""
        if not self.queues.cancel(job):
            return False
        self.queued_jobs[job.cls] -= 1
        self.queued_bytes[job.cls] -= job.bytes_total - job.bytes_done
        return True

    def can_start_now(self, job: Job, now: float) -> bool:
        """Whether a job submitted now would be the very next chunk out, at once: nothing
        queued, not capped, the pacer holding enough credit for all of it."""
        return (not self.queued_jobs.total() and self.queues.blocked_until(job, now) <= now
                and self.pacer.ready_at(job.bytes_total, now) <= now
                and job.bytes_total <= self.pacer.burst)

    def next_chunk(self, now: float) -> tuple[Job | None, float]:
        """The job whose next chunk goes out now, charged to the link, its tenant and caps;
        or (None, t): nothing may start before time t (math.inf: nothing is queued)."""
        job, at = self.queues.peek(now)
        if job is None:
            return None, at
        paced = self.pacer.ready_at(job.chunk_bytes, now)
        if paced > now:
            return None, paced
        job = self.queues.take(job, now)
        size = job.chunk_bytes
        self._charge(job, size, now)
        if job.started_at is None:
            job.started_at = now
        job.next_chunk += 1
        job.bytes_done += size
        self.queued_bytes[job.cls] -= size
        if job.done:
            self.queues.dequeue(job)
            self.queued_jobs[job.cls] -= 1
            self.meter.jobs_total += 1
        return job, now

    def take_now(self, job: Job, now: float) -> None:
        """Charge a whole job that never queued (can_start_now said yes) to the link."""
        for size in job.chunks:
            self._charge(job, size, now)
        job.started_at = now
        job.bytes_done = job.bytes_total
        job.next_chunk = len(job.chunks)
        self.meter.jobs_total += 1

    def _charge(self, job: Job, size: int, now: float) -> None:
        """A chunk of `size` bytes of job starts now: the caps, the pacer and the meter."""
        self.queues.charge(job, size, now)
        self.pacer.consume(size, now)
        self.meter.add(job.tenant, job.cls, size, now)

    def queue_depths(self) -> dict[str, tuple[int, int]]:
        """Jobs and bytes waiting, by class name."""
        return {c.name.lower(): (self.queued_jobs[c], self.queued_bytes[c]) for c in TransferClass}

    def tenants(self) -> Iterable[str]:
        """Tenants this link has moved bytes for."""
        return self.meter.by_tenant.keys()
