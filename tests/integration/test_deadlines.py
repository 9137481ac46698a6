"""Client deadlines: a call that runs out of time gets DEADLINE_EXCEEDED, and nothing it
started is left half-done (the copy finishes, the page table agrees, the bytes are intact)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvd_client import AsyncClient, DeadlineExceededError
from kvd_client.arena import MappedPool
from kvd_loadgen.local import LocalKvd


async def test_a_deadline_mid_copy_leaves_nothing_half_done(tmp_path):
    # 8 MiB pages: promoting 12 of them takes long enough for a 2 ms deadline to pass.
    with LocalKvd("--page-bytes", str(8 * 2**20), "--device-pages", "12", "--host-pages",
                  "24", "--metrics", "", "--admission", "reservation", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target) as client:
            mapped = MappedPool(await client.export_pool())
            try:
                await client.admit("victim", 16 * 12)
                handles = (await client.allocate("victim", 12)).handles
                digests = []
                for h in handles:
                    data = np.random.default_rng(h.block_index).integers(
                        0, 256, mapped.page_bytes, dtype=np.uint8)
                    mapped.write(h, data)
                    digests.append(hashlib.sha256(data.tobytes()).hexdigest())
                await client.admit("pusher", 16 * 12)
                await client.allocate("pusher", 12)  # the victim is now all on the host
                hurried = AsyncClient(kvd.target, timeout_s=0.002)
                with pytest.raises(DeadlineExceededError):
                    await hurried.access("victim")  # 96 MiB to promote
                await hurried.close()
                # At once, someone else takes pages and writes them: if kvd had rolled the
                # promotion back while its copy still ran, that copy would now overwrite them.
                await client.release("pusher")
                await client.admit("fresh", 16 * 12)
                fresh = (await client.allocate("fresh", 12)).handles
                fresh_digests = []
                for h in fresh:
                    page = mapped.page(h)
                    page[:] = 0xAB
                    fresh_digests.append(hashlib.sha256(page.tobytes()).hexdigest())
                check = await client.self_check()  # waits for transfers, then checks
                now = [hashlib.sha256(mapped.page(h).tobytes()).hexdigest() for h in fresh]
                assert now == fresh_digests, "a finished-off copy overwrote someone's pages"
                assert check.ok, list(check.problems)
                access = await client.access("victim")
                now = [hashlib.sha256(mapped.page(h).tobytes()).hexdigest()
                       for h in access.handles]
                assert now == digests
            finally:
                mapped.close()
