"""`kvd-loadgen disagg`: a prefill pool and a decode pool in one kvd, a stream of requests
with heavy-tailed prompts, each prefilled, handed off over the capped prefill->decode link,
decoded and released.

Two runs on fresh daemons with the same arrivals:
- reserved: Admit names the decode pool, so kvd reserves the decode pages at admission and
  a request decode cannot hold waits (or is rejected) before any prefill is spent;
- unreserved: requests are admitted to prefill alone and ask decode only at handoff; a
  refused handoff is retried for a while, then the prefill is given up (wasted).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass, field

from rich.console import Console

from kvd_client import AsyncClient, KvdClientError, ResourceExhaustedError, eventloop, pb
from kvd_loadgen.engine import percentile
from kvd_loadgen.scenario import Samplers, assert_sound, link_sample, local_kvd
from kvd_loadgen.scenario_report import ScenarioReport, draw_utilisation, finish, label_bars

LINK = "prefill->decode"
BLOCK_TOKENS = 16  # the tiny model: 16 KiB pages


@dataclass
class DisaggScenario:
    requests: int = 120
    rate: float = 40.0  # arrivals per second (Poisson)
    link_mib_s: float = 64.0
    prefill_pages: int = 512
    decode_pages: int = 192
    decode_host_pages: int = 192
    prompt_min: int = 128  # tokens; Pareto tail with this minimum
    prompt_alpha: float = 1.3
    output_min: int = 128
    output_max: int = 512
    decode_step_ms: float = 10.0  # per block of 16 output tokens
    prefill_us_per_token: float = 20.0
    patience_s: float = 0.5  # unreserved: how long a refused handoff is retried
    seed: int = 7

    def arrivals(self) -> list[tuple[float, int, int]]:
        """(arrival s, prompt tokens, output tokens) for every request."""
        rng = random.Random(self.seed)
        most = (self.decode_pages - 1) * BLOCK_TOKENS - self.output_max  # fits decode
        t, out = 0.0, []
        for _ in range(self.requests):
            t += rng.expovariate(self.rate)
            prompt = min(int(self.prompt_min * rng.paretovariate(self.prompt_alpha)), most)
            out.append((t, prompt, rng.randint(self.output_min, self.output_max)))
        return out


def min_decode_pages(s: DisaggScenario | None = None) -> int:
    """The fewest decode device pages the scenario runs on: its smallest prompt with its
    longest output, and a page to spare (arrivals() caps prompts to fit)."""
    s = s or DisaggScenario()
    return math.ceil((s.prompt_min + s.output_max) / BLOCK_TOKENS) + 1


def kvd_config(s: DisaggScenario) -> str:
    return f"""
[server]
grace_s = 2
handoff_ttl_s = 30

[[pool]]
name = "prefill"
model = "tiny"
device_pages = {s.prefill_pages}
host_pages = {s.prefill_pages}
max_queue = 100000
admission = "reservation"

[[pool]]
name = "decode"
model = "tiny"
device_pages = {s.decode_pages}
host_pages = {s.decode_host_pages}
max_queue = 100000
admission = "reservation"

