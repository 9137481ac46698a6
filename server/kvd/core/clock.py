"""Time sources. The core never calls time.* itself: it is handed a Clock."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds."""

    def now(self) -> float:
        """Seconds on this clock's time line (only differences mean anything)."""


class MonotonicClock:
    """The real clock: time.monotonic()."""

    def now(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock tests move by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the test clock forward by `seconds`."""
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self._now += seconds
