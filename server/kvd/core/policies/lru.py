"""Least recently used: the baseline that cannot see what the engine knows."""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice

from kvd.core.blocks import Block
from kvd.core.clock import Clock
from kvd.core.policies.base import EvictionPolicy


class LruPolicy(EvictionPolicy):
    """O(1) insert, remove and touch on an ordered dict; choose(n) is O(n)."""

    name = "lru"

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self._order: OrderedDict[Block, None] = OrderedDict()

    def insert(self, block: Block) -> None:
        self._order[block] = None

    def remove(self, block: Block) -> None:
        del self._order[block]

    def touch(self, block: Block) -> None:
        self._order.move_to_end(block)

    def touch_many(self, blocks) -> None:
        order = self._order
        move_to_end = order.move_to_end
        for block in blocks:
            try:
                move_to_end(block)
            except KeyError:  # None, and pinned blocks, are not held
                pass

    def reorder(self, block: Block) -> None:
        pass  # LRU ignores intent by definition.

    def choose(self, n: int, for_tenant: str | None = None) -> list[Block] | None:
        if n > len(self._order):
            return None
        return list(islice(self._order, n))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: Block) -> bool:
        return block in self._order
