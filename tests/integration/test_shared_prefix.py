"""Shared prefix blocks over real gRPC, with the engine side writing distinct bytes through
its own mapping of kvd's arenas and checking them on every load: stored once, found and
loaded by another tenant's request, kept after its writer ended, moved between tiers by real
copies, and charged 1/k to the k tenants using it."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest

from kvd_client import AsyncClient, InvalidArgumentError, pb
from kvd_client.arena import MappedPool
from kvd_loadgen.local import LocalKvd

NS = "tiny|"
KEYS = [hashlib.sha256(b"%d" % i).digest() for i in range(6)]


def _pattern(size: int, key: bytes) -> np.ndarray:
    return np.frombuffer((key * (size // len(key) + 1))[:size], np.uint8)


def _fill(arena, handle, key: bytes) -> None:
    arena.write(handle, _pattern(arena.page_bytes, key))


def _holds(arena, handle, key: bytes) -> bool:
    return bool(np.array_equal(arena.read(handle), _pattern(arena.page_bytes, key)))


async def _store_and_write(client, arena, rid, keys):
    reply = await client.store(rid, NS, keys)
    for h, fresh, key in zip(reply.handles, reply.fresh, keys):
        if fresh:
            _fill(arena, h, key)
    await client.commit(rid, NS, keys)
    return reply


async def test_a_prefix_written_by_one_tenant_is_loaded_intact_by_another(client):
    arena = MappedPool(await client.export_pool())
    try:
        await client.admit("writer", prompt_tokens=16 * 4, tenant="x")
        first = await _store_and_write(client, arena, "writer", KEYS[:4])
        assert list(first.fresh) == [True] * 4
        await client.admit("reader", prompt_tokens=16 * 6, tenant="y")
        found = await client.lookup(NS, KEYS)
        assert found.num_hit == 4 and set(found.tiers) == {pb.TIER_DEVICE}
        loaded = await client.load("reader", NS, KEYS)
        assert len(loaded.handles) == 4
        assert all(_holds(arena, h, k) for h, k in zip(loaded.handles, KEYS))
        # Both tenants use the four pages: each is charged half.
        tenants = {t.tenant: t for t in await client.list_tenants()}
        assert tenants["x"].charged_pages == pytest.approx(2)
        assert tenants["y"].charged_pages == pytest.approx(2)
        assert tenants["y"].shared_pages == 4 and tenants["y"].shared_saved_pages == 2
        # Explain says the same of the reader and its tenant.
        shares = (await client.explain("reader")).request_shares
        assert (shares.num_blocks, shares.shared_pages) == (4, 4)
        assert (shares.charged_pages, shares.saved_pages) == (pytest.approx(2),
                                                              pytest.approx(2))
        tenant = (await client.explain("writer")).tenant_shares
        assert (tenant.num_blocks, tenant.shared_pages) == (4, 4)
        assert tenant.charged_pages == pytest.approx(2)
        # The reader stores the rest of its prompt: only the two new keys are fresh.
        more = await _store_and_write(client, arena, "reader", KEYS)
        assert list(more.fresh) == [False] * 4 + [True] * 2
        await client.release("writer")
        await client.release("reader")
        # Kept after both ended; pushed to the host tier by another request's pages...
        await client.admit("big", prompt_tokens=16 * 8, tenant="z")
        await client.allocate("big", 8)
        found = await client.lookup(NS, KEYS)
        assert found.num_hit == 6 and pb.TIER_HOST in found.tiers
        # ...and still byte-exact there.
        await client.admit("late", prompt_tokens=16 * 6, tenant="y")
        loaded = await client.load("late", NS, KEYS)
        assert len(loaded.handles) == 6
        assert all(_holds(arena, h, k) for h, k in zip(loaded.handles, KEYS))
        await client.release("late")
        await client.release("big")
    finally:
        arena.close()


async def test_bad_prefix_calls_get_a_clear_status(client):
    await client.admit("r", prompt_tokens=32)
    with pytest.raises(InvalidArgumentError, match="repeat"):
        await client.store("r", NS, [KEYS[0], KEYS[0]])
    with pytest.raises(InvalidArgumentError, match="1..256 bytes"):
        await client.load("r", NS, [b""])
    with pytest.raises(InvalidArgumentError, match="did not store"):
        await client.commit("r", NS, KEYS[:1])
    assert (await client.lookup(NS, KEYS)).num_hit == 0
    await client.release("r")


async def test_a_requests_pin_holds_its_shared_blocks_until_it_ends(client):
    await client.admit("a", prompt_tokens=16 * 3)
    await client.store("a", NS, KEYS[:3], intent=pb.MemoryIntent(pin_requested=True))
    await client.commit("a", NS, KEYS[:3])
    await client.admit("b", prompt_tokens=16 * 2)
    await client.load("b", NS, KEYS[:2], intent=pb.MemoryIntent(pin_requested=True,
                                                                deadline_us=500_000))

    async def pinned():
        return (await client.pool_stats()).pools[0].tiers[0].pinned_pages

    assert await pinned() == 3
    await client.release("a")
    assert await pinned() == 2  # b still pins its two
    await client.release("b")
    assert await pinned() == 0
    await client.admit("c", prompt_tokens=16)
    with pytest.raises(InvalidArgumentError, match="shared blocks take only"):
        await client.load("c", NS, KEYS, intent=pb.MemoryIntent(priority=pb.PRIORITY_HOT))
    await client.release("c")


async def test_a_prefix_stored_by_two_requests_at_once_is_found_only_once_written(client):
    """Two engines with the same prompt store its prefix at once: the second stores before
    the first has written and committed. Each is told to write it (kvd has no written bytes
    for it yet), so whoever commits first publishes bytes it wrote, never an empty page."""
    arena = MappedPool(await client.export_pool())
    try:
        await client.admit("a", prompt_tokens=16 * 2, tenant="x")
        await client.admit("b", prompt_tokens=16 * 2, tenant="y")
        first = await client.store("a", NS, KEYS[:2])  # a writes it later
        second = await _store_and_write(client, arena, "b", KEYS[:2])
        await client.admit("c", prompt_tokens=16 * 2, tenant="z")
        loaded = await client.load("c", NS, KEYS[:2])
        assert len(loaded.handles) == 2
        assert all(_holds(arena, h, k) for h, k in zip(loaded.handles, KEYS)), \
            "a loaded prefix block holds bytes nobody wrote"
        assert list(first.fresh) == list(second.fresh) == [True, True]
        for rid in ("a", "b", "c"):
            await client.release(rid)
    finally:
        arena.close()


async def test_a_prefix_whose_first_writer_ended_is_written_by_the_next(client):
    """The first request to store a prefix ends before it commits (its engine died): the
    request that stored it meanwhile writes and commits it, and the next request finds it."""
    arena = MappedPool(await client.export_pool())
    try:
        await client.admit("a", prompt_tokens=16 * 2, tenant="x")
        await client.admit("b", prompt_tokens=16 * 2, tenant="y")
        await client.store("a", NS, KEYS[:2])
        second = await client.store("b", NS, KEYS[:2])
        await client.release("a")  # never wrote, never committed
        written = []
        for h, fresh, k in zip(second.handles, second.fresh, KEYS):
            if fresh:
                _fill(arena, h, k)
                written.append(k)
        if written:  # as the engines' connectors do: commit what was written
            await client.commit("b", NS, written)
        found = await client.lookup(NS, KEYS[:2])
        assert found.num_hit == 2, "the prefix is never cached while a request uses it"
        await client.admit("c", prompt_tokens=16 * 2, tenant="z")
        loaded = await client.load("c", NS, KEYS[:2])
        assert all(_holds(arena, h, k) for h, k in zip(loaded.handles, KEYS))
        for rid in ("b", "c"):
            await client.release(rid)
    finally:
        arena.close()


SLOW_LINK = """
[[pool]]
model = "tiny"
device_pages = 2
host_pages = 8
admission = "reservation"
link_bandwidth = "8KiB"  # a page in two seconds once its burst is spent
link_chunk = "16KiB"
link_burst = "16KiB"
"""


async def test_a_block_still_being_placed_is_published_only_by_the_store_that_writes_it(
        tmp_path):
    """A store whose new page is being vacated (a victim copied out over a slow link) has
    not answered yet; another request stores the same key meanwhile and is told it has
    nothing to write (the block is moving). That request's commit published the block, and
    the first store, answering after, saw it committed and told its engine there was
    nothing to write either: every lookup then found a page holding the victim's bytes.
    The engines sharing prefixes at once (test_prefix_chaos) found it as a loaded block
    holding another request's private bytes."""
    config = tmp_path / "kvd.toml"
    config.write_text(SLOW_LINK)
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=20) as a, \
                AsyncClient(kvd.target, timeout_s=20) as b:
            arena = MappedPool(await a.export_pool())
            try:
                for rid in ("filler", "filler2"):  # the device full, the link's burst
                    await a.admit(rid, prompt_tokens=16, tenant="x")  # spent in between
                    for h in (await a.allocate(rid, 1)).handles:
                        arena.write(h, np.full(arena.page_bytes, 7, np.uint8))
                    if rid == "filler":
                        await a.allocate("filler", 1)
                        await a.evict(1)
                await a.admit("a", prompt_tokens=16, tenant="x")
                await b.admit("b", prompt_tokens=16, tenant="y")
                first = asyncio.ensure_future(a.store("a", NS, KEYS[:1]))  # ~1 s of copy
                await asyncio.sleep(0.3)
                assert not first.done()
                second = await b.store("b", NS, KEYS[:1])
                assert list(second.fresh) == [False]  # still being placed: not written into
                assert (await b.commit("b", NS, KEYS[:1])).num_committed == 0
                assert (await b.lookup(NS, KEYS[:1])).num_hit == 0, \
                    "a block nobody wrote was published"
                stored = await first
                assert list(stored.fresh) == [True]  # the first store's engine writes it
                _fill(arena, stored.handles[0], KEYS[0])
                assert (await a.commit("a", NS, KEYS[:1])).num_committed == 1
                await b.admit("c", prompt_tokens=16, tenant="y")
                loaded = await b.load("c", NS, KEYS[:1])
                assert [_holds(arena, h, KEYS[0]) for h in loaded.handles] == [True]
                for rid in ("filler", "filler2", "a", "b", "c"):
                    await a.release(rid)
                assert (await a.self_check()).ok
            finally:
                arena.close()


