"""`kvd-loadgen whale-minnows`: seed 000's case against a live kvd. One 128K-token request
(tenant `whale`) and forty 2K-token requests (tenant `minnows`) decode side by side, each
engine stepping at a steady pace and reading every block of every request each step, in a
pool the whale pushes past full. The same workload runs under `fair` and under `lru` as an
engine's own cache would (`lru@reservation`: every request in, the device over-subscribed),
and once with the minnows alone."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import asdict, dataclass

from rich.console import Console

from kvd_client import AsyncClient, eventloop
from kvd_loadgen.engine import Engine, SimRequest, percentile
from kvd_loadgen.measures import jain_index
from kvd_loadgen.scenario import Samplers, assert_sound, local_kvd, split_run
from kvd_loadgen.scenario_report import ScenarioReport, finish, label_bars

def tenant_names(s: Scenario) -> dict[str, str]:
    """Tenant -> its class: the whale, and the minnows split across minnow_tenants tenants."""
    names = {"whale": "whale"}
    if s.minnow_tenants <= 1:
        names["minnows"] = "minnows"
    else:
        names.update({f"minnows-{i}": "minnows" for i in range(s.minnow_tenants)})
    return names


@dataclass
class Scenario:
    whales: int = 1
    whale_tokens: int = 131072
    minnows: int = 40
    minnow_tokens: int = 2048
    duration_s: float = 3.0  # both engines decode side by side for this long
    whale_delay_s: float = 0.3  # the minnows decode alone this long before the whale comes
    block_tokens: int = 64
    page_bytes: int = 16384
    device_pages: int = 0  # 0: 90% of the whole demand (whales + minnows)
    host_pages: int = 0  # 0: enough for everything twice
    step_ms: float = 20.0
    chunk_blocks: int = 256
    minnow_tenants: int = 1  # split the minnows across this many tenants

    @property
    def output_tokens(self) -> int:
        """Long enough that no request finishes inside the measured window."""
        return int(self.duration_s * 1000 / self.step_ms) + 16

    def pages(self, tokens: int) -> int:
        return math.ceil((tokens + self.output_tokens) / self.block_tokens)

    @property
    def demand_pages(self) -> int:
        return (self.whales * self.pages(self.whale_tokens)
                + self.minnows * self.pages(self.minnow_tokens))

    @property
    def device(self) -> int:
        return self.device_pages or int(0.9 * self.demand_pages)

    @property
    def host(self) -> int:
        return self.host_pages or 2 * self.demand_pages


def kvd_config(s: Scenario, spec: str) -> str:
    policy, admission = split_run(spec)
    tenants = "".join(f'[[tenant]]\nname = "{name}"\ntoken = "{name}-token"\n\n'
                      for name in tenant_names(s))
    return (
        "[server]\ngrace_s = 2\n\n"
        f'[[pool]]\nname = "default"\npolicy = "{policy}"\npage_bytes = {s.page_bytes}\n'
        f'admission = "{admission}"\n'
        f"block_tokens = {s.block_tokens}\ndevice_pages = {s.device}\n"
        f"host_pages = {s.host}\nmax_queue = 4096\n\n" + tenants
    )


@dataclass
class ClassResult:
    run: str
    policy: str
    klass: str
    requests: int
    stall_p50_ms: float  # decode steps
    stall_p99_ms: float
    prefill_stall_max_ms: float  # steps that allocated prompts: TTFT's memory part
    step_p50_ms: float
    step_p99_ms: float
    tokens_per_s: float
    evictions_suffered: int
    evictions_caused: int
    admission_wait_p50_ms: float
    admission_wait_max_ms: float
    mean_share_ratio: float  # device pages held / fair share, averaged over the run


async def run_case(s: Scenario, policy: str, *, with_whales: bool) -> tuple[list, float]:
    """One run on a fresh kvd. Returns the per-class results and Jain's index."""
    names = tenant_names(s)
    minnow_tenants = [t for t, k in names.items() if k == "minnows"]
    requests: dict[str, list[SimRequest]] = {t: [] for t in names}
    if with_whales:
        requests["whale"] = [SimRequest(f"whale-{i}", s.whale_tokens, s.output_tokens, "whale")
                             for i in range(s.whales)]
    for i in range(s.minnows):
        requests[minnow_tenants[i % len(minnow_tenants)]].append(
            SimRequest(f"minnow-{i}", s.minnow_tokens, s.output_tokens, "minnows"))

    async def shares(admin: AsyncClient) -> dict:
        return {"shares": {t.tenant: (t.device_pages, t.fair_share_pages)
                           for t in await admin.list_tenants()
                           if t.tenant in names and t.reserved_pages > 0}}

    async with local_kvd(kvd_config(s, policy), prefix="kvd-wm-") as (kvd, admin):
        clients = {t: AsyncClient(kvd.target, token=f"{t}-token") for t in names}
        try:
            engines = {t: Engine(clients[t], block_tokens=s.block_tokens,
                                 step_s=s.step_ms / 1000, chunk_blocks=s.chunk_blocks)
                       for t in names}
            # The minnows are decoding when the whale arrives and prefills (seed 001's
            # figure 2); both then decode side by side for the measured window.
            await asyncio.gather(*(engines[t].arrive(r) for t in minnow_tenants
                                   for r in requests[t]))
            until = time.monotonic() + s.whale_delay_s + s.duration_s
            runs = [asyncio.ensure_future(engines[t].run(until=until)) for t in minnow_tenants]
            samplers = Samplers(admin)
            [samples] = samplers.start((shares, 0.1))
            if requests["whale"]:
                await asyncio.sleep(s.whale_delay_s)
                await asyncio.gather(*(engines["whale"].arrive(r) for r in requests["whale"]))
                runs.append(asyncio.ensure_future(engines["whale"].run(until=until)))
            await asyncio.gather(*runs)
            await samplers.stop()
            tenants = {t.tenant: t for t in await admin.list_tenants()}
            await assert_sound(admin)
        finally:
            for c in clients.values():
                await c.close()
    share_samples = [x["shares"] for x in samples]
    run = f"{policy}" if with_whales else "minnows alone"
    results = [_class_result(run, policy, klass, members, engines, requests, tenants,
                             share_samples)
               for klass in ("whale", "minnows")
               if (members := [t for t, k in names.items() if k == klass and requests[t]])]
    # Jain's index over each tenant's memory share relative to its fair share, per sample.
    jains = [jain_index([used / max(share, 1e-9) for used, share in sample.values()])
             for sample in share_samples if len(sample) > 1]
    return results, statistics.fmean(jains) if jains else 1.0


