"""/metrics of a running kvd after a workload: the expected series, with the right values,
in an exposition a real Prometheus parser accepts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from prometheus_client.parser import text_string_to_metric_families

from kvd import __version__
from kvd_client import AsyncClient, pb
from kvd_loadgen.local import LocalKvd

from .conftest import SMALL, free_port, scrape, slow_link_kvd, start_slow_read



def _value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


async def test_metrics_after_a_workload(tmp_path):
    port = free_port()
    launched = time.time()
    with LocalKvd(*SMALL, "--metrics", f"127.0.0.1:{port}", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target) as client:
            for rid in ("a", "b", "c"):  # 12 blocks on 8 device pages: evictions
                await client.admit(rid, 64, tenant="t1" if rid != "c" else "t2")
                await client.allocate(rid, 4)
            await client.access("a")
            stats = (await client.pool_stats()).pools[0]
            text, samples = scrape(port)
    labels = dict(pool="default", tier="device", state="used")
    assert _value(samples, "kvd_pool_pages", **labels) == stats.tiers[0].used_pages == 8
    assert _value(samples, "kvd_pool_pages", pool="default", tier="host", state="used") == 4
    assert _value(samples, "kvd_admissions_total", pool="default", decision="admitted") == 3
    evictions = sum(v for (n, _), v in samples.items() if n == "kvd_evictions_total")
    assert evictions == stats.num_evictions > 0
    assert _value(samples, "kvd_evictions_total", pool="default", policy="lru",
                  victim_tenant="t1", cause_tenant="t2") >= 4
    assert _value(samples, "kvd_page_moves_total", pool="default",
                  direction="host_to_device") == stats.num_promotions
    assert _value(samples, "kvd_moved_bytes_total", pool="default",
                  direction="device_to_host") == stats.num_demotions * stats.page_bytes
    assert _value(samples, "kvd_tenant_reserved_pages", pool="default", tenant="t1") == 8
    assert _value(samples, "kvd_rpc_duration_seconds_count", method="Admit", code="OK") == 3
    assert _value(samples, "kvd_stall_seconds_count", pool="default") >= 1
    assert "# TYPE kvd_rpc_duration_seconds histogram" in text
    link = "default:device<->host"
    moved = sum(v for (n, lbl), v in samples.items()
                if n == "kvd_link_bytes_total" and dict(lbl).get("link") == link)
    assert moved == stats.links[0].bytes_total > 0
    assert _value(samples, "kvd_link_capacity_bytes_per_second", link=link,
                  scheduling="fair") == stats.links[0].capacity_bytes_per_s
    assert _value(samples, "kvd_link_queued_transfers", link=link,
                  transfer_class="critical") == 0
    assert _value(samples, "kvd_read_bytes_total", pool="default", tenant="t1") == \
        4 * stats.page_bytes  # "a" read its 4 blocks once
    # Stalls by cause, the unit before _total as Prometheus names go.
    assert _value(samples, "kvd_tenant_stall_seconds_total", pool="default", tenant="t1",
                  cause_tenant="t2") > 0
    assert "kvd_stall_seconds_by_cause" not in text
    # The standard process and build-info series, of kvd's own process.
    assert 1e6 < _value(samples, "process_resident_memory_bytes") < 2**34
    started = _value(samples, "process_start_time_seconds")
    assert launched - 2 <= started <= time.time()  # kvd's start, not this test's process
    info = [dict(lbl) for (n, lbl), v in samples.items() if n == "kvd_build_info" and v == 1]
    assert info and info[0]["version"] == __version__
    assert info[0]["python_version"] == platform.python_version()
    assert ("python_info" in {n for n, _ in samples})
    promtool = shutil.which("promtool")
    if promtool:  # Debian's prometheus package, where it is installed
        check = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                               capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr


async def test_prefix_blocks_looked_up_found_loaded_and_stored_are_counted(tmp_path):
    # What the engines' prefix calls got from kvd, the KV tier's hit rate: keys looked up,
    # the leading run found for them, blocks loaded, blocks committed (once each).
    port = free_port()
    ns, keys = "m|", [bytes([i]) * 32 for i in range(6)]
    with LocalKvd(*SMALL, "--metrics", f"127.0.0.1:{port}", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target) as client:
            await client.admit("w", 64)
            await client.store("w", ns, keys[:4])
            assert (await client.commit("w", ns, [keys[0], keys[1], keys[3]])).num_committed == 3
            assert (await client.lookup(ns, keys)).num_hit == 2  # keys[2] is not written
            assert (await client.lookup("other|", keys[:2])).num_hit == 0
            await client.admit("r", 96)
            assert len((await client.load("r", ns, keys)).handles) == 2
            assert (await client.commit("w", ns, [keys[2]])).num_committed == 1
            assert (await client.commit("w", ns, keys[:4])).num_committed == 0
            assert (await client.lookup(ns, keys)).num_hit == 4
            stats = (await client.pool_stats()).pools[0]
            _, samples = scrape(port)
    counts = {"looked_up": 6 + 2 + 6, "hits": 2 + 4, "loaded": 2, "stored": 4}
    assert {op: getattr(stats, f"num_prefix_{op}") for op in counts} == counts
    assert {op: _value(samples, "kvd_prefix_blocks_total", pool="default", op=op)
            for op in counts} == counts


def test_loop_histogram_exposes_what_prometheus_clients_histogram_would():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from kvd.metrics import LoopHistogram

    buckets = (1e-4, 1e-3, 1e-2)
    ours = CollectorRegistry()
    loop_hist = LoopHistogram("h_seconds", "doc", ["method"], buckets)
    ours.register(loop_hist)
    theirs = CollectorRegistry()
    reference = Histogram("h_seconds", "doc", ["method"], registry=theirs, buckets=buckets)
    # Values on the bounds (le is "less or equal"), between them, and past the last.
    for method, value in [("A", 1e-4), ("A", 5e-4), ("A", 1e-3), ("B", 0.5), ("A", 2e-5),
                          ("B", 1e-2), ("A", 3.0)]:
        loop_hist.observe((method,), value)
        reference.labels(method).observe(value)

    def samples(registry):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(generate_latest(registry).decode())
                for s in family.samples if not s.name.endswith("_created")}

    assert samples(ours) == samples(theirs)
    assert samples(ours)[("h_seconds_bucket", (("le", "0.001"), ("method", "A")))] == 4


def _lags_over(samples: dict, seconds: float) -> float:
    """Loop lags observed over `seconds` (a bucket bound), from a scrape's samples."""
    bucket = _value(samples, "kvd_event_loop_lag_seconds_bucket", le=repr(seconds))
    return _value(samples, "kvd_event_loop_lag_seconds_count") - bucket


