"""What `kvd-loadgen bench` makes of its measurements: the ratios against the baselines, the
targets each must meet, the tables it prints and the RESULTS.md it writes."""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table

# ratio -> (comparison, bound) it must meet; victim-selection scaling ratios are added below.
TARGETS = {"admit_vs_empty_unary": (">=", 0.7), "allocate_vs_empty_unary": (">=", 0.7),
           "access_vs_empty_unary": (">=", 0.7), "step64_p50_vs_empty_pingpong": ("<=", 1.15),
           "copy_vs_numpy_copyto": (">=", 0.85)}
VICTIM_SCALING_BOUND = 2.0


def split_runs(runs: list[dict]) -> dict:
    """The rounds' kvd figures (median over rounds) under lru and intent, and the empty
    server's as the baseline."""
    def median_of(policy: str) -> dict:
        return {key: statistics.median(run[policy][key] for run in runs)
                for key in runs[0][policy]}
    k = median_of("lru")
    baseline = {
        "empty_unary_rps": statistics.median(k.pop(f"empty_unary_rps_{m}")
                                             for m in ("admit", "allocate", "access")),
        "empty_unary_server_cpu_us": k.pop("empty_unary_server_cpu_us"),
        "empty_pingpong_p50_us": k.pop("empty_pingpong_p50_us"),
        "empty_pingpong_p99_us": k.pop("empty_pingpong_p99_us")}
    k.update(step_requests=64, step_blocks_per_request=4)
    return {"kvd": k, "kvd_intent": median_of("intent"), "baseline": baseline}


def ratios_of(results: dict, runs: list[dict]) -> dict[str, float]:
    """kvd against the empty server (each round's ratio, median over rounds), copies against
    numpy.copyto, and how victim selection scales from the smallest pool to the largest."""
    def round_ratio(policy: str, key: str, base_key: str) -> float:
        return statistics.median(run[policy][key] / run[policy][base_key] for run in runs)
    c, v = results["copies"], results["victims_us"]
    ratios = {
        "admit_vs_empty_unary": round_ratio("lru", "admit_rps", "empty_unary_rps_admit"),
        "allocate_vs_empty_unary": round_ratio("lru", "allocate_rps",
                                               "empty_unary_rps_allocate"),
        "access_vs_empty_unary": round_ratio("lru", "access_rps", "empty_unary_rps_access"),
        "step64_p50_vs_empty_pingpong": round_ratio("lru", "step_p50_us",
                                                    "empty_pingpong_p50_us"),
        "step64_intent_p50_vs_empty_pingpong": round_ratio("intent", "step_p50_us",
                                                           "empty_pingpong_p50_us"),
        "copy_vs_numpy_copyto": c["kvd_copy_gbps"] / c["numpy_copyto_gbps"],
        "scattered_copy_vs_numpy_copyto": c["kvd_copy_scattered_gbps"] / c["numpy_copyto_gbps"],
    }
    sizes = sorted({int(key.split("@")[1]) for key in v})
    for name in sorted({key.split("@")[0] for key in v}):
        ratios[f"victim_{name}_{sizes[-1]}_vs_{sizes[0]}"] = (
            v[f"{name}@{sizes[-1]}"] / v[f"{name}@{sizes[0]}"])
    return ratios


def judge(ratios: dict[str, float]) -> dict[str, dict]:
    """Each target: its bound and whether this run met it."""
    targets = dict(TARGETS)
    targets.update({k: ("<=", VICTIM_SCALING_BOUND) for k in ratios if k.startswith("victim_")})
    return {k: {"op": op, "value": val,
                "met": ratios[k] >= val if op == ">=" else ratios[k] <= val}
            for k, (op, val) in targets.items()}


