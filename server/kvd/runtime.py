"""Runs a pool's decisions: executes transfer plans off the event loop, waits for blocks in
transit, and measures stalls. The core decides; this module makes the bytes follow."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import structlog

from kvd.core.jobs import Job, TransferClass
from kvd.core.blocks import Block, Request, TierKind
from kvd.core.errors import BlocksInTransit, NotFound, NoVictims, untraced
from kvd.core.pool import AccessResult, Pool
from kvd.core.transfer import MoveKind, Reason, TransferPlan
from kvd.links import Link, Transfer
from kvd.memory.copier import PageCopier, chunk_runs, plan_runs
from kvd.transit import InTransit
from kvd.core.holds import SWAP_HOLDER
from kvd.waiters import RETRY, AdmissionWaiters, RoomLine, give_back_turn

T = TypeVar("T")
log = structlog.get_logger("kvd.runtime")


# How long a step's reads may wait to be recorded. Off the reply's path, and the steps that
# come meanwhile (an engine reads the same batch every step) are recorded together, at the
# cost of one (a node's engines read hundreds of requests in between, recorded a slice at a
# time: see Pool.record_some_reads). Nothing sees them late: every other pool operation,
# stats and metrics included, records them first, whenever it comes.
RECORD_READS_AFTER_S = 0.2
# While engines' Step messages are being served, the recording waits for them (looking again
# this often), for at most RECORD_WAIT_S in all: engines stepping at the same instants (in
# lock-step, or at periods that divide RECORD_READS_AFTER_S, as 50 steps a second does)
# would otherwise have the slices of their earlier steps recorded between their steps, and
# the last step of each burst would wait for all of them.
RECORD_RETRY_S = 0.001
RECORD_WAIT_S = 0.05


def record_later(fn: Callable[[], bool], busy: Callable[[], bool] | None = None) -> None:
    """fn on the event loop RECORD_READS_AFTER_S from now, and again on the loop's next turn
    while it says more is left (what came meanwhile is served in between); without a
    running loop, at once until it is done. `busy`: whether Step messages are being served,
    which it waits for (see RECORD_WAIT_S)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        while fn():
            pass
        return
    until = None  # when it stops waiting for the steps

    def go() -> None:
        nonlocal until
        if busy is not None and busy():
            now = loop.time()
            until = now + RECORD_WAIT_S if until is None else until
            if now < until:
                loop.call_later(RECORD_RETRY_S, go)
                return
        if fn():
            loop.call_soon(go)

    loop.call_later(RECORD_READS_AFTER_S, go)


