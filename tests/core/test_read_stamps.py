"""A read of a whole request is recorded on the request: each block's last read and reuse
distance follow from the request's two latest whole reads and the block's own stamps (see
Block.last_access), and recording such a read costs the same for one block or a million.

The reference here is the rule that recording block by block applied: each block the
request held at the read (its last read no later) reads `now` last, and the later of its
last read and the read before as the one before.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.policies import policy_names

from .conftest import PoolFactory, settle
from .test_policies import _CountedWalks

RIDS = ("a", "b", "c")


class EagerStamps:
    """Each block's (last read, reuse distance) as recording block by block left them."""

    def __init__(self) -> None:
        self.stamps: dict[int, list[float]] = {}

    def placed(self, blocks, now: float) -> None:
        for b in blocks:
            self.stamps[id(b)] = [now, 0.0]

    def read_alone(self, block, now: float) -> None:
        stamp = self.stamps[id(block)]
        stamp[1] = now - stamp[0]
        stamp[0] = now

    def record(self, reads) -> None:
        for req, now, before, *_ in reads:
            for b in req.live:
                stamp = self.stamps[id(b)]
                last = stamp[0]
                if last <= now:
                    stamp[1] = now - (last if before is None or last > before else before)
                    stamp[0] = now


def _watch(pool, model: EagerStamps) -> None:
    """Every read the pool records is recorded by the model too, at the same moment."""
    record = pool.reads.record

    def both(reads):
        reads = list(reads)
        model.record(reads)
        record(reads)

    pool.reads.record = both


_OPS = st.lists(st.one_of(
    st.tuples(st.just("advance"), st.sampled_from([0.0, 0.25, 1.0])),
    st.tuples(st.just("grow"), st.sampled_from(RIDS)),
    st.tuples(st.just("free"), st.sampled_from(RIDS)),
    st.tuples(st.just("read"), st.lists(st.sampled_from(RIDS), max_size=3)),
    st.tuples(st.just("read whole"), st.sampled_from(RIDS)),
    st.tuples(st.just("read one"), st.sampled_from(RIDS), st.integers(0, 7)),
    st.tuples(st.just("record"), st.booleans()),
    st.tuples(st.just("evict"), st.integers(1, 3)),  # whole reads then bring blocks back
), min_size=1, max_size=30)


@pytest.mark.parametrize("policy", policy_names())
@settings(max_examples=60, deadline=None)
@given(ops=_OPS)
def test_each_block_reads_the_stamps_recording_it_block_by_block_would_leave(policy, ops):
    factory = PoolFactory()
    clock = factory.clock
    pool = factory(device_pages=64, host_pages=16, policy=policy)
    pool.defer = [].append  # as the runtime does: reads pend until recorded
    model = EagerStamps()
    _watch(pool, model)
    for rid in RIDS:
        pool.admit(rid, tenant="t", prompt_tokens=16 * 16, output_tokens=0)
        plan = settle(pool, pool.allocate(rid, 2))
        model.placed(plan.allocated, clock.now())
    for op in ops:
        kind = op[0]
        if kind == "advance":
            clock.advance(op[1])
        elif kind == "grow":
            if pool.requests[op[1]].num_live_blocks < 8:
                plan = settle(pool, pool.allocate(op[1], 1))
                model.placed(plan.allocated, clock.now())
        elif kind == "free":
            req = pool.requests[op[1]]
            if req.live:
                pool.free(op[1], [req.live[-1].index])
        elif kind == "read":
            pool.read_all(list(op[1]))  # answered now, recorded later
        elif kind == "read whole":
            before = pool.counters.num_accesses
            settle(pool, pool.access(op[1], None).plan)  # some brought back, maybe
            req = pool.requests[op[1]]
            assert all(b.last_access == clock.now() for b in req.live)
            assert pool.counters.num_accesses >= before + len(req.live)
        elif kind == "read one":
            req = pool.requests[op[1]]
            if req.live:
                block = req.live[op[2] % len(req.live)]
                settle(pool, pool.access(op[1], [block.index]).plan)
                model.read_alone(block, clock.now())
        elif kind == "evict":
            if len(pool.policy) >= op[1] and pool.host.num_free >= op[1]:
                settle(pool, pool.evict(op[1]))
        elif op[1]:
            pool.record_reads()
        else:
            pool.record_some_reads()
        for rid in RIDS:
            for b in pool.requests[rid].live:
                assert [b.last_access, b.reuse_s] == model.stamps[id(b)], (rid, b.index)


@pytest.mark.parametrize("policy", policy_names())
def test_recording_a_whole_request_read_walks_none_of_its_blocks(make_pool, policy):
    """An engine's step reads every block of a long context. Recording that read stamped
    each block, a walk over all of them on the event loop every step, under every policy,
    which every other tenant's call waited behind."""
    pool = make_pool(device_pages=600, host_pages=16, policy=policy)
    pool.admit("long", tenant="t", prompt_tokens=16 * 512, output_tokens=0)
    settle(pool, pool.allocate("long", 512))
    pool.read_all(["long"])
    pool.record_reads()
    req = pool.requests["long"]
    req.live = _CountedWalks(req.live)
    for _ in range(3):  # three steps, each recorded
        make_pool.clock.advance(0.01)
        pool.read_all(["long"])
        pool.record_reads()
    assert req.live.walks == 0
    assert {b.last_access for b in req.live} == {make_pool.clock.now()}
    assert pool.counters.num_accesses == 4 * 512
