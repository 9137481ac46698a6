"""`make bench`: kvd's control plane against empty gRPC baselines measured in the same run,
the Step stream, tier copies against numpy.copyto, and victim selection scaling."""

from __future__ import annotations


import asyncio
import contextlib
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from rich.console import Console

from kvd_client import AsyncClient, eventloop, pb
from kvd_loadgen.bench_report import (
    judge,
    print_tables,
    ratios_of,
    results_markdown,
    split_runs,
)
from kvd_loadgen.bench_scenarios import run_scenarios
from kvd_loadgen.local import LocalKvd
from kvd_loadgen.measures import cpu_s

console = Console()
CONCURRENCY = 8  # calls in flight from the load process, for both baseline and kvd


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "grpcio": grpc.__version__,
        "numpy": np.__version__,
    }


async def _burst(call, indices) -> float:
    """Seconds to make `call(i)` for every i of `indices`, CONCURRENCY in flight."""
    queue = iter(indices)

    async def worker():
        for i in queue:
            await call(i)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return time.perf_counter() - started


# Two servers and the load process share two cores, whose speed drifts by tens of percent
# over seconds here. Each kvd figure is therefore measured paired with the empty server's:
# both run at once, and the load alternates between them in short turns, so both sides see
# the same machine. A turn's first calls may overlap the other server's leftover work (kvd
# records reads just after it replies): they are timed as warm-up and left out.
BURST = 400  # unary calls a turn
TURN = 20  # ping-pongs a turn


