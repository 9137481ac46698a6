"""A policy reduced to one comparable score per block (as Redis's evict.c does).

Blocks live in a binary heap with lazy invalidation: a change of intent pushes a new entry and
the old one is skipped when it surfaces. Reads are lazier still: a read only makes a block's
score larger (it is used later), so its entry is re-scored only when it reaches the top of the
heap, and the access path pays nothing per block. choose(n) is O(n log N) amortised; the heap
is rebuilt when stale entries outnumber live ones, which bounds memory.
"""

from __future__ import annotations

import heapq
from abc import abstractmethod
from itertools import count
from typing import Any

from kvd.core.blocks import Block
from kvd.core.clock import Clock
from kvd.core.policies.base import EvictionPolicy


class ScoredPolicy(EvictionPolicy):
    """Evicts the block with the smallest score() first. score() returns a tuple that may
    grow with block.last_access but must never shrink when a block is read.

    Heap entries are flat tuples (*score, seq, block): one object per entry, which keeps a
    million-entry heap's walks in fewer cache lines than (score, seq, block) would.
    """

    eager_touch = False

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self._heap: list[tuple] = []
        self._live: dict[Block, tuple[Any, int]] = {}
        self._seq = count()

    @abstractmethod
    def score(self, block: Block) -> tuple:
        """Smaller is evicted first. Must not depend on the current time."""

    def _push(self, block: Block) -> None:
        key = self.score(block)
        seq = next(self._seq)
        self._live[block] = (key, seq)
        heapq.heappush(self._heap, (*key, seq, block))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(*key, seq, block) for block, (key, seq) in self._live.items()]
        heapq.heapify(self._heap)

    def insert(self, block: Block) -> None:
        self._push(block)

    def remove(self, block: Block) -> None:
        del self._live[block]

    def touch(self, block: Block) -> None:
        pass  # re-scored when its entry surfaces in choose()

    def reorder(self, block: Block) -> None:
        self._rescore(block)

    def _rescore(self, block: Block) -> None:
        key = self.score(block)
        if self._live[block][0] != key:
            self._push(block)

    def choose(self, n: int, for_tenant: str | None = None) -> list[Block] | None:
        if n > len(self._live):
            return None
        live = self._live
        taken: list[tuple] = []
        while True:
            heap = self._heap  # re-read: a push below may rebuild it
            entry = heap[0]
            block, seq = entry[-1], entry[-2]
            current = live.get(block)
            if current is None or current[1] != seq:
                heapq.heappop(heap)  # stale: removed or re-scored since
                continue
            fresh = self.score(block)
            if fresh != current[0]:  # read since it was scored: it belongs further down
                heapq.heappop(heap)
                self._push(block)
                continue
            if n == 1 and not taken:
                return [block]  # the top is the victim: nothing to pop or put back
            taken.append(heapq.heappop(heap))
            if len(taken) == n:
                break
        for entry in taken:  # choose() changes nothing: the pool removes what it takes
            heapq.heappush(self._heap, entry)
        return [entry[-1] for entry in taken]

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block: Block) -> bool:
        return block in self._live
