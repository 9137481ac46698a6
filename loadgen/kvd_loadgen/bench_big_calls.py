"""What one tenant's big calls cost another tenant's on the same kvd: tenant `a`'s client
goes round a 1M-token request's life in single calls, as fast as kvd answers (admit it,
allocate its 65,536 blocks in one call, read them all, free every other one, allocate half
back, release it), while tenant `b`'s client, in a process of its own, reads a resident
4-block request (Access) every 2 ms. b's Access latency beside a's calls, and in the
seconds before they start (alone), under each policy. Target: b's p99 beside a's calls
<= 50 ms under every policy.

kvd serves every call on one event loop. Each of a's calls costs it a few microseconds a
block, a third of a second in all for 65,536 of them; done whole, b's read waited for all
of it. kvd does such calls a slice of blocks at a time (`slice_blocks`), the loop served
between slices, and ends the holds of a's calls so too. What b still waits for past a
slice is mostly Python's full garbage collection, which a's churn of blocks sets off a few
times a second and which walks every object kvd holds (20-50 ms with 130,000 blocks alive
on a 2-core machine): the target is that bound, not a slice's.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvd_client import AsyncClient
from kvd_loadgen.engine import percentile
from kvd_loadgen.local import LocalKvd

TARGET_MS = 50.0
POLICIES = ("lru", "intent", "deadline", "regret", "reuse", "fair")
BLOCKS = 65_536
PING_S = 0.002  # between b's reads
ALONE_S = 2.0  # b's reads before a's calls


def _config(path: Path, policy: str, blocks: int) -> None:
    path.write_text(
        "[[pool]]\n"
        'name = "default"\n'
        "page_bytes = 4096\n"
        "block_tokens = 16\n"
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


async def _life(a: AsyncClient, rid: str, blocks: int) -> int:
    """One round of a's request's life in single calls; the calls made."""
    await a.admit(rid, 16 * blocks)
    handles = (await a.allocate(rid, blocks)).handles
    if len(handles) != blocks:
        raise RuntimeError(f"allocated {len(handles)} of {blocks} blocks")
    if len((await a.access(rid)).handles) != blocks:
        raise RuntimeError("a read of the whole request came back short")
    await a.free(rid, list(range(0, blocks, 2)))
    await a.allocate(rid, blocks // 2)
    await a.release(rid)
    return 6


async def _run(policy: str, blocks: int, seconds: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvd-big-calls-") as tmp:
        config = Path(tmp) / "kvd.toml"
        _config(config, policy, blocks)
        spans_file = Path(tmp) / "spans.json"
        with LocalKvd("--config", str(config), workdir=tmp) as kvd:
            async with (AsyncClient(kvd.target, token="ta", timeout_s=120) as a,
                        AsyncClient(kvd.target, token="tb", timeout_s=60) as b):
                await b.admit("b0", 16 * 4)
                await b.allocate("b0", 4)
                pinger = subprocess.Popen(
                    [sys.executable, "-m", "kvd_loadgen.bench_big_calls", "--ping",
                     kvd.target, str(ALONE_S + seconds + 0.5), str(spans_file)])
                try:
                    await asyncio.sleep(ALONE_S)
                    calls = rounds = 0
                    t0 = time.time()
                    while time.time() < t0 + seconds:
                        calls += await _life(a, f"long{rounds}", blocks)
                        rounds += 1
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
    return {"rounds": rounds, "a_call_ms": (t1 - t0) / calls * 1e3, "reads": len(beside),
            "alone_p50_ms": percentile(alone, 50) * 1e3,
            "alone_p99_ms": percentile(alone, 99) * 1e3,
            "p50_ms": percentile(beside, 50) * 1e3, "p99_ms": percentile(beside, 99) * 1e3,
            "max_ms": max(beside) * 1e3}


async def bench_big_calls(policies=POLICIES, blocks: int = BLOCKS,
                          seconds: float = 4.0) -> dict:
    """Each policy's run: a's rounds and its mean call time, b's reads beside them, and b's
    Access p50, p99 and worst (ms) beside a's calls, and alone."""
    return {policy: await _run(policy, blocks, seconds) for policy in policies}


def targets(result: dict) -> dict[str, dict]:
    return {f"big_calls_{policy}_other_tenant_access_p99_ms": {
        "op": "<=", "value": TARGET_MS, "measured": row["p99_ms"],
        "met": row["p99_ms"] <= TARGET_MS} for policy, row in result.items()}


def main() -> None:
    from kvd_client import eventloop

    if sys.argv[1:2] == ["--ping"]:
        target, seconds, out = sys.argv[2], float(sys.argv[3]), sys.argv[4]
        eventloop.run(_ping(target, seconds, out))
        return
    result = eventloop.run(bench_big_calls())
    print(f"{'policy':10} {'a rounds':>8} {'a ms/call':>9} {'b reads':>7} "
          f"{'b p50 / p99 / max ms beside':>28} {'b p50 / p99 ms alone':>21}")
    for policy, r in result.items():
        print(f"{policy:10} {r['rounds']:8} {r['a_call_ms']:9.1f} {r['reads']:7} "
              f"{r['p50_ms']:8.2f} / {r['p99_ms']:6.2f} / {r['max_ms']:<7.1f} "
              f"{r['alone_p50_ms']:9.2f} / {r['alone_p99_ms']:.2f}")
    for name, t in targets(result).items():
        print(f"{name}: {t['measured']:.2f} {t['op']} {t['value']}: "
              f"{'met' if t['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
