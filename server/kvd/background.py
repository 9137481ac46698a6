"""The tasks kvd runs beside the calls it serves, for as long as it serves: lease reaping,
hold and reservation expiry, the periodic self-check, the loop-lag watcher, systemd's
watchdog. Each keeps a promise (a lapsed lease's pages come back; an engine that hangs
cannot keep what it was handed), so none may end while kvd goes on serving without it."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("kvd.background")

# Failures by task, since kvd started (kvd_background_task_failures_total).
FAILURES: Counter[str] = Counter()
RESTART_S = 1.0


async def supervised(name: str, run: Callable[[], Awaitable[None]],
                     restart_s: float = RESTART_S) -> None:
    """Run `run()` until it returns; when it raises, log the error, count it and run it
    again after restart_s (an error that comes back comes back once a restart_s, not in a
    loop that holds kvd's)."""
    while True:
        try:
            await run()
            return
        except Exception:
            FAILURES[name] += 1
            log.exception("a background task failed; restarting it", task=name,
                          restart_s=restart_s, failures=FAILURES[name])
        await asyncio.sleep(restart_s)
