"""Random engine steps on real Step streams. Two engines, each with a client and a Step stream
of its own, drive one kvd (its own process, real gRPC, real arenas and copies) with steps
that allocate, free, release, update intents (pins, priorities, recompute_ok, prefetch) and
read (read_all, and accesses of some or all blocks), and with decode steps, which read the
last batch again and do nothing else, under every policy and several device sizes, the
engines' steps interleaved with each other and with the operator's evictions; the engines
are one tenant, or a tenant each. The operator also switches the policy between steps, and
an engine's stream now and then breaks off (the engine restarted, the connection broke),
with its last reply read or not: the engine goes on on a new stream. And another of the
tenant's clients frees blocks an engine's last step handed it, while its forward pass still
writes their pages.

Each engine writes bytes of its own into every page it is handed, learns where its blocks
went only from the replies (`allocated`, `relocated`), and checks every block a step read:
when the reply comes and again just before its next message (what a step hands out is the
engine's to read until then, whatever the other engine does meanwhile). A block holds what
the engine wrote, or zeros where the reply said it must be recomputed. No step may hang,
fail other than with a documented refusal, or leave kvd's invariants broken.

KVD_STEP_MACHINE_EXAMPLES sets the examples per device size (`make soak` runs many more).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random

import grpc
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from kvd.core.policies import policy_names
from kvd_client import AsyncClient, KvdClientError, ResourceExhaustedError, pb
from kvd_client.arena import MappedPool
from kvd_client.client import intent_update

from .conftest import QUOTAS, engine_clients, machine_kvd, size_id

PAGE_BYTES = 128
BLOCK_TOKENS = 16
EXAMPLES = int(os.environ.get("KVD_STEP_MACHINE_EXAMPLES", "50"))
OPS = 24
# A step kvd cannot serve in this long is stuck (nothing here waits on a slow link).
STUCK_S = 20.0

# What an item of a step may be refused with: there was no room (for the blocks, or for a
# pin), or a read named more blocks than the device tier holds (checked in Engine.absorb).
# Anything else is a bug: the engines name only live requests and blocks.
TOO_MANY = grpc.StatusCode.INVALID_ARGUMENT.value[0]
REFUSALS = {
    "intents": {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]},
    "frees": set(),
    "releases": set(),
    "allocations": {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]},
    "read_all": {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], TOO_MANY},
    "accesses": {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], TOO_MANY},
}

INTENTS = [dict(pin_requested=True), dict(pin_requested=False),
           dict(priority=pb.PRIORITY_HOT), dict(priority=pb.PRIORITY_COLD),
           dict(priority=pb.PRIORITY_DECODE_CRITICAL), dict(recompute_ok=True),
           dict(deadline_us=1000)]


class Engine:
    """One engine: its requests' blocks and the bytes it wrote into each, where it was last
    told each block is, and the blocks its last step let it read."""

    def __init__(self, name: str, client: AsyncClient, mapped: MappedPool, seed: int,
                 device_pages: int) -> None:
        self.name = name
        self.device_pages = device_pages
        self.client = client
        self.mapped = mapped
        self.rng = random.Random(seed)
        self.blocks: dict[str, dict[int, bytes]] = {}  # request -> block index -> bytes
        self.where: dict[tuple[str, int], pb.PageHandle] = {}
        self.readable: list[tuple[str, int]] = []
        self.call = None
        self.pending: tuple[pb.StepRequest, asyncio.Future] | None = None
        self.steps = 0
        self.checked = 0
        self.last_read: list[str] = []  # the read_all of its last step that had one
        # Blocks the engine was told to recompute in the last reply of a stream that broke
        # off after it read the reply: kvd may tell them again, and the engine has
        # recomputed them.
        self.recomputed: set[tuple[str, int]] = set()
        self.last_recompute: set[tuple[str, int]] = set()
        # Pages of blocks another client freed while this engine held them: its forward
        # pass writes them all the same, just before its next message (see late_writes).
        self.late: list[pb.PageHandle] = []
        # The reply to the step in flight is lost: the engine breaks off before it reads
        # it (a step that only reads, which changes nothing the engine keeps: where that
        # reply said blocks went, and which to recompute, it learns only from kvd's next
        # replies).
        self.losing = False

    async def open(self) -> None:
        self.call = self.client.memory.Step(metadata=self.client.metadata)

    async def break_off(self, read_last: bool) -> None:
        """The stream breaks off and the engine opens a new one: after it read the reply
        to its last step (read_last), or after a reply it lost (see `losing`)."""
        assert self.pending is None
        self.check(self.readable)  # what it was handed is its to read until the break
        self.readable = []
        self.late_writes()
        if read_last:
            self.recomputed |= self.last_recompute
        self.call.cancel()
        await self.open()

    def check(self, keys) -> None:
        for key in keys:
            handle = self.where[key]
            assert handle.tier == pb.TIER_DEVICE, (self.name, key, handle)
            want = self.blocks[key[0]][key[1]]
            got = self.mapped.read(handle)[:len(want)].tobytes()
            assert got == want, (f"{self.name}: block {key} at device page "
                                 f"{handle.page_index} does not hold what the engine wrote")
            self.checked += 1

    def freed_by_another(self, rid: str, indices: list[int]) -> None:
        """Another client freed these blocks, which the engine's last step handed it: the
        engine forgets them, but its forward pass, under way, still writes their pages."""
        for index in indices:
            self.late.append(self.where.pop((rid, index)))
            del self.blocks[rid][index]
        self.readable = [key for key in self.readable if key in self.where]

    def late_writes(self) -> None:
        """The forward pass writes the pages of blocks freed under it (bytes nobody reads)."""
        for handle in self.late:
            self.mapped.write(handle, self.rng.randbytes(PAGE_BYTES))
        self.late = []

    async def send(self, message: pb.StepRequest) -> None:
        """Send a step (the engine has read what the last one handed out: checked first)."""
        assert self.pending is None
        self.check(self.readable)
        self.readable = []
        self.late_writes()
        self.steps += 1
        message.step_id = self.steps
        if message.read_all:
            self.last_read = list(message.read_all)
        await self.call.write(message)
        self.pending = (message, asyncio.ensure_future(self.call.read()))
        done, _ = await asyncio.wait([self.pending[1]], timeout=0.5)
        if done:
            self.finish()

    def finish(self) -> None:
        message, read = self.pending
        self.pending = None
        reply = read.result()
        assert reply is not grpc.aio.EOF, f"{self.name}: kvd ended the stream"
        assert reply.step_id == message.step_id
        if self.losing:
            self.losing = False
            return
        self.absorb(message, reply)

    def absorb(self, message: pb.StepRequest, reply: pb.StepResponse) -> None:
        failed = set()
        too_many = []
        for e in reply.errors:
            assert e.code in REFUSALS[e.section], (self.name, e.section, e.code, e.message)
            failed.add((e.section, e.item_index))
            if e.code == TOO_MANY:
                too_many.append(e)
        for i, f in enumerate(message.frees):
            if ("frees", i) not in failed:
                for index in f.block_indices:
                    del self.blocks[f.request_id][index]
                    del self.where[f.request_id, index]
        for i, r in enumerate(message.releases):
            if ("releases", i) not in failed:
                for index in self.blocks.pop(r.request_id):
                    del self.where[r.request_id, index]
        written = []
        self.last_recompute = {(h.request_id, h.block_index) for h in reply.relocated
                               if h.recompute}
        for h in reply.allocated:
            key = (h.request_id, h.block_index)
            assert key not in self.where, (self.name, "handed out twice", key)
            self.blocks[h.request_id][h.block_index] = self.rng.randbytes(PAGE_BYTES)
            self.where[key] = h
            self.mapped.write(h, self.blocks[h.request_id][h.block_index])
            written.append(key)
        for h in reply.relocated:
            key = (h.request_id, h.block_index)
            assert key in self.where, (self.name, "told of a block it does not have", key)
            self.where[key] = h
            if h.recompute:  # dropped and back: zeros, until the engine recomputes it
                if key in self.recomputed:  # told again: recomputed already, or zeros
                    page = self.mapped.read(h)
                    assert not page.any() or page[:PAGE_BYTES].tobytes() == \
                        self.blocks[key[0]][key[1]], (self.name, key, "told again")
                    self.recomputed.discard(key)
                else:
                    assert not self.mapped.read(h).any(), (self.name, key, "not zeroed")
                self.mapped.write(h, self.blocks[key[0]][key[1]])
        for e in too_many:  # the read's blocks, as the step's frees and allocations left them
            if e.section == "read_all":
                count = len(self.blocks[message.read_all[e.item_index]])
            else:
                a = message.accesses[e.item_index]
                count = len(self.blocks[a.request_id]) if a.all_blocks else len(a.block_indices)
            assert count > self.device_pages, (self.name, e.section, count, e.message)
        read = []
        for i, rid in enumerate(message.read_all):
            if ("read_all", i) not in failed:
                read += [(rid, index) for index in self.blocks[rid]]
        for i, a in enumerate(message.accesses):
            if ("accesses", i) not in failed:
                indices = self.blocks[a.request_id] if a.all_blocks else a.block_indices
                read += [(a.request_id, index) for index in indices]
        self.check(read)
        self.readable = read + written

    def again(self) -> pb.StepRequest:
        """A decode step: the batch the engine read last (its requests still running),
        read again, and nothing else."""
        return pb.StepRequest(read_all=[rid for rid in self.last_read if rid in self.blocks])

    def step(self, choices) -> pb.StepRequest:
        """A step over the engine's requests, each choice made by the next of `choices`
        (integers drawn up front: what they pick depends on what the replies left)."""
        choice = iter(choices)

        def pick(options):
            return options[next(choice, 0) % len(options)]

        def some(options, at_least=0):
            n = at_least + next(choice, 0) % (len(options) + 1 - at_least)
            return sorted(random.Random(next(choice, 0)).sample(options, n))

        message = pb.StepRequest()
        live = sorted(self.blocks)
        if not live:
            return message
        for _ in range(pick([0, 0, 1, 2])):
            rid = pick(live)
            if self.blocks[rid]:
                message.intents.append(intent_update(
                    rid, pick(sorted(self.blocks[rid])), prefetch=pick([False, True]),
                    **pick(INTENTS)))
        if pick([True, False, False, False]):
            rid = pick(live)
            if self.blocks[rid]:
                message.frees.append(pb.FreeRequest(
                    request_id=rid, block_indices=some(sorted(self.blocks[rid]), 1)))
        gone = set()
        if pick([True] + [False] * 6):
            rid = pick(live)
            message.releases.append(pb.ReleaseRequest(request_id=rid))
            gone.add(rid)
        running = [rid for rid in live if rid not in gone]
        if not running:
            return message
        for rid in some(running)[:2]:
            message.allocations.append(pb.AllocateRequest(
                request_id=rid, num_blocks=pick([1, 2, 3]),
                intent=pick([None, None, pb.MemoryIntent(recompute_ok=True)])))
        message.read_all.extend(some(running))
        if pick([True, False]):
            rid = pick(running)
            freed = {(f.request_id, i) for f in message.frees for i in f.block_indices}
            kept = [i for i in sorted(self.blocks[rid]) if (rid, i) not in freed]
            if kept and pick([True, False]):
                message.accesses.append(pb.AccessRequest(request_id=rid,
                                                         block_indices=some(kept, 1)))
            else:
                message.accesses.append(pb.AccessRequest(request_id=rid, all_blocks=True))
        return message


# One operation: (engine, what it does, the integers its choices are made by).
OPERATION = st.tuples(st.integers(0, 1), st.integers(0, 4),
                      st.lists(st.integers(0, 2**16), min_size=24, max_size=24))
# Engine 0 admits a one-block request, then steps: no intents, free or release; one block
# allocated for the request, which it reads in the same step (see Engine.step). Run first
# in every run: however few of the generated examples come to read, the engines read back
# what they wrote.
ADMIT_ALLOCATE_READ = [(0, 0, [0] * 24), (0, 1, [0, 1, 1, 1, 0, 0, 0, 1, 0, 1] + [0] * 14)]


def _others(engine: Engine, engines: list[Engine]) -> list[Engine]:
    return [e for e in engines if e is not engine]


async def _served(engine: Engine, others: list[Engine]) -> None:
    """The engine's step in flight answered: at once, or once the other engines (whose
    holds it may wait for) send their next messages; never later than STUCK_S."""
    if engine.pending is None:
        return
    done, _ = await asyncio.wait([engine.pending[1]], timeout=0.5)
    if not done:
        for other in others:
            if other.pending is not None and other.pending[1].done():
                other.finish()  # its reply came meanwhile: the engine has read it
            if other.pending is None:
                await other.send(pb.StepRequest())  # the other engine gives its pages back
        done, _ = await asyncio.wait([engine.pending[1]], timeout=STUCK_S)
        assert done, f"{engine.name}: a step waited {STUCK_S} s"
    engine.finish()


# (device pages, host pages, whether each engine is a tenant of its own): a device smaller
# than one request can grow to, a host tier that fills (victims the engine allowed to be
# recomputed are then dropped), and room; two tenants' engines take turns at the loop while
# they compete, one tenant's steps do not; and tenants with a guarantee and a limit, whose
# pins must keep within them.
SIZES = [(4, 16, True), (5, 2, False), (10, 40, True), (24, 24, False), (10, 8, QUOTAS)]


@pytest.fixture(scope="module", params=SIZES, ids=size_id)
def step_kvd(request, tmp_path_factory):
    # Past the first size, slices of two blocks: a step's allocation, free or release of
    # more, its reply's handles and the holds its next message ends go a slice at a time.
    slice_blocks = None if request.param == SIZES[0] else 2
    with machine_kvd(tmp_path_factory, f"steps{request.param[0]}", request.param,
                     page_bytes=PAGE_BYTES, block_tokens=BLOCK_TOKENS, engines=2,
                     slice_blocks=slice_blocks) as kvd:
        kvd.examples = 0
        yield kvd


async def _example(kvd, operations, policy: str) -> list[int]:
    kvd.examples += 1
    prefix = f"x{kvd.examples}-"
    async with AsyncClient(kvd.target, timeout_s=STUCK_S) as admin:
        await admin.set_policy(policy)
        mapped = MappedPool(await admin.export_pool())
        clients = engine_clients(kvd, 2, STUCK_S)
        engines = [Engine(f"engine{i}", c, mapped, seed=kvd.examples * 2 + i,
                          device_pages=kvd.device)
                   for i, c in enumerate(clients)]
        try:
            for e in engines:
                await e.client.__aenter__()
                await e.open()
            made = 0
            for which, kind, choices in operations:
                engine = engines[which]
                if kind == 3 and choices[0] % 2:
                    # The operator evicts: never a page an engine was handed and has not
                    # given back (its next step would find another engine's bytes there).
                    with contextlib.suppress(ResourceExhaustedError):
                        await admin.evict(1 + choices[1] % 4)
                    continue
                if kind == 3 and choices[0] % 8 in (0, 4):
                    # The engine's stream breaks off; it goes on on a new one.
                    await _served(engine, _others(engine, engines))
                    read_last = choices[0] % 8 == 0
                    if not read_last and engine.blocks:
                        # Its last step reads every request (bringing back what the
                        # operator evicts first, now and then), and its reply is lost.
                        if choices[1] % 2:
                            with contextlib.suppress(ResourceExhaustedError):
                                await admin.evict(1 + choices[2] % 4)
                        engine.losing = True
                        await engine.send(pb.StepRequest(read_all=sorted(engine.blocks)))
                        await _served(engine, _others(engine, engines))
                    await engine.break_off(read_last)
                    continue
                if kind == 3 and choices[0] % 4 == 2:
                    # The operator switches the policy between two steps.
                    names = policy_names()
                    await admin.set_policy(names[choices[1] % len(names)])
                    continue
                if kind == 4:
                    # Another of the tenant's clients (the engine's scheduler, a router)
                    # frees blocks the engine's last step handed it, while its forward
                    # pass writes them: nobody else may get their pages before the
                    # engine's next message.
                    await _served(engine, _others(engine, engines))
                    if not engine.readable and engine.blocks:  # it reads all it has first
                        await engine.send(pb.StepRequest(read_all=sorted(engine.blocks)))
                        await _served(engine, _others(engine, engines))
                    handed = sorted({rid for rid, _ in engine.readable})
                    if handed:
                        rid = handed[choices[0] % len(handed)]
                        held = sorted({i for r, i in engine.readable if r == rid})
                        indices = random.Random(choices[1]).sample(
                            held, 1 + choices[2] % len(held))
                        await engine.client.free(rid, indices)
                        engine.freed_by_another(rid, indices)
                        other = _others(engine, engines)[0]
                        if choices[3] % 2 and other.blocks:
                            # The other engine grows a request at once: the pages freed
                            # are the first free ones, and must not be its yet.
                            await _served(other, [engine])
                            grown = sorted(other.blocks)[choices[4] % len(other.blocks)]
                            await other.send(pb.StepRequest(allocations=[
                                pb.AllocateRequest(request_id=grown, num_blocks=1)]))
                            await _served(other, [engine])
                    continue
                if kind == 0 or not engine.blocks:
                    made += 1
                    rid = f"{prefix}{engine.name}-r{made}"
                    reply = await engine.client.admit(rid, (1 + choices[0] % 6) * BLOCK_TOKENS)
                    if reply.decision == pb.DECISION_ADMITTED:
                        engine.blocks[rid] = {}
                    elif reply.decision == pb.DECISION_QUEUED:
                        await engine.client.release(rid)
                    continue
                if kind == 2 and choices[1] % 2:
                    # Decode steps: the last batch read again, once or a few times (the
                    # Step handler answers a repeat of the same read from what it kept).
                    for _ in range(1 + choices[2] % 3):
                        await _served(engine, _others(engine, engines))
                        await engine.send(engine.again())
                else:
                    await _served(engine, _others(engine, engines))
                    await engine.send(engine.step(choices))
                check = await admin.self_check()
                assert check.ok, list(check.problems)
            # Last, each engine reads every block it has, then releases its requests.
            for engine in engines:
                await _served(engine, _others(engine, engines))
            for engine in engines:
                for rid in sorted(engine.blocks):
                    await engine.send(pb.StepRequest(accesses=[
                        pb.AccessRequest(request_id=rid, all_blocks=True)]))
                    await _served(engine, _others(engine, engines))
                await engine.send(pb.StepRequest(releases=[
                    pb.ReleaseRequest(request_id=rid) for rid in sorted(engine.blocks)]))
                await _served(engine, _others(engine, engines))
                assert not engine.blocks, (engine.name, sorted(engine.blocks))
            check = await admin.self_check()
            assert check.ok, list(check.problems)
            stats = (await admin.pool_stats()).pools[0]
            assert stats.num_requests == 0, "requests left behind"
            return [e.checked for e in engines]
        finally:
            for e in engines:  # after a failure too: the next example starts clean
                if e.call is not None:
                    e.call.cancel()
                for rid in e.blocks:
                    with contextlib.suppress(KvdClientError):
                        await e.client.release(rid)
                await e.client.__aexit__(None, None, None)
            mapped.close()


# The suite's 120 s per test is for its default examples; `make soak` runs many more.
@pytest.mark.timeout(max(120, EXAMPLES // 2))
def test_random_steps_of_two_engines_lose_no_byte_under_every_policy(step_kvd):
    checked = []
    loop = asyncio.new_event_loop()  # one loop for every example: grpc.aio keeps to it

    # No shrinking: the daemon lives on across examples, so a replay is not the same run
    # (the failing example is reported as generated).
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(operations=st.lists(OPERATION, min_size=1, max_size=OPS),
           policy=st.sampled_from(policy_names()))
    @example(operations=ADMIT_ALLOCATE_READ, policy="lru")
    def run(operations, policy):
        checked.append(sum(loop.run_until_complete(_example(step_kvd, operations, policy))))

    try:
        run()
    finally:
        loop.close()
    # The engines read blocks back, not only wrote them: the explicit example at least
    # (the generated ones may not: a run's 50 examples can all end before any read).
    assert checked[0] >= 2
