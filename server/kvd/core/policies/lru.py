"""Least recently used: the baseline that cannot see what the engine knows."""

from __future__ import annotations

from collections.abc import Collection
from itertools import chain, islice

from kvd.core.blocks import Block
from kvd.core.clock import Clock
from kvd.core.policies.base import EvictionPolicy
from kvd.core.policies.queue import BlockQueue


class LruPolicy(EvictionPolicy):
    """O(1) insert, remove and touch on a BlockQueue; choose(n) is O(n)."""

    name = "lru"

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self._order = BlockQueue()

    def insert(self, block: Block) -> None:
        self._order.push(block)

    def remove(self, block: Block) -> None:
        self._order.discard(block)

    def touch(self, block: Block) -> None:
        self._order.push(block)

    def touch_many(self, blocks) -> None:
        self._order.requeue(blocks)  # pinned blocks are not held: skipped

    def touch_requests(self, requests) -> None:
        # Every block of each request in turn, in one pass (touch_many of each, chained).
        self._order.requeue(chain.from_iterable(req.live for req in requests))

    def reorder(self, block: Block) -> None:
        pass  # LRU ignores intent by definition.

    def choose(self, n: int, for_tenant: str | None = None,
               protected: Collection[Block] = ()) -> list[Block] | None:
        if protected:
            return self.choose_around(n, for_tenant, protected)
        if n > len(self._order):
            return None
        if n == 1:
            return [self._order.first()]
        return list(islice(self._order, n))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: Block) -> bool:
        return block in self._order
