"""Whether a node is sound: transfers that stopped moving, blocks in transit nothing owns,
and the core's invariants (SelfCheck); and waiting for transfers to finish (drain)."""

from __future__ import annotations

import asyncio
import time

import structlog

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
    def __init__(self, pools: dict[str, PoolRuntime]) -> None:
        self.pools = pools
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
            problems = rt.transit.stuck(rt.pool.requests.values(), STUCK_AFTER_S)
            for problem in set(problems) - set(self.stuck.get(name, ())):
                log.error("transfer stuck", pool=name, problem=problem)
            self.stuck[name] = problems
            found += problems
        return found

    async def self_check(self) -> list[str]:
        """Every pool's invariants, once its transfers in flight finished (or a while
        passed), and what is stuck."""
        problems = []
        for rt in self.pools.values():
            await rt.transit.quiesce(timeout_s=SELF_CHECK_WAIT_S)  # a slow link may be busy
            rt.pool.snapshot()
            problems.extend(check_pool(rt.pool))
        return problems + self.check_stuck()

    async def check_forever(self, period_s: float) -> None:
        """Every period_s, each pool's invariants, where its transfers let it be checked
        within a moment (a pool that is busy copying is checked at the next round)."""
        while True:
            await asyncio.sleep(period_s)
            for name, rt in self.pools.items():
                if not await rt.transit.quiesce(timeout_s=PERIODIC_WAIT_S):
                    self.runs["skipped"] += 1
                    continue
                rt.pool.snapshot()
                problems = check_pool(rt.pool)  # no await since quiesce: a still state
                if problems and not self.problems.get(name):
                    log.error("self-check failed", pool=name, problems=problems[:20],
                              count=len(problems))
                self.problems[name] = len(problems)
                self.runs["failed" if problems else "ok"] += 1

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for transfers in flight, at most timeout_s in all; False: some still were."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        quiet = True
        for rt in self.pools.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            quiet &= await rt.transit.quiesce(left)
        return quiet
