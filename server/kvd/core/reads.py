"""The read path: an engine reads blocks of a request (access), and each step reads every
block of its running requests (answer, the hot path) (DESIGN.md, "What kvd decides": what a
step's reads cost and record).

Most steps read requests whose blocks are all resident and still; such a read is answered
from a few per-request counters, and recording it (recency for the policy, read metering,
counters) is left for later: nothing in the reply depends on it. `Reads` answers, keeps what
it answered as `ReadRecord`s, and hands them over merged (`take`) for the pool to record —
soon, and in any case before any other pool method, so every decision sees the reads in the
order they came.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvd.core.blocks import Block, Changes, Request, RequestState, TierKind, by_index
from kvd.core.clock import Clock
from kvd.core.counters import PoolCounters
from kvd.core.errors import HostShort, InvalidArgument
from kvd.core.requests import check_still, resolve
from kvd.core.tenancy import Tenancy
from kvd.core.transfer import Reason, TransferPlan

if TYPE_CHECKING:
    from kvd.core.pages import PageTable


@dataclass(slots=True)
class AccessResult:
    """blocks is None for a read of every block of the request (but a round of a read in
    rounds): its live blocks."""

    blocks: list[Block] | None
    plan: TransferPlan | None
    request: Request
    # The plan brings in only some of the missing blocks (the host tier cannot take all
    # the victims at once): execute it and access again for the rest.
    partial: bool = False


def after_reads(method):
    """The method, of a room holding its pool's `reads`, first records the reads the hot path
    left pending, so every decision sees them (see Pool.read_all). It may change what answer()
    can give at once: the answers kept are forgotten."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self.reads.settle()
        return method(self, *args, **kwargs)

    return wrapper


def changes_blocks(method):
    """after_reads for a method that only adds blocks to requests or takes them away (or
    into and out of the policy: holds, pins), and whose eviction choices record the pending
    reads first (PageTable.before_choice). Under a
    policy that orders each request's blocks apart (per_request_order), or one that is told
    where the reads stand among the blocks it takes in meanwhile (orders_late_reads: LRU,
    and the policies that queue a block with the last read it has seen: intent, deadline),
    the reads are left pending: recorded later they leave the order, recency and metering
    that recording them first would have (a block added since a read is not touched by it,
    and a read meters the blocks its request held then), and an engine step's allocations,
    frees and ended holds then cost no recording of their own; the steps' reads are
    recorded together.

    One difference remains, and only until the request's next read is recorded: a block
    whose hold or pin ends while a read of its request is pending, and that is not the
    request's newest, is ordered by that read as it orders the others (by index) rather than
    after them. A Step stream's holds are of blocks it just allocated (the newest) or read,
    and end at its next message, before that message's reads."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self.reads.before_block_changes()
        return method(self, *args, **kwargs)

    return wrapper


# Answers kept for reads to come (about one per engine stepping on the pool).
MAX_ANSWERS = 64
# Requests recorded at a time by record_some: a node's engines read hundreds of requests
# between two recordings, and one pass over them all would hold the event loop (and every
# engine's next step) for milliseconds.
RECORD_SLICE = 16


class ReadRecord:
    """Reads answered and not yet recorded: every block of `requests` was read `times`
    times, last at `at`, and the time before at `before` (None: once); `sizes` and
    `critical`: each request's blocks, and decode-critical ones, when read. Reads of the
    same requests whose sizes differed (blocks were added or freed in between) add theirs
    to `more_sizes` and `more_critical` (None until one does) instead of counting in
    `times`. `seq`: where the last read stands among the pool's events (see
    Reads.before_block_changes)."""

    __slots__ = ("at", "before", "critical", "more_critical", "more_sizes", "requests",
                 "seq", "sizes", "times")

    def __init__(self, at: float, requests: list[Request], sizes: list[int],
                 critical: list[int], seq: int) -> None:
        self.at = at
        self.seq = seq
        self.before: float | None = None
        self.requests = requests
        self.sizes = sizes
        self.critical = critical
        self.times = 1
        self.more_sizes: list[int] | None = None
        self.more_critical: list[int] | None = None

    def again(self, now: float, sizes: list[int], critical: list[int], seq: int) -> None:
        """The same requests read again now, with these sizes."""
        self.before, self.at = self.at, now
        self.seq = seq
        if ((sizes is self.sizes or sizes == self.sizes)
                and (critical is self.critical or critical == self.critical)):
            self.times += 1
        elif self.more_sizes is None:
            self.more_sizes, self.more_critical = sizes, critical
        else:
            self.more_sizes = list(map(operator.add, self.more_sizes, sizes))
            self.more_critical = list(map(operator.add, self.more_critical, critical))

    def blocks_read(self) -> tuple[list[int], list[int]]:
        """Each request's blocks read over these reads, and decode-critical ones."""
        times = self.times
        sizes = self.sizes if times == 1 else [times * n for n in self.sizes]
        critical = self.critical if times == 1 else [times * n for n in self.critical]
        if self.more_sizes is not None:
            sizes = list(map(operator.add, sizes, self.more_sizes))
            critical = list(map(operator.add, critical, self.more_critical))
        return sizes, critical


