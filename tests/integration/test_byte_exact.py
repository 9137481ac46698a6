"""Byte-exact tiers: 100,000 random operations (writes through the shared arena, demotions,
promotions, evictions, frees, releases, pins, policy switches, handoffs to a second pool,
some cancelled half-way) with a checksum per block and zero mismatches. In-process for speed, but with the real arenas, copier and runtime; the
engine side writes and reads through its own mapping of the shared memory."""

from __future__ import annotations

import asyncio
import hashlib
import random

import numpy as np
import pytest

from kvd.config import Config, LinkConfig, PoolConfig
from kvd.core.errors import KvdError
from kvd.core.intent import IntentChange
from kvd.node import Node
from kvd_api.v1 import kvd_pb2 as pb
from kvd_client.arena import MappedPool

PAGE = 512


def _digest(page: np.ndarray) -> bytes:
    return hashlib.blake2b(page.tobytes(), digest_size=8).digest()


async def _run(num_ops: int, seed: int, backend: str = "host", gpus: tuple[int, int] = (0, 0)
               ) -> dict:
    config = Config(socket="", tcp="x", workers=2, inline_copy_bytes=4 * PAGE, pools=(
        PoolConfig(page_bytes=PAGE, block_tokens=16, device_pages=48, host_pages=160,
                   policy="lru", device_backend=backend, link_chunk=2 * PAGE, gpu=gpus[0]),
        PoolConfig(name="decode", page_bytes=PAGE, block_tokens=16, device_pages=32,
                   host_pages=96, policy="lru", device_backend=backend, gpu=gpus[1])),
        links=(LinkConfig("default", "decode", chunk=2 * PAGE),))
    daemon = Node(config)
    engines = {name: MappedPool(pb.ExportPoolResponse(page_bytes=PAGE, tiers=[
        pb.TierExport(tier=tier, num_pages=rt.arenas[key].num_pages,
                      shm_name=rt.arenas[key].export().shm_name)
        for tier, key in ((pb.TIER_DEVICE, "device"), (pb.TIER_HOST, "host"))]))
        for name, rt in daemon.pools.items()}
    for name, rt in daemon.pools.items():
        if backend == "cupy":
            # CUDA opens no IPC handle in the process that made it: this engine, in kvd's
            # process, sees the device arena's own array. (Engines in processes of their own
            # map the handle: on a GPU the integration tests' daemons export one.)
            engines[name].tiers[pb.TIER_DEVICE] = rt.arenas["device"].pages
    rng = random.Random(seed)
    digests: dict[tuple[str, int], bytes] = {}
    live: dict[str, list[int]] = {}
    counts = dict(ops=0, checked=0, mismatches=0, refused=0, handoffs=0, rolled_back=0)
    pool = daemon.pools["default"].pool

    def handle(block):
        return pb.PageHandle(tier=int(block.tier), page_index=block.page)

    def write(blocks):
        for b in blocks:
            data = np.frombuffer(rng.randbytes(PAGE), dtype=np.uint8)
            engines[b.request.pool].write(handle(b), data)
            digests[(b.request.request_id, b.index)] = _digest(data)

    def check(blocks):
        for b in blocks:
            counts["checked"] += 1
            page = engines[b.request.pool].read(handle(b))
            if _digest(page) != digests[(b.request.request_id, b.index)]:
                counts["mismatches"] += 1

    try:
        n = 0
        while counts["ops"] < num_ops:
            counts["ops"] += 1
            op = rng.random()
            try:
                if op < 0.08 or not live:
                    n += 1
                    rid = f"r{n}"
                    blocks = rng.randint(1, 12)
                    handoff = "decode" if rng.random() < 0.3 else ""
                    if daemon.admit(rid, tenant=rng.choice("ab"), pool="", priority=0,
                                    prompt_tokens=16 * blocks, output_tokens=16 * 2,
                                    handoff_pool=handoff).decision == "admitted":
                        new, _ = await daemon.allocate(rid, blocks)
                        write(new)
                        live[rid] = [b.index for b in new]
                    elif rid in daemon.request_index:
                        await daemon.release(rid)
                    continue
                rid = rng.choice(list(live))
                if op < 0.11:
                    if daemon.request_index[rid].pool.name != "default":
                        continue
                    progress = daemon.handoff(rid, "decode")
                    if rng.random() < 0.3:  # the caller goes away after the first chunk
                        async for _ in progress:
                            break
                        await progress.aclose()
                        await asyncio.gather(*daemon.handoffs.in_flight,
                                             return_exceptions=True)
                        counts["rolled_back"] += daemon.request_index[rid].pool.name == "default"
                    else:
                        last = [p async for p in progress][-1]
                        check(last["blocks"])
                        counts["handoffs"] += 1
                    continue
                if op < 0.55:  # read some or all blocks: promotions happen here
                    indices = (None if rng.random() < 0.5 else
                               rng.sample(live[rid], k=rng.randint(1, len(live[rid]))))
                    blocks, _, _ = await daemon.access(rid, indices)
                    check(blocks)
                elif op < 0.65:
                    new, _ = await daemon.allocate(rid, rng.randint(1, 3))
                    write(new)
                    live[rid] += [b.index for b in new]
                elif op < 0.72 and len(live[rid]) > 1:
                    gone = rng.sample(live[rid], k=rng.randint(1, len(live[rid]) - 1))
                    await daemon.free(rid, gone)
                    live[rid] = [i for i in live[rid] if i not in gone]
                    for i in gone:
                        del digests[(rid, i)]
                elif op < 0.80:
                    await daemon.release(rid)
                    for i in live.pop(rid):
                        del digests[(rid, i)]
                elif op < 0.86:
                    await daemon.evict("", rng.randint(1, 6))
                elif op < 0.97:
                    index = rng.choice(live[rid])
                    fields = rng.choice([{"priority": 4}, {"priority": 1}, {"pin_requested":
                                         rng.random() < 0.5}, {"deadline_us": rng.randint(
                                         0, 10**6)}, {"phase": 5}])
                    await daemon.update_intents([IntentChange(rid, index, fields,
                                                              rng.random() < 0.3)])
                else:
                    await daemon.set_policy("", rng.choice(["lru", "intent", "deadline",
                                                            "regret", "reuse", "fair"]))
            except KvdError:
                counts["refused"] += 1  # a full tier, too many pins: refused, state intact
        for rid in list(live):  # finally, every block of every request, read back
            blocks, _, _ = await daemon.access(rid, None)
            check(blocks)
        counts["problems"] = await daemon.self_check()
        counts["demotions"] = pool.counters.num_demotions
        counts["promotions"] = pool.counters.num_promotions
    finally:
        for engine in engines.values():
            engine.close()
        daemon.close()
    return counts