async def test_an_engine_is_never_told_to_write_a_page_that_may_be_given_away(tmp_path):
    """A stored a prefix block, wrote it, and called again before committing it; the block
    went to the host tier under B's allocation. A stored it again, and kvd told it to write
    the block where it was: in its host page. The operator released A's request before A's
    engine wrote, and kvd gave that host page (kept out of use only in the device tier) to
    the next block demoted: one of B's. A's write then landed in B's block, and B read A's
    bytes. An engine is now told to write device pages only, which kvd keeps until its next
    call."""
    with LocalKvd("--device-pages", "2", "--host-pages", "2", "--page-bytes", "4096",
                  "--policy", "lru", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target) as a, AsyncClient(kvd.target) as b, \
                AsyncClient(kvd.target) as operator:
            arena = MappedPool(await operator.export_pool())
            try:
                await a.admit("a", prompt_tokens=16)
                (h,) = (await a.store("a", NS, KEYS[:1])).handles
                _fill(arena, h, KEYS[0])
                await a.keep_alive()  # called again, the block not committed yet
                await b.admit("b", prompt_tokens=32)
                mine = {h.block_index: bytes([h.block_index + 1]) * 32
                        for h in (await b.allocate("b", 2)).handles}
                for h in (await b.access("b")).handles:
                    _fill(arena, h, mine[h.block_index])
                await b.keep_alive()
                again = await a.store("a", NS, KEYS[:1])  # found in the host tier
                told = [h for h, fresh in zip(again.handles, again.fresh) if fresh]
                assert all(h.tier == pb.TIER_DEVICE for h in told), "told to write a host page"
                await operator.release("a")  # while A's engine writes
                await operator.evict(1)  # B's device block demoted: into a host page free now
                for h in told:  # A's engine writes what it was told to, as it was told
                    _fill(arena, h, KEYS[0])
                await a.keep_alive()
                for h in (await b.access("b")).handles:
                    assert _holds(arena, h, mine[h.block_index]), \
                        f"B's block {h.block_index} holds another request's bytes"
                assert (await operator.self_check()).ok
            finally:
                arena.close()


