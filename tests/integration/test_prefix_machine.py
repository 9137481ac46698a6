"""Random prefix-block traffic of three engines on one kvd (its own process, real gRPC, real
arenas and copies), under every policy and several device sizes: each engine's requests
store the prompts' prefix blocks (two chains of keys, which the engines' prompts share),
commit them, load what others stored, grow private blocks that push kept prefixes to the
host tier or out, and die now and then between a store and the writes it was told to do.
The operator evicts, switches the policy, and releases an engine's request under it (the
engine still writes what its last Store told it to) between calls.

An engine does what a real one does between two calls: it writes the pages its last Store
told it to (fresh), reads the pages its last Load or Access handed it (checked when the
reply comes and again just before its next call: nothing may move them meanwhile), then
calls again. Every key has its bytes (a key is its tokens' hash: whoever writes it writes
the same), so every page a Load hands out must hold its key's bytes, whoever stored it,
whatever happened to it since. An engine whose tenant keeps its prefix blocks apart writes
bytes of its own for each key: it must load only those, and the others never those; a private block holds what its engine wrote, or zeros where
the reply said to recompute it. No call may hang or fail other than with a documented
refusal, and kvd's self-check must hold after every call.

KVD_PREFIX_MACHINE_EXAMPLES sets the examples per device size (`make soak` runs more).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvd.core.policies import policy_names
from kvd_client import (AbortedError, AsyncClient, FailedPreconditionError, KvdClientError,
                        ResourceExhaustedError, pb)
from kvd_client.arena import MappedPool

from .conftest import (PRIVATE, QUOTAS, engine_clients, machine_kvd, on_live_daemons,
                       size_id)

PAGE_BYTES = 64
BLOCK_TOKENS = 16
EXAMPLES = int(os.environ.get("KVD_PREFIX_MACHINE_EXAMPLES", "25"))
OPS = 30
STUCK_S = 20.0
NS = "tiny|salt"
# Two prompts' prefix chains: engines store and load leading runs of either.
CHAINS = [[hashlib.sha256(b"%s/%d" % (name, i)).digest() for i in range(6)]
          for name in (b"system", b"other")]

# (device pages, host pages, whether each engine is a tenant of its own): a device that
# kept prefixes and one request's blocks fill, a host tier that fills (kept blocks are then
# dropped), and room; and tenants with a guarantee, a limit and a weight, whose pins on the
# blocks they share must keep within them.
SIZES = [(6, 3, True), (8, 16, False), (16, 8, True), (12, 8, QUOTAS), (8, 8, PRIVATE)]

# What a call may be refused with: no room now, or blocks that moved under a store (it says
# to store again); a commit of blocks dropped before it (FailedPrecondition says so).
REFUSED = (ResourceExhaustedError, AbortedError)


def key_bytes(key: bytes, space: str = "") -> bytes:
    """A key's bytes, as an engine whose prefix blocks are in `space` writes them ("": the
    space the tenants that share have in common)."""
    if space:
        key = hashlib.sha256(space.encode() + key).digest()
    return (key * (PAGE_BYTES // len(key) + 1))[:PAGE_BYTES]


def private_bytes(rid: str, index: int, generation: int) -> bytes:
    return hashlib.sha256(f"{rid}/{index}/{generation}".encode()).digest() * 2


class Operator:
    """kvctl: no pages of its own; its calls may wait for the engines' (`others`)."""

    name = "operator"

    def __init__(self) -> None:
        self.others: list[Engine] = []

    def between_calls(self) -> None:
        pass


class Engine:
    """One engine: its request, the pages its last call handed it, and what it owes kvd
    before its next call (the fresh pages of its last Store, written then)."""

    def __init__(self, name: str, client: AsyncClient, mapped: MappedPool,
                 operator: Operator, tenant: bool, private: bool = False) -> None:
        self.name = name
        self.operator = operator
        self.client = client
        self.mapped = mapped
        self.rid: str | None = None
        self.made = 0
        self.to_write: list[tuple[pb.PageHandle, bytes]] = []
        self.stored: list[bytes] = []  # the keys of its last Store
        self.written: list[bytes] = []  # those it wrote, and has not committed
        self.readable: list[tuple[pb.PageHandle, bytes]] = []
        self.private: dict[int, bytes] = {}  # block index -> what it wrote there
        self.generation = 0
        self.loads = 0  # prefix blocks its loads handed it
        self.committed = 0  # prefix blocks its commits published
        self.tenant = tenant  # whether it is a tenant of its own (engineN)
        self.space = name if private else ""  # whose prefix blocks it stores and loads

    def check(self, handle: pb.PageHandle, want: bytes, what: str) -> None:
        got = self.mapped.read(handle)[:len(want)].tobytes()
        assert got == want, (f"{self.name}: {what} at {pb.Tier.Name(handle.tier)} page "
                             f"{handle.page_index} does not hold its bytes")

    def between_calls(self) -> None:
        """What the engine does after a reply and before its next call."""
        for handle, want in self.readable:
            self.check(handle, want, "a page it was handed")
        self.readable = []
        for handle, key in self.to_write:
            self.mapped.write(handle, np.frombuffer(key_bytes(key, self.space), np.uint8))
            self.written.append(key)
        self.to_write = []

    @property
    def others(self) -> list[Engine]:
        return [e for e in self.operator.others if e is not self]

    def die(self) -> None:
        """Its engine dies before it writes what its last Store told it to."""
        self.to_write = []
        self.written = []


