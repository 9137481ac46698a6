"""`kvd-loadgen soak` (`make soak`): many concurrent clients with a mixed workload against one
kvd for minutes; reports kvd's RSS over time, pages leaked at the end, latency percentiles per
interval, and errors by status code."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvd_client import AsyncClient, KvdClientError, eventloop, pb
from kvd_loadgen.engine import percentile
from kvd_loadgen.local import LocalKvd

EVICTION_LEDGER = 20_000  # kvd's defaults, which this soak runs with
EXPLAIN_KEEP = 2_000

CONFIG = """
[server]
grace_s = 5
lease_ttl_s = 2

[[pool]]
name = "default"
model = "tiny"
block_tokens = 16
device_pages = 1024
host_pages = 8192
policy = "{policy}"
max_queue = 4096
admission = "reservation"  # the clients over-subscribe the device: every path pages

[[tenant]]
name = "a"
token = "a-token"

[[tenant]]
name = "b"
token = "b-token"
weight = 2
"""


def _rss_mib(pid: int) -> tuple[float, float]:
    """(private heap, shared memory) resident MiB. The arenas are shared memory: their pages
    become resident as they are first written, which is warm-up, not a leak."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssShmem"):
            fields[key] = int(value.split()[0]) / 1024
    return fields.get("RssAnon", 0.0), fields.get("RssShmem", 0.0)


async def _client(target: str, n: int, until: float, samples: list, errors: Counter) -> None:
    """One engine's life: admit, allocate, step, release, over and over. Every 16th client
    also vanishes now and then: it drops its connection with a request still held and comes
    back as a new client, and kvd must release what it left once its lease expires."""
    rng = random.Random(n)
    abandons = n % 16 == 0
    i = 0
    while time.monotonic() < until:
        async with AsyncClient(target, token="a-token" if n % 3 else "b-token",
                               timeout_s=30) as kvd:
            while time.monotonic() < until:
                i += 1
                if not await _one_request(kvd, f"c{n}-{i}", rng, samples, errors,
                                          release=not (abandons and i % 5 == 0)):
                    break  # gone without releasing: its lease must clean up
                await asyncio.sleep(rng.random() * 0.01)


async def _one_request(kvd: AsyncClient, rid: str, rng: random.Random, samples: list,
                       errors: Counter, release: bool) -> bool:
    """Admit, allocate, a few steps, release (unless not `release`); False if it was held."""
    blocks = rng.randint(2, 48)
    try:
        t0 = time.monotonic()
        reply = await kvd.admit(rid, blocks * 16, rng.randint(16, 256))
        samples.append((time.monotonic(), time.monotonic() - t0))
        if reply.decision == pb.DECISION_REJECTED:
            return True
        if reply.decision == pb.DECISION_QUEUED:
            async for update in kvd.wait_admission(rid, timeout_s=30):
                if update.decision == pb.DECISION_ADMITTED:
                    break
        await kvd.allocate(rid, blocks)
        async with kvd.step_stream() as stream:
            for step in range(rng.randint(5, 40)):
                msg = pb.StepRequest(read_all=[rid])
                if step % 16 == 15:
                    msg.allocations.append(pb.AllocateRequest(request_id=rid, num_blocks=1))
                if rng.random() < 0.1:
                    msg.intents.append(pb.IntentUpdate(
                        request_id=rid, block_index=0,
                        intent=pb.MemoryIntent(priority=rng.choice([1, 2, 3]))))
                t0 = time.monotonic()
                step_reply = await stream.send(msg)
                samples.append((time.monotonic(), time.monotonic() - t0))
                for e in step_reply.errors:
                    errors[f"step:{e.code}"] += 1
        if not release:
            return False
        await kvd.release(rid)
    except KvdClientError as exc:
        errors[exc.code.name] += 1
        try:  # as an engine would: give back what the failed request held
            await kvd.release(rid)
        except KvdClientError:
            pass  # it was never admitted, or is gone already
    return True


# kvd's memory may grow this much from the middle third of a soak to the last.
GROWTH_TARGET = 0.05
# The soak `make bench` runs (as `make soak` does): long enough for the thirds to settle.
SOAK_CLIENTS, SOAK_S = 64, 240.0


def thirds_growth(rss: list[tuple[float, float, float]], duration_s: float
                  ) -> tuple[float, float]:
    """(heap, RSS) growth of the last third of the run over the middle third, mean against
    mean: like against like, both after the first third's warm-up (the bounded caches
    filling, the arenas' pages first touched), and a mean is not one noisy sample. RSS is
    heap plus the resident shared memory (the arenas)."""
    def mean(values):
        return sum(values) / len(values) if values else 0.0

    middle = [(h, h + sh) for at, h, sh in rss if duration_s / 3 <= at < 2 * duration_s / 3]
    last = [(h, h + sh) for at, h, sh in rss if at >= 2 * duration_s / 3]
    if not middle or not last:
        return 0.0, 0.0
    return tuple(mean([x[i] for x in last]) / mean([x[i] for x in middle]) - 1
                 for i in (0, 1))


