"""The transfer scheduler on a fake clock: class order, aging, weighted shares, caps, work
conservation and pacing."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.bandwidth import LinkScheduler
from kvd.core.jobs import Job, TokenBucket, TransferClass
from kvd.core.clock import FakeClock

MiB = 1 << 20
CHUNK = 256 * 1024


def link(clock, rate=100 * MiB, burst=CHUNK, scheduling="fair", weights=None, aging_s=0.05):
    weights = weights or {}
    return LinkScheduler("test", capacity_bps=rate, burst_bytes=burst, now=clock.now(),
                         scheduling=scheduling, aging_s=aging_s, quantum_bytes=CHUNK,
                         weight_of=lambda t: weights.get(t, 1.0))


def job(clock, cls=TransferClass.ACCESS, tenant="a", chunks=1, request="r", **kw):
    return Job(cls, tenant, request, [CHUNK] * chunks, clock.now(), **kw)


def drain(sched, clock, until=math.inf, refill=None, max_chunks=1_000_000):
    """Run the link with instantaneous copies: every chunk goes when the scheduler lets it.
    refill(job) is called when a job finishes (to keep a tenant backlogged). Returns the
    (time, job) of every chunk sent."""
    sent = []
    while len(sent) < max_chunks:
        chosen, at = sched.next_chunk(clock.now())
        if chosen is None:
            if at == math.inf or at > until:
                break
            clock.advance(at - clock.now())
            continue
        sent.append((clock.now(), chosen))
        if chosen.done and refill is not None:
            refill(chosen)
    return sent


def test_classes_go_out_in_priority_order():
    clock = FakeClock()
    sched = link(clock)
    order = [TransferClass.WRITEBACK, TransferClass.PREFETCH, TransferClass.ACCESS,
             TransferClass.CRITICAL]
    for cls in order:
        sched.submit(job(clock, cls, chunks=2))
    sent = drain(sched, clock)
    assert [j.cls for _, j in sent] == [c for c in sorted(order) for _ in range(2)]


def test_fifo_ignores_classes():
    clock = FakeClock()
    sched = link(clock, scheduling="fifo")
    order = [TransferClass.WRITEBACK, TransferClass.CRITICAL, TransferClass.PREFETCH]
    for cls in order:
        sched.submit(job(clock, cls))
    assert [j.cls for _, j in drain(sched, clock)] == order


def test_aging_lets_write_back_through_a_stream_of_critical_promotions():
    clock = FakeClock()
    sched = link(clock, aging_s=0.05)
    writeback = job(clock, TransferClass.WRITEBACK, tenant="bg", chunks=3)
    sched.submit(writeback)
    sched.submit(job(clock, TransferClass.CRITICAL))

    def more(_):  # decode-critical promotions never stop arriving
        sched.submit(job(clock, TransferClass.CRITICAL))

    sent = drain(sched, clock, refill=more, max_chunks=2000)
    served = [t for t, j in sent if j is writeback]
    assert len(served) == 3, "write-back starved"
    # Three classes to climb at 50 ms each, plus one chunk time; then again, per chunk.
    gaps = [served[0] - 1000.0] + [b - a for a, b in zip(served, served[1:])]
    for gap in gaps:
        assert 3 * 0.05 - 1e-9 <= gap <= 3 * 0.05 + CHUNK / (100 * MiB) + 1e-9
    # The critical stream kept the rest of the link: aging gives a starved class a chunk
    # now and then, not the link.
    critical = sum(1 for _, j in sent[: sent.index((served[-1], writeback))]
                   if j.cls is TransferClass.CRITICAL)
    assert critical > 50 * 3


@pytest.mark.parametrize("weights", [{"a": 1, "b": 1}, {"a": 3, "b": 1}, {"a": 1, "b": 4}])
def test_backlogged_tenants_share_the_link_by_weight(weights):
    clock = FakeClock()
    sched = link(clock, weights=weights)
    for tenant in weights:  # two jobs each: a queue never runs empty (which resets DRR)
        sched.submit(job(clock, tenant=tenant, chunks=3))
        sched.submit(job(clock, tenant=tenant, chunks=3))
    sent = drain(sched, clock, until=1010.0,
                 refill=lambda j: sched.submit(job(clock, tenant=j.tenant, chunks=3)))
    moved = Counter()
    for _, j in sent:
        moved[j.tenant] += CHUNK
    total = sum(moved.values())
    for tenant, w in weights.items():
        want = w / sum(weights.values())
        assert moved[tenant] / total == pytest.approx(want, rel=0.03)
    # Work-conserving and paced: the link ran at its rate, never above it.
    assert total == pytest.approx(10 * 100 * MiB, rel=0.01)


def test_one_backlogged_tenant_gets_the_whole_link():
    clock = FakeClock()
    sched = link(clock, weights={"a": 1, "idle": 9})
    sched.submit(job(clock, tenant="a", chunks=4))
    sent = drain(sched, clock, until=1005.0,
                 refill=lambda j: sched.submit(job(clock, tenant="a", chunks=4)))
    assert len(sent) * CHUNK == pytest.approx(5 * 100 * MiB, rel=0.01)


def test_pacing_never_exceeds_rate_plus_burst_in_any_second():
    clock = FakeClock()
    burst = 4 * CHUNK
    sched = link(clock, rate=50 * MiB, burst=burst)
    for tenant in "abc":
        sched.submit(job(clock, tenant=tenant, chunks=10))
    sent = drain(sched, clock, until=1008.0,
                 refill=lambda j: sched.submit(job(clock, tenant=j.tenant, chunks=10)))
    times = [t for t, _ in sent]
    # Slide a one-second window over every start time.
    lo = 0
    for hi, t in enumerate(times):
        while times[lo] < t - 1.0:
            lo += 1
        assert (hi - lo + 1) * CHUNK <= 50 * MiB + burst
    assert len(sent) * CHUNK >= 8 * 50 * MiB * 0.99


def test_tenant_cap_holds_and_the_rest_goes_to_others():
    clock = FakeClock()
    sched = link(clock)
    sched.set_tenant_cap("capped", 10 * MiB, CHUNK, clock.now())
    for tenant in ("capped", "free"):
        sched.submit(job(clock, tenant=tenant, chunks=4))
    sent = drain(sched, clock, until=1010.0,
                 refill=lambda j: sched.submit(job(clock, tenant=j.tenant, chunks=4)))
    moved = Counter()
    for _, j in sent:
        moved[j.tenant] += CHUNK
    assert moved["capped"] <= 10 * 10 * MiB + CHUNK
    assert moved["capped"] >= 10 * 10 * MiB * 0.95
    assert moved["capped"] + moved["free"] == pytest.approx(10 * 100 * MiB, rel=0.01)


def test_request_cap_and_read_gate():
    clock = FakeClock()
    sched = link(clock)
    cap = TokenBucket(5 * MiB, CHUNK, clock.now())
    capped = job(clock, chunks=20, caps=(cap,))
    sched.submit(capped)
    sent = drain(sched, clock)
    assert sent[-1][0] - sent[0][0] == pytest.approx(19 * CHUNK / (5 * MiB), rel=0.01)

    gate = TokenBucket(1 * MiB, 1 * MiB, clock.now())
    gate.consume(3 * MiB, clock.now())  # read 2 MiB over budget: held for ~2 s
    start = clock.now()
    held = job(clock, gates=(gate,))
    sched.submit(held)
    other = job(clock, tenant="b")
    sched.submit(other)
    sent = drain(sched, clock)
    assert [j for _, j in sent] == [other, held]
    assert sent[1][0] - start == pytest.approx(2.0, rel=0.01)
    assert gate.level >= 0  # a gate is checked, not charged


def test_cancel_and_queue_depths():
    clock = FakeClock()
    sched = link(clock)
    a = job(clock, TransferClass.PREFETCH, chunks=3)
    b = job(clock, TransferClass.WRITEBACK, tenant="b", chunks=2)
    sched.submit(a)
    sched.submit(b)
    assert sched.queue_depths()["prefetch"] == (1, 3 * CHUNK)
    assert sched.cancel(a)
    assert not sched.cancel(a)
    assert sched.queue_depths()["prefetch"] == (0, 0)
    assert [j for _, j in drain(sched, clock)] == [b, b]
    assert len(sched) == 0 and sched.meter.bytes_total == 2 * CHUNK
    assert sched.meter.by_tenant == {"b": 2 * CHUNK}


def test_can_start_now_only_on_an_idle_link_with_credit():
    clock = FakeClock()
    sched = link(clock, burst=2 * CHUNK)
    small = job(clock, chunks=2)
    assert sched.can_start_now(small, clock.now())
    sched.take_now(small, clock.now())
    assert not sched.can_start_now(job(clock), clock.now())  # credit spent
    clock.advance(CHUNK / (100 * MiB))
    assert sched.can_start_now(job(clock), clock.now())
    sched.submit(job(clock, tenant="q"))
    assert not sched.can_start_now(job(clock), clock.now())  # someone is waiting


def test_bad_arguments():
    clock = FakeClock()
    with pytest.raises(ValueError):
        link(clock, scheduling="lottery")
    with pytest.raises(ValueError):
        TokenBucket(0, 1, 0.0)
    with pytest.raises(ValueError):
        link(clock).submit(Job(TransferClass.ACCESS, "a", "r", [], clock.now()))


def test_a_tenant_of_small_weight_alone_gets_its_chunks_without_going_round_for_them():
    # A tenant's turn adds quantum x weight to its deficit: one of weight 1e-6 alone went
    # round a million times a chunk, on kvd's loop (seconds a chunk; every caller waited).
    clock = FakeClock()
    asked = Counter()
    sched = LinkScheduler("test", capacity_bps=100 * MiB, burst_bytes=8 * CHUNK,
                          now=clock.now(), quantum_bytes=CHUNK,
                          weight_of=lambda t: asked.update([t]) or {"a": 1e-6, "b": 1e-3}[t])
    sched.submit(job(clock, tenant="a", chunks=3))
    sched.submit(job(clock, tenant="b", chunks=3, request="r2"))
    sent = drain(sched, clock)
    assert len(sent) == 6
    # b's weight is 1000 times a's: its chunks go first, and then a's.
    assert [j.tenant for _, j in sent] == ["b"] * 3 + ["a"] * 3
    assert asked.total() <= 10 * len(sent), asked  # a few asks a chunk, not 1/weight


def _reference_drr(self, cls, now, commit):
    """FairQueues._drr going round one turn at a time, as DRR is written (and as kvd did):
    the oracle the skipped rounds must agree with."""
    queues = self._queues[cls]
    deficit = self._deficit[cls]
    eligible = [t for t, q in queues.items() if self.blocked_until(q[0], now) <= now]
    if not eligible or not commit:
        return (queues[eligible[0]][0], now) if eligible else (None, math.inf)
    while True:
        tenant = next(iter(queues))
        if tenant in eligible:
            job_ = queues[tenant][0]
            if self._turn[cls] != tenant:
                self._turn[cls] = tenant
                deficit[tenant] += self.quantum * self._weight_of(tenant)
            if deficit[tenant] >= job_.chunk_bytes:
                return job_, now
        self._turn[cls] = None
        queues.move_to_end(tenant)


@settings(max_examples=300, deadline=None)
@given(weights=st.lists(st.integers(-8, 8), min_size=1, max_size=4),
       jobs=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(1, 3 * CHUNK),
                                                            min_size=1, max_size=4)),
                     min_size=1, max_size=12))
def test_skipping_rounds_nobody_sends_in_keeps_drr_s_order(weights, jobs):
    # Weights are powers of two and chunks whole bytes, so every deficit is exact either
    # way, and the two must send the same chunks in the same order.
    orders = []
    for drr in (None, _reference_drr):
        clock = FakeClock()
        sched = LinkScheduler("test", capacity_bps=1e12, burst_bytes=1e12, now=clock.now(),
                              quantum_bytes=CHUNK,
                              weight_of=lambda t: 2.0 ** weights[int(t) % len(weights)])
        if drr is not None:
            sched.queues._drr = drr.__get__(sched.queues)
        for i, (tenant, chunks) in enumerate(jobs):
            sched.submit(Job(TransferClass.ACCESS, str(tenant), f"r{i}", chunks, clock.now()))
        orders.append([(j.request_id, j.next_chunk) for _, j in drain(sched, clock)])
    assert orders[0] == orders[1]
    assert len(orders[0]) == sum(len(chunks) for _, chunks in jobs)
