"""supervised: a task kvd runs beside the calls is started again when it fails, and only
then."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvd.background import FAILURES, supervised


async def test_a_failing_task_is_counted_and_started_again():
    runs = []

    async def flaky():
        runs.append(time.monotonic())
        if len(runs) <= 2:
            raise OSError("no descriptors left")

    before = FAILURES["flaky"]
    await asyncio.wait_for(supervised("flaky", flaky, restart_s=0.05), 5)
    assert len(runs) == 3  # two failures, then it ran to its end
    assert FAILURES["flaky"] - before == 2
    assert runs[2] - runs[0] >= 0.09  # restart_s after each failure, not at once


async def test_a_cancelled_task_is_not_started_again():
    runs = []

    async def forever():
        runs.append(1)
        await asyncio.sleep(3600)

    task = asyncio.ensure_future(supervised("forever", forever, restart_s=0.01))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    assert runs == [1] and FAILURES["forever"] == 0
