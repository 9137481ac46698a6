"""Whether a node is sound: transfers that stopped moving, blocks in transit nothing owns,
and the core's invariants (SelfCheck); and waiting for transfers to finish (drain)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import time
import warnings
from collections.abc import Callable

import structlog

import kvd
from kvd.core.invariants import check_pool
from kvd.runtime import PoolRuntime

log = structlog.get_logger("kvd.health")

# A transfer whose bytes have not moved for this long is reported as stuck (a link capped
# to a crawl can legitimately take seconds per chunk; nothing legitimate takes this long).
STUCK_AFTER_S = 30.0
# How long SelfCheck waits for transfers in flight to finish before checking anyway.
SELF_CHECK_WAIT_S = 5.0
# How long the periodic self-check waits for a pool's transfers before trying next round.
PERIODIC_WAIT_S = 0.5


class Health:
    def __init__(self, pools: dict[str, PoolRuntime],
                 index_check: Callable[[], list[str]] = list) -> None:
        self.pools = pools
        # The node's request index against its pools (Node.index_problems): "POOL: ..." each.
        self.index_check = index_check
        # What check_stuck() last found, by pool (a metric, SelfCheck and a log line).
        self.stuck: dict[str, list[str]] = {}
        # The periodic self-check: problems its last run found, by pool (a metric and an
        # alert), and its runs by result (ok, failed, skipped: transfers were in flight).
        self.problems: dict[str, int] = {}
        self.runs = {"ok": 0, "failed": 0, "skipped": 0}

    def check_stuck(self) -> list[str]:
        """Transfers without progress for STUCK_AFTER_S, and blocks in transit that nothing
        owns: logged when first found, kept for the metric and SelfCheck."""
        found = []
        for name, rt in self.pools.items():
            problems = rt.transit.stuck(rt.pool.pages.moving_requests(), STUCK_AFTER_S)
            for problem in set(problems) - set(self.stuck.get(name, ())):
                log.error("transfer stuck", pool=name, problem=problem)
            self.stuck[name] = problems
            found += problems
        return found

    async def self_check(self) -> list[str]:
        """Every pool's invariants, once its transfers in flight finished (or a while
        passed), the request index against the pools, and what is stuck. A pool of
        APART_FROM_PAGES pages or more is walked in a forked copy (check_apart), as the
        periodic check's: the operator's check would otherwise hold every engine's calls
        for as long as the walk."""
        problems = []
        for rt in self.pools.values():
            await rt.transit.quiesce(timeout_s=SELF_CHECK_WAIT_S)  # a slow link may be busy
            pool = rt.pool.snapshot()
            pages = pool.pages.device.capacity + pool.pages.host.capacity
            # Forked before anything awaits since quiesce: the copy is of a still pool.
            found = await check_apart(pool) if pages >= APART_FROM_PAGES else None
            if found is None:  # a small pool, or no child could walk it: walked here
                problems.extend(check_pool(pool))
                continue
            count, first = found
            problems.extend(first)
            if count > len(first):
                problems.append(f"{pool.name}: {count - len(first)} more problems")
        return problems + self.index_check() + self.check_stuck()

    async def check_forever(self, period_s: float) -> None:
        """Every period_s, each pool's invariants, where its transfers let it be checked
        within a moment (a pool that is busy copying is checked at the next round), on a
        copy of the pool (check_apart)."""
        while True:
            await asyncio.sleep(period_s)
            index: dict[str, list[str]] = {}
            for problem in self.index_check():
                index.setdefault(problem.split(":", 1)[0], []).append(problem)
            for name, rt in self.pools.items():
                if not await rt.transit.quiesce(timeout_s=PERIODIC_WAIT_S):
                    self.runs["skipped"] += 1
                    continue
                rt.pool.snapshot()
                # Forked before anything awaits since quiesce: the copy is of a still pool.
                found = await check_apart(rt.pool)
                if found is None:
                    self.runs["skipped"] += 1
                    continue
                count, problems = found
                count += len(index.get(name, ()))
                problems = [*problems, *index.get(name, ())][:FORKED_PROBLEMS]
                if count and not self.problems.get(name):
                    log.error("self-check failed", pool=name, problems=problems, count=count)
                self.problems[name] = count
                self.runs["failed" if count else "ok"] += 1

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for transfers in flight, at most timeout_s in all; False: some still were."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        quiet = True
        for rt in self.pools.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            quiet &= await rt.transit.quiesce(left)
        return quiet


# What a forked self-check sends back: its first problems (and how many it found).
FORKED_PROBLEMS = 20
# The size (device and host pages) from which the SelfCheck RPC walks a pool in a forked
# copy: about 50 ms of walk here, against a few milliseconds of fork; a smaller pool is
# walked where it is, quicker than a fork (the property tests check after every step).
APART_FROM_PAGES = 16384
# A forked self-check that has not answered by then is ended and counted as skipped.
FORKED_TIMEOUT_S = 300.0


async def check_apart(pool) -> tuple[int, list[str]] | None:
    """check_pool on the pool as it is now, walked in a forked child whose memory is a
    copy-on-write copy of kvd's: the walk takes about 3 us a page (0.2 s at 65,536 device
    pages, 1 s at 262,144), and would hold kvd's loop, and every engine's step, as long;
    the fork holds it for a few milliseconds. Returns how many problems the walk found and
    the first FORKED_PROBLEMS of them; None when no child could be made or it did not
    answer. Walks in the loop where a child could not be the walk alone: no fork, or gRPC
    loaded before kvd with its fork support on (see kvd/__init__.py)."""
    if not hasattr(os, "fork") or not kvd.GRPC_FORKS_BARE:
        problems = check_pool(pool)
        return len(problems), problems[:FORKED_PROBLEMS]
    try:
        read_end, write_end = os.pipe()
    except OSError as exc:  # out of descriptors (a flood of connections, say)
        log.warning("self-check skipped: no pipe to the walk", error=str(exc))
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # threads: the child uses none
            pid = os.fork()
    except OSError as exc:
        os.close(read_end)
        os.close(write_end)
        log.warning("self-check skipped: could not fork", error=str(exc))
        return None
    if pid == 0:  # the child: walk, answer, and leave without running anything of kvd's
        status = 1
        try:
            # A signal sent to the child is not kvd's: its handlers (and the loop's wakeup
            # descriptor, which the child shares with kvd) stay out of it.
            with contextlib.suppress(ValueError):  # kvd's loop off the main thread
                signal.set_wakeup_fd(-1)
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(signum, signal.SIG_DFL)
            gc.disable()
            os.close(read_end)
            problems = check_pool(pool)
            data = json.dumps([len(problems), problems[:FORKED_PROBLEMS]]).encode()
            while data:
                data = data[os.write(write_end, data):]
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    loop = asyncio.get_running_loop()
    answered = loop.create_future()
    chunks: list[bytes] = []

    def readable() -> None:
        try:
            chunk = os.read(read_end, 1 << 16)
        except BlockingIOError:
            return
        if chunk:
            chunks.append(chunk)
        elif not answered.done():
            answered.set_result(None)  # the child's end closed: it has exited

    os.set_blocking(read_end, False)
    loop.add_reader(read_end, readable)
    try:
        await asyncio.wait_for(answered, FORKED_TIMEOUT_S)
    except asyncio.TimeoutError:
        log.error("self-check child did not answer; ended", timeout_s=FORKED_TIMEOUT_S)
    finally:
        loop.remove_reader(read_end)
        os.close(read_end)
        if not answered.done():  # timed out, or kvd is stopping the check
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    try:
        count, problems = json.loads(b"".join(chunks))
    except ValueError:
        if answered.done():
            log.error("self-check child failed",
                      exit_code=os.waitstatus_to_exitcode(status))
        return None
    return count, problems
