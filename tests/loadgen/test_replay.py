"""Intent traces replayed through a real kvd process."""

from __future__ import annotations

import uvloop

from kvd_loadgen.data import resolve_intent_trace
from kvd_loadgen.replay import REFERENCE_MISSES, replay_profile


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
