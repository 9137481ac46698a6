"""Least recently used: the baseline that cannot see what the engine knows."""

from __future__ import annotations

from kvd.core.blocks import Block
from kvd.core.policies.scored import ScoredPolicy


class LruPolicy(ScoredPolicy):
    """Exact LRU on a heap of last-read times. A read only makes a block's time larger, so
    reads cost nothing here (the entry is re-scored when it reaches the top): the access path
    pays O(1) per block and eviction O(log n) amortised."""

    name = "lru"

    def score(self, block: Block) -> float:
        return block.last_access

    def reorder(self, block: Block) -> None:
        pass  # LRU ignores intent by definition.