def _class_result(run: str, policy: str, klass: str, members: list[str], engines: dict,
                  requests: dict, tenants: dict, samples: list[dict]) -> ClassResult:
    """What one class of tenants (whales or minnows) saw in a run."""
    steps = [x for t in members for x in engines[t].stats.steps]
    stalls = [x.stall_s * 1e3 for x in steps if not x.prefill]
    prefill = [x.stall_s * 1e3 for x in steps if x.prefill]
    lat = [x.latency_s * 1e3 for x in steps if not x.prefill]
    reqs = [r for t in members for r in requests[t]]
    waits = [r.admission_wait_s * 1e3 for r in reqs if r.admission_wait_s is not None]
    ratios = [sample[t][0] / max(sample[t][1], 1e-9)
              for sample in samples for t in members if t in sample]
    infos = [tenants[t] for t in members if t in tenants]
    return ClassResult(
        run=run, policy=policy, klass=klass, requests=len(reqs),
        stall_p50_ms=percentile(stalls, 50), stall_p99_ms=percentile(stalls, 99),
        prefill_stall_max_ms=max(prefill, default=0.0),
        step_p50_ms=percentile(lat, 50), step_p99_ms=percentile(lat, 99),
        tokens_per_s=sum(engines[t].stats.tokens_per_s for t in members),
        evictions_suffered=sum(i.evictions_suffered for i in infos),
        evictions_caused=sum(i.evictions_caused for i in infos),
        admission_wait_p50_ms=percentile(waits, 50),
        admission_wait_max_ms=max(waits, default=0.0),
        mean_share_ratio=statistics.fmean(ratios) if ratios else 0.0,
    )


# The baseline: an LRU cache as an engine keeps alone, the device over-subscribed and the
# whale in it (under working-set admission, a plain policy makes the whale wait until the
# minnows' working sets leave it room: the minnows of this scenario never do).
BASELINE = "lru@reservation"


async def run_all(s: Scenario, policies=(BASELINE, "fair:lru", "fair")) -> dict:
    out = {"scenario": asdict(s), "runs": []}
    solo, _ = await run_case(s, policies[-1], with_whales=False)
    out["runs"].append({"run": "minnows alone", "jain": None,
                        "classes": [asdict(r) for r in solo]})
    for policy in policies:
        results, jain = await run_case(s, policy, with_whales=True)
        out["runs"].append({"run": policy, "jain": jain,
                            "classes": [asdict(r) for r in results]})
    out["verdict"] = verdict(out)
    return out


def _find(out: dict, run: str, klass: str) -> dict:
    for r in out["runs"]:
        if r["run"] == run:
            for c in r["classes"]:
                if c["klass"] == klass:
                    return c
    raise KeyError((run, klass))


