"""The lease table finds a released request's lease without looking through every lease."""

from __future__ import annotations

import asyncio
import time

from kvd import leases
from kvd.core.clock import FakeClock, MonotonicClock
from kvd.leases import LeaseTable


def test_detach_forgets_the_request_in_its_own_lease_only():
    clock = FakeClock()
    table = LeaseTable(clock, ttl_s=5.0)
    table.attach("l1", "t", "a")
    table.attach("l1", "t", "b")
    table.attach("l2", "t", "c")
    table.attach("", "t", "d")  # no lease: nothing to remember
    table.detach("a")
    table.detach("d")
    assert table.leases["l1"].requests == {"b"} and table.leases["l2"].requests == {"c"}
    clock.advance(6.0)
    assert {lease.lease_id for lease in table.expired()} == {"l1", "l2"}
    for rid in ("b", "c"):  # the reaper releases what the expired leases held
        table.detach(rid)
    assert table._lease_of == {}  # nothing kept for requests that are gone


def test_a_request_from_a_peer_is_the_first_callers_or_lapses_unclaimed():
    clock = FakeClock()
    table = LeaseTable(clock, ttl_s=5.0)
    table.arrived("a", "t")
    table.arrived("b", "t")
    assert table.unclaimed
    table.adopt(["a"], "", "t")  # a call under no lease (the admin's) takes up nothing
    table.adopt(["a", "x"], "engine", "t")
    table.adopt(["a"], "other", "t")  # taken up once: the first caller's
    assert table.leases["engine"].requests == {"a"}
    clock.advance(6.0)
    table.renew("engine")
    assert [lease.requests for lease in table.expired()] == [{"b"}]  # nobody took it up
    table.detach("b")
    assert not table.unclaimed and table._lease_of == {"a": "engine"}


def test_a_request_handed_between_pools_is_its_leases_until_another_takes_it_up():
    table = LeaseTable(FakeClock(), ttl_s=5.0)
    table.attach("prefill", "t", "r")
    table.handed("r")
    table.adopt(["r"], "prefill", "t")  # its own lease naming it changes nothing
    assert table._lease_of == {"r": "prefill"} and table.unclaimed
    table.adopt(["r"], "decode", "t")
    table.adopt(["r"], "other", "t")
    assert table._lease_of == {"r": "decode"} and not table.unclaimed
    assert "prefill" not in table.leases  # holding nothing, it is forgotten


async def test_a_busy_kvd_does_not_count_as_a_silent_client():
    """kvd's loop frozen for longer than the TTL (one huge call used to do it): the client's
    keep-alives wait unread meanwhile, so the lapse is kvd's, not the client's."""
    released = []

    async def release(request_id):
        released.append(request_id)

    table = LeaseTable(MonotonicClock(), ttl_s=0.3)
    table.attach("l1", "t", "a")
    reaper = asyncio.ensure_future(table.reap_forever(release, 0.05))
    try:
        await asyncio.sleep(0.1)
        time.sleep(1.0)  # the loop is busy: nothing runs, no call is read
        await asyncio.sleep(0.15)  # the reaper ticks, late, before the keep-alive is read
        assert released == []
        table.renew("l1")  # the keep-alive that waited
        await asyncio.sleep(0.6)  # now truly silent: it lapses
        assert released == ["a"]
    finally:
        reaper.cancel()


def test_a_lease_that_holds_nothing_is_not_kept():
    """Every call renews its caller's lease, and a client may name a new one on each call:
    kept, 100,000 of them (30 s of a client's calls) took 51 MiB, and each second's look for
    silent leases walked them all, holding kvd's loop for tens of milliseconds. A lease
    matters only while it holds requests or an open stream, and only then is it kept."""
    clock = FakeClock()
    table = LeaseTable(clock, ttl_s=5.0)
    for i in range(1000):
        table.renew(f"t/{i}")
    assert table.leases == {}
    table.stream_opened("t/s", "t")  # a stream opened and closed, nothing admitted
    table.stream_closed("t/s")
    assert table.leases == {}
    # A stream opened, a request admitted under its lease meanwhile, the stream closed: the
    # lease holds the request, renewed by calls and silent from the stream's end.
    table.stream_opened("t/e", "t")
    table.attach("t/e", "t", "a")
    clock.advance(10.0)
    assert table.expired() == []  # the open stream holds it
    table.stream_closed("t/e")
    clock.advance(4.0)
    table.renew("t/e")
    clock.advance(4.0)
    assert table.expired() == []
    table.detach("a")  # released by its owner: nothing left to hold
    assert table.leases == {}
    # A request's lease outlives its stream's holding nothing else, and lapses when silent.
    table.attach("t/f", "t", "b")
    table.stream_opened("t/f", "t")
    table.stream_closed("t/f")
    clock.advance(6.0)
    assert [lease.lease_id for lease in table.expired()] == ["t/f"]




