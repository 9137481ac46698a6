"""`kvd-loadgen request-trace TRACE`: play a request trace against a live kvd as engines with
continuous batching would, under one or more policies on fresh daemons, and report per
tenant: admission wait, time-to-first-token's memory part, per-step stall, evictions, tokens
per second, fairness; with a markdown report and plots.

A trace with prefix blocks (Mooncake's `hash_ids`) is played with them as shared block keys,
as an engine's prefix cache names blocks: requests with a common prefix share its pages, kept
after they end. Then each tenant's prefix hit rate, the pages it shares and what the split of
their cost saves it are reported too; the `lru` policy is then a plain LRU prefix cache, what
an engine does alone."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvd_client import AsyncClient, eventloop
from kvd_loadgen.engine import Engine, SimRequest, percentile
from kvd_loadgen.measures import jain_index
from kvd_loadgen.scenario import Samplers, assert_sound, link_sample, local_kvd, split_run
from kvd_loadgen.scenario_report import finish
from kvd_loadgen.trace_reader import TraceRequest, read_request_trace, tenant_rule


@dataclass
class TraceRun:
    trace: str
    speed: float = 4.0
    limit: int | None = 600
    tenants: str = "length:16384"
    block_tokens: int = 512
    page_bytes: int = 16384
    device_pages: int = 1200
    host_pages: int = 40000
    step_ms: float = 20.0
    chunk_blocks: int = 256
    max_output_tokens: int = 128  # longer outputs are cut, to keep the run minutes long
    share: bool = True  # a trace's prefix blocks (hash_ids) are shared block keys


# The namespace of the trace's block keys (one model, no salt), and the tokens in a block
# Mooncake's hash_ids name.
NAMESPACE = "trace"
MOONCAKE_BLOCK_TOKENS = 512


def kvd_config(run: TraceRun, spec: str, tenants: list[str]) -> str:
    policy, admission = split_run(spec)
    blocks = "".join(f'[[tenant]]\nname = "{t}"\ntoken = "{t}-token"\n\n' for t in tenants)
    return (
        "[server]\ngrace_s = 2\nlease_ttl_s = 60\n\n"
        f'[[pool]]\nname = "default"\npolicy = "{policy}"\npage_bytes = {run.page_bytes}\n'
        f'admission = "{admission}"\n'
        f"block_tokens = {run.block_tokens}\ndevice_pages = {run.device_pages}\n"
        f"host_pages = {run.host_pages}\nmax_queue = 100000\n\n" + blocks)


async def _occupancy(admin: AsyncClient) -> dict:
    """Pages in use, and each tenant with reserved pages: (device pages, fair share)."""
    tenants = await admin.list_tenants()
    stats = (await admin.pool_stats()).pools[0]
    return {"device_used": stats.tiers[0].used_pages, "host_used": stats.tiers[1].used_pages,
            "working_set": stats.working_set_pages,
            "working_set_capacity": stats.working_set_capacity_pages,
            "queued": stats.num_queued,
            "tenants": {t.tenant: (t.device_pages, t.fair_share_pages) for t in tenants
                        if t.reserved_pages > 0},
            "shared": {t.tenant: (t.shared_pages, t.shared_saved_pages) for t in tenants}}


def _arrivals(run: TraceRun, trace: list[TraceRequest]) -> list[SimRequest]:
    """The trace as the engines' requests, each given its tenant by the run's rule."""
    rule = tenant_rule(run.tenants)
    return [SimRequest(r.request_id, r.prompt_tokens,
                       min(max(r.output_tokens, 1), run.max_output_tokens), rule(r),
                       r.arrival_s / run.speed,
                       keys=tuple(r.block_keys) if run.share else ()) for r in trace]


async def run_policy(run: TraceRun, policy: str, trace: list[TraceRequest],
                     progress: Progress | None = None) -> dict:
    arrivals = _arrivals(run, trace)
    tenants = sorted({sim.klass for sim in arrivals})
    async with local_kvd(kvd_config(run, policy, tenants), prefix="kvd-trace-") as (kvd, admin):
        clients = {t: AsyncClient(kvd.target, token=f"{t}-token", timeout_s=120)
                   for t in tenants}
        try:
            engines = {t: Engine(clients[t], block_tokens=run.block_tokens,
                                 step_s=run.step_ms / 1000, chunk_blocks=run.chunk_blocks,
                                 namespace=NAMESPACE)
                       for t in tenants}
            samplers = Samplers(admin)
            samples, link_samples = samplers.start((_occupancy, 0.5), (link_sample, 0.5))
            start = samplers.start_time
            await _play(arrivals, engines, start, progress and (progress, policy))
            ended = time.monotonic()
            await samplers.stop()
            tenant_info = {t.tenant: t for t in await admin.list_tenants()}
            stats = (await admin.pool_stats()).pools[0]
            await assert_sound(admin)
        finally:
            for c in clients.values():
                await c.close()
    classes = [_tenant_figures(t, [a for a in arrivals if a.klass == t], engines[t],
                               tenant_info.get(t), samples, ended - start) for t in tenants]
    jains = [jain_index([u / max(s, 1e-9) for u, s in x["tenants"].values()])
             for x in samples if len(x["tenants"]) > 1]
    return {"policy": policy, "wall_s": ended - start, "classes": classes,
            "tokens_per_s": sum(c["tokens"] for c in classes) / max(ended - start, 1e-9),
            "jain": statistics.fmean(jains) if jains else 1.0,
            "evictions": stats.num_evictions, "bytes_moved": stats.bytes_moved,
            "decode_critical_misses": stats.num_decode_critical_misses,
            "occupancy": samples, "links": link_samples}


async def _play(arrivals: list[SimRequest], engines: dict[str, Engine], start: float,
                progress: tuple[Progress, str] | None) -> None:
    """Each request arrives at its time to its tenant's engine; the engines run until every
    request has arrived and theirs have finished."""
    done = asyncio.Event()
    task = progress[0].add_task(progress[1], total=len(arrivals)) if progress else None

    async def arrive(sim: SimRequest):
        await asyncio.sleep(max(0.0, start + sim.arrival_s - time.monotonic()))
        await engines[sim.klass].arrive(sim)

    async def all_arrived():
        try:
            await asyncio.gather(*(arrive(s) for s in arrivals))
        finally:
            done.set()  # an arrival that failed stops the run (raised below), not hangs it

    async def report_progress():
        while progress:
            finished = sum(1 for s in arrivals if s.finished_at or s.rejected)
            progress[0].update(task, completed=finished)
            await asyncio.sleep(0.25)

    watcher = asyncio.ensure_future(all_arrived())
    reporter = asyncio.ensure_future(report_progress())
    try:
        await asyncio.gather(*(e.run(stop=done) for e in engines.values()))
        await watcher
    finally:
        reporter.cancel()


def _tenant_figures(tenant: str, reqs: list[SimRequest], eng: Engine, info, samples: list,
                    wall_s: float) -> dict:
    """One tenant's results: admission, stalls, tokens, evictions, share of the device."""
    decode = [x.stall_s * 1e3 for x in eng.stats.steps if not x.prefill]
    waits = [r.admission_wait_s * 1e3 for r in reqs if r.admission_wait_s is not None]
    prefill = [r.prefill_stall_s * 1e3 for r in reqs if r.prefilled]
    ratios = [s["tenants"][tenant][0] / max(s["tenants"][tenant][1], 1e-9) for s in samples
              if tenant in s["tenants"]]
    keyed = [r for r in reqs if r.keys or r.hit_blocks]
    shared = [s["shared"][tenant] for s in samples if tenant in s.get("shared", {})]
    return {
        "tenant": tenant, "requests": len(reqs),
        "finished": sum(1 for r in reqs if r.finished_at),
        "rejected": sum(1 for r in reqs if r.rejected),
        "queued": sum(1 for r in reqs if r.queued),
        "admission_wait_p50_ms": percentile(waits, 50),
        "admission_wait_p99_ms": percentile(waits, 99),
        "prefill_stall_p50_ms": percentile(prefill, 50),
        "prefill_stall_p99_ms": percentile(prefill, 99),
        "step_stall_p50_ms": percentile(decode, 50),
        "step_stall_p95_ms": percentile(decode, 95),
        "step_stall_p99_ms": percentile(decode, 99),
        "step_stall_ms": decode,
        "tokens": eng.stats.tokens,
        "tokens_per_s": eng.stats.tokens / max(wall_s, 1e-9),
        "evictions_suffered": info.evictions_suffered if info else 0,
        "evictions_caused": info.evictions_caused if info else 0,
        "mean_share_ratio": statistics.fmean(ratios) if ratios else 0.0,
        # Shared prefix blocks: keys found on arrival over keys asked for; pages of blocks
        # the tenant's requests use with others', and the pages that split saves it
        # (means over the run's samples).
        "prefix_blocks": sum(len(r.keys) for r in keyed),
        "prefix_hit_blocks": sum(r.hit_blocks for r in keyed),
        "prefix_hit_rate": (sum(r.hit_blocks for r in keyed)
                            / max(1, sum(len(r.keys) for r in keyed))),
        "shared_pages_mean": statistics.fmean(x[0] for x in shared) if shared else 0.0,
        "shared_saved_pages_mean": statistics.fmean(x[1] for x in shared) if shared else 0.0,
    }


