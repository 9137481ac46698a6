"""Reads that swap in rounds all end.

With the host tier full, a read whose blocks are on the host swaps them in rounds: each
round brings in as many as the host can take victims for, the read is tried again, and so
on. Three such reads at once took turns, and each round evicted what the others' last
rounds had brought in: the link ran flat out and none of them ever ended. One read at a
time now goes in rounds and keeps what they brought in, however long they take (holds that
engines never end lapse; these end with the rounds)."""

from __future__ import annotations

import asyncio

import pytest

from kvd.config import Config, PoolConfig
from kvd.core.blocks import TierKind
from kvd.core.errors import ResourceExhausted
from kvd.core.intent import IntentChange
from kvd.node import Node
from kvd.core.holds import SWAP_HOLDER

READS = 3  # by each reader


@pytest.mark.parametrize("lapsing", [False, True], ids=["", "lapsing"])
@pytest.mark.parametrize("policy", ["fair", "fair:intent", "fair:lru"])
async def test_reads_swapping_in_rounds_at_once_all_end(policy, lapsing):
    # 1 MiB/s moves a 16 KiB page in about 16 ms: a read's rounds take tens of ms.
    daemon = Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=(
        PoolConfig(model="tiny", device_pages=6, host_pages=7, policy=policy,
                   admission="reservation", link_bandwidth="1MiB"),)))
    try:
        rt = daemon.pools["default"]
        pool = rt.pool
        # One tenant, eleven blocks: five of the six device pages are its share (the sixth
        # is the free reserve), the host holds the rest.
        sizes = {"a": 4, "b": 4, "c": 3}
        for rid, blocks in sizes.items():
            daemon.admit(rid, tenant="t", pool="", prompt_tokens=16, output_tokens=0,
                         priority=0)
            for _ in range(blocks):
                await daemon.allocate(rid, 1)
        assert pool.device.num_used + pool.host.num_used == sum(sizes.values())

        rounds = 0
        access = pool.access

        def counting(*args, **kwargs):
            nonlocal rounds
            result = access(*args, **kwargs)
            rounds += result.partial
            return result

        pool.access = counting

        async def reader(rid: str) -> None:
            # Held for the reader, as an engine's reads are, until it has looked: a read
            # without a holder may lose its blocks to the next read's rounds as soon as
            # its own are done, before it resumes. Where holds lapse at once, none is kept
            # long enough to look: there the reads must end, whole.
            holder = f"reader-{rid}"
            for _ in range(READS):
                blocks, _, _ = await asyncio.wait_for(
                    daemon.access(rid, None, holder=holder), 10)
                assert len(blocks) == sizes[rid]
                if not lapsing:
                    assert all(b.tier is TierKind.DEVICE for b in blocks), blocks
                daemon.end_holds(holder)

        kept = []  # whether the rounds' holds outlived each lapse that found some

        async def lapse() -> None:
            """Holds lapse at once: as they would after hold_s of a slow swap."""
            holds = pool.pages.holds
            while True:
                before = holds.count_of(SWAP_HOLDER)
                daemon.lapse_holds(0.0)
                if before:
                    kept.append(holds.count_of(SWAP_HOLDER) == before)
                await asyncio.sleep(0.002)

        lapses = asyncio.ensure_future(lapse()) if lapsing else None
        try:
            await asyncio.gather(*(reader(rid) for rid in sizes))
        finally:
            if lapses is not None:
                lapses.cancel()
        assert rounds > 0, "no read went in rounds: nothing was tested"
        if lapsing:
            assert kept and all(kept), kept
        assert not pool.pages.holds.count  # the rounds' holds ended with them
        assert await daemon.self_check() == []
    finally:
        await daemon.aclose()


async def test_a_read_whose_rounds_find_no_more_room_is_refused_not_left_waiting():
    # A read swapping in rounds holds what they brought in; once the device is full of
    # those and blocks pinned meanwhile, no hold that may end is left but its own. It is
    # refused, as a read finding only pins is, rather than wait for its own holds to end.
    daemon = Node(Config(socket="", tcp="127.0.0.1:0", metrics="", pools=(
        PoolConfig(model="tiny", device_pages=6, host_pages=5, policy="lru",
                   admission="reservation", link_bandwidth="1MiB"),)))
    try:
        pool = daemon.pools["default"].pool
        for rid in ("a", "q"):  # q's five push four of a's to the host, one page left there
            daemon.admit(rid, tenant="t", pool="", prompt_tokens=16, output_tokens=0,
                         priority=0)
            for _ in range(5):
                await daemon.allocate(rid, 1)
        a, q = pool.requests["a"], pool.requests["q"]
        assert (a.num_device_blocks, q.num_device_blocks, pool.host.num_free) == (1, 5, 1)

        read = asyncio.ensure_future(daemon.access("a", None))
        while pool.pages.swapping is None:  # in its rounds: one of a's comes in at a time
            await asyncio.sleep(0.001)
        await daemon.update_intents([IntentChange("q", b.index, {"pin_requested": True})
                                     for b in q.live if b.tier is TierKind.DEVICE
                                     and not b.moving])
        with pytest.raises(ResourceExhausted, match=r"0 held by engine steps .*, "
                           r"[1-5] by this read's own swap rounds"):
            await asyncio.wait_for(read, 5)
        assert not pool.pages.holds.count and pool.pages.swapping is None
        assert await daemon.self_check() == []
    finally:
        await daemon.aclose()
