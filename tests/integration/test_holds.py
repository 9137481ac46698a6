"""What a reply hands an engine stays put until the engine's next call that hands out or
changes something, or its KeepAlive (the engine saying it is done): a call that only reads
kvd's state (a lookup, the pool's export or stats, an explanation) leaves the holds where
they are. An engine checks which kvd answers between copying into pages and committing
them: that may not let kvd move the pages under it."""

from __future__ import annotations

import numpy as np
import pytest

from kvd_client import AsyncClient, DeadlineExceededError, pb
from kvd_client.arena import MappedPool

READS = {
    "lookup": lambda c: c.lookup("ns", [b"k"]),
    "export_pool": lambda c: c.export_pool(),
    "pool_stats": lambda c: c.pool_stats(),
    "explain": lambda c: c.explain("mine"),
}


@pytest.mark.parametrize("read", sorted(READS))
async def test_a_call_that_only_reads_kvds_state_leaves_the_callers_pages_held(kvd, read):
    async with AsyncClient(kvd.target, timeout_s=10) as engine, \
            AsyncClient(kvd.target, timeout_s=1) as other:
        await engine.admit("mine", 16 * 8)
        handles = (await engine.allocate("mine", 8)).handles  # the whole device tier
        arena = MappedPool(await engine.export_pool())
        wrote = [np.random.default_rng(i).integers(0, 256, arena.page_bytes, np.uint8)
                 for i in range(8)]
        for h, data in zip(handles, wrote):
            arena.write(h, data)
        await READS[read](engine)  # between its writes and whatever it does next
        # Another engine needs a device page: every one is held, so it waits (here until
        # its deadline) rather than move one of them.
        await other.admit("theirs", 16)
        with pytest.raises(DeadlineExceededError):
            await other.allocate("theirs", 1)
        for h, data in zip(handles, wrote):
            assert arena.read(h).tobytes() == data.tobytes(), f"block {h.block_index} moved"
        # A call that does change something ends the holds: now the other engine gets in.
        await engine.free("mine", [7])
        assert [h.tier for h in (await other.allocate("theirs", 1)).handles] == [pb.TIER_DEVICE]
        arena.close()
        check = await engine.self_check()
        assert check.ok, list(check.problems)