class _Transfers:
    """A node's release for the reaper: a request named in `in_transit` waits for its
    blocks' copies (until `done` is set) before it is released."""

    def __init__(self, *in_transit: str) -> None:
        self.in_transit = set(in_transit)
        self.waiting, self.done = asyncio.Event(), asyncio.Event()
        self.released: list[str] = []

    async def release(self, request_id: str) -> None:
        if request_id in self.in_transit:
            self.waiting.set()
            await self.done.wait()
        self.released.append(request_id)


def _reaping(transfers: _Transfers, ttl_s: float = 0.2):
    table = LeaseTable(MonotonicClock(), ttl_s=ttl_s)
    return table, asyncio.ensure_future(table.reap_forever(transfers.release, 0.05))


async def _until(value, within_s: float = 5.0):
    """value() once it is truthy, looking every 20 ms for at most within_s; else its last."""
    until = time.monotonic() + within_s
    while not value() and time.monotonic() < until:
        await asyncio.sleep(0.02)
    return value()


async def test_a_release_that_waits_for_a_transfer_is_not_given_up(monkeypatch):
    """A lapsed lease's request whose blocks are in transit (a promotion over a slow link:
    seconds) is released once the transfer ends, however long that takes, past the time
    after which kvd says it waits (RELEASE_SLOW_S). Given up after a bound, it stayed
    admitted for ever, its lease gone and its pages held."""
    monkeypatch.setattr(leases, "RELEASE_SLOW_S", 0.1)
    transfers = _Transfers("in-transit")
    table, reaper = _reaping(transfers)
    table.attach("l1", "t", "in-transit")
    try:
        await asyncio.wait_for(transfers.waiting.wait(), 10)  # l1 lapsed; its release waits
        await asyncio.sleep(0.5)  # past RELEASE_SLOW_S, and past any bound of old
        assert transfers.released == []
        transfers.done.set()
        assert await _until(lambda: transfers.released) == ["in-transit"]
        assert table.num_requests_released == 1
    finally:
        reaper.cancel()


async def test_a_release_that_waits_holds_up_no_other_lease():
    """While one lapsed lease's release waits for its transfer, the other leases lapse on
    time. The reaper used to wait on the one release (up to 5 s) before it looked again,
    and its late tick then credited every lease with the time it had waited."""
    transfers = _Transfers("in-transit")
    table, reaper = _reaping(transfers)
    table.attach("l1", "t", "in-transit")
    try:
        await asyncio.wait_for(transfers.waiting.wait(), 10)  # l1 lapsed; its release waits
        table.attach("l2", "t", "idle")
        # l2 lapses 0.2 s after it was last heard from: well within 3 s, even on a machine
        # that stalls kvd for a second or two (the stall is credited to every lease).
        assert await _until(lambda: transfers.released, within_s=3.0) == ["idle"]
    finally:
        transfers.done.set()
        reaper.cancel()


async def test_a_stopped_reaper_stops_the_releases_it_started():
    """kvd stopping cancels the reaper: the releases it left waiting end with it."""
    transfers = _Transfers("in-transit")
    table, reaper = _reaping(transfers)
    table.attach("l1", "t", "in-transit")
    await asyncio.wait_for(transfers.waiting.wait(), 5)
    reaper.cancel()
    await asyncio.gather(reaper, return_exceptions=True)
    await asyncio.sleep(0)
    waiting = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert waiting == []
