"""Engines sharing prefix blocks at once, against one real kvd (its own process, real gRPC,
real arenas, real copies over a slow link): each engine, a tenant of its own, stores the
leading runs of three prompts' key chains, writes the fresh pages after a while (its forward
pass), commits them or dies first, loads what the others committed, grows and reads private
blocks, frees them, and starts new requests; an operator evicts meanwhile. Their calls are in
flight together: one waits for room while another's store, load, release or eviction moves
the blocks it is after.

Every key has its bytes (a key is its tokens' hash: whoever writes it writes the same), so
every page a Load hands out holds its key's bytes, when the reply comes and still when the
engine's next call goes (nothing may move it while the engine reads); a private block holds
what its engine wrote, or zeros where the reply said to recompute it. No call may fail but
with a documented refusal or take near its deadline, kvd's self-check holds throughout, and
nothing is left when the engines are done. A fifth engine steps on a Step stream meanwhile:
every block each step reads is where kvd said, holding what it wrote, until its next step.

KVD_PREFIX_CHAOS_STEPS sets the calls per engine, KVD_PREFIX_CHAOS_SEED their random choices;
KVD_PREFIX_CHAOS_POLICIES=all runs every policy.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random

import grpc
import numpy as np
import pytest

from kvd.core.policies import policy_names
from kvd_client import (AbortedError, AsyncClient, FailedPreconditionError,
                        ResourceExhaustedError, pb)
from kvd_client.arena import MappedPool
from kvd_loadgen.local import LocalKvd

PAGE = 16 * 1024
BLOCK_TOKENS = 16
ENGINES = 4
STEPS = int(os.environ.get("KVD_PREFIX_CHAOS_STEPS", "80"))  # per engine
SEED = int(os.environ.get("KVD_PREFIX_CHAOS_SEED", "0"))
DEADLINE_S = 10.0
NS = "tiny|salt"
# Three prompts' prefix chains, shared by every engine's requests.
CHAINS = [[hashlib.sha256(b"%s/%d" % (name, i)).digest() for i in range(5)]
          for name in (b"system", b"tools", b"other")]
# What a call may be refused with: no room now; blocks that moved under a store (store
# again); a commit of blocks dropped before it.
REFUSED = (ResourceExhaustedError, AbortedError, FailedPreconditionError)
# A Step item's: no room now (an allocation, a read that cannot be brought in now).
STEP_REFUSALS = {section: {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}
                 for section in ("allocations", "read_all")}

CONFIG = """
[server]
hold_s = 60

[[pool]]
page_bytes = {page}
block_tokens = {block_tokens}
device_pages = {device}
host_pages = {host}
policy = "{policy}"
link_bandwidth = "8MiB"
link_chunk = "16KiB"

[[tenant]]
name = "engine0"
token = "engine0-token"
guaranteed = 2

[[tenant]]
name = "engine1"
token = "engine1-token"
limit = {limit}

[[tenant]]
name = "engine2"
token = "engine2-token"
weight = 2.0

[[tenant]]
name = "engine3"
token = "engine3-token"

