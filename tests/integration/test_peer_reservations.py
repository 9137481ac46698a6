"""What a node reserves on its peer for a request's handoff is given back as soon as nothing
here can claim it: when the Admit that asked is cancelled while the peer answers, and when the
request is released while a retry asks the peer again. Left to the peer's TTL instead, each
would hold decode pages on the peer that no other request could have for a minute: a client
that cancels its Admits could keep a peer's pool full.

The peer is a stand-in: a real gRPC server on a real TCP socket, serving kvd.v1.Peer's Reserve
and Unreserve from this test (its other methods are not called here), so the test decides when
and how the peer answers. The real peer's side is tested in test_cross_node."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from kvd_api.v1 import kvd_pb2_grpc as pb_grpc
from kvd_client import AsyncClient, pb
from kvd_client.errors import DeadlineExceededError, ResourceExhaustedError
from kvd_loadgen.local import LocalKvd

from .test_tls import _port

PAGE = 16 * 1024


class StandInPeer(pb_grpc.PeerServicer):
    """A peer's reservations. Each Reserve is put in `asked` and answered with the next
    decision the test puts in `answers`. `at_once`: the reservation is made as the call
    arrives, before the answer, as a real peer makes it (the answer may then never get
    back); otherwise it is made as the answer goes, as when the peer served the call after
    one sent later (an Unreserve: separate calls keep no order)."""

    def __init__(self, at_once: bool) -> None:
        self.at_once = at_once
        self.reserved: set[str] = set()
        self.asked: asyncio.Queue[str] = asyncio.Queue()
        self.answers: asyncio.Queue[int] = asyncio.Queue()
        self.unreserves = 0
        self.answered = asyncio.Event()  # set as each answer goes

    async def Reserve(self, request, context):
        rid = request.request_id
        if self.at_once:
            self.reserved.add(rid)
        await self.asked.put(rid)
        decision = await self.answers.get()
        if decision == pb.DECISION_ADMITTED:
            self.reserved.add(rid)
        else:
            self.reserved.discard(rid)
        self.answered.set()
        return pb.PeerReserveResponse(decision=decision, reason="the stand-in says so")

    async def Unreserve(self, request, context):
        self.unreserves += 1
        self.reserved.discard(request.request_id)
        return pb.PeerUnreserveResponse()


async def _serve(peer: StandInPeer, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_PeerServicer_to_server(peer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def _node(tmp_path, port: int, pool_extra: str = "") -> LocalKvd:
    (tmp_path / "kvd.toml").write_text(f"""
[[pool]]
name = "prefill"
page_bytes = {PAGE}
block_tokens = 16
device_pages = 64
host_pages = 64
admission = "reservation"
{pool_extra}
[[peer]]
name = "p"
address = "127.0.0.1:{port}"
timeout_s = 30
[[link]]
source = "prefill"
target = "p/decode"
bandwidth = "64MiB/s"
""")
    return LocalKvd("--config", str(tmp_path / "kvd.toml"), workdir=tmp_path)


@contextlib.asynccontextmanager
async def _node_and_peer(tmp_path, *, at_once: bool, pool_extra: str = ""):
    """A kvd whose handoff pool is the stand-in peer's (see StandInPeer), and the peer."""
    port = _port()
    peer = StandInPeer(at_once)
    server = await _serve(peer, port)
    try:
        with _node(tmp_path, port, pool_extra) as kvd:
            yield kvd, peer
    finally:
        await server.stop(None)


async def _given_back(peer: StandInPeer, timeout_s: float = 5.0) -> bool:
    """Whether the peer holds no reservation within timeout_s."""
    for _ in range(int(timeout_s / 0.05)):
        if not peer.reserved:
            return True
        await asyncio.sleep(0.05)
    return not peer.reserved


