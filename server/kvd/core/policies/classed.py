"""A policy that sorts blocks into a few ordered classes (a bucketed queue, as kernels' and
caches' multi-queue designs do) instead of one heap of all blocks.

Each block has a class, a small hashable key computed from what the engine said about it
(intent rank, request priority, recompute cost in quarter-octaves, deadline in milliseconds).
Classes are evicted smallest key first; inside a class, least recently read first. Each class is
a BlockQueue (see queue.py: looking at its oldest block touches that block only), and a heap
holds only the class keys, so choosing a victim is O(1) in resident blocks: it looks at the
smallest class's oldest entry. (A single heap of all blocks is O(log n) in principle and far
worse at a million blocks in practice: every pop walks twenty levels of cache misses.)

Reads cost nothing on the access path: a block remembers its last read when it was queued
(block.queued_access), and a block found read since is sent to the back of its class when it
reaches the front (second chance, as CLOCK does). Order inside a class is therefore by when kvd
noticed the read, which equals LRU unless two blocks read since their queueing are found out
of order.
"""

from __future__ import annotations

import bisect
import heapq
from abc import abstractmethod
from collections.abc import Collection, Hashable

from kvd.core.blocks import Block
from kvd.core.clock import Clock
from kvd.core.policies.base import EvictionPolicy
from kvd.core.policies.queue import BlockQueue


def log_bucket(value: int | float | None) -> int:
    """Orders positive magnitudes to within a quarter of an octave (about 19%): cost and slack
    matter in ratios, and bucketing them keeps the number of classes small. None and values
    <= 0 are 0."""
    if value is None or value <= 0:
        return 0
    value = int(value)
    bits = value.bit_length()
    return 4 * bits + ((value >> max(bits - 3, 0)) & 3)


class _Class(BlockQueue):
    """One class's blocks, oldest first; knows its key and its policy."""

    __slots__ = ("key", "policy")

    def __init__(self, key: Hashable, policy: ClassedPolicy) -> None:
        super().__init__()
        self.key = key
        self.policy = policy


class LastReadQueued(EvictionPolicy):
    """A policy that queues a block with the last read it has seen (block.queued_access:
    ClassedPolicy, or FairPolicy over one) and logs its inserts while reads are pending
    (late_inserts, numbered from _seq). Reads recorded late are given to the blocks queued
    after them, as if they had been recorded first (touch_requests_among_inserts)."""

    def touch_requests_among_inserts(self, reads) -> None:
        """Reads recorded late (as Reads.take gives them, in the order of their numbers): a
        block queued after its request's last read here (allocated, or back from a hold, a
        pin or a reorder) takes that read as seen, as it would have had the read been
        recorded before the block was queued; one queued before it has a read to notice, as
        it would have. Inserts before the last of these reads are done with: the reads
        recorded after these come after them."""
        late = self.late_inserts
        if not late or not reads:
            return
        last_read = {read[0]: read[6] for read in reads}
        for seq, block in late:
            read = last_read.get(block.request)
            if read is not None and read < seq and block in self:
                block.queued_access = block.last_access
        newest = max(read[6] for read in reads)
        del late[:bisect.bisect_left(late, newest, key=lambda entry: entry[0])]

    def end_late_inserts(self) -> None:
        self.late_inserts = None  # every block is in its place already


class ClassedPolicy(LastReadQueued):
    """Evicts the smallest class first, least recently read first within it. Subclasses say
    what a block's class is; it may change only when the pool calls reorder()."""

    eager_touch = False
    # A block is queued with the last read it has seen, so reads recorded after blocks were
    # queued must be told which blocks came after them (LastReadQueued): its inserts
    # are logged while reads are pending, and an engine step's allocations, frees, intent
    # updates and ended holds need not record the reads before them.
    orders_late_reads = True

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self._classes: dict[Hashable, _Class] = {}
        self._keys: list = []  # heap of class keys; a key whose class is gone is stale
        self._num = 0

    @abstractmethod
    def klass(self, block: Block) -> Hashable:
        """Smaller is evicted first. Must not depend on time or on reads."""

    def insert(self, block: Block) -> None:
        key = self.klass(block)
        members = self._classes.get(key)
        if members is None:
            members = self._classes[key] = _Class(key, self)
            heapq.heappush(self._keys, key)
            if len(self._keys) > 2 * len(self._classes) + 64:
                self._keys = list(self._classes)
                heapq.heapify(self._keys)
        block.queued_access = block.last_access
        members.push(block)
        self._num += 1
        if self.late_inserts is not None:
            self.late_inserts.append((next(self._seq), block))

    def remove(self, block: Block) -> None:
        members = block.queue
        members.discard(block)
        self._num -= 1
        if not members:
            del self._classes[members.key]  # its heap entry goes stale

    def touch(self, block: Block) -> None:
        pass  # noticed when the block reaches the front of its class

    def reorder(self, block: Block) -> None:
        if self.klass(block) != block.queue.key:
            self.remove(block)
            self.insert(block)

    @staticmethod
    def _front(members: _Class) -> Block:
        """The class's least recently read block, sending blocks read since they were queued to
        the back (each read is paid for once, here)."""
        while True:
            block = members.first()
            if block.last_access == block.queued_access:
                return block
            block.queued_access = block.last_access
            members.push(block)

    @staticmethod
    def _oldest(members: _Class, n: int) -> list[Block]:
        """Up to n of the class's least recently read blocks, oldest first (as _front)."""
        out: list[Block] = []
        while len(out) < n and len(out) < len(members):
            stale = []
            for i, block in enumerate(members):
                if i < len(out):
                    continue  # taken in an earlier pass
                if block.last_access != block.queued_access:
                    stale.append(block)
                    continue
                out.append(block)
                if len(out) == n:
                    break
            for block in stale:
                block.queued_access = block.last_access
                members.push(block)
        return out

    def choose(self, n: int, for_tenant: str | None = None,
               protected: Collection[Block] = ()) -> list[Block] | None:
        if protected:
            return self.choose_around(n, for_tenant, protected)
        if n > self._num:
            return None
        if n <= 0:
            return []
        keys, classes = self._keys, self._classes
        while (first := classes.get(keys[0])) is None:
            heapq.heappop(keys)  # stale: that class emptied
        if n == 1:
            return [self._front(first)]
        victims: list[Block] = []
        popped = []
        while len(victims) < n:
            key = heapq.heappop(keys)
            members = classes.get(key)
            if members is None or key in popped:
                continue
            popped.append(key)
            victims += self._oldest(members, n - len(victims))
        for key in popped:  # choose() changes no order: put the keys back
            heapq.heappush(keys, key)
        return victims

    def __len__(self) -> int:
        return self._num

    def __contains__(self, block: Block) -> bool:
        members = block.queue
        return type(members) is _Class and members.policy is self
