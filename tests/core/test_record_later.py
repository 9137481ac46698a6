"""The runtime records a pool's reads a slice at a time: the event loop serves what came
meanwhile between two slices, and without a loop the recording runs to its end at once."""

from __future__ import annotations

import asyncio

from kvd import runtime


def _slices(n: int, order: list[str]):
    """A recording of n slices that, in each, sees a step come in (a callback made ready)."""
    left = [n]

    def record_some() -> bool:
        order.append("slice")
        asyncio.get_running_loop().call_soon(order.append, "step")
        left[0] -= 1
        return left[0] > 0

    return record_some, left


async def test_the_loop_serves_what_came_between_two_slices(monkeypatch):
    monkeypatch.setattr(runtime, "RECORD_READS_AFTER_S", 0.0)
    order: list[str] = []
    record_some, left = _slices(3, order)
    runtime.record_later(record_some)
    for _ in range(100):
        if not left[0]:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0)
    assert order == ["slice", "step"] * 3


def test_without_a_loop_the_recording_runs_to_its_end():
    calls = []

    def record_some() -> bool:
        calls.append(1)
        return len(calls) < 4

    runtime.record_later(record_some)
    assert len(calls) == 4
