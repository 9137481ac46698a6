"""Engines whose calls are cut off: every call an engine makes runs under a deadline of tens
of milliseconds, over a link that copies a page in about sixteen, on a device of six pages
that the engines' requests over-subscribe. kvd's handlers are cancelled while they wait for
room, for blocks in transit and for copies; an engine that lost an answer learns the state of
its request again (as one would after a timeout) and goes on. Every block read is checked
against what the engine wrote, and at the end nothing is left and SelfCheck is clean."""

from __future__ import annotations

import asyncio
import os
import random

import numpy as np
import pytest

from kvd.core.policies import policy_names
from kvd_client import AsyncClient, KvdClientError, NotFoundError, pb
from kvd_client.arena import MappedPool
from kvd_client.client import intent_update
from kvd_loadgen.local import LocalKvd

from .conftest import done_with_pages

PAGE = 16 * 1024
ENGINES = 4
STEPS = int(os.environ.get("KVD_CUT_OFF_STEPS", "80"))  # per engine
# Three shapes, each (a request's blocks at most, pinned blocks at most, all engines
# together) such that a request read whole always finds room beside the pins, and no engine
# waits on itself: requests of the whole device, which a read gets only once no other
# engine holds a page (kvd's room line makes the others' reads wait behind it); of all but
# one of its pages (under `fair` as many as a tenant's share of it, the free reserve being
# nobody's); and pins beside smaller requests.
SHAPES = {"whole": (6, 0), "large": (5, 0), "pins": (4, 2)}
# Blocks at most, all engines together: the host tier seldom fills, so that a request read
# whole can swap its blocks in (with both tiers full kvd refuses, rightly, until something
# is freed; see Engine.read_whole). Under `fair` a tenant at its share leaves the free
# reserve's page alone for that, and the refill demotes into the host.
BUDGET = 6 + 10 - 2 - 1
RETRYABLE = ("RESOURCE_EXHAUSTED", "FAILED_PRECONDITION")

CONFIG = """
[[pool]]
name = "default"
model = "tiny"
device_pages = 6
host_pages = 10
policy = "{policy}"
admission = "reservation"
link_bandwidth = "1MiB"
"""


def pattern(rid: str, block: int, version: int) -> np.ndarray:
    seed = hash((rid, block, version)) & 0xFFFFFFFF
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8)


