"""A node's worth of engines on one kvd: N engines (N = 1, 2, 4, 8), each with a Step stream
of its own on a channel of its own, against the empty gRPC server with the same N streams,
in the same run (kvd and the empty server in turns).

Each engine runs 64 requests of 4 blocks; every step reads every block of every request
(`read_all`), grows one request by a block and frees the block that request grew by 64 steps
before (decode growth at a steady footprint), and every fourth step updates one block's
intent. The empty server gets the same engines' messages (each built the same way, so both
runs pay the engine's own work) and answers each with a two-byte reply.

- Saturated: each stream sends its next step as soon as the last is answered, for a while;
  aggregate steps/s of kvd against the empty server's (target >= 0.7x at each N). Beside
  it (reported): the same engines' decode steps that need no new block, the step_id and
  the same batch read and nothing else, on both servers in the same turns. What kvd keeps
  of the empty server's rate there is what its gRPC layer and its reads cost; the gap
  between that and the full steps is what the block grown, the block freed and the intent
  update cost kvd's bookkeeping.
- Paced: 8 engines at 50 steps/s each, in lock-step (every engine sends at the same
  instants, so a step waits behind all the others'); each step's round trip on kvd against
  the empty server's at the same pace (target: p99 added latency <= 2 ms). Reported beside
  it: the same engines with their steps spread evenly over the period, as engines with
  clocks of their own step.

Each server's CPU time per step (its process's user + system time over the steps it
served, read from /proc) says where the gap is: what gRPC costs the empty server, and what
kvd spends on top of it; and its main thread's, which runs the event loop and every handler
one at a time (gRPC's own threads do the socket work beside it): what each server does in
the one thread no second core can share.

- Work budget: at the most streams, the empty server also answers through handlers that spend
  a fixed CPU time on each step (`Work<us>`, see echo_server), in the same turns. Where its
  ratio crosses the target is what a step may cost a server's handler on this machine for the
  target to hold; where it crosses kvd's ratio is what kvd's steps cost, in the same terms.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from kvd_api.v1 import kvd_pb2 as pb
from kvd_client import AsyncClient
from kvd_loadgen.local import LocalKvd
from kvd_loadgen.measures import cpu_s

REQUESTS, BLOCKS = 64, 4
ECHO = "/kvd.bench.Echo/Ack"  # answers each message with a reply as small as kvd's
WORK = "/kvd.bench.Echo/Work{}"  # the same, after that many us of CPU time a message
WORK_US = (30, 60, 120, 180)
TARGET = 0.7


class Engine:
    """One engine's requests and its next Step message (`seen` learns the indices of the
    blocks its steps allocated from the replies)."""

    def __init__(self, name: str) -> None:
        self.rids = [f"{name}-r{i}" for i in range(REQUESTS)]
        self.step = 0
        self.grown: dict[str, list[int]] = {rid: [] for rid in self.rids}

    def message(self) -> bytes:
        self.step += 1
        rid = self.rids[self.step % REQUESTS]
        frees = []
        if self.grown[rid]:  # the block it grew by one round ago
            frees = [pb.FreeRequest(request_id=rid, block_indices=[self.grown[rid].pop(0)])]
        intents = ([pb.IntentUpdate(request_id=rid, block_index=0,
                                    intent=pb.MemoryIntent(request_priority=self.step % 100))]
                   if self.step % 4 == 0 else [])
        return pb.StepRequest(step_id=self.step, read_all=self.rids, frees=frees,
                              allocations=[pb.AllocateRequest(request_id=rid, num_blocks=1)],
                              intents=intents).SerializeToString()

    def seen(self, reply: pb.StepResponse) -> None:
        for handle in reply.allocated[:]:  # a slice: upb's containers have no __iter__
            self.grown[handle.request_id].append(handle.block_index)


def decode_message(engine: Engine) -> bytes:
    """The engine's next step when none of its requests needs a new block: the step_id and
    the batch it reads, nothing else."""
    engine.step += 1
    return pb.StepRequest(step_id=engine.step, read_all=engine.rids).SerializeToString()


class EchoEngine(Engine):
    """The same engine against the empty server: it builds the same messages (the block it
    grew by is made up, as no reply hands one out), so both runs pay the engine's own work."""

    def message(self) -> bytes:
        data = super().message()
        self.grown[self.rids[self.step % REQUESTS]].append(BLOCKS + self.step)
        return data


