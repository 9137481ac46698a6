"""`kvd-loadgen cluster`: three kvd processes and one etcd on this machine (loopback).

Node `a` serves prefill for nodes `b` and `c` (its `prefill` pool hands off to their `decode`
pools over capped links) and every node serves requests in its `default` pool. Two tenants
with cluster quotas send traffic skewed across the nodes: `chat` (weight 2, a cluster limit)
mostly to `a`, `batch` (weight 1) mostly to `c`. Midway node `c` is killed; later etcd is
stopped and started again. The report: each tenant's cluster-wide pages against its quota
and fair share over time, handoff throughput against each link's cap, how long the dead node
counted, and how the nodes decided while etcd was away and converged after.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
import random
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console

from kvd_client import AsyncClient, KvdClientError, eventloop, pb
from kvd_loadgen.etcd import LocalEtcd, etcd_binary, free_port
from kvd_loadgen.local import LocalKvd
from kvd_loadgen.scenario_report import ScenarioReport, finish

PAGE = 16 * 1024
NODES = ("a", "b", "c")
# Workers sending each tenant's requests to each node: the skew.
WORKERS = {"chat": {"a": 8, "b": 3, "c": 1}, "batch": {"a": 1, "b": 2, "c": 6}}


@dataclass
class ClusterScenario:
    duration_s: float = 24.0
    kill_at_s: float = 8.0  # node c dies (SIGKILL)
    etcd_stop_at_s: float = 12.0
    etcd_start_at_s: float = 16.0
    chat_limit: int = 300  # pages, over the cluster
    device_pages: int = 256  # each node's default pool
    link_mib_s: float = 8.0  # a's links to b/decode and c/decode
    handoff_workers: int = 3  # per link
    lease_ttl_s: float = 2.0
    reconcile_s: float = 0.25
    seed: int = 7


def _pool(name: str, device_pages: int, host_pages: int, policy: str = "lru") -> str:
    return (f'\n[[pool]]\nname = "{name}"\npage_bytes = {PAGE}\nblock_tokens = 16\n'
            f'device_pages = {device_pages}\nhost_pages = {host_pages}\npolicy = "{policy}"\n')


def _config(s: ClusterScenario, name: str, etcd: str, ports: dict[str, int]) -> str:
    pools = _pool("default", s.device_pages, 2 * s.device_pages, "fair")
    if name == "a":
        pools += _pool("prefill", 256, 256) + "".join(f"""
[[peer]]
name = "{peer}"
address = "127.0.0.1:{ports[peer]}"
token = "{peer}-admin-token"
timeout_s = 1
[[link]]
source = "prefill"
target = "{peer}/decode"
bandwidth = "{s.link_mib_s}MiB"
""" for peer in ("b", "c"))
    else:
        pools += _pool("decode", 512, 512)
    return f"""
[server]
tcp = "127.0.0.1:{ports[name]}"
allow_plaintext_tokens = true   # loopback only: peers present the admin token
metrics = ""
[auth]
admin_token = "{name}-admin-token"
[cluster]
etcd = "{etcd}"
node = "{name}"
lease_ttl_s = {s.lease_ttl_s}
reconcile_s = {s.reconcile_s}
{pools}
[[tenant]]
name = "chat"
weight = 2
[tenant.cluster]
weight = 2
limit = {s.chat_limit}

[[tenant]]
name = "batch"
[tenant.cluster]
weight = 1
"""


async def _serve(client: AsyncClient, tenant: str, node: str, worker: int, rng: random.Random,
                 stop: asyncio.Event, outcomes: dict) -> None:
    """One client of a tenant on a node: requests of 16-48 pages held about a second."""
    i = 0
    while not stop.is_set():
        i += 1
        rid = f"{tenant}-{node}{worker}-{i}"
        pages = rng.randint(16, 48)
        try:
            reply = await client.admit(rid, prompt_tokens=pages * 16, output_tokens=0,
                                       tenant=tenant)
            if reply.decision == pb.DECISION_QUEUED:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(_admitted(client, rid), 2.0)
            outcomes[pb.Decision.Name(reply.decision)] += 1
            await asyncio.sleep(rng.uniform(0.5, 1.5))
            with contextlib.suppress(KvdClientError):
                await client.release(rid)
        except KvdClientError:
            outcomes["errors"] += 1
            await asyncio.sleep(0.2)


async def _admitted(client: AsyncClient, rid: str) -> None:
    async for update in client.wait_admission(rid):
        if update.decision == pb.DECISION_ADMITTED:
            return


async def _hand_off(a: AsyncClient, decode: AsyncClient | None, peer: str, worker: int,
                    stop: asyncio.Event, counts: dict) -> None:
    """Prefill on a, hand off to the peer's decode pool, decode (released) there."""
    i = 0
    while not stop.is_set():
        i += 1
        rid = f"h-{peer}{worker}-{i}"
        tenant = "chat" if i % 2 else "batch"
        try:
            reply = await a.admit(rid, prompt_tokens=16 * 16, output_tokens=0, pool="prefill",
                                  handoff_pool=f"{peer}/decode", tenant=tenant)
            if reply.decision != pb.DECISION_ADMITTED:
                counts["not admitted"] += 1
                with contextlib.suppress(KvdClientError):
                    await a.release(rid)
                await asyncio.sleep(0.2)
                continue
            await a.allocate(rid, 16)
            await a.handoff_all(rid, timeout_s=10)
            counts["completed"] += 1
            if decode is not None:
                with contextlib.suppress(KvdClientError):
                    await decode.release(rid)
        except KvdClientError as exc:
            counts["failed"] += 1
            counts["last error"] = str(exc)[:160]
            with contextlib.suppress(KvdClientError):
                await a.release(rid)
            await asyncio.sleep(0.2)


