"""Calls on a request that race each other, against one real kvd with prefill and decode
pools over slow links: while the request's blocks are being copied (a handoff, a read that
brings them back from the host tier), the engine (several of its threads at once) releases
the request, frees blocks, reads, allocates, pins or hands it off again, on calls or Step
streams of their own, and the operator evicts, switches a pool's policy or lowers the
tenant's limit; now and then a second request's calls race beside them, for the same pages
and links. The engine writes a distinct pattern into every block it is handed.

Once every call has ended, for each request: one whose release was answered OK is gone;
otherwise kvd holds it in one pool, with exactly the blocks the engine has (those whose frees
were answered OK are gone, those handed out are there), each holding what the engine wrote.
Then no page and no reservation is left in either pool. A call is answered OK or with a
documented refusal: NOT_FOUND only once a release of the request went through (or, for a
call naming a block, once that block's free did), and nothing may hang.

The other property tests run an engine's calls one after another, each waiting for the last:
none of these races came up there.

KVD_RACE_EXAMPLES sets the examples per policy (`make soak` runs more).
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from kvd.core.policies import policy_names
from kvd_client import AsyncClient, KvdClientError, pb
from kvd_client.arena import MappedPool
from kvd_client.client import intent_update
from kvd_loadgen.local import LocalKvd

from .conftest import done_with_pages

EXAMPLES = int(os.environ.get("KVD_RACE_EXAMPLES", "20"))
PAGE = 16 * 1024  # the tiny model: 1 KiB a token, 16 tokens a page
# Slow links: a handoff of 6 blocks takes ~0.2 s, a block read back from the host ~30 ms;
# the racing calls land within 0.25 s of the first.
POOL = """
[[pool]]
name = "{name}"
model = "tiny"
device_pages = 12
host_pages = 16
policy = "{policy}"
admission = "reservation"
link_bandwidth = "512KiB"
link_chunk = "16KiB"
"""
CONFIG = ("""
[server]
handoff_ttl_s = 30
slice_blocks = {slice_blocks}
""" + POOL.replace("{name}", "prefill") + POOL.replace("{name}", "decode") + """
[[link]]
source = "prefill"
target = "decode"
bandwidth = "512KiB"
chunk = "16KiB"
""")
KINDS = ["handoff", "handoff", "cancelled_handoff", "release", "free", "free", "access",
         "read", "allocate", "pin", "unpin", "evict", "step_read", "step_free", "decode",
         "policy", "quota", "store"]
CODE = grpc.StatusCode
# What each call may be refused with (NOT_FOUND, only once a release went through, or for a
# pin or a read by index, once the free of a block it names did).
REFUSALS = {
    "handoff": {CODE.FAILED_PRECONDITION, CODE.RESOURCE_EXHAUSTED, CODE.INVALID_ARGUMENT},
    "release": set(),
    "free": set(),
    "access": {CODE.RESOURCE_EXHAUSTED},
    "read": {CODE.RESOURCE_EXHAUSTED},
    "allocate": {CODE.FAILED_PRECONDITION, CODE.RESOURCE_EXHAUSTED},
    # Refused while its request is handed off or once it left the pool (FAILED_PRECONDITION,
    # as its commit is for a block dropped before it); no room; found blocks evicted.
    "store": {CODE.FAILED_PRECONDITION, CODE.RESOURCE_EXHAUSTED, CODE.ABORTED},
    "pin": {CODE.RESOURCE_EXHAUSTED, CODE.FAILED_PRECONDITION},
    "evict": {CODE.FAILED_PRECONDITION, CODE.RESOURCE_EXHAUSTED},
    "policy": set(),
    "quota": set(),
    # A Step's items, by section.
    "read_all": {CODE.RESOURCE_EXHAUSTED},
    "frees": set(),
}
STUCK_S = 20.0
POLICIES = policy_names()
# The calls that name one of the request's blocks by index.
BY_INDEX = ("read", "pin", "unpin")
# A prompt's prefix blocks, which requests store and commit before the calls race (a
# handoff carries them to decode): the same keys in every example, and the same bytes
# whoever writes them (a key is its tokens' hash).
NS = "races"
PREFIX = [b"races-prefix/%d" % i for i in range(3)]


def _code(number: int) -> CODE:
    return next(code for code in CODE if code.value[0] == number)


def prefix_bytes(key: bytes) -> np.ndarray:
    return pattern(key.decode(), 0)


def pattern(rid: str, index: int) -> np.ndarray:
    seed = (hash((rid, index)) & 0xFFFFFFFF) or 1
    return np.random.default_rng(seed).integers(1, 256, PAGE, dtype=np.uint8)


@st.composite
def _race(draw):
    """Requests (their block counts: one request, or two whose calls race too), pages the
    operator demotes first, the calls: (request, kind, delay in ms, argument), and how many
    of the shared prefix's blocks each request stored and committed first."""
    sizes = draw(st.lists(st.integers(0, 6), min_size=1, max_size=2))
    evicted = draw(st.integers(0, sum(sizes)))  # some are read back over the link
    frees = [iter(draw(st.permutations(range(n)))) for n in sizes]  # each free, its own block
    calls = []
    for _ in range(draw(st.integers(1, 5))):
        who, kind = draw(st.integers(0, len(sizes) - 1)), draw(st.sampled_from(KINDS))
        arg = (next(frees[who], None) if kind in ("free", "step_free")
               else None if not sizes[who] and kind in BY_INDEX
               else draw(st.integers(0, max(sizes[who], 1) - 1)))
        if arg is not None:
            calls.append((who, kind, draw(st.integers(0, 250)), arg))
    prefixes = draw(st.lists(st.integers(0, len(PREFIX)), min_size=len(sizes),
                             max_size=len(sizes)))
    return sizes, evicted, calls, prefixes


