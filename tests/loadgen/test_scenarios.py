"""The bandwidth-hog and disagg scenarios at a small size against real daemons, and the
report every scenario shares."""

from __future__ import annotations

import json
import os
import re

import pytest

from kvd_loadgen import bandwidth_hog, disagg
from kvd_loadgen.scenario_report import (
    ScenarioReport,
    draw_utilisation,
    finish,
    utilisation_series,
)

PNG = b"\x89PNG\r\n\x1a\n"


def assert_report(directory, title):
    text = (directory / "REPORT.md").read_text()
    assert text.startswith(f"# {title}")
    for name in [line.split("(")[1].rstrip(")") for line in text.splitlines()
                 if line.startswith("![")]:
        assert (directory / name).read_bytes().startswith(PNG)
    return text


async def test_bandwidth_hog_small(tmp_path):
    s = bandwidth_hog.HogScenario(duration_s=0.8, hog_streams=4, hog_weight=3.0)
    out = await bandwidth_hog.run_all(s)
    ph = out["phases"]
    assert set(ph) == set(bandwidth_hog.PHASES)
    assert ph["solo"]["sensitive_promoting_steps"] > 0
    assert ph["solo"]["bytes_per_s"]["hog"] == 0  # the hog held memory but moved nothing
    bl = ph["backlogged fair"]
    total = sum(bl["bytes_per_s"].values())
    assert bl["bytes_per_s"]["hog"] / total == pytest.approx(0.75, abs=0.08)
    # Fair scheduling keeps a backlogged link as busy as FIFO does, in the same run: the
    # link's figure alone is the machine's speed too (with two test workers per core this
    # 0.8 s run once kept it 59% busy). The 90% target is the benchmark's. A phase this
    # short is one stall of the daemon's or the load generator's process away from an idle
    # link (on a 2-core CI runner fair once measured 0.69 beside fifo's 0.995), so a fair
    # phase that falls short runs again, twice at most: a strategy that idles the link
    # falls short every time. The scheduler's own work conservation is exact, on a fake
    # clock, in tests/core/test_bandwidth.py.
    fifo = ph["backlogged fifo"]["utilisation"]
    tries = [bl["utilisation"]]
    while tries[-1] < 0.75 * fifo and len(tries) < 3:
        tries.append((await bandwidth_hog.run_phase(s, "backlogged fair"))["utilisation"])
    assert max(tries) > 0.3
    assert max(tries) >= 0.75 * fifo, (tries, fifo)
    report = bandwidth_hog.build_report(out)
    assert set(report.verdict) == {
        "sensitive p99 wait with budgets <= 1.5x solo",
        "link utilisation >= 90% of the cap while both are backlogged",
        "each tenant's share within 10% of its weight"}
    report.write(tmp_path / "hog")
    text = assert_report(tmp_path / "hog", "Bandwidth hog")
    assert "| backlogged fair | hog | 3 |" in text


@pytest.mark.parametrize("decode_pages", [disagg.min_decode_pages(), 100])
async def test_the_handoff_burst_runs_on_any_decode_pool_the_cli_takes(decode_pages):
    """Its four requests of 81 decode pages asked for more than a small decode pool holds
    (an AssertionError at 48 pages: "it can never be resident"): it hands off what the
    pool holds, as many as it admits at once."""
    out = await disagg.handoff_burst(disagg.DisaggScenario(decode_pages=decode_pages))
    assert 1 <= out["requests"] <= 4 and out["mib_s"] > 0
    assert out["bytes"] == out["requests"] * min(80, decode_pages - 2) * 16 * 1024


async def test_disagg_small(tmp_path):
    s = disagg.DisaggScenario(requests=30, rate=80.0, output_min=256, output_max=512)
    out = await disagg.run_all(s)
    res, unres = out["modes"]["reserved"], out["modes"]["unreserved"]
    assert res["prefills_wasted"] == 0
    assert res["finished"] + res["rejected"] == 30 and not res["errors"]
    assert unres["prefills"] == 30
    assert unres["finished"] + unres["prefills_wasted"] == 30
    assert res["link_bytes"] == res["handoff_bytes"] > 0
    assert out["burst"]["mib_s"] > 0
    report = disagg.build_report(out)
    report.write(tmp_path / "disagg")
    assert_report(tmp_path / "disagg", "Disaggregated prefill and decode")
    # The outcomes chart in words, every bar labelled with its value (those of 0 too).
    import matplotlib.pyplot as plt

    (outcomes,) = [f for f in report.figures if f.name == "outcomes"]
    fig = outcomes.draw(plt)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "finished", "waited for admission", "rejected", "prefills wasted"]
    assert len(ax.texts) == 8 and "0" in [t.get_text() for t in ax.texts]  # reserved: 0 wasted
    assert ax.get_ylabel() == "requests"
    plt.close(fig)


