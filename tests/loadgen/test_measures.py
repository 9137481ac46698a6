"""The load generator's measures."""

import pytest

from kvd_loadgen.measures import jain_index


def test_jain_index():
    assert jain_index([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)


def test_soak_memory_growth_compares_like_with_like():
    """The last third against the middle third, means of each; RSS counts the arenas."""
    from kvd_loadgen.soak import thirds_growth

    # Heap warms up in the first third (20 -> 50), then sits at 50 with noise; the arenas'
    # resident part grows in the middle third only.
    rss = [(t, 20 + 30 * min(t, 30) / 30 + (1 if t % 2 else -1), min(t, 45))
           for t in range(0, 90)]
    heap, total = thirds_growth(rss, 90.0)
    assert abs(heap) < 0.01  # no growth once warm, whatever the first third did
    assert 0 < total < 0.15  # the arenas grew from the middle third to the last
    grow = [(t, 50 + t, 0.0) for t in range(90)]  # a leak: a page a second
    assert thirds_growth(grow, 90.0)[0] > 0.25


def test_the_soak_targets_judge_memory_and_what_is_left():
    """A short real soak: each target carries its measured value; a leak of heap or RSS, or
    a page left behind, is not met; the report line says the figures."""
    import uvloop

    from kvd_loadgen.bench_report import soak_markdown
    from kvd_loadgen.soak import GROWTH_TARGET, run_soak, targets

    out = uvloop.run(run_soak(4, 6.0, "fair", 2.0))
    judged = targets(out)
    assert set(judged) == {"soak_heap_growth_last_vs_middle_third_pct",
                           "soak_rss_growth_last_vs_middle_third_pct",
                           "soak_pages_requests_left_and_self_check_problems"}
    heap = judged["soak_heap_growth_last_vs_middle_third_pct"]
    assert heap["measured"] == pytest.approx(out["heap_growth_last_vs_middle_third"] * 100)
    assert judged["soak_pages_requests_left_and_self_check_problems"]["met"]
    leaky = {**out, "heap_growth_last_vs_middle_third": GROWTH_TARGET * 2,
             "rss_growth_last_vs_middle_third": GROWTH_TARGET + 0.001, "pages_leaked": 3}
    assert not any(t["met"] for t in targets(leaky).values())
    assert judged["soak_heap_growth_last_vs_middle_third_pct"]["met"] == (
        out["heap_growth_last_vs_middle_third"] <= GROWTH_TARGET)
    line = "\n".join(soak_markdown(leaky))
    assert "heap +10.0%" in line and "pages leaked 3" in line


def test_the_work_budget_is_read_where_the_ratios_cross():
    """What a step may cost a handler for a ratio, along the measured (us, ratio) points."""
    from kvd_loadgen.bench_engines import work_at

    points = [(60, 0.5), (30, 0.8), (120, 0.4)]  # in any order
    assert work_at(points, 0.7) == pytest.approx(40.0)  # a third of the way from 30 to 60
    assert work_at(points, 0.9) == pytest.approx(15.0)  # between (0, 1) and (30, 0.8)
    assert work_at(points, 0.45) == pytest.approx(90.0)
    assert work_at(points, 0.8) == pytest.approx(30.0)
    assert work_at(points, 1.2) == 0.0  # as fast as the empty server: no work to spare
    assert work_at(points, 0.3) is None  # past the last point measured


def test_the_empty_server_with_work_spends_the_cpu_time_it_names():
    """Work<us> spends the CPU time it names on each message (a real server, real streams).
    Told by the server's CPU time a message, which other load on the machine leaves as it
    is (its rate would not be: under load the empty server too answers only hundreds)."""
    import asyncio

    from kvd_loadgen.bench_engines import ECHO, WORK, EchoEngine, _closed_loop, _Cpu, _echo

    async def cpu_per_message():
        async with _echo(1) as (pid, (channel,)):
            out = {}
            for method in (ECHO, WORK.format(0), WORK.format(2000)):
                call = channel.stream_stream(method)()
                cpu = _Cpu(pid)
                with cpu:
                    steps = await _closed_loop(call, EchoEngine("e").message, 0.5)
                await call.done_writing()
                assert steps > 0
                out[method] = cpu.process / steps
            return out

    ms = {method: s * 1e3 for method, s in asyncio.run(cpu_per_message()).items()}
    # 2 ms of the handler's thread's CPU time a message, at least; without work, much less.
    assert ms[WORK.format(2000)] >= 2.0, ms
    assert ms[WORK.format(0)] < 1.0 and ms[ECHO] < 1.0, ms


def test_the_budget_line_says_a_cost_past_the_points_plainly():
    """A ratio past the last point measured reads 'more than N µs', not 'about more than'."""
    from kvd_loadgen.bench_report import budget_line

    line = budget_line({"streams": 8, "points": [(30, 0.65), (60, 0.53)],
                        "target_us": 26.4, "kvd_us": None})
    assert "up to about 26 µs" in line
    assert "with more than 60 µs a step" in line and "about more" not in line


def test_a_servers_main_thread_cpu_is_told_apart_from_its_other_threads():
    """The engines bench's main-thread figure is the main thread's alone: a process whose
    other thread spins while its main thread sleeps shows CPU time in the process, next to
    none in its main thread."""
    import subprocess
    import sys
    import time

    from kvd_loadgen.bench_engines import _Cpu
    from kvd_loadgen.measures import cpu_s

    spin = ("import threading, time\n"
            "def spin():\n"
            "    until = time.thread_time() + 5\n"
            "    while time.thread_time() < until: pass\n"
            "threading.Thread(target=spin, daemon=True).start()\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        cpu = _Cpu(proc.pid)
        with cpu:
            # Until the spinning thread has had 0.3 s of a core (on a busy machine that
            # takes longer than 0.3 s).
            until = cpu_s(proc.pid) + 0.3
            deadline = time.monotonic() + 20
            while cpu_s(proc.pid) < until and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    assert cpu.process >= 0.3  # the spinning thread
    assert cpu.main <= 0.1  # asleep


def test_spread_engines_send_at_their_own_phases():
    """The spread paced run's engines each send at the pace, their first step `offset` into
    the period: their sends do not come at the same instants as the lock-step run's do."""
    import asyncio
    import time

    from kvd_loadgen.bench_engines import _paced

    class Call:
        def __init__(self) -> None:
            self.sent: list[float] = []

        async def write(self, message) -> None:
            self.sent.append(time.perf_counter())

        async def read(self):
            return None

    async def run(offsets):
        calls = [Call() for _ in offsets]
        start = time.perf_counter()
        trips = await asyncio.gather(*(_paced(call, lambda: b"", 10.0, 0.35, offset=offset)
                                       for call, offset in zip(calls, offsets)))
        return start, calls, trips

    start, (first, second), trips = asyncio.run(run([0.0, 0.05]))
    assert [len(t) for t in trips] == [len(first.sent), len(second.sent)] == [4, 4]
    # Each sends every 0.1 s; the second's sends come 0.05 s after the first's.
    assert second.sent[0] - start >= 0.049
    gaps = sorted(b - a for a, b in zip(first.sent, second.sent))
    assert 0.02 < (gaps[1] + gaps[2]) / 2 < 0.08, gaps  # the median, what jitter leaves