def print_tables(results: dict, console: Console) -> None:
    b, k, c = results["baseline"], results["kvd"], results["copies"]
    table = Table(title="kvd bench (figures from this run)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("empty unary RPC/s", f"{b['empty_unary_rps']:.0f}"),
        ("empty unary server CPU us/call", f"{b['empty_unary_server_cpu_us']:.0f}"),
        ("kvd Admit / Allocate / Access server CPU us/call",
         f"{k['admit_server_cpu_us']:.0f} / {k['allocate_server_cpu_us']:.0f} / "
         f"{k['access_server_cpu_us']:.0f}"),
        ("kvd Admit RPC/s", f"{k['admit_rps']:.0f}"),
        ("kvd Allocate RPC/s", f"{k['allocate_rps']:.0f}"),
        ("kvd Access RPC/s", f"{k['access_rps']:.0f}"),
        ("empty ping-pong p50 us", f"{b['empty_pingpong_p50_us']:.0f}"),
        (f"kvd Step ({k['step_requests']} req x {k['step_blocks_per_request']} blocks, lru) "
         "p50 us", f"{k['step_p50_us']:.0f}"),
        ("kvd Step (same, intent policy) p50 us", f"{results['kvd_intent']['step_p50_us']:.0f}"),
        ("intent updates/s on one Step stream (256 a message)",
         f"{results['intent_updates']['intent_updates_per_s']:,.0f}"),
        ("engine KV cache events applied/s (64 a batch; batches dropped / replayed)",
         f"{results['kv_events']['kv_events_per_s']:,.0f} "
         f"({results['kv_events']['kv_event_batches_dropped']} / "
         f"{results['kv_events']['kv_event_batches_replayed']})"),
        ("kvd page copies GB/s (page runs)", f"{c['kvd_copy_gbps']:.2f}"),
        ("kvd page copies GB/s (scattered pages)", f"{c['kvd_copy_scattered_gbps']:.2f}"),
        ("numpy.copyto GB/s", f"{c['numpy_copyto_gbps']:.2f}"),
    ]
    g = results.get("copies_gpu")
    if g:
        rows += [("GPU: kvd page copies GB/s, device to host (page runs / scattered)",
                  f"{g['kvd_copy_gbps']:.2f} / {g['kvd_copy_scattered_gbps']:.2f}"),
                 ("GPU: one device-to-host copy of the same bytes GB/s",
                  f"{g['numpy_copyto_gbps']:.2f}")]
    rows += [(f"victim selection us/victim: {key}", f"{val:.2f}")
             for key, val in results["victims_us"].items()]
    for label, value in rows:
        table.add_row(label, value)
    console.print(table)
    t = Table(title="ratios and targets")
    for col in ("ratio", "value", "target", "met"):
        t.add_column(col)
    for key, val in results["ratios"].items():
        tgt = results["targets"].get(key)
        if tgt is None:
            t.add_row(key, f"{val:.2f}", "(reported)", "")
        else:
            t.add_row(key, f"{val:.2f}", f"{tgt['op']} {tgt['value']}",
                      "yes" if tgt["met"] else "NO")
    console.print(t)
    if results.get("engines"):
        e = Table(title="a node's worth of engines: N Step streams, kvd and the empty server "
                        "in turns")
        for col in ("streams", "kvd steps/s", "empty steps/s", "ratio",
                    "server CPU us/step, kvd / empty", "main thread, kvd / empty",
                    "decode steps only: ratio / kvd main us"):
            e.add_column(col, justify="right")
        for row in engines_rows(results["engines"]):
            e.add_row(*row)
        console.print(e)
        if results["engines"].get("budget"):
            console.print(budget_line(results["engines"]["budget"]))
    if results.get("against_min"):
        m = Table(title="intent traces: blocks brought to the device, each policy against "
                        "Belady's MIN (pins held until read)")
        out = results["against_min"]
        policies = list(next(iter(next(iter(out.values())).values()))["policies"])
        for col in ("profile", "pages", "MIN", *policies):
            m.add_column(col, justify="left" if col == "profile" else "right")
        for profile, settings in out.items():
            for n, row in settings.items():
                m.add_row(profile, str(n), str(row["min"]),
                          *(str(row["policies"][p]) for p in policies))
        console.print(m)


def engines_rows(out: dict) -> list[tuple[str, ...]]:
    """The saturated node-of-engines runs (see bench_engines), a row per stream count."""

    def us(x):
        return "?" if x is None else f"{x:.0f}"

    def decode(r):
        if "kvd_decode_steps_per_s" not in r:
            return "?"
        ratio = r["kvd_decode_steps_per_s"] / r["empty_decode_steps_per_s"]
        return f"{ratio:.2f} / {us(r.get('kvd_decode_main_us_per_step'))}"

    return [(str(n), f"{r['kvd_steps_per_s']:,.0f}", f"{r['empty_steps_per_s']:,.0f}",
             f"{r['kvd_steps_per_s'] / r['empty_steps_per_s']:.2f}",
             f"{us(r.get('kvd_server_us_per_step'))} / {us(r.get('empty_server_us_per_step'))}",
             f"{us(r.get('kvd_main_us_per_step'))} / {us(r.get('empty_main_us_per_step'))}",
             decode(r))
            for n, r in out["saturated"].items()]


