"""Intent traces: parsing with line numbers, and Belady's MIN on cases worked by hand."""

from __future__ import annotations

import json

import pytest

from kvd_loadgen.belady import belady_min
from kvd_loadgen.data import INTENT_PROFILES, resolve_intent_trace
from kvd_loadgen.intent_trace import IntentEvent, TraceError, read_intent_trace


def _event(kind, obj, priority="WARM", phase="PREFILL", step=0):
    return {"step": step, "event_type": kind, "reason": None, "latency_us": None,
            "intent": {"object_id": obj, "request_id": obj.split(":")[0], "block_id": 0,
                       "priority": priority, "phase": phase, "size_bytes": 4096}}


def test_bad_lines_name_their_line_unless_skipped(tmp_path):
    path = tmp_path / "t.intent.jsonl"
    lines = [json.dumps(_event("ALLOCATED", "r:1")), "{not json",
             json.dumps(_event("EXPLODED", "r:1")), json.dumps(_event("ACCESSED", "r:1"))]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r"t.intent.jsonl:2: "):
        read_intent_trace(path)
    events = read_intent_trace(path, skip_bad=True)
    assert [(e.line, e.event_type) for e in events] == [(1, "ALLOCATED"), (4, "ACCESSED")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_event("ACCESSED", "r:1", priority="LUKEWARM")) + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:1: unknown priority 'LUKEWARM'"):
        read_intent_trace(bad)


@pytest.mark.parametrize("profile", INTENT_PROFILES)
def test_the_shared_profiles_parse(profile):
    events = read_intent_trace(resolve_intent_trace(profile))
    assert len(events) > 2000
    assert {e.event_type for e in events} >= {"ALLOCATED", "ACCESSED", "MARKED_DECODE_CRITICAL"}


def _trace(spec):
    """'A a B b' -> ALLOCATED for capitals, ACCESSED (decode-critical) for lower case."""
    out = []
    for token in spec.split():
        kind = "ALLOCATED" if token.isupper() else "ACCESSED"
        out.append(IntentEvent(0, 0, kind, _event(kind, token.lower(), "DECODE_CRITICAL",
                                                  "DECODE")["intent"]))
    return out


def test_belady_evicts_the_block_used_furthest_ahead():
    # Capacity 2: A B C arrive; A is needed next, B never: MIN keeps A and bypasses or evicts B.
    result = belady_min(_trace("A B C a c"), capacity=2)
    assert (result.accesses, result.misses) == (2, 0)
    # Capacity 1, alternating: MIN keeps a (needed first) and lets b miss each time: 2 misses.
    result = belady_min(_trace("A B a b a b"), capacity=1)
    assert result.misses == 2
    # A cyclic scan one larger than the cache: LRU misses all 6 reads, MIN only the 2 c's.
    cyclic = belady_min(_trace("A B C a b c a b c"), capacity=2)
    assert (cyclic.accesses, cyclic.misses) == (6, 2)


def test_belady_that_must_place_every_block_cannot_bypass():
    """kvd places every allocated and accessed block: alternating a and b in one page, both
    miss every time after the first placements (the bypassing MIN lets only b miss)."""
    assert belady_min(_trace("A B a b a b"), capacity=1, must_place=True).misses == 4
    # With room for the working set, no difference.
    assert belady_min(_trace("A B a b a b"), capacity=2, must_place=True).misses == 0
    # A cyclic scan one larger than the cache: MIN still beats LRU's 6 misses.
    assert belady_min(_trace("A B C a b c a b c"), capacity=2, must_place=True).misses <= 4


def _with_prefetch(spec):
    """As _trace, and 'pX' for a PREFETCHED hint of block x."""
    out = []
    for token in spec.split():
        if token.startswith("p"):
            out.append(IntentEvent(0, 0, "PREFETCHED", _event("PREFETCHED", token[1:])["intent"]))
        else:
            out += _trace(token)
    return out


def test_belady_placing_prefetched_blocks_counts_what_it_brings_in():
    """An engine's prefetch hint is a placement kvd's intent policies honour: the optimum held
    to the same asks fetches the prefetched block when it is not resident (a fetch, not a
    miss), and nothing when it is."""
    trace = _with_prefetch("A B a pb")  # capacity 1: b went when A's read placed a
    placed = belady_min(trace, capacity=1, must_place=True, prefetches=True)
    assert (placed.misses, placed.fetches) == (1, 2)  # a read back, then b prefetched
    assert belady_min(trace, capacity=2, must_place=True, prefetches=True).fetches == 0
    # Without prefetches the hint is not a reference at all.
    assert belady_min(trace, capacity=1, must_place=True).fetches == 1
    # A hint for a block never allocated (or freed) is skipped, as the replay skips it.
    assert belady_min(_with_prefetch("A a pz"), capacity=1, must_place=True,
                      prefetches=True).fetches == 0
