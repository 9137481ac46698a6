"""`kvd-loadgen bandwidth-hog`: seed 001's long request that takes the memory bandwidth.

A hog tenant streams long-context promotions (its requests are bigger than the device tier;
every access brings a window of blocks back from host) beside a latency-sensitive tenant
whose decode steps each need a few blocks promoted at once (marked decode-critical, then
read). The device<->host link is capped. Phases, each on a fresh daemon:

- solo: the sensitive tenant alone (the hog holds memory but moves nothing);
- fifo: both, the link in arrival order with no budgets;
- fair: both, the link with classes, weights and caps;
- backlogged fifo / fair: both tenants streaming as hard as they can, to show the link's
  split between them against their weights, and its utilisation.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

from rich.console import Console

from kvd_client import AsyncClient, eventloop, pb
from kvd_client.client import intent_update
from kvd_loadgen.engine import percentile
from kvd_loadgen.scenario import Samplers, assert_sound, link_sample, local_kvd
from kvd_loadgen.scenario_report import ScenarioReport, draw_utilisation, finish

LINK = "default:device<->host"
PAGE = 16 * 1024  # the tiny model preset, 16 tokens a page


@dataclass
class HogScenario:
    link_mib_s: float = 16.0
    chunk_pages: int = 2
    hog_streams: int = 8
    hog_blocks: int = 32  # per hog request: several times what one window reads
    window: int = 8  # blocks a hog access reads (and mostly promotes)
    sensitive_requests: int = 4
    sensitive_blocks: int = 16  # promoted per sensitive decode step
    # Device pages left to the sensitive tenant when it runs alone (the hog pins the rest):
    # its own steps then push each other's blocks out, as the hog's traffic does otherwise.
    sensitive_room: int = 40
    sensitive_step_ms: float = 40.0
    hog_weight: float = 1.0
    sensitive_weight: float = 1.0
    duration_s: float = 4.0

    @property
    def device_pages(self) -> int:
        """As many as the hog's blocks: the hog alone could fill the device tier."""
        return self.hog_streams * self.hog_blocks

    @property
    def host_pages(self) -> int:
        return 2 * (self.hog_streams * self.hog_blocks * 2
                    + self.sensitive_requests * self.sensitive_blocks)


def kvd_config(s: HogScenario, scheduling: str) -> str:
    chunk = s.chunk_pages * PAGE
    return f"""
[server]
grace_s = 2

[[pool]]
model = "tiny"
device_pages = {s.device_pages}
host_pages = {s.host_pages}
policy = "intent"
admission = "reservation"  # the hog's reads page through the link: that is the contention
link_bandwidth = {int(s.link_mib_s * 2**20)}
link_burst = {2 * chunk}
link_chunk = {chunk}
link_scheduling = "{scheduling}"

[[tenant]]
name = "hog"
weight = {s.hog_weight}

[[tenant]]
name = "sensitive"
weight = {s.sensitive_weight}
"""


async def stream(c: AsyncClient, request_id: str, blocks: int, window: int,
                 stop: asyncio.Event) -> None:
    """Read a long request window by window: every access promotes what the last ones
    pushed out."""
    start = 0
    while not stop.is_set():
        await c.access(request_id, [(start + i) % blocks for i in range(window)])
        start += window


async def sensitive(c: AsyncClient, s: HogScenario, stop: asyncio.Event, waits: list) -> None:
    """Decode steps: mark one request's blocks decode-critical (kvd promotes them at once,
    first in line), read them, and let them go cold again. The wait is from the mark to the
    read's return."""
    step = 0
    while not stop.is_set():
        began = time.perf_counter()
        rid = f"sensitive{step % s.sensitive_requests}"
        blocks = range(s.sensitive_blocks)
        marked = await c.update_intents([intent_update(
            rid, i, priority=pb.PRIORITY_DECODE_CRITICAL) for i in blocks])
        reply = await c.access(rid, list(blocks))
        waited = time.perf_counter() - began
        await c.update_intents([intent_update(rid, i, priority=pb.PRIORITY_COLD)
                                for i in blocks])
        waits.append((waited, marked.num_prefetched + reply.num_promoted))
        step += 1
        await asyncio.sleep(max(0.0, s.sensitive_step_ms / 1000 - (time.perf_counter() - began)))