async def run(s: ClusterScenario, progress=None) -> dict:
    if etcd_binary() is None:
        raise RuntimeError("no etcd on PATH (Debian: apt-get install etcd-server)")
    rng = random.Random(s.seed)
    with tempfile.TemporaryDirectory(prefix="kvd-cluster-") as tmp:
        etcd = LocalEtcd(Path(tmp)).start()
        ports = {n: free_port() for n in NODES}
        kvds = {}
        try:
            for name in NODES:
                workdir = Path(tmp) / name
                workdir.mkdir()
                (workdir / "kvd.toml").write_text(_config(s, name, etcd.address, ports))
                kvds[name] = LocalKvd("--config", str(workdir / "kvd.toml"),
                                      workdir=workdir).start()
            clients = {n: AsyncClient(k.target, timeout_s=10) for n, k in kvds.items()}
            for c in clients.values():
                await c.__aenter__()
            try:
                return await _drive(s, rng, etcd, kvds, clients, progress)
            finally:
                for c in clients.values():
                    with contextlib.suppress(Exception):
                        await c.__aexit__(None, None, None)
        finally:
            for k in kvds.values():
                k.stop()
            etcd.stop()


async def _drive(s, rng, etcd, kvds, clients, progress) -> dict:
    for c in clients.values():  # everyone sees everyone before the load starts
        for _ in range(200):
            if {n.node for n in (await c.get_cluster("default")).nodes} == set(NODES):
                break
            await asyncio.sleep(0.05)
    stop = asyncio.Event()
    outcomes = {t: {n: _counter() for n in NODES} for t in WORKERS}
    handoffs = {peer: _counter() for peer in ("b", "c")}
    tasks = [asyncio.ensure_future(_serve(clients[n], t, n, w, random.Random(rng.random()),
                                          stop, outcomes[t][n]))
             for t, per_node in WORKERS.items() for n, k in per_node.items() for w in range(k)]
    tasks += [asyncio.ensure_future(_hand_off(clients["a"], clients[peer], peer, w, stop,
                                              handoffs[peer]))
              for peer in ("b", "c") for w in range(s.handoff_workers)]
    samples: list[dict] = []
    events: dict[str, float] = {}
    start = time.monotonic()
    alive = set(NODES)

    async def sample() -> None:
        row = {"t": time.monotonic() - start, "nodes": {}}
        for name in sorted(alive):
            with contextlib.suppress(KvdClientError):
                view = await clients[name].get_cluster("default")
                row["nodes"][name] = {
                    "etcd_up": view.etcd_up, "members": sorted({n.node for n in view.nodes}),
                    "tenants": {t.tenant: {"share": t.share_pages, "limit": t.limit_pages,
                                           "parts": {p.node: (p.reserved_pages,
                                                              p.entitlement_pages,
                                                              p.may_reserve_pages)
                                                     for p in t.nodes}}
                                for t in view.tenants}}
                row["nodes"][name]["own"] = {
                    t.tenant: t.reserved_pages for t in await clients[name].list_tenants("default")}
        with contextlib.suppress(KvdClientError):
            row["links"] = {lk.link: lk.bytes_total for lk in await clients["a"].list_links()
                            if "/" in lk.link}
        samples.append(row)

    try:
        while (now := time.monotonic() - start) < s.duration_s:
            if "c killed" not in events and now >= s.kill_at_s:
                kvds["c"].proc.send_signal(signal.SIGKILL)
                alive.discard("c")
                events["c killed"] = now
            if "etcd stopped" not in events and now >= s.etcd_stop_at_s:
                etcd.stop()
                events["etcd stopped"] = time.monotonic() - start
            if "etcd started" not in events and now >= s.etcd_start_at_s:
                etcd.start()
                events["etcd started"] = time.monotonic() - start
            await sample()
            if progress:
                progress(f"cluster: {now:.0f} / {s.duration_s:.0f} s")
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"scenario": asdict(s), "samples": samples, "events": events,
            "outcomes": outcomes, "handoffs": handoffs}


