"""Random traffic across two nodes: a prefill pool on one kvd handing requests off to the decode
pool of another (its peer, over TCP), each in its own process, with real arenas and copies.

The prefill engine writes a distinct pattern into every block it is handed; whichever engine
reads a request afterwards (on the prefill node, or on the decode node after its handoff)
checks that every block holds exactly what was written there. Requests are admitted with the
decode pages reserved on the peer (admitted, queued, rejected, refused for a full queue, or
given up by the engine while the peer answers), grow, are read, have blocks freed, store and
load shared prefixes, are handed off (let run, cancelled at a random point of the copy, or
released while the copy runs), grow and are read on the decode node (by calls, and by its
engine's Step stream), and are released wherever they are; the operator evicts on either
node and switches the decode pool's policy. No call may hang or fail other than with a
documented refusal; both daemons' self-checks hold after every operation; and once every
request is released, neither node has a request, a reservation, a hold or a page in use
(but the prefix blocks it keeps as cache).

KVD_CROSS_NODE_EXAMPLES sets the examples (the suite's default is small).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os

import grpc
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvd.core.policies import policy_names
from kvd_client import (AbortedError, AsyncClient, FailedPreconditionError, InvalidArgumentError,
                        NotFoundError, ResourceExhaustedError, pb)
from kvd_client.arena import MappedPool
from kvd_loadgen.local import LocalKvd

from .conftest import on_live_daemons
from .test_tls import _port

EXAMPLES = int(os.environ.get("KVD_CROSS_NODE_EXAMPLES", "40"))
OPS = 24
PAGE = 4096
BLOCK_TOKENS = 16
STUCK_S = 20.0
# Refusals a call may meet (no room, a request mid-handoff, a copy rolled back); anything
# else (NOT_FOUND for a request the node lists, INTERNAL, a hang) is a failure.
REFUSED = (ResourceExhaustedError, FailedPreconditionError, AbortedError)
STEP_REFUSED = {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                grpc.StatusCode.FAILED_PRECONDITION.value[0], grpc.StatusCode.ABORTED.value[0]}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Node b, with a small decode pool, and node a, whose prefill pool hands off to it
    over a link slow enough that a handoff can be cut at any point of its copy."""
    port = _port()
    a_dir, b_dir = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    (b_dir / "kvd.toml").write_text(f"""
[server]
tcp = "127.0.0.1:{port}"
allow_plaintext_tokens = true
[auth]
admin_token = "b-admin-token-0123456789"
[[pool]]
name = "decode"
page_bytes = {PAGE}
block_tokens = {BLOCK_TOKENS}
device_pages = 8
host_pages = 8
admission = "reservation"
""")
    # Leases lapse a second after their clients go (each example's clients go at its end):
    # a lapse acts on what a lease still holds while later examples run.
    (a_dir / "kvd.toml").write_text(f"""
[server]
lease_ttl_s = 1.0
[[pool]]
name = "prefill"
page_bytes = {PAGE}
block_tokens = {BLOCK_TOKENS}
device_pages = 10
host_pages = 10
admission = "reservation"
max_queue = 2
[[peer]]
name = "b"
address = "127.0.0.1:{port}"
token = "b-admin-token-0123456789"
[[link]]
source = "prefill"
target = "b/decode"
bandwidth = "1MiB/s"
""")
    b = LocalKvd("--config", str(b_dir / "kvd.toml"), workdir=b_dir)
    a = LocalKvd("--config", str(a_dir / "kvd.toml"), workdir=a_dir)
    with b, a:
        yield a, b
        assert a.proc.poll() is None, f"node a died:\n{a.log()}"
        assert b.proc.poll() is None, f"node b died:\n{b.log()}"