async def test_an_admit_cancelled_while_the_peer_answers_gives_the_reservation_back(tmp_path):
    """The engine's Admit runs out of time while the peer, which has reserved, answers:
    kvd tells the peer at once, and the request is nowhere."""
    async with _node_and_peer(tmp_path, at_once=True) as (kvd, peer):
        async with AsyncClient(kvd.target, timeout_s=10) as client:
            async with AsyncClient(kvd.target, timeout_s=0.5) as hasty:
                with pytest.raises(DeadlineExceededError):
                    await hasty.admit("r", prompt_tokens=4 * 16, pool="prefill",
                                      handoff_pool="p/decode")
            assert await asyncio.wait_for(peer.asked.get(), 1) == "r"
            assert await _given_back(peer), \
                "the peer still holds the cancelled Admit's reservation"
            assert await client.list_requests() == []
            # The id is free, and a new Admit of it reserves again.
            admit = asyncio.ensure_future(client.admit(
                "r", prompt_tokens=4 * 16, pool="prefill", handoff_pool="p/decode"))
            assert await asyncio.wait_for(peer.asked.get(), 5) == "r"
            await peer.answers.put(pb.DECISION_ADMITTED)
            assert (await admit).decision == pb.DECISION_ADMITTED
            assert peer.reserved == {"r"}


async def test_a_request_released_while_a_retry_asks_the_peer_leaves_nothing_there(tmp_path):
    """Queued because the peer said not now; released while kvd's retry asks again, and
    the peer serves the release's Unreserve before that Reserve: the reservation the retry
    brings back has no request, and kvd gives it back."""
    async with _node_and_peer(tmp_path, at_once=False) as (kvd, peer):
        async with AsyncClient(kvd.target, timeout_s=10) as client:
            admit = asyncio.ensure_future(client.admit(
                "r", prompt_tokens=4 * 16, pool="prefill", handoff_pool="p/decode"))
            assert await asyncio.wait_for(peer.asked.get(), 5) == "r"
            await peer.answers.put(pb.DECISION_QUEUED)
            assert (await admit).decision == pb.DECISION_QUEUED
            # kvd asks again (every second); the request is released meanwhile.
            assert await asyncio.wait_for(peer.asked.get(), 5) == "r"
            await client.release("r")
            for _ in range(100):  # the release's Unreserve, served first
                if peer.unreserves:
                    break
                await asyncio.sleep(0.05)
            unreserved = peer.unreserves
            assert unreserved == 1
            peer.answered.clear()
            await peer.answers.put(pb.DECISION_ADMITTED)
            await asyncio.wait_for(peer.answered.wait(), 5)
            assert await _given_back(peer), \
                "the peer holds a reservation for a request released here"
            assert peer.unreserves > unreserved
            assert await client.list_requests() == []


async def test_an_admit_refused_here_after_the_peer_reserved_gives_the_reservation_back(
        tmp_path):
    """The peer reserves, then this node refuses the Admit (the tenant's share of its
    admission queue is full): the peer's reservation goes back at once, and the queued
    request keeps its own."""
    async with _node_and_peer(tmp_path, at_once=True, pool_extra="max_queue = 1") as (kvd, peer):
        async with AsyncClient(kvd.target, timeout_s=10) as client:
            for n in range(64):  # requests of q1's size until no room is left here
                local = await client.admit(f"local{n}", prompt_tokens=4 * 16,
                                           pool="prefill")
                if local.decision != pb.DECISION_ADMITTED:
                    await client.release(f"local{n}")
                    break
            assert local.decision == pb.DECISION_QUEUED
            for rid, answer in (("q1", pb.DECISION_QUEUED), ("q2", None)):
                admit = asyncio.ensure_future(client.admit(
                    rid, prompt_tokens=4 * 16, pool="prefill", handoff_pool="p/decode"))
                assert await asyncio.wait_for(peer.asked.get(), 5) == rid
                await peer.answers.put(pb.DECISION_ADMITTED)
                if answer is not None:
                    assert (await admit).decision == answer  # reserved there, queued here
            with pytest.raises(ResourceExhaustedError, match="admission queue"):
                await admit
            for _ in range(100):
                if peer.reserved == {"q1"}:
                    break
                await asyncio.sleep(0.05)
            assert peer.reserved == {"q1"}, \
                "the peer holds a reservation for an Admit this node refused"
