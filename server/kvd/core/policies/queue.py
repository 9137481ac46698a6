"""A queue of blocks whose bookkeeping lives on the blocks themselves.

An OrderedDict keeps an LRU order in O(1), but looking at its oldest entry walks a linked
node, the dict's index table, its entry array and the next node: at a million blocks each of
those is a cache miss, and victim selection costs twice what it costs at ten thousand. Here
the queue is a deque of blocks; a block remembers which queue holds its live entry and at
which position (block.queue, block.queue_pos), and moving it to the back appends a new entry
and leaves the old one behind, stale. Looking at the front reads the first slot and that one
block. Stale entries are dropped when they reach the front, and compacted away when they
outnumber the live ones, so every operation is O(1) amortized.

The entries lie in segments of about `segment` entries (appends go to the last; one call's
appends stay in one segment, however many), and a compaction filters them from the front a
bounded piece per call that appends, about twice the entries it appended: compacting every
entry at once held the event loop (every tenant's call) half a second at half a million
blocks, once per that many entries appended. A compaction ends at the segment that was last
when it began, so appends cannot keep it going.

A block is in at most one queue at a time (pushing it into another moves it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvd.core.blocks import Block, Request


class _Membership:
    """What a queue knows of its blocks without its entries: which it holds, how many."""

    __slots__ = ("_live",)

    def discard(self, block: Block) -> None:
        """Take block out of the queue (nothing when it is not in it)."""
        if block.queue is self:
            block.queue = None
            self._live -= 1

    def __len__(self) -> int:
        return self._live

    def __contains__(self, block: Block) -> bool:
        return block.queue is self


class _Segments(_Membership):
    """What BlockQueue and RunQueue share: segments of entries, and a compaction under way
    (`_filter`, theirs, filters a piece of one segment)."""

    __slots__ = ("_segments", "_count", "_next", "_sweep", "_stop", "_segment", "_slack")

    def __init__(self, segment: int, slack: int) -> None:
        self._segments: deque[deque] = deque()
        self._count = 0  # entries in all segments
        self._next = 0  # the next entry's position
        self._live = 0
        self._sweep = -1  # the segment a compaction under way filters next; -1: none
        self._stop: deque | None = None  # the segment it ends at (the last when it began)
        self._segment = segment
        self._slack = slack  # entries past twice the blocks before a compaction begins

    def _new_segment(self) -> deque:
        return deque()

    def _tail(self) -> deque:
        """The segment appends go to (a new one once the last is full)."""
        segments = self._segments
        if not segments or len(segments[-1]) >= self._segment:
            segments.append(self._new_segment())
        return segments[-1]

    def _front(self) -> deque:
        """The first segment that holds an entry (empty ones before it go). The queue must
        hold an entry."""
        segments = self._segments
        while not segments[0]:
            if segments.popleft() is self._stop:
                self._sweep, self._stop = -1, None  # nothing before it is left to filter
            elif self._sweep > 0:
                self._sweep -= 1
            elif self._sweep == 0 and segments[0] is self._stop:  # the next to filter went
                self._sweep, self._stop = -1, None
        return segments[0]

    def _compact_some(self, appended: int) -> None:
        """Go on with a compaction under way, about twice as much work as the entries just
        appended (a quarter of a segment's worth at least), so that it ends before the queue
        doubles; or begin one once the entries are more than twice the blocks."""
        if self._sweep < 0:
            if self._count <= 2 * self._live + self._slack:
                return
            self._sweep = 0
            self._stop = self._new_segment()  # appends from now on come after what it filters
            self._segments.append(self._stop)
        budget = max(2 * appended, self._segment // 4)
        while self._sweep >= 0 and budget > 0:
            budget -= self._filter(self._sweep, budget)

    def _filter(self, i: int, budget: int) -> int:
        raise NotImplementedError

    def _filtered(self, i: int, kept: deque, before_room: bool) -> None:
        """Segment i's kept entries placed before the rest of it (into the segment before
        when `before_room`, else a segment of their own, which the caller made); the
        compaction moves past segment i once it is done, and ends at its stop."""
        segments = self._segments
        if kept and not before_room:
            segments.insert(i, kept)
            i += 1
        if not segments[i]:
            del segments[i]
        if segments[i] is self._stop:
            self._sweep, self._stop = -1, None
        else:
            self._sweep = i


class _Positioned(deque):
    """A BlockQueue's segment: its entry at index i is at position base + i."""

    __slots__ = ("base",)


