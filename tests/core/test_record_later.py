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


def _quick(monkeypatch) -> None:
    monkeypatch.setattr(runtime, "RECORD_READS_AFTER_S", 0.0)
    monkeypatch.setattr(runtime, "RECORD_RETRY_S", 0.001)
    monkeypatch.setattr(runtime, "RECORD_WAIT_S", 0.5)


async def _until(done, timeout_s: float = 2.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if done():
            return
        await asyncio.sleep(0.005)


async def test_the_recording_waits_while_steps_are_served(monkeypatch):
    # Engines stepping at the same instants (in lock-step, or at 50 steps a second against
    # the recording's 0.2 s) had the slices of their earlier steps recorded between their
    # steps: the last step of each burst waited for them.
    _quick(monkeypatch)
    served = [True]
    recorded: list[bool] = []

    def record_some() -> bool:
        recorded.append(served[0])
        return False

    runtime.record_later(record_some, busy=lambda: served[0])
    await asyncio.sleep(0.05)
    assert recorded == []
    served[0] = False
    await _until(lambda: recorded)
    assert recorded == [False]


async def test_steps_served_without_a_pause_hold_the_recording_up_only_so_long(monkeypatch):
    _quick(monkeypatch)
    monkeypatch.setattr(runtime, "RECORD_WAIT_S", 0.05)
    loop = asyncio.get_running_loop()
    at: list[float] = []
    left = [3]

    def record_some() -> bool:
        at.append(loop.time())
        left[0] -= 1
        return left[0] > 0

    started = loop.time()
    runtime.record_later(record_some, busy=lambda: True)
    await _until(lambda: not left[0])
    assert len(at) == 3
    assert 0.05 <= at[0] - started < 0.5
    assert at[-1] - at[0] < 0.05  # past its wait, the slices go on a turn apart as before


async def test_a_nodes_reads_wait_for_the_step_messages_it_serves(monkeypatch):
    from kvd.config import Config, override_default_pool
    from kvd.node import Node

    _quick(monkeypatch)
    node = Node(override_default_pool(Config(), device_pages=16, host_pages=16))
    try:
        node.admit("r", tenant="", pool="", prompt_tokens=16, output_tokens=0, priority=0)
        await node.allocate("r", 1)
        pool = node.runtime_of("r").pool
        node.stepping.add("a step being served")
        node.read_all(["r"], None)
        await asyncio.sleep(0.05)
        assert pool.reads.pending
        node.stepping.clear()
        await _until(lambda: not pool.reads.pending)
        assert not pool.reads.pending
    finally:
        await node.aclose()