async def test_loop_lag_observes_the_loop_held_by_a_handler():
    """A callback that holds the loop 80 ms: the lag watcher, due every 10 ms, wakes about
    70 ms late."""
    from kvd.metrics import LoopHistogram, watch_loop_lag

    hist = LoopHistogram("lag_seconds", "doc", [], (1e-3, 1e-2, 5e-2, 0.1))
    watcher = asyncio.ensure_future(watch_loop_lag(hist, period_s=0.01))
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.08)  # noqa: ASYNC251 - a handler that does not yield
        await asyncio.sleep(0.03)
    finally:
        watcher.cancel()
    counts, total = hist._series[()]
    assert sum(counts[3:]) >= 1  # a lag past 50 ms: the held loop's
    assert total >= 0.06


async def test_a_stopped_kvd_shows_in_its_loop_lag(tmp_path):
    """The machine stops kvd for 200 ms (SIGSTOP, SIGCONT, as a preempting neighbour would):
    /metrics then counts at least one more lag past 100 ms, and their sum grows by 150 ms
    or more (the watcher's timer, due every 50 ms, falls due in the stop's first 50 ms)."""
    port = free_port()
    with LocalKvd(*SMALL, "--metrics", f"127.0.0.1:{port}", workdir=tmp_path) as kvd:
        await asyncio.sleep(0.3)
        text, before = scrape(port)
        assert "# TYPE kvd_event_loop_lag_seconds histogram" in text
        assert _value(before, "kvd_event_loop_lag_seconds_count") >= 3
        kvd.proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(0.2)
        kvd.proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.1)
        _, after = scrape(port)
    # At least one: a busy machine may stall kvd that long meanwhile too.
    assert _lags_over(after, 0.1) >= _lags_over(before, 0.1) + 1
    assert _value(after, "kvd_event_loop_lag_seconds_sum") - _value(
        before, "kvd_event_loop_lag_seconds_sum") >= 0.15


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