[[tenant]]
name = "engine4"
token = "engine4-token"
"""


def key_bytes(key: bytes) -> np.ndarray:
    return np.frombuffer((key * (PAGE // len(key) + 1))[:PAGE], np.uint8)


def private_bytes(rid: str, index: int, generation: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(f"{rid}/{index}/{generation}".encode()).digest()[:8])
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8)


class _Engine:
    """An engine: its client (its tenant, its lease), the arena it maps, its random choices,
    and its request (the `made`th it started)."""

    def __init__(self, wid: int, client: AsyncClient, mapped: MappedPool) -> None:
        self.name = f"engine{wid}"
        self.c = client
        self.mapped = mapped
        self.rng = random.Random(f"{SEED}/{wid}")
        self.rid: str | None = None
        self.made = 0


class Engine(_Engine):
    """One engine of unary calls: the pages its last call handed it to read, and its private
    blocks' bytes."""

    def __init__(self, wid: int, client: AsyncClient, mapped: MappedPool) -> None:
        super().__init__(wid, client, mapped)
        self.readable: list[tuple[pb.PageHandle, np.ndarray, str]] = []
        self.private: dict[int, np.ndarray] = {}
        self.generation = 0
        self.loaded = self.checked = 0

    def check(self, handle: pb.PageHandle, want: np.ndarray, what: str) -> None:
        got = self.mapped.read(handle)
        assert np.array_equal(got, want), (
            f"{self.name} {self.rid}: {what} at {pb.Tier.Name(handle.tier)} page "
            f"{handle.page_index} does not hold its bytes"
            f"{' (zeros)' if not got.any() else ''}")
        self.checked += 1

    async def call(self, make):
        """One call, after the engine is done with what it was handed (read once more: it
        may not have moved); a documented refusal is None."""
        for handle, want, what in self.readable:
            self.check(handle, want, what + ", before the next call")
        self.readable = []
        try:
            return await make()
        except REFUSED:
            return None

    async def forward(self) -> None:
        """The engine's forward pass: other engines' calls go on meanwhile."""
        await asyncio.sleep(self.rng.random() * 0.004)

    async def admit(self) -> None:
        if self.rid is not None:
            await self.call(lambda: self.c.release(self.rid))
            self.rid = None
        self.made += 1
        rid = f"{self.name}-r{self.made}"
        blocks = self.rng.randint(1, 4)
        reply = await self.call(lambda: self.c.admit(rid, blocks * BLOCK_TOKENS,
                                                     BLOCK_TOKENS))
        self.private, self.generation = {}, 0
        if reply is None or reply.decision == pb.DECISION_REJECTED:
            return
        if reply.decision == pb.DECISION_QUEUED:
            await self.call(lambda: self.c.release(rid))  # cancelled while it waits
            return
        self.rid = rid

    async def store(self) -> None:
        keys = self.rng.choice(CHAINS)[:self.rng.randint(1, 5)]
        pin = self.rng.random() < 0.2
        reply = await self.call(lambda: self.c.store(
            self.rid, NS, keys, intent=pb.MemoryIntent(pin_requested=True) if pin else None))
        if reply is None:
            return
        assert len(reply.handles) == len(reply.fresh) == len(keys)
        await self.forward()  # computes the blocks' KV, then writes the fresh ones
        if self.rng.random() < 0.15:  # dies before it writes: its request goes
            await self.call(lambda: self.c.release(self.rid))
            self.rid = None
            return
        for handle, fresh, key in zip(reply.handles, reply.fresh, keys):
            if fresh:
                self.mapped.write(handle, key_bytes(key))
        if self.rng.random() < 0.8:
            await self.call(lambda: self.c.commit(self.rid, NS, keys))

    async def load(self) -> None:
        chain = self.rng.choice(CHAINS)
        keys = chain[:self.rng.randint(1, 5)]
        pin = self.rng.random() < 0.2
        reply = await self.call(lambda: self.c.load(
            self.rid, NS, keys, intent=pb.MemoryIntent(pin_requested=True) if pin else None))
        if reply is None:
            return
        assert len(reply.handles) <= len(keys)
        for handle, key in zip(reply.handles, keys):
            what = f"prefix block {CHAINS.index(chain)}/{chain.index(key)}"
            self.check(handle, key_bytes(key), what)
            self.readable.append((handle, key_bytes(key), what))
        self.loaded += len(reply.handles)

    async def allocate(self) -> None:
        if len(self.private) >= 3:  # its reads fit the smallest device
            return
        reply = await self.call(lambda: self.c.allocate(self.rid, self.rng.randint(1, 2)))
        if reply is None:
            return
        await self.forward()
        self.generation += 1
        for h in reply.handles:
            data = private_bytes(self.rid, h.block_index, self.generation)
            self.mapped.write(h, data)
            self.private[h.block_index] = data

    async def access(self) -> None:
        if not self.private:
            return
        indices = sorted(self.rng.sample(sorted(self.private),
                                         self.rng.randint(1, len(self.private))))
        reply = await self.call(lambda: self.c.access(self.rid, indices))
        if reply is None:
            return
        assert sorted(h.block_index for h in reply.handles) == indices
        for h in reply.handles:
            want = self.private[h.block_index]
            if h.recompute:  # dropped: zeros, which the engine recomputes
                self.check(h, np.zeros(PAGE, np.uint8), f"recomputed block {h.block_index}")
                self.mapped.write(h, want)
            else:
                self.check(h, want, f"private block {h.block_index}")
                self.readable.append((h, want, f"private block {h.block_index}"))

    async def free(self) -> None:
        if len(self.private) > 1:
            index = self.rng.choice(sorted(self.private))
            if await self.call(lambda: self.c.free(self.rid, [index])) is not None:
                del self.private[index]

    async def lookup(self) -> None:
        keys = self.rng.choice(CHAINS)
        reply = await self.call(lambda: self.c.lookup(NS, keys))
        if reply is not None:
            assert 0 <= reply.num_hit <= len(keys)

    async def run(self, steps: int) -> None:
        ops = [self.store, self.store, self.load, self.load, self.allocate, self.access,
               self.free, self.lookup]
        for _ in range(steps):
            if self.rid is None or self.rng.random() < 0.12:
                await self.admit()
            else:
                await self.rng.choice(ops)()
            await self.forward()
        if self.rid is not None:
            await self.access()  # what it has is read back whole before it goes
            await self.call(lambda: self.c.release(self.rid))
            self.rid = None


