"""A prefill pool on one kvd handing off to a decode pool on another (a peer, over TCP with
TLS): the decode pages are reserved on the peer at admission (or the peer's reason comes
back), the pages arrive byte for byte under the inter-node link's budget keeping the engine's
block indices, and a handoff cut short leaves the request whole where it was and nothing on
the peer."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvd_client import AsyncClient, pb
from kvd_client.arena import MappedPool
from kvd_loadgen.local import LocalKvd

from .test_tls import _port, pki  # noqa: F401 (a fixture)

PAGE = 16 * 1024  # tiny pages: 16 tokens of 1 KiB


def _peers(tmp_path, pki, *, link: str = "64MiB/s", decode_pages: int = 16,  # noqa: F811
           decode_host_pages: int = 64, b_tenants: str = "", a_top: str = "",
           b_server: str = ""):
    port = _port()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "kvd.toml").write_text(f"""
[server]
tcp = "127.0.0.1:{port}"
tls_cert = "{pki}/server.pem"
tls_key = "{pki}/server.key"
{b_server}
[auth]
admin_token = "b-admin-token-0123456789"
[[pool]]
name = "decode"
page_bytes = {PAGE}
block_tokens = 16
device_pages = {decode_pages}
host_pages = {decode_host_pages}
admission = "reservation"
{b_tenants}""")
    (tmp_path / "a" / "kvd.toml").write_text(f"""{a_top}
[[pool]]
name = "prefill"
page_bytes = {PAGE}
block_tokens = 16
device_pages = 64
host_pages = 64
admission = "reservation"
[[peer]]
name = "b"
address = "127.0.0.1:{port}"
token = "b-admin-token-0123456789"
tls_ca = "{pki}/ca.pem"
[[link]]
source = "prefill"
target = "b/decode"
bandwidth = "{link}"
""")
    a = LocalKvd("--config", str(tmp_path / "a" / "kvd.toml"), workdir=tmp_path / "a")
    b = LocalKvd("--config", str(tmp_path / "b" / "kvd.toml"), workdir=tmp_path / "b")
    return a, b


async def _write_blocks(client: AsyncClient, rid: str, num: int, seed: int) -> dict[int, bytes]:
    """The prefill engine writes a distinct pattern into each of the request's blocks."""
    mapped = MappedPool(await client.export_pool("prefill"))
    try:
        handles = (await client.allocate(rid, num)).handles
        rng = np.random.default_rng(seed)
        written = {}
        for h in handles:
            data = rng.integers(0, 256, mapped.page_bytes, dtype=np.uint8)
            mapped.write(h, data)
            written[h.block_index] = data.tobytes()
        return written
    finally:
        mapped.close()


async def _admitted_and_written(client: AsyncClient, seed: int) -> dict[int, bytes]:
    """Request "r" of 16 blocks, admitted to a's prefill pool to be handed off to b's decode
    pool, its blocks written (see _write_blocks)."""
    await client.admit("r", prompt_tokens=16 * 16, output_tokens=0, pool="prefill",
                       handoff_pool="b/decode")
    return await _write_blocks(client, "r", 16, seed=seed)


async def _read_blocks(client: AsyncClient, rid: str, pool: str) -> dict[int, bytes]:
    mapped = MappedPool(await client.export_pool(pool))
    try:
        return {h.block_index: mapped.page(h).tobytes()
                for h in (await client.access(rid)).handles}
    finally:
        mapped.close()


async def _requests(client: AsyncClient) -> dict[str, str]:
    return {r.request_id: r.state for r in await client.list_requests()}