def _counter() -> Counter:
    return Counter()


# ---------------------------------------------------------------------- figures and report

def _cluster_reserved(row: dict, tenant: str) -> int:
    """A tenant's pages reserved over the live nodes: each node's own, fresh figure."""
    return sum(n["own"].get(tenant, 0) for n in row["nodes"].values() if "own" in n)


def _first_after(samples, t0: float, predicate) -> float | None:
    for row in samples:
        if row["t"] >= t0 and predicate(row):
            return row["t"] - t0
    return None


def analyse(out: dict) -> dict:
    s = out["scenario"]
    samples, events = out["samples"], out["events"]
    chat = [_cluster_reserved(r, "chat") for r in samples]
    kill = events.get("c killed")
    left = (None if kill is None else _first_after(
        samples, kill, lambda r: all("c" not in n["members"] for n in r["nodes"].values()
                                     if "members" in n)))
    stopped, started = events.get("etcd stopped"), events.get("etcd started")
    noticed = (None if stopped is None else _first_after(
        samples, stopped, lambda r: all(not n["etcd_up"] for n in r["nodes"].values()
                                        if "etcd_up" in n)))
    converged = (None if started is None else _first_after(
        samples, started, lambda r: all(n["etcd_up"] and n["members"] == ["a", "b"]
                                        for n in r["nodes"].values() if "etcd_up" in n)))
    down = [c for r, c in zip(samples, chat)
            if stopped is not None and started is not None and stopped <= r["t"] < started]
    rates = {}
    for link in ("prefill->b/decode", "prefill->c/decode"):
        pts = [(r["t"], r["links"][link]) for r in samples if link in r.get("links", {})]
        busy = [(b - a) / (tb - ta) / 2**20 for (ta, a), (tb, b) in zip(pts, pts[1:])
                if tb > ta and (kill is None or tb < kill or link.startswith("prefill->b"))]
        rates[link] = {"mean_mib_s": statistics.fmean(busy) if busy else 0.0,
                       "p90_mib_s": sorted(busy)[int(0.9 * (len(busy) - 1))] if busy else 0.0}
    return {"chat_max": max(chat, default=0), "chat_mean": statistics.fmean(chat or [0]),
            "chat_over": max(0, max(chat, default=0) - s["chat_limit"]),
            "left_after_s": left, "etcd_noticed_s": noticed, "converged_after_s": converged,
            "chat_max_while_etcd_down": max(down, default=0), "link_rates": rates}


def build_report(out: dict) -> ScenarioReport:
    s = out["scenario"]
    a = analyse(out)
    report = ScenarioReport(
        "cluster", "Three nodes and etcd",
        f"Three kvd processes and one etcd on loopback. Node a prefills for b and c (links "
        f"capped at {s['link_mib_s']:g} MiB/s each, {s['handoff_workers']} handoff streams "
        f"per link); every node serves `chat` (weight 2, cluster limit {s['chat_limit']} pages) "
        f"and `batch` (weight 1) in a {s['device_pages']}-page pool, skewed: chat's clients "
        f"a/b/c {WORKERS['chat']['a']}/{WORKERS['chat']['b']}/{WORKERS['chat']['c']}, batch's "
        f"{WORKERS['batch']['a']}/{WORKERS['batch']['b']}/{WORKERS['batch']['c']}. Node c is "
        f"killed at {s['kill_at_s']:g} s; etcd stops at {s['etcd_stop_at_s']:g} s and starts "
        f"at {s['etcd_start_at_s']:g} s. Lease {s['lease_ttl_s']:g} s, reconcile "
        f"{s['reconcile_s']:g} s.")
    report.data = out
    report.table("Tenants over the cluster (pages of the default pools)",
                 ["tenant", "quota", "most reserved", "mean reserved", "most while etcd away"],
                 [["chat", f"limit {s['chat_limit']}, weight 2", f"{a['chat_max']}",
                   f"{a['chat_mean']:.0f}", f"{a['chat_max_while_etcd_down']}"]])
    report.table("Handoffs from a's prefill pool",
                 ["link", "cap MiB/s", "mean MiB/s", "p90 MiB/s", "completed", "failed"],
                 [[link, f"{s['link_mib_s']:g}", f"{r['mean_mib_s']:.2f}",
                   f"{r['p90_mib_s']:.2f}", out["handoffs"][_peer(link)]["completed"],
                   out["handoffs"][_peer(link)]["failed"]]
                  for link, r in a["link_rates"].items()])
    fmt = lambda v: "never" if v is None else f"{v:.2f} s"  # noqa: E731
    report.table("Failures", ["what", "measured"], [
        ["c killed: until a and b's pictures dropped it", fmt(a["left_after_s"])],
        ["etcd stopped: until every node said so", fmt(a["etcd_noticed_s"])],
        ["etcd started: until a and b reached it and saw each other", fmt(a["converged_after_s"])]])
    report.target("chat's cluster pages within its limit plus one reconcile of growth "
                  "(overshoot <= 96 pages: a largest request, 48, from each other node)",
                  a["chat_over"] <= 96, f"{a['chat_over']} pages over")
    report.target(f"a killed node leaves within lease + reconcile + 1 s "
                  f"({s['lease_ttl_s'] + s['reconcile_s'] + 1:g} s)",
                  a["left_after_s"] is not None
                  and a["left_after_s"] <= s["lease_ttl_s"] + s["reconcile_s"] + 1.0,
                  fmt(a["left_after_s"]))
    report.target("converged within 5 s of etcd's return",
                  a["converged_after_s"] is not None and a["converged_after_s"] <= 5.0,
                  fmt(a["converged_after_s"]))
    b_rate = a["link_rates"]["prefill->b/decode"]["p90_mib_s"]
    report.target("handoffs to b run at >= 80% of the link's cap (p90 of 0.2 s samples)",
                  b_rate >= 0.8 * s["link_mib_s"], f"{b_rate:.2f} MiB/s")
    report.figure("tenants", "chat's pages reserved over the cluster against its limit and "
                  "its cluster fair share, and each node's part", lambda plt: _tenants(plt, out))
    report.figure("handoffs", "Handoff throughput per link against its cap",
                  lambda plt: _handoffs(plt, out))
    return report