def pattern(rid: str, index: int, generation: int) -> bytes:
    return hashlib.sha256(f"{rid}/{index}/{generation}".encode()).digest() * (PAGE // 32)


# Two prompts' prefix blocks (keys are the tokens' hashes: whoever writes one writes the
# same bytes), which requests share.
NS = "model"
CHAINS = [[hashlib.sha256(f"chain{c}/{i}".encode()).digest() for i in range(4)]
          for c in range(2)]


def key_bytes(key: bytes) -> bytes:
    return key * (PAGE // len(key))


class Node:
    """One node's engine (its client, its pool mapped) and the requests it lists."""

    def __init__(self, name: str, pool: str, client: AsyncClient, device_pages: int) -> None:
        self.name = name
        self.pool = pool
        self.client = client
        # A request may grow past its pool's device tier (the rest in host memory): it is
        # read in parts then, and a read of it whole is refused as such.
        self.device_pages = device_pages
        self.mapped: MappedPool | None = None

    async def listed(self) -> dict[str, str]:
        return {r.request_id: r.state for r in await self.client.list_requests()}


class Cluster:
    """Both nodes, and what the engines wrote into each request's blocks."""

    def __init__(self, a: Node, b: Node) -> None:
        self.a, self.b = a, b
        self.written: dict[str, dict[int, bytes]] = {}
        self.generation = 0
        self.made = 0
        self.reads = 0
        self.handed = 0
        self.loads = 0
        self.loads_on_b = 0
        self.read_in_parts = 0  # reads of a request grown past its device tier
        self.refused_whole = 0  # a Step's read of one whole, refused as such

    async def where(self, rid: str) -> tuple[Node | None, str]:
        """The node that runs rid (the decode node once its handoff committed), and its
        state there."""
        on_b = (await self.b.listed()).get(rid)
        if on_b in ("admitted", "arriving"):
            return self.b, on_b
        on_a = (await self.a.listed()).get(rid)
        return (self.a, on_a) if on_a is not None else (None, "")

    async def write(self, node: Node, rid: str, handles) -> None:
        self.generation += 1
        for h in handles:
            data = pattern(rid, h.block_index, self.generation)
            node.mapped.write(h, np.frombuffer(data, np.uint8))
            self.written[rid][h.block_index] = data

    async def store(self, node: Node, rid: str, keys: list[bytes]) -> None:
        """Store a prefix for rid, write the fresh blocks, commit them."""
        reply = await call(node.client.store(rid, NS, keys))
        if reply is None:
            return
        for h, fresh, key in zip(reply.handles, reply.fresh, keys):
            if fresh:
                node.mapped.write(h, np.frombuffer(key_bytes(key), np.uint8))
        await call(node.client.commit(rid, NS, keys))

    async def load(self, node: Node, rid: str, keys: list[bytes]) -> None:
        """Load the leading run of a prefix kvd holds where rid runs: each page holds its
        key's bytes."""
        reply = await call(node.client.load(rid, NS, keys))
        if reply is None:
            return
        for h, key in zip(reply.handles, keys):
            assert node.mapped.read(h).tobytes() == key_bytes(key), (
                f"{rid} on node {node.name}: prefix block {h.block_index} "
                f"({pb.Tier.Name(h.tier)} page {h.page_index}) does not hold its key's bytes")
        self.loads += len(reply.handles)
        self.loads_on_b += len(reply.handles) if node is self.b else 0

    async def read(self, node: Node, rid: str) -> None:
        """Read every block of rid where it runs: each holds what was written there. One
        that holds more blocks than the device tier is refused whole, and read in parts."""
        written = sorted(self.written[rid])
        if len(written) <= node.device_pages:
            parts = [None]
        else:
            try:
                whole = await call(node.client.access(rid))
            except InvalidArgumentError as exc:
                assert "at once needs as many device pages" in str(exc), exc
            else:
                assert whole is None, f"{rid} on node {node.name}: read whole past the device"
            parts = [written[i:i + node.device_pages]
                     for i in range(0, len(written), node.device_pages)]
            self.read_in_parts += 1
        got = set()
        for part in parts:  # each part checked before the next call moves its pages
            reply = await call(node.client.access(rid, part))
            if reply is None:
                return
            got |= {h.block_index for h in reply.handles}
            for h in reply.handles:
                want = self.written[rid][h.block_index]
                have = node.mapped.read(h).tobytes()
                if h.recompute:  # dropped: zeros, which the engine recomputes
                    assert have == bytes(PAGE), f"{rid}:{h.block_index} recomputed, not zeros"
                    node.mapped.write(h, np.frombuffer(want, np.uint8))
                else:
                    assert have == want, (f"{rid}:{h.block_index} on node {node.name} "
                                          f"({pb.Tier.Name(h.tier)} page {h.page_index}) does "
                                          "not hold what was written")
        assert got == set(self.written[rid]), (
            f"{rid} on node {node.name}: blocks {sorted(got)}, written "
            f"{sorted(self.written[rid])}")
        self.reads += 1


async def call(coro):
    """One call; a documented refusal is None; a hang fails."""
    try:
        return await asyncio.wait_for(coro, STUCK_S)
    except REFUSED:
        return None
    except asyncio.TimeoutError:
        raise AssertionError(f"a call waited {STUCK_S} s") from None


async def _hand_off(cluster: Cluster, rid: str, how: int, delay_ms: int) -> None:
    """Hand rid off: let run (how 0), cancelled after delay_ms (how 1), or with a release
    sent after delay_ms while it copies (how 2: the release waits for it, then acts where
    the request is)."""
    a = cluster.a
    handoff = asyncio.ensure_future(call(a.client.handoff_all(rid)))
    if how == 0:
        done = await handoff
        cluster.handed += done is not None and done.done
        return
    await asyncio.sleep(delay_ms / 1000)
    if how == 1:
        handoff.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await handoff
        # Cut short: the request is whole on a, nothing of it on b; or it had committed.
        for _ in range(100):
            node, state = await cluster.where(rid)
            if state != "arriving":
                break
            await asyncio.sleep(0.02)
        assert node is not None and state == "admitted", (rid, node and node.name, state)
        return
    released = asyncio.ensure_future(asyncio.wait_for(a.client.release(rid), STUCK_S))
    done = await handoff
    with contextlib.suppress(NotFoundError):  # it had left a: the handoff committed first
        await released
    cluster.handed += done is not None and done.done
    node, _ = await cluster.where(rid)
    if node is not None:  # the release went to a, and the request was on b by then
        await call(node.client.release(rid))
    assert (await cluster.where(rid))[0] is None, f"{rid} outlived its release"
    del cluster.written[rid]


async def _step(cluster: Cluster, kind: int, x: int, y: int) -> None:
    rids = sorted(cluster.written)
    rid = rids[x % len(rids)] if rids else None
    node, state = await cluster.where(rid) if rid else (None, "")
    if kind == 0 or rid is None:  # a new request, its decode pages asked of the peer
        cluster.made += 1
        rid = f"r{cluster.made}"
        admit = cluster.a.client.admit(
            rid, prompt_tokens=(1 + x % 4) * BLOCK_TOKENS, output_tokens=(y % 3) * BLOCK_TOKENS,
            pool="prefill", handoff_pool="b/decode")
        if y == 9:  # the engine gives up at once: a's Admit is cancelled mid-way, or not
            with contextlib.suppress(asyncio.TimeoutError, *REFUSED):
                await asyncio.wait_for(admit, 0.0003 * (1 + x))
            if rid in await cluster.a.listed():
                cluster.written[rid] = {}
            return
        reply = await call(admit)  # refused when the tenant's share of a's queue is full
        if reply is not None and reply.decision != pb.DECISION_REJECTED:
            cluster.written[rid] = {}
        return
    if node is None:  # rejected from a's queue meanwhile (it can never fit)
        del cluster.written[rid]
        return
    if state != "admitted":  # queued on a (the peer said not now, or no room here)
        if kind == 5:
            await call(node.client.release(rid))
            del cluster.written[rid]
        return
    c = node.client
    if kind == 1:  # grow, and write what it was handed
        reply = await call(c.allocate(rid, 1 + y % 2))
        if reply is not None:
            await cluster.write(node, rid, reply.handles)
    elif kind == 2 and node is cluster.a:
        await _hand_off(cluster, rid, y % 3, (x * 7) % 40)
    elif kind == 3:
        await cluster.read(node, rid)
    elif kind == 4 and cluster.written[rid]:  # free one of its blocks
        index = sorted(cluster.written[rid])[y % len(cluster.written[rid])]
        freed = await call(c.free(rid, [index]))
        assert freed is not None and freed.num_freed == 1, freed
        del cluster.written[rid][index]
    elif kind == 5:
        await call(c.release(rid))
        del cluster.written[rid]
    elif kind == 7 and node is cluster.a:  # store (write, commit) a prefix's leading run
        await cluster.store(node, rid, CHAINS[x % 2][:1 + y % 4])
    elif kind == 8:  # load a prefix where the request runs (brought along by its handoff)
        await cluster.load(node, rid, CHAINS[x % 2][:1 + y % 4])
    elif kind == 9 and node is cluster.b:  # the decode engine's Step: grow and read all
        reply = await asyncio.wait_for(
            cluster.stream.step(allocations=[(rid, 1)] if y % 2 else [], read_all=[rid]),
            STUCK_S)
        held = len(cluster.written[rid]) + len(reply.allocated)
        for error in reply.errors:  # no room: the step goes on without it
            if held > cluster.b.device_pages and error.section == "read_all":
                # Grown past the device tier: never read whole, and told so.
                assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], error
                assert "at once needs as many device pages" in error.message, error
                cluster.refused_whole += 1
                continue
            assert error.code in STEP_REFUSED, error
        await cluster.write(node, rid, reply.allocated)
    elif kind == 6:  # the operator, on either node
        if y % 4 == 0:
            await call(cluster.b.client.set_policy(policy_names()[x % len(policy_names())],
                                                  pool="decode"))
        else:
            node = cluster.a if y % 2 else cluster.b
            await call(node.client.evict(1 + x % 3, pool=node.pool))


async def _settled(cluster: Cluster) -> None:
    """Every request released: nothing is left on either node (the peer's reservations go
    back in the background, so they are waited for a little)."""
    for node in (cluster.a, cluster.b):
        for rid in await node.listed():
            if (await node.listed()).get(rid) in ("admitted", "queued"):
                await call(node.client.release(rid))
    for _ in range(100):
        if not await cluster.a.listed() and not await cluster.b.listed():
            break
        await asyncio.sleep(0.05)
    assert await cluster.a.listed() == {}, "requests left on node a"
    assert await cluster.b.listed() == {}, "requests or reservations left on node b"
    for node in (cluster.a, cluster.b):
        await node.client.keep_alive()  # its engine is done with what it was handed
        stats = (await node.client.pool_stats(node.pool)).pools[0]
        assert (stats.num_requests, stats.reserved_pages, stats.handoff_reserved_pages,
                stats.held_pages) == (0, 0, 0, 0), (node.name, stats)
        # Only the prefix blocks kvd keeps as cache (one page each at most) are left.
        used = sum(t.used_pages for t in stats.tiers)
        assert used <= sum(map(len, CHAINS)), f"{used} pages left on node {node.name}"


async def _example(nodes, operations) -> Cluster:
    a_kvd, b_kvd = nodes
    async with AsyncClient(a_kvd.target, timeout_s=STUCK_S) as ca, \
            AsyncClient(b_kvd.target, timeout_s=STUCK_S) as cb:
        cluster = Cluster(Node("a", "prefill", ca, 10), Node("b", "decode", cb, 8))
        for node in (cluster.a, cluster.b):
            node.mapped = MappedPool(await node.client.export_pool(node.pool))
        try:
            await cb.set_policy("lru", pool="decode")
            async with cb.step_stream() as cluster.stream:  # the decode engine's
                for kind, x, y in operations:
                    await _step(cluster, kind, x, y)
                    for node in (cluster.a, cluster.b):
                        check = await node.client.self_check()
                        assert check.ok, (node.name, list(check.problems))
            await _settled(cluster)
            return cluster
        finally:
            with contextlib.suppress(Exception):  # after a failure: the next starts clean
                await _settled(cluster)
            for node in (cluster.a, cluster.b):
                node.mapped.close()


OPERATION = st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 9))
# Admitted, a prefix stored and its own blocks grown and written, read, handed off whole
# (the prefix along), the prefix loaded and the blocks read on the decode node, grown there
# by a call and by a Step, a block freed, read again.
HANDED_AND_READ = [(0, 3, 0), (7, 0, 3), (1, 0, 1), (3, 0, 0), (2, 0, 0), (8, 0, 3),
                   (3, 0, 0), (1, 0, 0), (9, 0, 1), (4, 0, 0), (3, 0, 0)]