def test_scenario_report_writes_what_it_prints(tmp_path, capsys):
    from rich.console import Console

    r = ScenarioReport("x", "A title", "Some words.")
    r.table("T", ["a", "b"], [[1, "two"]], ["a note"])
    r.target("a target", False, "3 vs 2")
    r.figure("f", "a plot", lambda plt: plt.subplots()[0])
    r.data = {"k": 1}
    finish(r, Console(width=100), tmp_path / "out.json", tmp_path / "rep")
    printed = capsys.readouterr().out
    assert "NOT met" in printed and "two" in printed and "a note" in printed
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["k"] == 1 and data["verdict"]["a target"] == {"met": False,
                                                              "measured": "3 vs 2"}
    text = assert_report(tmp_path / "rep", "A title")
    assert "| a target | **no** | 3 vs 2 |" in text and "| 1 | two |" in text


def test_a_utilisation_plot_of_runs_that_moved_nothing_says_so(tmp_path):
    """A run whose link carried nothing (a small trace that fit the device) gets a plot that
    says so, not matplotlib's warning about a legend with nothing in it."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    samples = [{"t": 0.0, "links": {}}, {"t": 1.0, "links": {}}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = draw_utilisation({"fair": samples}, lambda name: "l", "link")(pyplot)
    assert [t.get_text() for t in fig.axes[0].texts] == ["nothing crossed the link"]
    pyplot.close(fig)


def test_utilisation_series():
    samples = [{"t": t, "links": {"l": {"capacity": 100.0, "bytes": b}}}
               for t, b in ((0.0, 0), (1.0, 50), (2.0, 150))]
    assert utilisation_series(samples, "l") == ([1.0, 2.0], [0.5, 1.0])


@pytest.mark.skipif(__import__("shutil").which("etcd") is None,
                    reason="no etcd: `make test` installs Debian's etcd-server where it can")
async def test_cluster_small(tmp_path):
    """Three kvds and etcd, shortened: the quota holds, handoffs go both ways, the killed
    node leaves, etcd's absence is survived and the nodes converge."""
    from kvd_loadgen import cluster

    # c's lease lapses (2 s) before etcd goes away.
    s = cluster.ClusterScenario(duration_s=13.0, kill_at_s=3.0, etcd_stop_at_s=7.0,
                                etcd_start_at_s=9.0)
    out = await cluster.run(s)
    a = cluster.analyse(out)
    print(a)
    assert set(out["events"]) == {"c killed", "etcd stopped", "etcd started"}
    assert a["chat_max"] > s.chat_limit // 2 and a["chat_over"] <= 96
    assert a["left_after_s"] is not None and a["left_after_s"] <= s.lease_ttl_s + 1.5
    assert a["converged_after_s"] is not None and a["converged_after_s"] <= 5.0
    assert out["handoffs"]["b"]["completed"] > 0 and out["handoffs"]["c"]["completed"] > 0
    assert out["handoffs"]["b"]["failed"] == 0  # b lives throughout
    report = cluster.build_report(out)
    report.write(tmp_path / "cluster")
    assert_report(tmp_path / "cluster", "Three nodes and etcd")


