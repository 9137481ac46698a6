"""The request-trace report, on the shared ScenarioReport: stall CDF per tenant and policy,
device occupancy over time per tenant, link utilisation over time, evictions suffered per
tenant, and the policies side by side."""

from __future__ import annotations

from pathlib import Path

from kvd_loadgen.scenario_report import ScenarioReport, draw_utilisation, label_bars

LINK = "default:device<->host"


def write_report(directory: Path, out: dict) -> Path:
    return build_report(out).write(directory)


def build_report(out: dict) -> ScenarioReport:
    results = out["results"]
    tenants = sorted({c["tenant"] for r in results for c in r["classes"]})
    run = out["run"]
    report = ScenarioReport(
        "request-trace", "Request-trace run",
        f"Trace `{Path(run['trace']).name}` (first {run['limit']} requests), time compressed "
        f"x{run['speed']:g}, tenants by `{run['tenants']}`, {run['block_tokens']} tokens per "
        f"page, {run['device_pages']} device and {run['host_pages']} host pages, engines "
        f"stepping every {run['step_ms']:g} ms, outputs cut at {run['max_output_tokens']} "
        "tokens.")
    report.data = out
    rows = []
    for r in results:
        for c in r["classes"]:
            rows.append([r["policy"], c["tenant"],
                         f"{c['finished']} / {c['rejected']} / {c['queued']}",
                         f"{c['admission_wait_p99_ms']:.1f}", f"{c['prefill_stall_p99_ms']:.1f}",
                         f"{c['step_stall_p50_ms']:.2f} / {c['step_stall_p95_ms']:.2f} / "
                         f"{c['step_stall_p99_ms']:.2f}", f"{c['evictions_suffered']:,}",
                         f"{c['tokens_per_s']:.0f}"])
    report.table("Per tenant and policy",
                 ["policy", "tenant", "finished / rejected / queued", "admission wait p99 ms",
                  "TTFT memory p99 ms", "step stall p50 / p95 / p99 ms", "evictions suffered",
                  "tokens/s"], rows)
    if any(c.get("prefix_blocks") for r in results for c in r["classes"]):
        report.table(
            "Shared prefix blocks per tenant and policy (hit rate: blocks found on arrival "
            "over blocks asked for; shared and saved: mean pages over the run)",
            ["policy", "tenant", "prefix hit rate", "hit / asked blocks", "pages shared",
             "pages saved by the split"],
            [[r["policy"], c["tenant"], f"{c['prefix_hit_rate']:.1%}",
              f"{c['prefix_hit_blocks']:,} / {c['prefix_blocks']:,}",
              f"{c['shared_pages_mean']:.1f}", f"{c['shared_saved_pages_mean']:.1f}"]
             for r in results for c in r["classes"]])
    report.table("Per policy",
                 ["policy", "total tokens/s", "Jain (memory share / fair share)", "evictions",
                  "bytes moved"],
                 [[r["policy"], f"{r['tokens_per_s']:.0f}", f"{r['jain']:.3f}",
                   f"{r['evictions']:,}", f"{r['bytes_moved'] / 2**20:,.0f} MiB"]
                  for r in results])
    report.figure("stall_cdf", "Per-step memory stall, CDF per tenant and policy (the share of "
                  "steps that never stalled is the height at 0, and in the legend)",
                  lambda plt: _stall_cdf(plt, results))
    report.figure("occupancy", "Device pages each tenant holds over time against its fair "
                  "share and the device's capacity, per policy",
                  lambda plt: _occupancy(plt, results, tenants, run["device_pages"]))
    if any("working_set" in x for r in results for x in r["occupancy"]):
        report.figure("working_set", "The running requests' working set (what each grows to "
                      "by its end) against the device pages admission "
                      "keeps it within, and requests waiting, per policy",
                      lambda plt: _working_set(plt, results))
    report.figure("link_utilisation", "device<->host link utilisation over time, per policy",
                  draw_utilisation({r["policy"]: r.get("links", []) for r in results},
                                   lambda _: LINK, "device<->host link utilisation"))
    report.figure("policies", "Evictions suffered, step stall p99 and throughput, per policy",
                  lambda plt: _policies(plt, results, tenants))
    return report


