"""Handoff across nodes: a prefill pool on this node, its decode pool in another node's kvd
(a `[[peer]]`; the handoff pool is named `PEER/POOL`).

- **At admission** the prefill kvd asks the peer to reserve the request's decode pages
  (`Peer.Reserve`). The peer reserves (the request is admitted here), says not now (it waits
  in this node's queue, with the peer's reason, and is asked again until the peer says yes),
  or never (rejected, with the peer's reason). A request released before its handoff gives
  its reservation back (`Peer.Unreserve`; the peer's `handoff_ttl_s` is the backstop).
- **The handoff** copies nothing between arenas here: the request's pages are read from this
  node's arenas and streamed to the peer (`Peer.Receive`), under the `[[link]]` to `PEER/POOL`
  (its bandwidth budget, pacing, classes and tenants' weights and caps, as any link), keeping
  the engine's block indices. The peer writes them into the pages it allocated and makes the
  request live only at the stream's commit; a stream cut before it leaves nothing there, and
  the request stays whole here. After the peer's answer the request leaves this node.
- **Its shared prefix** goes in the same stream, after its own pages: each committed prefix
  block it used, but for the leading run of each namespace the peer's Lookup says it holds.
  The peer stores them for the request under their names after the commit, writing those it
  has no bytes for, so the decode engine Loads its whole prefix there; this node keeps them.

The transport is `BlockSender`: kvd-to-kvd gRPC over TCP, TLS by default (the peer's CA;
mTLS with a certificate of this kvd's). An RDMA transfer engine (Mooncake's TransferEngine,
NVIDIA NIXL) would fill the same place: both arenas registered with it once at start, the
peer's Reserve reply carrying the device addresses of the pages it allocated, one batch of
one-sided writes per chunk instead of messages, and the commit as the one message left.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import grpc
import structlog

from kvd.config import Config, PeerConfig
from kvd.core.blocks import Request, RequestState, TierKind
from kvd.core import prefix
from kvd.core.errors import (Aborted, BlocksInTransit, FailedPrecondition, InvalidArgument,
                             KvdError, NotFound, PermissionDenied)
from kvd.core.holds import OWN_HOLDER
from kvd.core.pages import MAX_BLOCK_INDEX
from kvd.core.reservation import PoolReserver, Verdict
from kvd.core.transfer import Reason
from kvd.memory.copier import chunk_runs, page_runs, read_pages, write_pages
from kvd_api.v1 import kvd_pb2 as pb
from kvd_api.v1 import kvd_pb2_grpc as pb_grpc
from kvd_client.pem import read_pem

log = structlog.get_logger("kvd.peers")

# The most block indices a request handed off here may say it used (PeerBlocks.indices_used,
# each a slot here): as many as the block indices a handoff may name.
MAX_INDICES_USED = MAX_BLOCK_INDEX + 1
_VERDICTS = {pb.DECISION_ADMITTED: Verdict.OK, pb.DECISION_QUEUED: Verdict.WAIT,
             pb.DECISION_REJECTED: Verdict.NEVER}


def is_remote(pool: str) -> bool:
    return "/" in pool


def split(pool: str) -> tuple[str, str]:
    """PEER/POOL -> (peer, pool)."""
    peer, _, name = pool.partition("/")
    return peer, name


class PeerLink:
    """A channel to one peer kvd (its Peer service, and its Memory service's lookups), with
    its admin token."""

    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        options = [("grpc.max_send_message_length", 64 * 2**20),
                   ("grpc.max_receive_message_length", 64 * 2**20)]
        if config.tls_ca:
            try:
                pem = read_pem({"tls_ca": config.tls_ca, "tls_cert": config.tls_cert,
                                "tls_key": config.tls_key}, server=False)
            except ValueError as exc:
                raise InvalidArgument(f"[[peer]] {config.name!r}: {exc}") from None
            credentials = grpc.ssl_channel_credentials(
                root_certificates=pem["tls_ca"], private_key=pem["tls_key"],
                certificate_chain=pem["tls_cert"])
            self.channel = grpc.aio.secure_channel(config.address, credentials, options)
        else:
            self.channel = grpc.aio.insecure_channel(config.address, options)
        self.stub = pb_grpc.PeerStub(self.channel)
        self.memory = pb_grpc.MemoryStub(self.channel)  # the peer's Lookup of prefix blocks
        self.metadata = (("authorization", f"Bearer {config.token}"),) if config.token else ()

    async def close(self) -> None:
        await self.channel.close()


class Peers:
    """This node's peers, and the verdicts of its requests' remote reservations."""

    def __init__(self, config: Config) -> None:
        self.configs = {p.name: p for p in config.peers}
        self.links: dict[str, PeerLink] = {}  # made on first use, on the event loop
        # request id -> (verdict, reason) from its handoff pool's peer.
        self.verdicts: dict[str, tuple[Verdict, str]] = {}

    def open(self) -> None:
        """A link to every peer now, on the event loop (kvd's start): a PEM file that cannot
        be read or used stops the start (InvalidArgument), not the first handoff's call."""
        for peer in self.configs:
            self.link(peer)

    def link(self, peer: str) -> PeerLink:
        link = self.links.get(peer)
        if link is None:
            config = self.configs.get(peer)
            if config is None:
                raise NotFound(f"no [[peer]] {peer!r}")
            link = self.links[peer] = PeerLink(config)
        return link

    async def close(self) -> None:
        for link in self.links.values():
            with contextlib.suppress(Exception):
                await link.close()

    async def reserve(self, req: Request, page_bytes: int, block_tokens: int) -> Verdict:
        """Ask the peer to reserve req's decode pages; the verdict is kept for the pool's
        admission (RemoteReserver) and returned."""
        peer, pool = split(req.handoff_pool)
        link = self.link(peer)
        try:
            reply = await link.stub.Reserve(pb.PeerReserveRequest(
                request_id=req.request_id, tenant=req.tenant, pool=pool,
                prompt_tokens=req.prompt_tokens, output_tokens=req.output_tokens,
                priority=req.priority, page_bytes=page_bytes, block_tokens=block_tokens),
                metadata=link.metadata, timeout=link.config.timeout_s)
            verdict, reason = _VERDICTS.get(reply.decision, Verdict.WAIT), reply.reason
            if verdict is Verdict.WAIT and reply.capped:
                verdict = Verdict.CAPPED
        except grpc.RpcError as err:  # the peer is away: not now, and say why
            verdict = Verdict.WAIT
            reason = (f"handoff pool {req.handoff_pool!r}: peer {peer!r} at "
                      f"{link.config.address} did not answer ({err.code().name}: "
                      f"{err.details()})")
        if verdict is not Verdict.OK:  # in the caller's words: the pool is PEER/POOL here
            theirs = f"handoff pool {pool!r}: "
            reason = f"handoff pool {req.handoff_pool!r}: {reason.removeprefix(theirs)}" \
                if not reason.startswith(f"handoff pool {req.handoff_pool!r}") else reason
        self.verdicts[req.request_id] = (verdict, reason)
        return verdict

    def unreserve(self, handoff_pool: str, request_id: str) -> None:
        """Give a reservation back (in the background: the peer's TTL is the backstop)."""
        self.verdicts.pop(request_id, None)
        peer, pool = split(handoff_pool)
        if peer not in self.configs:
            return
        link = self.link(peer)

        async def call():
            with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
                await link.stub.Unreserve(pb.PeerUnreserveRequest(request_id=request_id,
                                                                  pool=pool),
                                          metadata=link.metadata,
                                          timeout=link.config.timeout_s)

        asyncio.ensure_future(call())


class RemoteReserver:
    """What a pool's admission asks of a remote handoff pool: the peer's last verdict (the
    node asked before admitting, and asks again for requests left waiting)."""

    def __init__(self, peers: Peers) -> None:
        self.peers = peers

    def state(self, req: Request) -> tuple[Verdict, str]:
        return self.peers.verdicts.get(
            req.request_id, (Verdict.WAIT, f"handoff pool {req.handoff_pool!r}: waiting for "
                                           "the peer's answer"))

    def reserve(self, req: Request) -> None:
        """The peer reserved already (its verdict was OK)."""


class Reservers:
    """A pool's reserver: its node's pools, or a peer's for PEER/POOL."""

    def __init__(self, local: PoolReserver, remote: RemoteReserver) -> None:
        self.local = local
        self.remote = remote

    def state(self, req: Request) -> tuple[Verdict, str]:
        return (self.remote if is_remote(req.handoff_pool) else self.local).state(req)

    def reserve(self, req: Request) -> None:
        (self.remote if is_remote(req.handoff_pool) else self.local).reserve(req)


# ---------------------------------------------------------------------- the sending side

class BlockSender:
    """Streams a request's pages to a peer's pool over the link to it (Peer.Receive), all or
    nothing: `send` returns when the peer committed, or raises (the peer then keeps
    nothing)."""

    def __init__(self, link: PeerLink) -> None:
        self.link = link

    async def send(self, header: pb.PeerBlocks, submit: Callable, stop: Callable) -> int:
        """submit(put) starts the link's transfer, whose copy calls put(message) for each
        chunk from a worker thread (blocking while two are in flight: the network's pace
        holds the link back too) and returns the transfer's future; stop() cancels it."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue(maxsize=2)
        done = object()
        closed = False

        def put(message: pb.PeerBlocks) -> None:  # from the link's worker thread
            if not closed:
                asyncio.run_coroutine_threadsafe(out.put(message), loop).result()

        async def messages():
            yield header
            while (message := await out.get()) is not done:
                yield message

        call = self.link.stub.Receive(messages(), metadata=self.link.metadata)
        sent = answer = None
        try:
            future = submit(put)
            sent = asyncio.ensure_future(_then(future, out.put, pb.PeerBlocks(commit=True)))
            answer = asyncio.ensure_future(_answer(call))
            await asyncio.wait({sent, answer}, return_when=asyncio.FIRST_EXCEPTION)
            if sent.done() and sent.exception() is not None:
                raise sent.exception()  # the link stopped the copy: cut the stream
            reply = await answer
            await sent
            return reply.blocks
        except BaseException:
            call.cancel()  # the peer keeps nothing of a stream that never committed
            stop()
            closed = True
            while not out.empty():  # a worker blocked on a full queue goes on, and stops
                out.get_nowait()
            for task in (sent, answer):
                if task is not None and not task.done():
                    task.cancel()
            raise


async def _answer(call):
    return await call


async def _then(future, put, last) -> None:
    await future  # every chunk went (raises what stopped it)
    await put(last)


def chunk_messages(blocks, arenas: dict, chunk_pages: int) -> list[list[tuple]]:
    """A handoff's pages as link chunks of runs (src tier, src page, ordinal, num)."""
    pairs = [(b.tier, b.page, TierKind.DEVICE, i) for i, b in enumerate(blocks)]
    return chunk_runs(page_runs(pairs), chunk_pages) if pairs else []


def read_chunk(runs, arenas: dict) -> list[pb.PeerBlocks]:
    """One chunk's pages as messages, one a run: a run's pages are consecutive blocks of the
    request (the runs of a chunk are not in block order)."""
    return [pb.PeerBlocks(first=ordinal, data=read_pages(arenas[src_tier], src_page, num))
            for src_tier, src_page, _dst, ordinal, num in runs]


# ---------------------------------------------------------------------- the receiving side

def reserve_here(node, request: pb.PeerReserveRequest) -> pb.PeerReserveResponse:
    """A peer's Reserve: reserved (ADMITTED), not now (QUEUED) or never (REJECTED)."""
    rt = node.runtime(request.pool)
    pool = rt.pool
    if (request.page_bytes, request.block_tokens) != (pool.page_bytes, pool.block_tokens):
        return pb.PeerReserveResponse(
            decision=pb.DECISION_REJECTED,
            reason=f"pool {pool.name!r} lays blocks out differently ({pool.page_bytes} bytes, "
                   f"{pool.block_tokens} tokens a page; the prefill pool: "
                   f"{request.page_bytes}, {request.block_tokens}): kvd hands off block "
                   "for block")
    try:
        node.may_use(pool.name, request.tenant)
    except PermissionDenied as exc:  # the peer's Admit could not tell
        return pb.PeerReserveResponse(decision=pb.DECISION_REJECTED, reason=str(exc))
    existing = pool.requests.get(request.request_id)
    if existing is not None:
        if existing.state is RequestState.RESERVED and existing.tenant == request.tenant:
            return pb.PeerReserveResponse(decision=pb.DECISION_ADMITTED)  # asked again
        return pb.PeerReserveResponse(decision=pb.DECISION_REJECTED,
                                      reason=f"request {request.request_id!r} already exists "
                                             f"in pool {pool.name!r}")
    projected = pool.admission.projected_pages(request.prompt_tokens, request.output_tokens)
    state, why = pool.admission.reservation_state(
        request.tenant, projected, request.prompt_tokens + request.output_tokens)
    if state is Verdict.NEVER:
        return pb.PeerReserveResponse(decision=pb.DECISION_REJECTED, reason=why)
    if state is not Verdict.OK:  # later
        return pb.PeerReserveResponse(decision=pb.DECISION_QUEUED, reason=why,
                                      capped=state is Verdict.CAPPED)
    pool.reservations.reserve(request.request_id, request.tenant,
                              prompt_tokens=request.prompt_tokens,
                              output_tokens=request.output_tokens, priority=request.priority,
                              ttl_s=node.config.handoff_ttl_s)
    log.info("reserved for a peer's handoff", pool=pool.name, request_id=request.request_id,
             tenant=request.tenant, pages=projected)
    return pb.PeerReserveResponse(decision=pb.DECISION_ADMITTED)


async def receive_here(node, request_iterator) -> int:
    """A peer's Receive: the request's pages into pages allocated here, live at the commit;
    anything short of it leaves nothing."""
    from kvd.service.register import Malformed

    messages = request_iterator.__aiter__()
    try:
        header = await messages.__anext__()
    except StopAsyncIteration:
        raise InvalidArgument("an empty Receive stream") from None
    if type(header) is Malformed:
        raise InvalidArgument(header.message)
    rid = header.request_id
    dst = node.runtime(header.pool)
    pool = dst.pool
    if header.page_bytes != pool.page_bytes:
        raise FailedPrecondition(f"pool {pool.name!r} has {pool.page_bytes}-byte pages, not "
                                 f"{header.page_bytes}")
    indices = list(header.block_indices)
    if len(set(indices)) != len(indices):
        raise InvalidArgument("block indices repeat")
    if header.indices_used > MAX_INDICES_USED:
        raise InvalidArgument(f"indices_used is at most {MAX_INDICES_USED}, got "
                              f"{header.indices_used}")
    shared = list(header.shared)
    _check_shared(shared, len(indices), pool.device.capacity + pool.host.capacity)
    num_sent = sum(1 for e in shared if e.sent)
    reservation = pool.requests.get(rid)
    if reservation is None:  # none made at admission, or it lapsed: now or never
        pool.reservations.reserve(rid, header.tenant, prompt_tokens=header.prompt_tokens,
                                  output_tokens=header.output_tokens,
                                  priority=header.priority, ttl_s=node.config.handoff_ttl_s)
    elif reservation.state is not RequestState.RESERVED:
        raise FailedPrecondition(f"request {rid!r} is being handed off already")
    pool.reservations.claim(rid)
    node.handoffs.receiving.add(rid)  # ListRequests: "arriving" until it is live here
    try:
        return await _receive(node, dst, rid, header, messages, indices, shared, num_sent)
    finally:
        node.handoffs.receiving.discard(rid)


async def _receive(node, dst, rid: str, header, messages, indices: list[int], shared: list,
                   num_sent: int) -> int:
    """receive_here, from the claim of the request's reservation on."""
    from kvd.service.register import Malformed

    pool = dst.pool
    this = asyncio.current_task()
    plan = None
    demoted = False
    started = time.perf_counter()
    try:
        if indices:
            plan = await dst.run(lambda: pool.allocate(rid, len(indices), indices=indices,
                                                       reason=Reason.HANDOFF))
            dst.transit.track(plan, this)
            if plan.demotions:
                await node.handoffs._copy_demotions(dst, plan)
            demoted = True
        pages = [b.page for b in plan.allocated] if plan is not None else []
        device = dst.arenas["device"]
        # The pages come in any order, each once: one sent twice while another never came
        # would leave that one with what a former owner wrote in it. The shared blocks'
        # come after the request's own, kept until they are stored here (past the commit).
        expected = len(pages) + num_sent
        shared_data: list[bytes] = [b""] * num_sent
        written = bytearray(expected)
        received = 0
        message = header
        while True:
            if type(message) is Malformed:
                raise InvalidArgument(message.message)
            if message.data:
                num = len(message.data) // pool.page_bytes
                if (len(message.data) % pool.page_bytes or message.first + num > expected):
                    raise InvalidArgument(
                        f"pages {message.first}..{message.first + num - 1} of a request of "
                        f"{expected}, {len(message.data)} bytes: out of range, or not "
                        "whole pages")
                for i in range(num):  # consecutive ordinals, not always consecutive pages
                    ordinal = message.first + i
                    if written[ordinal]:
                        raise InvalidArgument(f"page {ordinal} of the request came twice")
                    written[ordinal] = 1
                    page_data = message.data[i * pool.page_bytes:(i + 1) * pool.page_bytes]
                    if ordinal < len(pages):
                        write_pages(device, pages[ordinal], page_data)
                    else:
                        shared_data[ordinal - len(pages)] = page_data
                received += num
            if message.commit:
                break
            try:
                message = await messages.__anext__()
            except StopAsyncIteration:
                raise Aborted("the stream ended before its commit") from None
        if received != expected:
            raise InvalidArgument(f"committed with {received} of {expected} pages")
    except BaseException as exc:
        if plan is not None:
            node.handoffs.abort_target(dst, plan, demoted)
        pool.release(rid)
        dst.room_may_have_changed()
        node.handoffs.kick_queues(pool.name)
        node.handoffs.counts["received_rolled_back"] += 1
        log.info("a peer's handoff rolled back here", request_id=rid, pool=pool.name,
                 error=repr(exc))
        raise
    if plan is not None:
        pool.complete(plan)
        dst.transit.finish(plan)
    pool.requests[rid].keep_indices(header.indices_used)
    node.request_index[rid] = dst
    node.leases.arrived(rid, pool.requests[rid].tenant)  # the decode engine's, once it calls
    moved = len(indices) * pool.page_bytes
    node.handoffs.counts["received"] += 1
    node.handoffs.counts["bytes"] += moved
    pool.requests[rid].bytes_moved += moved
    dst.waiters.notify()
    prefix = await _take_shared(dst, rid, shared, shared_data) if shared else 0
    node.events.publish("handoff", pool=pool.name, tenant=pool.requests[rid].tenant,
                        request_id=rid, count=len(indices), reason="received from a peer")
    log.info("a peer's handoff received", request_id=rid, pool=pool.name,
             blocks=len(indices), prefix_blocks=prefix,
             seconds=round(time.perf_counter() - started, 3))
    return len(indices)


def _check_shared(shared: list, num_own: int, most: int) -> None:
    """Refuse a Receive whose shared blocks could not be stored here: more pages than the
    pool has, bad keys, or keys repeated within a namespace (see prefix.check_keys)."""
    if num_own + len(shared) > most:
        raise InvalidArgument(f"{num_own} blocks and {len(shared)} shared blocks: more than "
                              f"the pool's {most} pages")
    groups: dict[str, list[bytes]] = {}
    for e in shared:
        groups.setdefault(e.namespace, []).append(e.key)
    for namespace, keys in groups.items():
        prefix.check_keys(namespace, keys)


async def _take_shared(dst, rid: str, shared: list, data: list[bytes]) -> int:
    """The shared prefix blocks a request received from a peer uses, stored here under their
    names for it: pages for those this pool has no written bytes for, written with the
    peer's, and committed. A namespace's blocks are taken up to the first one neither sent
    nor held here (gone since the peer's lookup: a lookup finds no block past a gap).
    Best effort: without room for them, the request has its own blocks and its engine
    recomputes the prefix it does not find. Returns how many blocks it uses here."""
    pool = dst.pool
    named = pool.pages.named
    holder = f"{OWN_HOLDER}peer-receive:{rid}"
    arenas = {TierKind.DEVICE: dst.arenas["device"], TierKind.HOST: dst.arenas["host"]}
    pages = iter(data)
    groups: dict[str, list[tuple[bytes, bytes | None]]] = {}
    for e in shared:
        groups.setdefault(e.namespace, []).append((e.key, next(pages) if e.sent else None))
    taken = 0
    try:
        for namespace, group in groups.items():
            run = []
            for key, page in group:
                held = named.get((namespace, key))
                if page is None and (held is None or not held.committed):
                    break
                run.append((key, page))
            if not run:
                continue
            try:
                plan, placed = pool.store(rid, namespace, [k for k, _ in run], holder)
                if plan.num_copies:
                    await dst.execute(plan)
                else:
                    dst.complete_now(plan)
                todo = pool.prefixes.writes_of(
                    rid, [(d, page) for d, (_, page) in zip(placed, run) if page is not None], 0)
                for d, page in todo:
                    write_pages(arenas[d.tier], d.page, page)
                if todo:
                    pool.commit(rid, namespace, [d.name[1] for d, _ in todo])
            except (KvdError, BlocksInTransit) as exc:
                log.info("no room for a received request's prefix blocks: its engine "
                         "recomputes them", request_id=rid, pool=pool.name, error=str(exc))
                continue
            except Exception:  # a victim's copy failed (rolled back): the request is here
                log.exception("a received request's prefix blocks were not stored",
                              request_id=rid, pool=pool.name)
                continue
            taken += len(run)
    finally:
        pool.end_holds(holder)
        dst.room_may_have_changed()
    return taken