def engines_markdown(out: dict) -> list[str]:
    lines = ["## A node's worth of engines", "",
             "Each engine: 64 requests x 4 blocks read every step, one block grown and one "
             "freed, an intent update every fourth step; the empty server answers the same "
             "messages. Server CPU per step: the server process's CPU time over the steps it "
             "served; main thread: that of the thread that runs its event loop and handlers. "
             "Decode steps only: the same engines' steps that need no new block (the batch "
             "read, nothing else) on both servers in the same turns, kvd's steps/s against "
             "the empty server's, and kvd's main thread CPU a step: what the gRPC layer and "
             "the reads cost kvd, without the block grown, the block freed and the intent "
             "update.",
             "",
             "| Step streams | kvd steps/s | empty steps/s | ratio | server CPU µs/step, kvd / "
             "empty | main thread µs/step, kvd / empty | decode steps only: ratio / kvd "
             "main thread µs/step |", "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += ["| " + " | ".join(row) + " |" for row in engines_rows(out)]
    if out.get("budget"):
        lines += ["", budget_line(out["budget"])]
    return lines


def budget_line(budget: dict) -> str:
    """What a step may cost a handler for the target ratio, and what kvd's cost, in the same
    terms (see bench_engines)."""
    from kvd_loadgen.bench_engines import TARGET

    def us(x):
        return f"more than {max(u for u, _ in budget['points']):.0f}" if x is None \
            else f"about {x:.0f}"

    points = ", ".join(f"{u:.0f} µs {r:.2f}x" for u, r in budget["points"])
    return (f"The empty server whose handler spends a fixed CPU time on each step, "
            f"{budget['streams']} streams, against the empty server: {points}. "
            f"{TARGET:g}x holds "
            f"while a step costs its handler up to {us(budget['target_us'])} µs; kvd "
            f"steps as the empty server does with {us(budget['kvd_us'])} µs a step.")


def overload_markdown(out: dict) -> list[str]:
    """The overload runs as a table (see bench_overload)."""
    lines = [f"## Overload: Mooncake's trace, first {out['limit']} requests, 1,200 device pages",
             "", "| run | speed | tokens/s | Jain | step stall p50 / p99 ms, long · short | "
             "admission wait p99 s, long · short | evictions | moved |",
             "|---|---:|---:|---:|---|---|---:|---:|"]
    for part in ("overload", "calm"):
        for spec, r in out[part].items():
            if spec == "speed":
                continue
            t = r["tenants"]
            stalls = " · ".join(f"{t[x]['step_stall_p50_ms']:.1f} / "
                                f"{t[x]['step_stall_p99_ms']:.1f}" for x in sorted(t))
            waits = " · ".join(f"{t[x]['admission_wait_p99_ms'] / 1e3:.1f}" for x in sorted(t))
            lines.append(f"| {spec} | x{out[part]['speed']:g} | {r['tokens_per_s']:,.0f} | "
                         f"{r['jain']:.3f} | {stalls} | {waits} | {r['evictions']:,} | "
                         f"{r['bytes_moved'] / 2**20:,.0f} MiB |")
    return lines


def against_min_markdown(out: dict) -> list[str]:
    """Each policy's fetches beside the optimum's (see replay.against_min)."""
    policies = list(next(iter(next(iter(out.values())).values()))["policies"])
    lines = ["## Intent traces: blocks brought to the device against Belady's MIN", "",
             "Pins held until the pinned block's read; MIN places every allocated, read and "
             "prefetched block, as kvd does (in brackets: MIN not asked to honour the prefetch "
             "hints).", "",
             "| profile | device pages | MIN | " + " | ".join(policies) + " | best / MIN |",
             "|---|---:|---:|" + "---:|" * len(policies) + "---:|"]
    for profile, settings in out.items():
        for n, row in settings.items():
            best = min(row["policies"].values())
            ratio = f"{best / row['min']:.2f}x" if row["min"] else "-"
            lines.append(f"| {profile} | {n} | {row['min']} ({row['min_without_prefetches']}) "
                         "| " + " | ".join(str(row["policies"][p]) for p in policies)
                         + f" | {ratio} |")
    return lines


def soak_markdown(soak: dict) -> list[str]:
    """The soak's line: what it ran, its memory from the middle third to the last, and what
    it left behind."""
    periods = soak["periods"]
    return ["## Soak: memory over time", "",
            f"{soak['clients']} clients, {soak['duration_s']:.0f} s, policy {soak['policy']}: "
            f"{soak['calls']:,} calls, errors {soak['errors'] or 'none'}; kvd's memory, mean of "
            f"the last third of the run against the middle third's: heap "
            f"{soak['heap_growth_last_vs_middle_third'] * 100:+.1f}%, RSS (heap and arenas) "
            f"{soak['rss_growth_last_vs_middle_third'] * 100:+.1f}%; pages leaked "
            f"{soak['pages_leaked']}, requests left {soak['requests_left']}, self-check "
            f"{'sound' if soak['self_check_ok'] else 'NOT sound'}; p99 per "
            f"{periods[1]['from_s'] - periods[0]['from_s'] if len(periods) > 1 else 0:.0f} s "
            f"from {min(p['p99_ms'] for p in periods):.0f} to "
            f"{max(p['p99_ms'] for p in periods):.0f} ms."]


def results_markdown(results: dict) -> str:
    m = results["machine"]
    lines = ["# kvd benchmark results", "",
             f"Measured by `make bench` on {m['machine']}, {m['cpus']} CPUs, Python "
             f"{m['python']}, grpcio {m['grpcio']}, numpy {m['numpy']} ({m['platform']}); median "
             f"of {results.get('rounds', 1)} alternating rounds against an empty gRPC server.",
             "", "| ratio | value | target | met |", "|---|---:|---|---|"]
    for key, value in results["ratios"].items():
        target = results["targets"].get(key)
        lines.append(f"| {key} | {value:.2f} | "
                     + (f"{target['op']} {target['value']} | {'yes' if target['met'] else 'NO'} |"
                        if target else "(reported) | |"))
    b, k, c = results["baseline"], results["kvd"], results["copies"]
    lines += ["", "| figure | value |", "|---|---:|",
              f"| empty unary RPC/s | {b['empty_unary_rps']:.0f} |",
              f"| kvd Admit / Allocate / Access RPC/s | {k['admit_rps']:.0f} / "
              f"{k['allocate_rps']:.0f} / {k['access_rps']:.0f} |",
              f"| empty ping-pong p50 µs | {b['empty_pingpong_p50_us']:.0f} |",
              f"| kvd Step, 64 requests x 4 blocks, p50 µs (lru / intent) | "
              f"{k['step_p50_us']:.0f} / {results['kvd_intent']['step_p50_us']:.0f} |",
              f"| intent updates/s on one Step stream (256 a message, pipelined) | "
              f"{results['intent_updates']['intent_updates_per_s']:,.0f} |",
              f"| engine KV cache events applied/s, 64 a batch (batches dropped on the way / "
              f"recovered by replay) | {results['kv_events']['kv_events_per_s']:,.0f} "
              f"({results['kv_events']['kv_event_batches_dropped']} / "
              f"{results['kv_events']['kv_event_batches_replayed']}) |",
              f"| page copies GB/s (runs / scattered) vs numpy.copyto | "
              f"{c['kvd_copy_gbps']:.2f} / {c['kvd_copy_scattered_gbps']:.2f} vs "
              f"{c['numpy_copyto_gbps']:.2f} |"]
    g = results.get("copies_gpu")
    if g:
        lines.append(f"| GPU: page copies GB/s device to host (runs / scattered) vs one copy "
                     f"of the same bytes | {g['kvd_copy_gbps']:.2f} / "
                     f"{g['kvd_copy_scattered_gbps']:.2f} vs {g['numpy_copyto_gbps']:.2f} |")
    lines += [f"| victim selection µs: {key} | {val:.2f} |"
              for key, val in results["victims_us"].items()]
    if results.get("engines"):
        lines += ["", *engines_markdown(results["engines"])]
    if results.get("overload"):
        lines += ["", *overload_markdown(results["overload"])]
    if results.get("against_min"):
        lines += ["", *against_min_markdown(results["against_min"])]
    if results.get("soak"):
        lines += ["", *soak_markdown(results["soak"])]
    scen = results.get("scenarios")
    if scen:
        lines += ["", "## Scenarios at a small, fixed size", "",
                  f"- replay-intents balanced, decode-critical misses: "
                  f"{scen['replay_balanced_dc_misses']}",
                  f"- whale-minnows (1.5 s): {scen['whale_minnows']}",
                  f"- request-trace (150 Mooncake requests): {scen['request_trace']}"]
        for name in ("bandwidth_hog", "disagg"):
            for target, v in scen.get(name, {}).items():
                lines.append(f"- {name.replace('_', '-')}: {target}: "
                             f"{'met' if v['met'] else 'NOT met'} ({v['measured']})")
    return "\n".join(lines) + "\n"