async def run_soak(clients: int, duration_s: float, policy: str, interval_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvd-soak-") as tmp:
        config = Path(tmp) / "kvd.toml"
        config.write_text(CONFIG.format(policy=policy))
        with LocalKvd("--config", str(config), workdir=tmp) as kvd:
            samples: list = []
            errors: Counter = Counter()
            rss: list = []
            start = time.monotonic()
            until = start + duration_s

            filled: list = []  # when kvd's bounded caches were full (the end of warm-up)

            async def watch_rss():
                async with AsyncClient(kvd.target, lease="") as admin:
                    while time.monotonic() < until:
                        rss.append((time.monotonic() - start, *_rss_mib(kvd.proc.pid)))
                        if not filled:
                            p = (await admin.pool_stats()).pools[0]
                            # The eviction ledger keeps the last EVICTION_LEDGER evictions,
                            # Explain the last EXPLAIN_KEEP released requests (per pool).
                            if (p.num_evictions >= EVICTION_LEDGER
                                    and p.num_admitted >= EXPLAIN_KEEP + 2 * clients):
                                filled.append(time.monotonic() - start)
                        await asyncio.sleep(interval_s / 4)

            watcher = asyncio.ensure_future(watch_rss())
            await asyncio.gather(*(_client(kvd.target, n, until, samples, errors)
                                   for n in range(clients)))
            await watcher
            # Wait out the abandoned clients' leases, then nothing may be left.
            await asyncio.sleep(3)
            async with AsyncClient(kvd.target, lease="") as admin:
                stats = (await admin.pool_stats()).pools[0]
                check = await admin.self_check()
            leaked = sum(t.used_pages for t in stats.tiers)
            log = kvd.log()
    periods = []
    t = 0.0
    while t < duration_s:
        window = [lat for at, lat in samples if t <= at - start < t + interval_s]
        periods.append({"from_s": t, "calls": len(window),
                        "p50_ms": percentile(window, 50) * 1e3,
                        "p99_ms": percentile(window, 99) * 1e3})
        t += interval_s
    # Warm-up ends when kvd's bounded caches are full (their memory is then constant); if
    # they never fill in the run, at a third of it.
    warmup_s = filled[0] if filled else duration_s / 3
    warm = [heap for at, heap, _ in rss if at >= warmup_s]
    growth = (warm[-1] - warm[0]) / warm[0] if len(warm) > 1 else 0.0
    heap_growth, rss_growth = thirds_growth(rss, duration_s)
    return {"heap_growth_last_vs_middle_third": heap_growth,
            "rss_growth_last_vs_middle_third": rss_growth,
            "clients": clients, "duration_s": duration_s, "policy": policy,
            "calls": len(samples), "errors": dict(errors), "pages_leaked": leaked,
            "reserved_pages_left": stats.reserved_pages, "requests_left": stats.num_requests,
            "self_check_ok": check.ok, "rss_mib": rss, "rss_growth_after_warmup": growth,
            "warmup_s": warmup_s, "caches_filled": bool(filled),
            "periods": periods, "lease_expiries": log.count("lease expired")}


def targets(out: dict) -> dict[str, dict]:
    """The soak's targets with their values and whether each was met: memory from the
    middle third of the run to the last (heap, and RSS with the arenas), and nothing left
    behind once every client is gone."""
    heap, total = (out["heap_growth_last_vs_middle_third"],
                   out["rss_growth_last_vs_middle_third"])
    left = out["pages_leaked"] + out["requests_left"] + (not out["self_check_ok"])
    return {
        "soak_heap_growth_last_vs_middle_third_pct": {
            "op": "<=", "value": GROWTH_TARGET * 100, "measured": heap * 100,
            "met": heap <= GROWTH_TARGET},
        "soak_rss_growth_last_vs_middle_third_pct": {
            "op": "<=", "value": GROWTH_TARGET * 100, "measured": total * 100,
            "met": total <= GROWTH_TARGET},
        "soak_pages_requests_left_and_self_check_problems": {
            "op": "<=", "value": 0, "measured": left, "met": left == 0},
    }


def run_cli(args) -> int:
    from kvd_loadgen.cli import write_json

    clients = SOAK_CLIENTS if args.clients is None else args.clients
    duration_s = SOAK_S if args.duration_s is None else args.duration_s
    console = Console(width=max(Console().width, 100))
    with console.status(f"soak: {clients} clients for {duration_s:.0f} s"):
        out = eventloop.run(run_soak(clients, duration_s, args.policy, args.interval_s))
    t = Table(title=f"soak: {out['clients']} clients, {out['duration_s']:.0f} s, "
                    f"policy {out['policy']}")
    for col in ("from s", "calls", "p50 ms", "p99 ms"):
        t.add_column(col, justify="right")
    for p in out["periods"]:
        t.add_row(f"{p['from_s']:.0f}", str(p["calls"]), f"{p['p50_ms']:.2f}",
                  f"{p['p99_ms']:.2f}")
    console.print(t)
    rss = out["rss_mib"]
    console.print(f"kvd private heap (RssAnon): {rss[0][1]:.0f} MiB at start, "
                  f"{rss[-1][1]:.0f} MiB at the end, growth after warm-up (to "
                  f"{out['warmup_s']:.0f} s: "
                  f"{'until its bounded caches were full' if out['caches_filled'] else 'a third of the run; the caches never filled'}"
                  f") {out['rss_growth_after_warmup'] * 100:+.1f}%; arenas resident (RssShmem): "
                  f"{rss[0][2]:.0f} -> {rss[-1][2]:.0f} MiB")
    heap, total = (out["heap_growth_last_vs_middle_third"],
                   out["rss_growth_last_vs_middle_third"])
    met = heap <= GROWTH_TARGET and total <= GROWTH_TARGET
    console.print(f"memory, last third of the run against the middle third (means): heap "
                  f"{heap * 100:+.1f}%, RSS {total * 100:+.1f}% (target <= "
                  f"{GROWTH_TARGET * 100:.0f}% each): {'met' if met else 'NOT met'}")
    console.print(f"pages leaked: {out['pages_leaked']}; requests left: {out['requests_left']}; "
                  f"self-check ok: {out['self_check_ok']}; lease expiries: "
                  f"{out['lease_expiries']}; errors by code: {out['errors'] or 'none'}")
    write_json(args.json, out)
    ok = out["pages_leaked"] == 0 and out["self_check_ok"] and out["requests_left"] == 0
    return 0 if ok else 1
