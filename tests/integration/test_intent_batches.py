"""A batch of intent updates never leaves a block in transit that nothing will move.

A batch with prefetch hints plans copies into the device. Big batches (more than
intent_batch.SLICED updates) are checked and applied a slice at a time with the event loop
served in between; a batch that names requests of several pools is applied pool by pool. A
caller cut off between two slices (a deadline, a closed stream), or a slice that fails
because another call released one of its requests meanwhile, used to leave the slices
before it with their prefetch plans made and never started: their blocks stayed marked in
transit with no copy to finish them, and every read, release and shutdown that touched them
waited for ever. A batch whose second pool's updates were bad applied the first pool's, and
left its plan unstarted too.

In-process for the many cut-off points, with the real arenas, copier and runtime; the
engine writes each block's bytes through its own mapping of the shared memory and checks
them once the batch is over."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest

from kvd import intent_batch
from kvd.config import Config, PoolConfig
from kvd.core.blocks import TierKind
from kvd.core.errors import KvdError
from kvd.core.intent import IntentChange
from kvd.node import Node
from kvd.service.convert import pool_export
from kvd_api.v1 import kvd_pb2 as pb
from kvd_client.arena import MappedPool

PAGE = 512
DEVICE = 64
BIG = intent_batch.SLICED + 64  # updates: a batch applied in slices


class Engine:
    """A node with one or more pools, and an engine that writes distinct bytes into every
    block it allocates and checks them on every read."""

    def __init__(self, policy: str, pools: tuple[str, ...] = ("default",)) -> None:
        self.node = Node(Config(socket="", tcp="x", workers=2, pools=tuple(
            PoolConfig(name=name, page_bytes=PAGE, device_pages=DEVICE, host_pages=512,
                       policy=policy) for name in pools)))
        self.mapped = {name: MappedPool(pool_export(rt))  # as ExportPool hands them out
                       for name, rt in self.node.pools.items()}
        self.digests: dict[tuple[str, int], bytes] = {}

    async def grow(self, rid: str, blocks: int, pool: str = "default") -> None:
        self.node.admit(rid, tenant="t", pool=pool, prompt_tokens=16, output_tokens=0,
                        priority=0)
        for _ in range(blocks):
            (block,), _ = await self.node.allocate(rid, 1)
            data = np.frombuffer(hashlib.blake2b(f"{rid}/{block.index}".encode(),
                                                 digest_size=64).digest() * (PAGE // 64),
                                 dtype=np.uint8)
            self.mapped[pool].write(self._handle(block), data)
            self.digests[(rid, block.index)] = hashlib.blake2b(data.tobytes()).digest()

    @staticmethod
    def _handle(block) -> pb.PageHandle:
        return pb.PageHandle(tier=int(block.tier), page_index=block.page)

    def on_host(self, rid: str) -> list[int]:
        rt = self.node.runtime_of(rid)
        return [b.index for b in rt.pool.requests[rid].live if b.tier is TierKind.HOST]

    async def quiet(self) -> None:
        for rt in self.node.pools.values():
            assert await rt.transit.quiesce(timeout_s=10), "a copy never ended"

    async def settled_and_intact(self) -> None:
        """Every copy ended and nothing is left in transit; every block reads back, in the
        device's worth at a time, with the bytes the engine wrote."""
        await self.quiet()
        for name, rt in self.node.pools.items():
            for rid, req in list(rt.pool.requests.items()):
                moving = [b.index for b in req.live if b.moving]
                assert not moving, (f"{len(moving)} blocks of {rid!r} in pool {name!r} are "
                                    "in transit with no copy under way")
                indices = [b.index for b in req.live]
                for start in range(0, len(indices), DEVICE // 2):
                    part = indices[start:start + DEVICE // 2]
                    blocks, _, _ = await asyncio.wait_for(
                        self.node.access(rid, part), timeout=10)
                    for b in blocks:
                        page = self.mapped[name].read(self._handle(b))
                        assert (hashlib.blake2b(page.tobytes()).digest()
                                == self.digests[(rid, b.index)]), f"{rid} block {b.index}"
        assert await self.node.self_check() == []

    async def aclose(self) -> None:
        for mapped in self.mapped.values():
            mapped.close()
        await self.node.aclose()


def _prefetches(rid: str, indices: list[int]) -> list[IntentChange]:
    return [IntentChange(rid, i, {}, prefetch=True) for i in indices]


async def _cut_off_at(policy: str, turns: int, how: str) -> bool:
    """A big batch of prefetches, cut off after `turns` turns of the loop: cancelled, or a
    request it names released; whether the batch was still going when it was cut off."""
    engine = Engine(policy)
    try:
        await engine.grow("other", 1)
        await engine.grow("r", BIG + DEVICE)
        await engine.quiet()
        host = engine.on_host("r")
        assert len(host) >= BIG
        changes = [*_prefetches("r", host[:BIG]),
                   IntentChange("other", 0, {"request_priority": 3})]
        batch = asyncio.ensure_future(engine.node.update_intents(changes))
        for _ in range(turns):
            await asyncio.sleep(0)
        going = not batch.done()
        if how == "cancel":
            batch.cancel()
        else:
            await engine.node.release("other")
        try:
            await batch
        except asyncio.CancelledError:
            assert how == "cancel"
        except KvdError as exc:
            assert how == "release" and "other" in str(exc)
        await engine.settled_and_intact()
        return going
    finally:
        await engine.aclose()


@pytest.mark.parametrize("how", ["cancel", "release"])
@pytest.mark.parametrize("policy", ["intent", "deadline", "fair:intent"])
async def test_a_big_intent_batch_cut_off_between_slices_leaves_nothing_in_transit(policy,
                                                                                   how):
    # Every point the batch yields at, until it is over before the cut.
    turns = 0
    while await _cut_off_at(policy, turns, how):
        turns += 1
    assert turns > (BIG // intent_batch.INTENT_SLICE)  # it went through every slice


@pytest.mark.parametrize("policy", ["intent", "fair:deadline"])
async def test_a_batch_over_two_pools_with_a_bad_update_changes_nothing(policy):
    engine = Engine(policy, pools=("a", "b"))
    try:
        await engine.grow("ra", DEVICE + 16, pool="a")
        await engine.grow("rb", 4, pool="b")
        await engine.quiet()
        host = engine.on_host("ra")
        before = {b.index: (b.tier, b.priority) for b in
                  engine.node.runtime_of("ra").pool.requests["ra"].live}
        changes = [*_prefetches("ra", host[:8]),
                   IntentChange("ra", host[8], {"priority": pb.PRIORITY_DECODE_CRITICAL}),
                   IntentChange("rb", 99, {"request_priority": 3})]  # rb has no block 99
        with pytest.raises(KvdError, match="99"):
            await engine.node.update_intents(changes)
        await engine.quiet()
        after = {b.index: (b.tier, b.priority) for b in
                 engine.node.runtime_of("ra").pool.requests["ra"].live}
        assert after == before  # nothing applied, nothing prefetched
        await engine.settled_and_intact()
    finally:
        await engine.aclose()
