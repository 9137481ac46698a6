"""`kvd-loadgen hostile`: a victim tenant steps at a steady pace while an attacker tenant, in
another process, floods kvd every way a tenant can: many Step streams sending as fast as
they can, intent batches at the per-call bound, requests queued until its share of the
admission queue is full, and event watchers that never read.

Phases, each with a fresh pair of daemons: the victim alone; the attacker on the victim's
kvd; and the control, the same attacker flooding a second kvd while the victim steps against
the first. Then the same two with an attacker that only floods Step streams: with nothing
else of the attacker's in flight, its streams alone must not crowd the victim out. On a
small machine any busy process slows every other one: the control's victim
latency is the machine's share, the difference to it is kvd's. Reported: the victim's Step
p50/p99 per phase, its lost requests, the attacker's throughput, and kvd's RSS.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvd_client import AsyncClient, KvdClientError, eventloop, pb
from kvd_client.client import intent_update
from kvd_loadgen.engine import percentile
from kvd_loadgen.local import LocalKvd
from kvd_loadgen.soak import _rss_mib

CONFIG = """
[server]
lease_ttl_s = 5

[[pool]]
model = "tiny"
device_pages = 1024
host_pages = 1024

[[tenant]]
name = "victim"
token = "victim-token"

[[tenant]]
name = "attacker"
token = "attacker-token"
limit = 256
"""


@dataclass
class Hostile:
    duration_s: float = 6.0
    step_ms: float = 2.0  # the victim's pace
    victim_requests: int = 4
    victim_blocks: int = 8
    attacker_streams: int = 64
    attacker_watchers: int = 8
    batches: bool = True
    queue: bool = True


# ---------------------------------------------------------------- the two tenants


async def victim(target: str, s: Hostile, out: Path) -> None:
    """Steady steps: each reads all of the victim's blocks; latency per step."""
    latencies, lost = [], 0
    async with AsyncClient(target, token="victim-token", timeout_s=30) as c:
        rids = [f"v{i}" for i in range(s.victim_requests)]
        for rid in rids:
            await c.admit(rid, 16 * s.victim_blocks)
            await c.allocate(rid, s.victim_blocks)
        print("ready", flush=True)
        until = time.monotonic() + s.duration_s
        async with c.step_stream() as stream:
            next_at = time.monotonic()
            while time.monotonic() < until:
                started = time.perf_counter()
                reply = await stream.step(read_all=rids)
                latencies.append(time.perf_counter() - started)
                lost += len(reply.errors)  # a read of its own request refused: lost
                next_at += s.step_ms / 1000
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        for rid in rids:
            try:
                await c.release(rid)
            except KvdClientError:
                lost += 1
    out.write_text(json.dumps({"latencies": latencies, "lost": lost}))


async def attacker(target: str, s: Hostile, out: Path) -> None:
    """Everything at once until told to stop (SIGTERM ends the process)."""
    counts = {"steps": 0, "intent_batches": 0, "queued": 0, "refused": 0}
    async with AsyncClient(target, token="attacker-token", timeout_s=60) as c:
        await c.admit("a-held", 16 * 64)
        await c.allocate("a-held", 64)

        async def streams(i: int) -> None:
            async with c.step_stream() as stream:
                while True:
                    await stream.step(read_all=["a-held"])
                    counts["steps"] += 1

        async def batches() -> None:
            updates = [intent_update("a-held", i % 64, priority=1) for i in range(1024)]
            while True:
                await c.update_intents(updates)
                counts["intent_batches"] += 1

        async def queue() -> None:
            i = 0
            while True:  # beyond its limit: these wait, until its queue share is full
                i += 1
                try:
                    reply = await c.admit(f"a-q{i}", 16 * 64)
                    counts["queued"] += reply.decision == pb.DECISION_QUEUED
                except KvdClientError:
                    counts["refused"] += 1
                    await asyncio.sleep(0.01)

        async def watcher() -> None:  # subscribes and never reads
            call = c.memory.WatchEvents(pb.WatchEventsRequest(buffer=16384),
                                        metadata=c.metadata)
            await asyncio.sleep(3600)
            call.cancel()

        tasks = ([asyncio.ensure_future(streams(i)) for i in range(s.attacker_streams)]
                 + ([asyncio.ensure_future(batches())] if s.batches else [])
                 + ([asyncio.ensure_future(queue())] if s.queue else [])
                 + [asyncio.ensure_future(watcher()) for _ in range(s.attacker_watchers)])
        print("ready", flush=True)
        await asyncio.sleep(s.duration_s + 1.5)  # past the victim's run
        out.write_text(json.dumps(counts))
        for t in tasks:
            t.cancel()


