"""Intent traces replayed through a real kvd process."""

from __future__ import annotations

import pytest
import uvloop

from kvd_client import pb
from kvd_loadgen.data import resolve_intent_trace
from kvd_loadgen.intent_trace import IntentEvent
from kvd_loadgen.replay import (PIN_MODES, REFERENCE_MISSES, TraceTooBig, _Steps,
                                replay_profile)


def test_intent_policies_beat_the_reference_best_and_never_overflow():
    results = uvloop.run(replay_profile(
        resolve_intent_trace("balanced"), "balanced", ("lru", "intent", "deadline"),
        device_pages=128, host_pages=4096, page_bytes=4096))
    by_policy = {r.policy: r for r in results}
    best_reference = min(REFERENCE_MISSES["balanced"].values())
    for policy in ("intent", "deadline"):
        r = by_policy[policy]
        assert r.decode_critical_accesses == 76
        assert r.decode_critical_misses <= best_reference, policy
    lru = by_policy["lru"]
    assert lru.decode_critical_misses > by_policy["intent"].decode_critical_misses
    for policy in ("lru", "intent", "deadline"):
        assert by_policy[policy].peak_device_pages <= 128
        assert by_policy[policy].evictions > 1000  # the trace really is under pressure
    assert by_policy["belady-min"].decode_critical_misses <= lru.decode_critical_misses


def test_a_trace_with_frees_and_commits_replays_cleanly():
    results = uvloop.run(replay_profile(
        resolve_intent_trace("mock_vllm_small"), "mock_vllm_small", ("lru", "intent"),
        device_pages=64, host_pages=256, page_bytes=4096))
    for r in results[:2]:
        assert r.decode_critical_accesses > 0
        assert r.peak_device_pages <= 64


def test_below_the_traces_pins_intent_fetches_what_the_optimum_does():
    """At 64 device pages (the trace's 76 decode-critical pins would fill the device, so pins
    are held until their block's read) the optimum must fetch; `intent`, ordering a priority's
    blocks by the engine's target decode step, stays within 1.2x of it where LRU fetches every
    read block back."""
    results = uvloop.run(replay_profile(
        resolve_intent_trace("balanced"), "balanced", ("lru", "intent"), device_pages=64,
        host_pages=4096, page_bytes=4096, pins="until-read"))
    by_policy = {r.policy: r for r in results}
    optimum = by_policy["belady-placed"].fetches
    assert optimum > 0
    assert by_policy["intent"].fetches <= 1.2 * optimum
    assert by_policy["lru"].fetches >= 3 * optimum
    for policy in ("lru", "intent"):
        assert by_policy[policy].peak_device_pages <= 64


def test_a_trace_whose_requests_outgrow_the_device_is_refused_before_it_runs():
    with pytest.raises(TraceTooBig, match="holds 72 blocks at once, more than the 64 device"):
        uvloop.run(replay_profile(resolve_intent_trace("long_context_extreme"),
                                  "long_context_extreme", ("lru",), device_pages=64,
                                  host_pages=4096, page_bytes=4096))


def _event(kind, obj, step, **intent):
    return IntentEvent(step, step, kind, {"object_id": obj, "request_id": obj.split(":")[0],
                                          "block_id": 0, "size_bytes": 4096, **intent})


@pytest.mark.parametrize("pins", PIN_MODES)
def test_pins_held_until_read_are_let_go_in_the_message_after_the_read(pins):
    events = [_event("ALLOCATED", "r:0", 0, priority="WARM"),
              _event("MARKED_DECODE_CRITICAL", "r:0", 1, pin_requested=True),
              _event("ACCESSED", "r:0", 2, pin_requested=True, priority="DECODE_CRITICAL"),
              _event("ALLOCATED", "r:1", 3, priority="WARM")]
    messages = list(_Steps(events, "t", "", pins).messages())
    assert [len(m.accesses) for m in messages] == [0, 0, 1, 0]
    last = messages[3]
    unpins = [u for u in last.intents if u.block_index == 0]
    if pins == "trace":
        assert not unpins
    else:
        assert len(unpins) == 1 and not unpins[0].intent.pin_requested
        assert unpins[0].intent.priority == pb.PRIORITY_HOT
    with pytest.raises(ValueError, match="pins must be one of"):
        _Steps(events, "t", "", "sometimes")
