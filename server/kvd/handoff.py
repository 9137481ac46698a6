"""Handoff between pools (DESIGN.md, "What kvd decides": prefill and decode): a request's
blocks are copied from its prefill pool to its decode pool under the pool->pool link's
budget, all or nothing, keeping the engine's block indices; reservations no handoff claimed
in time lapse; prefill requests queued for room in a decode pool go when it comes free.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
from collections.abc import AsyncIterator, Callable, Mapping

import structlog

from kvd.assembly import Links
from kvd.config import Config
from kvd.core.jobs import Job, TransferClass
from kvd.core.blocks import Block, Request, RequestState, TierKind
from kvd.core.clock import Clock
from kvd.core.errors import (BlocksInTransit, FailedPrecondition, InvalidArgument,
                             ResourceExhausted)
from kvd.core.holds import OWN_HOLDER
from kvd.core.pool import Pool
from kvd.core.transfer import Reason, TransferPlan
from kvd.events import EventBus, publish_admitted
from kvd.links import Transfer, TransferCancelled
from kvd.memory.copier import chunk_runs, copy_between, page_runs
from kvd.peers import BlockSender, Peers, chunk_messages, is_remote, read_chunk, split
from kvd.runtime import PoolRuntime, find_runtime
from kvd.waiters import give_back_turn
from kvd_api.v1 import kvd_pb2 as pb

log = structlog.get_logger("kvd.handoff")


def _kept_here(pool: Pool, b: Block) -> bool:
    """Whether a shared block a request uses is committed and still kept in the pool (under
    its name, in a tier)."""
    return b.committed and pool.pages.named.get(b.name) is b and b.tier is not TierKind.NONE


def _prefix_to_carry(pool: Pool, req: Request) -> dict[str, list[Block]]:
    """The shared prefix blocks a handoff takes along, by namespace: those the request uses
    that are committed and kept in its pool."""
    groups: dict[str, list[Block]] = {}
    for b in req.shared:
        if _kept_here(pool, b):
            groups.setdefault(b.name[0], []).append(b)
    return groups


async def _until_releasable(rt: PoolRuntime, request_id: str, still: list[Block]) -> None:
    """Until no block that goes with the request's release in this pool moves, bar `still`
    (those the handoff itself holds in transit, which it lets go just before): a block it
    stored and never committed that another call's copy moves (an operator's eviction, a
    victim's demotion), or, in the target after a failed carry ended its holds, one of its
    own blocks there chosen as a victim. The release, called with nothing awaited after
    this, is then not refused half-way through a commit or a rollback."""
    req = rt.pool.requests[request_id]
    ours = set(still)
    while busy := [b for b in (*req.live_blocks(), *rt.pool.prefixes.unused(req))
                   if b.moving and b not in ours]:
        await rt.transit.wait_for(busy)


def _peer_error(target: str, err: grpc.RpcError) -> Exception:
    """A peer's refusal or a cut stream, as kvd's own error (the request stays here)."""
    from kvd.core.errors import Aborted

    code, details = err.code(), err.details()
    text = f"handoff to {target!r}: the peer said {code.name}: {details}; rolled back"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(text)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return FailedPrecondition(text)
    return Aborted(text)


def _settle_handoff(task: asyncio.Task) -> None:
    """A handoff whose caller went away failed or rolled back with nobody to tell: it was
    logged and counted; mark its exception retrieved."""
    if not task.cancelled():
        task.exception()


class Handoffs:
    """A node's handoffs: those in flight, their counts, and the reservations they claim.
    `pools` and `request_index` are the node's (a completed handoff moves the request's
    entry to its new pool)."""

    def __init__(self, config: Config, clock: Clock, pools: Mapping[str, PoolRuntime],
                 request_index: dict[str, PoolRuntime], links: Links,
                 events: EventBus, peers: Peers | None, *, left: Callable[[str], None],
                 handed: Callable[[str], None]) -> None:
        self.config = config
        # Called with a request that left this node for a peer's (its lease lets go of it),
        # and with one handed to another of this node's pools (its decode engine's lease
        # takes it up, see LeaseTable.adopt).
        self.left = left
        self.handed = handed
        self.clock = clock
        self.pools = pools
        self.request_index = request_index
        self.links = links
        self.events = events
        self.peers = peers or Peers(config)
        self.in_flight: set[asyncio.Task] = set()
        # Requests with a Handoff under way, and its task: a second one is refused at once
        # (it used to start too, and claim a reservation the first had rolled back), and a
        # release waits for it to end (see settled).
        self._handing_off: dict[str, asyncio.Task] = {}
        # Requests whose pages a peer's handoff is writing here (see peers.receive_here).
        self.receiving: set[str] = set()
        self.counts: Counter = Counter()

    def under_way(self, request_id: str) -> bool:
        """Whether a handoff of the request is in flight."""
        return request_id in self._handing_off

    def refuse_while_under_way(self, request_id: str, what: str) -> None:
        """Refuse a call that adds pages to a request (`what`: the call, as the engine
        names it) while a handoff of it is under way: they would be in the pool the request
        is leaving, left behind (an allocation's blocks) or let go under the engine (a
        store's new pages, which the handoff's commit drops uncommitted)."""
        if request_id in self._handing_off:
            rt = self.request_index.get(request_id)
            req = rt.pool.requests.get(request_id) if rt is not None else None
            raise FailedPrecondition(
                f"request {request_id!r} is being handed off to pool "
                f"{req.handoff_pool if req is not None else ''!r}: {what} once the handoff "
                "is done, there")

    async def settled(self, request_id: str) -> None:
        """Until no handoff of the request is in flight (whether it went through or rolled
        back): a release waits for it, then acts wherever the request is. Waiting for its
        blocks in transit is not enough: a request with no block of its own (only the prefix
        it stored, which the handoff carries) has none, and a release that went first was
        undone by the handoff's commit, which made the request live in its target again."""
        while (task := self._handing_off.get(request_id)) is not None:
            give_back_turn()  # a handoff takes seconds: the tenant's other streams go on
            await asyncio.wait({task})

    def arriving(self, request_id: str, runtime: PoolRuntime) -> bool:
        """Whether the request's entry in this pool is a handoff's target while its pages
        are copied in: from another pool of this kvd (the request is still the source's),
        or from a peer's."""
        return (request_id in self.receiving
                or (request_id in self._handing_off
                    and self.request_index.get(request_id) is not runtime))

    def runtime(self, pool: str) -> PoolRuntime:
        return find_runtime(self.pools, pool)

    def check_pair(self, src: PoolRuntime, dst: PoolRuntime) -> None:
        if src is dst:
            raise InvalidArgument(f"a request cannot hand off to its own pool {src.pool.name!r}")
        a, b = src.pool, dst.pool
        if (a.page_bytes, a.block_tokens) != (b.page_bytes, b.block_tokens):
            raise FailedPrecondition(
                f"pools {a.name!r} and {b.name!r} lay blocks out differently "
                f"({a.page_bytes} vs {b.page_bytes} bytes, {a.block_tokens} vs "
                f"{b.block_tokens} tokens a page): kvd hands off block for block"
            )

    def drop_reservation(self, pool: str, request_id: str) -> bool:
        rt = self.pools.get(pool)
        req = rt.pool.requests.get(request_id) if rt else None
        if req is None or req.state is not RequestState.RESERVED:
            return False
        rt.pool.release(request_id)
        self.kick_queues(pool)
        return True

    def kick_queues(self, target: str) -> None:
        """Pages came free in `target`: prefill requests queued for a reservation there may
        go now."""
        for rt in self.pools.values():
            pool = rt.pool
            if pool.admission.handoff_waiting[target]:
                admitted = pool.admit_waiting()
                publish_admitted(self.events, pool.name, admitted)
                if admitted:
                    rt.waiters.notify()

    def expire_reservations(self) -> int:
        """Release decode reservations no handoff claimed in time (their prefill requests
        stay; a later Handoff says the reservation lapsed)."""
        expired = 0
        for rt in list(self.pools.values()):
            for request_id in rt.pool.reservations.expired():
                tenant = rt.pool.requests[request_id].tenant
                rt.pool.release(request_id)
                expired += 1
                self.counts["reservations_expired"] += 1
                log.warning("handoff reservation expired", pool=rt.pool.name,
                            request_id=request_id, tenant=tenant)
                self.events.publish("handoff", pool=rt.pool.name, tenant=tenant,
                                    request_id=request_id, reason="reservation expired")
            if expired:
                self.kick_queues(rt.pool.name)
        return expired

    async def handoff(self, src: PoolRuntime, request_id: str, target: str = "",
                      holder: str = "", own: Callable[[str], bool] | None = None
                      ) -> AsyncIterator[dict]:
        """Copy a request's blocks to its handoff pool under the pool->pool link's budget,
        yielding progress; all or nothing. The work runs in a task of its own, so a caller
        that goes away cancels it between chunks and it rolls back cleanly. The blocks the
        last message hands out are held for `holder` until its next call.

        Another client's engine that holds the request's blocks (it was handed them, and its
        forward pass may still write them) is waited for first, until its next call or until
        its holds lapse (see _after_writers); `own`: the caller's holders, not waited for
        (an engine hands its request off once it is done with it)."""
        req, dst = self._target(src, request_id, target)
        progress: asyncio.Queue = asyncio.Queue()
        cancel = asyncio.Event()
        async def run() -> None:
            await self._after_writers(src, req, own or (lambda h: h == holder), cancel, dst)
            if dst is not None:
                await self._handoff(src, dst, req, progress, cancel, holder)
            else:
                await self._remote_handoff(src, req, progress, cancel)

        task = asyncio.ensure_future(run())
        self._handing_off[request_id] = task
        task.add_done_callback(lambda _: self._handing_off.pop(request_id, None))
        self.in_flight.add(task)
        task.add_done_callback(_settle_handoff)
        task.add_done_callback(self.in_flight.discard)
        try:
            while True:
                getter = asyncio.ensure_future(progress.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    item = getter.result()
                    yield item
                    if item["done"]:
                        return
                    continue
                getter.cancel()
                task.result()  # raises what failed the handoff
                while not progress.empty():
                    item = progress.get_nowait()
                    yield item
                return
        finally:
            if not task.done():
                cancel.set()  # the caller went away: roll back between chunks
                self.counts["cancelled"] += 1

    async def _after_writers(self, src: PoolRuntime, req: Request, own: Callable[[str], bool],
                             cancel: asyncio.Event, dst: PoolRuntime | None) -> None:
        """Until every other client's holder that holds a device block of the request has
        called again, or its holds lapsed (hold_s), before the copy begins: what its
        engine wrote into the pages it was handed is in them by then (a router's Handoff
        copied at once would give the decode pool what they held half-way through the
        engine's forward pass). A caller that goes away meanwhile gives the reservation
        back, as a rollback does."""
        holds = src.pool.pages.holds
        waiting = {h: e for h, e in holds.writers(req).items() if not own(h)}
        if waiting:
            await self._writers_called(src, req, waiting, cancel)
        if cancel.is_set():  # the caller went away before anything began
            if dst is not None:
                self.drop_reservation(dst.pool.name, req.request_id)
            self.counts["rolled_back"] += 1
            self.events.publish("handoff", pool=src.pool.name, tenant=req.tenant,
                                request_id=req.request_id,
                                reason="rolled back: its caller went away before it began")
            raise TransferCancelled()

    async def _writers_called(self, src: PoolRuntime, req: Request, waiting: dict,
                              cancel: asyncio.Event) -> None:
        """Until each of `waiting` (Holds.writers) called again, or the caller went away."""
        holds = src.pool.pages.holds
        done = asyncio.get_running_loop().create_future()

        def check() -> None:
            if not done.done() and all(holds.called_again(h, e) for h, e in waiting.items()):
                done.set_result(None)

        log.info("handoff waits for the engines that hold the request's blocks",
                 request_id=req.request_id, pool=src.pool.name, holders=len(waiting))
        self.events.publish("handoff", pool=src.pool.name, tenant=req.tenant,
                            request_id=req.request_id, count=len(waiting),
                            reason="waiting for the next call of the engines holding it")
        holds.watchers.append(check)
        canceller = asyncio.ensure_future(cancel.wait())
        try:
            await asyncio.wait({done, canceller}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            holds.watchers.remove(check)
            canceller.cancel()
            done.cancel()

    def _target(self, src: PoolRuntime, request_id: str, target: str
                ) -> tuple[Request, PoolRuntime]:
        """The request and the pool it goes to, its reservation there made if it had none
        (or lapsed); refused, leaving nothing, when it cannot be."""
        req = src.pool.get_admitted(request_id)
        target = target or req.handoff_pool
        if not target:
            raise FailedPrecondition(
                f"request {request_id!r} was admitted without a handoff pool; name target_pool")
        if req.handoff_pool and target != req.handoff_pool:
            raise InvalidArgument(f"request {request_id!r} reserved pages in pool "
                                  f"{req.handoff_pool!r}, not {target!r}")
        if is_remote(target):  # the peer reserves now if it had not (or it lapsed)
            if request_id in self._handing_off:
                raise FailedPrecondition(f"request {request_id!r} is being handed off already")
            self.peers.link(split(target)[0])
            req.handoff_pool = target
            return req, None
        dst = self.runtime(target)
        self.check_pair(src, dst)
        reservation = dst.pool.requests.get(request_id)
        # Checked before anything is reserved: a refused second call must leave nothing.
        if ((reservation is not None and reservation.state is not RequestState.RESERVED)
                or request_id in self._handing_off):
            raise FailedPrecondition(f"request {request_id!r} is being handed off already")
        if reservation is None:
            # None made at admission (or it lapsed, or a handoff was rolled back): the
            # target decides only now, and a refusal means the prefill was spent for nothing.
            try:
                dst.pool.reservations.reserve(
                    request_id, req.tenant, prompt_tokens=req.prompt_tokens,
                    output_tokens=req.output_tokens, priority=req.priority,
                    ttl_s=self.config.handoff_ttl_s)
            except ResourceExhausted as exc:
                self.counts["refused"] += 1
                had = ("its reservation lapsed or a handoff was rolled back"
                       if req.handoff_pool else "it was admitted without a reservation")
                raise ResourceExhausted(f"{exc}; {had}") from None
            req.handoff_pool = target
        return req, dst

    async def _handoff(self, src: PoolRuntime, dst: PoolRuntime, req: Request,
                       progress: asyncio.Queue, cancel: asyncio.Event, holder: str) -> None:
        request_id = req.request_id
        blocks = await src.run(lambda: src.pool.reservations.begin_handoff(request_id),
                               undo=src.pool.reservations.end_handoff)
        this = asyncio.current_task()
        src.transit.hold_for(blocks, this)  # whoever needs these blocks waits for the handoff
        try:
            dst.pool.reservations.claim(request_id)  # gone if it lapsed meanwhile
        except BaseException:
            src.transit.finish_blocks(blocks)
            src.pool.reservations.end_handoff(blocks)
            src.room_may_have_changed()
            raise
        plan = None
        demoted = False
        try:
            if blocks:
                indices = [b.index for b in blocks]  # the engine's indices stay
                plan = await dst.run(lambda: dst.pool.allocate(
                    request_id, len(blocks), indices=indices, reason=Reason.HANDOFF))
                dst.transit.track(plan, this)
                if plan.demotions:  # room in the decode pool first, over its own link
                    await self._copy_demotions(dst, plan)
                demoted = True
                await self._copy_handoff(src, dst, blocks, plan, progress, cancel)
            if cancel.is_set():
                raise TransferCancelled()
            if plan is not None:  # its blocks are the request's in the target from now on
                dst.pool.complete(plan)
                dst.transit.finish(plan)
                plan = None
            await self._carry_shared(src, dst, req, cancel)
        except BaseException as exc:
            await self._roll_back(src, dst, req, blocks, plan, demoted, exc)
            raise
        await self._commit(src, dst, req, blocks, progress, holder)

    async def _roll_back(self, src: PoolRuntime, dst: PoolRuntime, req: Request,
                         blocks: list[Block], plan: TransferPlan | None, demoted: bool,
                         exc: BaseException) -> None:
        """All or nothing: the request stays whole in the prefill pool; the target pages and
        the reservation go (`plan`: the target's allocation, None once it completed: its
        blocks then go with the target's request)."""
        if plan is not None:
            self.abort_target(dst, plan, demoted)
        # Cancelled (kvd stopping and done waiting for it): nothing more is waited for.
        await self._end_handoff(src, dst, req.request_id, blocks, release=dst,
                                wait=not isinstance(exc, asyncio.CancelledError))
        self.counts["failed" if not isinstance(exc, TransferCancelled)
                    else "rolled_back"] += 1
        log.info("handoff rolled back", request_id=req.request_id, source=src.pool.name,
                 target=dst.pool.name, error=repr(exc))
        self.events.publish("handoff", pool=src.pool.name, tenant=req.tenant,
                            request_id=req.request_id, reason=f"rolled back: {exc!r}")

    @staticmethod
    def abort_target(dst: PoolRuntime, plan: TransferPlan, demoted: bool) -> None:
        """Undo a handoff's allocation in its target pool."""
        if demoted:  # victims' bytes are on host now: finish those moves only
            dst.pool.complete(TransferPlan(dst.pool.name, Reason.HANDOFF, plan.cause,
                                           demotions=plan.demotions))
            dst.pool.abort(TransferPlan(dst.pool.name, Reason.HANDOFF, plan.cause,
                                        allocated=plan.allocated))
        else:
            dst.pool.abort(plan)
        dst.transit.finish(plan)

    async def _commit(self, src: PoolRuntime, dst: PoolRuntime, req: Request,
                      blocks: list[Block], progress: asyncio.Queue, holder: str) -> None:
        """The blocks live in the target now; the prefill pages go."""
        request_id = req.request_id
        dst_req = dst.pool.requests[request_id]
        dst_req.keep_indices(len(req.blocks))
        await self._end_handoff(src, dst, request_id, blocks, release=src)
        self.request_index[request_id] = dst
        self.handed(request_id)
        moved = len(blocks) * src.pool.page_bytes
        self.counts["completed"] += 1
        self.counts["bytes"] += moved
        dst_req.bytes_moved += moved
        if holder:  # the engine reads what the last message hands it: nothing may move it
            dst.pool.pages.holds.hold(holder, dst_req.live_blocks())
        src.waiters.notify()
        self.events.publish("handoff", pool=dst.pool.name, tenant=req.tenant,
                            request_id=request_id, count=len(blocks), reason="completed")
        progress.put_nowait(self._progress(dst_req, len(blocks), len(blocks),
                                           src.pool.page_bytes, finished=True))

    async def _end_handoff(self, src: PoolRuntime, dst: PoolRuntime, request_id: str,
                           blocks: list[Block], release: PoolRuntime, wait: bool = True
                           ) -> None:
        """The source blocks are free to move again; the request goes from `release` (the
        target on a rollback, the source on commit), once nothing that goes with it moves
        (`wait`); waiters for room in either may go."""
        if wait:
            await _until_releasable(release, request_id, blocks if release is src else [])
        src.transit.finish_blocks(blocks)
        src.pool.reservations.end_handoff(blocks)
        try:
            _, admitted = release.pool.release(request_id)
        except BlocksInTransit:
            admitted = []
            log.error("a cancelled handoff's rollback left the request in its target pool",
                      request_id=request_id, pool=release.pool.name)
        publish_admitted(self.events, release.pool.name, admitted)
        src.room_may_have_changed()
        dst.room_may_have_changed()
        self.kick_queues(dst.pool.name)

    @staticmethod
    def _progress(req: Request, done: int, total: int, page_bytes: int,
                  finished: bool = False) -> dict:
        return {"request_id": req.request_id, "pool": req.pool, "blocks_done": done,
                "blocks_total": total, "bytes_done": done * page_bytes,
                "bytes_total": total * page_bytes, "done": finished,
                "blocks": req.live_blocks() if finished else None}

    async def _remote_handoff(self, src: PoolRuntime, req: Request, progress: asyncio.Queue,
                              cancel: asyncio.Event) -> None:
        """The request's pages to a peer kvd's pool (kvd.peers), under the link to it; the
        request leaves this node once the peer committed them, and stays whole if not."""
        request_id = req.request_id
        target = req.handoff_pool
        blocks = await src.run(lambda: src.pool.reservations.begin_handoff(request_id),
                               undo=src.pool.reservations.end_handoff)
        this = asyncio.current_task()
        src.transit.hold_for(blocks, this)
        page_bytes = src.pool.page_bytes
        total = len(blocks)
        # The shared prefix blocks go along, held here (not evicted) while they are read.
        shared_holder = f"{OWN_HOLDER}peer-handoff:{request_id}"
        try:
            link = self.links.handoff_link(src.pool.name, target)
            arenas = {TierKind.DEVICE: src.arenas["device"], TierKind.HOST: src.arenas["host"]}
            chunk_pages = max(1, int(link.sched.quantum) // page_bytes)
            listed, sent = await self._shared_for_peer(src, req, target)
            src.pool.pages.holds.hold(shared_holder, sent)
            chunks = chunk_messages(blocks + sent, arenas, chunk_pages)
            header = pb.PeerBlocks(
                request_id=request_id, pool=split(target)[1],
                block_indices=[b.index for b in blocks], indices_used=len(req.blocks),
                page_bytes=page_bytes,
                tenant=req.tenant, prompt_tokens=req.prompt_tokens,
                output_tokens=req.output_tokens, priority=req.priority, shared=listed)

            transfers = []

            def submit(put):
                def copy(runs):
                    for message in read_chunk(runs, arenas):
                        put(message)

                def on_chunk(j: Job):
                    done = min(total, j.bytes_done // page_bytes)  # its own blocks first
                    progress.put_nowait(self._progress(req, done, total, page_bytes))

                transfer = Transfer(self._handoff_job(req, chunks, page_bytes), chunks,
                                    copy, asyncio.get_running_loop().create_future(),
                                    on_chunk=on_chunk)
                transfers.append(transfer)
                if chunks:
                    link.submit(transfer)
                else:
                    transfer.future.set_result(None)
                self._cancel_on(cancel, link, transfer)
                return transfer.future

            def stop():
                for transfer in transfers:
                    if not transfer.future.done():
                        link.cancel(transfer)

            await BlockSender(self.peers.link(split(target)[0])).send(header, submit, stop)
            if cancel.is_set():
                raise TransferCancelled()
        except BaseException as exc:
            src.pool.end_holds(shared_holder)
            src.transit.finish_blocks(blocks)
            src.pool.reservations.end_handoff(blocks)
            src.room_may_have_changed()
            self.counts["failed" if not isinstance(exc, (TransferCancelled,
                                                         asyncio.CancelledError))
                        else "rolled_back"] += 1
            log.info("handoff to a peer rolled back", request_id=request_id, target=target,
                     error=repr(exc))
            self.events.publish("handoff", pool=src.pool.name, tenant=req.tenant,
                                request_id=request_id, reason=f"rolled back: {exc!r}")
            if isinstance(exc, grpc.RpcError):
                raise _peer_error(target, exc) from None
            raise
        # The peer has it now: the release here waits for what another call moves.
        await _until_releasable(src, request_id, blocks)
        src.pool.end_holds(shared_holder)
        src.transit.finish_blocks(blocks)
        src.pool.reservations.end_handoff(blocks)
        self.peers.verdicts.pop(request_id, None)
        req.handoff_pool = ""  # handed off: nothing to give back at its release here
        src.pool.release(request_id)
        self.request_index.pop(request_id, None)
        self.left(request_id)  # its lease ending later must not release the id's next user
        src.room_may_have_changed()
        src.waiters.notify()
        moved = total * page_bytes
        self.counts["completed"] += 1
        self.counts["bytes"] += moved
        self.events.publish("handoff", pool=target, tenant=req.tenant, request_id=request_id,
                            count=total, reason="completed")
        done = self._progress(req, total, total, page_bytes, finished=True)
        done.update(pool=target, blocks=[])
        progress.put_nowait(done)

    async def _shared_for_peer(self, src: PoolRuntime, req: Request, target: str
                               ) -> tuple[list[pb.PeerSharedBlock], list[Block]]:
        """The shared prefix blocks a request handed off to a peer takes along: each block
        it uses that is committed and here, listed (PeerBlocks.shared), and those to send:
        all but the leading run of each namespace's that the peer's Lookup says it holds (a
        peer that cannot say is sent them all). The peer takes a listed block it was not
        sent only while it still holds it."""
        def here(b: Block) -> bool:  # read now: still, and still here
            return not b.moving and _kept_here(src.pool, b)

        groups = {namespace: still
                  for namespace, group in _prefix_to_carry(src.pool, req).items()
                  if (still := [b for b in group if not b.moving])}
        peer, pool = split(target)
        link = self.peers.link(peer)
        listed: list[tuple[pb.PeerSharedBlock, Block]] = []
        for namespace, group in groups.items():
            try:
                held = (await link.memory.Lookup(
                    pb.LookupRequest(pool=pool, namespace=namespace,
                                     keys=[b.name[1] for b in group]),
                    metadata=link.metadata, timeout=link.config.timeout_s)).num_hit
            except grpc.RpcError as err:
                log.info("a peer's lookup failed: the whole prefix goes", target=target,
                         error=err.code().name)
                held = 0
            listed += [(pb.PeerSharedBlock(namespace=namespace, key=b.name[1], sent=i >= held),
                        b) for i, b in enumerate(group)]
        # The lookups were awaited: a block moved or let go meanwhile is not read (the peer
        # takes its namespace's blocks up to it).
        listed = [(e, b) for e, b in listed if not e.sent or here(b)]
        return [e for e, _ in listed], [b for e, b in listed if e.sent]

    @staticmethod
    def _cancel_on(cancel: asyncio.Event, link, transfer) -> None:
        async def watch():
            await cancel.wait()
            if not transfer.future.done():
                link.cancel(transfer)

        watcher = asyncio.ensure_future(watch())
        transfer.future.add_done_callback(lambda _: watcher.cancel())

    def _handoff_job(self, req: Request, chunks: list[list[tuple]], page_bytes: int) -> Job:
        """A handoff's copies wait on the link as an access does, under the request's cap."""
        return Job(TransferClass.ACCESS, req.tenant, req.request_id,
                   [sum(run[4] for run in chunk) * page_bytes for chunk in chunks],
                   self.clock.now(),
                   caps=(req.transfer_cap,) if req.transfer_cap is not None else ())

    async def _copy_demotions(self, dst: PoolRuntime, plan: TransferPlan) -> None:
        runs = page_runs((m.src_tier, m.src_page, m.dst_tier, m.dst_page)
                         for m in plan.demotions if m.copies_bytes)
        if not runs:
            return
        chunks = chunk_runs(runs, dst.chunk_pages)
        job = self._handoff_job(plan.cause, chunks, dst.pool.page_bytes)
        transfer = Transfer(job, chunks, dst.copier.copy_runs,
                            asyncio.get_running_loop().create_future())
        dst.link.submit(transfer)
        await transfer.future

    async def _copy_handoff(self, src: PoolRuntime, dst: PoolRuntime, blocks: list[Block],
                            plan: TransferPlan, progress: asyncio.Queue,
                            cancel: asyncio.Event) -> None:
        pairs = [(block.tier, block.page, TierKind.DEVICE, new.page)
                 for block, new in zip(blocks, plan.allocated)]
        if not pairs:
            return
        page_bytes = src.pool.page_bytes
        total = len(blocks)
        dst_req = dst.pool.requests[blocks[0].request.request_id]

        def on_chunk(j: Job):
            pages = j.bytes_done // page_bytes
            progress.put_nowait(self._progress(dst_req, pages, total, page_bytes))

        await self._copy_pairs(src, dst, blocks[0].request, pairs, cancel, on_chunk)

    async def _carry_shared(self, src: PoolRuntime, dst: PoolRuntime, req: Request,
                            cancel: asyncio.Event) -> None:
        """The shared prefix blocks the request uses (committed: written), stored under
        their names in the target pool too, for the request there: those the target lacks
        are copied over the link and committed, so the decode engine loads its whole
        prefix from its own pool. They stay in the source, where others may use them:
        held there (not evicted) while they are read, not made still as the request's own
        blocks are (a prefix every request shares would be in transit at every handoff)."""
        groups = _prefix_to_carry(src.pool, req)
        if not groups:
            return
        holder = f"{OWN_HOLDER}handoff:{req.request_id}"  # ends with the carry, never lapses
        # The request's own blocks stay where the copy put them: the engine is handed them.
        dst.pool.pages.holds.hold(holder, dst.pool.requests[req.request_id].live_blocks())
        try:
            for namespace, group in groups.items():
                if cancel.is_set():
                    raise TransferCancelled()
                keys = [b.name[1] for b in group]
                while True:  # waits for copies under way, never in line for room
                    try:
                        plan, placed = dst.pool.store(req.request_id, namespace, keys, holder)
                        break
                    except BlocksInTransit as exc:
                        if not exc.blocks:
                            raise ResourceExhausted(
                                f"pool {dst.pool.name!r} has no device room now for the "
                                f"{len(keys)} shared prefix block(s) request "
                                f"{req.request_id!r} uses (pinned, held or in transit)"
                            ) from None
                        await dst.transit.wait_for(exc.blocks)
                if plan.num_copies:
                    await dst.execute(plan)
                else:
                    dst.complete_now(plan)
                # New pages, and blocks another request stored there and has not committed
                # (written, if at all, with the same bytes: a name is its tokens' hash).
                todo = [(s, d) for s, d in zip(group, placed) if not d.committed]
                # Both ends settled before the copy, and held (not evicted) during it; a
                # source block let go meanwhile is not copied (nor its name committed).
                while True:
                    busy_src = [s for s, _ in todo if s.moving]
                    busy_dst = [d for _, d in todo if d.moving]
                    if not busy_src and not busy_dst:
                        break
                    await src.transit.wait_for(busy_src)
                    await dst.transit.wait_for(busy_dst)
                # The handoff writes them (and so may commit them: see Prefixes.commit).
                todo = dst.pool.prefixes.writes_of(
                    req.request_id, [(s, d) for s, d in todo if _kept_here(src.pool, s)], 1)
                src.pool.pages.holds.hold(holder, [s for s, _ in todo])
                dst.pool.pages.holds.hold(holder, [d for _, d in todo])
                pairs = [(s.tier, s.page, d.tier, d.page) for s, d in todo]
                if pairs:
                    await self._copy_pairs(src, dst, req, pairs, cancel)
                if cancel.is_set():
                    raise TransferCancelled()
                if todo:
                    dst.pool.commit(req.request_id, namespace, [d.name[1] for _, d in todo])
        finally:
            for rt in (src, dst):
                rt.pool.end_holds(holder)
                rt.room_may_have_changed()

    async def _copy_pairs(self, src: PoolRuntime, dst: PoolRuntime, req: Request,
                          pairs: list[tuple], cancel: asyncio.Event, on_chunk=None) -> None:
        """Copy pages of the source pool to the target's ((tier, page, target tier, target
        page) each) over the pool->pool link, under its budget; cancel stops it between
        chunks."""
        link = self.links.handoff_link(src.pool.name, dst.pool.name)
        src_arenas = {TierKind.DEVICE: src.arenas["device"], TierKind.HOST: src.arenas["host"]}
        dst_arenas = {TierKind.DEVICE: dst.arenas["device"], TierKind.HOST: dst.arenas["host"]}
        chunk_pages = max(1, int(link.sched.quantum) // src.pool.page_bytes)
        chunks = chunk_runs(page_runs(pairs), chunk_pages)
        job = self._handoff_job(req, chunks, src.pool.page_bytes)

        def copy(runs):
            for src_tier, src_page, dst_tier, dst_page, num in runs:
                copy_between(src_arenas[src_tier], src_page, dst_arenas[dst_tier], dst_page,
                             num)

        transfer = Transfer(job, chunks, copy, asyncio.get_running_loop().create_future(),
                            on_chunk=on_chunk)
        link.submit(transfer)
        canceller = asyncio.ensure_future(cancel.wait())
        try:
            await asyncio.wait({transfer.future, canceller},
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            canceller.cancel()
        if not transfer.future.done():
            link.cancel(transfer)
        await transfer.future