async def test_the_engines_bench_drives_real_steps_on_every_stream():
    """The node-of-engines bench, shortened: every stream's steps succeed (reads, a block
    grown and one freed per step, intent updates), kvd stays sound, the figures are there."""
    from kvd_loadgen.bench_engines import bench_engines, targets
    from kvd_loadgen.bench_report import engines_markdown

    out = await bench_engines(ns=(1, 2), seconds=0.3, rounds=1, paced_engines=2, rate=20.0,
                              paced_seconds=0.5, work_us=(50, 2000))
    for n in (1, 2):
        assert out["saturated"][n]["kvd_steps_per_s"] > 0
        assert out["saturated"][n]["empty_steps_per_s"] > 0
        for server in ("kvd", "empty"):
            # CPU time per step, in us: no more than the machine's cores could give.
            us = out["saturated"][n][f"{server}_server_us_per_step"]
            busy = us * out["saturated"][n][f"{server}_steps_per_s"] / 1e6
            assert us > 0 and busy <= (os.cpu_count() or 1) + 0.5, (server, us, busy)
            # Its main thread's share: some of it, and no more than one core.
            main = out["saturated"][n][f"{server}_main_us_per_step"]
            main_busy = main * out["saturated"][n][f"{server}_steps_per_s"] / 1e6
            assert 0 < main <= us and main_busy <= 1.2, (server, main, us, main_busy)
        # The decode steps alone ran on both servers, and cost kvd's main thread less a
        # step than the steps that also grow, free and update a block.
        r = out["saturated"][n]
        assert r["kvd_decode_steps_per_s"] > 0 and r["empty_decode_steps_per_s"] > 0
        assert 0 < r["kvd_decode_main_us_per_step"] < r["kvd_main_us_per_step"], r
    budget = out["budget"]
    assert budget["streams"] == 2 and [u for u, _ in budget["points"]] == [50, 2000]
    # 2 ms of CPU a step: at most 500 steps/s from the server's one thread, on two streams.
    assert budget["points"][1][1] * out["saturated"][2]["empty_steps_per_s"] <= 600
    rows = engines_markdown(out)
    assert [line.split(" | ")[0] for line in rows[-4:-2]] == ["| 1", "| 2"]
    assert rows[-1].startswith("The empty server whose handler spends")
    for paced in ("paced", "paced_spread"):
        assert out[paced]["kvd_p99_ms"] > 0 and out[paced]["empty_p99_ms"] > 0
    assert set(targets(out)) == {"engines1_steps_vs_empty", "engines2_steps_vs_empty",
                                 "engines1_decode_steps_vs_empty",
                                 "engines2_decode_steps_vs_empty",
                                 "engines2_paced_p99_added_ms",
                                 "engines2_paced_spread_p99_added_ms"}
    for reported in ("engines2_paced_spread_p99_added_ms", "engines1_decode_steps_vs_empty"):
        assert "op" not in targets(out)[reported]  # reported only
    assert re.search(r" \| \d+\.\d\d / \d+ \|$", rows[-4])  # the decode-only column


async def test_the_step_history_bench_steps_a_real_engine_and_judges_late_against_early():
    """The long-run bench, shortened: one engine's steps (a block grown and one freed per
    step) succeed on a real kvd under each policy, kvd stays sound, and the target is the
    late window's main-thread CPU a step over the early one's."""
    from kvd_loadgen.bench_history import TARGET, bench_step_history, targets

    out = await bench_step_history(steps=600, window=100)
    assert set(out) == {"lru", "fair"}
    for r in out.values():
        assert r["steps"] == 600 and r["early_us"] > 0 and r["late_us"] > 0
    judged = targets(out)
    assert set(judged) == {"step_cost_late_vs_early_lru", "step_cost_late_vs_early_fair"}
    for policy in ("lru", "fair"):
        t = judged[f"step_cost_late_vs_early_{policy}"]
        assert t["measured"] == out[policy]["late_us"] / out[policy]["early_us"]
        assert t["met"] == (t["measured"] <= TARGET)


async def test_the_held_reads_bench_steps_an_engine_beside_another_clients_allocations():
    """The held-reads bench, shrunk: the engine's steps and the other client's allocations
    (each one choosing a victim) succeed on a real kvd under each policy, kvd stays sound,
    and the target is the larger size's median over the smaller's."""
    from kvd_loadgen.bench_held import TARGET, bench_held_reads, targets

    out = await bench_held_reads(policies=("lru", "fair"), allocations=8, sizes=(4, 32))
    assert set(out) == {"lru", "fair"}
    for row in out.values():
        assert set(row) == {4, 32}
        assert all(0 < r["p50_ms"] <= r["p99_ms"] for r in row.values())
    judged = targets(out)
    assert set(judged) == {"held_reads_lru_alloc_p50_large_vs_small",
                           "held_reads_fair_alloc_p50_large_vs_small"}
    for policy in ("lru", "fair"):
        t = judged[f"held_reads_{policy}_alloc_p50_large_vs_small"]
        assert t["measured"] == out[policy][32]["p50_ms"] / out[policy][4]["p50_ms"]
        assert t["met"] == (t["measured"] <= TARGET)