class LastRead:
    """A read answered wholly at once (see Reads.answer), and what it was answered on: the
    page table's moves then, and the position its Changes had reached."""

    __slots__ = ("count", "tenant", "requests", "sizes", "critical", "mark", "moves",
                 "_where")

    def __init__(self, count: int, tenant: str | None, requests: list[Request],
                 sizes: list[int], critical: list[int], moves: int, mark: int) -> None:
        self.count = count
        self.tenant = tenant
        self.requests = requests
        self.sizes = sizes
        self.critical = critical
        self.moves = moves
        self.mark = mark
        self._where: dict[Request, int] | None = None  # each request's position, once asked

    def still(self, moves: int, changes: Changes) -> bool:
        """Whether every request is still resident and still, its sizes brought up to date:
        no block of the pool has started to move since (`moves`), and a request noted in
        `changes` since (blocks added or freed, decode-critical or not) is looked at again.
        The lists a pending ReadRecord shares are replaced, never changed."""
        if moves != self.moves:
            return False
        changed = changes.since(self.mark)
        if not changed:
            return changed is not None
        where = self._where
        if where is None:
            where = self._where = {req: i for i, req in enumerate(self.requests)}
            if len(where) != len(self.requests):  # a request named twice: no shortcut
                return False
        sizes = critical = None
        for req in changed:
            i = where.get(req)
            if i is None:
                continue  # another's
            if (req.num_moving_blocks or req.num_device_blocks != req.num_live_blocks
                    or req.maybe_relocated):
                return False
            if sizes is None:
                sizes, critical = self.sizes.copy(), self.critical.copy()
            sizes[i], critical[i] = req.num_live_blocks, req.num_critical
        if sizes is not None:
            self.sizes, self.critical = sizes, critical
        self.mark = changes.end
        return True


