"""Measures the load generator reports (not decisions kvd makes: those live in the server)."""

from __future__ import annotations

import os


def jain_index(values: list[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one has everything."""
    values = [v for v in values]
    if not values:
        return 1.0
    total = sum(values)
    squares = sum(v * v for v in values)
    return (total * total) / (len(values) * squares) if squares else 1.0


def cpu_s(pid: int, main_thread: bool = False) -> float | None:
    """A process's CPU time so far (user + system, seconds), or its main thread's (the one
    that runs its event loop and every handler); None where /proc has none."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
