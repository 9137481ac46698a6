"""BlockQueue against a plain list model: any sequence of pushes and discards, over two
queues, leaves the same order, and compaction and stale entries never show."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvd.core.blocks import Block, Request, RequestState, TierKind
from kvd.core.policies.queue import BlockQueue


@given(st.lists(st.tuples(st.sampled_from(["push", "requeue", "discard", "first"]),
                          st.integers(0, 1), st.integers(0, 9)), max_size=300))
def test_block_queues_keep_the_order_a_list_would(ops):
    req = Request("r", "t", "p", 0, 10, RequestState.ADMITTED)
    blocks = [Block(req, i, TierKind.DEVICE, i) for i in range(10)]
    queues = [BlockQueue(), BlockQueue()]
    model: list[list[Block]] = [[], []]
    for op, q, i in ops:
        block = blocks[i]
        if op == "push":  # to the back of q, out of wherever it was
            for m in model:
                if block in m:
                    m.remove(block)
            model[q].append(block)
            queues[q].push(block)
        elif op == "requeue":  # the block and its neighbour to the back, if q holds them
            moved = [b for b in (block, blocks[(i + 1) % 10]) if b in model[q]]
            for b in moved:
                model[q].remove(b)
            model[q] += moved
            queues[q].requeue([block, None, blocks[(i + 1) % 10]])
        elif op == "discard":
            if block in model[q]:
                model[q].remove(block)
            queues[q].discard(block)
        elif model[q]:
            assert queues[q].first() is model[q][0]
        for queue, m in zip(queues, model):
            assert list(queue) == m
            assert len(queue) == len(m)
            assert [b in queue for b in blocks] == [b in m for b in blocks]


def test_a_queue_compacts_what_moving_blocks_leave_behind():
    req = Request("r", "t", "p", 0, 2, RequestState.ADMITTED)
    a, b = Block(req, 0, TierKind.DEVICE, 0), Block(req, 1, TierKind.DEVICE, 1)
    queue = BlockQueue()
    queue.push(a)
    queue.push(b)
    for _ in range(10_000):  # an LRU's touches: each leaves one stale entry
        queue.push(a)
        queue.push(b)
    assert len(queue._entries) <= 2 * len(queue) + 64
    assert list(queue) == [a, b] and queue.first() is a
