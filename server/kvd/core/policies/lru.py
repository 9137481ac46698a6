"""Least recently used: the baseline that cannot see what the engine knows."""

from __future__ import annotations

from collections.abc import Collection
from itertools import chain

from kvd.core.blocks import Block
from kvd.core.clock import Clock
from kvd.core.policies.base import EvictionPolicy
from kvd.core.policies.queue import RunQueue


class RecencyQueues(EvictionPolicy):
    """A policy whose order is each block's last read or insert, in one queue (LRU) or in
    several (regret's levels): reads recorded late are put in their place among the inserts
    made meanwhile, and an engine step's allocations, frees and ended holds need not record
    the reads before them (see Reads.before_block_changes). A subclass logs its inserts in
    late_inserts (numbered from _seq) and says how blocks go to the back (_requeue)."""

    orders_late_reads = True

    def touch_requests_among_inserts(self, reads) -> None:
        # The blocks read and those inserted since the first read, moved to the back in the
        # order of their last event: each block ends where recording each read at once and
        # inserting each block at once leaves it. Inserts after the last read stay logged
        # (the next reads come after them, or end_late_inserts puts them behind).
        late, requeue = self.late_inserts, self._requeue
        placed = 0
        run: list = []
        for read in reads:
            seq = read[6]
            if placed < len(late) and late[placed][0] < seq:
                self._requeue_requests(run)
                run = []
                start = placed
                while placed < len(late) and late[placed][0] < seq:
                    placed += 1
                requeue(block for _, block in late[start:placed])
            run.append(read[0])
        self._requeue_requests(run)
        del late[:placed]

    def end_late_inserts(self) -> None:
        late, self.late_inserts = self.late_inserts, None
        if late:
            self._requeue(block for _, block in late)

    def _requeue(self, blocks) -> None:
        """Move the held blocks of `blocks` to the back of their queue, in order (others are
        skipped)."""
        raise NotImplementedError

    def _requeue_requests(self, requests) -> None:
        """_requeue() of each request's live blocks in turn."""
        self._requeue(chain.from_iterable(req.live for req in requests))

    def touch_request(self, req) -> None:
        self._requeue_requests((req,))

    def touch_requests(self, requests) -> None:
        self._requeue_requests(requests)


class LruPolicy(RecencyQueues):
    """O(1) insert, remove and touch on a RunQueue, and O(1) a whole request's read;
    choose(n) is O(n), and the blocks of a request read whole are looked at once, when they
    are among the oldest."""

    name = "lru"

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self._order = RunQueue()

    def insert(self, block: Block) -> None:
        self._order.push(block)
        if self.late_inserts is not None:
            self.late_inserts.append((next(self._seq), block))

    def _requeue(self, blocks) -> None:
        self._order.requeue(blocks)

    def _requeue_requests(self, requests) -> None:
        self._order.requeue_requests(requests)  # one entry each (see RunQueue)

    def remove(self, block: Block) -> None:
        self._order.discard(block)

    def touch(self, block: Block) -> None:
        self._order.push(block)

    def touch_many(self, blocks) -> None:
        self._order.requeue(blocks)  # pinned blocks are not held: skipped

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
        return self._order.oldest(n)

    def order_problems(self) -> list[str]:
        order = list(self._order)
        if len(order) != len(self) or len({id(b) for b in order}) != len(order):
            return [f"lru: its order walks {len(order)} blocks "
                    f"({len({id(b) for b in order})} distinct), it holds {len(self)}"]
        return []

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: Block) -> bool:
        return block in self._order