async def _fill(c: AsyncClient, s: HogScenario, phase: str, backlogged: bool) -> None:
    """The phase's requests: the hog's streams, and the sensitive tenant's (cold blocks it
    reads now and then, or, backlogged, streams as big as the hog's)."""
    for i in range(s.hog_streams):
        await c.admit(f"hog{i}", s.hog_blocks * 16, 0, tenant="hog")
        await c.allocate(f"hog{i}", s.hog_blocks)
    if phase == "solo":  # the hog holds memory, and moves nothing
        pins = s.device_pages - s.sensitive_room
        await c.update_intents([
            intent_update(f"hog{i // s.hog_blocks}", i % s.hog_blocks,
                          pin_requested=True) for i in range(pins)])
    if backlogged:  # the sensitive tenant streams as hard as the hog
        for i in range(s.hog_streams):
            await c.admit(f"bulk{i}", s.hog_blocks * 16, 0, tenant="sensitive")
            await c.allocate(f"bulk{i}", s.hog_blocks)
        return
    for i in range(s.sensitive_requests):
        rid = f"sensitive{i}"
        await c.admit(rid, s.sensitive_blocks * 16, 0, tenant="sensitive")
        await c.allocate(rid, s.sensitive_blocks)
        await c.update_intents([intent_update(rid, b, priority=pb.PRIORITY_COLD)
                                for b in range(s.sensitive_blocks)])


async def run_phase(s: HogScenario, phase: str) -> dict:
    scheduling = "fifo" if "fifo" in phase else "fair"
    backlogged = phase.startswith("backlogged")
    async with local_kvd(kvd_config(s, scheduling), prefix="kvd-hog-", timeout_s=60) as (_, c):
        await _fill(c, s, phase, backlogged)
        samplers = Samplers(c)
        stop = samplers.stopping
        streams = [f"hog{i}" for i in range(s.hog_streams) if phase != "solo"]
        if backlogged:
            streams += [f"bulk{i}" for i in range(s.hog_streams)]
        tasks = [asyncio.ensure_future(stream(c, rid, s.hog_blocks, s.window, stop))
                 for rid in streams]
        waits: list = []
        await asyncio.sleep(0.5)  # let queues form before measuring
        [samples] = samplers.start((link_sample, 0.25))
        if not backlogged:
            tasks.append(asyncio.ensure_future(sensitive(c, s, stop, waits)))
        await asyncio.sleep(s.duration_s)
        await samplers.stop()
        await asyncio.gather(*tasks)
        await assert_sound(c)
    first, last = samples[0], samples[-1]
    elapsed = last["t"] - first["t"]
    a, b = first["links"][LINK], last["links"][LINK]
    capacity = b["capacity"]
    rates = {t: (b["tenants"].get(t, 0) - a["tenants"].get(t, 0)) / elapsed
             for t in ("hog", "sensitive")}
    # Steps whose every block had been pushed out: each waited for the same transfer.
    promoted = [w * 1e3 for w, n in waits if n == s.sensitive_blocks]
    return {
        "phase": phase, "scheduling": scheduling, "elapsed_s": elapsed,
        "utilisation": (b["bytes"] - a["bytes"]) / (capacity * elapsed),
        "capacity_bytes_per_s": capacity,
        "bytes_per_s": rates,
        "sensitive_steps": len(waits),
        "sensitive_promoting_steps": len(promoted),
        "wait_ms": promoted,
        "wait_p50_ms": percentile(promoted, 50),
        "wait_p99_ms": percentile(promoted, 99),
        "samples": samples,
    }


PHASES = ("solo", "fifo", "fair", "backlogged fifo", "backlogged fair")


async def run_all(s: HogScenario, progress=None) -> dict:
    results = {}
    for phase in PHASES:
        if progress is not None:
            progress(phase)
        results[phase] = await run_phase(s, phase)
    return {"scenario": asdict(s), "phases": results}


def build_report(out: dict) -> ScenarioReport:
    s = HogScenario(**out["scenario"])
    ph = out["phases"]
    r = ScenarioReport(
        "bandwidth-hog",
        "Bandwidth hog: a long request's promotions beside a latency-sensitive tenant",
        f"The device<->host link is capped at {s.link_mib_s:g} MiB/s (chunks of "
        f"{s.chunk_pages} pages of 16 KiB). The hog streams {s.hog_streams} requests of "
        f"{s.hog_blocks} blocks, reading {s.window} blocks an access, in a {s.device_pages}-"
        f"page device tier; the sensitive tenant's decode step marks {s.sensitive_blocks} "
        f"demoted blocks decode-critical and reads them every {s.sensitive_step_ms:g} ms. "
        "The wait is from the mark to the read's return, measured by the client (it includes "
        f"two RPCs). Each phase runs {s.duration_s:g} s on a fresh daemon; weights "
        f"hog {s.hog_weight:g}, sensitive {s.sensitive_weight:g}.")
    r.data = out
    _tables(r, s, ph)
    _targets(r, s, ph)
    _figures(r, s, ph)
    return r


def _weights(s: HogScenario) -> dict[str, float]:
    return {"hog": s.hog_weight, "sensitive": s.sensitive_weight}