def _stall_cdf(plt, results):
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        for c in r["classes"]:
            xs = sorted(c["step_stall_ms"])
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                calm = sum(1 for x in xs if x == 0) / len(xs)
                # From (0, 0): the jump at 0 is the steps that never stalled, drawn inside the
                # axes (a log axis would have no 0 at all).
                line, = ax.step([0.0, *xs], [0.0, *ys], where="post",
                                label=f"{r['policy']} / {c['tenant']} ({calm:.0%} of steps "
                                      "never stalled)")
                ax.plot([0.0], [calm], marker="o", color=line.get_color())
    ax.set_xscale("symlog", linthresh=0.1)  # linear below 0.1 ms, so 0 is on the axis
    ax.set_xlim(left=-0.02)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("per-step memory stall (ms)")
    ax.set_ylabel("fraction of engine steps")
    ax.set_title("Stall CDF per tenant and policy")
    ax.legend(fontsize=8)
    return fig


def _occupancy(plt, results, tenants, capacity: int):
    fig, axes = plt.subplots(len(results), 1, figsize=(7, 2.6 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        ax.axhline(capacity, color="black", linewidth=0.8, linestyle=":",
                   label=f"device capacity ({capacity:,} pages)")
        for t in tenants:
            pts = [(s["t"], s["tenants"][t][0]) for s in r["occupancy"] if t in s["tenants"]]
            if pts:
                ax.plot(*zip(*pts), label=f"{t} (device pages)")
                share = [(s["t"], s["tenants"][t][1]) for s in r["occupancy"]
                         if t in s["tenants"]]
                ax.plot(*zip(*share), linestyle="--", linewidth=0.8,
                        label=f"{t} fair share")
        ax.set_title(f"Device occupancy per tenant: {r['policy']}")
        ax.set_xlabel("seconds")
        ax.set_ylabel("device pages")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    return fig


def _working_set(plt, results):
    fig, axes = plt.subplots(len(results), 1, figsize=(7, 2.6 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        pts = [(s["t"], s["working_set"], s["working_set_capacity"], s["queued"])
               for s in r["occupancy"] if "working_set" in s]
        if not pts:
            continue
        ts, ws, cap, queued = zip(*pts)
        ax.plot(ts, ws, label="admitted working set (pages)")
        ax.plot(ts, cap, color="black", linewidth=0.8, linestyle=":",
                label=f"device pages for working sets ({max(cap):,})")
        ax.set_ylim(bottom=0, top=max(max(ws), max(cap)) * 1.1)
        ax.set_xlabel("seconds")
        ax.set_ylabel("pages")
        other = ax.twinx()
        other.plot(ts, queued, color="tab:gray", linewidth=0.8, label="requests waiting")
        other.set_ylabel("requests waiting")
        other.set_ylim(bottom=0)
        lines = ax.get_legend_handles_labels()
        more = other.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="lower left")
        ax.set_title(f"Working set against the device: {r['policy']}")
    return fig


def _policies(plt, results, tenants):
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    policies = [r["policy"] for r in results]
    width = 0.8 / max(len(tenants), 1)
    for i, t in enumerate(tenants):
        ev = [next((c["evictions_suffered"] for c in r["classes"] if c["tenant"] == t), 0)
              for r in results]
        p99 = [next((c["step_stall_p99_ms"] for c in r["classes"] if c["tenant"] == t), 0)
               for r in results]
        xs = [j + i * width for j in range(len(results))]
        label_bars(axes[0], axes[0].bar(xs, ev, width, label=t))
        label_bars(axes[1], axes[1].bar(xs, p99, width, label=t), "{:.1f}")
    label_bars(axes[2], axes[2].bar(range(len(results)), [r["tokens_per_s"] for r in results]))
    for ax, title in zip(axes, ("evictions suffered", "step stall p99 (ms)", "tokens/s (all)")):
        ax.set_xticks([j + width * (len(tenants) - 1) / 2 for j in range(len(results))]
                      if ax is not axes[2] else range(len(results)))
        ax.set_xticklabels(policies)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    return fig
