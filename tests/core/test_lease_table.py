"""The lease table finds a released request's lease without looking through every lease."""

from __future__ import annotations

from kvd.core.clock import FakeClock
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


async def test_a_busy_kvd_does_not_count_as_a_silent_client():
    """kvd's loop frozen for longer than the TTL (one huge call used to do it): the client's
    keep-alives wait unread meanwhile, so the lapse is kvd's, not the client's."""
    import asyncio
    import time

    from kvd.core.clock import MonotonicClock

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
        table.renew("l1", "t")  # the keep-alive that waited
        await asyncio.sleep(0.6)  # now truly silent: it lapses
        assert released == ["a"]
    finally:
        reaper.cancel()