def test_a_hundred_thousand_operations_lose_no_byte():
    counts = asyncio.run(_run(100_000, seed=11))
    assert counts["ops"] >= 100_000
    assert counts["mismatches"] == 0, counts
    assert counts["problems"] == []
    assert counts["checked"] > 100_000 and counts["demotions"] > 10_000, counts
    assert counts["promotions"] > 10_000, counts
    assert counts["handoffs"] > 500 and counts["rolled_back"] > 100, counts


@pytest.mark.gpu
def test_the_same_on_the_cupy_backend():
    pytest.importorskip("cupy")
    from kvd.memory.cuda import gpu_available

    if not gpu_available():
        pytest.skip("no GPU here")
    counts = asyncio.run(_run(100_000, seed=12, backend="cupy"))
    assert counts["mismatches"] == 0 and counts["problems"] == []


@pytest.mark.gpu
def test_the_same_with_the_decode_pool_on_another_gpu():
    """Pools on two GPUs: each one's copies run with its own GPU current (the copy threads'
    is GPU 0's), and handoffs copy from one GPU to the other."""
    pytest.importorskip("cupy")
    import cupy

    from kvd.memory.cuda import gpu_available

    if not gpu_available() or cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("fewer than two GPUs here")
    last = cupy.cuda.runtime.getDeviceCount() - 1
    counts = asyncio.run(_run(20_000, seed=13, backend="cupy", gpus=(0, last)))
    assert counts["mismatches"] == 0 and counts["problems"] == []
    assert counts["handoffs"] > 50, counts