class Race:
    """One request, the calls racing on it, and what the engine learnt from their answers."""

    def __init__(self, client: AsyncClient, maps: dict[str, MappedPool], rid: str) -> None:
        self.c, self.maps, self.rid = client, maps, rid
        self.blocks: set[int] = set()  # the engine's blocks
        self.unwritten: set[int] = set()  # handed out while a handoff may have copied them
        self.refused: list[tuple[str, int, CODE, str]] = []
        self.freed: set[int] = set()  # blocks whose frees were answered OK
        self.released = False
        self.first_blocks = 0
        self.prefix: list[bytes] = []  # the prefix blocks it stored and committed

    def write(self, handles, racing_handoff: bool) -> None:
        for h in handles:
            self.maps[h.pool or "prefill"].write(h, pattern(self.rid, h.block_index))
            self.blocks.add(h.block_index)
            if racing_handoff:
                # Written once the answer came; a handoff under way may have copied the
                # page before that (the engine's race, not kvd's): its bytes are not
                # checked.
                self.unwritten.add(h.block_index)

    async def call(self, kind: str, delay_ms: int, arg: int, racing_handoff: bool) -> None:
        await asyncio.sleep(delay_ms / 1000)
        c, rid = self.c, self.rid
        try:
            if kind in ("handoff", "cancelled_handoff"):
                async for _ in c.handoff(rid, "decode"):
                    if kind == "cancelled_handoff":
                        break  # the engine goes away mid-copy: all or nothing
            elif kind == "release":
                await c.release(rid)
                self.released = True
            elif kind == "free":
                await c.free(rid, [arg])
                self.blocks.discard(arg)
                self.freed.add(arg)
            elif kind == "access":  # every block the request has
                await c.access(rid)
            elif kind == "read":  # the blocks from `arg` on, by index
                await c.access(rid, list(range(arg, self.first_blocks)))
            elif kind == "allocate":
                self.write((await c.allocate(rid, 1)).handles, racing_handoff)
            elif kind == "store":  # one of the prompt's prefix blocks: written, committed
                key = PREFIX[arg % len(PREFIX)]
                reply = await c.store(rid, NS, [key])
                for h, fresh in zip(reply.handles, reply.fresh):
                    if fresh:
                        self.maps[h.pool or "prefill"].write(h, prefix_bytes(key))
                await c.commit(rid, NS, [key])
            elif kind in ("pin", "unpin"):
                await c.update_intents([intent_update(rid, arg, pin_requested=kind == "pin")])
            elif kind == "evict":
                await c.evict(arg + 1, pool="prefill")
            elif kind == "policy":  # the operator switches a pool's policy
                await c.set_policy(POLICIES[arg % len(POLICIES)],
                                   pool=("prefill", "decode")[arg % 2])
            elif kind == "quota":  # the operator lowers the tenant's limit in a pool
                await c.set_quota("default", pool=("prefill", "decode")[arg % 2],
                                  limit_pages=2 + arg, create=True)
            else:  # an engine's steps on a stream of its own: read it all (and free a block)
                frees = [(rid, [arg])] if kind == "step_free" else []
                errors = []
                async with c.step_stream() as stream:
                    for i in range(4 if kind == "decode" else 1):  # decode: the same again
                        if i:
                            await asyncio.sleep(0.015)
                        errors += (await stream.step(frees=frees, read_all=[rid])).errors
                for error in errors:
                    self.refused.append((error.section, arg, _code(error.code), error.message))
                if frees and not any(e.section == "frees" for e in errors):
                    self.blocks.discard(arg)
                    self.freed.add(arg)
        except KvdClientError as exc:
            self.refused.append((kind, arg, exc.code, str(exc)))

    def check_refusals(self) -> None:
        for kind, arg, code, text in self.refused:
            pin = kind in ("pin", "unpin")
            allowed = REFUSALS["pin" if pin else
                              "handoff" if kind == "cancelled_handoff" else kind]
            named = ({arg} if pin else set(range(arg, self.first_blocks)) if kind == "read"
                     else set())
            if code is CODE.NOT_FOUND and (self.released or named & self.freed):
                continue
            assert code in allowed, f"{kind} refused with {code.name}: {text}"


    async def check_whole_or_gone(self, calls) -> None:
        """Released: gone. Else whole in one pool, every block holding what the engine
        wrote; then released, by the engine."""
        client, rid = self.c, self.rid
        found = await _one_pool(client, rid)
        if self.released:
            assert found == [], f"released, and kvd still holds it: {found}"
            return
        assert len(found) == 1, f"kvd holds the request {len(found)} times: {found}"
        assert found[0].num_blocks == len(self.blocks), (found[0], self.blocks)
        handles = (await client.access(rid)).handles
        assert sorted(h.block_index for h in handles) == sorted(self.blocks)
        for h in handles:
            if h.block_index in self.unwritten:
                continue
            page = self.maps[h.pool or "prefill"].read(h)
            want = (np.zeros(PAGE, np.uint8) if h.recompute
                    else pattern(rid, h.block_index))
            assert np.array_equal(page, want), (
                f"{rid} block {h.block_index} ({h.pool} page {h.page_index}) does not "
                f"hold what the engine wrote; calls {calls}")
        if self.prefix:  # the prefix it committed, wherever the request is now
            for h, key in zip((await client.load(rid, NS, self.prefix)).handles, self.prefix):
                assert np.array_equal(self.maps[h.pool or "prefill"].read(h),
                                      prefix_bytes(key)), (
                    f"{rid} prefix block {key!r} ({h.pool} page {h.page_index}) does not "
                    f"hold its bytes; calls {calls}")
        await client.release(rid)


