"""Runs a pool's decisions: executes transfer plans off the event loop, waits for blocks in
transit, and measures stalls. The core decides; this module makes the bytes follow."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import structlog

from kvd.core.jobs import Job, TransferClass
from kvd.core.blocks import Block, Request, TierKind
from kvd.core.errors import BlocksInTransit, NotFound, ResourceExhausted
from kvd.core.pool import AccessResult, Pool
from kvd.core.transfer import MoveKind, Reason, TransferPlan
from kvd.links import Link, Transfer
from kvd.memory.copier import PageCopier, chunk_runs, plan_runs

T = TypeVar("T")
log = structlog.get_logger("kvd.runtime")
_RETRY = object()  # a room waiter's own blocks are in transit: it waits for them, then retries


# How long a step's reads may wait to be recorded. Off the reply's path, and the steps that
# come meanwhile (an engine reads the same batch every step) are recorded together, at the
# cost of one. Nothing sees them late: every other pool operation, stats and metrics
# included, records them first, whenever it comes.
RECORD_READS_AFTER_S = 0.05
# Blocks in transit with no owner for this long are stuck (see PoolRuntime.stuck).
ORPHANED_AFTER_S = 1.0
# WaitAdmission streams one request may have (each holds a little of kvd's memory).
MAX_WAITERS = 8


def record_later(fn: Callable[[], None]) -> None:
    """fn on the event loop RECORD_READS_AFTER_S from now; at once without a running loop."""
    try:
        asyncio.get_running_loop().call_later(RECORD_READS_AFTER_S, fn)
    except RuntimeError:
        fn()


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
        self._inflight: dict[Block, asyncio.Future] = {}
        self._refilling = False
        # Set (and dropped) whenever the admission queue may have changed; made only when a
        # WaitAdmission stream waits, so admissions nobody watches make no event.
        # WaitAdmission streams: request id -> (the position it was told, its event).
        self._queue_waiters: dict[str, list[tuple[int, asyncio.Event]]] = {}
        self._plans: set[TransferPlan] = set()
        # Operations that found no device room while pages were in transit, in line for it:
        # (rank, arrival, op, future). Served as transfers complete, best rank first.
        self._room_waiters: list[tuple[int, int, Callable, asyncio.Future]] = []
        self._arrivals = itertools.count()
        # Since when some block waited on has been in transit with no owner (None: none).
        self._unowned_since: float | None = None
        # Requests with blocks in transit that no plan owns, since when (see stuck()).
        self._orphans_seen: dict[Request, float] = {}
        # Plans in flight: their transfer, and when its bytes last moved (for stuck()).
        self._progress: dict[TransferPlan, list] = {}
        # Told of every plan done, with its stall (the node's events and stall metric).
        self.on_plan_done = on_plan_done

    def queue_event(self, request_id: str, position: int) -> asyncio.Event:
        """An event set when the request's answer changes: admitted, gone, or a queue
        position other than `position` (the one its waiter has just told)."""
        waiters = self._queue_waiters.setdefault(request_id, [])
        if len(waiters) >= MAX_WAITERS:
            raise ResourceExhausted(f"{len(waiters)} WaitAdmission streams wait on this "
                                    f"request already; at most {MAX_WAITERS}")
        event = asyncio.Event()
        waiters.append((position, event))
        return event

    def notify_queue(self) -> None:
        """The admission queue may have changed: wake the waiters whose answer did (one
        ordering of the queue for all of them; the others sleep on)."""
        if not self._queue_waiters:
            return
        positions = self.pool.queue_positions()
        for request_id, waiters in list(self._queue_waiters.items()):
            position = positions.get(request_id, 0)
            keep = [(told, event) for told, event in waiters if told == position]
            for told, event in waiters:
                if told != position:
                    event.set()
            if keep:
                self._queue_waiters[request_id] = keep
            else:
                del self._queue_waiters[request_id]

    def forget_waiter(self, request_id: str, event: asyncio.Event) -> None:
        """A waiter went away without being woken."""
        waiters = self._queue_waiters.get(request_id)
        if waiters is not None:
            waiters[:] = [(p, e) for p, e in waiters if e is not event]
            if not waiters:
                del self._queue_waiters[request_id]

    @property
    def num_in_flight(self) -> int:
        """Plans whose copies are under way."""
        return len(self._plans)

    async def begin_access(self, request_id: str, indices, holder: str = "") -> StartedAccess:
        """An access with its copies started (unary Access and a Step's reads both come
        here): done when the blocks were resident or the idle link copied them at once,
        else `copying` runs on while the caller starts other work (StartedAccess.wait)."""
        result = await self.access(request_id, indices, holder)
        if result.plan is None:
            return StartedAccess(self, result, None, 0.0)
        run = self.start(result.plan)
        if callable(run):
            # A task, not a coroutine: a later access may wait on these blocks.
            return StartedAccess(self, result, asyncio.ensure_future(run()), 0.0)
        if run:
            self.pool.record_stall(run, result.plan)
        return StartedAccess(self, result, None, run)

    def track(self, plan: TransferPlan, task: asyncio.Future) -> None:
        """A plan made outside start() (a handoff's) is in flight in `task`: whoever needs
        its blocks waits for it, and checks see it."""
        self._plans.add(plan)
        self.hold_for(plan.blocks(), task)

    def hold_for(self, blocks: list[Block], task: asyncio.Future) -> None:
        """Whoever needs these blocks waits for `task` (a handoff copying them)."""
        for b in blocks:
            self._inflight[b] = task

    async def access(self, request_id: str, indices, holder: str = "") -> AccessResult:
        """pool.access, waiting out transfers; an access that waited for its own blocks'
        promotion (started by a prefetch that came too late) counts those as misses. A swap
        the host tier cannot take at once goes in rounds; their stall is recorded here, and
        the last round's plan is returned for the caller to execute."""
        result = await self._access(request_id, indices, holder)
        while result.partial:
            stall_s = await self.execute(result.plan)
            self.pool.record_stall(stall_s, result.plan)
            result = await self._access(request_id, indices, holder)
        return result

    async def _access(self, request_id: str, indices, holder: str) -> AccessResult:
        try:
            return self.pool.access(request_id, indices, holder)
        except BlocksInTransit as exc:
            busy: BlocksInTransit | None = exc
        late = [b for b in busy.blocks if b.tier is not TierKind.DEVICE]
        critical = self._critical(request_id, indices)
        if busy.blocks:
            await self.wait_for(busy.blocks)
            busy = None
        result = await self.run(lambda: self.pool.access(request_id, indices, holder),
                                critical, busy)
        self.pool.note_late(late)
        return result

    def _critical(self, request_id: str, indices) -> bool:
        req = self.pool.requests.get(request_id)
        if req is None:
            return False
        if indices is None:
            return any(b is not None and b.decode_critical for b in req.blocks)
        return any(0 <= i < len(req.blocks) and req.blocks[i] is not None
                   and req.blocks[i].decode_critical for i in indices)

    async def run(self, op: Callable[[], T], critical: bool = False,
                  busy: BlocksInTransit | None = None,
                  undo: Callable[[T], None] | None = None) -> T:
        """Call a pool operation, waiting out blocks in transit and calling again. One that
        finds no device room while pages are in transit waits in line for room (decode-
        critical first under fair link scheduling, else in arrival order) and is called
        again, in that order, the moment a transfer completes: a stream of others cannot
        take the room from under it."""
        if busy is None:
            try:  # the common case: nothing in the way, no suspension
                return op()
            except BlocksInTransit as exc:
                pending = exc
            busy = pending
        while True:
            if busy.blocks:
                await self.wait_for(busy.blocks)
            else:
                rank = 0 if critical and self.link.sched.scheduling == "fair" else 1
                future = asyncio.get_running_loop().create_future()
                heapq.heappush(self._room_waiters,
                               (rank, next(self._arrivals), op, future))
                if not self.pool.num_moving_blocks():
                    self._serve_room_waiters()  # the transfer it waited for is done already
                try:
                    result = await future
                except asyncio.CancelledError:
                    # The caller went away after the line had already run its operation:
                    # nobody will start what it planned, so undo it here (its blocks would
                    # otherwise stay in transit for ever).
                    if future.done() and not future.cancelled() and future.exception() is None:
                        self._orphaned(future.result(), undo)
                    raise
                if result is not _RETRY:
                    return result
            try:
                return op()
            except BlocksInTransit as exc:
                again = exc
            busy = again

    def _orphaned(self, result, undo) -> None:
        if result is _RETRY:
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
        if self._room_waiters:
            self._serve_room_waiters()

    def _serve_room_waiters(self) -> None:
        """Room may have come free: call waiting operations in line until one still finds
        none."""
        waiters = self._room_waiters
        while waiters:
            _, _, op, future = waiters[0]
            if future.done():  # its caller gave up
                heapq.heappop(waiters)
                continue
            try:
                result = op()
            except BlocksInTransit as busy:
                if not busy.blocks:
                    return  # still no room: the line waits for the next transfer
                heapq.heappop(waiters)
                future.set_result(_RETRY)
                continue
            except BaseException as exc:
                heapq.heappop(waiters)
                future.set_exception(exc)
                continue
            heapq.heappop(waiters)
            future.set_result(result)

    async def wait_for(self, blocks: list[Block]) -> None:
        """Wait until these blocks' transfers finish (no blocks: until any transfer does)."""
        if blocks:
            futures = {f for b in blocks if (f := self._inflight.get(b)) is not None
                       and not f.done()}
        else:
            futures = set(self._inflight.values())
            if futures:
                await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
                return
        if futures:
            await asyncio.wait(futures)
        else:
            # Moving but not yet registered (the planner's task registers it next), or, if
            # that lasts, owned by nobody: a bug that stuck_blocks() reports. Never spin.
            await asyncio.sleep(0.0005 if self._unowned_since is None else 0.05)
            self._note_unowned(blocks)

    def _note_unowned(self, blocks: list[Block]) -> None:
        unowned = [b for b in blocks if b.moving and b not in self._inflight]
        if not unowned:
            self._unowned_since = None
        elif self._unowned_since is None:
            self._unowned_since = time.monotonic()

    def stuck(self, bound_s: float) -> list[str]:
        """What has been in flight without progress for longer than bound_s: blocks in
        transit that no plan or handoff owns, and plans whose bytes stopped moving."""
        now = time.monotonic()
        problems = []
        inflight = self._inflight
        seen, self._orphans_seen = self._orphans_seen, {}
        for req in self.pool.requests.values():
            if not req.num_moving_blocks:
                continue
            orphans = [b for b in req.blocks if b is not None and b.moving
                       and (b not in inflight or inflight[b].done())]
            if not orphans:
                continue
            # A plan's blocks go unowned for an instant between its planning and its start:
            # only what stays so is reported.
            since = self._orphans_seen[req] = seen.get(req, now)
            if now - since >= ORPHANED_AFTER_S:
                problems.append(f"{self.pool.name}: {len(orphans)} block(s) of request "
                                f"{req.request_id[:64]!r} in transit with no owner for "
                                f"{now - since:.1f} s")
        for plan, entry in self._progress.items():
            transfer, done, since = entry
            if transfer.job.bytes_done != done:
                entry[1], entry[2] = transfer.job.bytes_done, now
            elif now - since > bound_s:
                problems.append(f"{self.pool.name}: a {plan.reason} plan moved no byte for "
                                f"{now - since:.0f} s ({transfer.job.bytes_done} of "
                                f"{transfer.job.bytes_total} bytes done)")
        return problems

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
        if self._room_waiters:
            self._serve_room_waiters()
        if plan.reason is not Reason.RESERVE and not self._refilling:
            self._refill_soon()
        if pinned_out and self.pool.policy.uses_intent:  # pinned while demoted: bring back
            run = self.start(self.pool.prefetch(pinned_out))
            if callable(run):
                asyncio.ensure_future(run())

    def _refill_soon(self) -> None:
        """Top up the fair policy's free reserve in the background, off every request's path."""
        if self.pool.reserve_pages <= self.pool.device.num_free or not self.pool.policy.fair:
            return
        self._refilling = True

        async def refill():
            try:
                plan = self.pool.refill_plan()
                if plan is not None:
                    await self.execute(plan)
            finally:
                self._refilling = False

        asyncio.ensure_future(refill())

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
        for block in plan.blocks():
            self._inflight[block] = task
        self._plans.add(plan)
        self._progress[plan] = [transfer, 0, time.monotonic()]
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
            self.finish(plan)
            raise
        self._zero_lost(plan)
        pinned_out = self.pool.complete(plan)
        stall_s = time.perf_counter() - started
        (plan.cause or _first_request(plan)).bytes_moved += transfer.job.bytes_total
        self.finish(plan)
        self._completed(plan, pinned_out, stall_s)
        return stall_s

    def finish(self, plan: TransferPlan) -> None:
        """A plan is no longer in flight (completed or aborted)."""
        self.finish_blocks(plan.blocks())
        self._plans.discard(plan)
        self._progress.pop(plan, None)

    def finish_blocks(self, blocks: list[Block]) -> None:
        """Nobody needs to wait for these blocks any more."""
        inflight = self._inflight
        for block in blocks:
            inflight.pop(block, None)

    def _notify(self, plan: TransferPlan, stall_s: float) -> None:
        if self.on_plan_done is not None:
            self.on_plan_done(plan, stall_s)

    async def quiesce(self, timeout_s: float | None = None) -> bool:
        """Wait until no transfer is in flight (for checks and shutdown), at most timeout_s.
        False: some still were."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            pending = {f for f in self._inflight.values() if not f.done()}
            if not pending:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            await asyncio.wait(pending, timeout=left)

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
