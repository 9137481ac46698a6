"""Another tenant's reads beside a load, for the benches that time what one tenant's work on
kvd costs another's calls: kvd's config with tenants `a` (the load) and `b` (the reader),
b's client in a process of its own reading a resident 4-block request (Access) every
PING_S, and its latencies before the load starts (alone) and beside it.

`python -m kvd_loadgen.beside TARGET SECONDS OUT` is b's client: it writes each read's
(start, end) wall-clock times to OUT (JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvd_client import AsyncClient
from kvd_loadgen.engine import percentile
from kvd_loadgen.local import LocalKvd

POLICIES = ("lru", "intent", "deadline", "regret", "reuse", "fair")
PING_S = 0.002  # between b's reads
ALONE_S = 2.0  # b's reads before the load starts
WARM_UP_S = 0.5  # b's first reads, not counted


class Beside:
    """What a run beside b's reads measured: when the load ran (`started`, `ended`, wall
    clock; `start()` and `end()` stamp them), and, once the run is over, b's `figures`."""

    def __init__(self) -> None:
        self.started = self.ended = 0.0
        self.figures: dict = {}

    def start(self) -> None:
        self.started = time.time()

    def end(self) -> None:
        self.ended = time.time()


@contextlib.asynccontextmanager
async def beside_reads(policy: str, blocks: int, seconds: float, name: str, setup=None):
    """kvd (its own process) with tenant b's client reading beside tenant a's load: yields
    (a's client, Beside) once b has read alone for ALONE_S; the load runs for about
    `seconds` between Beside.start() and end(). `setup(a)`, awaited before b starts
    reading: what the load needs in place. After it, kvd's self-check must hold."""
    with tempfile.TemporaryDirectory(prefix=f"kvd-{name}-") as tmp:
        config = Path(tmp) / "kvd.toml"
        write_config(config, policy, blocks)
        spans = Path(tmp) / "spans.json"
        run = Beside()
        with LocalKvd("--config", str(config), workdir=tmp) as kvd:
            async with (AsyncClient(kvd.target, token="ta", timeout_s=120) as a,
                        AsyncClient(kvd.target, token="tb", timeout_s=60) as b):
                await b.admit("b0", 16 * 4)
                await b.allocate("b0", 4)
                if setup is not None:
                    await setup(a)
                reader = subprocess.Popen([sys.executable, "-m", "kvd_loadgen.beside",
                                           kvd.target, str(ALONE_S + seconds + 0.5),
                                           str(spans)])
                try:
                    await asyncio.sleep(ALONE_S)
                    yield a, run
                finally:
                    if reader.wait(timeout=60) != 0:
                        raise RuntimeError("b's client failed")
            async with AsyncClient(kvd.target) as admin:  # a unix caller with no token
                check = await admin.self_check()
            assert check.ok, check.problems
        run.figures = figures(spans, run.started, run.ended)


def write_config(path: Path, policy: str, blocks: int) -> None:
    """One pool with room for `blocks` and a little more in each tier, under `policy`, and
    the tenants a (token "ta") and b (token "tb")."""
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


def figures(out: Path, t0: float, t1: float) -> dict:
    """b's reads beside the load (those that overlap t0..t1), and its Access p50 and p99
    (ms) beside it and alone (before t0, past its warm-up)."""
    spans = json.loads(out.read_text())
    first = spans[0][0]
    alone = [e - s for s, e in spans if s >= first + WARM_UP_S and e < t0]
    beside = [e - s for s, e in spans if e > t0 and s < t1]
    return {"reads": len(beside),
            "alone_p50_ms": percentile(alone, 50) * 1e3,
            "alone_p99_ms": percentile(alone, 99) * 1e3,
            "p50_ms": percentile(beside, 50) * 1e3, "p99_ms": percentile(beside, 99) * 1e3,
            "max_ms": max(beside) * 1e3}


def p99_targets(name: str, result: dict, target_ms: float) -> dict[str, dict]:
    """The target of each policy's run in `result`: b's p99 beside the load <= target_ms."""
    return {f"{name}_{policy}_other_tenant_access_p99_ms": {
        "op": "<=", "value": target_ms, "measured": row["p99_ms"],
        "met": row["p99_ms"] <= target_ms} for policy, row in result.items()}


def print_targets(targets: dict[str, dict]) -> None:
    for name, t in targets.items():
        print(f"{name}: {t['measured']:.2f} {t['op']} {t['value']}: "
              f"{'met' if t['met'] else 'NOT met'}")


async def _read(target: str, seconds: float, out: str) -> None:
    async with AsyncClient(target, token="tb", timeout_s=60) as b:
        spans = []
        until = time.time() + seconds
        while time.time() < until:
            started = time.time()
            await b.access("b0")
            spans.append((started, time.time()))
            await asyncio.sleep(PING_S)
    Path(out).write_text(json.dumps(spans))


def main() -> None:
    from kvd_client import eventloop

    target, seconds, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    eventloop.run(_read(target, seconds, out))


if __name__ == "__main__":
    main()
