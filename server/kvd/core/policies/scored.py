"""A policy reduced to one comparable score per block (as Redis's evict.c does).

Blocks live in a binary heap with lazy invalidation: a change of score pushes a new entry and
the old one is skipped when it surfaces. choose(n) is O(n log N); the heap is rebuilt when
stale entries outnumber live ones, which keeps memory and amortised cost bounded.
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
    """Evicts the block with the smallest score() first."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self._heap: list[tuple[Any, int, Block]] = []
        self._live: dict[Block, tuple[Any, int]] = {}
        self._seq = count()

    @abstractmethod
    def score(self, block: Block) -> Any:
        """Smaller is evicted first. Must not depend on the current time."""

    def _push(self, block: Block) -> None:
        entry = (self.score(block), next(self._seq))
        self._live[block] = entry
        heapq.heappush(self._heap, (entry[0], entry[1], block))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(key, seq, block) for block, (key, seq) in self._live.items()]
        heapq.heapify(self._heap)

    def insert(self, block: Block) -> None:
        self._push(block)

    def remove(self, block: Block) -> None:
        del self._live[block]

    def touch(self, block: Block) -> None:
        self._rescore(block)

    def reorder(self, block: Block) -> None:
        self._rescore(block)

    def _rescore(self, block: Block) -> None:
        key = self.score(block)
        if self._live[block][0] != key:
            self._push(block)

    def choose(self, n: int) -> list[Block] | None:
        if n > len(self._live):
            return None
        taken: list[tuple[Any, int, Block]] = []
        heap, live = self._heap, self._live
        while len(taken) < n:
            key, seq, block = heapq.heappop(heap)
            entry = live.get(block)
            if entry is not None and entry[1] == seq:
                taken.append((key, seq, block))
        for item in taken:  # choose() changes nothing: the pool removes what it takes
            heapq.heappush(heap, item)
        return [block for _, _, block in taken]

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block: Block) -> bool:
        return block in self._live
