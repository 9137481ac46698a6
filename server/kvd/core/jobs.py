"""What waits on a link: a transfer job of chunks, its class, and the token buckets that
hold it back (per tenant, per request, a read budget, and the link's own pacing)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class TransferClass(enum.IntEnum):
    """A transfer's class on the link: lower goes first (with aging, so none starves)."""
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
        """Take `nbytes` of credit now (the level may go negative: a debt)."""
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
        """Bytes of all the job's chunks."""
        return sum(self.chunks)

    @property
    def done(self) -> bool:
        """Whether every chunk has gone out."""
        return self.next_chunk >= len(self.chunks)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of the next chunk."""
        return self.chunks[self.next_chunk]
