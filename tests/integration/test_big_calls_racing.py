"""Big calls racing each other, a slice at a time: two tenants' engines, each with requests of
its own, call kvd at once (allocate many blocks, free many, read all or many, release, store
and load long runs of shared prefix blocks, call again and so end their holds), on one kvd
whose slices are a few blocks, so that every call crosses slice boundaries with the other
engine's calls between its slices; under every policy, with device tiers small enough for
their calls to compete for room.

Each engine writes a pattern of its own into every block it is handed and checks every
block it reads: it holds what the engine wrote, or zeros where kvd said it must be
recomputed. A shared block's pattern is its key's (a key names its tokens: every engine
writes the same bytes): an engine writes those a store tells it to and commits them, and
checks every block a load hands it. After each round of calls kvd's invariants hold,
nothing is left in transit, every block an engine was handed and did not free is still its
request's, and every key a lookup finds holds its bytes. No call hangs: each round is
bounded.

KVD_BIG_RACE_EXAMPLES sets the examples per policy (`make soak` runs more).
"""

from __future__ import annotations

import asyncio
import hashlib
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.config import Config, PoolConfig, TenantConfig
from kvd.core.blocks import RequestState, TierKind
from kvd.core.errors import KvdError
from kvd.core.policies import policy_names
from kvd.node import Node

PAGE = 32
EXAMPLES = int(os.environ.get("KVD_BIG_RACE_EXAMPLES", "12"))
ENGINES = ("a", "b")
REQUESTS = ("r0", "r1")
ROUND_S = 30.0  # a round of calls kvd cannot finish in this long is stuck
NS = "racing"
# Two prompts' prefix chains: engines store and load leading runs of either.
CHAINS = [[b"chain%d-%d" % (c, i) for i in range(24)] for c in range(2)]


def _pattern(rid: str, index: int, generation: int) -> np.ndarray:
    seed = (sum(map(ord, rid)) * 7919 + index) * 104_729 + generation
    return np.random.default_rng(seed).integers(1, 256, PAGE, dtype=np.uint8)


def _key_pattern(key: bytes) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(1, 256, PAGE, dtype=np.uint8)


def _page(node: Node, block) -> np.ndarray:
    """The page a block's bytes are in, in whichever tier (both are mapped)."""
    tier = "device" if block.tier is TierKind.DEVICE else "host"
    assert block.tier in (TierKind.DEVICE, TierKind.HOST), f"{block} has no bytes"
    return node.runtime("default").arenas[tier].pages[block.page]


def check_shared(node: Node) -> None:
    """Every key a lookup finds holds its key's bytes."""
    for chain in CHAINS:
        for block, key in zip(node.shared.lookup("default", NS, chain), chain):
            assert np.array_equal(_page(node, block), _key_pattern(key)), (
                f"{key!r} ({block}): bytes differ from its key's")