def run_cli(args) -> int:
    from kvd_loadgen.request_trace_report import build_report

    page_bytes = args.page_bytes
    if args.model:
        from kvd.config import MODEL_PRESETS

        page_bytes = args.block_tokens * MODEL_PRESETS[args.model].bytes_per_token
    run = TraceRun(trace=str(args.trace), speed=args.speed, limit=args.limit,
                   tenants=args.tenants, block_tokens=args.block_tokens,
                   page_bytes=page_bytes,
                   device_pages=args.device_pages, host_pages=args.host_pages,
                   step_ms=args.step_ms, max_output_tokens=args.max_output_tokens,
                   share=not args.no_share)
    trace = read_request_trace(args.trace, skip_bad=args.skip_bad, limit=args.limit)
    if run.share and run.block_tokens != MOONCAKE_BLOCK_TOKENS and any(
            r.block_keys for r in trace):
        print(f"kvd-loadgen: the trace's hash_ids name {MOONCAKE_BLOCK_TOKENS}-token blocks; "
              f"use --block-tokens {MOONCAKE_BLOCK_TOKENS} or --no-share", file=sys.stderr)
        return 2
    console = Console(width=max(Console().width, 140))
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} requests"), TimeElapsedColumn(),
                  console=console) as progress:
        for policy in args.policy.split(","):
            results.append(eventloop.run(run_policy(run, policy, trace, progress)))
    out = {"run": asdict(run), "results": results}
    return finish(build_report(out), console, args.json, args.report)
