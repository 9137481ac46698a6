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


async def test_close_keeps_its_deadline_when_a_refill_is_wedged():
    """Closing takes at most its timeout in all: the wait for a refill that is due gets only
    what is left of the deadline once the engines' feeds have closed, not the whole timeout
    again. (A refill that never ends and feeds that take a while to close used to make
    closing take their sum.) The feeds take 3 s and the timeout is 4 s: their sum, 7 s, is
    more than a stall of this machine (2.5 s seen) past the timeout."""
    node = Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=(
        PoolConfig(page_bytes=64, block_tokens=4, device_pages=4, host_pages=4,
                   device_backend="host"),)))
    wedged = asyncio.ensure_future(asyncio.sleep(3600))  # a refill whose copy never ends
    node.runtime("default")._refill = wedged
    feeds_close = node.engines.aclose

    async def slow_feeds():
        await asyncio.sleep(3.0)
        await feeds_close()

    node.engines.aclose = slow_feeds
    loop = asyncio.get_running_loop()
    started = loop.time()
    await node.aclose(timeout_s=4.0)
    took = loop.time() - started
    assert wedged.cancelled()
    assert took < 6.0, f"closing took {took:.2f} s against a 4 s timeout"