# Handed off, then grown on the decode node past its 8 device pages (10 blocks, then 11 by
# a Step): read in parts, and a Step's read of it whole refused as such.
GROWN_PAST_THE_DEVICE = [(0, 3, 0), (1, 0, 1), (1, 0, 1), (2, 0, 0), (1, 0, 1), (1, 0, 1),
                         (1, 0, 1), (3, 0, 0), (9, 0, 1), (3, 0, 0)]


@pytest.mark.timeout(max(180, EXAMPLES * 15))
def test_random_traffic_across_two_nodes_reads_only_what_was_written(nodes):
    done = []
    loop = asyncio.new_event_loop()  # one loop for every example: grpc.aio keeps to it

    @on_live_daemons(EXAMPLES)
    @given(operations=st.lists(OPERATION, min_size=OPS // 3, max_size=OPS))
    @example(operations=HANDED_AND_READ)
    @example(operations=GROWN_PAST_THE_DEVICE)
    def run(operations):
        done.append(loop.run_until_complete(_example(nodes, operations)))

    try:
        run()
    finally:
        loop.close()
    first = done[0]
    assert (first.handed, first.reads, first.loads_on_b) == (1, 3, 4), \
        "the explicit example did not run as written"
    grown = done[1]
    assert (grown.handed, grown.reads, grown.read_in_parts, grown.refused_whole) == \
        (1, 2, 2, 1), "the example grown past the device did not run as written"