class Engine:
    """One engine: calls under a short deadline (`fast`), and a patient client (`slow`) to
    learn what a cut-off call left behind."""

    def __init__(self, fast: AsyncClient, slow: AsyncClient, mapped: MappedPool, wid: int,
                 seed: int, pins: dict[tuple[str, int], bool], shape: tuple[int, int]
                 ) -> None:
        self.fast, self.slow, self.mapped, self.wid = fast, slow, mapped, wid
        self.rng = random.Random(seed * 100 + wid)
        self.requests: dict[str, dict[int, int]] = {}  # rid -> block -> version written
        self.pins = pins  # every engine's pinned blocks: (rid, block)
        self.max_blocks, self.max_pins = shape
        self.fleet: list[Engine] = []  # every engine, this one included
        self.n = self.checked = self.cut = self.preempted = 0

    def room(self, more: int) -> bool:
        """Whether the engines together may hold `more` blocks more (see BUDGET)."""
        held = sum(len(blocks) for e in self.fleet for blocks in e.requests.values())
        return held + more <= BUDGET

    def forget(self, rid: str, blocks=None) -> None:
        """These blocks of rid (None: all) are gone, and their pins with them."""
        for block in (list(self.requests.get(rid, ())) if blocks is None else blocks):
            self.pins.pop((rid, block), None)
            if rid in self.requests:
                self.requests[rid].pop(block, None)
        if blocks is None:
            self.requests.pop(rid, None)

    def write(self, rid: str, handles) -> None:
        for h in handles:
            version = self.requests[rid].get(h.block_index, 0) + 1
            self.requests[rid][h.block_index] = version
            self.mapped.write(h, pattern(rid, h.block_index, version))

    def check(self, rid: str, handles) -> None:
        for h in handles:
            version = self.requests[rid].get(h.block_index)
            if version is None:
                continue  # allocated by a call whose answer was lost: not written yet
            page = self.mapped.read(h)
            if h.recompute:  # its bytes were dropped: zeros, and the engine recomputes
                assert not page.any(), f"{rid}/{h.block_index}: a lost page held bytes"
                self.mapped.write(h, pattern(rid, h.block_index, version))
                continue
            assert np.array_equal(page, pattern(rid, h.block_index, version)), (
                f"{rid} block {h.block_index} (version {version}, tier {h.tier}, page "
                f"{h.page_index}) corrupted")
            self.checked += 1

    async def read_whole(self, rid: str) -> pb.AccessResponse | None:
        """Read every block, waiting out refusals that other engines' blocks cause; None
        when kvd still refuses after a while (both tiers full for the tenant: the engines,
        each reading before it frees, would wait on each other), and the engine preempts
        the request instead, as one out of memory does."""
        for _ in range(100):
            try:
                return await self.slow.access(rid)
            except KvdClientError as exc:
                if exc.code.name not in RETRYABLE:
                    raise
                await asyncio.sleep(0.02)
        await self.slow.release(rid)
        self.forget(rid)
        self.preempted += 1
        return None

    async def learn(self, rid: str) -> None:
        """A call on rid was cut off: learn its blocks as kvd has them, write those the
        engine was never told of."""
        try:
            active = (await self.slow.explain(rid)).active
        except NotFoundError:
            active = False
        if not active:
            self.forget(rid)
            return
        blocks = self.requests.setdefault(rid, {})
        reply = await self.read_whole(rid)
        if reply is None:
            return
        self.forget(rid, set(blocks) - {h.block_index for h in reply.handles})
        self.check(rid, reply.handles)
        self.write(rid, [h for h in reply.handles if h.block_index not in blocks])

    def choose(self):
        """The next call: (request id, method, args)."""
        if (not self.requests or self.rng.random() < 0.2) and self.room(4):
            self.n += 1
            return f"w{self.wid}-{self.n}", self.fast.admit, None
        if not self.requests:
            return None, None, None
        rid = self.rng.choice(sorted(self.requests))
        blocks = sorted(self.requests[rid])
        c, more = self.rng.random(), self.rng.randint(1, 2)
        if c < 0.2 and len(blocks) + more <= self.max_blocks and self.room(more):
            return rid, self.fast.allocate, (rid, more)
        if c < 0.6 or not blocks:
            return rid, self.fast.access, (rid,)
        if c < 0.7:
            return rid, self.fast.access, (rid, [self.rng.choice(blocks)])
        if c < 0.8 and len(blocks) > 1:
            return rid, self.fast.free, (rid, [self.rng.choice(blocks)])
        if c < 0.87:
            return rid, self.fast.release, (rid,)
        if c < 0.92:
            updates = [intent_update(rid, b, recompute_ok=self.rng.random() < 0.5,
                                     request_priority=self.rng.randint(0, 9))
                       for b in self.rng.sample(blocks, self.rng.randint(1, len(blocks)))]
            return rid, self.fast.update_intents, (updates,)
        if c < 0.95:  # pinned and unpinned by the patient client: the pins stay known
            return rid, self.pin, (rid, self.rng.choice(blocks))
        return rid, self.fast.evict, (self.rng.randint(1, 4),)

    async def step(self) -> None:
        rid, method, args = self.choose()
        if method is None:
            await asyncio.sleep(0.01)  # no room for more: the others free some
            return
        if method == self.fast.admit:
            self.requests[rid] = {}
            blocks = self.rng.randint(1, 4)
            try:
                reply = await self.fast.admit(rid, 16 * blocks, 16 * 2)
            except KvdClientError as exc:
                if exc.code.name != "DEADLINE_EXCEEDED":
                    raise
                self.cut += 1
                await self.learn(rid)
                return
            if reply.decision != pb.DECISION_ADMITTED:
                if reply.decision == pb.DECISION_QUEUED:
                    await self.slow.release(rid)
                del self.requests[rid]
                return
            method, args = self.fast.allocate, (rid, blocks)
        try:
            reply = await method(*args)
        except KvdClientError as exc:
            if exc.code.name == "DEADLINE_EXCEEDED":
                self.cut += 1
                await self.learn(rid)
                return
            if exc.code.name in RETRYABLE:
                return  # a clean refusal (no room now, too many pins)
            raise
        if method == self.fast.allocate:
            self.write(rid, reply.handles)
        elif method == self.fast.access:
            self.check(rid, reply.handles)
        elif method == self.fast.free:
            self.forget(rid, args[1])
        elif method == self.fast.release:
            self.forget(rid)

    async def pin(self, rid: str, block: int) -> None:
        """Pin the block, or unpin it if pinned; no more than max_pins at once."""
        pinned = (rid, block) in self.pins
        if not pinned and len(self.pins) >= self.max_pins:
            return
        await self.slow.update_intents([intent_update(rid, block, pin_requested=not pinned)])
        if pinned:
            del self.pins[(rid, block)]
        else:
            self.pins[(rid, block)] = True

    async def run(self, steps: int) -> None:
        for _ in range(steps):
            await self.step()
        for rid in sorted(self.requests):  # read back whole, then let go
            reply = await self.read_whole(rid)
            if reply is not None:
                self.check(rid, reply.handles)
                await self.slow.release(rid)


async def _cut_off(tmp_path, policy: str, shape: tuple[int, int], seed: int) -> None:
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG.format(policy=policy))
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        engines, clients, pins = [], [], {}
        try:
            for wid in range(ENGINES):
                slow = AsyncClient(kvd.target, timeout_s=20)
                # 10 to 40 ms: a page's copy takes about 16.
                fast = AsyncClient(kvd.target, timeout_s=0.01 + 0.01 * wid)
                clients += [slow, fast]
                mapped = MappedPool(await slow.export_pool())
                engines.append(Engine(fast, slow, mapped, wid, seed, pins, shape))
            for engine in engines:
                engine.fleet = engines
            await asyncio.gather(*(e.run(STEPS) for e in engines))
            assert sum(e.cut for e in engines) > 0, "no call was cut off: nothing was tested"
            assert sum(e.checked for e in engines) > ENGINES * 10  # it did read back
            check = await clients[0].self_check()
            assert check.ok, list(check.problems)
            await done_with_pages(clients)  # an engine releases with its patient client
            for stats in (await clients[0].pool_stats()).pools:
                assert stats.num_requests == 0, stats
                assert sum(t.used_pages for t in stats.tiers) == 0, stats
        finally:
            for engine in engines:
                engine.mapped.close()
            for c in clients:
                await c.close()
        assert kvd.proc.poll() is None, kvd.log()


# The suite runs three policies; KVD_CUT_OFF_POLICIES=all runs every one.
POLICIES = (("lru", "fair", "intent") if os.environ.get("KVD_CUT_OFF_POLICIES", "") != "all"
            else tuple(policy_names()))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("policy", POLICIES)
async def test_engines_whose_calls_are_cut_off_keep_their_bytes(tmp_path, policy, shape):
    await _cut_off(tmp_path, policy, SHAPES[shape], seed=sum(map(ord, policy + shape)))
