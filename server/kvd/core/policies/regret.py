"""LRU that learns from its mistakes: a block evicted and wanted back soon after is kept longer."""

from __future__ import annotations

from collections import OrderedDict

from kvd.core.blocks import Block
from kvd.core.clock import Clock
from kvd.core.policies.scored import ScoredPolicy


class RegretPolicy(ScoredPolicy):
    """Score = last access + protection. A block promoted within `window_s` of its eviction
    gains a level of protection (worth `window_s` of recency each, up to `max_level`); a block
    evicted and not regretted loses one. Protection is a head start in recency, so it decays
    on its own as other blocks are touched after it."""

    name = "regret"

    def __init__(
        self,
        clock: Clock,
        window_s: float = 0.5,
        max_level: int = 4,
        memory: int = 65536,
    ) -> None:
        super().__init__(clock)
        self.window_s = window_s
        self.max_level = max_level
        self._memory = memory
        self._evicted_at: OrderedDict[Block, float] = OrderedDict()
        self.num_regrets = 0

    def score(self, block: Block) -> tuple:
        return (block.last_access + block.regret_level * self.window_s,)

    def on_evicted(self, block: Block) -> None:
        self._evicted_at[block] = self.clock.now()
        self._evicted_at.move_to_end(block)
        if len(self._evicted_at) > self._memory:
            self._evicted_at.popitem(last=False)

    def on_promoted(self, block: Block) -> None:
        evicted_at = self._evicted_at.pop(block, None)
        if evicted_at is None:
            return
        if self.clock.now() - evicted_at <= self.window_s:
            self.num_regrets += 1
            block.regret_level = min(block.regret_level + 1, self.max_level)
        else:
            block.regret_level = max(block.regret_level - 1, 0)