async def _pools(client: AsyncClient) -> dict[str, pb.PoolStats]:
    return {p.pool: p for p in (await client.pool_stats()).pools}


async def _one_pool(client: AsyncClient, rid: str) -> list[pb.RequestInfo]:
    """The request's entries once a cancelled handoff has settled (rolled back, or gone
    through before the cancel came); not its reservation in the decode pool."""
    for _ in range(200):
        found = [r for r in await client.list_requests()
                 if r.request_id == rid and r.state != "reserved"]
        if len(found) <= 1:
            return found
        await asyncio.sleep(0.01)
    return found


async def _example(client, maps, n: int, sizes: list[int], evicted: int, calls,
                   prefixes: list[int]) -> None:
    races = [Race(client, maps, f"r{n}-{i}") for i in range(len(sizes))]
    try:
        for race, blocks, stored in zip(races, sizes, prefixes):
            # Its prompt: its own blocks and the prefix it stores.
            admitted = await client.admit(race.rid, 16 * max(1, blocks + stored), 32,
                                          pool="prefill", handoff_pool="decode")
            assert admitted.decision == pb.DECISION_ADMITTED
            if blocks:
                race.write((await client.allocate(race.rid, blocks)).handles,
                           racing_handoff=False)
            race.first_blocks = blocks
        for race, stored in zip(races, prefixes):
            if stored:
                keys = PREFIX[:stored]
                reply = await client.store(race.rid, NS, keys)
                for h, fresh, key in zip(reply.handles, reply.fresh, keys):
                    if fresh:
                        maps[h.pool or "prefill"].write(h, prefix_bytes(key))
                await client.commit(race.rid, NS, keys)
                race.prefix = keys
        if evicted:
            await client.evict(evicted, pool="prefill")
        handed = {who for who, kind, _, _ in calls if kind.endswith("handoff")}
        tasks = [asyncio.ensure_future(races[who].call(kind, delay, arg, who in handed))
                 for who, kind, delay, arg in calls]
        if tasks:  # none where each call drawn named a block its request did not have
            done, pending = await asyncio.wait(tasks, timeout=STUCK_S)
            assert not pending, f"calls stuck for {STUCK_S} s: {calls}"
            for task in done:
                task.result()
        for race in races:
            race.check_refusals()
            await race.check_whole_or_gone(calls)
        # Nothing is left behind: no page but the prefix blocks kept for the next requests,
        # no reservation, in either pool. (A release that raced a call handing out pages
        # keeps them out of use until the client's next call: this one.)
        await done_with_pages([client])
        for name, stats in (await _pools(client)).items():
            kept = sum([(await client.lookup(NS, [key], pool=name)).num_hit
                        for key in PREFIX])
            assert sum(t.used_pages for t in stats.tiers) == kept, (name, kept, stats)
            assert stats.reserved_pages == stats.handoff_reserved_pages == 0, (name, stats)
        assert (await client.self_check()).ok
    finally:  # the next example starts on an empty kvd, with no limit
        for race in races:
            with contextlib.suppress(KvdClientError):
                await client.release(race.rid)
        for pool in ("prefill", "decode"):
            await client.set_quota("default", pool=pool, limit_pages=0, create=True)