async def test_health_and_readiness_beside_the_metrics_until_the_drain_ends(tmp_path):

    port = free_port()
    with slow_link_kvd(tmp_path, "--metrics", f"127.0.0.1:{port}", "--grace-s", "10") as kvd:
        assert _get(port, "/healthz") == (200, "ok\n")
        assert _get(port, "/readyz") == (200, "ready\n")
        status, body = _get(port, "/nothing")
        assert status == 404 and "/metrics, /healthz, /readyz" in body
        async with AsyncClient(kvd.target) as client:
            async with client.step_stream() as stream:
                # A read kvd serves for a second (the slow link): the drain waits for it.
                pending = await start_slow_read(client, stream)
                await asyncio.sleep(0.2)
                kvd.proc.send_signal(signal.SIGTERM)
                for _ in range(100):
                    if _get(port, "/readyz")[0] == 503:
                        break
                    await asyncio.sleep(0.02)
                # Draining: not ready, still alive, and the metrics still answer.
                assert _get(port, "/readyz") == (503, "not ready\n")
                assert _get(port, "/healthz")[0] == 200
                assert "kvd_uptime_seconds" in _get(port, "/metrics")[1]
                assert kvd.proc.poll() is None
                assert not (await pending).errors
        assert kvd.proc.wait(timeout=10) == 0


def test_a_metrics_port_in_use_is_one_line_and_exit_2(tmp_path):
    from .test_startup import busy_port, kvd as run_kvd, one_line

    with busy_port() as port:
        one_line(run_kvd("--socket", "k.sock", "--metrics", f"127.0.0.1:{port}",
                         tmp_path=tmp_path), f"cannot serve metrics on 127.0.0.1:{port}")


@pytest.mark.parametrize("broken", ["figures", "index"])
async def test_the_periodic_self_check_reports_broken_bookkeeping(tmp_path, broken):
    """kvd checks its own invariants every self_check_s: 0 problems on a sound pool, then the
    count (the KvdSelfCheckFailing alert) once a tenant's figures no longer add up, or a
    request in the pool is missing from the node's request index."""
    from kvd.config import config_from_dict
    from kvd.metrics import _node_families, _pool_families
    from kvd.node import Node
    from kvd.stats import node_figures

    node = Node(config_from_dict({"server": {"self_check_s": 0.05}, "pool": [
        {"name": "default", "page_bytes": 4096, "device_pages": 8, "host_pages": 8}]}))
    checker = asyncio.ensure_future(node.health.check_forever(0.05))
    try:
        node.admit("r", tenant="t", pool="default", prompt_tokens=64, output_tokens=0,
                   priority=0)
        await node.allocate("r", 4)

        def scrape():
            figures = node_figures(node)
            families = {f.name: f for f in (*_pool_families(figures.pools),
                                            *_node_families(figures))}
            problems = {s.labels["pool"]: s.value
                        for s in families["kvd_self_check_problems"].samples}
            runs = {s.labels["result"]: s.value for s in families["kvd_self_check_runs"].samples}
            return problems, runs

        async def scraped(done):
            """The figures once `done` holds of them (each check forks a walk, which takes
            its time on a loaded machine), or as they are after 20 s."""
            for _ in range(400):
                problems, runs = scrape()
                if done(problems, runs):
                    break
                await asyncio.sleep(0.05)
            return problems, runs

        problems, runs = await scraped(lambda problems, runs: runs["ok"] >= 2)
        assert problems == {"default": 0} and runs["ok"] >= 2 and runs["failed"] == 0
        if broken == "figures":
            node.runtime("default").pool.tenancy.device_by_tenant["t"] += 3  # they now lie
        else:  # the request is in its pool and no call reaches it
            del node.request_index["r"]
        problems, runs = await scraped(lambda problems, runs: runs["failed"] >= 1)
        assert problems["default"] > 0 and runs["failed"] >= 1
    finally:
        checker.cancel()
        await asyncio.wait_for(node.aclose(), 10)