async def _call(engine: Engine, coro_fn):
    """One call of the engine's, after what it does between calls; a refusal is None. A
    call may wait for pages the other engines hold (until their next calls): when it has
    not come back soon, they make their next calls, and it must come back then."""
    engine.between_calls()
    call = asyncio.ensure_future(coro_fn())
    done, _ = await asyncio.wait([call], timeout=0.5)
    if not done:
        for other in engine.others:
            other.between_calls()
            await other.client.keep_alive()  # a call: it is done with what it was handed
        done, _ = await asyncio.wait([call], timeout=STUCK_S)
        if not done:
            call.cancel()
            raise AssertionError(f"{engine.name}: a call waited {STUCK_S} s")
    try:
        return call.result()
    except REFUSED:
        return None


async def _step(engine: Engine, admin: AsyncClient, kind: int, a: int, b: int) -> None:
    c = engine.client
    if kind == 0 or engine.rid is None:
        if engine.rid is not None:
            if a % 2:
                engine.die()
            await _call(engine, lambda: c.release(engine.rid))
        engine.made += 1
        rid = f"{engine.name}-r{engine.made}"
        reply = await _call(engine, lambda: c.admit(rid, (1 + a % 4) * BLOCK_TOKENS))
        engine.rid, engine.private, engine.stored, engine.written = None, {}, [], []
        if reply is not None and reply.decision == pb.DECISION_ADMITTED:
            engine.rid = rid
        elif reply is not None and reply.decision == pb.DECISION_QUEUED:
            await _call(engine, lambda: c.release(rid))
        return
    rid = engine.rid
    chain = CHAINS[a % 2]
    if kind == 1:  # store a leading run, perhaps pinned; perhaps write and commit at once
        keys = chain[:1 + b % len(chain)]
        intent = pb.MemoryIntent(pin_requested=True) if a % 5 == 0 else None
        reply = await _call(engine, lambda: c.store(rid, NS, keys, intent=intent))
        if reply is None:
            return
        assert len(reply.handles) == len(reply.fresh) == len(keys)
        engine.stored = keys
        engine.to_write = [(h, k) for h, fresh, k in zip(reply.handles, reply.fresh, keys)
                           if fresh]
        if a % 3 == 0:  # a connector's save: store, write, commit
            await _step(engine, admin, 2, 1, b)
    elif kind == 2:  # commit: what it wrote, or every key it stored (having written)
        keys = engine.stored if a % 2 else None
        engine.between_calls()
        keys = list(dict.fromkeys(keys if keys is not None else engine.written))
        engine.written = []
        if keys:
            with contextlib.suppress(FailedPreconditionError):  # dropped before it
                reply = await _call(engine, lambda: c.commit(rid, NS, keys))
                engine.committed += reply.num_committed if reply is not None else 0
    elif kind == 3:  # load a leading run, perhaps pinned: every page holds its key's bytes
        keys = chain[:1 + b % len(chain)]
        intent = pb.MemoryIntent(pin_requested=True) if a % 4 >= 2 else None
        reply = await _call(engine, lambda: c.load(rid, NS, keys, intent=intent))
        if reply is None:
            return
        assert len(reply.handles) <= len(keys)
        for handle, key in zip(reply.handles, keys):
            want = key_bytes(key, engine.space)
            engine.check(handle, want, f"prefix block {chain.index(key)}")
            engine.readable.append((handle, want))
        engine.loads += len(reply.handles)
    elif kind == 4:  # grow private blocks (pressure on the kept prefixes) and write them
        reply = await _call(engine, lambda: c.allocate(rid, 1 + b % 3))
        if reply is None:
            return
        engine.generation += 1
        for h in reply.handles:
            data = private_bytes(rid, h.block_index, engine.generation)
            engine.mapped.write(h, np.frombuffer(data, np.uint8))
            engine.private[h.block_index] = data
    elif kind == 5 and engine.private:  # read its newest private blocks
        indices = sorted(engine.private)[-(1 + b % 3):]
        reply = await _call(engine, lambda: c.access(rid, indices))
        if reply is None:
            return
        for h in reply.handles:
            want = engine.private[h.block_index]
            if h.recompute:  # dropped: zeros, which the engine recomputes
                engine.check(h, bytes(len(want)), f"recomputed block {h.block_index}")
                engine.mapped.write(h, np.frombuffer(want, np.uint8))
            else:
                engine.check(h, want, f"private block {h.block_index}")
                engine.readable.append((h, want))
    elif kind == 6:  # the operator
        if a % 3 == 0:
            await admin.set_policy(policy_names()[b % len(policy_names())])
        elif a % 3 == 1 and b % 2:
            await _released_under(engine, admin, b)
        else:
            # An evict takes what the policy can give now (never pages the engines hold),
            # or is refused.
            await _call(engine.operator, lambda: admin.evict(1 + b % 4))


