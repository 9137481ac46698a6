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