class BlockQueue(_Segments):
    """Blocks in insertion order with O(1) removal: the queue each policy class keeps.
    Positions are implicit: an entry is at its segment's base plus its index there, and a
    compaction renumbers the entries it keeps within the range they held."""

    __slots__ = ()

    def __init__(self, segment: int = 1024, slack: int = 64) -> None:
        super().__init__(segment, slack)

    def _new_segment(self) -> _Positioned:
        segment = _Positioned()
        segment.base = self._next
        return segment

    def push(self, block: Block) -> None:
        """Put block at the back (moving it there if this queue holds it already)."""
        if block.queue is not self:
            if block.queue is not None:
                block.queue.discard(block)
            self._live += 1
        block.queue = self
        tail = self._tail()
        block.queue_pos = self._next
        self._next += 1
        tail.append(block)
        self._count += 1
        self._compact_some(1)

    def requeue(self, blocks) -> None:
        """Move each block of `blocks` that this queue holds to the back, in order (others,
        and None, are skipped): push() for the blocks a step read, in one pass."""
        tail = self._tail()
        append = tail.append
        pos = start = self._next
        for block in blocks:
            if block is not None and block.queue is self:
                block.queue_pos = pos
                pos += 1
                append(block)
        self._next = pos
        self._count += pos - start
        self._compact_some(pos - start)

    def first(self) -> Block:
        """The oldest block. The queue must not be empty."""
        while True:
            front = self._front()
            block = front[0]
            if block.queue is self and block.queue_pos == front.base:
                return block
            front.popleft()  # stale: the block moved back or left
            front.base += 1
            self._count -= 1

    def __iter__(self) -> Iterator[Block]:
        """Oldest first. The queue must not change while this runs."""
        for segment in self._segments:
            for pos, block in enumerate(segment, segment.base):
                if block.queue is self and block.queue_pos == pos:
                    yield block

    def _filter(self, i: int, budget: int) -> int:
        """Drop the stale entries from the front of segment i, about `budget` of them
        looked at; those kept go before the rest of it, renumbered within the range they
        held (from the end of the segment before, where that has room). Returns the
        entries looked at."""
        segments = self._segments
        segment = segments[i]
        base = segment.base
        kept = _Positioned()
        looked = 0
        while segment and looked < budget:
            block = segment.popleft()
            if block.queue is self and block.queue_pos == base + looked:
                kept.append(block)
            looked += 1
        segment.base = base + looked
        self._count += len(kept) - looked
        before = segments[i - 1] if i else None
        room = before is not None and len(before) + len(kept) <= self._segment
        if room:
            start = before.base + len(before)
            before.extend(kept)
        else:
            kept.base = start = base
        for pos, block in enumerate(kept, start):
            block.queue_pos = pos
        self._filtered(i, kept, room)
        return looked


