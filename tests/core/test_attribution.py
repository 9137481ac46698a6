"""The attribution ledger and accounts stay bounded in bytes, not only in number."""

from __future__ import annotations

import pytest

from kvd.core.attribution import MAX_NAMED, OTHERS, Attribution, EvictionRecord


def _record(victim: str, evictor: str) -> EvictionRecord:
    return EvictionRecord(0.0, "p", victim, "t", 0, evictor, "t", "allocate", "lru")


def test_an_account_names_at_most_max_named_others_and_sums_the_rest():
    att = Attribution(ledger_size=10, finished_size=2)
    att.open("whale", "t")
    victims = [f"v{i}" for i in range(5 * MAX_NAMED)]
    for v in victims:
        att.open(v, "t")
        att.evicted(_record(v, "whale"))
        att.evicted(_record(v, "whale"))
        att.stalled(v, [_record(v, "whale")], 0.5)
    caused = att.account("whale").evictions_caused
    assert len(caused) == MAX_NAMED + 1
    assert sum(caused.values()) == 2 * len(victims)  # nothing lost, only folded
    assert caused[("t", victims[0])] == 2 and caused[OTHERS] == 2 * (len(victims) - MAX_NAMED)
    assert len(att.ledger) == 10
    # Many stalls, many causes: the same bound on the victim's side.
    att.open("minnow", "t")
    for i in range(3 * MAX_NAMED):
        att.evicted(_record("minnow", f"e{i}"))
        att.stalled("minnow", [_record("minnow", f"e{i}")], 0.25)
    minnow = att.account("minnow")
    assert len(minnow.evictions_suffered) == len(minnow.stall_s_by_cause) == MAX_NAMED + 1
    assert sum(minnow.stall_s_by_cause.values()) == pytest.approx(0.75 * MAX_NAMED)
    assert minnow.stall_s == pytest.approx(0.75 * MAX_NAMED)