class StepEngine(_Engine):
    """An engine on a Step stream beside them: each step reads every block of its request
    (four at most), and grows it or frees a block now and then; it writes what a step
    allocated, and checks every block a step read where kvd said it is (zeros where it said
    to recompute), and again before its next step."""

    def __init__(self, wid: int, client: AsyncClient, mapped: MappedPool) -> None:
        super().__init__(wid, client, mapped)
        self.where: dict[int, pb.PageHandle] = {}
        self.data: dict[int, np.ndarray] = {}
        self.readable: list[int] = []  # the blocks the last step read or handed out
        self.checked = 0

    def check(self, index: int) -> None:
        handle = self.where[index]
        assert handle.tier == pb.TIER_DEVICE, (self.name, self.rid, index, handle)
        assert np.array_equal(self.mapped.read(handle), self.data[index]), (
            f"{self.name} {self.rid}: block {index} at device page {handle.page_index} "
            f"does not hold what the engine wrote")
        self.checked += 1

    async def step(self, stream, **items) -> set[str]:
        """One step; the sections whose item failed (with a refusal: nothing else may). What
        the last step handed out was the engine's until now: it must not have moved."""
        for index in self.readable:
            self.check(index)
        self.readable = []
        reply = await stream.step(**items)
        failed = set()
        for e in reply.errors:
            assert e.code in STEP_REFUSALS.get(e.section, ()), (
                self.name, e.section, e.code, e.message)
            failed.add(e.section)
        if "frees" not in failed:
            for _, indices in items.get("frees", ()):
                for index in indices:
                    del self.where[index], self.data[index]
        for h in reply.allocated:
            assert h.block_index not in self.where, (self.name, "handed out twice", h)
            self.where[h.block_index] = h
            self.data[h.block_index] = private_bytes(self.rid, h.block_index, self.made)
            self.mapped.write(h, self.data[h.block_index])
        for h in reply.relocated:
            assert h.block_index in self.where, (self.name, "told of a block it lacks", h)
            self.where[h.block_index] = h
            if h.recompute:  # dropped and back: zeros until the engine recomputes it
                assert not self.mapped.read(h).any(), (self.name, h, "not zeroed")
                self.mapped.write(h, self.data[h.block_index])
        if "read_all" not in failed and items.get("read_all"):
            for index in self.where:
                self.check(index)
            self.readable = list(self.where)
        else:
            self.readable = [h.block_index for h in reply.allocated]
        return failed

    async def run(self, steps: int) -> None:
        async with self.c.step_stream() as stream:
            for _ in range(steps):
                if self.rid is None or self.rng.random() < 0.06:
                    if self.rid is not None:
                        await self.step(stream, releases=[self.rid])
                        self.rid, self.where, self.data, self.readable = None, {}, {}, []
                    self.made += 1
                    rid = f"{self.name}-r{self.made}"
                    reply = await self.c.admit(rid, BLOCK_TOKENS, 3 * BLOCK_TOKENS)
                    if reply.decision == pb.DECISION_ADMITTED:
                        self.rid = rid
                    elif reply.decision == pb.DECISION_QUEUED:
                        await self.c.release(rid)
                else:
                    items = {"read_all": [self.rid]}
                    if not self.where or (len(self.where) < 4 and self.rng.random() < 0.3):
                        items["allocations"] = [(self.rid, 1)]
                    elif len(self.where) > 1 and self.rng.random() < 0.2:
                        items["frees"] = [(self.rid, [self.rng.choice(sorted(self.where))])]
                    await self.step(stream, **items)
                await asyncio.sleep(self.rng.random() * 0.004)  # its forward pass
            if self.rid is not None:
                await self.step(stream, read_all=[self.rid])
                await self.step(stream, releases=[self.rid])
                # Its blocks went with it: a next round's request starts with none.
                self.rid, self.where, self.data, self.readable = None, {}, {}, []