async def test_a_commit_publishes_only_what_the_last_store_said_to_write(tmp_path):
    """A's store was told to write a new block, and its engine never wrote it (its copy
    failed). The block went to the host tier uncommitted under B's allocation, and A stored
    it again: not fresh this time (kvd tells engines to write device pages only). A commit of
    every key A stored, which the API says leaves alone the keys its Store reply did not
    mark fresh, committed it all the same, A being the request told to write it at the
    first store: lookups then found a page nobody had written, and every engine loaded its
    unwritten bytes as the prefix's KV."""
    with LocalKvd("--device-pages", "2", "--host-pages", "2", "--page-bytes", "4096",
                  "--policy", "lru", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target) as a, AsyncClient(kvd.target) as b:
            await a.admit("a", prompt_tokens=16)
            first = await a.store("a", NS, KEYS[:1])
            assert list(first.fresh) == [True]  # ... and its engine never writes it
            await a.keep_alive()  # called again, the block not committed
            await b.admit("b", prompt_tokens=32)
            await b.allocate("b", 2)  # pushes A's block out of the device tier
            again = await a.store("a", NS, KEYS[:1])
            assert again.handles[0].tier == pb.TIER_HOST and list(again.fresh) == [False]
            committed = (await a.commit("a", NS, KEYS[:1])).num_committed
            assert committed == 0, "committed a key its Store reply did not mark fresh"
            assert (await b.lookup(NS, KEYS[:1])).num_hit == 0, "a page nobody wrote is found"


