"""What a long context's engine costs another tenant's calls on the same kvd: tenant `a`'s
engine steps on one 65,536-block request as fast as kvd answers (each step reads it whole,
every 16th grows it by a block), while tenant `b`'s client, in a process of its own, reads
a resident 4-block request (Access) every 2 ms. b's Access latency beside the stepping
engine, and in the second before it starts (alone), under each policy. Target: b's p99
beside the engine <= 5 ms under every policy.

kvd runs every tenant's calls on one event loop, so whatever a step costs kvd in one go,
every other call waits for. Recording each step's read block by block (a block's recency,
the policy's order) and, under `fair`, where a request over its share reads through the
general path every step (the refill takes some of its blocks, its read brings them back),
finding the blocks it misses, those that moved and the policy's order by looking at each
of its blocks, made b's Access wait 27.6 ms at the median under `lru` and 10 ms (p99 61 ms)
under `fair`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvd_api.v1 import kvd_pb2 as pb
from kvd_client import AsyncClient
from kvd_loadgen.engine import percentile
from kvd_loadgen.local import LocalKvd

TARGET_MS = 5.0
POLICIES = ("lru", "intent", "deadline", "regret", "reuse", "fair")
BLOCKS = 65_536
GROW_EVERY = 16  # steps
PING_S = 0.002  # between b's reads
ALONE_S = 2.0  # b's reads before a steps


def _config(path: Path, policy: str, blocks: int) -> None:
    path.write_text(
        "[[pool]]\n"
        'name = "default"\n'
        "page_bytes = 4096\n"
        f"device_pages = {blocks + 1024}\n"
        f"host_pages = {blocks + 1024}\n"
        f'policy = "{policy}"\n'
        "[[tenant]]\n"
        'name = "a"\n'
        'token = "ta"\n'
        "[[tenant]]\n"
        'name = "b"\n'
        'token = "tb"\n')


async def _ping(target: str, seconds: float, out: str) -> None:
    """b's client: an Access of its request every PING_S for `seconds`; writes each read's
    (start, end) wall-clock times to `out` (JSON)."""
    async with AsyncClient(target, token="tb", timeout_s=60) as b:
        spans = []
        until = time.time() + seconds
        while time.time() < until:
            started = time.time()
            await b.access("b0")
            spans.append((started, time.time()))
            await asyncio.sleep(PING_S)
    Path(out).write_text(json.dumps(spans))


async def _run(policy: str, blocks: int, seconds: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvd-whale-loop-") as tmp:
        config = Path(tmp) / "kvd.toml"
        _config(config, policy, blocks)
        spans_file = Path(tmp) / "spans.json"
        with LocalKvd("--config", str(config), workdir=tmp) as kvd:
            async with (AsyncClient(kvd.target, token="ta", timeout_s=120) as a,
                        AsyncClient(kvd.target, token="tb", timeout_s=60) as b):
                await b.admit("b0", 16 * 4)
                await b.allocate("b0", 4)
                await a.admit("long", 16 * (blocks + 600))
                for start in range(0, blocks, 512):
                    await a.allocate("long", min(512, blocks - start))
                pinger = subprocess.Popen(
                    [sys.executable, "-m", "kvd_loadgen.bench_whale_loop", "--ping",
                     kvd.target, str(ALONE_S + seconds + 0.5), str(spans_file)])
                try:
                    await asyncio.sleep(ALONE_S)
                    steps = 0
                    t0 = time.time()
                    async with a.step_stream() as stream:
                        while time.time() < t0 + seconds:
                            steps += 1
                            grow = ([pb.AllocateRequest(request_id="long", num_blocks=1)]
                                    if steps % GROW_EVERY == 0 else [])
                            reply = await stream.send(pb.StepRequest(
                                step_id=steps, read_all=["long"], allocations=grow))
                            if reply.errors:
                                raise RuntimeError(f"a step failed: {reply.errors[0]}")
                    t1 = time.time()
                finally:
                    if pinger.wait(timeout=60) != 0:
                        raise RuntimeError("b's client failed")
            async with AsyncClient(kvd.target) as admin:  # a unix caller with no token
                check = await admin.self_check()
            assert check.ok, check.problems
        spans = json.loads(spans_file.read_text())
    first = spans[0][0]
    alone = [e - s for s, e in spans if s >= first + 0.5 and e < t0]  # past its warm-up
    beside = [e - s for s, e in spans if e > t0 and s < t1]
    return {"steps_per_s": steps / (t1 - t0), "reads": len(beside),
            "alone_p50_ms": percentile(alone, 50) * 1e3,
            "alone_p99_ms": percentile(alone, 99) * 1e3,
            "p50_ms": percentile(beside, 50) * 1e3, "p99_ms": percentile(beside, 99) * 1e3}


async def bench_whale_loop(policies=POLICIES, blocks: int = BLOCKS,
                           seconds: float = 3.0) -> dict:
    """Each policy's run: a's steps a second, b's reads beside them, and b's Access p50 and
    p99 (ms) beside a's steps and alone."""
    return {policy: await _run(policy, blocks, seconds) for policy in policies}


def targets(result: dict) -> dict[str, dict]:
    return {f"long_engine_{policy}_other_tenant_access_p99_ms": {
        "op": "<=", "value": TARGET_MS, "measured": row["p99_ms"],
        "met": row["p99_ms"] <= TARGET_MS} for policy, row in result.items()}


def main() -> None:
    if sys.argv[1:2] == ["--ping"]:
        from kvd_client import eventloop

        target, seconds, out = sys.argv[2], float(sys.argv[3]), sys.argv[4]
        eventloop.run(_ping(target, seconds, out))
        return
    from kvd_client import eventloop

    result = eventloop.run(bench_whale_loop())
    print(f"{'policy':10} {'a steps/s':>10} {'b p50 / p99 ms beside':>22} "
          f"{'b p50 / p99 ms alone':>21}")
    for policy, r in result.items():
        print(f"{policy:10} {r['steps_per_s']:10,.0f} "
              f"{r['p50_ms']:10.2f} / {r['p99_ms']:<9.2f} "
              f"{r['alone_p50_ms']:9.2f} / {r['alone_p99_ms']:.2f}")
    for name, t in targets(result).items():
        print(f"{name}: {t['measured']:.2f} {t['op']} {t['value']}: "
              f"{'met' if t['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
