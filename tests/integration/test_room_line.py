"""A read that waits for device room is not starved by engines that keep reading around it.

An engine's read holds its blocks until that engine's next call, and every engine calls
again a few milliseconds later: with two of them stepping, there is never an instant when
neither holds a page. A read that needs both their pages found room only at such an
instant, and waited for as long as they ran. Once it has waited a while, the others' reads
and allocations queue behind it instead, their holds end as they call again, and it goes
first."""

from __future__ import annotations

import asyncio

import pytest

from kvd.config import Config, PoolConfig
from kvd.core.blocks import TierKind
from kvd.node import Node
from kvd_client import AsyncClient, pb
from kvd_loadgen.local import LocalKvd


async def test_a_read_needing_every_page_is_not_starved_by_engines_reading_beside_it():
    daemon = Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=(
        PoolConfig(model="tiny", device_pages=6, host_pages=10, policy="fair",
                   admission="reservation"),)))
    try:
        # One tenant: under `fair` five of the six pages are its share, the sixth the free
        # reserve. `a` grows to five blocks one at a time, b and c to two: reading `a` whole
        # needs three of their four pages, so both engines' holds out of the way at once.
        for rid, blocks in (("a", 5), ("b", 2), ("c", 2)):
            daemon.admit(rid, tenant="t", pool="", prompt_tokens=16 * blocks,
                         output_tokens=0, priority=0)
            for _ in range(blocks):
                await daemon.allocate(rid, 1)
        pool = daemon.pools["default"].pool

        stop = asyncio.Event()
        reads = {"b": 0, "c": 0}

        async def engine(rid: str) -> None:
            """Reads its request every couple of milliseconds, as a decoding engine does; each
            call ends the holds of its last (the service does so for every call)."""
            while not stop.is_set():
                daemon.end_holds(rid)
                await daemon.access(rid, None, holder=rid)
                reads[rid] += 1
                await asyncio.sleep(0.002)

        engines = [asyncio.ensure_future(engine(rid)) for rid in ("b", "c")]
        try:
            await asyncio.sleep(0.05)
            assert min(reads.values()) > 0
            on_device = {rid: req.num_device_blocks for rid, req in pool.requests.items()}
            assert on_device["a"] < 5 and on_device["b"] == on_device["c"] == 2, on_device
            blocks, _, _ = await asyncio.wait_for(daemon.access("a", None, holder="a"), 5)
            assert [b.tier for b in blocks] == [TierKind.DEVICE] * 5
            # And the others go on once `a` is done with its pages.
            before = dict(reads)
            daemon.end_holds("a")
            await asyncio.sleep(0.5)
            assert all(reads[rid] > before[rid] for rid in reads), (before, reads)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*engines), 5)
        assert await daemon.self_check() == []
    finally:
        await daemon.aclose()


CONFIG = """
[[pool]]
name = "default"
model = "tiny"
device_pages = 6
host_pages = 10
policy = "fair"
admission = "reservation"
"""


async def test_the_same_against_engines_stepping_over_step_streams(tmp_path):
    """The same through a real kvd, b and c reading over Step streams, whose reads of blocks
    in place are answered (and held) without looking at room."""
    (tmp_path / "kvd.toml").write_text(CONFIG)
    with LocalKvd("--config", str(tmp_path / "kvd.toml"), workdir=tmp_path) as kvd:
        clients = {rid: AsyncClient(kvd.target, timeout_s=5) for rid in "abc"}
        stop = asyncio.Event()
        steps = {"b": 0, "c": 0}

        async def engine(rid: str) -> None:
            async with clients[rid].step_stream() as stream:
                while not stop.is_set():
                    reply = await stream.step(read_all=[rid])
                    assert not reply.errors, reply.errors
                    steps[rid] += 1
                    await asyncio.sleep(0.002)

        try:
            for rid, blocks in (("a", 5), ("b", 2), ("c", 2)):
                await clients[rid].admit(rid, 16 * blocks, 0, tenant="t")
                for _ in range(blocks):
                    await clients[rid].allocate(rid, 1)
            engines = [asyncio.ensure_future(engine(rid)) for rid in ("b", "c")]
            try:
                await asyncio.sleep(0.2)
                assert min(steps.values()) > 0
                reply = await clients["a"].access("a")  # within the client's 5 s
                assert [h.tier for h in reply.handles] == [pb.TIER_DEVICE] * 5
                before = dict(steps)
                await clients["a"].release("a")
                await asyncio.sleep(0.5)
                assert all(steps[rid] > before[rid] for rid in steps), (before, steps)
            finally:
                stop.set()
                await asyncio.wait_for(asyncio.gather(*engines), 5)
            assert (await clients["a"].self_check()).ok
        finally:
            for client in clients.values():
                await client.close()


@pytest.mark.parametrize("policy", ["lru", "fair", "intent"])
async def test_an_allocation_cancelled_once_the_line_ran_it_is_rolled_back(policy):
    # b's allocation waits in line for room (every device page is held for a). a's next
    # call ends its holds and the line runs b's allocation at once, choosing a victim of
    # a's; b's caller goes away before it resumes. Nobody will start that plan: it is
    # rolled back, the victim keeps its page and its bytes, and b is as it was.
    daemon = Node(Config(socket="", tcp="x", metrics="", pools=(
        PoolConfig(model="tiny", device_pages=4, host_pages=8, policy=policy,
                   admission="reservation"),)))
    try:
        rt = daemon.pools["default"]
        pool = rt.pool
        for rid in ("a", "b"):
            daemon.admit(rid, tenant="t", pool="", prompt_tokens=16, output_tokens=0,
                         priority=0)
        blocks, _ = await daemon.allocate("a", 4, holder="engine-a")
        device = rt.arenas["device"].pages
        for b in blocks:
            device[b.page] = b.index + 1
        waiting = asyncio.ensure_future(daemon.allocate("b", 1, holder="engine-b"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done() and not pool.requests["b"].live  # in line
        daemon.end_holds("engine-a")
        assert pool.requests["b"].live  # the line ran it...
        waiting.cancel()  # ...and its caller is gone before it resumes
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await rt.transit.quiesce(timeout_s=5)
        assert not pool.requests["b"].live
        assert [(b.tier, b.moving) for b in pool.requests["a"].live] == \
            [(TierKind.DEVICE, False)] * 4
        for b in pool.requests["a"].live:
            assert (device[b.page] == b.index + 1).all(), f"a's block {b.index}"
        assert await daemon.self_check() == []
        (block,), _ = await asyncio.wait_for(daemon.allocate("b", 1), timeout=5)
        assert block.index == 0 and await daemon.self_check() == []
    finally:
        await daemon.aclose()