async def test_the_long_engine_bench_times_another_tenants_reads_beside_an_engine():
    """The long-engine bench, shrunk: tenant a's engine steps on its request under each
    policy while tenant b's client (a process of its own) reads, kvd stays sound, and the
    target is b's p99 beside the engine."""
    from kvd_loadgen.bench_whale_loop import TARGET_MS, bench_whale_loop, targets

    out = await bench_whale_loop(policies=("lru", "fair"), blocks=1024, seconds=0.5)
    assert set(out) == {"lru", "fair"}
    for row in out.values():
        assert row["steps_per_s"] > 0 and row["reads"] > 0
        assert 0 < row["alone_p50_ms"] <= row["alone_p99_ms"]
        assert 0 < row["p50_ms"] <= row["p99_ms"]
    judged = targets(out)
    for policy in ("lru", "fair"):
        t = judged[f"long_engine_{policy}_other_tenant_access_p99_ms"]
        assert t["measured"] == out[policy]["p99_ms"]
        assert t["met"] == (t["measured"] <= TARGET_MS)


async def test_the_big_calls_bench_times_another_tenants_reads_beside_them():
    """The big-calls bench, shrunk: tenant a goes round each life of single calls (a long
    request's, a long prompt's shared prefix blocks', a long request swapped out and read
    back) under each policy while tenant b's
    client (a process of its own) reads, kvd stays sound, and each target is b's p99
    beside a's calls."""
    from kvd_loadgen.bench_big_calls import TARGET_MS, bench_big_calls, targets

    out = await bench_big_calls(policies=("lru", "fair"), blocks=1024, seconds=0.5)
    assert set(out) == {"calls", "prefix", "swap"}
    judged = targets(out)
    for life, name in (("calls", "big_calls"), ("prefix", "big_prefix_calls"),
                       ("swap", "big_swap_calls")):
        assert set(out[life]) == {"lru", "fair"}
        for policy, row in out[life].items():
            assert row["rounds"] > 0 and row["a_call_ms"] > 0 and row["reads"] > 0
            assert 0 < row["alone_p50_ms"] <= row["alone_p99_ms"]
            assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
            t = judged[f"{name}_{policy}_other_tenant_access_p99_ms"]
            assert t["measured"] == row["p99_ms"]
            assert t["met"] == (t["measured"] <= TARGET_MS)


async def test_the_engines_bench_streams_hold_their_leases_through_the_other_turns():
    """kvd's streams wait out the empty server's turns (here ~3 s, past a 2 s lease): each
    stream carries its client's lease, as an engine's StepStream does, so the requests its
    engine admitted stay; opened without it, kvd released them mid-run ('no request')."""
    from kvd_loadgen.bench_engines import bench_engines

    out = await bench_engines(ns=(1,), seconds=0.8, rounds=2, paced_engines=1, rate=20.0,
                              paced_seconds=0.3, work_us=(10, 20, 40),
                              kvd_args=("--lease-ttl-s", "2"))
    assert out["saturated"][1]["kvd_steps_per_s"] > 0


async def test_the_unary_and_step_bench_keeps_its_clients_lease_through_the_run():
    """The bench's raw Step stream and unary calls carry its client's lease: the step's
    requests are that client's, and with a lease nothing renewed (here 1 s, the run about
    3 s) kvd released them mid-run and the bench failed its own check ('a call failed')."""
    from kvd_loadgen.bench import bench_pair

    out = await bench_pair(300, 300, 8, 1, policies=("lru",), kvd_args=("--lease-ttl-s", "1"))
    assert out["lru"]["step_p50_us"] > 0 and out["lru"]["admit_rps"] > 0


def test_the_queues_bench_times_the_longest_call_on_each_policy():
    """The queues bench, shrunk: each policy goes through reads, single touches and holds
    for a while, and each target is its longest call, judged against the bound."""
    from kvd_loadgen.bench_queues import TARGET_MS, bench_queues, targets

    out = bench_queues(policies=("lru", "intent"), blocks=4096, seconds=0.3)
    assert set(out) == {"lru", "intent"}
    judged = targets(out)
    for policy, row in out.items():
        assert row["blocks"] == 4096 and row["calls"] > 100
        assert 0 < row["longest_call_ms"]
        t = judged[f"queue_{policy}_longest_call_ms"]
        assert t["measured"] == row["longest_call_ms"]
        assert t["met"] == (t["measured"] <= TARGET_MS)