async def _released_under(engine: Engine, admin: AsyncClient, b: int) -> None:
    """The operator releases the engine's request while the engine writes the fresh blocks
    its last Store handed it; another engine allocates at once and writes its blocks; then
    the first engine's writes land, and it calls again. The other engine's blocks must hold
    its bytes when it reads them."""
    if not engine.to_write:  # a Store whose fresh blocks the engine is writing
        await _step(engine, admin, 1, 1, b)  # (not committed at once, not pinned)
        if engine.rid is None:
            return
    whole = f"{engine.name}/{engine.rid}" if engine.tenant else engine.rid  # the admin's
    if await _call(engine.operator, lambda: admin.release(whole)) is None:
        return
    engine.rid = None
    other = next((e for e in engine.others if e.rid is not None), None)
    if other is not None:
        await _step(other, admin, 4, 0, b)  # it allocates and writes
    engine.between_calls()  # the released engine's writes
    await engine.client.keep_alive()  # and its next call
    if other is not None and other.rid is not None:
        await _step(other, admin, 5, 0, 2)  # it reads its newest blocks


OPERATION = st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(0, 9),
                      st.integers(0, 9))
# Two engines store the same prefix at once: the second before the first has written it.
# The second writes and commits it; the third loads it.
SAME_PREFIX_AT_ONCE = [(0, 0, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0), (0, 1, 1, 1), (1, 1, 1, 1),
                       (1, 2, 1, 0), (2, 3, 1, 1), (0, 2, 0, 0), (2, 3, 1, 5)]


@pytest.fixture(scope="module", params=SIZES, ids=size_id)
def prefix_kvd(request, tmp_path_factory):
    # But for one size, slices of two blocks: a store of more keys goes a slice at a time
    # (on the smallest device, its later slices find no room and it is stored whole).
    slice_blocks = None if request.param == SIZES[1] else 2
    with machine_kvd(tmp_path_factory, f"prefix{request.param[0]}", request.param,
                     page_bytes=PAGE_BYTES, block_tokens=BLOCK_TOKENS, engines=3,
                     slice_blocks=slice_blocks) as kvd:
        yield kvd


async def _example(kvd, operations, policy: str) -> int:
    async with AsyncClient(kvd.target, timeout_s=STUCK_S) as admin:
        await admin.set_policy(policy)
        mapped = MappedPool(await admin.export_pool())
        before = (await admin.pool_stats()).pools[0]
        clients = engine_clients(kvd, 3, STUCK_S)
        operator = Operator()
        engines = operator.others = [Engine(f"engine{i}", c, mapped, operator,
                                            bool(kvd.tenants), f"engine{i}" in kvd.private)
                                     for i, c in enumerate(clients)]
        try:
            for e in engines:
                await e.client.__aenter__()
            for which, kind, a, b in operations:
                await _step(engines[which], admin, kind, a, b)
                check = await admin.self_check()
                assert check.ok, list(check.problems)
            for e in engines:
                if e.rid is not None:
                    await _call(e, lambda: e.client.release(e.rid))
                    e.rid = None
            check = await admin.self_check()
            assert check.ok, list(check.problems)
            after = (await admin.pool_stats()).pools[0]
            assert after.num_requests == 0, "requests left"
            # kvd counts what its answers gave: the blocks loads handed out, those commits
            # published (a refused call counts nothing).
            assert (after.num_prefix_loaded - before.num_prefix_loaded,
                    after.num_prefix_stored - before.num_prefix_stored) == (
                sum(e.loads for e in engines), sum(e.committed for e in engines))
            return sum(e.loads for e in engines)
        finally:
            for e in engines:  # after a failure too: the next example starts clean
                if e.rid is not None:
                    with contextlib.suppress(KvdClientError):
                        await e.client.release(e.rid)
                await e.client.__aexit__(None, None, None)
            mapped.close()


@pytest.mark.timeout(max(120, EXAMPLES * 3))
def test_random_prefix_traffic_of_three_engines_loads_only_written_bytes(prefix_kvd):
    loaded = []
    loop = asyncio.new_event_loop()  # one loop for every example: grpc.aio keeps to it

    # The daemon (and the prefixes it keeps) lives on across examples.
    @on_live_daemons(EXAMPLES)
    @given(operations=st.lists(OPERATION, min_size=OPS // 3, max_size=OPS),
           policy=st.sampled_from(policy_names()))
    @example(operations=SAME_PREFIX_AT_ONCE, policy="lru")
    def run(operations, policy):
        loaded.append(loop.run_until_complete(_example(prefix_kvd, operations, policy)))

    try:
        run()
    finally:
        loop.close()
    # The explicit example loads what it stored (the generated ones may load nothing).
    assert loaded[0] >= 2, "the explicit example loaded no prefix block"
