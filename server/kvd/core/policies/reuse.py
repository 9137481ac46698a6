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
from itertools import count, islice

from kvd.core.blocks import Block, Request, by_index
from kvd.core.clock import Clock
from kvd.core.policies.base import EvictionPolicy

_STALE = (None, None)  # the key of a request no longer held


class ReusePolicy(EvictionPolicy):
    """Belady's MIN with learned next reads: victims from the request whose next read is
    predicted furthest, its most recently read block first (see the module)."""
    name = "reuse"

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self._blocks: dict[Request, OrderedDict[Block, None]] = {}
        self._key: dict[Request, tuple[float, int]] = {}  # request -> (next read, seq)
        self._heap: list[tuple[float, int, Request]] = []  # (-next read, seq, request)
        # Requests predicted anew since the heap last had their keys: pushed when a choice
        # needs the heap (a request read many times meanwhile is pushed once).
        self._dirty: set[Request] = set()
        # Requests whose held blocks are in index order: the order a read of the whole
        # request leaves them in, so reading it again moves none of them.
        self._in_order: set[Request] = set()
        # Of the others, how many blocks were put at the end of their held blocks since they
        # were last in index order (at most: some may have gone since): what came before
        # those is in index order still, and a read of the whole request reorders only
        # them and the blocks before them with a higher index.
        self._appended: dict[Request, int] = {}
        self._num = 0
        self._seq = count()

    def _predict(self, req: Request, block: Block) -> None:
        # A new seq even when the prediction is unchanged: among requests predicted alike, the
        # one read longest ago goes first, whatever was predicted in between (so reads
        # recorded together leave the order that recording them one by one would).
        self._key[req] = (block.last_access + block.reuse_s, next(self._seq))
        self._dirty.add(req)

    def _heap_now(self) -> list[tuple[float, int, Request]]:
        """The heap with every request's current key (stale entries are skipped as popped)."""
        dirty, key = self._dirty, self._key
        if dirty:
            heap = self._heap
            if len(heap) + len(dirty) > 2 * len(key) + 64:
                heap[:] = [(-k, s, r) for r, (k, s) in key.items()]
                heapq.heapify(heap)
            else:
                for req in dirty:
                    k = key.get(req)
                    if k is not None:
                        heapq.heappush(heap, (-k[0], k[1], req))
            dirty.clear()
        return self._heap

    def insert(self, block: Block) -> None:
        req = block.request
        blocks = self._blocks.get(req)
        if blocks is None:
            blocks = self._blocks[req] = OrderedDict()
            self._in_order.add(req)
        elif req not in self._in_order:
            self._appended[req] += 1
        elif next(reversed(blocks)).index > block.index:
            self._in_order.discard(req)
            self._appended[req] = 1
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
            self._in_order.discard(req)
            self._appended.pop(req, None)

    def touch(self, block: Block) -> None:
        held = self._blocks[block.request]
        if next(reversed(held)) is not block:
            self._out_of_order(block.request, 1)
            held.move_to_end(block)
        self._predict(block.request, block)

    def _out_of_order(self, req: Request, appended: int) -> None:
        """`appended` blocks of req were put at the end of its held blocks out of order."""
        if req in self._in_order:
            self._in_order.discard(req)
            self._appended[req] = appended
        else:
            self._appended[req] += appended

    def touch_request(self, req: Request) -> None:
        held = self._blocks.get(req)
        if held is None:
            return
        if req not in self._in_order:
            self._reorder(req, held)
            self._in_order.add(req)
        self._predict(req, next(reversed(held)))

    def _reorder(self, req: Request, held: OrderedDict[Block, None]) -> None:
        """Put req's held blocks in index order, as moving each to the end in index order
        would: only the blocks put at the end since they were last in order move, and those
        before them with a higher index (for a long request read whole step after step, the
        few blocks brought back or grown since its last read, not all of its blocks)."""
        appended = self._appended.pop(req)
        moving: list[Block] = []
        lowest = None
        for block in reversed(held):
            if len(moving) < appended:
                moving.append(block)
                if lowest is None or block.index < lowest:
                    lowest = block.index
            elif block.index > lowest:  # in order, but past one that came after it
                moving.append(block)
            else:
                break  # in order from here back, and before every block moving
        moving.sort(key=by_index)
        for block in moving:
            held.move_to_end(block)

    def touch_many(self, blocks) -> None:
        last = None
        for block in blocks:
            if block is not None:
                held = self._blocks.get(block.request)
                if held is not None and block in held:
                    held.move_to_end(block)
                    self._out_of_order(block.request, 1)
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
        if n <= 0:
            return []
        heap = self._heap_now()
        key, held = self._key, self._blocks
        victims: list[Block] = []
        popped = []  # requests looked past, put back after
        while True:
            _, seq, req = heap[0]
            if key.get(req, _STALE)[1] != seq:
                heapq.heappop(heap)  # a stale entry: gone for good
                continue
            blocks = held[req]
            want = n - len(victims)
            if len(blocks) >= want:  # the request on top is enough: it stays there
                victims += islice(reversed(blocks), want)  # most recently read first
                break
            victims += reversed(blocks)
            popped.append(heapq.heappop(heap))
        for entry in popped:  # choose() changes nothing
            heapq.heappush(heap, entry)
        return victims

    def __len__(self) -> int:
        return self._num

    def __contains__(self, block: Block) -> bool:
        held = self._blocks.get(block.request)
        return held is not None and block in held
