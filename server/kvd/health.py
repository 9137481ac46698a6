"""Whether a node is sound: transfers that stopped moving, blocks in transit nothing owns,
and the core's invariants (SelfCheck); and waiting for transfers to finish (drain)."""

from __future__ import annotations

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


class Health:
    def __init__(self, pools: dict[str, PoolRuntime]) -> None:
        self.pools = pools
        # What check_stuck() last found, by pool (a metric, SelfCheck and a log line).
        self.stuck: dict[str, list[str]] = {}

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

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for transfers in flight, at most timeout_s in all; False: some still were."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        quiet = True
        for rt in self.pools.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            quiet &= await rt.transit.quiesce(left)
        return quiet