async def operator(c: AsyncClient, stop: asyncio.Event, checks: list) -> None:
    """The operator evicts now and then and checks kvd throughout."""
    rng = random.Random(f"{SEED}/operator")
    while not stop.is_set():
        check = await c.self_check()
        assert check.ok, list(check.problems)
        checks.append(1)
        if rng.random() < 0.5:
            try:
                await c.evict(rng.randint(1, 3))
            except ResourceExhaustedError:
                pass  # nothing the policy may give now
        await asyncio.sleep(0.02)


async def _chaos(tmp_path, policy: str, device: int, host: int) -> None:
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG.format(page=PAGE, block_tokens=BLOCK_TOKENS, device=device,
                                    host=host, policy=policy, limit=device // 2))
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        admin = AsyncClient(kvd.target, timeout_s=DEADLINE_S)
        clients = [AsyncClient(kvd.target, timeout_s=DEADLINE_S, token=f"engine{i}-token")
                   for i in range(ENGINES + 1)]
        mapped = None
        try:
            for c in (admin, *clients):
                await c.__aenter__()
            mapped = MappedPool(await admin.export_pool())
            engines = [Engine(i, c, mapped) for i, c in enumerate(clients[:ENGINES])]
            stepper = StepEngine(ENGINES, clients[ENGINES], mapped)
            stop, checks = asyncio.Event(), []
            watch = asyncio.ensure_future(operator(admin, stop, checks))
            try:
                await asyncio.gather(*(e.run(STEPS) for e in (*engines, stepper)))
                for _ in range(4):
                    # A crowded device refuses many calls, and the engines' timing decides
                    # how many: more rounds until enough was read back to mean something.
                    if (sum(e.checked for e in engines) > ENGINES * 3
                            and sum(e.loaded for e in engines) > 0 and stepper.checked > 0):
                        break
                    await asyncio.gather(*(e.run(STEPS) for e in (*engines, stepper)))
            finally:
                stop.set()
                await watch
            assert checks, "the operator never checked"
            assert sum(e.checked for e in engines) > ENGINES * 3, "little was read back"
            assert sum(e.loaded for e in engines) > 0, "no prefix block was ever loaded"
            assert stepper.checked > 0, "the Step engine read nothing back"
            check = await admin.self_check()
            assert check.ok, list(check.problems)
            stats = (await admin.pool_stats()).pools[0]
            assert stats.num_requests == 0, stats
        finally:
            if mapped is not None:
                mapped.close()
            for c in (admin, *clients):
                await c.close()
        assert kvd.proc.poll() is None, kvd.log()


# The suite runs four policies; KVD_PREFIX_CHAOS_POLICIES=all runs every one.
POLICIES = (("lru", "fair", "intent", "reuse")
            if os.environ.get("KVD_PREFIX_CHAOS_POLICIES", "") != "all"
            else tuple(policy_names()))
# (device pages, host pages): kept prefixes and requests crowd a device that one request's
# reads nearly fill, and a host that fills (kept blocks are dropped then); less crowded; and
# room for every key kept.
SIZES = [(5, 3), (8, 6), (14, 24)]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"device{s[0]}-host{s[1]}")
@pytest.mark.parametrize("policy", POLICIES)
async def test_engines_sharing_prefixes_at_once_read_only_written_bytes(tmp_path, policy,
                                                                        size):
    await _chaos(tmp_path, policy, *size)
