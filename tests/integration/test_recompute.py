"""A dropped block is never handed back as data: Access flags it for recompute (once), its
page holds zeros (nothing of the page's previous owner), and stats, Explain and the event
stream count it."""

from __future__ import annotations

import asyncio

import numpy as np

from kvd_client import AsyncClient, pb
from kvd_client.arena import MappedPool
from kvd_client.client import intent_update
from kvd_loadgen.local import LocalKvd


async def test_dropped_block_comes_back_flagged_and_zeroed(tmp_path):
    # 4 device pages, 1 host page: of two recompute_ok victims one is demoted, one dropped.
    with LocalKvd("--model", "tiny", "--block-tokens", "16", "--device-pages", "4",
                  "--host-pages", "1", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=10) as c:
            mapped = MappedPool(await c.export_pool())

            subscribed = asyncio.Event()

            async def first_recompute():
                async for event in c.watch_events(kinds=["recompute"],
                                                  on_subscribed=subscribed.set):
                    return event

            watcher = asyncio.ensure_future(first_recompute())
            await asyncio.wait_for(subscribed.wait(), 10)
            try:
                await c.admit("r", 32, 0)
                reply = await c.allocate("r", 2)
                want = {}
                for h in reply.handles:
                    want[h.block_index] = np.full(mapped.page_bytes, 10 + h.block_index,
                                                  dtype=np.uint8)
                    mapped.write(h, want[h.block_index])
                await c.update_intents([intent_update("r", i, recompute_ok=True)
                                        for i in (0, 1)])
                evicted = await c.evict(2)
                dropped = {e.block_index for e in evicted.evicted if e.to_tier == pb.TIER_UNSPECIFIED}
                assert len(dropped) == 1
                # Another request takes the dropped block's old page and writes into it.
                await c.admit("other", 16 * 2, 0)
                for h in (await c.allocate("other", 2)).handles:
                    mapped.page(h)[:] = 0xEE
                access = await c.access("r")
                flags = {h.block_index: h.recompute for h in access.handles}
                assert flags == {i: i in dropped for i in (0, 1)}
                for h in access.handles:
                    page = mapped.read(h)
                    if h.recompute:
                        assert not page.any(), "a lost block's page held another's bytes"
                        mapped.write(h, want[h.block_index])  # the engine recomputes it
                    else:
                        assert np.array_equal(page, want[h.block_index])
                again = await c.access("r")  # said once: the engine has recomputed it
                assert not any(h.recompute for h in again.handles)
                stats = (await c.pool_stats()).pools[0]
                assert stats.num_lost_blocks == 1
                assert (await c.explain("r")).num_recomputes == 1
                event = await asyncio.wait_for(watcher, 5)
                assert (event.kind, event.request_id, event.count) == ("recompute", "r", 1)
            finally:
                watcher.cancel()
                mapped.close()
