"""BlockQueue against a plain list model: any sequence of pushes and discards, over two
queues, leaves the same order, and compaction and stale entries never show."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from kvd.core.blocks import Block, Request, RequestState, TierKind
from kvd.core.policies.queue import BlockQueue, RunQueue


BLOCK_QUEUE_OPS = st.tuples(st.sampled_from(["push", "requeue", "discard", "first"]),
                            st.integers(0, 1), st.integers(0, 9))


@given(st.lists(BLOCK_QUEUE_OPS, max_size=300))
def test_block_queues_keep_the_order_a_list_would(ops):
    _block_queues_against_lists(ops, 1024, 64)


@given(st.lists(BLOCK_QUEUE_OPS, min_size=100, max_size=400), st.sampled_from([1, 2, 5]),
       st.sampled_from([0, 3]))
def test_block_queues_compacted_a_piece_at_a_time_keep_the_order_a_list_would(
        ops, segment, slack):
    """The same on queues that compact often, a few entries a segment: the order holds
    while a compaction is under way (its kept entries renumbered, the front consumed), and
    the entries stay within a bound."""
    _block_queues_against_lists(ops, segment, slack)


def _block_queues_against_lists(ops, segment: int, slack: int) -> None:
    req = Request("r", "t", "p", 0, 10, RequestState.ADMITTED)
    blocks = [Block(req, i, TierKind.DEVICE, i) for i in range(10)]
    queues = [BlockQueue(segment, slack), BlockQueue(segment, slack)]
    model: list[list[Block]] = [[], []]
    peak = [0, 0]
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
            assert queue._count == sum(map(len, queue._segments))
        # Stale entries are compacted away as a queue appends, within a bound of the most
        # blocks it held.
        peak[q] = max(peak[q], len(queues[q]))
        assert queues[q]._count <= 3 * peak[q] + slack + 2 * segment + 2


def test_a_queue_compacts_what_moving_blocks_leave_behind():
    req = Request("r", "t", "p", 0, 2, RequestState.ADMITTED)
    a, b = Block(req, 0, TierKind.DEVICE, 0), Block(req, 1, TierKind.DEVICE, 1)
    queue = BlockQueue()
    queue.push(a)
    queue.push(b)
    for _ in range(10_000):  # an LRU's touches: each leaves one stale entry
        queue.push(a)
        queue.push(b)
    assert queue._count <= 2 * len(queue) + 64
    assert list(queue) == [a, b] and queue.first() is a


RUN_QUEUE_OPS = st.tuples(st.sampled_from(["push", "requeue", "requests", "discard", "first",
                                           "oldest", "free", "grow"]),
                          st.integers(0, 2), st.integers(0, 11))


@given(st.lists(RUN_QUEUE_OPS, max_size=300))
def test_a_run_queue_keeps_the_order_a_list_would(ops):
    """RunQueue against a list: requeue_requests moves each request's live blocks the queue
    holds to the back in block order, as requeue() of them would, whatever comes after (a
    block of the request pushed, moved or taken out on its own, blocks freed and added,
    another queue taking one), through the replacing of runs at the front and compaction."""
    _run_queue_against_a_list(ops, 1024, 64)


@given(st.lists(RUN_QUEUE_OPS, min_size=100, max_size=400), st.sampled_from([1, 2, 5]),
       st.sampled_from([0, 3]))
def test_a_run_queue_compacted_a_segment_at_a_time_keeps_the_order_a_list_would(
        ops, segment, slack):
    """The same, on queues that compact often, a few entries a segment: the order holds
    while a compaction is under way, its segments filtered between the calls (and runs
    replaced, blocks taken, the front consumed), and the entries stay within a bound."""
    _run_queue_against_a_list(ops, segment, slack)


def _run_queue_against_a_list(ops, segment: int, slack: int) -> None:
    reqs = [Request(f"r{i}", "t", "p", 0, 4, RequestState.ADMITTED) for i in range(3)]
    blocks = []
    for req in reqs:
        req.live = [Block(req, i, TierKind.DEVICE, i) for i in range(4)]
        blocks += req.live
    queue, other = RunQueue(segment, slack), BlockQueue()
    model: list[Block] = []
    peak = 0
    for op, r, i in ops:
        block = blocks[i % len(blocks)]
        if op == "push":  # to the back, out of wherever it was (a freed block is gone)
            if block not in block.request.live:
                continue
            if block in model:
                model.remove(block)
            model.append(block)
            queue.push(block)
        elif op == "requeue":
            moved = [b for b in (block, blocks[(i + 5) % len(blocks)]) if b in model]
            for b in moved:
                model.remove(b)
            model += moved
            queue.requeue([block, None, blocks[(i + 5) % len(blocks)]])
        elif op == "requests":  # requests r and the next read whole, in turn
            for req in (reqs[r], reqs[(r + i) % 3]):
                moved = [b for b in req.live if b in model]
                for b in moved:
                    model.remove(b)
                model += moved
            queue.requeue_requests([reqs[r], reqs[(r + i) % 3]])
        elif op == "discard":
            if block in model:
                model.remove(block)
            if i % 2:
                queue.discard(block)
            else:  # another queue takes it
                other.push(block)
        elif op == "free":  # out of the queue and of its request's live blocks
            if block in model:
                model.remove(block)
            queue.discard(block)
            if block in block.request.live:
                block.request.live.remove(block)
        elif op == "grow":  # a new block at the end of request r, pushed
            req = reqs[r]
            new = Block(req, len(blocks), TierKind.DEVICE, len(blocks))
            blocks.append(new)
            req.live.append(new)
            model.append(new)
            queue.push(new)
        elif op == "oldest":
            assert queue.oldest(i) == model[:i]
        elif model:
            assert queue.first() is model[0]
        assert list(queue) == model
        assert len(queue) == len(model)
        assert [b in queue for b in blocks] == [b in model for b in blocks]
        assert queue._count == sum(map(len, queue._segments))
        peak = max(peak, len(queue))  # stale entries go as it appends, within a bound
        assert queue._count <= 3 * peak + slack + 2 * segment + 2


def test_a_request_read_step_after_step_costs_one_entry_a_step():
    """A long request read whole every step: one entry a step, its blocks looked at only
    when they reach the front or the queue compacts (twice as many entries as it holds
    blocks later), and kept in their order through both."""
    req = Request("long", "t", "p", 0, 4096, RequestState.ADMITTED)
    req.live = [Block(req, i, TierKind.DEVICE, i) for i in range(4096)]
    queue = RunQueue()
    for b in req.live:
        queue.push(b)
    cold = Block(Request("cold", "t", "p", 0, 1, RequestState.ADMITTED), 0, TierKind.DEVICE, 0)
    queue.push(cold)
    entries = queue._count
    for _ in range(100):
        queue.requeue_requests([req])
    assert queue._count == entries + 100  # nothing compacted, no block moved
    assert queue.first() is cold
    assert list(queue) == [cold, *req.live]
    compacted = 0
    for _ in range(2 * len(queue) + 64):  # enough entries for a compaction
        before = queue._count
        queue.requeue_requests([req])
        if queue._count < before:  # compacted: the run replaced by the blocks
            compacted += 1
            assert list(queue) == [cold, *req.live]
        assert queue.first() is cold
    assert compacted and queue._count <= 2 * len(queue) + 64
    assert list(queue) == [cold, *req.live]



def test_no_call_on_a_run_queue_walks_more_than_a_bounded_piece_of_it():
    """A compaction of the whole queue in one call held the event loop for as long as it
    took to walk every entry (half a second at half a million blocks), every tenant's call
    waiting. However many compactions the touches bring, each call looks at its own
    entries and about a segment's worth more (a run costing its request's blocks)."""
    reqs = [Request(f"r{i}", "t", "p", 0, 16, RequestState.ADMITTED) for i in range(1250)]
    blocks = []
    for req in reqs:
        req.live = [Block(req, i, TierKind.DEVICE, i) for i in range(16)]
        blocks += req.live
    looked = 0

    class Counted(RunQueue):
        """Counts the entries and the runs' blocks it looks at."""

        def _counts(self, pos, block):
            nonlocal looked
            looked += 1
            return super()._counts(pos, block)

        def _standing(self, req, pos):
            nonlocal looked
            looked += len(req.live)
            return super()._standing(req, pos)

    queue = Counted(segment=256)
    for b in blocks:
        queue.push(b)
    rng = random.Random(7)
    most = 0
    compactions = 0
    for step in range(20_000):
        looked = 0
        before = queue._count
        if step % 2:
            queue.requeue([blocks[rng.randrange(len(blocks))] for _ in range(4)])
        else:
            queue.requeue_requests([reqs[rng.randrange(len(reqs))] for _ in range(4)])
        compactions += queue._count < before
        most = max(most, looked)
    assert compactions >= 2, "the touches brought no compaction to look at"
    assert most <= 2 * 256 + 16 + 4, most
    assert len(queue) == len(list(queue)) == len(blocks)


def test_no_call_on_a_block_queue_walks_more_than_a_bounded_piece_of_it():
    """The same for a policy class's queue: blocks held and let go (out of the queue and
    back in) leave stale entries; each call looks at about a segment's worth of them."""
    req = Request("r", "t", "p", 0, 20_000, RequestState.ADMITTED)
    blocks = [Block(req, i, TierKind.DEVICE, i) for i in range(20_000)]
    looked = 0

    class Counted(BlockQueue):
        """Counts the entries its compaction looks at."""

        def _filter(self, i, budget):
            nonlocal looked
            done = super()._filter(i, budget)
            looked += done
            return done

    queue = Counted(segment=256)
    for b in blocks:
        queue.push(b)
    rng = random.Random(7)
    most = compactions = 0
    for _ in range(40_000):
        block = blocks[rng.randrange(len(blocks))]
        queue.discard(block)  # held
        looked = 0
        before = queue._count
        queue.push(block)  # let go
        compactions += queue._count < before + 1
        most = max(most, looked)
    assert compactions >= 2, "the holds brought no compaction to look at"
    assert most <= 2 * 256 + 1, most
    assert list(queue) == sorted(blocks, key=lambda b: b.queue_pos)