class Engine:
    """One tenant's engine: its requests, and what it wrote into each block it holds."""

    def __init__(self, node: Node, tenant: str) -> None:
        self.node = node
        self.tenant = tenant
        self.holder = f"engine-{tenant}"
        self.written: dict[tuple[str, int], int] = {}  # (request, index) -> generation
        self.live: set[str] = set()
        self.generation = 0

    def rid(self, name: str) -> str:
        return f"{self.tenant}/{name}"

    def _device(self):
        return self.node.runtime("default").arenas["device"].pages

    def _write(self, block) -> None:
        self.generation += 1
        rid = block.request.request_id
        self._device()[block.page] = _pattern(rid, block.index, self.generation)
        self.written[(rid, block.index)] = self.generation

    def _check(self, blocks) -> None:
        for b in blocks:
            assert b.tier is TierKind.DEVICE, f"{b} handed out off the device"
            rid = b.request.request_id
            page = self._device()[b.page]
            if b.lost:
                b.lost = False  # the reply told the engine (see convert.handle)
                assert not page.any(), f"{b} came back for recompute holding bytes"
                self._write(b)  # it recomputes it
                continue
            want = _pattern(rid, b.index, self.written[(rid, b.index)])
            assert np.array_equal(page, want), f"{b}: bytes differ from what was written"

    async def call(self, op: tuple) -> None:
        """One call of the engine's: what it was handed before is no longer in use."""
        kind, name, n, pick = op
        node, rid = self.node, self.rid(name)
        node.end_holds(self.holder)
        try:
            if kind == "admit" or rid not in self.live:
                if rid not in self.live:
                    result = await node.admit_async(rid, tenant=self.tenant, pool="",
                                                    prompt_tokens=4 * n, output_tokens=0,
                                                    priority=0)
                    if result.decision.name != "ADMITTED":
                        await node.release(rid)
                        return
                    self.live.add(rid)
                return
            req = node.request(rid)
            mine = sorted(i for (r, i) in self.written if r == rid)
            if kind == "allocate":
                blocks, _ = await node.allocate(rid, n, holder=self.holder)
                assert len(blocks) == n
                for b in blocks:
                    self._write(b)
            elif kind == "free" and mine:
                chosen = mine[pick % len(mine):][:n] or mine[:n]
                freed = await node.free(rid, chosen)
                assert freed == len(chosen)
                for i in chosen:
                    del self.written[(rid, i)]
            elif kind == "read":
                indices = None if pick % 2 or not mine else mine[pick % len(mine):][:n]
                blocks, _, _ = await node.access(rid, indices, holder=self.holder)
                self._check(blocks)
            elif kind == "store":
                keys = CHAINS[pick % 2][:n]
                blocks, fresh, _ = await node.shared.store(rid, NS, keys, holder=self.holder)
                assert len(blocks) == len(fresh) == len(keys)
                written = []
                for b, to_write, key in zip(blocks, fresh, keys):
                    if to_write:
                        self._device()[b.page] = _key_pattern(key)
                        written.append(key)
                if written:
                    # The other engine may have stored the same keys at once, been told to
                    # write them too (the same bytes), and committed them first.
                    assert await node.shared.commit(rid, NS, written) <= len(written)
                    assert all(b.committed for b, to_write in zip(blocks, fresh) if to_write)
            elif kind == "load":
                keys = CHAINS[pick % 2][:n]
                blocks = await node.shared.load(rid, NS, keys, holder=self.holder)
                for b, key in zip(blocks, keys):
                    assert np.array_equal(_page(node, b), _key_pattern(key)), (
                        f"{key!r} ({b}): loaded bytes differ from its key's")
            elif kind == "release":
                freed, _ = await node.release(rid)
                assert freed == len(mine), (freed, len(mine))
                self.live.discard(rid)
                for i in mine:
                    del self.written[(rid, i)]
            assert req.state is RequestState.ADMITTED or kind == "release"
        except KvdError:
            pass  # no room, more than the device holds: refused, and nothing changed
        # Its forward pass done (the bytes written or checked), the engine says so before
        # the other engine's call ends: a call of the other's may wait for these pages.
        node.end_holds(self.holder)

    def check_kept(self) -> None:
        for (rid, index) in self.written:
            req = self.node.request(rid)
            assert index < len(req.blocks) and req.blocks[index] is not None, (
                f"{rid}[{index}] vanished")


OP = st.tuples(st.sampled_from(["allocate", "allocate", "free", "read", "read", "release",
                                "admit", "store", "store", "load"]),
               st.sampled_from(REQUESTS), st.integers(1, 24), st.integers(0, 1000))