def _tables(r: ScenarioReport, s: HogScenario, ph: dict) -> None:
    solo = ph["solo"]["wait_p99_ms"]
    rows = []
    for name in ("solo", "fifo", "fair"):
        p = ph[name]
        rows.append([name, p["sensitive_promoting_steps"],
                     f"{p['wait_p50_ms']:.1f} / {p['wait_p99_ms']:.1f}",
                     f"{p['wait_p99_ms'] / max(solo, 1e-9):.2f}x",
                     f"{p['bytes_per_s']['hog'] / 2**20:.1f}",
                     f"{p['bytes_per_s']['sensitive'] / 2**20:.1f}",
                     f"{p['utilisation'] * 100:.0f}%"])
    r.table("Sensitive tenant's decode-critical promotion wait",
            ["phase", "steps", "wait p50 / p99 ms", "p99 vs solo", "hog MiB/s",
             "sensitive MiB/s", "link use"], rows)
    rows = []
    weights = _weights(s)
    for name in ("backlogged fifo", "backlogged fair"):
        p = ph[name]
        total = sum(p["bytes_per_s"].values())
        for t, w in weights.items():
            share = p["bytes_per_s"][t] / max(total, 1e-9)
            want = w / sum(weights.values())
            rows.append([name, t, f"{w:g}", f"{p['bytes_per_s'][t] / 2**20:.2f}",
                         f"{share * 100:.1f}%", f"{want * 100:.1f}%",
                         f"{(share - want) / want * 100:+.1f}%",
                         f"{p['utilisation'] * 100:.0f}%"])
    r.table("Both tenants backlogged: the link's split against the weights",
            ["phase", "tenant", "weight", "MiB/s", "share", "weighted share", "off by",
             "link use"], rows)


def _targets(r: ScenarioReport, s: HogScenario, ph: dict) -> None:
    solo = ph["solo"]["wait_p99_ms"]
    weights = _weights(s)
    fair, bl = ph["fair"], ph["backlogged fair"]
    r.target("sensitive p99 wait with budgets <= 1.5x solo",
             fair["wait_p99_ms"] <= 1.5 * solo,
             f"{fair['wait_p99_ms']:.1f} ms vs solo {solo:.1f} ms "
             f"({fair['wait_p99_ms'] / max(solo, 1e-9):.2f}x; fifo "
             f"{ph['fifo']['wait_p99_ms'] / max(solo, 1e-9):.2f}x)")
    r.target("link utilisation >= 90% of the cap while both are backlogged",
             bl["utilisation"] >= 0.9, f"{bl['utilisation'] * 100:.1f}%")
    total = sum(bl["bytes_per_s"].values())
    offs = {t: abs(bl["bytes_per_s"][t] / max(total, 1e-9) - w / sum(weights.values()))
            / (w / sum(weights.values())) for t, w in weights.items()}
    r.target("each tenant's share within 10% of its weight",
             max(offs.values()) <= 0.10,
             ", ".join(f"{t} off by {o * 100:.1f}%" for t, o in offs.items()))


def _figures(r: ScenarioReport, s: HogScenario, ph: dict) -> None:
    def cdf(pyplot):
        fig, ax = pyplot.subplots(figsize=(7, 3.5))
        for name in ("solo", "fifo", "fair"):
            xs = sorted(ph[name]["wait_ms"])
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                        label=name)
        ax.set_xscale("log")
        ax.set_xlabel("decode-critical promotion wait (ms)")
        ax.set_ylabel("fraction of steps")
        ax.set_title("Sensitive tenant's promotion wait")
        ax.legend()
        return fig

    def shares(pyplot):
        fig, ax = pyplot.subplots(figsize=(7, 3.2))
        names = ["fifo", "fair", "backlogged fifo", "backlogged fair"]
        for i, t in enumerate(("hog", "sensitive")):
            ax.bar([j + i * 0.4 for j in range(len(names))],
                   [ph[n]["bytes_per_s"][t] / 2**20 for n in names], 0.4, label=t)
        ax.axhline(s.link_mib_s, color="grey", linestyle="--", linewidth=0.8,
                   label="link cap")
        ax.set_xticks([j + 0.2 for j in range(len(names))])
        ax.set_xticklabels(names)
        ax.set_ylabel("MiB/s")
        ax.set_title("Bytes per second by tenant")
        ax.legend(fontsize=8)
        return fig

    r.figure("wait_cdf", "Sensitive tenant's decode-critical promotion wait, CDF", cdf)
    r.figure("link_utilisation", "Link utilisation over time, per phase",
             draw_utilisation({n: ph[n]["samples"] for n in PHASES}, lambda _: LINK,
                              "device<->host link utilisation"))
    r.figure("tenant_bytes", "Bytes per second by tenant, per phase", shares)


def run_cli(args) -> int:
    s = HogScenario(link_mib_s=args.link_mib_s, hog_streams=args.hog_streams,
                    duration_s=args.duration_s, hog_weight=args.hog_weight,
                    sensitive_weight=args.sensitive_weight)
    console = Console(width=max(Console().width, 120))
    started = time.perf_counter()
    with console.status("bandwidth hog") as status:
        out = eventloop.run(run_all(s, lambda phase: status.update(f"bandwidth hog: {phase}")))
    for p in out["phases"].values():  # the raw series stay in --json, not on the terminal
        p["samples_kept"] = len(p["samples"])
    return finish(build_report(out), console, args.json, args.report, started)