async def test_a_block_its_writer_never_wrote_is_written_by_the_next_request_to_store_it(
        tmp_path):
    """A's engine never wrote a new block (it died, or its copy failed), and the block went to
    the host tier uncommitted. Engines are told to write device pages only, so every later
    store of the key was told there was nothing to write: while some request used the
    block, no engine wrote it and no lookup found it. A hot prefix (a system prompt) was
    never cached again. A store now brings such a block back to the device to be written."""
    with LocalKvd("--device-pages", "2", "--host-pages", "4", "--page-bytes", "4096",
                  "--policy", "lru", "--admission", "reservation", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target) as a, AsyncClient(kvd.target) as b, \
                AsyncClient(kvd.target) as c:
            arena = MappedPool(await c.export_pool())
            try:
                await a.admit("a", prompt_tokens=16)
                assert list((await a.store("a", NS, KEYS[:1])).fresh) == [True]
                await a.keep_alive()  # its engine never writes the block
                await b.admit("b", prompt_tokens=32)
                await b.allocate("b", 2)  # pushes the block out of the device tier
                await b.keep_alive()
                await c.admit("c", prompt_tokens=16)
                reply = await _store_and_write(c, arena, "c", KEYS[:1])
                assert list(reply.fresh) == [True], "nobody is left to write the block"
                assert reply.handles[0].tier == pb.TIER_DEVICE
                await a.release("a")
                assert (await b.lookup(NS, KEYS[:1])).num_hit == 1
                await b.release("b")
                await b.admit("b2", prompt_tokens=16)
                (h,) = (await b.load("b2", NS, KEYS[:1])).handles
                assert _holds(arena, h, KEYS[0])
                assert (await c.self_check()).ok
            finally:
                arena.close()
