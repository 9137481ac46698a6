"""Prefix-block calls in flight together, in orders hypothesis chooses: three engines and an
operator on one kvd (its own process, real gRPC, real arenas) whose host link is slow, so
that a call that moves a page (a victim copied out to make room, a kept block brought in)
stays unanswered while the others' calls go on. Each operation starts one engine's call
without waiting for its reply, takes a reply in (the engine then acts on it), lets the
copies run a while, or has an engine die with its call still in flight.

test_prefix_machine makes one call at a time and test_prefix_chaos makes them at once in
random timings; this one decides which call is in flight while which other starts, and
which reply is taken in first: a store whose reply waits on a victim's copy while another
request stores, commits or loads the same key, a commit before or after the store that
placed the block answers, a load of a block being brought in, an eviction or a dead
engine's release in between.

The engines act as real ones do: an engine writes the fresh pages its Store reply names and
reads the pages a Load or Access hands it after the reply and before its next call (checked
then: nothing may move them meanwhile). Every key has its bytes (whoever writes it writes
the same), so every page a Load hands out holds its key's bytes; a private block holds what
its engine wrote, or zeros where the reply said to recompute it. A call may be refused only
as documented, and none may hang; kvd's self-check holds after every operation, and nothing
is left when the engines are done.

The second test runs the same engines on a prefill and a decode pool, and hands requests off
from one to the other among those calls: a handoff carries its request's blocks and the
committed prefix blocks it used that decode lacks, while others store, commit and load the
same keys there, and an engine may die with its handoff in flight (rolled back). The
handed-off request's blocks must hold what its engine wrote, where the handoff says.

KVD_PREFIX_OVERLAP_EXAMPLES sets the examples per device size (`make soak` runs more).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from kvd.core.policies import policy_names
from kvd_client import (AbortedError, AsyncClient, FailedPreconditionError, KvdClientError,
                        ResourceExhaustedError, pb)
from kvd_client.arena import MappedPool
from kvd_loadgen.local import LocalKvd

from .conftest import QUOTAS, engine_clients, machine_kvd, size_id

PAGE_BYTES = 1024
BLOCK_TOKENS = 16
EXAMPLES = int(os.environ.get("KVD_PREFIX_OVERLAP_EXAMPLES", "20"))
OPS = 40
STUCK_S = 20.0
NS = "tiny|salt"
# A page crosses the link in about 30 ms, and the link holds no credit to spare (a byte's
# burst): every copy is a transfer the calls that need it wait for, and one after another
# they wait tens of milliseconds, while an operation takes a few.
SLOW_LINK = '\nlink_bandwidth = "32KiB"\nlink_chunk = "1KiB"\nlink_burst = "1"\n'
CHAINS = [[hashlib.sha256(b"%s/%d" % (name, i)).digest() for i in range(5)]
          for name in (b"system", b"other")]
# (device pages, host pages, tenants): a device kept prefixes and one request fill; more
# room, all engines one tenant; more still, each engine a tenant with quotas.
SIZES = [(5, 6, True), (8, 6, False), (10, 8, QUOTAS)]
# A call's documented refusals: no room now; blocks that moved under a store (store again);
# a commit of blocks dropped before it.
REFUSED = (ResourceExhaustedError, AbortedError, FailedPreconditionError)


def key_bytes(key: bytes) -> np.ndarray:
    return np.frombuffer((key * (PAGE_BYTES // len(key) + 1))[:PAGE_BYTES], np.uint8)


def private_bytes(rid: str, index: int, generation: int) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(f"{rid}/{index}/{generation}".encode()).digest()
                         * (PAGE_BYTES // 32), np.uint8)


class Actor:
    """An engine or the operator: at most one call in flight (`pending`: its task, and
    what to do with its reply)."""

    def __init__(self, name: str, client: AsyncClient) -> None:
        self.name = name
        self.client = client
        self.pending: tuple[asyncio.Task, object] | None = None

    def between_calls(self) -> None:
        pass

    def start(self, make, then=None) -> None:
        """Start a call (the engine first does what it owes before its next one)."""
        assert self.pending is None
        self.between_calls()
        self.pending = (asyncio.ensure_future(make()), then)

    def settle(self) -> None:
        """Act on the reply of the call in flight, which has come."""
        task, then = self.pending
        self.pending = None
        try:
            reply = task.result()
        except REFUSED:
            return
        if then is not None:
            then(reply)


class Engine(Actor):
    """One engine: its request, what it owes kvd before its next call (the fresh pages of
    its last Store), the pages its last reply handed it to read, its private blocks."""

    def __init__(self, name: str, client: AsyncClient, maps: dict[str, MappedPool]) -> None:
        super().__init__(name, client)
        self.maps = maps  # each pool's arenas, by name
        self.pool = ""  # its request's pool
        self.rid: str | None = None
        self.made = 0
        self.generation = 0
        self.to_write: list[tuple[pb.PageHandle, bytes]] = []
        self.stored: list[bytes] = []  # the keys of its last Store
        self.written: list[bytes] = []  # those it wrote and has not committed
        self.readable: list[tuple[pb.PageHandle, np.ndarray, str]] = []
        self.private: dict[int, np.ndarray] = {}
        self.loaded = self.checked = self.handed = 0

    def check(self, handle: pb.PageHandle, want: np.ndarray, what: str) -> None:
        got = self.maps[handle.pool].read(handle)[:len(want)]
        assert np.array_equal(got, want), (
            f"{self.name} {self.rid}: {what} at {handle.pool} {pb.Tier.Name(handle.tier)} "
            f"page {handle.page_index} does not hold its bytes"
            f"{' (zeros)' if not got.any() else ''}")

    def write(self, handle: pb.PageHandle, data: np.ndarray) -> None:
        self.maps[handle.pool].write(handle, data)
        self.checked += 1

    def between_calls(self) -> None:
        """Read what the last reply handed out (it may not have moved), write what the last
        Store said to."""
        for handle, want, what in self.readable:
            self.check(handle, want, what + ", before the next call")
        self.readable = []
        for handle, key in self.to_write:
            self.write(handle, key_bytes(key))
            self.written.append(key)
        self.to_write = []

    def die(self) -> None:
        """Its engine dies: the call in flight goes unanswered, nothing it owed is written."""
        if self.pending is not None:
            self.pending[0].cancel()
            self.pending = None
        self.to_write, self.written, self.readable = [], [], []

    # What the engine does with each reply.

    def admitted(self, rid: str, pool: str):
        def then(reply: pb.AdmitResponse) -> None:
            if reply.decision == pb.DECISION_ADMITTED:
                self.rid, self.pool = rid, pool
            elif reply.decision == pb.DECISION_QUEUED:  # cancelled while it waits
                self.pending = (asyncio.ensure_future(self.client.release(rid)), None)
        return then

    def stored_keys(self, keys: list[bytes]):
        def then(reply: pb.StoreResponse) -> None:
            assert len(reply.handles) == len(reply.fresh) == len(keys)
            self.stored = keys
            self.to_write = [(h, k) for h, fresh, k in zip(reply.handles, reply.fresh, keys)
                             if fresh]
        return then

    def loaded_keys(self, chain: int, keys: list[bytes]):
        def then(reply: pb.LoadResponse) -> None:
            assert len(reply.handles) <= len(keys)
            for handle, key in zip(reply.handles, keys):
                what = f"prefix block {chain}/{CHAINS[chain].index(key)}"
                self.check(handle, key_bytes(key), what)
                self.readable.append((handle, key_bytes(key), what))
            self.loaded += len(reply.handles)
        return then

    def allocated(self, reply: pb.AllocateResponse) -> None:
        self.generation += 1
        for h in reply.handles:
            data = private_bytes(self.rid, h.block_index, self.generation)
            self.write(h, data)
            self.private[h.block_index] = data

    def accessed(self, indices: list[int]):
        def then(reply: pb.AccessResponse) -> None:
            assert sorted(h.block_index for h in reply.handles) == indices
            self.read_private(reply.handles)
        return then

    def read_private(self, handles) -> None:
        """Read the private blocks these handles name (and recompute the dropped ones)."""
        for h in handles:
            want = self.private[h.block_index]
            if h.recompute:  # dropped: zeros, which the engine recomputes
                self.check(h, np.zeros(PAGE_BYTES, np.uint8), f"recomputed block {h.block_index}")
                self.write(h, want)
            else:
                self.check(h, want, f"private block {h.block_index}")
                self.readable.append((h, want, f"private block {h.block_index}"))

    def handed_off(self, reply: pb.HandoffProgress) -> None:
        """The request is the target pool's now: its blocks are where the last message
        says, holding what the engine wrote (the decode engine reads them)."""
        assert reply.done, reply
        assert sorted(h.block_index for h in reply.handles) == sorted(self.private), (
            self.private.keys(), reply)
        self.pool = reply.pool
        self.handed += 1
        self.read_private(reply.handles)


class Run:
    """One example's actors: engines 0-2 and the operator (3), on a kvd with these pools
    (with two, the first hands requests off to the second)."""

    def __init__(self, engines: list[Engine], operator: Actor, pools: list[str]) -> None:
        self.engines = engines
        self.actors: list[Actor] = [*engines, operator]
        self.pools = pools

    async def finish(self, actor: Actor) -> None:
        """Take in the actor's reply. A call may wait for pages the others hold until their
        next calls: when it has not come soon, the others act on the replies they have,
        and those with no call in flight make one (a KeepAlive); it must come then."""
        while actor.pending is not None:
            task = actor.pending[0]
            done, _ = await asyncio.wait([task], timeout=0.5)
            if not done:
                for other in self.actors:
                    if other is not actor:
                        await self.free_holds(other)
                done, _ = await asyncio.wait([task], timeout=STUCK_S)
                assert done, f"{actor.name}: a call waited {STUCK_S} s"
            actor.settle()  # an admit that queued goes on with its release

    async def free_holds(self, actor: Actor) -> None:
        """The actor acts on a reply that has come and, with nothing in flight, calls."""
        if actor.pending is not None and actor.pending[0].done():
            actor.settle()
        if actor.pending is None:
            actor.between_calls()
            await actor.client.keep_alive()

    async def start(self, which: int, kind: int, a: int, b: int) -> None:
        actor = self.actors[which]
        await self.finish(actor)
        c = actor.client
        if actor is self.actors[-1]:  # the operator
            pool = self.pools[a % len(self.pools)]
            if kind % 3 == 0:
                policy = policy_names()[b % len(policy_names())]
                actor.start(lambda: c.set_policy(policy, pool=pool))
            else:
                actor.start(lambda: c.evict(1 + b % 3, pool=pool))
            return
        engine: Engine = actor
        rid = engine.rid
        if kind == 0 or rid is None:  # a new request; perhaps dying with the last
            if rid is not None:
                if a % 2:
                    engine.die()
                engine.start(lambda: c.release(rid))
                engine.rid = None
                await self.finish(engine)
            engine.made += 1
            rid = f"{engine.name}-r{engine.made}"
            engine.private, engine.stored, engine.written = {}, [], []
            pool = self.pools[b % len(self.pools)]
            handoff = {"handoff_pool": self.pools[1]} if pool != self.pools[-1] else {}
            engine.start(lambda: c.admit(rid, (1 + a % 3) * BLOCK_TOKENS, pool=pool,
                                         **handoff),
                         engine.admitted(rid, pool))
            return
        chain = a % 2
        keys = CHAINS[chain][:1 + b % 5]
        pin = pb.MemoryIntent(pin_requested=True)
        if kind == 1:  # store a leading run, perhaps pinned
            engine.start(lambda: c.store(rid, NS, keys, intent=pin if a % 5 == 0 else None),
                         engine.stored_keys(keys))
        elif kind == 2:  # commit what it wrote, or every key it stored (having written)
            engine.between_calls()
            keys = list(dict.fromkeys(engine.stored if a % 2 else engine.written))
            engine.written = []
            if keys:
                engine.start(lambda: c.commit(rid, NS, keys))
        elif kind == 3:  # load a leading run, perhaps pinned
            engine.start(lambda: c.load(rid, NS, keys, intent=pin if a % 4 >= 2 else None),
                         engine.loaded_keys(chain, keys))
        elif kind == 4 and len(engine.private) < 3:  # grow private blocks; written at once
            engine.start(lambda: c.allocate(rid, 1 + b % 2), engine.allocated)
        elif kind == 5 and engine.private:  # read its newest private blocks
            indices = sorted(engine.private)[-(1 + b % 3):]
            engine.start(lambda: c.access(rid, indices), engine.accessed(indices))
        elif kind == 6 and len(engine.private) > 1:
            index = sorted(engine.private)[b % len(engine.private)]
            engine.private.pop(index)
            engine.start(lambda: c.free(rid, [index]))
        elif kind == 10 and engine.pool != self.pools[-1]:  # hand it off to the next pool
            engine.between_calls()
            engine.stored, engine.written = [], []  # not committed: left behind
            target = self.pools[-1]
            engine.start(lambda: c.handoff_all(rid, target), engine.handed_off)

    async def step(self, which: int, kind: int, a: int, b: int) -> None:
        if kind == 7:  # take a reply in
            await self.finish(self.actors[which])
        elif kind == 8:  # the copies run a while
            await asyncio.sleep(0.01 * (1 + a))
        elif kind == 9 and which < len(self.engines):  # dies, its call in flight
            engine = self.engines[which]
            if engine.rid is not None:
                engine.die()
                rid, engine.rid = engine.rid, None
                engine.start(lambda: engine.client.release(rid))
        else:
            await self.start(which, kind, a, b)


def operations(kinds: int):
    """(actor, kind, a, b) lists: kinds 0-9, and 10 (a handoff) where there are two pools."""
    return st.lists(st.tuples(st.integers(0, 3), st.integers(0, kinds - 1),
                              st.integers(0, 9), st.integers(0, 9)),
                    min_size=OPS // 2, max_size=OPS)

# Found by test_prefix_chaos, and fails on the code before its fix: engine0 fills the
# device with four blocks, engine1 with a fifth and a sixth (whose victim's copy spends the
# link's credit). engine1's store must copy a victim out to place its block and is still
# waiting for that when engine2 stores the same key, is told it has nothing to write (the
# block is moving) and commits every key it stored: that commit published a page nobody had
# written, which engine0 then loaded. engine1 then takes its reply in, writes and commits,
# and engine0 loads the key again.
PLACED_WHILE_MOVING = [
    (0, 0, 2, 0), (0, 7, 0, 0), (0, 4, 0, 1), (0, 7, 0, 0), (0, 4, 0, 1), (0, 7, 0, 0),
    (1, 0, 0, 0), (1, 7, 0, 0), (2, 0, 0, 0), (2, 7, 0, 0),
    (1, 4, 0, 0), (1, 7, 0, 0), (1, 4, 0, 0), (1, 7, 0, 0),
    (1, 1, 2, 0), (2, 1, 2, 0), (2, 7, 0, 0), (2, 2, 1, 0), (2, 7, 0, 0),
    (0, 3, 0, 0), (0, 7, 0, 0), (1, 7, 0, 0), (1, 2, 1, 0), (1, 7, 0, 0),
    (0, 3, 0, 0), (0, 7, 0, 0), (0, 5, 0, 2),
]


# Two pools, prefill and decode, each with a slow link to its host tier, and a slow link
# from one to the other: a handoff's copies (its request's blocks, and the committed prefix
# blocks it used that decode lacks) take tens of milliseconds a page too.
TWO_POOLS = """
[server]
hold_s = 120
handoff_ttl_s = 30
""" + "".join(f"""
[[pool]]
name = "{name}"
page_bytes = {PAGE_BYTES}
block_tokens = {BLOCK_TOKENS}
device_pages = {{device}}
host_pages = {{host}}
admission = "reservation"
policy = "lru"
""" + SLOW_LINK for name in ("prefill", "decode")) + """
[[link]]
source = "prefill"
target = "decode"
bandwidth = "32KiB"
chunk = "1KiB"
burst = "1"
"""
TWO_POOL_SIZES = [(5, 6), (8, 8)]
# engine0 prefills on a prefix it stores, writes and commits, grows two blocks of its own
# and hands its request off; while the copies run, engine1 stores the same prefix in decode
# (told to write what the handoff has not brought yet), writes and commits it, and engine2
# loads it there; engine0 then reads its blocks in decode, and loads the prefix there.
CARRIED_WHILE_STORED = [
    (0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 0, 1), (0, 1, 2, 2), (0, 2, 1, 0), (0, 4, 0, 1),
    (0, 10, 0, 0), (1, 1, 2, 2), (1, 7, 0, 0), (1, 2, 1, 0), (2, 3, 0, 2), (2, 7, 0, 0),
    (0, 7, 0, 0), (0, 3, 0, 2), (0, 7, 0, 0), (1, 3, 0, 2), (1, 7, 0, 0),
]


@pytest.fixture(scope="module", params=SIZES, ids=size_id)
def overlap_kvd(request, tmp_path_factory):
    with machine_kvd(tmp_path_factory, f"overlap{request.param[0]}", request.param,
                     page_bytes=PAGE_BYTES, block_tokens=BLOCK_TOKENS, engines=3,
                     pool_extra=SLOW_LINK) as kvd:
        kvd.pools = ["default"]
        yield kvd


@pytest.fixture(scope="module", params=TWO_POOL_SIZES,
                ids=lambda s: f"device{s[0]}-host{s[1]}")
def handoff_kvd(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"handoff{request.param[0]}")
    device, host = request.param
    (tmp / "kvd.toml").write_text(TWO_POOLS.format(device=device, host=host))
    with LocalKvd("--config", str(tmp / "kvd.toml"), workdir=tmp) as kvd:
        kvd.tenants, kvd.pools = False, ["prefill", "decode"]
        yield kvd
        assert kvd.proc.poll() is None, f"kvd died:\n{kvd.log()}"


async def _example(kvd, operations, policy: str) -> dict[str, int]:
    async with AsyncClient(kvd.target, timeout_s=STUCK_S) as admin:
        maps = {}
        for pool in kvd.pools:
            await admin.set_policy(policy, pool=pool)
            maps[pool] = MappedPool(await admin.export_pool(pool))
        clients = engine_clients(kvd, 3, STUCK_S)
        operator_client = AsyncClient(kvd.target, timeout_s=STUCK_S)
        engines = [Engine(f"engine{i}", c, maps) for i, c in enumerate(clients)]
        run = Run(engines, Actor("operator", operator_client), kvd.pools)
        try:
            for actor in run.actors:
                await actor.client.__aenter__()
            for op in operations:
                await run.step(*op)
                check = await admin.self_check()
                assert check.ok, (op, list(check.problems))
            for actor in run.actors:
                await run.finish(actor)
            for e in engines:
                if e.rid is not None and e.private:  # what it has is read back whole
                    indices = sorted(e.private)
                    e.start(lambda: e.client.access(e.rid, indices), e.accessed(indices))
                    await run.finish(e)
                if e.rid is not None:
                    e.start(lambda: e.client.release(e.rid))
                    e.rid = None
                    await run.finish(e)
            check = await admin.self_check()
            assert check.ok, list(check.problems)
            for stats in (await admin.pool_stats()).pools:
                assert stats.num_requests == 0, f"requests left in {stats.pool}"
                assert stats.reserved_pages == stats.handoff_reserved_pages == 0, stats
            assert await admin.list_requests() == [], "entries left"
            return {"loaded": sum(e.loaded for e in engines),
                    "checked": sum(e.checked for e in engines),
                    "handed": sum(e.handed for e in engines)}
        finally:
            for e in run.actors:  # after a failure too: the next example starts clean
                if e.pending is not None:
                    e.pending[0].cancel()
                    with contextlib.suppress(BaseException):
                        await e.pending[0]
                rid = getattr(e, "rid", None)
                if rid is not None:
                    with contextlib.suppress(KvdClientError):
                        await e.client.release(rid)
                await e.client.__aexit__(None, None, None)
            for mapped in maps.values():
                mapped.close()


def _run_examples(kvd, kinds: int, explicit: list) -> dict[str, int]:
    """Run the examples; the prefix blocks loaded, the pages read back and the handoffs
    made in all of them."""
    results = []
    loop = asyncio.new_event_loop()  # one loop for every example: grpc.aio keeps to it

    # No shrinking: the daemon (and the prefixes it keeps) lives on across examples, and
    # the copies' timing is real, so a replay is not the same run.
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(operations=operations(kinds), policy=st.sampled_from(policy_names()))
    def run(operations, policy):
        results.append(loop.run_until_complete(_example(kvd, operations, policy)))

    for ops in explicit:
        run = example(operations=ops, policy="lru")(run)
    try:
        run()
    finally:
        loop.close()
    return {k: sum(r[k] for r in results) for k in results[0]}


@pytest.mark.timeout(max(180, EXAMPLES * 6))
def test_prefix_calls_in_flight_together_load_only_written_bytes(overlap_kvd):
    done = _run_examples(overlap_kvd, 10, [PLACED_WHILE_MOVING])
    assert done["checked"] > EXAMPLES and done["loaded"] > 0, f"little was read back: {done}"


@pytest.mark.timeout(max(180, EXAMPLES * 6))
def test_handoffs_among_prefix_calls_in_flight_carry_only_written_bytes(handoff_kvd):
    """The same engines on prefill and decode pools, handing their requests off (which
    carries the committed prefix blocks a request used to decode) while the others store,
    commit and load the same keys in either pool; a handoff in flight may be cancelled by
    its engine dying."""
    done = _run_examples(handoff_kvd, 11, [CARRIED_WHILE_STORED])
    assert done["checked"] > EXAMPLES and done["loaded"] > 0, f"little was read back: {done}"
    assert done["handed"] > 0, f"no handoff went through: {done}"
