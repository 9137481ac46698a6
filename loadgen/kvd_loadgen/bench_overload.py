"""Overload: Mooncake's conversation trace (first 600 requests) at 16x its pace against 1,200
device pages of 512 tokens, two tenants by prompt length, engines stepping every 20 ms. Each
request's prompt is its own pages, read every step with its output (`--no-share`: the trace
engine reads only a request's own blocks, so shared prefixes would hide the read pressure).

Under reservation admission (what kvd did before it protected the working set, the baseline
`lru@reservation`) every admitted request is read each step while the admitted pages exceed
the device, and every step pages. Under working-set admission the running requests' working
sets fit the device and the rest wait in fair order. At 4x the trace is calm: working-set
admission must cost nothing there (`fair` against `fair@reservation`).

The same runs, with a report and plots:
`kvd-loadgen request-trace TRACE --speed 16 --limit 600 --no-share
 --policy lru@reservation,lru,fair`.
"""

from __future__ import annotations

from rich.console import Console

from kvd_client import eventloop

OVERLOAD_RUNS = ("lru@reservation", "lru", "fair")
CALM_RUNS = ("fair@reservation", "fair")
STALL_P99_MS = 50.0


def _figures(r: dict) -> dict:
    classes = {c["tenant"]: c for c in r["classes"]}
    return {
        "tokens_per_s": r["tokens_per_s"], "jain": r["jain"], "wall_s": r["wall_s"],
        "evictions": r["evictions"], "bytes_moved": r["bytes_moved"],
        "tenants": {t: {k: c[k] for k in ("step_stall_p50_ms", "step_stall_p99_ms",
                                          "admission_wait_p99_ms", "tokens_per_s",
                                          "finished", "rejected")}
                    for t, c in classes.items()},
    }


def run_overload(console: Console, limit: int = 600) -> dict:
    from kvd_loadgen.data import data_dir
    from kvd_loadgen.request_trace import TraceRun, run_policy
    from kvd_loadgen.trace_reader import read_request_trace

    path = data_dir() / "request-traces" / "mooncake_conversation_trace_head4000.jsonl"
    trace = read_request_trace(path, limit=limit)
    out: dict = {"limit": limit}
    for name, speed, specs in (("overload", 16.0, OVERLOAD_RUNS), ("calm", 4.0, CALM_RUNS)):
        run = TraceRun(trace=str(path), speed=speed, limit=limit, share=False)
        out[name] = {"speed": speed}
        for spec in specs:
            with console.status(f"overload bench: {spec} at x{speed:g}"):
                out[name][spec] = _figures(eventloop.run(run_policy(run, spec, trace)))
    return out


def targets(out: dict) -> dict[str, dict]:
    """The overload targets, each with its bound, what this run measured and whether it was
    met."""
    base, fair = out["overload"]["lru@reservation"], out["overload"]["fair"]
    calm_base, calm = out["calm"]["fair@reservation"], out["calm"]["fair"]
    rows = {
        "overload_fair_tokens_vs_lru_reservation": (
            ">=", 1.5, fair["tokens_per_s"] / max(base["tokens_per_s"], 1e-9)),
        "overload_fair_jain": (">=", 0.95, fair["jain"]),
        "calm_fair_tokens_vs_reservation": (
            ">=", 0.95, calm["tokens_per_s"] / max(calm_base["tokens_per_s"], 1e-9)),
    }
    for tenant, figures in sorted(fair["tenants"].items()):
        rows[f"overload_fair_{tenant}_stall_p99_ms"] = ("<=", STALL_P99_MS,
                                                        figures["step_stall_p99_ms"])
    short = "short"
    if short in fair["tenants"] and short in base["tenants"]:
        rows["overload_fair_short_p99_vs_lru_reservation_ms"] = (
            "<=", base["tenants"][short]["step_stall_p99_ms"],
            fair["tenants"][short]["step_stall_p99_ms"])
    return {k: {"op": op, "value": round(value, 2), "measured": measured,
                "met": measured >= value if op == ">=" else measured <= value}
            for k, (op, value, measured) in rows.items()}
