"""A node closing while background work of its own is due: nothing of it runs on the arenas
once they are closed."""

from __future__ import annotations

import asyncio
import gc

from kvd.config import Config, PoolConfig
from kvd.node import Node


async def test_a_refill_due_at_close_does_not_copy_into_closed_arenas():
    """Under a fair policy an allocation that takes the free reserve schedules a refill (a
    demotion that tops the reserve up, off the engine's path). Closed at once, the node
    used to close its arenas while that refill was still due: it then ran, and copied
    into a closed arena (a TypeError in a task nobody awaited)."""
    loop = asyncio.get_running_loop()
    problems = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: problems.append(context))
    try:
        node = Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=(
            PoolConfig(page_bytes=64, block_tokens=4, device_pages=4, host_pages=4,
                       policy="fair", device_backend="host", link_bandwidth="1GiB/s"),)))
        node.admit("r", tenant="t", pool="", prompt_tokens=16, output_tokens=0, priority=0)
        await node.allocate("r", 4)
        assert node.runtime("default")._refilling  # due: the reserve was taken
        await node.aclose()
        for _ in range(3):
            await asyncio.sleep(0.01)
        gc.collect()  # a task that failed and that nobody awaited is reported now
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert [(c.get("message"), repr(c.get("exception"))) for c in problems] == []
