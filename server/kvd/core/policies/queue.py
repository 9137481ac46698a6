"""A queue of blocks whose bookkeeping lives on the blocks themselves.

An OrderedDict keeps an LRU order in O(1), but looking at its oldest entry walks a linked
node, the dict's index table, its entry array and the next node: at a million blocks each of
those is a cache miss, and victim selection costs twice what it costs at ten thousand. Here
the queue is a deque of blocks; a block remembers which queue holds its live entry and at
which position (block.queue, block.queue_pos), and moving it to the back appends a new entry
and leaves the old one behind, stale. Looking at the front reads the deque's first slot and
that one block. Stale entries are dropped when they reach the front, and the deque is
compacted when they outnumber the live ones, so every operation is O(1) amortized.

A block is in at most one BlockQueue at a time (pushing it into another moves it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvd.core.blocks import Block


class BlockQueue:
    """Blocks in insertion order with O(1) removal: the queue each policy class keeps."""
    __slots__ = ("_entries", "_head", "_live")

    def __init__(self) -> None:
        self._entries: deque[Block] = deque()
        self._head = 0  # the position of _entries[0]; positions only grow
        self._live = 0

    def push(self, block: Block) -> None:
        """Put block at the back (moving it there if this queue holds it already)."""
        if block.queue is not self:
            if block.queue is not None:
                block.queue.discard(block)
            self._live += 1
        block.queue = self
        block.queue_pos = self._head + len(self._entries)
        self._entries.append(block)
        if len(self._entries) > 2 * self._live + 64:
            self._compact()

    def requeue(self, blocks) -> None:
        """Move each block of `blocks` that this queue holds to the back, in order (others,
        and None, are skipped): push() for the blocks a step read, in one pass."""
        entries = self._entries
        append = entries.append
        pos = self._head + len(entries)
        for block in blocks:
            if block is not None and block.queue is self:
                block.queue_pos = pos
                pos += 1
                append(block)
        if len(entries) > 2 * self._live + 64:
            self._compact()

    def discard(self, block: Block) -> None:
        """Take block out of the queue (nothing when it is not in it)."""
        if block.queue is self:
            block.queue = None
            self._live -= 1

    def first(self) -> Block:
        """The oldest block. The queue must not be empty."""
        entries = self._entries
        while True:
            block = entries[0]
            if block.queue is self and block.queue_pos == self._head:
                return block
            entries.popleft()  # stale: the block moved back or left
            self._head += 1

    def __iter__(self) -> Iterator[Block]:
        """Oldest first. The queue must not change while this runs."""
        head = self._head
        for i, block in enumerate(self._entries):
            if block.queue is self and block.queue_pos == head + i:
                yield block

    def _compact(self) -> None:
        head = self._head
        live = [block for pos, block in enumerate(self._entries, head)
                if block.queue is self and block.queue_pos == pos]  # __iter__, inline
        for pos, block in enumerate(live, head):
            block.queue_pos = pos
        self._entries = deque(live)

    def __len__(self) -> int:
        return self._live

    def __contains__(self, block: Block) -> bool:
        return block.queue is self