async def test_a_handoff_across_nodes_delivers_the_pages_byte_for_byte(tmp_path, pki):  # noqa: F811
    a, b = _peers(tmp_path, pki)
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            admitted = await ca.admit("r1", prompt_tokens=10 * 16, output_tokens=32,
                                      pool="prefill", handoff_pool="b/decode", tenant="chat")
            assert admitted.decision == pb.DECISION_ADMITTED, admitted
            assert (await _requests(cb)) == {"r1": "reserved"}  # 12 pages held on b
            written = await _write_blocks(ca, "r1", 10, seed=1)
            progress = [p async for p in ca.handoff("r1")]
            assert progress[-1].done and progress[-1].blocks_done == 10
            assert progress[-1].pool == "b/decode"
            assert "r1" not in await _requests(ca)  # it left this node
            assert (await _requests(cb)) == {"r1": "admitted"}
            received = await _read_blocks(cb, "r1", "decode")
            assert received == written  # every page, at the engine's own block indices
            (link,) = [lk for lk in await ca.list_links() if lk.link == "prefill->b/decode"]
            assert link.bytes_total == 10 * PAGE
            assert {t.tenant: t.bytes for t in link.tenants} == {"chat": 10 * PAGE}
        shown = subprocess.run([str(Path(sys.executable).with_name("kvctl")), "--target",
                                a.target, "cluster"], capture_output=True, text=True,
                               timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "prefill->b/decode" in shown.stdout and "chat 0.2 MiB" in shown.stdout



async def test_a_routers_handoff_across_nodes_waits_for_the_engines_writes(tmp_path,
                                                                          pki):  # noqa: F811
    """A router hands the request to the peer while the engine's forward pass still writes
    the pages its last step was handed: nothing is sent before the engine's next message,
    and the peer gets what the engine wrote."""
    a, b = _peers(tmp_path, pki)
    with b, a:
        async with AsyncClient(a.target) as engine, AsyncClient(a.target) as router, \
                AsyncClient(b.target) as cb:
            await engine.admit("r", prompt_tokens=6 * 16, output_tokens=0, pool="prefill",
                               handoff_pool="b/decode")
            mapped = MappedPool(await engine.export_pool("prefill"))
            try:
                async with engine.step_stream() as stream:
                    handles = (await stream.step(allocations=[("r", 6)])).allocated
                    handing = asyncio.ensure_future(router.handoff_all("r"))
                    await asyncio.sleep(0.3)
                    assert not handing.done(), "sent while the engine still wrote the pages"
                    rng = np.random.default_rng(11)
                    written = {}
                    for h in handles:  # the forward pass, late
                        data = rng.integers(0, 256, mapped.page_bytes, dtype=np.uint8)
                        mapped.write(h, data)
                        written[h.block_index] = data.tobytes()
                    assert not (await stream.step()).errors  # its next message
                    last = await asyncio.wait_for(handing, 10)
            finally:
                mapped.close()
            assert last.done and last.pool == "b/decode"
            assert await _read_blocks(cb, "r", "decode") == written


async def test_a_request_handed_across_nodes_keeps_the_indices_it_used(tmp_path, pki):  # noqa: F811
    """Block indices freed after the request's last block are not handed out again on the
    peer: the peer used to go on from the last block it received, and a free the engine sent
    again (its first answer lost) freed the block it had just written there."""
    from kvd_client import NotFoundError

    a, b = _peers(tmp_path, pki)
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            await ca.admit("r1", prompt_tokens=4 * 16, output_tokens=32, pool="prefill",
                           handoff_pool="b/decode")
            await ca.allocate("r1", 4)
            await ca.free("r1", [2, 3])
            assert (await ca.handoff_all("r1")).done
            grown = (await cb.allocate("r1", 1)).handles
            assert [h.block_index for h in grown] == [4]
            with pytest.raises(NotFoundError, match="freed"):
                await cb.free("r1", [2])  # the free sent again
            assert [h.block_index for h in (await cb.access("r1")).handles] == [0, 1, 4]
            assert (await cb.self_check()).ok


async def test_the_peer_refuses_cleanly_and_its_reason_comes_back(tmp_path, pki):  # noqa: F811
    a, b = _peers(tmp_path, pki, decode_pages=16, decode_host_pages=4)  # 20 pages in all
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            never = await ca.admit("huge", prompt_tokens=20 * 16, output_tokens=0,
                                   pool="prefill", handoff_pool="b/decode")
            assert never.decision == pb.DECISION_REJECTED
            assert "can never be resident" in never.reason and "b/decode" in never.reason
            held = await ca.admit("first", prompt_tokens=12 * 16, output_tokens=0,
                                  pool="prefill", handoff_pool="b/decode")
            assert held.decision == pb.DECISION_ADMITTED
            later = await ca.admit("second", prompt_tokens=9 * 16, output_tokens=0,
                                   pool="prefill", handoff_pool="b/decode")
            assert later.decision == pb.DECISION_QUEUED, later
            assert "b/decode" in later.reason and "unreserved" in later.reason
            assert set(await _requests(cb)) == {"first"}  # nothing held for the queued one
            await ca.release("first")  # its reservation on b goes back...
            for _ in range(100):  # ...and a asks b again for the queued one
                if (await _requests(ca)).get("second") == "admitted":
                    break
                await asyncio.sleep(0.05)
            assert (await _requests(ca)).get("second") == "admitted"
            assert await _requests(cb) == {"second": "reserved"}


async def test_a_request_at_its_tenants_limit_on_the_peer_holds_no_other_tenant_up(
        tmp_path, pki):  # noqa: F811
    """alpha holds its 12-page limit in b's decode pool (a request handed off there); its
    next request waits on a for a reservation only alpha's own requests on b can make room
    for. beta's request, queued after it (first in line: neither tenant holds prefill pages
    on a), has its reservation on b and goes in at once. b said QUEUED for alpha's as for
    any wait, and a held its line for it."""
    a, b = _peers(tmp_path, pki, b_tenants='[[tenant]]\nname = "alpha"\nlimit = 12\n')
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            async def admit(rid, tenant):
                return await ca.admit(rid, prompt_tokens=12 * 16 if rid == "a1" else 2 * 16,
                                      output_tokens=0, pool="prefill",
                                      handoff_pool="b/decode", tenant=tenant)

            assert (await admit("a1", "alpha")).decision == pb.DECISION_ADMITTED
            await ca.allocate("a1", 1)
            assert [p async for p in ca.handoff("a1")][-1].done  # alpha's 12 pages on b
            capped = await admit("a2", "alpha")
            assert capped.decision == pb.DECISION_QUEUED, capped
            assert "12-page limit" in capped.reason and "b/decode" in capped.reason
            passed = await admit("b1", "beta")
            assert passed.decision == pb.DECISION_ADMITTED, passed.reason
            assert await _requests(ca) == {"a2": "queued", "b1": "admitted"}
            assert await _requests(cb) == {"a1": "admitted", "b1": "reserved"}
            await cb.release("a1")  # alpha's room on b: a asks b again for a2
            for _ in range(100):
                if (await _requests(ca)).get("a2") == "admitted":
                    break
                await asyncio.sleep(0.05)
            assert (await _requests(ca)).get("a2") == "admitted"


async def test_a_handoff_cut_short_leaves_the_request_whole_and_nothing_on_the_peer(
        tmp_path, pki):  # noqa: F811
    # 16 pages of 16 KiB at 64 KiB/s: four seconds of copying, cut after one.
    a, b = _peers(tmp_path, pki, link="64KiB/s")
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            written = await _admitted_and_written(ca, seed=2)
            free_before = (await cb.pool_stats("decode")).pools[0].tiers[0]

            async def hand_off():
                return [p async for p in ca.handoff("r")]

            call = asyncio.ensure_future(hand_off())
            await asyncio.sleep(1.0)
            call.cancel()  # the engine gave up: a cancels, the stream to b is cut
            with pytest.raises(asyncio.CancelledError):
                await call
            for _ in range(100):
                if "r" not in await _requests(cb):
                    break
                await asyncio.sleep(0.05)
            assert "r" not in await _requests(cb)
            after = (await cb.pool_stats("decode")).pools[0].tiers[0]
            assert after.used_pages == free_before.used_pages == 0
            assert (await _requests(ca)) == {"r": "admitted"}
            assert await _read_blocks(ca, "r", "prefill") == written  # whole, untouched
            assert (await cb.self_check()).ok and (await ca.self_check()).ok
            # The same handoff, let run, then completes.
            done = [p async for p in ca.handoff("r")]
            assert done[-1].done
            assert await _read_blocks(cb, "r", "decode") == written


async def test_the_peer_lists_a_request_whose_pages_are_arriving_as_arriving(
        tmp_path, pki):  # noqa: F811
    """While a handoff's pages cross to the peer, the sender lists the request as admitted
    (it runs there still) and the peer as arriving (the entry holds the pages being
    written; it said "admitted", as if the request ran on both nodes); then only the peer
    has it, admitted."""
    # 16 pages of 16 KiB at 64 KiB/s: two seconds of copying past the link's burst.
    a, b = _peers(tmp_path, pki, link="64KiB/s")
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            await _admitted_and_written(ca, seed=3)
            assert await _requests(cb) == {"r": "reserved"}
            call = asyncio.ensure_future(ca.handoff_all("r"))
            for _ in range(100):  # until the peer has claimed the reservation
                if await _requests(cb) != {"r": "reserved"}:
                    break
                await asyncio.sleep(0.02)
            assert await _requests(cb) == {"r": "arriving"}
            assert await _requests(ca) == {"r": "admitted"}
            assert (await call).done
            assert await _requests(cb) == {"r": "admitted"}
            assert await _requests(ca) == {}


async def test_the_peer_rolls_back_when_the_sender_dies_mid_stream(tmp_path, pki):  # noqa: F811
    a, b = _peers(tmp_path, pki, link="64KiB/s")
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            await _admitted_and_written(ca, seed=3)

            async def hand_off():
                return [p async for p in ca.handoff("r")]

            call = asyncio.ensure_future(hand_off())
            await asyncio.sleep(1.0)
            a.proc.send_signal(signal.SIGKILL)
            with pytest.raises(Exception):
                await call
            deadline = time.monotonic() + 10
            while "r" in await _requests(cb) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert "r" not in await _requests(cb)
            assert (await cb.pool_stats("decode")).pools[0].tiers[0].used_pages == 0
            assert (await cb.self_check()).ok


async def test_handoffs_of_pages_scattered_in_the_arena_arrive_in_block_order(tmp_path,
                                                                              pki):  # noqa: F811
    """After a few requests came and went, a request's blocks sit on pages in no particular
    order, and a chunk's runs of pages are not in block order: each must land at its own
    block (the first handoff of a fresh pool always had them in order)."""
    a, b = _peers(tmp_path, pki, link="8MiB/s")
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            for i in range(5):
                rid = f"r{i}"
                await ca.admit(rid, prompt_tokens=16 * 16, output_tokens=0, pool="prefill",
                               handoff_pool="b/decode")
                if i % 2:  # another request in between: the free pages interleave
                    await ca.admit(f"x{i}", prompt_tokens=3 * 16, output_tokens=0,
                                   pool="prefill")
                    await ca.allocate(f"x{i}", 3)
                written = await _write_blocks(ca, rid, 16, seed=10 + i)
                await ca.handoff_all(rid)
                assert await _read_blocks(cb, rid, "decode") == written, rid
                await cb.release(rid)
                if i % 2:
                    await ca.release(f"x{i}")


async def test_tenants_share_the_link_to_a_peer_by_weight(tmp_path, pki):  # noqa: F811
    """Two tenants handing off at once over a capped link to the peer: by weight, 3:1, as on
    a local link; the link runs at its cap."""
    a, b = _peers(tmp_path, pki, link="1MiB/s", decode_pages=128)
    config = tmp_path / "a" / "kvd.toml"
    config.write_text(config.read_text() + '\n[[tenant]]\nname = "gold"\nweight = 3\n'
                      '[[tenant]]\nname = "bronze"\nweight = 1\n')
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            for tenant in ("gold", "bronze"):
                for i in range(2):  # 2 x 24 pages each: 768 KiB a tenant, backlogged
                    rid = f"{tenant}{i}"
                    admitted = await ca.admit(rid, prompt_tokens=24 * 16, output_tokens=0,
                                              pool="prefill", handoff_pool="b/decode",
                                              tenant=tenant)
                    assert admitted.decision == pb.DECISION_ADMITTED, admitted
                    await ca.allocate(rid, 24)

            async def hand_off(rid):
                return await ca.handoff_all(rid)

            tasks = [asyncio.ensure_future(hand_off(f"{t}{i}"))
                     for t in ("gold", "bronze") for i in range(2)]
            async def sent() -> tuple[float, dict[str, int]]:
                (link,) = [lk for lk in await ca.list_links() if lk.link == "prefill->b/decode"]
                return time.monotonic(), {t.tenant: t.bytes for t in link.tenants}

            # Both backlogged until the second sample (bronze's 768 KiB not yet through).
            # The rate is measured between two samples: the calls that start the
            # handoffs are not counted as link time.
            await asyncio.sleep(0.15)
            t0, before = await sent()
            await asyncio.sleep(0.65)
            t1, after = await sent()
            await asyncio.gather(*tasks)
            assert len(await _requests(cb)) == 4
    gold, bronze = after.get("gold", 0), after.get("bronze", 0)
    # 3:1 within a page or two at this size (56 pages counted: 42:14 is 3.0, 44:12 is 3.7)
    assert 2.4 <= gold / max(bronze, 1) <= 4.0, after
    moved = sum(after.values()) - sum(before.values())
    assert moved / (t1 - t0) >= 0.8 * 2**20, (before, after)  # at its cap while both wait


async def test_a_request_handed_to_the_peer_leaves_its_lease_here(tmp_path, pki):  # noqa: F811
    """Its client's lease on the sender no longer holds a request handed to the peer: when
    that lease lapses later, the sender must not release the request now under that id (it
    released it, whoever had admitted it since)."""
    a, b = _peers(tmp_path, pki, a_top="[server]\nlease_ttl_s = 1.0")
    with b, a:
        async with AsyncClient(a.target) as later:
            async with AsyncClient(a.target) as first:
                await _admitted_and_written(first, seed=5)
                assert (await first.handoff_all("r")).done  # r left a for b
            # first's client is gone; its lease lapses in a second. The id is used again.
            admitted = await later.admit("r", prompt_tokens=16, output_tokens=0,
                                         pool="prefill")
            assert admitted.decision == pb.DECISION_ADMITTED
            for _ in range(12):  # past the lapse and the reaper's next rounds
                await later.keep_alive()
                await asyncio.sleep(0.25)
            assert await _requests(later) == {"r": "admitted"}, \
                "a lapsed lease released a request it never held"


async def test_a_request_handed_to_the_peer_is_held_by_the_engine_that_takes_it_up(
        tmp_path, pki):  # noqa: F811
    """On the peer, a request that arrived is the lease's of the first client whose call
    names it (the decode engine's): released when that client goes silent, kept while it
    calls; and one no client takes up within the lease TTL is released. It used to be
    nobody's there: left for ever when its decode engine died, or never came."""
    a, b = _peers(tmp_path, pki, b_server="lease_ttl_s = 1.0")
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as watcher:
            for rid in ("taken", "untaken"):
                await ca.admit(rid, prompt_tokens=2 * 16, pool="prefill",
                               handoff_pool="b/decode")
                await ca.allocate(rid, 2)
                assert (await ca.handoff_all(rid)).done
            async with AsyncClient(b.target) as decode:
                await decode.access("taken")  # the decode engine takes it up
                for _ in range(10):  # calling, past the TTL: it keeps the request
                    await decode.keep_alive()
                    await watcher.keep_alive()
                    await asyncio.sleep(0.25)
                assert await _requests(watcher) == {"taken": "admitted"}, \
                    "a request nobody took up outlived the lease TTL"
            # The decode engine is gone: its request goes once its lease lapses.
            for _ in range(40):
                if not await _requests(watcher):
                    break
                await asyncio.sleep(0.1)
            assert await _requests(watcher) == {}, "a gone engine's request was kept"
            stats = (await watcher.pool_stats("decode")).pools[0]
            assert sum(t.used_pages for t in stats.tiers) == 0


async def test_a_request_this_node_rejects_leaves_no_reservation_on_the_peer(tmp_path,
                                                                              pki):  # noqa: F811
    """The peer has room, this node never will (its prefill pool is smaller than the
    request): rejected, and the peer holds nothing for it."""
    a, b = _peers(tmp_path, pki, decode_pages=256)
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            reply = await ca.admit("big", prompt_tokens=100 * 16, output_tokens=0,
                                   pool="prefill", handoff_pool="b/decode")
            assert reply.decision == pb.DECISION_REJECTED
            assert "pool 'prefill'" in reply.reason
            for _ in range(50):
                if not await _requests(cb):
                    break
                await asyncio.sleep(0.05)
            assert await _requests(cb) == {}


def _one_pool(tmp_path, device_pages: int = 8, host_pages: int = 4) -> LocalKvd:
    """A kvd with a decode pool only, for a peer's Receive sent raw."""
    (tmp_path / "kvd.toml").write_text(f"""
[[pool]]
name = "decode"
page_bytes = {PAGE}
block_tokens = 16
device_pages = {device_pages}
host_pages = {host_pages}
""")
    return LocalKvd("--config", str(tmp_path / "kvd.toml"), workdir=tmp_path)


@pytest.mark.parametrize("pages", [
    [(0, b"A"), (0, b"A")],  # page 0 twice, page 1 never
    [(1, b"B"), (1, b"B")],  # page 1 twice, page 0 never
], ids=["first-twice", "second-twice"])
async def test_a_peer_that_sends_a_page_twice_and_another_never_is_refused(tmp_path, pages):
    # A buggy or hostile sender commits a two-page handoff with one page sent twice: the
    # page it never sent would hold what a former owner left in it (another tenant's
    # bytes). kvd refuses the stream, and keeps nothing of it.
    import grpc

    with _one_pool(tmp_path, device_pages=4) as kvd:
        async with AsyncClient(kvd.target) as c:
            receive = c.channel.stream_unary(
                "/kvd.v1.Peer/Receive", request_serializer=pb.PeerBlocks.SerializeToString,
                response_deserializer=pb.PeerReceiveResponse.FromString)

            async def messages():
                yield pb.PeerBlocks(request_id="r", pool="decode", block_indices=[0, 1],
                                    page_bytes=PAGE, tenant="default", prompt_tokens=32)
                for k, (first, fill) in enumerate(pages):
                    yield pb.PeerBlocks(first=first, data=fill * PAGE,
                                        commit=k == len(pages) - 1)

            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await receive(messages(), metadata=c.metadata)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "twice" in refused.value.details()
            assert "r" not in await _requests(c)
            assert (await c.pool_stats("decode")).pools[0].tiers[0].used_pages == 0
            assert (await c.self_check()).ok



async def test_a_peer_that_claims_too_many_indices_used_is_refused(tmp_path):
    """Each index a peer says the request used costs a slot here: past the bound, the
    stream is refused and nothing kept."""
    import grpc

    from kvd.peers import MAX_INDICES_USED

    with _one_pool(tmp_path) as kvd:
        async with AsyncClient(kvd.target) as c:
            receive = c.channel.stream_unary(
                "/kvd.v1.Peer/Receive", request_serializer=pb.PeerBlocks.SerializeToString,
                response_deserializer=pb.PeerReceiveResponse.FromString)

            async def messages():  # refused at its header: sent no further (see _receive)
                yield pb.PeerBlocks(request_id="r", pool="decode", block_indices=[0],
                                    indices_used=MAX_INDICES_USED + 1, page_bytes=PAGE,
                                    tenant="default", prompt_tokens=16)

            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await receive(messages(), metadata=c.metadata)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "indices_used" in refused.value.details()
            assert "r" not in await _requests(c)
            assert (await c.self_check()).ok


async def test_a_handoff_across_nodes_brings_the_shared_prefix_its_request_used(
        tmp_path, pki):  # noqa: F811
    # r1 prefilled on a 4-block prefix it stored and committed (the first block already on
    # the peer: another request stored it there) and 2 blocks of its own. On the peer the
    # decode engine loads its whole prefix by name, byte for byte, and this node keeps the
    # prefix for others; the block the peer had does not cross the link.
    keys = [hashlib.sha256(b"prefix/%d" % i).digest() for i in range(4)]
    rng = np.random.default_rng(11)
    prefix = {k: rng.integers(0, 256, PAGE, dtype=np.uint8) for k in keys}
    a, b = _peers(tmp_path, pki)
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            decode = MappedPool(await cb.export_pool("decode"))
            prefill = MappedPool(await ca.export_pool("prefill"))
            try:
                await cb.admit("other", 16, pool="decode")
                for h in (await cb.store("other", "m", keys[:1])).handles:
                    decode.write(h, prefix[keys[h.block_index]])
                await cb.commit("other", "m", keys[:1])
                await ca.admit("r1", prompt_tokens=6 * 16, output_tokens=16, pool="prefill",
                               handoff_pool="b/decode", tenant="chat")
                for h in (await ca.store("r1", "m", keys)).handles:
                    prefill.write(h, prefix[keys[h.block_index]])
                await ca.commit("r1", "m", keys)
                own = await _write_blocks(ca, "r1", 2, seed=12)
                progress = [p async for p in ca.handoff("r1")]
                assert progress[-1].done and progress[-1].blocks_done == 2
                assert await _read_blocks(cb, "r1", "decode") == own
                assert (await cb.lookup("m", keys, pool="decode")).num_hit == 4
                loaded = (await cb.load("r1", "m", keys)).handles
                assert len(loaded) == 4, "the decode node lacks the request's prefix"
                assert [decode.read(h).tobytes() for h in loaded] == [
                    prefix[k].tobytes() for k in keys]
                assert (await ca.lookup("m", keys, pool="prefill")).num_hit == 4
                (link,) = [k for k in await ca.list_links() if k.link == "prefill->b/decode"]
                assert link.bytes_total == 5 * PAGE  # its 2 blocks, 3 of the prefix's 4
                assert (await ca.self_check()).ok and (await cb.self_check()).ok
            finally:
                decode.close()
                prefill.close()


async def _receive(c: AsyncClient, shared: list[pb.PeerSharedBlock], pages: list[bytes],
                   header_only: bool = False):
    """A peer's handoff of a one-block request and its shared blocks' pages, sent raw
    (`header_only`: its first message alone)."""
    receive = c.channel.stream_unary(
        "/kvd.v1.Peer/Receive", request_serializer=pb.PeerBlocks.SerializeToString,
        response_deserializer=pb.PeerReceiveResponse.FromString)

    async def messages():
        yield pb.PeerBlocks(request_id="r", pool="decode", block_indices=[0], page_bytes=PAGE,
                            tenant="default", prompt_tokens=16 * 4, shared=shared)
        if header_only:
            return
        for i, data in enumerate([b"\1" * PAGE] + pages):
            yield pb.PeerBlocks(first=i, data=data, commit=i == len(pages))

    return await receive(messages(), metadata=c.metadata)


@pytest.mark.parametrize("shared, pages, why", [
    ([pb.PeerSharedBlock(namespace="m", key=b"k", sent=True)] * 2, [b"\2" * PAGE] * 2,
     "repeat"),
    ([pb.PeerSharedBlock(namespace="m", key=b"k", sent=True)], [], "committed with 1 of 2"),
    ([pb.PeerSharedBlock(namespace="m", key=b"k%d" % i) for i in range(12)], [],
     "more than the pool's 12 pages"),
], ids=["keys-repeat", "a-page-never-sent", "too-many"])
async def test_a_peer_whose_shared_blocks_are_unsound_is_refused(tmp_path, shared, pages, why):
    import grpc

    with _one_pool(tmp_path) as kvd:
        async with AsyncClient(kvd.target) as c:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                # Refused at its header, the stream is sent no further: a message written
                # after kvd's status has come makes grpc's asyncio client report INTERNAL
                # ("Internal error from Core") in place of it (grpc/grpc#36066).
                await _receive(c, shared, pages, header_only=why.startswith("more than"))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert why in refused.value.details()
            assert "r" not in await _requests(c)
            assert (await c.pool_stats("decode")).pools[0].tiers[0].used_pages == 0
            assert (await c.self_check()).ok


async def test_a_received_prefix_is_taken_up_to_a_block_this_node_no_longer_holds(tmp_path):
    # The sender's lookup said this node holds k0 of each chain; of the chain "m" it holds it
    # no more (let go since): its k1 is not stored (a lookup finds nothing past a gap). Of
    # the chain "n" it still does: both are the request's, k1 written with the peer's bytes.
    with _one_pool(tmp_path) as kvd:
        async with AsyncClient(kvd.target) as c:
            mapped = MappedPool(await c.export_pool("decode"))
            try:
                await c.admit("other", 16, pool="decode")
                (h,) = (await c.store("other", "n", [b"k0"])).handles
                mapped.write(h, np.frombuffer(b"\3" * PAGE, np.uint8))
                await c.commit("other", "n", [b"k0"])
                shared = [pb.PeerSharedBlock(namespace=ns, key=k, sent=k == b"k1")
                          for ns in ("m", "n") for k in (b"k0", b"k1")]
                await _receive(c, shared, [b"\4" * PAGE, b"\5" * PAGE])
                assert (await _requests(c))["r"] == "admitted"
                assert (await c.lookup("m", [b"k0", b"k1"], pool="decode")).num_hit == 0
                loaded = (await c.load("r", "n", [b"k0", b"k1"])).handles
                assert [mapped.read(h).tobytes() for h in loaded] == [b"\3" * PAGE,
                                                                      b"\5" * PAGE]
                assert (await c.self_check()).ok
            finally:
                mapped.close()


async def test_a_peers_pool_restricted_to_tenants_refuses_the_others_handoffs(
        tmp_path, pki):  # noqa: F811
    """b's decode pool is open to alpha only. a admitted beta's request to be handed off
    there (a knows nothing of b's pools), and b reserved its pages: any tenant of a could
    put its requests in a pool of b's that b keeps for others."""
    a, b = _peers(tmp_path, pki, b_tenants='tenants = ["alpha"]\n')
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            async def admit(rid, tenant):
                return await ca.admit(rid, prompt_tokens=2 * 16, output_tokens=0,
                                      pool="prefill", handoff_pool="b/decode", tenant=tenant)

            assert (await admit("a1", "alpha")).decision == pb.DECISION_ADMITTED
            refused = await admit("b1", "beta")
            assert refused.decision == pb.DECISION_REJECTED, refused
            assert "not open to tenant 'beta'" in refused.reason
            assert await _requests(cb) == {"a1": "reserved"}


async def test_a_handoff_across_nodes_commits_while_a_block_its_request_stored_moves(
        tmp_path, pki):  # noqa: F811
    """Once the peer committed the pages, the sender releases the request with the block
    it stored and never committed, which the operator's eviction was demoting: the release
    was refused (blocks in transit) with the request already the peer's, the handoff
    reported failed, and the request stayed on both nodes. The release waits for the
    demotion."""
    a, b = _peers(tmp_path, pki, link="32KiB")
    config = tmp_path / "a" / "kvd.toml"
    # A crawling host link (a page's demotion takes 2 s once its burst, a page, is spent);
    # the link to the peer carries a page in half a second past its burst.
    config.write_text(config.read_text().replace(
        "device_pages = 64\nhost_pages = 64",
        'device_pages = 3\nhost_pages = 8\nlink_bandwidth = "8KiB"\nlink_chunk = "16KiB"\n'
        'link_burst = "1"').replace('bandwidth = "32KiB"',
                                    'bandwidth = "32KiB"\nchunk = "16KiB"\nburst = "1"'))
    with b, a:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            await ca.admit("r", prompt_tokens=2 * 16, output_tokens=16, pool="prefill",
                           handoff_pool="b/decode")
            written = await _write_blocks(ca, "r", 2, seed=4)
            mapped = MappedPool(await ca.export_pool("prefill"))
            try:
                for h in (await ca.store("r", "m", [b"k"])).handles:
                    mapped.write(h, np.full(PAGE, 9, np.uint8))
            finally:
                mapped.close()
            await ca.keep_alive()  # written: its pages are no longer the engine's
            # r's first block goes to host at once, spending the host link's burst.
            (first,) = (await ca.evict(1, pool="prefill")).evicted
            assert (first.block_index, first.to_tier) == (0, pb.TIER_HOST)
            stream = ca.handoff("r")
            assert not (await stream.__anext__()).done  # a page crossed, one to go
            # r's blocks are the handoff's: k alone can go, 2 s on the host link.
            evicting = asyncio.ensure_future(ca.evict(1, pool="prefill"))
            last = [p async for p in stream][-1]
            assert last.done and last.pool == "b/decode"
            assert len((await evicting).evicted) == 1
            assert await _requests(ca) == {}
            assert await _requests(cb) == {"r": "admitted"}
            assert await _read_blocks(cb, "r", "decode") == written
            assert (await ca.self_check()).ok and (await cb.self_check()).ok
