"""Belady's MIN with learned next reads: a block's next read is predicted as its last read
plus the time between its last two reads. Needs no intent from the engine.

Attention reads every block of a running request each step, in order. So within a request
the block read last is needed last (for such a cyclic scan LRU is the worst order and this
the best), and across requests a slow-stepping request's pages are needed later than a fast
one's. The policy keeps each request's blocks in read order (O(1) per read) and a heap of
requests by the predicted next read of their most recently read block (one push per access,
not per block). It takes victims from the request whose next read is furthest, most recently
read first: exact within a request, request-grained across requests.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Collection
from itertools import count

from kvd.core.blocks import Block, Request
from kvd.core.clock import Clock
from kvd.core.policies.base import EvictionPolicy


class ReusePolicy(EvictionPolicy):
    """Belady's MIN with learned next reads: victims from the request whose next read is
    predicted furthest, its most recently read block first (see the module)."""
    name = "reuse"
    tracks_reuse = True

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self._blocks: dict[Request, OrderedDict[Block, None]] = {}
        self._key: dict[Request, tuple[float, int]] = {}  # request -> (next read, seq)
        self._heap: list[tuple[float, int, Request]] = []  # (-next read, seq, request)
        self._num = 0
        self._seq = count()

    def _predict(self, req: Request, block: Block) -> None:
        # A new seq even when the prediction is unchanged: among requests predicted alike, the
        # one read longest ago goes first, whatever was predicted in between (so reads
        # recorded together leave the order that recording them one by one would).
        next_read = block.last_access + block.reuse_s
        seq = next(self._seq)
        self._key[req] = (next_read, seq)
        heapq.heappush(self._heap, (-next_read, seq, req))
        if len(self._heap) > 2 * len(self._key) + 64:
            self._heap = [(-k, s, r) for r, (k, s) in self._key.items()]
            heapq.heapify(self._heap)

    def insert(self, block: Block) -> None:
        req = block.request
        blocks = self._blocks.get(req)
        if blocks is None:
            blocks = self._blocks[req] = OrderedDict()
        blocks[block] = None
        self._num += 1
        self._predict(req, block)

    def remove(self, block: Block) -> None:
        req = block.request
        blocks = self._blocks[req]
        del blocks[block]
        self._num -= 1
        if not blocks:
            del self._blocks[req]
            del self._key[req]

    def touch(self, block: Block) -> None:
        self._blocks[block.request].move_to_end(block)
        self._predict(block.request, block)

    def touch_many(self, blocks) -> None:
        last = None
        for block in blocks:
            if block is not None:
                held = self._blocks.get(block.request)
                if held is not None and block in held:
                    held.move_to_end(block)
                    last = block
        if last is not None:
            self._predict(last.request, last)

    def reorder(self, block: Block) -> None:
        pass  # learns from reads, not from intent

    def choose(self, n: int, for_tenant: str | None = None,
               protected: Collection[Block] = ()) -> list[Block] | None:
        if protected:
            return self.choose_around(n, for_tenant, protected)
        if n > self._num:
            return None
        victims: list[Block] = []
        popped = []
        while len(victims) < n:
            neg, seq, req = heapq.heappop(self._heap)
            if self._key.get(req, (None, None))[1] != seq:
                continue  # stale
            popped.append((neg, seq, req))
            for block in reversed(self._blocks[req]):  # most recently read first
                victims.append(block)
                if len(victims) == n:
                    break
        for entry in popped:  # choose() changes nothing
            heapq.heappush(self._heap, entry)
        return victims

    def __len__(self) -> int:
        return self._num

    def __contains__(self, block: Block) -> bool:
        held = self._blocks.get(block.request)
        return held is not None and block in held
