"""A policy that sorts blocks into a few ordered classes (a bucketed queue, as kernels' and
caches' multi-queue designs do) instead of one heap of all blocks.

Each block has a class, a small hashable key computed from what the engine said about it
(intent rank, request priority, recompute cost in quarter-octaves, deadline in milliseconds).
Classes are evicted smallest key first; inside a class, least recently read first. Each class is
an OrderedDict (a linked list; a plain dict used as a queue slows down as deleted entries pile
up at its front), and a heap holds only the class keys, so choosing a victim is O(1) in
resident blocks: it looks at the smallest class's oldest entry. (A single heap of all blocks is
O(log n) in principle and far worse at a million blocks in practice: every pop walks twenty
levels of cache misses.)

Reads cost nothing on the access path: each entry remembers the block's last read when it was
queued, and a block found read since is sent to the back of its class when it reaches the front
(second chance, as CLOCK does). Order inside a class is therefore by when kvd noticed the read,
which equals LRU unless two blocks read since their queueing are found out of order.
"""

from __future__ import annotations

import heapq
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Hashable
from itertools import islice

from kvd.core.blocks import Block
from kvd.core.clock import Clock
from kvd.core.policies.base import EvictionPolicy


def log_bucket(value: int | float | None) -> int:
    """Orders positive magnitudes to within a quarter of an octave (about 19%): cost and slack
    matter in ratios, and bucketing them keeps the number of classes small. None and values
    <= 0 are 0."""
    if value is None or value <= 0:
        return 0
    value = int(value)
    bits = value.bit_length()
    return 4 * bits + ((value >> max(bits - 3, 0)) & 3)


class ClassedPolicy(EvictionPolicy):
    """Evicts the smallest class first, least recently read first within it. Subclasses say
    what a block's class is; it may change only when the pool calls reorder()."""

    eager_touch = False

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        # class key -> {block: its last_access when queued}, oldest first
        self._classes: dict[Hashable, OrderedDict[Block, float]] = {}
        self._keys: list = []  # heap of class keys; a key whose class is gone is stale
        self._class_of: dict[Block, Hashable] = {}

    @abstractmethod
    def klass(self, block: Block) -> Hashable:
        """Smaller is evicted first. Must not depend on time or on reads."""

    def insert(self, block: Block) -> None:
        key = self.klass(block)
        members = self._classes.get(key)
        if members is None:
            members = self._classes[key] = OrderedDict()
            heapq.heappush(self._keys, key)
            if len(self._keys) > 2 * len(self._classes) + 64:
                self._keys = list(self._classes)
                heapq.heapify(self._keys)
        members[block] = block.last_access
        self._class_of[block] = key

    def remove(self, block: Block) -> None:
        key = self._class_of.pop(block)
        members = self._classes[key]
        del members[block]
        if not members:
            del self._classes[key]  # its heap entry goes stale

    def touch(self, block: Block) -> None:
        pass  # noticed when the block reaches the front of its class

    def reorder(self, block: Block) -> None:
        if self.klass(block) != self._class_of[block]:
            self.remove(block)
            self.insert(block)

    def _front(self, members: OrderedDict[Block, float]) -> Block:
        """The class's least recently read block, sending blocks read since they were queued to
        the back (each read is paid for once, here)."""
        while True:
            block = next(iter(members))
            queued_at = members[block]
            if block.last_access == queued_at:
                return block
            members[block] = block.last_access
            members.move_to_end(block)

    @staticmethod
    def _oldest(members: OrderedDict[Block, float], n: int) -> list[Block]:
        """Up to n of the class's least recently read blocks, oldest first (as _front)."""
        out: list[Block] = []
        while len(out) < n and len(out) < len(members):
            stale = []
            for block, queued_at in islice(members.items(), len(out), None):
                if block.last_access != queued_at:
                    stale.append(block)
                    continue
                out.append(block)
                if len(out) == n:
                    break
            for block in stale:
                members[block] = block.last_access
                members.move_to_end(block)
        return out

    def choose(self, n: int, for_tenant: str | None = None) -> list[Block] | None:
        if n > len(self._class_of):
            return None
        keys, classes = self._keys, self._classes
        while keys[0] not in classes:
            heapq.heappop(keys)  # stale: that class emptied
        if n == 1:
            return [self._front(classes[keys[0]])]
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
        return len(self._class_of)

    def __contains__(self, block: Block) -> bool:
        return block in self._class_of