async def _paired_rates(sides: list[tuple[int, object]], n: int) -> list[dict]:
    """Calls per second and server CPU per call of each side, `(pid, call)`, over n calls
    each, made in alternating turns of BURST calls."""
    spent = [0.0] * len(sides)
    cpu = [0.0] * len(sides)
    for start in range(0, n, BURST):
        warm = range(n + start // BURST * CONCURRENCY, n + (start // BURST + 1) * CONCURRENCY)
        for k, (pid, call) in enumerate(sides):
            await _burst(call, warm)  # warm-up calls, untimed, numbered after the timed ones
            cpu0 = cpu_s(pid)
            spent[k] += await _burst(call, range(start, min(n, start + BURST)))
            cpu1 = cpu_s(pid)
            cpu[k] += math.nan if cpu0 is None or cpu1 is None else cpu1 - cpu0
    return [{"rps": n / t, "server_cpu_us": c / n * 1e6} for t, c in zip(spent, cpu)]


def _num_warmups(n: int) -> int:
    """How many warm-up calls _paired_rates makes to each side besides its n timed ones."""
    return -(-n // BURST) * CONCURRENCY


async def _paired_pingpong(sends: list, n: int) -> list[dict]:
    """Round-trip p50 and p99 of each `send(i)` (one message in flight), n samples each,
    taken in alternating turns of TURN messages."""
    samples: list[list[float]] = [[] for _ in sends]
    clock = time.perf_counter
    while len(samples[-1]) < n:
        for send, out in zip(sends, samples):
            for j in range(TURN + 1):
                t0 = clock()
                await send(j)
                if j:  # the first message of a turn is the warm-up
                    out.append(clock() - t0)
    result = []
    for out in samples:
        out.sort()
        result.append({"p50_us": statistics.median(out) * 1e6,
                       "p99_us": out[int(0.99 * (len(out) - 1))] * 1e6})
    return result


def _ping(stream, payload: bytes):
    async def send(i):
        await stream.write(payload)
        await stream.read()
    return send


@contextlib.asynccontextmanager
async def _echo_server():
    """The empty gRPC server in its own process: (pid, channel)."""
    with tempfile.TemporaryDirectory(prefix="kvd-echo-") as tmp:
        sock = Path(tmp) / "echo.sock"
        proc = subprocess.Popen([sys.executable, "-m", "kvd_loadgen.echo_server",
                                 "--socket", str(sock)])
        try:
            for _ in range(200):
                if sock.exists():
                    break
                await asyncio.sleep(0.05)
            async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
                await channel.channel_ready()
                yield proc.pid, channel
        finally:
            proc.terminate()
            proc.wait()


async def bench_pair(n_unary: int, n_stream: int, step_requests: int, step_blocks: int,
                     policies=("lru", "intent"), kvd_args: tuple[str, ...] = ()) -> dict:
    """kvd's unary Admit / Allocate / Access and a Step of `step_requests` x `step_blocks`
    resident blocks, each paired with the empty server's unary call and ping-pong."""
    args = ("--page-bytes", "4096", "--device-pages", "65536", "--host-pages", "65536")
    out: dict = {}
    async with _echo_server() as (echo_pid, echo):
        echo_unary = echo.unary_unary("/kvd.bench.Echo/Unary")
        await _burst(lambda i: echo_unary(b""), range(200))
        # The empty server gets the same Step message and answers as briefly as kvd does.
        echo_stream = echo.stream_stream("/kvd.bench.Echo/Ack")()
        rids = [f"s{i}" for i in range(step_requests)]
        payload = pb.StepRequest(step_id=1, read_all=rids).SerializeToString()
        echo_ping = _ping(echo_stream, payload)
        for policy in policies:
            with LocalKvd(*args, "--policy", policy, *kvd_args) as kvd:
                async with AsyncClient(kvd.target) as client:
                    # A batch of running requests, each with step_blocks resident blocks;
                    # one Step message reads every block of every request, as attention does.
                    for rid in rids:
                        await client.admit(rid, step_blocks * 16)
                        await client.allocate(rid, step_blocks)
                    side: dict = {}
                    # The Step first, on a daemon that holds the step's requests and nothing
                    # else under every policy: the unary calls after it leave thousands of
                    # requests admitted.
                    # The raw calls carry the client's lease, as its own calls do: the step's
                    # requests are the client's, and a lease no call renews lapses (30 s)
                    # and releases them in the middle of a long run.
                    step = client.channel.stream_stream("/kvd.v1.Memory/Step")(
                        metadata=client.metadata)
                    e, k = await _paired_pingpong([echo_ping, _ping(step, payload)], n_stream)
                    await step.done_writing()
                    side.update(empty_pingpong_p50_us=e["p50_us"],
                                empty_pingpong_p99_us=e["p99_us"],
                                step_p50_us=k["p50_us"], step_p99_us=k["p99_us"])
                    if policy == policies[0]:
                        await _unary_pairs(client, kvd.proc.pid, echo_pid, echo_unary,
                                           n_unary, side)
                    stats = (await client.pool_stats()).pools[0]
                    expected = step_requests + (n_unary + _num_warmups(n_unary)
                                                if policy == policies[0] else 0)
                    assert stats.num_requests == expected, "a call failed"
                    check = await client.self_check()
                    assert check.ok, check.problems
            out[policy] = side
        await echo_stream.done_writing()
    return out


async def _unary_pairs(client, kvd_pid: int, echo_pid: int, echo_unary, n: int,
                       side: dict) -> None:
    """Admit, then Allocate, then Access, each paired with the empty unary call (requests
    are pre-serialized, so the load process does the same work for both servers)."""
    methods = {
        "admit": ("Admit", lambda i: pb.AdmitRequest(request_id=f"r{i}", prompt_tokens=1)),
        "allocate": ("Allocate", lambda i: pb.AllocateRequest(request_id=f"r{i}",
                                                              num_blocks=1)),
        "access": ("Access", lambda i: pb.AccessRequest(request_id=f"r{i}",
                                                        block_indices=[0])),
    }
    for name, (method, make) in methods.items():
        call = client.channel.unary_unary(f"/kvd.v1.Memory/{method}")
        payloads = [make(i).SerializeToString() for i in range(n + _num_warmups(n))]
        md = client.metadata  # the client's lease (see bench_pair), to both servers
        e, k = await _paired_rates([(echo_pid, lambda i: echo_unary(b"", metadata=md)),
                                    (kvd_pid, lambda i: call(payloads[i], metadata=md))], n)
        side[f"empty_unary_rps_{name}"] = e["rps"]
        side["empty_unary_server_cpu_us"] = e["server_cpu_us"]
        side[f"{name}_rps"] = k["rps"]
        side[f"{name}_server_cpu_us"] = k["server_cpu_us"]


def bench_copies(page_bytes: int = 2 * 2**20, num_pages: int = 128, repeats: int = 5,
                 gpu: bool = False) -> dict:
    """kvd's page copier on a plan of page moves against one numpy.copyto of the same bytes:
    once with the pages a request's blocks usually get (consecutive runs, coalesced), once
    scattered at random (the worst case: one copy per page). With `gpu`, the device tier is
    GPU memory (CuPy) and the host tier page-locked, as kvd runs on a GPU, and the baseline
    is one device-to-host copy of the same bytes (`numpy_copyto_gbps` then names it)."""
    from kvd.core.blocks import Block, Request, RequestState, TierKind
    from kvd.core.transfer import Move, MoveKind, TransferPlan
    from kvd.memory.arena import ShmArena
    from kvd.memory.copier import PageCopier

    if gpu:
        from kvd.memory.cuda import CupyArena, pin_host_arena

        device = CupyArena(num_pages, page_bytes)
        host = ShmArena(num_pages, page_bytes, label="bench-host", backend="pinned-shm")
        pin_host_arena(host)
    else:
        device = ShmArena(num_pages, page_bytes, label="bench-dev", backend="host-standin")
        host = ShmArena(num_pages, page_bytes, label="bench-host")
    try:
        device.pages[:] = 7
        host.pages[:] = 1
        copier = PageCopier(device, host)
        req = Request("b", "t", "p", 0, num_pages, RequestState.ADMITTED)

        def plan_for(order):
            plan = TransferPlan("p", "bench", None)
            for src, dst in enumerate(order):
                block = Block(req, src, TierKind.DEVICE, src)
                plan.demotions.append(Move(block, MoveKind.DEMOTE, TierKind.DEVICE, src,
                                           TierKind.HOST, int(dst), True))
            return plan

        plans = {"runs": plan_for(range(num_pages)),
                 "scattered": plan_for(np.random.default_rng(0).permutation(num_pages))}
        best = {name: float("inf") for name in (*plans, "numpy")}
        for _ in range(repeats):
            for name, plan in plans.items():
                t0 = time.perf_counter()
                copier.copy_plan(plan)
                best[name] = min(best[name], time.perf_counter() - t0)
            t0 = time.perf_counter()
            if gpu:
                device.pages.get(out=host.pages)  # one copy of every byte, device to host
            else:
                np.copyto(host.pages, device.pages)
            best["numpy"] = min(best["numpy"], time.perf_counter() - t0)
        assert (host.pages == 7).all()
        total = num_pages * page_bytes
        return {"copy_bytes": total, "kvd_copy_gbps": total / best["runs"] / 1e9,
                "kvd_copy_scattered_gbps": total / best["scattered"] / 1e9,
                "numpy_copyto_gbps": total / best["numpy"] / 1e9}
    finally:
        device.close()
        host.close()


def bench_victims(sizes=(10_000, 1_000_000), churn: int = 20_000) -> dict:
    """Victim selection time (choose(1)) at each resident size, while victims are evicted and
    fresh blocks inserted between choices as the pool would (that bookkeeping is not timed)."""
    from kvd.core.blocks import Block, Request, RequestState, TierKind
    from kvd.core.clock import FakeClock
    from kvd.core.policies import make_policy, policy_names

    class OneTenant:
        """fair over one tenant: it always pays (the cost measured is the machinery)."""

        engine_held: dict = {}

        def usage(self, tenant):
            return 2 * max(sizes)

        def fair_share(self, tenant):
            return 1.0

        def guaranteed(self, tenant):
            return 0

    out = {}
    rng = np.random.default_rng(1)
    for name in policy_names():
        if name.startswith("fair:"):
            continue  # fair over each base costs the same as fair over reuse plus that base
        runs = []  # (size, policy, the blocks to insert next)
        for size in sizes:
            clock = FakeClock()
            policy = make_policy(name, clock, OneTenant())
            # 64-block requests, as a pool full of sequences holds them.
            reqs = [Request(f"v{j}", "t", "p", 0, 64, RequestState.ADMITTED)
                    for j in range((size + churn) // 64 + 1)]
            deadlines = rng.random(size + churn)
            blocks = [Block(reqs[i // 64], i, TierKind.DEVICE, i, own_access=float(i),
                            own_reuse_s=float(deadlines[i]), deadline_at=float(deadlines[i]),
                            request_priority=i % 100)
                      for i in range(size + churn)]
            for b in blocks[:size]:
                policy.insert(b)
            runs.append((size, policy, iter(blocks[size:])))
        best = dict.fromkeys(sizes, float("inf"))
        clock_ = time.perf_counter
        # The fastest of five passes at each size (timing noise only adds), the sizes'
        # passes in turns: the machine's drift over the run falls on both alike.
        for _ in range(5):
            for size, policy, spare in runs:
                spent = 0.0
                for _ in range(churn // 5):
                    t0 = clock_()
                    (victim,) = policy.choose(1)  # victim selection: what is timed
                    spent += clock_() - t0
                    policy.remove(victim)  # the pool's bookkeeping after it, untimed
                    policy.insert(next(spare))
                best[size] = min(best[size], spent / (churn // 5) * 1e6)
        for size in sizes:
            out[f"{name}@{size}"] = best[size]
        del runs
    return out


async def bench_intent_updates(messages: int = 300, per_message: int = 256) -> dict:
    """Intent updates per second on one Step stream: each message re-prioritises
    `per_message` resident blocks (and sets their deadlines), pipelined as an engine would."""
    args = ("--page-bytes", "4096", "--device-pages", "4096", "--host-pages", "4096",
            "--policy", "intent")
    with LocalKvd(*args) as kvd:
        async with AsyncClient(kvd.target) as client:
            rids = [f"s{i}" for i in range(64)]
            for rid in rids:
                await client.admit(rid, 4 * 16)
                await client.allocate(rid, 4)
            targets = [(rid, b) for rid in rids for b in range(4)]
            steps = []
            for m in range(messages):
                priority = pb.PRIORITY_HOT if m % 2 else pb.PRIORITY_WARM
                steps.append(pb.StepRequest(intents=[
                    pb.IntentUpdate(request_id=rid, block_index=b, intent=pb.MemoryIntent(
                        priority=priority, deadline_us=1000 * (m + b)))
                    for rid, b in targets[:per_message]]))
            errors = []
            async with client.step_stream() as stream:
                started = time.perf_counter()
                await stream.pipeline(steps, lambda req, reply: errors.extend(reply.errors))
                elapsed = time.perf_counter() - started
            assert not errors, errors[:3]
    return {"intent_updates_per_s": messages * per_message / elapsed,
            "intent_updates_per_message": per_message}


def bench_kv_events(batches: int = 2000, per_batch: int = 64, lose_every: int = 50) -> dict:
    """KV cache events a running kvd applies per second from an engine's publisher (the
    wire format of vLLM's and SGLang's), with one batch in `lose_every` kept off the PUB
    socket (as the network would drop it) and recovered from the replay socket."""
    import msgpack
    import zmq

    with tempfile.TemporaryDirectory(prefix="kvd-events-") as tmp:
        endpoint, replay = f"ipc://{tmp}/pub", f"ipc://{tmp}/replay"
        ctx = zmq.Context()
        pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
        pub.bind(endpoint)
        router.bind(replay)
        config = Path(tmp) / "kvd.toml"
        config.write_text('[[pool]]\nmodel = "tiny"\ndevice_pages = 64\nhost_pages = 64\n'
                          f'[[engine]]\nname = "e"\nendpoint = "{endpoint}"\n'
                          f'replay_endpoint = "{replay}"\n')
        port = _free_port()
        try:
            with LocalKvd("--config", str(config), "--metrics", f"127.0.0.1:{port}"):
                time.sleep(0.5)  # the SUB joins (a miss would only add a replay)
                sent = []
                started = time.perf_counter()
                for seq in range(batches):
                    events = [{"type": "BlockStored", "block_hashes": [seq * per_batch + i],
                               "medium": "GPU"} for i in range(per_batch)]
                    payload = msgpack.packb([time.time(), events, 0])
                    sent.append(payload)
                    if seq % lose_every != lose_every - 1:
                        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
                    _serve_replays(router, sent)
                applied = replayed = 0
                while applied < batches:
                    _serve_replays(router, sent)  # kvd asks for the last lost one when quiet
                    applied, replayed = _event_batches(port)
                    if time.perf_counter() - started > 120:
                        break
                    time.sleep(0.005)
                elapsed = time.perf_counter() - started
        finally:
            pub.close(0)
            router.close(0)
            ctx.term()
    return {"kv_events_per_s": applied * per_batch / elapsed, "kv_event_batches": applied,
            "kv_event_batches_replayed": replayed,
            "kv_event_batches_dropped": batches // lose_every}


def _serve_replays(router, sent: list[bytes]) -> None:
    """Answer the replay requests waiting, as vLLM's publisher does: every batch from the
    start asked, then sequence -1."""
    while router.poll(0):
        client, _, start = router.recv_multipart()
        for seq in range(int.from_bytes(start, "big"), len(sent)):
            router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), sent[seq]])
        router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])


def _event_batches(port: int) -> tuple[int, int]:
    """(batches applied, of them replayed) from kvd's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    outcomes = {s.labels.get("outcome"): s.value
                for f in text_string_to_metric_families(text.decode())
                for s in f.samples if s.name == "kvd_engine_event_batches_total"}
    return int(outcomes.get("live", 0) + outcomes.get("replayed", 0)), int(
        outcomes.get("replayed", 0))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_bench(args) -> int:
    from kvd_loadgen.cli import write_json

    quick = getattr(args, "quick", False)
    n_unary, n_stream = (1000, 300) if quick else (5000, 2000)
    results: dict = {"machine": machine(), "concurrency": CONCURRENCY}
    # Each round starts fresh servers and pairs every kvd figure with the empty server's
    # (see _paired_rates); the ratios are the median over rounds of each round's ratio.
    rounds = 1 if quick else 3
    runs: list[dict] = []
    for r in range(rounds):
        with console.status(f"round {r + 1}/{rounds}: unary calls and the Step stream, kvd "
                            "and the empty server in turns"):
            runs.append(eventloop.run(bench_pair(n_unary, n_stream, 64, 4)))
    with console.status("intent updates on the Step stream"):
        results["intent_updates"] = eventloop.run(bench_intent_updates())
    with console.status("engines' KV cache events into kvd"):
        results["kv_events"] = bench_kv_events(batches=500 if quick else 2000)
    results.update(split_runs(runs), rounds=rounds)
    with console.status("tier copies"):
        results["copies"] = bench_copies(num_pages=32 if quick else 128)
        from kvd.memory.cuda import gpu_available

        if gpu_available():  # the same on a GPU: a device tier in GPU memory
            results["copies_gpu"] = bench_copies(num_pages=32 if quick else 128, gpu=True)
    with console.status("victim selection"):
        results["victims_us"] = bench_victims(
            sizes=(10_000, 100_000) if quick else (10_000, 1_000_000),
            churn=6_000 if quick else 30_000)
    results["ratios"] = ratios_of(results, runs)
    results["targets"] = judge(results["ratios"])
    with console.status("a node's worth of engines: 1, 2, 4, 8 Step streams, kvd and the "
                        "empty server in turns"):
        from kvd_loadgen.bench_engines import bench_engines, targets as engine_targets

        results["engines"] = eventloop.run(bench_engines(seconds=1.0 if quick else 2.0,
                                                      rounds=1 if quick else 2))
    more = engine_targets(results["engines"])
    with console.status("a step's cost over a long run: one engine, 40,000 steps, early "
                        "against late"):
        from kvd_loadgen.bench_history import bench_step_history, targets as history_targets

        results["step_history"] = eventloop.run(bench_step_history(
            steps=12_000 if quick else 40_000, window=2_000 if quick else 4_000))
    more.update(history_targets(results["step_history"]))
    with console.status("what one engine holds against another client's calls: 512 and "
                        "65,536 blocks read a step"):
        from kvd_loadgen.bench_held import bench_held_reads, targets as held_targets

        results["held_reads"] = eventloop.run(bench_held_reads(
            allocations=80 if quick else 200))
    more.update(held_targets(results["held_reads"]))
    with console.status("a long context's engine against another tenant's calls: 65,536 "
                        "blocks read a step, under each policy"):
        from kvd_loadgen.bench_whale_loop import bench_whale_loop, targets as loop_targets

        results["long_engine"] = eventloop.run(bench_whale_loop(
            seconds=1.5 if quick else 3.0))
    more.update(loop_targets(results["long_engine"]))
    with console.status("one tenant's big calls against another's: a 1M-token request's "
                        "life, a 1M-token prompt's prefix blocks', and a 1M-token request "
                        "swapped out and read back, in single calls, under each policy"):
        from kvd_loadgen.bench_big_calls import bench_big_calls, targets as big_targets

        results["big_calls"] = eventloop.run(bench_big_calls(seconds=2.0 if quick else 4.0))
    more.update(big_targets(results["big_calls"]))
    with console.status("the longest call on a policy's queues while stale entries pile up "
                        "and are compacted: 131,072 blocks, LRU and intent"):
        from kvd_loadgen.bench_queues import bench_queues, targets as queue_targets

        results["queues"] = bench_queues(seconds=3.0 if quick else 6.0)
    more.update(queue_targets(results["queues"]))
    if not quick:
        from kvd_loadgen.bench_overload import run_overload, targets as overload_targets

        results["overload"] = run_overload(console)
        more.update(overload_targets(results["overload"]))
        from kvd_loadgen.soak import SOAK_CLIENTS, SOAK_S, run_soak, targets as soak_targets

        with console.status(f"soak: {SOAK_CLIENTS} clients for {SOAK_S:.0f} s, kvd's "
                            "memory over time"):
            soak = eventloop.run(run_soak(SOAK_CLIENTS, SOAK_S, "fair", 30.0))
        more.update(soak_targets(soak))
        results["soak"] = {k: v for k, v in soak.items() if k != "rss_mib"}
    with console.status("intent traces under every policy against Belady's MIN (64 and 96 "
                        "device pages)"):
        from kvd_loadgen.replay import against_min, against_min_targets

        results["against_min"] = eventloop.run(against_min())
    more.update(against_min_targets(results["against_min"]))
    for key, target in more.items():
        results["ratios"][key] = target["measured"]
        if "op" in target:  # else reported only
            results["targets"][key] = {"op": target["op"], "value": target["value"],
                                       "met": target["met"]}
    print_tables(results, console)
    if not quick:
        results["scenarios"] = run_scenarios(console)
    write_json(args.json, results)
    if args.json is not None:
        path = args.json.with_name("RESULTS.md")
        path.write_text(results_markdown(results))
        console.print(f"wrote {args.json} and {path}")
    return 0