# Each race the first versions of this test found, once for sure.
EXPLICIT = [
    ([6], 0, [(0, "handoff", 0, 0), (0, "release", 30, 0)], [0]),
    ([6], 0, [(0, "handoff", 0, 0), (0, "free", 30, 1)], [0]),
    ([6], 0, [(0, "handoff", 0, 0), (0, "access", 30, 0)], [0]),
    ([6], 0, [(0, "handoff", 0, 0), (0, "allocate", 30, 0)], [0]),
    ([4], 0, [(0, "free", 0, 2), (0, "free", 0, 3), (0, "handoff", 30, 0),
              (0, "unpin", 300, 2)], [0]),
    ([6], 6, [(0, "access", 0, 0), (0, "release", 20, 0)], [0]),
    ([6], 3, [(0, "read", 0, 0), (0, "free", 5, 0), (0, "free", 5, 1), (0, "free", 5, 2),
              (0, "free", 5, 3), (0, "free", 5, 4)], [0]),
    ([6], 0, [(0, "cancelled_handoff", 0, 0), (0, "release", 10, 0), (0, "access", 20, 0)],
     [0]),
    # A request with no block of its own hands off the prefix it committed; a release went
    # through at once, and the handoff's commit then made it live in decode again.
    ([0], 0, [(0, "handoff", 0, 0), (0, "release", 30, 0)], [3]),
    # A read bringing its evicted blocks in a slice at a time; the handoff, which does not
    # wait for its own client's holds, committed between two slices: the read was refused
    # (FAILED_PRECONDITION) where a read done whole follows the request to decode.
    ([5], 4, [(0, "read", 107, 0), (0, "handoff", 53, 4)], [0]),
]


@pytest.mark.timeout(max(180, EXAMPLES * 8))
# Slices of two blocks: allocations, frees, releases, replies and holds ending that name
# more go a slice at a time, with the loop (and the racing calls) served between slices.
@pytest.mark.parametrize("policy, slice_blocks", [("lru", 256), ("fair", 256), ("lru", 2),
                                                  ("fair", 2)])
def test_calls_racing_on_one_request_leave_it_whole_or_gone(tmp_path, policy, slice_blocks):
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG.format(policy=policy, slice_blocks=slice_blocks))
    loop = asyncio.new_event_loop()  # one loop for every example: grpc.aio keeps to it

    # No shrinking: kvd lives on across examples, so a replay is not the same run.
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(race=_race())
    def run(race):
        loop.run_until_complete(_example(client, maps, next(counter), *race))

    for race in EXPLICIT:
        run = example(race=race)(run)

    counter = iter(range(10**6))
    try:
        with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
            async def connect() -> AsyncClient:  # on the loop the examples run on
                return AsyncClient(kvd.target, timeout_s=STUCK_S)

            client = loop.run_until_complete(connect())
            maps: dict[str, MappedPool] = {}
            try:
                for name in ("prefill", "decode"):
                    maps[name] = MappedPool(loop.run_until_complete(client.export_pool(name)))
                run()
                assert kvd.proc.poll() is None, f"kvd died:\n{kvd.log()}"
            finally:
                for mapped in maps.values():
                    mapped.close()
                loop.run_until_complete(client.close())
    finally:
        loop.close()
