"""Reports people can read: a markdown page and PNG plots (matplotlib) for a request-trace
run: stall CDF per tenant and policy, device occupancy over time per tenant, evictions
suffered per tenant, and the policies side by side."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files, not windows
    import matplotlib.pyplot as plt

    return plt


def write_report(directory: Path, out: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    plt = _plt()
    results = out["results"]
    tenants = sorted({c["tenant"] for r in results for c in r["classes"]})
    files = {}

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        for c in r["classes"]:
            xs = sorted(c["step_stall_ms"])
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=f"{r['policy']} / {c['tenant']}")
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlabel("per-step memory stall (ms)")
    ax.set_ylabel("fraction of engine steps")
    ax.set_title("Stall CDF per tenant and policy")
    ax.legend(fontsize=8)
    files["stall_cdf"] = "stall_cdf.png"
    fig.tight_layout()
    fig.savefig(directory / files["stall_cdf"], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(results), 1, figsize=(7, 2.6 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
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
        ax.legend(fontsize=7)
    files["occupancy"] = "occupancy.png"
    fig.tight_layout()
    fig.savefig(directory / files["occupancy"], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    policies = [r["policy"] for r in results]
    width = 0.8 / max(len(tenants), 1)
    for i, t in enumerate(tenants):
        ev = [next((c["evictions_suffered"] for c in r["classes"] if c["tenant"] == t), 0)
              for r in results]
        p99 = [next((c["step_stall_p99_ms"] for c in r["classes"] if c["tenant"] == t), 0)
               for r in results]
        xs = [j + i * width for j in range(len(results))]
        axes[0].bar(xs, ev, width, label=t)
        axes[1].bar(xs, p99, width, label=t)
    axes[2].bar(range(len(results)), [r["tokens_per_s"] for r in results])
    for ax, title in zip(axes, ("evictions suffered", "step stall p99 (ms)", "tokens/s (all)")):
        ax.set_xticks([j + width * (len(tenants) - 1) / 2 for j in range(len(results))]
                      if ax is not axes[2] else range(len(results)))
        ax.set_xticklabels(policies)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    files["policies"] = "policies.png"
    fig.tight_layout()
    fig.savefig(directory / files["policies"], dpi=110)
    plt.close(fig)

    run = out["run"]
    lines = [
        "# Request-trace run",
        "",
        f"Trace `{Path(run['trace']).name}` (first {run['limit']} requests), time compressed "
        f"x{run['speed']:g}, tenants by `{run['tenants']}`, {run['block_tokens']} tokens per "
        f"page, {run['device_pages']} device and {run['host_pages']} host pages, engines "
        f"stepping every {run['step_ms']:g} ms, outputs cut at {run['max_output_tokens']} "
        "tokens.",
        "",
        "| policy | tenant | finished / rejected / queued | admission wait p99 ms | "
        "TTFT memory p99 ms | step stall p50 / p95 / p99 ms | evictions suffered | tokens/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for c in r["classes"]:
            lines.append(
                f"| {r['policy']} | {c['tenant']} | {c['finished']} / {c['rejected']} / "
                f"{c['queued']} | {c['admission_wait_p99_ms']:.1f} | "
                f"{c['prefill_stall_p99_ms']:.1f} | {c['step_stall_p50_ms']:.2f} / "
                f"{c['step_stall_p95_ms']:.2f} / {c['step_stall_p99_ms']:.2f} | "
                f"{c['evictions_suffered']:,} | {c['tokens_per_s']:.0f} |")
    lines += ["", "| policy | total tokens/s | Jain (memory share / fair share) | evictions | "
              "bytes moved |", "|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['policy']} | {r['tokens_per_s']:.0f} | {r['jain']:.3f} | "
                     f"{r['evictions']:,} | {r['bytes_moved'] / 2**20:,.0f} MiB |")
    lines += ["", f"![stall CDF]({files['stall_cdf']})", "",
              f"![occupancy]({files['occupancy']})", "", f"![policies]({files['policies']})",
              ""]
    path = directory / "REPORT.md"
    path.write_text("\n".join(lines))
    return path
