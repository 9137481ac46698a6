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
caps, still paced. Pure logic on a Clock's time; the runtime does the copying.
"""

from __future__ import annotations

import enum
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


class TransferClass(enum.IntEnum):
    CRITICAL = 0  # promotions of decode-critical blocks
    ACCESS = 1  # what an access, allocation or handoff waits on
    PREFETCH = 2  # ahead of an access
    WRITEBACK = 3  # demotions nobody waits on (reserve refill, engine-asked evictions)


class TokenBucket:
    """rate bytes/s, holding at most `burst` bytes of credit. A chunk may start when the level
    covers it (or the bucket is full, for a chunk larger than the burst), and may leave the
    level negative: the debt is paid back before the next start."""

    __slots__ = ("rate", "burst", "level", "updated")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("a token bucket needs a positive rate and burst")
        self.rate = float(rate)
        self.burst = float(burst)
        self.level = float(burst)
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.burst, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def ready_at(self, nbytes: float, now: float) -> float:
        """The earliest time a chunk of nbytes may start (now when it may start now)."""
        self._refill(now)
        need = min(nbytes, self.burst)
        if self.level >= need:
            return now
        return now + (need - self.level) / self.rate

    def in_debt_until(self, now: float) -> float:
        """now when the level is >= 0, else when it will be (a gate, consuming nothing)."""
        self._refill(now)
        return now if self.level >= 0 else now + -self.level / self.rate

    def consume(self, nbytes: float, now: float) -> None:
        self._refill(now)
        self.level -= nbytes


@dataclass(eq=False)
class Job:
    """One transfer: its chunks go out one at a time. `payload` is the runtime's."""

    cls: TransferClass
    tenant: str
    request_id: str
    chunks: list[int]  # bytes of each chunk, in order
    enqueued_at: float
    payload: Any = None
    # Token buckets a chunk must wait for and is charged to (per request caps)...
    caps: tuple[TokenBucket, ...] = ()
    # ...and buckets that must not be in debt (a request's read budget): checked, not charged.
    gates: tuple[TokenBucket, ...] = ()
    next_chunk: int = 0
    bytes_done: int = 0
    started_at: float | None = None

    @property
    def bytes_total(self) -> int:
        return sum(self.chunks)

    @property
    def done(self) -> bool:
        return self.next_chunk >= len(self.chunks)

    @property
    def chunk_bytes(self) -> int:
        return self.chunks[self.next_chunk]


@dataclass
class TenantShare:
    weight: float = 1.0
    cap: TokenBucket | None = None


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