class Reads:
    """One pool's answered, unrecorded reads, and their recording. `requests` is the pool's
    request table (read only here); recording a read touches the blocks in the page table's
    policy, and meters it for the tenancy and the counters."""

    def __init__(self, requests: dict[str, Request], clock: Clock, *, pages: PageTable,
                 tenancy: Tenancy, counters: PoolCounters, page_bytes: int) -> None:
        self._requests = requests
        self.clock = clock
        self.pages = pages
        self.tenancy = tenancy
        self.counters = counters
        self.page_bytes = page_bytes
        self.pending: list[ReadRecord] = []
        # The answers given wholly at once, by key (the caller's, else the request ids joined
        # by NUL: ids hold no NUL, so equal joins of as many ids are equal lists, and one
        # string compares faster than 64 scattered ones). An engine reads its batch every
        # step: while its requests stay resident and still, the same read needs no checks
        # but of the requests whose blocks changed (LastRead.still). Forgotten by every pool
        # method but those that only add or take away blocks (settle).
        self._answers: dict[str | bytes, LastRead] = {}
        # The pending record of each key: a step reading the same requests again (each
        # engine reads its batch every step, several engines in turn) is merged into its
        # record, which moves to the end of `pending`, rather than pending as one more.
        self._open: dict[str | bytes, ReadRecord] = {}
        # The reads taken to be recorded a slice at a time (record_some) and not recorded
        # yet, as take() gives them: older than any pending, so recorded before them.
        self._recording: list[tuple[Request, float, float | None, int, int, int, int]] = []
        self.slice = RECORD_SLICE
        # Numbers the reads answered and, under a policy that orders them among its inserts
        # (EvictionPolicy.orders_late_reads), the blocks it takes in while reads are pending.
        self._seq = itertools.count(1)

    def _again(self, key: str | bytes, read: list[Request], sizes: list[int],
               critical: list[int]) -> ReadRecord | None:
        """The pending record of the same requests, read again now; None when there is
        none (the caller makes one)."""
        record = self._open.get(key)
        # The same requests, by identity and in order (eq=False): often the same list.
        if record is None or (record.requests is not read and record.requests != read):
            return None
        record.again(self.clock.now(), sizes, critical, next(self._seq))
        pending = self.pending
        if pending[-1] is not record:  # pending stays in the order of the last reads
            pending.remove(record)
            pending.append(record)
        return record

    def _add(self, key: str | bytes, record: ReadRecord) -> bool:
        """A new pending record; whether it is the first pending."""
        self._open[key] = record
        self.pending.append(record)
        policy = self.pages.policy
        if policy.orders_late_reads and policy.late_inserts is None:
            policy.log_inserts(self._seq)
        return len(self.pending) == 1

    def answer_again(self, key: str | bytes, count: int, tenant: str | None
                     ) -> tuple[list[Request], bool] | None:
        """answer() of a repeated read, when the last answer under `key` (of `count` ids)
        still holds: the requests answered, and whether the read is the first pending. None
        when it does not hold (answer() then looks at each request)."""
        last = self._answers.get(key)
        if (last is None or last.count != count or last.tenant != tenant
                or not last.still(self.pages.moves, self.pages.changes)):
            return None
        if self.pending and self._again(key, last.requests, last.sizes, last.critical):
            return last.requests, False
        return last.requests, self._add(key, ReadRecord(self.clock.now(), last.requests,
                                                        last.sizes, last.critical,
                                                        next(self._seq)))

    def answer(self, request_ids: Sequence[str], tenant: str | None = None,
               key: bytes | None = None
               ) -> tuple[list[str], list[Request], bool, list[Request]]:
        """Read every block of each request now. Returns the ids left for the general path
        (blocks not all resident and still, unknown ids, other tenants' than `tenant`), the
        requests read whose blocks moved since the engine was told, whether this read is the
        first pending (the pool then has them recorded soon), and the requests answered.

        `key`, when given, stands for request_ids in telling a repeated read: bytes equal
        only for equal lists (the Step message without its id)."""
        if key is None:
            request_ids = list(request_ids)  # their strings made once: joined and looked up
            key = "\0".join(request_ids)
        again = self.answer_again(key, len(request_ids), tenant)
        if again is not None:
            return [], [], again[1], again[0]
        pending = self.pending
        requests = self._requests
        admitted = RequestState.ADMITTED
        general: list[str] = []
        relocated: list[Request] = []
        read: list[Request] = []
        sizes: list[int] = []
        critical: list[int] = []
        for rid in request_ids:
            req = requests.get(rid)
            if (req is None or req.state is not admitted or req.num_moving_blocks
                    or req.num_device_blocks != req.num_live_blocks
                    or (tenant is not None and req.tenant != tenant)):
                general.append(rid)
                continue
            read.append(req)
            sizes.append(req.num_live_blocks)
            critical.append(req.num_critical)
            if req.maybe_relocated:
                relocated.append(req)
        if not read:
            return general, relocated, False, read
        if not general and not relocated:
            answers = self._answers
            if len(answers) >= MAX_ANSWERS and key not in answers:
                del answers[next(iter(answers))]  # the oldest
            answers[key] = LastRead(len(request_ids), tenant, read, sizes, critical,
                                    self.pages.moves, self.pages.changes.end)
        if pending and self._again(key, read, sizes, critical):
            return general, relocated, False, read
        first = self._add(key, ReadRecord(self.clock.now(), read, sizes, critical,
                                          next(self._seq)))
        return general, relocated, first, read

    def before_block_changes(self) -> None:
        """Blocks are about to be added or taken away: see changes_blocks. The answers
        stay: they follow such changes (LastRead.still). A policy that orders every block
        by its last read or insert (LRU) is told the order of the reads among the blocks it
        took in meanwhile (orders_late_reads): recorded later, they leave the order that
        recording them first would."""
        policy = self.pages.policy
        if ((self.pending or self._recording) and not policy.per_request_order
                and policy.late_inserts is None):
            self.record_pending()

    def record_pending(self) -> None:
        """Record the reads answered so far (a no-op when there are none). Only a read budget
        is charged late: at the last read rather than each (the refill of that moment is
        lost, never gained)."""
        if self._recording:
            rest, self._recording = self._recording, []
            self.record(_still_admitted(rest))
        if self.pending:
            self.record(self.take())
        self._recorded_all()

    def record_some(self) -> bool:
        """Record the pending reads `slice` requests at a time: the first call takes them
        (merged, see take), each call after records the next of them; whether some are left
        (each call holds the caller's loop for about as long as the merge or a slice). Reads
        answered in between wait until those taken are recorded (record_pending records
        both, in that order): recorded in slices, the reads leave what recording them at
        once would."""
        if not self._recording:
            if self.pending:
                self._recording = self.take()
            if not self._recording:  # none, or only of requests released since
                self._recorded_all()
            return bool(self._recording)
        batch, limit = self._recording, self.slice
        self._recording = batch[limit:]
        self.record(_still_admitted(batch[:limit]))
        if not self._recording and not self.pending:
            self._recorded_all()
        return bool(self._recording)

    def _recorded_all(self) -> None:
        """Every read answered is recorded: the policy's inserts since, if it kept them in
        order, go behind them (see before_block_changes)."""
        policy = self.pages.policy
        if policy.late_inserts is not None:
            policy.end_late_inserts()

    def settle(self) -> None:
        """Before any other call on the pool: the pending reads recorded, the last answer
        forgotten."""
        if self.pending or self._recording:
            self.record_pending()
        if self._answers:
            self._answers.clear()
            self.pages.changes.forget()

    def take(self) -> list[tuple[Request, float, float | None, int, int, int]]:
        """The pending reads, merged, as (request, last read, the read before or None, times,
        blocks read, decode-critical blocks read) in the order of the last reads; none
        pending after.

        Steps that come faster than the pool records them leave several reads pending, often
        of the same requests (an engine reads its batch every step). Nothing that depends on
        reads happened to the pool in between (at most blocks were added or taken away, see
        changes_blocks), so each request's blocks need only their last read, and the one
        before it for the reuse distance; the blocks read add up, and the policy sees the
        requests in the order of their last reads, as recording the reads one by one would
        leave them. Requests released meanwhile are left out."""
        pending, self.pending = self.pending, []
        if not pending:
            return []
        self._open = {}
        admitted = RequestState.ADMITTED
        if len(pending) == 1 and pending[0].times == 1 and pending[0].more_sizes is None:
            at = pending[0].at
            record = pending[0]
            seq = record.seq
            return [(r, at, None, 1, n, c, seq)
                    for r, n, c in zip(record.requests, record.sizes, record.critical)
                    if r.state is admitted]
        # request -> [request, last, the read before, times, the record of the last, blocks,
        # decode-critical blocks]. Records come newest first (pending is in the order of
        # their last reads); a record read again was moved to the end, so the read before a
        # request's last is the latest of its record's read before and the other records'
        # last reads.
        latest: dict[Request, list] = {}
        for i, record in enumerate(reversed(pending)):
            at, before, count = record.at, record.before, record.times
            sizes, critical = record.blocks_read()
            for req, size, crit in zip(reversed(record.requests), reversed(sizes),
                                       reversed(critical)):
                entry = latest.get(req)
                if entry is None:
                    latest[req] = [req, at, before, count, i, size, crit, record.seq]
                else:
                    if entry[4] == i:  # named twice in one step: read twice at its time
                        entry[2] = at
                    elif entry[2] is None or entry[2] < at:
                        entry[2] = at
                    entry[3] += count
                    entry[5] += size
                    entry[6] += crit
        return [(e[0], e[1], e[2], e[3], e[5], e[6], e[7]) for e in reversed(latest.values())
                if e[0].state is admitted]

    def access(self, req: Request, indices: Sequence[int] | None,
               holder: str = "") -> AccessResult:
        """The engine reads these blocks of an admitted request now (None: all of them).
        Resident blocks are touched; the rest are promoted by the returned plan. With a
        holder, the blocks are held for it from now on (see Holds)."""
        pages = self.pages
        if (indices is None and req.num_moving_blocks == 0
                and req.num_device_blocks == req.num_live_blocks):
            # The hot path: attention reads a resident request.
            self.record(((req, self.clock.now(), None, 1, req.num_live_blocks,
                          req.num_critical, next(self._seq)),))
            if holder:
                self._held_whole(req, (), holder)
            return AccessResult(None, None, req)
        if indices is None:
            return self._read_whole(req, holder)
        blocks = resolve(req, indices)
        check_still(blocks)
        missing = [b for b in blocks if b.tier is not TierKind.DEVICE]
        counters = self.counters
        plan = None
        if missing:
            plan, round_ = self._bring_in(req, missing, blocks, holder)
            if round_:
                return AccessResult(blocks, plan, req, partial=True)
        now = self.clock.now()
        # A block read for a holder leaves the policy below, held, and goes back in, read,
        # when its holds end: a touch now would only be undone.
        policy = None if holder else pages.policy
        for b in blocks:
            b.reuse_s = now - b.last_access
            b.last_access = now
            if b.decode_critical:
                counters.num_decode_critical_accesses += 1
                if b.moving:
                    counters.num_decode_critical_misses += 1
            if policy is not None and not b.moving and not b.pinned and not b.held:
                policy.touch(b)
        counters.num_accesses += len(blocks)
        counters.num_misses += len(missing)
        self.note(req, len(blocks), now)
        if holder:
            # Only once the access succeeded (an access waiting for room holds nothing, so
            # waiters cannot hold each other up). The promoted blocks are not offered to the
            # policy when their copy lands.
            for b in blocks:
                pages.holds.hold_one(holder, b)
        return AccessResult(blocks, plan, req)

    def _read_whole(self, req: Request, holder: str) -> AccessResult:
        """A read of every block of a request not all of whose blocks are resident: the
        blocks off the device tier brought in (its `off_device`), the read recorded as the
        hot path records one (by request, not block by block), and the request held by
        request but for the blocks brought in, which are moving (see _held_whole). Nothing
        here looks at each of its blocks: under a fair policy a long request over its share
        reads this way every step (the refill takes some of its blocks, its read brings them
        back)."""
        if req.num_moving_blocks:
            check_still(req.live)
        missing = sorted(req.off_device, key=by_index)
        plan = None
        if missing:
            plan, round_ = self._bring_in(req, missing, None, holder)
            if round_:
                return AccessResult(req.live_blocks(), plan, req, partial=True)
        self.note_late(missing)
        self.record(((req, self.clock.now(), None, 1, req.num_live_blocks, req.num_critical,
                      next(self._seq)),))
        if holder:
            self._held_whole(req, missing, holder)
        return AccessResult(None, plan, req)

    def _bring_in(self, req: Request, missing: list[Block], blocks: list[Block] | None,
                  holder: str) -> tuple[TransferPlan, bool]:
        """The plan bringing a read's missing blocks in, and whether it is a round of a read
        in rounds. `blocks`: the blocks read (None: every block of req). A read the device
        tier could never hold at once is refused. When the host tier has no room to swap
        out all the victims now, the plan brings in what it can (a round; counted missed
        here): the caller executes it and reads again (the blocks brought in are then
        resident and protected), and the reads are counted once, in the last round."""
        pages = self.pages
        num = req.num_live_blocks if blocks is None else len(blocks)
        if num > pages.device.capacity:
            raise InvalidArgument(
                f"reading {num} blocks at once needs as many device pages; the device tier "
                f"of pool {pages.name!r} holds {pages.device.capacity} pages: read them in "
                "parts")
        whole, keep = blocks is None, blocks or ()
        try:
            return pages.promote(req, missing, keep, Reason.ACCESS, holder, whole=whole), False
        except HostShort as short:
            if short.possible <= 0:
                raise
            missing = missing[:short.possible]
            plan = pages.promote(req, missing, keep, Reason.ACCESS, holder, whole=whole)
            self.note_late(missing)
            return plan, True

    def _held_whole(self, req: Request, moving: Sequence[Block], holder: str) -> None:
        """Hold every block of a request the holder read whole: those brought in one by one
        (moving, out of the policy: held, they are not offered to it when their copy lands),
        the others by request (see Holds.hold_requests). Held block by block, a read that
        brings in one block of a long request cost as much as reading each of its blocks
        into and out of the policy."""
        holds = self.pages.holds
        for b in moving:
            holds.hold_one(holder, b)
        holds.hold_requests(holder, [req])

    def note_late(self, blocks: Iterable[Block]) -> None:
        """A read's blocks that were not in the device tier (their promotion planned now, or
        already under way): misses."""
        for b in blocks:
            self.counters.num_misses += 1
            if b.decode_critical:
                self.counters.num_decode_critical_misses += 1

    def record(self, reads) -> None:
        """Every block of each request (all of them resident) was read `count` times, last at
        `now` and before that at `before` (None: once), `num_read` blocks in all, `critical`
        of them decode-critical (as they were when read): recency, the policy's order, and
        read metering. `reads` is (request, now, before, count, num_read, critical, seq) in
        the order of the last reads, as take() gives them. A block added since `now` was not
        read.

        Recorded on the request, not block by block (see Block.last_access and reuse_s): a
        long context's every step reads every one of its blocks, and a walk over them held
        the event loop, and every other tenant's call, for milliseconds. Each block it held
        then (its own last read no later than `now`) reads `now` as its last read, and the
        later of its own and the request's read before as the one before (a block added
        after the read before was first read at `now`)."""
        policy = self.pages.policy
        num_critical = num_blocks = 0
        for req, now, before, count, num_read, critical, _ in reads:
            num_critical += critical
            last = req.read_at
            if now >= last:  # (a read older than the last recorded changes no block)
                req.read_since = last if before is None or last > before else before
                req.read_at = now
            num_blocks += num_read
            self.note(req, num_read, now)
        if policy.late_inserts:  # put among (or given to) the blocks queued meanwhile
            policy.touch_requests_among_inserts(reads)
        elif policy.eager_touch:
            policy.touch_requests([read[0] for read in reads])
        self.counters.num_decode_critical_accesses += num_critical
        self.counters.num_accesses += num_blocks

    def note(self, req: Request, num_blocks: int, now: float) -> None:
        """Attention read num_blocks of the request: meter them (and spend its read budget)."""
        req.blocks_read += num_blocks
        self.tenancy.blocks_read_by_tenant[req.tenant] += num_blocks
        if req.read_bucket is not None:
            req.read_bucket.consume(num_blocks * self.page_bytes, now)


def _still_admitted(reads: list[tuple]) -> list[tuple]:
    """Reads (as take() gives them) of requests not released since they were taken."""
    admitted = RequestState.ADMITTED
    return [read for read in reads if read[0].state is admitted]
