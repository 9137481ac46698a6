"""WaitAdmission streams are woken only when their own answer changes: another tenant's
admission and release, which moves nobody in the queue, wakes none of 200 waiters (each
used to wake all of them, and each of those sorted the queue again)."""

from __future__ import annotations

import asyncio

from kvd.config import Config, PoolConfig
from kvd.node import Node


async def test_only_waiters_whose_answer_changed_wake():
    daemon = Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=(
        PoolConfig(model="tiny", device_pages=64, host_pages=0, max_queue=1024),)))
    try:
        daemon.set_quota("flood", "", limit=1, create=True)
        daemon.admit("f0", tenant="flood", pool="", prompt_tokens=16, output_tokens=0,
                     priority=0)
        waits = []
        for i in range(1, 201):  # each waits on flood's own 1-page limit
            daemon.admit(f"f{i}", tenant="flood", pool="", prompt_tokens=16,
                         output_tokens=0, priority=0)
            admitted, position, _, changed = daemon.admission_state(f"f{i}")
            assert not admitted and position == i
            waits.append(asyncio.ensure_future(changed.wait()))
        await asyncio.sleep(0)
        for j in range(5):  # another tenant comes and goes
            daemon.admit(f"v{j}", tenant="victim", pool="", prompt_tokens=16, output_tokens=0,
                         priority=0)
            await daemon.release(f"v{j}")
        await asyncio.sleep(0.01)
        assert sum(w.done() for w in waits) == 0
        # f0 goes: f1 is admitted and every other waiter moves up one: all of them wake.
        await daemon.release("f0")
        await asyncio.sleep(0.01)
        assert all(w.done() for w in waits)
        assert daemon.admission_state("f1")[0]
        assert daemon.admission_state("f2")[1] == 1
    finally:
        await daemon.aclose()