class LinkScheduler:
    """The transfer scheduler of one link."""

    def __init__(self, name: str, *, capacity_bps: float, burst_bytes: float, now: float,
                 scheduling: str = "fair", aging_s: float = 0.05, quantum_bytes: int = 1 << 18,
                 weight_of: Callable[[str], float] | None = None) -> None:
        if scheduling not in ("fair", "fifo"):
            raise ValueError(f"link scheduling is fair or fifo, got {scheduling!r}")
        if aging_s <= 0 or quantum_bytes <= 0:
            raise ValueError("aging_s and quantum_bytes must be positive")
        self.name = name
        self.capacity_bps = float(capacity_bps)
        self.pacer = TokenBucket(capacity_bps, burst_bytes, now)
        self.scheduling = scheduling
        self.aging_s = aging_s
        self.quantum = quantum_bytes
        self._weight_of = weight_of or (lambda tenant: 1.0)
        self._caps: dict[str, TokenBucket] = {}
        # fair: class -> tenant -> queue of jobs (tenants in round-robin order); fifo: one queue.
        self._queues: list[OrderedDict[str, deque[Job]]] = [OrderedDict() for _ in TransferClass]
        self._deficit: list[dict[str, float]] = [{} for _ in TransferClass]
        self._turn: list[str | None] = [None for _ in TransferClass]
        self._last_served: list[float] = [now for _ in TransferClass]
        self._fifo: deque[Job] = deque()
        self.queued_jobs = Counter()  # by class
        self.queued_bytes = Counter()
        self.meter = LinkMeter()

    # ------------------------------------------------------------------ configuration

    @property
    def burst_bytes(self) -> float:
        return self.pacer.burst

    def set_tenant_cap(self, tenant: str, rate: float | None, burst: float | None,
                       now: float) -> None:
        """A hard cap on what one tenant moves over this link (None: no cap)."""
        if rate is None:
            self._caps.pop(tenant, None)
        else:
            self._caps[tenant] = TokenBucket(rate, burst or max(rate / 10, self.quantum), now)

    def tenant_cap(self, tenant: str) -> TokenBucket | None:
        return self._caps.get(tenant)

    def capped_tenants(self) -> list[str]:
        return list(self._caps)

    # ------------------------------------------------------------------ queueing

    def __len__(self) -> int:
        return sum(self.queued_jobs.values())

    def submit(self, job: Job) -> None:
        if not job.chunks or any(c <= 0 for c in job.chunks):
            raise ValueError("a job needs chunks of positive size")
        if self.scheduling == "fifo":
            self._fifo.append(job)
        else:
            queues = self._queues[job.cls]
            if job.tenant not in queues:
                queues[job.tenant] = deque()
                self._deficit[job.cls][job.tenant] = 0.0
            queues[job.tenant].append(job)
        self.queued_jobs[job.cls] += 1
        self.queued_bytes[job.cls] += job.bytes_total - job.bytes_done

    def cancel(self, job: Job) -> bool:
        """Take a job off the queue (False when it is not queued: done, or never submitted)."""
        if self.scheduling == "fifo":
            try:
                self._fifo.remove(job)
            except ValueError:
                return False
        else:
            queue = self._queues[job.cls].get(job.tenant)
            if queue is None or job not in queue:
                return False
            queue.remove(job)
            if not queue:
                self._drop_tenant(job.cls, job.tenant)
        self.queued_jobs[job.cls] -= 1
        self.queued_bytes[job.cls] -= job.bytes_total - job.bytes_done
        return True

    def _drop_tenant(self, cls: int, tenant: str) -> None:
        del self._queues[cls][tenant]
        del self._deficit[cls][tenant]
        if self._turn[cls] == tenant:
            self._turn[cls] = None

    def _blocked_until(self, job: Job, now: float) -> float:
        """When the job's caps and gates let its next chunk start (now: they do)."""
        size = job.chunk_bytes
        at = now
        if self.scheduling == "fair":
            cap = self._caps.get(job.tenant)
            if cap is not None:
                at = max(at, cap.ready_at(size, now))
            for bucket in job.caps:
                at = max(at, bucket.ready_at(size, now))
            for gate in job.gates:
                at = max(at, gate.in_debt_until(now))
        return at

    def can_start_now(self, job: Job, now: float) -> bool:
        """Whether a job submitted now would be the very next chunk out, at once: nothing
        queued, not capped, the pacer holding enough credit for all of it."""
        return (not self.queued_jobs.total() and self._blocked_until(job, now) <= now
                and self.pacer.ready_at(job.bytes_total, now) <= now
                and job.bytes_total <= self.pacer.burst)

    def next_chunk(self, now: float) -> tuple[Job | None, float]:
        """The job whose next chunk goes out now, charged to the link, its tenant and caps;
        or (None, t): nothing may start before time t (math.inf: nothing is queued)."""
        job, at = self._choose(now)
        if job is None:
            return None, at
        size = job.chunk_bytes
        paced = self.pacer.ready_at(size, now)
        if paced > now:
            return None, paced
        return self._take(job, now), now

    def _choose(self, now: float) -> tuple[Job | None, float]:
        if self.scheduling == "fifo":
            if not self._fifo:
                return None, math.inf
            return self._fifo[0], now
        earliest = math.inf
        for cls in self._class_order(now):
            job, at = self._drr(cls, now, commit=False)
            if job is not None:
                return job, now
            earliest = min(earliest, at)
        return None, earliest

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
            at = self._blocked_until(queue[0], now)
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
        while True:
            tenant = next(iter(queues))
            if tenant in ok:
                job = queues[tenant][0]
                if self._turn[cls] != tenant:
                    self._turn[cls] = tenant
                    deficit[tenant] += self.quantum * max(self._weight_of(tenant), 1e-6)
                if deficit[tenant] >= job.chunk_bytes:
                    return job, now
            self._turn[cls] = None
            queues.move_to_end(tenant)

    def _take(self, peeked: Job, now: float) -> Job:
        """Send the next chunk of the peeked job's class (the job DRR picks) out now."""
        job = peeked
        if self.scheduling == "fair":
            job, _ = self._drr(peeked.cls, now, commit=True)
            assert job is not None
        size = job.chunk_bytes
        if self.scheduling == "fair":
            self._deficit[job.cls][job.tenant] -= size
        self._charge(job, size, now)
        if job.started_at is None:
            job.started_at = now
        self._last_served[job.cls] = now
        job.next_chunk += 1
        job.bytes_done += size
        self.queued_bytes[job.cls] -= size
        if job.done:
            self._dequeue(job)
            self.meter.jobs_total += 1
        return job

    def _dequeue(self, job: Job) -> None:
        self.queued_jobs[job.cls] -= 1
        if self.scheduling == "fifo":
            self._fifo.popleft()
            return
        queue = self._queues[job.cls][job.tenant]
        queue.popleft()
        if not queue:
            self._drop_tenant(job.cls, job.tenant)

    def take_now(self, job: Job, now: float) -> None:
        """Charge a whole job that never queued (can_start_now said yes) to the link."""
        for size in job.chunks:
            self._charge(job, size, now)
        job.started_at = now
        job.bytes_done = job.bytes_total
        job.next_chunk = len(job.chunks)
        self.meter.jobs_total += 1

    def _charge(self, job: Job, size: int, now: float) -> None:
        """A chunk of `size` bytes of job starts now: the pacer, the caps and the meter."""
        if self.scheduling == "fair":
            cap = self._caps.get(job.tenant)
            if cap is not None:
                cap.consume(size, now)
            for bucket in job.caps:
                bucket.consume(size, now)
        self.pacer.consume(size, now)
        self.meter.add(job.tenant, job.cls, size, now)

    def queue_depths(self) -> dict[str, tuple[int, int]]:
        """Jobs and bytes waiting, by class name."""
        return {c.name.lower(): (self.queued_jobs[c], self.queued_bytes[c]) for c in TransferClass}

    def tenants(self) -> Iterable[str]:
        return self.meter.by_tenant.keys()


def split_chunks(total_pages: int, page_bytes: int, chunk_pages: int) -> list[int]:
    """Chunk sizes in bytes for total_pages pages, at most chunk_pages a chunk."""
    full, rest = divmod(total_pages, chunk_pages)
    return [chunk_pages * page_bytes] * full + ([rest * page_bytes] if rest else [])