def verdict(out: dict) -> dict:
    """The targets of the tenants issue, computed from this run's figures."""
    solo = _find(out, "minnows alone", "minnows")
    lru_m, fair_m = _find(out, BASELINE, "minnows"), _find(out, "fair", "minnows")
    lru_w, fair_w = _find(out, BASELINE, "whale"), _find(out, "fair", "whale")
    jain = next(r["jain"] for r in out["runs"] if r["run"] == "fair")
    return {
        "lru_minnow_evictions": lru_m["evictions_suffered"],
        "solo_minnow_evictions": solo["evictions_suffered"],
        "lru_minnow_stall_p99_ms": lru_m["stall_p99_ms"],
        "solo_minnow_stall_p99_ms": solo["stall_p99_ms"],
        "fair_minnow_stall_p99_ms": fair_m["stall_p99_ms"],
        "fair_minnow_stall_p99_within_1.25x_solo":
            fair_m["stall_p99_ms"] <= 1.25 * solo["stall_p99_ms"] + 1e-9,
        "whale_tokens_per_s_fair_over_lru": (fair_w["tokens_per_s"]
                                            / max(lru_w["tokens_per_s"], 1e-9)),
        "whale_keeps_0.9x": fair_w["tokens_per_s"] >= 0.9 * lru_w["tokens_per_s"],
        "fair_jain": jain,
        "fair_jain_at_least_0.95": jain >= 0.95,
    }


def build_report(out: dict) -> ScenarioReport:
    s = out["scenario"]
    r = ScenarioReport(
        "whale-minnows", "Whale and minnows: one long request beside many short ones",
        f"{s['whales']} whale(s) of {s['whale_tokens']} tokens beside {s['minnows']} minnows of "
        f"{s['minnow_tokens']} tokens ({s['minnow_tenants']} minnow tenant(s)), decoding side by "
        f"side for {s['duration_s']} s at {s['block_tokens']} tokens a page; the device tier "
        "holds 90% of the whole demand. fair = fair:reuse.")
    r.data = out
    rows = []
    for run in out["runs"]:
        for c in run["classes"]:
            rows.append([run["run"], c["klass"],
                         f"{c['stall_p50_ms']:.2f} / {c['stall_p99_ms']:.2f}",
                         f"{c['prefill_stall_max_ms']:.1f}",
                         f"{c['step_p50_ms']:.1f} / {c['step_p99_ms']:.1f}",
                         f"{c['tokens_per_s']:.0f}", c["evictions_suffered"],
                         c["evictions_caused"],
                         f"{c['admission_wait_p50_ms']:.1f} / {c['admission_wait_max_ms']:.1f}",
                         f"{c['mean_share_ratio']:.2f}",
                         "-" if run["jain"] is None else f"{run['jain']:.3f}"])
    r.table("Per run and class",
            ["run", "class", "decode stall p50/p99 ms", "prefill stall ms",
             "decode step p50/p99 ms", "tok/s", "evict suff", "evict caused",
             "adm wait p50/max ms", "share ratio", "Jain"], rows)
    v = out["verdict"]
    r.target("minnows' p99 stall under fair <= 1.25x alone",
             v["fair_minnow_stall_p99_within_1.25x_solo"],
             f"{v['fair_minnow_stall_p99_ms']:.2f} ms vs {v['solo_minnow_stall_p99_ms']:.2f} ms "
             f"alone (lru@reservation {v['lru_minnow_stall_p99_ms']:.2f} ms)")
    r.target("the whale keeps >= 0.9x its tokens/s under lru@reservation", v["whale_keeps_0.9x"],
             f"{v['whale_tokens_per_s_fair_over_lru']:.2f}x")
    r.target("Jain's index under fair >= 0.95", v["fair_jain_at_least_0.95"],
             f"{v['fair_jain']:.3f}")

    def bars(pyplot):
        fig, axes = pyplot.subplots(1, 2, figsize=(10, 3.5))
        runs = [run["run"] for run in out["runs"]]
        klasses = sorted({c["klass"] for run in out["runs"] for c in run["classes"]})
        width = 0.8 / max(len(klasses), 1)
        for i, k in enumerate(klasses):
            def value(run, key):
                return next((c[key] for c in run["classes"] if c["klass"] == k), 0)
            xs = [j + i * width for j in range(len(runs))]
            label_bars(axes[0], axes[0].bar(
                xs, [value(run, "stall_p99_ms") for run in out["runs"]], width, label=k),
                "{:.1f}")
            label_bars(axes[1], axes[1].bar(
                xs, [value(run, "evictions_suffered") for run in out["runs"]], width, label=k))
        for ax, title in zip(axes, ("decode stall p99 (ms)", "evictions suffered")):
            ax.set_xticks([j + width * (len(klasses) - 1) / 2 for j in range(len(runs))])
            ax.set_xticklabels(runs)
            ax.set_title(title)
            ax.legend(fontsize=8)
        return fig

    r.figure("runs", "Decode stall p99 and evictions suffered, per run and class", bars)
    return r


def run_cli(args) -> int:
    s = Scenario(whales=args.whales, whale_tokens=args.whale_tokens, minnows=args.minnows,
                 minnow_tenants=args.minnow_tenants,
                 minnow_tokens=args.minnow_tokens, duration_s=args.duration_s,
                 block_tokens=args.block_tokens, page_bytes=args.page_bytes,
                 device_pages=args.device_pages, step_ms=args.step_ms)
    console = Console(width=max(Console().width, 140))
    started = time.perf_counter()
    with console.status(f"whale and minnows: device {s.device} pages, demand {s.demand_pages}"):
        out = eventloop.run(run_all(s))
    return finish(build_report(out), console, args.json, args.report, started)