class PoolRuntime:
    """One pool, its arenas, and the transfers in flight."""

    def __init__(self, pool: Pool, arenas: dict, copier: PageCopier, link: Link,
                 chunk_bytes: int = 256 * 1024,
                 on_plan_done: Callable[[TransferPlan, float], None] | None = None) -> None:
        self.pool = pool
        self.arenas = arenas
        self.copier = copier
        # Every copy between this pool's tiers goes through its device<->host link.
        self.link = link
        self.chunk_pages = max(1, chunk_bytes // pool.page_bytes)
        self.transit = InTransit(pool.name)
        self.waiters = AdmissionWaiters(pool.admission.queue_positions,
                                        lambda: pool.admission.positions_version)
        self.room_line = RoomLine()
        self._swapping = asyncio.Lock()  # the read swapping in rounds (see access)
        self._refill: asyncio.Future | None = None  # the last refill started
        self._closing = False  # no refill starts (stop_refills)
        # Told of every plan done, with its stall (the node's events and stall metric).
        self.on_plan_done = on_plan_done

    async def begin_access(self, request_id: str, indices, holder: str = "",
                           wait: bool = True) -> StartedAccess:
        """An access with its copies started (unary Access and a Step's reads both come
        here): done when the blocks were resident or the idle link copied them at once,
        else `copying` runs on while the caller starts other work (StartedAccess.wait).
        `wait=False`: NoVictims where it would wait for room (a read in slices holding what
        it read, see sliced); blocks in transit are waited for."""
        result = await self.access(request_id, indices, holder, wait)
        if result.plan is None:
            return StartedAccess(self, result, None, 0.0)
        run = self.start(result.plan)
        if callable(run):
            # A task, not a coroutine: a later access may wait on these blocks.
            return StartedAccess(self, result, asyncio.ensure_future(run()), 0.0)
        if run:
            self.pool.record_stall(run, result.plan)
        return StartedAccess(self, result, None, run)

    async def access(self, request_id: str, indices, holder: str = "",
                     wait: bool = True) -> AccessResult:
        """pool.access, waiting out transfers; an access that waited for its own blocks'
        promotion (started by a prefetch that came too late) counts those as misses. A swap
        the host tier cannot take at once goes in rounds (see _swap_in_rounds); the last
        round's plan is returned for the caller to execute. `wait`: see begin_access."""
        result = await self._access(request_id, indices, holder, wait=wait)
        if result.partial:
            result = await self._swap_in_rounds(request_id, indices, holder, result)
        return result

    async def _swap_in_rounds(self, request_id: str, indices, holder: str,
                              result: AccessResult) -> AccessResult:
        """Each round brings in what the host tier can take out now; their stall is recorded
        here. One read at a time goes in rounds: the blocks its rounds brought in are held
        for it until it is done, and it goes first in the room line. Reads that took turns
        each evicted what the others' last rounds had brought in, and none of them ended.
        The first round, planned before its turn, is copied before it waits for it (blocks
        whose plan never starts would stay in transit for everyone waiting on them)."""
        await self._round(result.plan)
        pages = self.pool.pages
        if self._swapping.locked():
            give_back_turn()  # as one waiting for room does (see RoomLine)
        async with self._swapping:
            pages.swapping = self.pool.requests.get(request_id)
            try:
                while True:
                    result = await self._access(request_id, indices, holder, swapping=True)
                    if not result.partial:
                        return result
                    await self._round(result.plan)
            finally:
                pages.swapping = None
                if pages.holds.end(SWAP_HOLDER):
                    self.room_may_have_changed()

    async def _round(self, plan: TransferPlan) -> None:
        self.pool.record_stall(await self.execute(plan), plan)

    def _held_for_rounds(self, result: AccessResult) -> AccessResult:
        """A round's answer: the read's blocks in the device tier (at its first round; they
        stay there, held), and those it brings in, held for the rounds to come (in the same
        call as the plan: a transfer completing meanwhile lets others choose victims)."""
        if result.partial:
            holds = self.pool.pages.holds
            if not holds.has(SWAP_HOLDER):
                holds.hold(SWAP_HOLDER, result.blocks)
            for m in result.plan.promotions:
                holds.hold_one(SWAP_HOLDER, m.block)
        return result

    async def _access(self, request_id: str, indices, holder: str,
                      swapping: bool = False, wait: bool = True) -> AccessResult:
        """`swapping`: the read in rounds (see _swap_in_rounds), which never yields. `wait`:
        see begin_access."""
        def op():
            result = self.pool.access(request_id, indices, holder)
            return self._held_for_rounds(result) if swapping else result

        busy: BlocksInTransit | None
        if not swapping and self.yields(holder):
            busy = NoVictims()  # behind the line, which goes first
        else:
            try:
                return op()
            except BlocksInTransit as exc:
                busy = untraced(exc)
        late = [b for b in busy.blocks if b.tier is not TierKind.DEVICE]
        if not wait:
            # Blocks in transit are waited for (their copies end whatever anyone holds);
            # room is not (it may be what the caller's own call holds, see begin_access).
            while busy.blocks:
                await self.transit.wait_for(busy.blocks)
                try:
                    result = op()
                except BlocksInTransit as exc:
                    busy = untraced(exc)
                    late += [b for b in busy.blocks if b.tier is not TierKind.DEVICE]
                    continue
                self.pool.note_late(late)
                return result
            try:
                raise busy
            finally:
                busy = None  # not kept by this frame, which its traceback holds
        critical = self._critical(request_id, indices)
        if busy.blocks:
            await self.transit.wait_for(busy.blocks)
            busy = None
        result = await self.run(op, critical, busy, first=swapping)
        self.pool.note_late(late)
        return result

    def _critical(self, request_id: str, indices) -> bool:
        req = self.pool.requests.get(request_id)
        if req is None:
            return False
        if indices is None:
            return any(b.decode_critical for b in req.live)
        return any(0 <= i < len(req.blocks) and req.blocks[i] is not None
                   and req.blocks[i].decode_critical for i in indices)

    def line_stalled(self) -> bool:
        """Whether operations that take device pages go behind the room line (see
        RoomLine.stalled); cheap while nothing waits."""
        return bool(self.room_line) and self.room_line.stalled()

    def yields(self, holder: str | None) -> bool:
        """Whether an operation that takes device pages for `holder` joins the stalled room
        line rather than try first (see RoomLine). A holder that holds pages already goes
        on: its holds end only with its next call, which the line may be waiting for (a
        Step message's later items); its next call then yields."""
        return (holder is not None and self.line_stalled()
                and not self.pool.pages.holds.has(holder))

    async def run(self, op: Callable[[], T], critical: bool = False,
                  busy: BlocksInTransit | None = None,
                  undo: Callable[[T], None] | None = None, holder: str | None = None,
                  first: bool = False, wait: bool = True) -> T:
        """Call a pool operation, waiting out blocks in transit and calling again. One that
        finds no device room while pages are in transit or held waits in line for room
        (decode-critical first under fair link scheduling, else in arrival order) and is
        called again, in that order, the moment a transfer completes or a hold ends: a
        stream of others cannot take the room from under it. `holder`: the operation
        takes device pages for it, and joins a stalled line rather than try first.
        `first`: ahead of everyone in the line (the read swapping in rounds). `wait=False`:
        the BlocksInTransit (NoVictims for the line) is raised rather than waited out (a
        big allocation's later slice, see sliced)."""
        if busy is None:
            if self.yields(holder):
                busy = NoVictims()
            else:
                try:  # the common case: nothing in the way, no suspension
                    return op()
                except BlocksInTransit as exc:
                    busy = untraced(exc)
            if not wait:
                try:
                    raise busy
                finally:
                    busy = None  # not kept by this frame, which its traceback holds
        while True:
            if busy.blocks:
                await self.transit.wait_for(busy.blocks)
            else:
                rank = (-1 if first else 0 if critical and self.link.sched.serves_by_class
                        else 1)
                future = self.room_line.join(op, rank)
                if not self.pool.pages.num_moving_blocks():
                    self.room_line.serve()  # the transfer it waited for is done already
                if not future.done():
                    give_back_turn()
                try:
                    result = await future
                except asyncio.CancelledError:
                    # The caller went away after the line had already run its operation:
                    # nobody will start what it planned, so undo it here (its blocks would
                    # otherwise stay in transit for ever).
                    if future.done() and not future.cancelled() and future.exception() is None:
                        self._orphaned(future.result(), undo)
                    else:
                        # Those behind it may have room (they yielded to a stalled line):
                        # nothing else need come to serve them.
                        asyncio.get_running_loop().call_soon(self.room_may_have_changed)
                    raise
                finally:
                    # Refused in line, the future's error is raised through this frame, which
                    # its traceback keeps: not the future too (a cycle).
                    future = None
                if result is not RETRY:
                    return result
            try:
                return op()
            except BlocksInTransit as exc:
                busy = untraced(exc)

    def _orphaned(self, result, undo) -> None:
        if result is RETRY:
            return
        if undo is not None:
            undo(result)
            return
        plan = result.plan if isinstance(result, AccessResult) else result
        if isinstance(plan, TransferPlan):
            self.pool.abort(plan)
            log.warning("a cancelled operation's plan was rolled back", pool=self.pool.name,
                        reason=plan.reason)

    def room_may_have_changed(self) -> None:
        """Pages came free or evictable (a release, a free, an unpin, a transfer done):
        serve the operations waiting for room."""
        if self.room_line:
            self.room_line.serve()

    def complete_now(self, plan: TransferPlan) -> float:
        """Complete a plan whose bytes are already where they belong."""
        self._zero_lost(plan)
        self._completed(plan, self.pool.complete(plan), 0.0)
        return 0.0

    def _zero_lost(self, plan: TransferPlan) -> None:
        """A dropped block comes back to a page that held another block's bytes: zero it, so
        an engine that reads before recomputing sees nothing of another request. (After the
        plan's copies: the page may be a victim's that was being copied out.)"""
        device = self.arenas["device"]
        for m in plan.promotions:
            if m.kind is MoveKind.REMATERIALIZE:
                device.zero(m.dst_page)

    def _completed(self, plan: TransferPlan, pinned_out: list[Block], stall_s: float) -> None:
        self._notify(plan, stall_s)
        self.room_may_have_changed()
        if plan.reason is not Reason.RESERVE:
            self._refill_soon()
        if pinned_out and self.pool.policy.uses_intent:  # pinned while demoted: bring back
            run = self.start(self.pool.prefetch(pinned_out))
            if callable(run):
                asyncio.ensure_future(run())

    def _refill_soon(self) -> None:
        """Top up the fair policy's free reserve in the background, off every request's path
        (unless a refill is due or under way already)."""
        if (self._closing or self.pool.pages.reserve_pages <= self.pool.device.num_free
                or not self.pool.policy.fair or self._refilling):
            return

        async def refill():
            plan = self.pool.refill_plan()
            if plan is not None:
                await self.execute(plan)

        self._refill = asyncio.ensure_future(refill())

    @property
    def _refilling(self) -> bool:
        """Whether a refill is due or under way."""
        return self._refill is not None and not self._refill.done()

    def stop_refills(self) -> asyncio.Future | None:
        """The pool is closing: no refill starts from now on. Returns the one due or under
        way, if any, for the caller to let finish (its copies are a transfer like any other)
        before the links and arenas close."""
        self._closing = True
        return self._refill if self._refilling else None

    def start(self, plan: TransferPlan | None) -> float | Callable[[], Awaitable[float]]:
        """Begin a plan. Returns the stall in seconds when the plan is already complete (no
        copy, or a small copy the idle link did at once), or a factory for the awaitable that
        waits for the link to copy it and returns the stall."""
        if plan is None:
            return 0.0
        if plan.num_copies == 0:
            return self.complete_now(plan)
        started = time.perf_counter()
        runs = plan_runs(plan)
        chunks = chunk_runs(runs, self.chunk_pages)
        job = self._job(plan, chunks)
        try:
            copied = self.link.try_now(job, runs, self.copier.copy_runs)
        except BaseException:
            self.pool.abort(plan)
            raise
        if copied:
            stall_s = time.perf_counter() - started
            (plan.cause or _first_request(plan)).bytes_moved += job.bytes_total
            self._zero_lost(plan)
            self._completed(plan, self.pool.complete(plan), stall_s)
            return stall_s
        transfer = Transfer(job, chunks, self.copier.copy_runs,
                            asyncio.get_running_loop().create_future())
        self.link.submit(transfer)
        # The page-table update runs in a task of its own: a caller that gives up (a deadline,
        # a cancelled stream) stops waiting, but the plan still finishes, so no page is ever
        # left half-moved or handed out while a thread still writes into it.
        task = asyncio.ensure_future(self._complete_when_copied(plan, transfer, started))
        self.transit.copying(plan, transfer, task)
        return lambda: asyncio.shield(task)

    def _job(self, plan: TransferPlan, chunks: list[list[tuple]]) -> Job:
        """The plan as a job for the link: its class, who pays, and the caps it is under."""
        if any(m.block.decode_critical for m in plan.promotions):
            cls = TransferClass.CRITICAL
        elif plan.reason.on_demand:
            cls = TransferClass.ACCESS
        elif plan.reason is Reason.PREFETCH:
            cls = TransferClass.PREFETCH
        else:
            cls = TransferClass.WRITEBACK
        req = plan.cause or _first_request(plan)
        page_bytes = self.pool.page_bytes
        sizes = [sum(run[4] for run in chunk) * page_bytes for chunk in chunks]
        caps = (req.transfer_cap,) if req.transfer_cap is not None else ()
        gates = ((req.read_bucket,) if plan.promotions and req.read_bucket is not None else ())
        return Job(cls, req.tenant, req.request_id, sizes, self.pool.clock.now(), caps=caps,
                   gates=gates)

    async def execute(self, plan: TransferPlan | None) -> float:
        """Copy a plan's bytes and complete it; returns seconds spent waiting (the stall)."""
        run = self.start(plan)
        return await run() if callable(run) else run

    async def _complete_when_copied(self, plan: TransferPlan, transfer: Transfer,
                                    started: float) -> float:
        try:
            await transfer.future
        except BaseException:
            self.pool.abort(plan)  # the copy failed: nothing moved
            self.transit.finish(plan)
            raise
        self._zero_lost(plan)
        pinned_out = self.pool.complete(plan)
        stall_s = time.perf_counter() - started
        (plan.cause or _first_request(plan)).bytes_moved += transfer.job.bytes_total
        self.transit.finish(plan)
        self._completed(plan, pinned_out, stall_s)
        return stall_s

    def _notify(self, plan: TransferPlan, stall_s: float) -> None:
        if self.on_plan_done is not None:
            self.on_plan_done(plan, stall_s)

    async def aclose_link(self) -> None:
        await self.link.aclose()

    def close(self) -> None:
        for arena in self.arenas.values():
            arena.close()


def find_runtime(pools: Mapping[str, PoolRuntime], name: str) -> PoolRuntime:
    """The runtime of the pool called `name`, or NotFound listing the pools there are."""
    try:
        return pools[name]
    except KeyError:
        raise NotFound(f"no pool {name!r}; this kvd has {', '.join(sorted(pools))}") from None


class StartedAccess:
    """An access whose copies may still run: `result` is the pool's answer; `copying` the
    task copying its plan (None: nothing left to copy, and `stall_s` was the wait)."""

    __slots__ = ("copying", "result", "runtime", "stall_s")

    def __init__(self, runtime: PoolRuntime, result: AccessResult,
                 copying: asyncio.Future | None, stall_s: float) -> None:
        self.runtime = runtime
        self.result = result
        self.copying = copying
        self.stall_s = stall_s

    @property
    def page_bytes(self) -> int:
        return self.runtime.pool.page_bytes

    async def wait(self) -> float:
        """Wait for the copies (if any) and record their stall; returns the whole stall."""
        if self.copying is not None:
            self.stall_s = await self.copying
            self.copying = None
            self.runtime.pool.record_stall(self.stall_s, self.result.plan)
        return self.stall_s


def _first_request(plan: TransferPlan) -> Request:
    """Who a plan without a cause moves for: the owner of its first block (a prefetch moves
    for the blocks' request; write-back for the victims')."""
    moves = plan.promotions or plan.demotions
    return moves[0].block.request if moves else plan.allocated[0].request