class RunQueue(_Segments):
    """Like BlockQueue, and a read of a whole request costs one entry, not one per block.

    An engine's step reads every block of each request it runs; with long contexts that is
    hundreds of thousands of blocks a step, and moving each to the back of an LRU queue held
    the event loop for as long (with the compactions the stale entries brought). Here
    `requeue_requests` appends one entry for the request, a run: the request's blocks this
    queue held then stand there, in the request's block order, as requeue() of its live
    blocks would have put them. A block stands at its run when the request's latest run
    comes after the block's own entry (block.queue_pos < the run's position); a block pushed
    or moved on its own since stands at its own entry. A run is replaced by the blocks it
    stands for when a choice of victims meets it (`first`, `oldest`) or when the queue
    compacts, so a request read step after step costs one entry a step, and its blocks are
    looked at once it is among the oldest (or once per compaction, which as many entries as
    the queue holds blocks must come before).

    Entries are (position, block or request); positions grow along the queue (a run's
    blocks all take its position when it is replaced), and an entry counts only while its
    block's queue_pos is its position, or its request's latest run is at it.
    """

    __slots__ = ("_runs",)

    def __init__(self, segment: int = 1024, slack: int = 64) -> None:
        super().__init__(segment, slack)
        self._runs: dict[Request, int] = {}  # request -> the position of its latest run

    def push(self, block: Block) -> None:
        """Put block at the back (moving it there if this queue holds it already)."""
        if block.queue is not self:
            if block.queue is not None:
                block.queue.discard(block)
            block.queue = self
            self._live += 1
        pos = self._next
        self._next = pos + 1
        block.queue_pos = pos
        self._tail().append((pos, block))
        self._count += 1
        self._compact_some(1)

    def requeue(self, blocks) -> None:
        """Move each block of `blocks` that this queue holds to the back, in order (others,
        and None, are skipped)."""
        append = self._tail().append
        pos = start = self._next
        for block in blocks:
            if block is not None and block.queue is self:
                block.queue_pos = pos
                append((pos, block))
                pos += 1
        self._next = pos
        self._count += pos - start
        self._compact_some(pos - start)

    def requeue_requests(self, requests) -> None:
        """requeue() of each request's live blocks in turn, one entry per request."""
        if not self._live:
            return  # nothing to move
        runs = self._runs
        append = self._tail().append
        pos = start = self._next
        for req in requests:
            runs[req] = pos
            append((pos, req))
            pos += 1
        self._next = pos
        self._count += pos - start
        self._compact_some(pos - start)

    def first(self) -> Block:
        """The oldest block. The queue must not be empty."""
        runs = self._runs
        while True:
            front = self._front()
            pos, item = front[0]
            if type(item) is Block:
                if self._counts(pos, item):
                    return item
                front.popleft()  # stale, or standing at a later run of its request
                self._count -= 1
                continue
            front.popleft()
            self._count -= 1
            if runs.get(item) == pos:  # the request's latest run: its blocks take its place
                del runs[item]
                standing = self._standing(item, pos)
                front.extendleft(reversed(standing))
                self._count += len(standing)

    def oldest(self, n: int) -> list[Block]:
        """The n oldest blocks (all of them when it holds fewer), oldest first. The runs met
        on the way are replaced by their blocks, as first() replaces one, so choosing again
        never walks a run's request again (a long request evicted a batch at a time, most
        of its blocks gone already, would be walked whole for each batch)."""
        runs = self._runs
        out: list[Block] = []
        kept: list[tuple[int, Block]] = []
        while len(out) < n and self._count > len(kept):
            front = self._front()
            pos, item = front.popleft()
            self._count -= 1
            if type(item) is Block:
                if self._counts(pos, item):
                    out.append(item)
                    kept.append((pos, item))
                    self._count += 1  # put back below
            elif runs.get(item) == pos:
                del runs[item]
                standing = self._standing(item, pos)
                front.extendleft(reversed(standing))
                self._count += len(standing)
        if kept:
            segments = self._segments
            if not segments:
                segments.append(self._new_segment())
            segments[0].extendleft(reversed(kept))
        return out

    def _standing(self, req: Request, pos: int) -> list[tuple[int, Block]]:
        """The entries of the blocks that stand at req's run at `pos`, now at `pos`."""
        run = []
        for block in req.live:
            if block.queue is self and block.queue_pos < pos:
                block.queue_pos = pos
                run.append((pos, block))
        return run

    def __iter__(self) -> Iterator[Block]:
        """Oldest first. The queue must not change while this runs."""
        runs = self._runs
        for segment in self._segments:
            for pos, item in segment:
                if type(item) is Block:
                    if self._counts(pos, item):
                        yield item
                elif runs.get(item) == pos:
                    for block in item.live:
                        if block.queue is self and block.queue_pos < pos:
                            yield block

    def _counts(self, pos: int, block: Block) -> bool:
        """Whether the entry (pos, block) stands for the block: the block's latest entry, and
        no later run of its request."""
        runs = self._runs
        return (block.queue is self and block.queue_pos == pos
                and (not runs or runs.get(block.request, pos) <= pos))

    def _filter(self, i: int, budget: int) -> int:
        """Filter segment i from its front, about `budget` entries' worth (a run costs its
        request's blocks): drop the entries that count no more and replace each run by its
        blocks; those kept go before the rest of the segment (into the segment before,
        where that has room). Returns the work done."""
        segments, runs = self._segments, self._runs
        segment = segments[i]
        kept: deque[tuple[int, Block | Request]] = deque()
        work = looked = 0
        while segment and work < budget:
            pos, item = segment.popleft()
            looked += 1
            work += 1
            if type(item) is Block:
                if self._counts(pos, item):
                    kept.append((pos, item))
            elif runs.get(item) == pos:
                del runs[item]
                work += len(item.live)
                kept += self._standing(item, pos)
        self._count += len(kept) - looked
        before = segments[i - 1] if i else None
        room = before is not None and len(before) + len(kept) <= self._segment
        if room:
            before += kept
        self._filtered(i, kept, room)
        return work