# ---------------------------------------------------------------- phases


def _spawn(role: str, target: str, s: Hostile, out: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd_loadgen.hostile", role, target, json.dumps(asdict(s)),
         str(out)], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the {role} did not start")
    return proc


def _phase(name: str, s: Hostile, attack: str | None, workdir: Path) -> dict:
    """attack: None (victim alone), "same" (the victim's kvd) or "other" (a second kvd)."""
    config = workdir / "kvd.toml"
    config.write_text(CONFIG)
    (workdir / "a").mkdir()
    (workdir / "b").mkdir()
    with LocalKvd("--config", str(config), workdir=workdir / "a") as kvd, \
            LocalKvd("--config", str(config), workdir=workdir / "b") as other:
        attacker_proc = None
        if attack is not None:
            attacker_proc = _spawn("attacker", (kvd if attack == "same" else other).target, s,
                                   workdir / "attacker.json")
            time.sleep(0.5)  # the flood is on
        victim_proc = _spawn("victim", kvd.target, s, workdir / "victim.json")
        rss = 0.0
        while victim_proc.poll() is None:
            rss = max(rss, _rss_mib(kvd.proc.pid)[0])
            time.sleep(0.1)
        if attacker_proc is not None:
            try:
                attacker_proc.wait(30)
            except subprocess.TimeoutExpired:
                attacker_proc.kill()
        result = json.loads((workdir / "victim.json").read_text())
        flood = (json.loads((workdir / "attacker.json").read_text())
                 if attacker_proc is not None and (workdir / "attacker.json").exists() else {})
        alive = kvd.proc.poll() is None
    lat = result["latencies"]
    return {"phase": name, "steps": len(lat), "p50_ms": percentile(lat, 50) * 1000,
            "p99_ms": percentile(lat, 99) * 1000, "lost": result["lost"],
            "kvd_rss_mib": rss, "kvd_alive": alive, "attacker": flood}


def run(s: Hostile) -> dict:
    """The victim alone, then two attacks, each on the victim's kvd and as the control: the
    whole flood, and Step streams only (nothing else of the attacker's in flight)."""
    streams_only = replace(s, batches=False, queue=False, attacker_watchers=0)
    with tempfile.TemporaryDirectory(prefix="kvd-hostile-") as tmp:
        phases = []
        for i, (name, attack, scenario) in enumerate((
                ("victim alone", None, s),
                ("attacker on the same kvd", "same", s),
                ("control: attacker on a second kvd", "other", s),
                ("Step streams only, on the same kvd", "same", streams_only),
                ("control: Step streams only, second kvd", "other", streams_only))):
            workdir = Path(tmp) / str(i)
            workdir.mkdir()
            phases.append(_phase(name, scenario, attack, workdir))
    _, *attacked = phases
    checks = {}
    for same, control, what in ((attacked[0], attacked[1], ""),
                                (attacked[2], attacked[3], ", Step streams only")):
        checks[f"p50 <= 1.5x control{what}"] = same["p50_ms"] <= 1.5 * control["p50_ms"]
        checks[f"p99 <= 2x control{what}"] = same["p99_ms"] <= 2 * control["p99_ms"]
    checks["no victim request lost"] = all(p["lost"] == 0 for p in phases)
    checks["kvd stayed up"] = all(p["kvd_alive"] for p in phases)
    return {"scenario": asdict(s), "phases": phases, "checks": checks}


def run_cli(args) -> int:
    s = Hostile(duration_s=args.duration_s, step_ms=args.step_ms,
                attacker_streams=args.streams)
    result = run(s)
    table = Table(title="hostile tenant: the victim's Step latency")
    for col in ("phase", "steps", "p50 ms", "p99 ms", "lost", "kvd RSS MiB", "attacker"):
        table.add_column(col)
    for p in result["phases"]:
        table.add_row(p["phase"], str(p["steps"]), f"{p['p50_ms']:.2f}", f"{p['p99_ms']:.2f}",
                      str(p["lost"]), f"{p['kvd_rss_mib']:.0f}",
                      ", ".join(f"{k} {v}" for k, v in p["attacker"].items()))
    console = Console(width=160)
    console.print(table)
    for check, ok in result["checks"].items():
        console.print(f"{check}: {'met' if ok else 'NOT MET'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":  # the two tenants' processes
    role, target, scenario, out = sys.argv[1:5]
    s = Hostile(**json.loads(scenario))
    eventloop.run((victim if role == "victim" else attacker)(target, s, Path(out)))
