"""The load generator's scenarios at a small, fixed size, run by `make bench` after its
measurements: figures to compare runs by, not pass/fail."""

from __future__ import annotations

from rich.console import Console

from kvd_client import eventloop


def run_scenarios(console: Console) -> dict:
    """The load generator's scenarios at a small, fixed size (figures, not pass/fail)."""
    from kvd_loadgen.data import data_dir, resolve_intent_trace
    from kvd_loadgen.replay import replay_profile
    from kvd_loadgen.request_trace import TraceRun, run_policy
    from kvd_loadgen.trace_reader import read_request_trace
    from kvd_loadgen.whale_minnows import Scenario, run_all

    from kvd_loadgen import bandwidth_hog, disagg

    out = {}
    with console.status("scenario: bandwidth-hog (1.5 s a phase)"):
        hog = eventloop.run(bandwidth_hog.run_all(bandwidth_hog.HogScenario(duration_s=1.5)))
        out["bandwidth_hog"] = {k: v for k, v in
                                bandwidth_hog.build_report(hog).json()["verdict"].items()}
    with console.status("scenario: disagg (60 requests)"):
        dis = eventloop.run(disagg.run_all(disagg.DisaggScenario(requests=60)))
        out["disagg"] = {k: v for k, v in disagg.build_report(dis).json()["verdict"].items()}
    with console.status("scenario: replay-intents balanced"):
        rows = eventloop.run(replay_profile(resolve_intent_trace("balanced"), "balanced",
                                         ("lru", "intent", "deadline"), device_pages=128,
                                         host_pages=4096, page_bytes=4096))
        out["replay_balanced_dc_misses"] = {r.policy: r.decode_critical_misses for r in rows}
    with console.status("scenario: whale-minnows (1.5 s)"):
        wm = eventloop.run(run_all(Scenario(duration_s=1.5)))
        out["whale_minnows"] = wm["verdict"]
    with console.status("scenario: request-trace (150 Mooncake requests)"):
        path = data_dir() / "request-traces" / "mooncake_conversation_trace_head4000.jsonl"
        run = TraceRun(trace=str(path), limit=150)
        trace = read_request_trace(path, limit=150)
        out["request_trace"] = {}
        for policy in ("lru", "fair"):
            r = eventloop.run(run_policy(run, policy, trace))
            out["request_trace"][policy] = {
                c["tenant"]: {k: c[k] for k in ("step_stall_p99_ms", "evictions_suffered",
                                                "tokens_per_s")} for c in r["classes"]}
    return out
