"""Links at run time: a LinkScheduler and the worker that copies what it lets through.

One worker per link copies one chunk at a time (in a copy thread, or on the event loop when
the chunk is small), so the order the scheduler chooses is the order bytes move, and a link
configured at B bytes/s never moves more. The core decides which chunk; this moves it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from kvd.core.bandwidth import LinkScheduler
from kvd.core.jobs import Job
from kvd.core.clock import Clock

log = structlog.get_logger("kvd.links")


class TransferCancelled(Exception):
    """The transfer was stopped before its last chunk."""


@dataclass(eq=False)
class Transfer:
    """A job's copies: chunk_ops[i] is what chunk i copies, `copy(ops)` copies it."""

    job: Job
    chunk_ops: list[list[Any]]
    copy: Callable[[list[Any]], None]
    future: asyncio.Future
    # Called after every chunk (handoff progress).
    on_chunk: Callable[[Job], None] | None = None
    cancelled: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)


class Link:
    """A link's scheduler and its copy worker."""

    def __init__(self, sched: LinkScheduler, clock: Clock, executor: Executor,
                 inline_copy_bytes: int, source_pool: str) -> None:
        self.sched = sched
        self.source_pool = source_pool  # whose tenants' weights and caps apply
        self.clock = clock
        self._executor = executor
        self.inline_copy_bytes = inline_copy_bytes
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._current: Transfer | None = None
        self.busy_s = 0.0  # seconds spent copying

    @property
    def name(self) -> str:
        return self.sched.name

    def submit(self, transfer: Transfer) -> None:
        transfer.job.payload = transfer
        self.sched.submit(transfer.job)
        if self._task is None:
            self._task = asyncio.ensure_future(self._work())
        self._wake.set()

    def cancel(self, transfer: Transfer) -> None:
        """Stop a transfer between chunks: its future fails with TransferCancelled once no chunk
        of it is being copied (at once when it is only queued)."""
        transfer.cancelled = True
        if self.sched.cancel(transfer.job) and self._current is not transfer:
            _fail(transfer, TransferCancelled())

    def try_now(self, job: Job, ops: list[Any], copy: Callable[[list[Any]], None]) -> bool:
        """Copy a small job at once, on the event loop, when the link is idle and has credit
        for it (charged as if scheduled). False: submit it instead."""
        now = self.clock.now()
        if (self._current is not None or job.bytes_total > self.inline_copy_bytes
                or not self.sched.can_start_now(job, now)):
            return False
        started = time.perf_counter()
        copy(ops)
        self.busy_s += time.perf_counter() - started
        self.sched.take_now(job, now)
        return True

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            job, at = self.sched.next_chunk(self.clock.now())
            if job is None:
                self._wake.clear()
                timeout = None if at == math.inf else max(0.0, at - self.clock.now())
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
                continue
            transfer: Transfer = job.payload
            ops = transfer.chunk_ops[job.next_chunk - 1]
            self._current = transfer
            started = time.perf_counter()
            try:
                inline = job.chunks[job.next_chunk - 1] <= self.inline_copy_bytes
                if inline:
                    transfer.copy(ops)
                else:
                    await loop.run_in_executor(self._executor, transfer.copy, ops)
            except Exception as exc:  # the copy failed: the transfer fails, the link goes on
                self._current = None
                self.sched.cancel(job)
                log.error("copy failed", link=self.name, request_id=job.request_id,
                          error=str(exc))
                _fail(transfer, exc)
                continue
            finally:
                self.busy_s += time.perf_counter() - started
            self._current = None
            if inline:
                await asyncio.sleep(0)  # let the loop run between chunks
            if transfer.cancelled:
                self.sched.cancel(job)
                _fail(transfer, TransferCancelled())
                continue
            if transfer.on_chunk is not None:
                transfer.on_chunk(job)
            if job.done:
                if not transfer.future.done():
                    transfer.future.set_result(None)
                _ended(transfer)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None


def _fail(transfer: Transfer, exc: BaseException) -> None:
    if not transfer.future.done():
        transfer.future.set_exception(exc)
        transfer.future.exception()  # retrieved: a waiter may have gone
    _ended(transfer)


def _ended(transfer: Transfer) -> None:
    """The job no longer leads to its transfer: the two go by reference counting, not
    left as a cycle to the collector, which kvd's collections may not walk for a while
    (kvd.gcwalk)."""
    transfer.job.payload = None


def measure_copy_bandwidth(nbytes: int = 32 << 20, rounds: int = 3) -> float:
    """Bytes per second numpy.copyto moves between two host buffers here (best of rounds):
    the default capacity of a link nobody configured."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = math.inf
    for _ in range(rounds):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return nbytes / max(best, 1e-9)