async def _closed_loop(call, make, seconds: float, seen=None) -> int:
    """Steps one stream completes in `seconds`, one in flight."""
    n = 0
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        await call.write(make())
        reply = await call.read()
        if seen is not None:
            if reply.errors:
                raise RuntimeError(f"a step failed: {reply.errors[0]}")
            seen(reply)
        n += 1
    return n


async def _paced(call, make, rate: float, seconds: float, seen=None,
                 offset: float = 0.0) -> list[float]:
    """Round trips of one stream sending `rate` steps a second, the first `offset` seconds
    from now."""
    out = []
    period = 1 / rate
    next_at = time.perf_counter() + offset
    until = next_at + seconds
    while next_at < until:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        t0 = time.perf_counter()
        await call.write(make())
        reply = await call.read()
        out.append(time.perf_counter() - t0)
        if seen is not None:
            seen(reply)
        next_at += period
    return out


class _Cpu:
    """A server's CPU time (seconds) over the turns measured inside `with`: its process's,
    and its main thread's (None where /proc has none)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.process: float | None = 0.0
        self.main: float | None = 0.0

    def __enter__(self) -> None:
        self._at = (cpu_s(self.pid), cpu_s(self.pid, main_thread=True))

    def __exit__(self, *exc) -> None:
        now = (cpu_s(self.pid), cpu_s(self.pid, main_thread=True))
        (p0, m0), (p1, m1) = self._at, now
        self.process = None if None in (self.process, p0, p1) else self.process + p1 - p0
        self.main = None if None in (self.main, m0, m1) else self.main + m1 - m0


def _us_per_step(cpu_s: float | None, steps: int) -> float | None:
    return None if cpu_s is None or not steps else cpu_s / steps * 1e6


@contextlib.asynccontextmanager
async def _echo(n: int):
    """The empty server in its own process (its pid first), and n channels to it."""
    with tempfile.TemporaryDirectory(prefix="kvd-echo-") as tmp:
        sock = Path(tmp) / "echo.sock"
        proc = subprocess.Popen([sys.executable, "-m", "kvd_loadgen.echo_server",
                                 "--socket", str(sock)])
        channels = []
        try:
            for _ in range(200):
                if sock.exists():
                    break
                await asyncio.sleep(0.05)
            for _ in range(n):
                channel = grpc.aio.insecure_channel(f"unix://{sock}")
                await channel.channel_ready()
                channels.append(channel)
            yield proc.pid, channels
        finally:
            for channel in channels:
                await channel.close()
            proc.terminate()
            proc.wait()


def work_at(points: list[tuple[float, float]], ratio: float) -> float | None:
    """The handler cost (us a step) at which the empty server's throughput ratio reaches
    `ratio`, interpolated along `points` ((us, ratio), by us; (0, 1) comes first); None when
    the ratio is past the last point."""
    points = [(0.0, 1.0), *sorted(points)]
    if ratio >= 1.0:
        return 0.0
    for (u0, r0), (u1, r1) in zip(points, points[1:]):
        if r1 <= ratio <= r0 and r0 > r1:
            return u0 + (u1 - u0) * (r0 - ratio) / (r0 - r1)
    return None


async def bench_engines(ns=(1, 2, 4, 8), seconds: float = 2.0, rounds: int = 2,
                        paced_engines: int = 8, rate: float = 50.0,
                        paced_seconds: float = 4.0, work_us=WORK_US,
                        kvd_args: tuple[str, ...] = ()) -> dict:
    most = max(max(ns), paced_engines)
    out: dict = {"saturated": {}, "paced": {}}
    args = ("--page-bytes", "4096", "--device-pages", "65536", "--host-pages", "65536",
            "--policy", "fair", *kvd_args)
    async with _echo(most) as (echo_pid, echo_channels):
        with LocalKvd(*args) as kvd:
            clients = [AsyncClient(kvd.target, timeout_s=30) for _ in range(most)]
            for c in clients:
                await c.__aenter__()
            try:
                engines = [Engine(f"e{i}") for i in range(most)]
                for client, engine in zip(clients, engines):
                    for rid in engine.rids:
                        await client.admit(rid, 2 * BLOCKS * 16)  # room to grow by one
                        await client.allocate(rid, BLOCKS)
                # Each engine's stream with its client's lease, as StepStream opens it: an
                # open stream holds the lease while the engine waits out the other turns.
                kvd_calls = [c.channel.stream_stream("/kvd.v1.Memory/Step",
                                                     request_serializer=None,
                                                     response_deserializer=pb.StepResponse
                                                     .FromString)(metadata=c.metadata)
                             for c in clients]
                echoes = [EchoEngine(f"e{i}") for i in range(most)]
                echo_calls = [ch.stream_stream(ECHO)() for ch in echo_channels]
                kvd_pid = kvd.proc.pid
                for n in ns:
                    kvd_steps = echo_steps = 0
                    kvd_s = echo_s = 0.0
                    kvd_cpu, echo_cpu = _Cpu(kvd_pid), _Cpu(echo_pid)
                    decode_cpu = {"kvd": _Cpu(kvd_pid), "empty": _Cpu(echo_pid)}
                    decode_steps = {"kvd": 0, "empty": 0}
                    decode_s = {"kvd": 0.0, "empty": 0.0}
                    work_steps = dict.fromkeys(work_us if n == max(ns) else (), 0)
                    work_s = dict.fromkeys(work_steps, 0.0)
                    for _ in range(rounds):
                        for us in work_steps:  # the empty server with a handler's cost
                            calls = [ch.stream_stream(WORK.format(us))()
                                     for ch in echo_channels[:n]]
                            t0 = time.perf_counter()
                            work_steps[us] += sum(await asyncio.gather(*(
                                _closed_loop(calls[i], echoes[i].message, seconds)
                                for i in range(n))))
                            work_s[us] += time.perf_counter() - t0
                            for call in calls:
                                await call.done_writing()
                        t0 = time.perf_counter()
                        with kvd_cpu:
                            kvd_steps += sum(await asyncio.gather(*(
                                _closed_loop(kvd_calls[i], engines[i].message, seconds,
                                             engines[i].seen)
                                for i in range(n))))
                        kvd_s += time.perf_counter() - t0
                        t0 = time.perf_counter()
                        with echo_cpu:
                            echo_steps += sum(await asyncio.gather(*(
                                _closed_loop(echo_calls[i], echoes[i].message, seconds)
                                for i in range(n))))
                        echo_s += time.perf_counter() - t0
                        for name, calls, engines_of in (("kvd", kvd_calls, engines),
                                                        ("empty", echo_calls, echoes)):
                            t0 = time.perf_counter()
                            with decode_cpu[name]:
                                decode_steps[name] += sum(await asyncio.gather(*(
                                    _closed_loop(calls[i], functools.partial(
                                        decode_message, engines_of[i]), seconds / 2,
                                        engines_of[i].seen if name == "kvd" else None)
                                    for i in range(n))))
                            decode_s[name] += time.perf_counter() - t0
                    out["saturated"][n] = {
                        "kvd_steps_per_s": kvd_steps / kvd_s,
                        "empty_steps_per_s": echo_steps / echo_s,
                        "kvd_server_us_per_step": _us_per_step(kvd_cpu.process, kvd_steps),
                        "empty_server_us_per_step": _us_per_step(echo_cpu.process, echo_steps),
                        "kvd_main_us_per_step": _us_per_step(kvd_cpu.main, kvd_steps),
                        "empty_main_us_per_step": _us_per_step(echo_cpu.main, echo_steps),
                        "kvd_decode_steps_per_s": decode_steps["kvd"] / decode_s["kvd"],
                        "empty_decode_steps_per_s": decode_steps["empty"] / decode_s["empty"],
                        "kvd_decode_main_us_per_step": _us_per_step(decode_cpu["kvd"].main,
                                                                    decode_steps["kvd"])}
                    if work_steps:
                        empty = echo_steps / echo_s
                        points = [(us, work_steps[us] / work_s[us] / empty)
                                  for us in work_steps]
                        kvd_ratio = kvd_steps / kvd_s / empty
                        out["budget"] = {"streams": n, "points": points,
                                         "target_us": work_at(points, TARGET),
                                         "kvd_us": work_at(points, kvd_ratio)}
                spread = [i / (paced_engines * rate) for i in range(paced_engines)]
                for name, offsets in (("paced", [0.0] * paced_engines),
                                      ("paced_spread", spread)):
                    kvd_rt = await asyncio.gather(*(
                        _paced(kvd_calls[i], engines[i].message, rate, paced_seconds,
                               engines[i].seen, offsets[i])
                        for i in range(paced_engines)))
                    echo_rt = await asyncio.gather(*(
                        _paced(echo_calls[i], echoes[i].message, rate, paced_seconds,
                               offset=offsets[i])
                        for i in range(paced_engines)))
                    out[name] = {"engines": paced_engines, "rate": rate,
                                 **_round_trips(kvd_rt, echo_rt)}
                for call in (*kvd_calls, *echo_calls):
                    await call.done_writing()
                check = await clients[0].self_check()
                assert check.ok, check.problems
            finally:
                for c in clients:
                    with contextlib.suppress(Exception):
                        await c.__aexit__(None, None, None)
    return out


def _round_trips(kvd_rt: list[list[float]], echo_rt: list[list[float]]) -> dict:
    """p50 and p99 round trips (ms) of the paced streams on kvd and on the empty server,
    and the p99 kvd adds."""
    k = sorted(x for xs in kvd_rt for x in xs)
    e = sorted(x for xs in echo_rt for x in xs)

    def p(xs, q):
        return xs[int(q * (len(xs) - 1))] * 1e3

    return {"kvd_p50_ms": statistics.median(k) * 1e3, "kvd_p99_ms": p(k, 0.99),
            "empty_p50_ms": statistics.median(e) * 1e3, "empty_p99_ms": p(e, 0.99),
            "p99_added_ms": p(k, 0.99) - p(e, 0.99)}


def targets(result: dict) -> dict[str, dict]:
    """Each target with its value and whether it was met."""
    out = {}
    for n, r in result["saturated"].items():
        ratio = r["kvd_steps_per_s"] / r["empty_steps_per_s"]
        out[f"engines{n}_steps_vs_empty"] = {"op": ">=", "value": TARGET, "measured": ratio,
                                             "met": ratio >= TARGET}
        if "kvd_decode_steps_per_s" in r:  # reported beside the target: no target of its own
            out[f"engines{n}_decode_steps_vs_empty"] = {
                "measured": r["kvd_decode_steps_per_s"] / r["empty_decode_steps_per_s"]}
    added = result["paced"]["p99_added_ms"]
    out[f"engines{result['paced']['engines']}_paced_p99_added_ms"] = {"op": "<=", "value": 2.0, "measured": added,
                                          "met": added <= 2.0}
    if "paced_spread" in result:  # reported beside the target: no target of its own
        spread = result["paced_spread"]
        out[f"engines{spread['engines']}_paced_spread_p99_added_ms"] = {
            "measured": spread["p99_added_ms"]}
    return out