def test_kvd_loads_grpc_with_fork_support_off_and_leaves_the_variable_as_it_was():
    """Loaded first, kvd loads gRPC with fork support off and puts the variable back (the
    processes kvd starts see the user's). Loaded after gRPC (fork support on by default),
    kvd cannot fork a bare child, and says so."""
    code = ("import os, sys\n{first}\nimport kvd\n"
            "print(kvd.GRPC_FORKS_BARE, os.environ.get('GRPC_ENABLE_FORK_SUPPORT'))")
    runs = {(first, asked): subprocess.run(
        [sys.executable, "-c", code.format(first=first)], capture_output=True, text=True,
        env={**{k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"},
             **({"GRPC_ENABLE_FORK_SUPPORT": asked} if asked else {})}, check=True).stdout.split()
        for first in ("", "import grpc") for asked in ("", "true", "false")}
    assert runs == {("", ""): ["True", "None"], ("", "true"): ["True", "true"],
                    ("", "false"): ["True", "false"],
                    ("import grpc", ""): ["False", "None"],
                    ("import grpc", "true"): ["False", "true"],
                    ("import grpc", "false"): ["True", "false"]}


async def test_a_self_check_that_cannot_fork_a_bare_child_walks_in_the_loop(monkeypatch):
    """Where gRPC was loaded with fork support on, the check walks the pool where it is
    (a problem planted in the pool is found) and forks nothing."""
    import kvd
    from kvd.config import config_from_dict
    from kvd.health import check_apart
    from kvd.node import Node

    def no_fork():
        raise AssertionError("forked")

    monkeypatch.setattr(kvd, "GRPC_FORKS_BARE", False)
    monkeypatch.setattr(os, "fork", no_fork)
    node = Node(config_from_dict({"pool": [{"name": "default", "page_bytes": 64,
                                            "device_pages": 64, "host_pages": 64}]}))
    try:
        node.admit("r", tenant="t", pool="default", prompt_tokens=64, output_tokens=0,
                   priority=0)
        await node.allocate("r", 4)
        pool = node.runtime("default").pool
        assert await check_apart(pool) == (0, [])
        pool.tenancy.device_by_tenant["t"] += 3  # figures now lie
        count, problems = await check_apart(pool)
        assert count >= 1 and problems
    finally:
        await asyncio.wait_for(node.aclose(), 10)


async def test_a_self_check_out_of_descriptors_is_skipped_not_a_crash(monkeypatch):
    """No descriptor left for the pipe to the forked walk (a flood of connections took them):
    the check is skipped, as when the fork fails; it raised, and ended the periodic check."""
    import errno

    from kvd.config import config_from_dict
    from kvd.health import check_apart
    from kvd.node import Node

    def no_descriptors():
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    node = Node(config_from_dict({"pool": [{"name": "default", "page_bytes": 64,
                                            "device_pages": 64, "host_pages": 64}]}))
    try:
        pool = node.runtime("default").pool
        monkeypatch.setattr(os, "pipe", no_descriptors)
        assert await check_apart(pool) is None
        monkeypatch.undo()
        assert await check_apart(pool) == (0, [])
    finally:
        await asyncio.wait_for(node.aclose(), 10)


async def test_the_periodic_self_check_does_not_hold_kvds_loop(monkeypatch):
    """The self-check walks every page of a pool: about 0.2 s at 65,536 device pages here,
    1 s at 262,144, and once a minute every engine's step waited that long. It checks a
    forked copy of the still pool instead; kvd's loop waits only for the fork, and runs on
    while the copy is walked. (Counted, not timed: a walk held in the loop lets it run not
    once meanwhile; the fork's own pause, timed, ran past a quarter of the walk on a loaded
    machine.)"""
    from kvd import health
    from kvd.config import config_from_dict
    from kvd.core.invariants import check_pool
    from kvd.node import Node

    checking = False
    during = 0  # turns of kvd's loop while a check ran
    apart = health.check_apart

    async def watched(pool):
        nonlocal checking
        checking = True
        try:
            return await apart(pool)
        finally:
            checking = False

    monkeypatch.setattr(health, "check_apart", watched)
    pages, blocks = 65536, 64
    node = Node(config_from_dict({"pool": [{"name": "default", "page_bytes": 64,
                                            "device_pages": pages, "host_pages": pages}]}))
    try:
        for i in range(pages // blocks):
            node.admit(f"r{i}", tenant=f"t{i % 4}", pool="default",
                       prompt_tokens=16 * blocks, output_tokens=0, priority=0)
            await node.allocate(f"r{i}", blocks)
        pool = node.runtime("default").pool
        started = time.perf_counter()
        assert check_pool(pool) == []
        walk_s = time.perf_counter() - started

        async def ticks():
            nonlocal during
            while True:
                await asyncio.sleep(0.001)
                during += checking

        ticker = asyncio.ensure_future(ticks())
        checker = asyncio.ensure_future(node.health.check_forever(0.05))
        try:
            async with asyncio.timeout(60):
                while node.health.runs["ok"] < 2:
                    await asyncio.sleep(0.05)
        finally:
            checker.cancel()
            ticker.cancel()
            await asyncio.gather(checker, ticker, return_exceptions=True)
        assert node.health.problems == {"default": 0}
        assert during >= 3, (during, walk_s)
    finally:
        await asyncio.wait_for(node.aclose(), 30)


def forked_children(pid: int) -> dict[int, int]:
    """The children a kvd forked (its multiprocessing resource tracker aside), each with its
    thread count; read from /proc, whole (ps cuts command lines to its column width)."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in map(int, (task / "children").read_text().split()):
                with contextlib.suppress(OSError, StopIteration):
                    if "resource_tracker" in Path(f"/proc/{child}/cmdline").read_text():
                        continue
                    status = Path(f"/proc/{child}/status").read_text().splitlines()
                    line = next(x for x in status if x.startswith("Threads:"))
                    found[child] = int(line.split()[1])
    return found


async def test_the_forked_self_check_runs_beside_a_serving_kvd_and_leaves_it_whole(tmp_path):
    """A real kvd (uvloop, gRPC's threads, shared-memory arenas) forks its self-check every
    0.1 s while a client allocates and reads: every check comes back sound, the client's
    calls go on, no child is left behind, and SIGTERM still stops kvd cleanly."""
    config = tmp_path / "kvd.toml"
    config.write_text('[server]\nself_check_s = 0.1\n\n[[pool]]\nmodel = "tiny"\n'
                      'device_pages = 64\nhost_pages = 256\n')
    port = free_port()
    kvd = LocalKvd("--config", str(config), "--metrics", f"127.0.0.1:{port}",
                   workdir=tmp_path).start()
    try:
        async with AsyncClient(kvd.target) as client:
            for i in range(40):
                await client.admit(f"r{i}", 16 * 8)
                await client.allocate(f"r{i}", 8)
                assert len((await client.access(f"r{i}")).handles) == 8
                if i >= 4:
                    await client.release(f"r{i - 4}")
                await asyncio.sleep(0.02)
            _, samples = scrape(port)
        ok = samples[("kvd_self_check_runs_total", (("result", "ok"),))]
        assert ok >= 3 and samples[("kvd_self_check_runs_total", (("result", "failed"),))] == 0
        assert samples[("kvd_self_check_problems", (("pool", "default"),))] == 0
        # A check's child lives for milliseconds here: one seen twice, 0.3 s apart, was
        # left behind (a zombie kvd never reaped, or a walk that never ended).
        seen: list[set] = []
        for _ in range(5):
            seen.append(set(forked_children(kvd.proc.pid)))
            time.sleep(0.3)
        assert all(len(pids) <= 1 for pids in seen), seen
        assert not any(a & b for a, b in zip(seen, seen[1:])), seen
    finally:
        assert kvd.stop() == 0, kvd.log


def test_the_self_checks_forked_child_runs_no_grpc_threads(tmp_path):
    """gRPC's fork support (on by default) restarts gRPC's threads in a forked child, beside
    the walk (five more threads here). kvd turns it off before gRPC is loaded, so the child is
    the walk alone: one thread. Its walk (262,144 empty device pages) lasts long enough here
    to be looked at."""
    config = tmp_path / "kvd.toml"
    config.write_text('[server]\nself_check_s = 0.05\n\n[[pool]]\npage_bytes = 64\n'
                      'device_pages = 262144\nhost_pages = 64\n')
    kvd = LocalKvd("--config", str(config), workdir=tmp_path).start()
    threads: dict[int, int] = {}  # each forked child seen: its thread count
    try:
        deadline = time.monotonic() + 60
        while len(threads) < 5 and time.monotonic() < deadline:
            for child, count in forked_children(kvd.proc.pid).items():
                threads[child] = max(threads.get(child, 0), count)
            time.sleep(0.005)
    finally:
        assert kvd.stop() == 0, kvd.log
    assert len(threads) >= 5, threads
    assert set(threads.values()) == {1}, threads


async def test_an_operators_self_check_does_not_hold_the_engines(tmp_path):
    """`kvctl self-check` (the SelfCheck RPC) walks every page as the periodic check does:
    about 1 s at 262,144 device pages (half of them held) here, and every engine's call
    waited as long. A big pool is walked in a forked copy, as the periodic check's is: a
    client's calls meanwhile wait for the fork, not for the walk, and go on being answered
    while it runs. (Counted, not timed: held up by the walk, none would be answered during
    the check; the fork's own pause, timed, ran past a quarter of the walk on a loaded
    machine.)"""
    config = tmp_path / "kvd.toml"
    config.write_text('[[pool]]\npage_bytes = 64\ndevice_pages = 262144\nhost_pages = 64\n')
    kvd = LocalKvd("--config", str(config), workdir=tmp_path).start()
    try:
        async with AsyncClient(kvd.target) as client, AsyncClient(kvd.target) as operator:
            for i in range(64):
                await client.admit(f"r{i}", 16 * 2048)
                await client.allocate(f"r{i}", 2048)
            longest = 0.0
            checking, checked = asyncio.Event(), asyncio.Event()
            during = 0  # calls sent and answered while the check ran

            async def engine():
                nonlocal longest, during
                while not checked.is_set():
                    sent_during = checking.is_set()
                    started = time.perf_counter()
                    assert len((await client.access("r0", [0, 1, 2, 3])).handles) == 4
                    longest = max(longest, time.perf_counter() - started)
                    during += sent_during and not checked.is_set()
                    await asyncio.sleep(0.002)

            calls = asyncio.ensure_future(engine())
            await asyncio.sleep(0.05)
            started = time.perf_counter()
            checking.set()
            check = await operator.self_check()
            checked.set()
            walk_s = time.perf_counter() - started
            await calls
        assert check.ok, check.problems
        assert during >= 3, (during, longest, walk_s)
    finally:
        assert kvd.stop() == 0, kvd.log


async def test_an_operators_self_check_of_a_big_pool_finds_what_is_wrong(monkeypatch):
    """The forked walk's findings reach the caller: a planted problem is found, in a child,
    and problems past the first FORKED_PROBLEMS are counted, not lost."""
    from kvd import health
    from kvd.config import config_from_dict
    from kvd.node import Node

    forks = []
    real_fork = os.fork

    def fork():
        pid = real_fork()
        if pid:
            forks.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", fork)
    node = Node(config_from_dict({"pool": [
        {"name": "default", "page_bytes": 64, "device_pages": health.APART_FROM_PAGES,
         "host_pages": 64}]}))
    try:
        for i in range(3):
            node.admit(f"r{i}", tenant=f"t{i}", pool="default", prompt_tokens=64,
                       output_tokens=0, priority=0)
            await node.allocate(f"r{i}", 4)
        assert await node.self_check() == [] and len(forks) == 1
        pool = node.runtime("default").pool
        for i in range(3):
            pool.requests[f"r{i}"].num_device_blocks += 1  # figures now lie, each request's
        found = await node.self_check()
        assert len(forks) == 2
        assert [p for p in found if "r0 counts" in p] and [p for p in found if "r2 counts" in p]
        monkeypatch.setattr(health, "FORKED_PROBLEMS", 1)
        cut = await node.self_check()
        assert cut[:1] == found[:1] and len(cut) == 2, cut
        assert cut[1] == f"default: {len(found) - 1} more problems", cut
    finally:
        await asyncio.wait_for(node.aclose(), 10)


async def test_kubernetes_grpc_probes_get_health_on_the_health_listener(tmp_path):
    """`health = HOST:PORT`: grpc.health.v1 alone, in clear, for Kubernetes' grpc: probes;
    NOT_SERVING once kvd drains; nothing of kvd's API there."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import grpc

    port = free_port()
    kvd = slow_link_kvd(tmp_path, "--health", f"127.0.0.1:{port}", "--grace-s", "10").start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stats = channel.unary_unary("/kvd.v1.Memory/GetPoolStats",
                                        request_serializer=pb.GetPoolStatsRequest.SerializeToString,
                                        response_deserializer=pb.GetPoolStatsResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stats(pb.GetPoolStatsRequest())
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            async with AsyncClient(kvd.target) as client:
                async with client.step_stream() as stream:
                    pending = await start_slow_read(client, stream)
                    await asyncio.sleep(0.2)
                    kvd.proc.send_signal(signal.SIGTERM)
                    for _ in range(100):
                        reply = await health.Check(health_pb2.HealthCheckRequest())
                        if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                            break
                        await asyncio.sleep(0.02)
                    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
                    assert not (await pending).errors
        assert kvd.proc.wait(timeout=10) == 0
    finally:
        kvd.stop()