@pytest.mark.parametrize("policy", policy_names())
def test_big_calls_racing_a_slice_at_a_time_lose_no_byte(policy):
    @settings(max_examples=EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(device=st.sampled_from([24, 48]), host=st.sampled_from([0, 24, 96]),
           slice_blocks=st.sampled_from([2, 3, 5]),
           rounds=st.lists(st.tuples(OP, OP), min_size=1, max_size=12))
    def run(device, host, slice_blocks, rounds):
        asyncio.run(_example(policy, device, host, slice_blocks, rounds))

    run()


async def _example(policy, device, host, slice_blocks, rounds) -> None:
    config = Config(socket="", tcp="127.0.0.1:0", slice_blocks=slice_blocks, hold_s=60.0,
                    pools=(PoolConfig(page_bytes=PAGE, block_tokens=4, device_pages=device,
                                      host_pages=host, policy=policy, device_backend="host",
                                      admission="reservation"),),
                    tenants=tuple(TenantConfig(t) for t in ENGINES))
    node = Node(config)
    try:
        engines = [Engine(node, t) for t in ENGINES]
        for engine in engines:
            await engine.call(("admit", REQUESTS[0], 24, 0))
        for ops in rounds:
            await asyncio.wait_for(asyncio.gather(*(
                e.call(op) for e, op in zip(engines, ops))), ROUND_S)
            await asyncio.sleep(0.005)  # holds ending a slice at a time
            assert await node.self_check() == []
            pool = node.runtime("default").pool
            assert pool.pages.num_moving_blocks() == 0, "left in transit"
            for engine in engines:
                engine.check_kept()
            check_shared(node)
    finally:
        await node.aclose()


RACING_KINDS = ["allocate", "read", "read", "store", "load", "free", "evict"]
RACING_OP = st.tuples(st.sampled_from(RACING_KINDS), st.sampled_from(("ra", "rb", "rc")),
                      st.integers(1, 4), st.integers(0, 9))


# A history of allocations, whole reads and evictions (the two reads' test).
HISTORY_OP = st.tuples(st.sampled_from(["allocate", "allocate", "read", "evict"]),
                       st.sampled_from(("ra", "rb", "rc")), st.integers(1, 4), st.just(1))


@pytest.mark.parametrize("policy", policy_names())
def test_two_whole_reads_racing_after_any_history_both_end(policy):
    """Two engines read a whole request each at once, after a history that left their
    blocks anywhere between the tiers: both reads end (see the test below). The case the
    general test below reaches too rarely to find: on the code before, it failed under 5
    of the 10 policies in one run (a read waited for ever)."""
    @settings(max_examples=EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(device=st.sampled_from([6, 8, 12]), host=st.sampled_from([4, 8, 12]),
           slice_blocks=st.sampled_from([1, 2]),
           setup=st.lists(HISTORY_OP, min_size=8, max_size=25),
           pair=st.sampled_from([("ra", "rb"), ("rb", "rc"), ("ra", "rc")]))
    def run(device, host, slice_blocks, setup, pair):
        racing = [("read", rid, 1, 1) for rid in pair]
        asyncio.run(_racing(policy, device, host, slice_blocks, setup, racing, "aaa"))

    run()


@pytest.mark.parametrize("policy", policy_names())
def test_calls_racing_after_any_history_all_end(policy):
    """Two or three engines' calls at once (allocations, reads whole and by index, stores,
    loads, frees, an operator's evict), after a history of such calls has left the
    requests' blocks anywhere between the tiers: every call ends (done, or refused), each
    engine's holds lapsing hold_s after its reply as kvd's do, and kvd's invariants hold.
    Reads bringing blocks in a slice at a time held what they had read while later slices
    waited for room, and two such reads could each wait for what the other held, for ever:
    neither call had answered, so neither's holds lapsed."""
    @settings(max_examples=EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(device=st.sampled_from([6, 8, 12]), host=st.sampled_from([2, 4, 8, 12]),
           slice_blocks=st.sampled_from([1, 2, 3]),
           setup=st.lists(RACING_OP, min_size=8, max_size=25),
           racing=st.lists(RACING_OP, min_size=2, max_size=3))
    def run(device, host, slice_blocks, setup, racing):
        asyncio.run(_racing(policy, device, host, slice_blocks, setup, racing, "aba"))

    run()


async def _racing_call(node: Node, op: tuple, holder: str) -> None:
    """One call of an engine's (its errors are kvd's refusals: no room, a block another
    call freed, ...)."""
    kind, rid, n, pick = op
    req = node.runtime_of(rid).pool.requests.get(rid)
    live = [b.index for b in req.live] if req is not None else []
    try:
        if kind == "allocate":
            await node.allocate(rid, n, holder=holder)
        elif kind == "read" and live:
            indices = None if pick % 2 else live[pick % len(live):][:3 * n]
            blocks, _, _ = await node.access(rid, indices, holder=holder)
            assert all(b.tier is TierKind.DEVICE and not b.moving for b in blocks)
        elif kind == "store":
            await node.shared.store(rid, NS, CHAINS[pick % 2][:3 * n], holder=holder)
        elif kind == "load":
            await node.shared.load(rid, NS, CHAINS[pick % 2][:3 * n], holder=holder)
        elif kind == "free" and live:
            await node.free(rid, live[:n])
        elif kind == "evict":
            await node.evict("default", n)
    except KvdError:
        pass


async def _racing(policy, device, host, slice_blocks, setup, racing, tenants: str) -> None:
    """`tenants`: the tenant of each request, ra's, rb's and rc's."""
    hold_s = 0.2
    node = Node(Config(socket="", tcp="127.0.0.1:0", slice_blocks=slice_blocks, hold_s=hold_s,
                       pools=(PoolConfig(page_bytes=PAGE, block_tokens=4, device_pages=device,
                                         host_pages=host, policy=policy,
                                         device_backend="host", admission="reservation"),),
                       tenants=tuple(TenantConfig(t) for t in ENGINES)))

    async def lapse() -> None:  # as kvd's background does
        while True:
            await asyncio.sleep(hold_s / 4)
            node.lapse_holds(hold_s)

    async def call(op: tuple, holder: str) -> None:
        try:
            await _racing_call(node, op, holder)
        finally:
            node.answered(holder)  # its reply

    lapsing = asyncio.ensure_future(lapse())
    try:
        for rid, tenant in zip(("ra", "rb", "rc"), tenants):
            # Up to a device's worth of blocks each (those kvd cannot hold too are queued).
            node.admit(rid, tenant=tenant, pool="", prompt_tokens=4 * device,
                       output_tokens=0, priority=0)
        for op in setup:
            await asyncio.wait_for(_racing_call(node, op, "setup"), ROUND_S)
            node.end_holds("setup")
        holders = [f"engine-{i}" for i in range(len(racing))]
        calls = [asyncio.ensure_future(call(op, h)) for op, h in zip(racing, holders)]
        _, stuck = await asyncio.wait(calls, timeout=20 * hold_s)
        for task in stuck:
            task.cancel()
        assert not stuck, f"{len(stuck)} call(s) waited for ever"
        for task in calls:
            task.result()
        for holder in holders:
            node.end_holds(holder)  # their engines' next calls
        await asyncio.sleep(0.005)  # holds ending a slice at a time
        assert await node.self_check() == []
        assert node.runtime("default").pool.pages.num_moving_blocks() == 0
    finally:
        lapsing.cancel()
        await node.aclose()
