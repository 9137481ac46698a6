"""LRU that learns from its mistakes: a block evicted and wanted back soon after is kept longer."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from kvd.core.blocks import Block
from kvd.core.clock import Clock
from kvd.core.policies.lru import RecencyQueues
from kvd.core.policies.queue import RunQueue


class RegretPolicy(RecencyQueues):
    """Evicts the smallest last access + protection. A block promoted within `window_s` of its
    eviction gains a level of protection (worth `window_s` of recency each, up to `max_level`);
    a block evicted and not regretted loses one. Protection is a head start in recency, so it
    decays on its own as other blocks are read after it.

    One LRU queue per level (blocks keep their level while held): the victim is the best of the
    max_level + 1 queue fronts, so every operation is O(1) in resident blocks and exact."""

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
        # One LRU queue per level; a request read whole is one entry in each (see RunQueue).
        self._levels = [RunQueue() for _ in range(max_level + 1)]
        self._level_of: dict[Block, int] = {}

    def insert(self, block: Block) -> None:
        level = min(block.regret_level, self.max_level)
        self._levels[level].push(block)
        self._level_of[block] = level
        if self.late_inserts is not None:
            self.late_inserts.append((next(self._seq), block))

    def remove(self, block: Block) -> None:
        self._levels[self._level_of.pop(block)].discard(block)

    def touch(self, block: Block) -> None:
        self._levels[self._level_of[block]].push(block)

    def touch_many(self, blocks) -> None:
        level_of, levels = self._level_of, self._levels
        for block in blocks:
            level = level_of.get(block)  # None and pinned blocks are not held
            if level is not None:
                levels[level].push(block)

    _requeue = touch_many  # each level an LRU queue: reads recorded late go in their place

    def _requeue_requests(self, requests) -> None:
        requests = list(requests)
        for queue in self._levels:  # each request's blocks of that level stand at its run
            queue.requeue_requests(requests)

    def reorder(self, block: Block) -> None:
        pass  # learns from evictions and reads, not from intent

    def choose(self, n: int, for_tenant: str | None = None,
               protected: Collection[Block] = ()) -> list[Block] | None:
        if protected:
            return self.choose_around(n, for_tenant, protected)
        if n > len(self._level_of):
            return None
        window = self.window_s
        # Each level's n oldest, its runs met on the way replaced by their blocks (see
        # RunQueue.oldest): a long request evicted a batch at a time is walked once.
        fronts = [iter(queue.oldest(n)) for queue in self._levels]
        heads: list[tuple[float, int, Block]] = []
        for level, it in enumerate(fronts):
            block = next(it, None)
            if block is not None:
                heads.append((block.last_access + level * window, level, block))
        victims: list[Block] = []
        while len(victims) < n:
            best = min(heads)
            victims.append(best[2])
            level = best[1]
            heads.remove(best)
            block = next(fronts[level], None)
            if block is not None:
                heads.append((block.last_access + level * window, level, block))
        return victims

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

    def order_problems(self) -> list[str]:
        walked = [b for queue in self._levels for b in queue]
        if len(walked) != len(self) or {id(b) for b in walked} != {id(b) for b in self._level_of}:
            return [f"regret: its levels walk {len(walked)} blocks, it holds {len(self)}"]
        return []

    def __len__(self) -> int:
        return len(self._level_of)

    def __contains__(self, block: Block) -> bool:
        return block in self._level_of