[[link]]
source = "prefill"
target = "decode"
bandwidth = {int(s.link_mib_s * 2**20)}
"""


@dataclass
class Outcome:
    prompt: int
    output: int
    decision: str = ""
    queued: bool = False
    admission_wait_s: float = 0.0
    prefilled: bool = False
    wasted: bool = False
    refusals: int = 0
    handoff_s: float = 0.0
    handoff_bytes: int = 0
    finished: bool = False
    errors: list = field(default_factory=list)


async def one_request(c: AsyncClient, s: DisaggScenario, rid: str, o: Outcome,
                      reserved: bool) -> None:
    began = time.perf_counter()
    kw = {"handoff_pool": "decode"} if reserved else {}
    reply = await c.admit(rid, o.prompt, o.output, pool="prefill", **kw)
    o.decision = pb.Decision.Name(reply.decision)
    if reply.decision == pb.DECISION_REJECTED:
        return
    if reply.decision == pb.DECISION_QUEUED:
        o.queued = True
        async for update in c.wait_admission(rid):
            if update.decision == pb.DECISION_ADMITTED:
                break
    o.admission_wait_s = time.perf_counter() - began
    blocks = math.ceil(o.prompt / BLOCK_TOKENS)
    await c.allocate(rid, blocks)
    await asyncio.sleep(o.prompt * s.prefill_us_per_token / 1e6)  # the prefill's compute
    o.prefilled = True
    deadline = time.perf_counter() + s.patience_s
    while True:
        started = time.perf_counter()
        try:
            last = await c.handoff_all(rid, "" if reserved else "decode")
            break
        except ResourceExhaustedError:
            o.refusals += 1
            if time.perf_counter() > deadline:
                o.wasted = True  # decode never took it: the prefill was for nothing
                await c.release(rid)
                return
            await asyncio.sleep(0.02)
    o.handoff_s = time.perf_counter() - started
    o.handoff_bytes = last.bytes_total
    # Decode: a new block whenever the sequence crosses a block boundary.
    for _ in range(math.ceil((o.prompt + o.output) / BLOCK_TOKENS) - blocks):
        await c.allocate(rid, 1)
        await c.access(rid)
        await asyncio.sleep(s.decode_step_ms / 1000)
    await c.release(rid)
    o.finished = True


async def run_mode(s: DisaggScenario, reserved: bool) -> dict:
    arrivals = s.arrivals()
    outcomes = [Outcome(p, out) for _, p, out in arrivals]
    async with local_kvd(kvd_config(s), prefix="kvd-disagg-") as (_, c):
        samplers = Samplers(c)
        [samples] = samplers.start((link_sample, 0.25))
        start = samplers.start_time

        async def arrive(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i][0] - time.monotonic()))
            try:
                await one_request(c, s, f"r{i}", outcomes[i], reserved)
            except KvdClientError as exc:
                outcomes[i].errors.append(str(exc))
                try:  # as an engine would: give the request back
                    await c.release(f"r{i}")
                except KvdClientError:
                    pass

        await asyncio.gather(*(arrive(i) for i in range(len(arrivals))))
        wall = time.monotonic() - start
        await samplers.stop()
        stats = {p.pool: p for p in (await c.pool_stats()).pools}
        await assert_sound(c)
    link = next(x for x in stats["prefill"].links if x.link == LINK)
    handoffs = [o for o in outcomes if o.handoff_bytes]
    rates = [o.handoff_bytes / o.handoff_s for o in handoffs if o.handoff_s > 0]
    waits = [o.admission_wait_s * 1e3 for o in outcomes if o.queued]
    return {
        "mode": "reserved" if reserved else "unreserved",
        "wall_s": wall,
        "requests": len(outcomes),
        "finished": sum(o.finished for o in outcomes),
        "rejected": sum(o.decision == "DECISION_REJECTED" for o in outcomes),
        "queued": sum(o.queued for o in outcomes),
        "admission_wait_p50_ms": percentile(waits, 50),
        "admission_wait_p99_ms": percentile(waits, 99),
        "prefills": sum(o.prefilled for o in outcomes),
        "prefills_wasted": sum(o.wasted for o in outcomes),
        "handoff_refusals": sum(o.refusals for o in outcomes),
        "handoffs": len(handoffs),
        "handoff_bytes": sum(o.handoff_bytes for o in handoffs),
        "handoff_p50_ms": percentile([o.handoff_s * 1e3 for o in handoffs], 50),
        "handoff_p99_ms": percentile([o.handoff_s * 1e3 for o in handoffs], 99),
        "handoff_rate_p50_mib_s": percentile(rates, 50) / 2**20 if rates else 0.0,
        "link_bytes": link.bytes_total,
        "link_capacity_bytes_per_s": link.capacity_bytes_per_s,
        "link_busy_fraction": link.busy_seconds / wall,
        "errors": [e for o in outcomes for e in o.errors][:10],
        "samples": samples,
    }


async def handoff_burst(s: DisaggScenario, requests: int = 4, blocks: int = 80) -> dict:
    """Prefill a few long requests, then hand them all off at once: the link's throughput
    when handoffs keep it busy, against its cap. On a small decode pool, requests of what
    its device tier holds, as many as it admits at once (one at least)."""
    blocks = min(blocks, s.decode_pages - 2)  # and its output block, and one to spare
    async with local_kvd(kvd_config(s), prefix="kvd-disagg-") as (_, c):
        admitted = 0
        for i in range(requests):
            reply = await c.admit(f"b{i}", blocks * BLOCK_TOKENS, BLOCK_TOKENS,
                                  pool="prefill", handoff_pool="decode")
            if reply.decision != pb.DECISION_ADMITTED and admitted:
                if reply.decision == pb.DECISION_QUEUED:
                    await c.release(f"b{i}")
                break
            assert reply.decision == pb.DECISION_ADMITTED, reply
            await c.allocate(f"b{i}", blocks)
            admitted += 1
        requests = admitted
        started = time.perf_counter()
        done = await asyncio.gather(*(c.handoff_all(f"b{i}") for i in range(requests)))
        elapsed = time.perf_counter() - started
        assert all(d.done for d in done)
    moved = requests * blocks * 16 * 1024
    return {"requests": requests, "bytes": moved, "elapsed_s": elapsed,
            "mib_s": moved / elapsed / 2**20}


async def run_all(s: DisaggScenario, progress=None) -> dict:
    out = {"scenario": asdict(s), "modes": {}}
    for reserved in (True, False):
        if progress:
            progress("reserved" if reserved else "unreserved")
        r = await run_mode(s, reserved)
        out["modes"][r["mode"]] = r
    if progress:
        progress("handoff burst")
    out["burst"] = await handoff_burst(s)
    return out


def build_report(out: dict) -> ScenarioReport:
    s = DisaggScenario(**out["scenario"])
    m = out["modes"]
    r = ScenarioReport(
        "disagg", "Disaggregated prefill and decode: reservation at admission, handoff",
        f"{s.requests} requests arrive at {s.rate:g}/s with Pareto prompts (min "
        f"{s.prompt_min} tokens, alpha {s.prompt_alpha:g}) and {s.output_min}-{s.output_max} "
        f"output tokens; a prefill pool of {s.prefill_pages} device pages hands off to a "
        f"decode pool of {s.decode_pages} device + {s.decode_host_pages} host pages (16 KiB "
        f"pages) over a link capped at {s.link_mib_s:g} MiB/s. Unreserved requests retry a "
        f"refused handoff for {s.patience_s:g} s, then give the prefill up.")
    r.data = out
    _tables(r, s, m, out["burst"])
    _targets(r, s, m, out["burst"])
    _figures(r, m)
    return r


def _tables(r: ScenarioReport, s: DisaggScenario, m: dict, b: dict) -> None:
    rows = []
    for name in ("reserved", "unreserved"):
        x = m[name]
        rows.append([name, x["finished"], x["rejected"], x["queued"],
                     f"{x['admission_wait_p50_ms']:.0f} / {x['admission_wait_p99_ms']:.0f}",
                     x["prefills"], x["prefills_wasted"], x["handoff_refusals"],
                     f"{x['handoff_p50_ms']:.1f} / {x['handoff_p99_ms']:.1f}",
                     f"{x['handoff_rate_p50_mib_s']:.1f}",
                     f"{x['link_bytes'] / 2**20:.1f}", f"{x['wall_s']:.1f}"])
    r.table("Requests, prefills and handoffs",
            ["mode", "finished", "rejected", "queued", "adm wait p50/p99 ms", "prefills",
             "wasted", "refusals", "handoff p50/p99 ms", "handoff MiB/s p50", "MiB handed off",
             "wall s"], rows,
            [f"Handoff MiB/s is one handoff's bytes over its duration; the link's cap is "
             f"{s.link_mib_s:g} MiB/s."])
    r.table("Handoffs keeping the link busy",
            ["requests", "MiB handed off", "seconds", "MiB/s", "link cap MiB/s", "of the cap"],
            [[b["requests"], f"{b['bytes'] / 2**20:.1f}", f"{b['elapsed_s']:.3f}",
              f"{b['mib_s']:.1f}", f"{s.link_mib_s:g}", f"{b['mib_s'] / s.link_mib_s:.0%}"]],
            ["All handed off at once, from prefill to an empty decode pool; the elapsed time "
             "includes the RPCs and the decode pool's allocations."])


def _targets(r: ScenarioReport, s: DisaggScenario, m: dict, b: dict) -> None:
    res = m["reserved"]
    r.target("no prefill wasted with reservation", res["prefills_wasted"] == 0,
             f"{res['prefills_wasted']} wasted with reservation, "
             f"{m['unreserved']['prefills_wasted']} without")
    # A paced link moves at most cap x time + its burst (by default 5 ms of traffic, at
    # least two chunks of 0.5 ms of traffic, 64 KiB to 4 MiB).
    cap = s.link_mib_s * 2**20
    burst = max(cap / 200, 2 * min(4 << 20, max(64 << 10, cap * 0.0005)))
    allowed = (s.link_mib_s * 2**20 * b["elapsed_s"] + burst) / b["elapsed_s"] / 2**20
    r.target("handoff throughput paced at the link cap (cap x time + burst)",
             b["mib_s"] <= allowed,
             f"{b['mib_s']:.1f} MiB/s with the link kept busy; cap {s.link_mib_s:g} MiB/s, "
             f"{allowed:.1f} with the burst over {b['elapsed_s'] * 1e3:.0f} ms")


def _figures(r: ScenarioReport, m: dict) -> None:
    r.figure("link_utilisation", "prefill->decode link utilisation over time",
             draw_utilisation({n: m[n]["samples"] for n in m}, lambda _: LINK,
                              "prefill->decode link utilisation"))

    def outcomes(pyplot):
        fig, ax = pyplot.subplots(figsize=(7, 3.2))
        keys = {"finished": "finished", "queued": "waited for admission",
                "rejected": "rejected", "prefills_wasted": "prefills wasted"}
        runs = {"reserved": "decode pages reserved at admission",
                "unreserved": "no reservation"}
        for i, (name, label) in enumerate(runs.items()):
            label_bars(ax, ax.bar([j + i * 0.4 for j in range(len(keys))],
                                  [m[name][k] for k in keys], 0.4, label=label))
        ax.set_xticks([j + 0.2 for j in range(len(keys))])
        ax.set_xticklabels(list(keys.values()))
        ax.set_ylabel("requests")
        ax.set_title("Request outcomes")
        ax.legend()
        return fig

    r.figure("outcomes", "Requests finished, queued, rejected and prefills wasted", outcomes)


def run_cli(args) -> int:
    s = DisaggScenario(requests=args.requests, rate=args.rate, link_mib_s=args.link_mib_s,
                       decode_pages=args.decode_pages)
    console = Console(width=max(Console().width, 140))
    started = time.perf_counter()
    with console.status("disagg") as status:
        out = eventloop.run(run_all(s, lambda mode: status.update(f"disagg: {mode}")))
    return finish(build_report(out), console, args.json, args.report, started)