def _peer(link: str) -> str:
    """prefill->b/decode -> b"""
    return link.split("->", 1)[1].split("/", 1)[0]


def _marks(ax, events: dict) -> None:
    for label, t in events.items():
        ax.axvline(t, color="grey", linestyle=":", linewidth=0.8)
        ax.text(t, ax.get_ylim()[1] * 0.97, f" {label}", fontsize=7, va="top")


def _tenants(plt, out: dict):
    s, samples = out["scenario"], out["samples"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ts = [r["t"] for r in samples]
    ax.plot(ts, [_cluster_reserved(r, "chat") for r in samples], label="chat: reserved, cluster")
    for node in NODES:
        ax.plot(ts, [r["nodes"].get(node, {}).get("own", {}).get("chat", 0) for r in samples],
                linewidth=0.8, label=f"chat on {node}")
    share = [r["nodes"]["a"]["tenants"]["chat"]["share"] if "a" in r["nodes"]
             and "chat" in r["nodes"]["a"].get("tenants", {}) else None for r in samples]
    ax.plot(ts, share, linestyle="--", label="chat: cluster fair share (a's picture)")
    ax.axhline(s["chat_limit"], color="black", linewidth=0.8, label="chat: cluster limit")
    ax.plot(ts, [_cluster_reserved(r, "batch") for r in samples], label="batch: reserved, cluster")
    ax.set_xlabel("seconds")
    ax.set_ylabel("pages")
    ax.set_ylim(bottom=0)
    _marks(ax, out["events"])
    ax.legend(fontsize=7, loc="lower right")
    return fig


def _handoffs(plt, out: dict):
    s, samples = out["scenario"], out["samples"]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for link in ("prefill->b/decode", "prefill->c/decode"):
        pts = [(r["t"], r["links"][link]) for r in samples if link in r.get("links", {})]
        ax.plot([tb for (_, _), (tb, _) in zip(pts, pts[1:])],
                [(b - a) / max(tb - ta, 1e-9) / 2**20 for (ta, a), (tb, b) in zip(pts, pts[1:])],
                label=link)
    ax.axhline(s["link_mib_s"], color="black", linewidth=0.8, label="each link's cap")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB/s")
    ax.set_ylim(bottom=0)
    _marks(ax, out["events"])
    ax.legend(fontsize=7)
    return fig


def run_cli(args) -> int:
    s = ClusterScenario(duration_s=args.duration_s, link_mib_s=args.link_mib_s,
                        chat_limit=args.chat_limit)
    s.kill_at_s, s.etcd_stop_at_s, s.etcd_start_at_s = (s.duration_s / 3, s.duration_s / 2,
                                                        s.duration_s * 2 / 3)
    console = Console(width=max(Console().width, 140))
    started = time.perf_counter()
    try:
        with console.status("cluster") as status:
            out = eventloop.run(run(s, status.update))
    except RuntimeError as exc:
        console.print(f"kvd-loadgen cluster: {exc}")
        return 2
    return finish(build_report(out), console, args.json, args.report, started)

