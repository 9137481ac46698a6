"""WaitAdmission streams' wake-ups (kvd.waiters.AdmissionWaiters): a waiter is woken when
its request's position changed, and a notify finds nothing to do, without looking at every
waiter, while the positions they were told stand."""

from __future__ import annotations

from kvd.waiters import AdmissionWaiters


def test_a_waiter_wakes_when_its_position_changed_and_only_then():
    state = {"positions": {"a": 1, "b": 2}, "version": 1}
    looked = []

    def positions():
        looked.append(1)
        return state["positions"]

    waiters = AdmissionWaiters(positions, lambda: state["version"])
    a, b = waiters.event("a", 1), waiters.event("b", 2)
    waiters.notify()
    assert not a.is_set() and not b.is_set()
    state.update(positions={"b": 1}, version=2)  # a admitted: b moves up
    waiters.notify()
    assert a.is_set() and b.is_set()
    b = waiters.event("b", 1)
    state["positions"] = {"b": 7}  # (what a version that stands cannot do)
    waiters.notify()  # nothing moved since: no waiter looked at
    assert not b.is_set()
    # Positions worked out again (another version) and told to a new waiter: the next
    # notify looks at every waiter, as the others may have moved.
    state.update(positions={"b": 3}, version=3)
    b2 = waiters.event("b", 3)
    waiters.notify()
    assert b.is_set() and not b2.is_set()


def test_without_a_version_every_notify_looks_at_every_waiter():
    waiters = AdmissionWaiters(lambda: {"a": 2})
    a = waiters.event("a", 1)
    waiters.notify()
    assert a.is_set()
    a = waiters.event("a", 2)
    waiters.notify()
    waiters.notify()
    assert not a.is_set()
