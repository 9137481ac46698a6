"""kvds on several nodes sharing tenants' quotas through a real etcd (Debian's etcd-server,
started here on loopback with a temporary data directory): a cluster-wide limit holds across
nodes within its stated bound, a killed node leaves the picture within its lease, and when
etcd stops the nodes go on deciding, then converge when it is back."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvd_client import AsyncClient, pb
from kvd_loadgen.etcd import LocalEtcd, etcd_binary, free_port as _port
from kvd_loadgen.local import LocalKvd

ETCD = etcd_binary()
needs_etcd = pytest.mark.skipif(
    ETCD is None, reason="no etcd: `make test` installs Debian's etcd-server where it runs as "
    "root with apt; elsewhere install etcd (v3 API)")

KVCTL = str(Path(sys.executable).with_name("kvctl"))
LEASE_TTL_S = 2.0
RECONCILE_S = 0.2
LIMIT = 40  # chat's cluster limit, pages


class Etcd(LocalEtcd):
    """The cluster tests' etcd (and test_operations' when it is here)."""


@pytest.fixture
def etcd(tmp_path):
    server = Etcd(tmp_path).start()
    yield server
    server.stop()


def node(tmp_path: Path, etcd: Etcd, name: str, *args: str) -> LocalKvd:
    workdir = tmp_path / name
    workdir.mkdir()
    config = workdir / "kvd.toml"
    config.write_text(f"""
[cluster]
etcd = "{etcd.address}"
node = "{name}"
lease_ttl_s = {LEASE_TTL_S}
reconcile_s = {RECONCILE_S}
[[pool]]
name = "default"
model = "tiny"
device_pages = 64
host_pages = 64
[[tenant]]
name = "chat"
[tenant.cluster]
limit = {LIMIT}
""")
    return LocalKvd("--config", str(config), *args, workdir=workdir)


async def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


async def _members(client: AsyncClient) -> set[str]:
    return {n.node for n in (await client.get_cluster()).nodes}


async def _chat(client: AsyncClient) -> pb.TenantInfo:
    return next(t for t in await client.list_tenants() if t.tenant == "chat")


@needs_etcd
async def test_a_cluster_limit_holds_across_nodes_within_one_reconcile_of_growth(tmp_path,
                                                                                  etcd):
    """The bound: every node computes its part of the limit from one picture, and a node's
    picture of the others is at most one reconcile interval (plus an etcd round trip) old.
    So the tenant's pages reserved over the cluster pass the limit by at most what the other
    nodes reserved within one such interval. Measured here with two nodes admitting as fast
    as they are asked."""
    with node(tmp_path, etcd, "a") as a, node(tmp_path, etcd, "b") as b:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            for c in (ca, cb):
                await _wait_for(lambda c=c: _members(c), 10, "both nodes in the picture")
                await _wait_for(lambda c=c: _members_are(c, {"a", "b"}), 10, "a and b")
            samples: list[tuple[float, int, int]] = []
            stop = asyncio.Event()

            async def sample():
                while not stop.is_set():
                    ra, rb = (await _chat(ca)).reserved_pages, (await _chat(cb)).reserved_pages
                    samples.append((time.monotonic(), ra, rb))
                    await asyncio.sleep(0.02)

            async def admit(c: AsyncClient, name: str):
                for i in range(30):  # 4 pages each: 240 pages asked for, 6x the limit
                    await c.admit(f"{name}{i}", 64, tenant="chat")

            sampler = asyncio.ensure_future(sample())
            await asyncio.gather(admit(ca, "a"), admit(cb, "b"))
            await asyncio.sleep(4 * RECONCILE_S)
            stop.set()
            await sampler
            view = await ca.get_cluster()
            shown = subprocess.run([KVCTL, "--target", a.target, "cluster"],
                                   capture_output=True, text=True, timeout=60)
            assert shown.returncode == 0, shown.stderr
            assert "a (this node)" in shown.stdout and "reachable" in shown.stdout
            assert "chat" in shown.stdout and "may reserve" in shown.stdout
            data = json.loads(subprocess.run([KVCTL, "--target", a.target, "--json", "cluster"],
                                             capture_output=True, text=True, timeout=60).stdout)
            assert data["etcd_up"] and data["tenants"][0]["limit_pages"] == LIMIT
    totals = [ra + rb for _, ra, rb in samples]
    window = RECONCILE_S + 0.1  # one reconcile interval and etcd's round trip

    def growth(column: int) -> int:  # the most a node's reservations grew in one window
        return max(samples[j][column] - samples[i][column]
                   for i in range(len(samples)) for j in range(i, len(samples))
                   if samples[j][0] - samples[i][0] <= window)

    bound = max(growth(1), growth(2))
    overshoot = max(totals) - LIMIT
    print(f"cluster limit {LIMIT} pages: most reserved {max(totals)}, overshoot "
          f"{max(0, overshoot)}, bound (one node's growth in {window:.2f} s) {bound}")
    assert max(totals) > LIMIT // 2  # it did admit on both nodes
    assert overshoot <= bound
    assert totals[-1] <= LIMIT + bound
    (chat,) = view.tenants
    assert chat.limit_pages == LIMIT and chat.reserved_pages == totals[-1]
    assert {n.node for n in chat.nodes} == {"a", "b"}
    assert sum(n.may_reserve_pages for n in chat.nodes) <= max(LIMIT, chat.reserved_pages)


async def _members_are(client: AsyncClient, names: set[str]) -> bool:
    return await _members(client) == names


@needs_etcd
async def test_a_killed_node_leaves_the_picture_within_its_lease(tmp_path, etcd):
    with node(tmp_path, etcd, "a") as a, node(tmp_path, etcd, "b") as b:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            await _wait_for(lambda: _members_are(ca, {"a", "b"}), 10, "a sees a and b")
            for i in range(8):  # b reserves 32 of the 40 pages
                await cb.admit(f"b{i}", 64, tenant="chat")
            await _wait_for(lambda: _reserved_seen(ca, "b", 32), 5, "a sees b's 32 pages")
            waiting = await ca.admit("big", 16 * 16, tenant="chat")  # 16 pages: over a's part
            assert waiting.decision == pb.DECISION_QUEUED, waiting
            b.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            await _wait_for(lambda: _members_are(ca, {"a"}), LEASE_TTL_S + 3, "b leaves")
            left_after = time.monotonic() - killed
            # b's pages no longer count: a admits what it queued.
            await _wait_for(lambda: _admitted(ca, "big"), 3, "a admits its queued request")
    assert left_after <= LEASE_TTL_S + RECONCILE_S + 1.0, left_after
    print(f"a killed node left the picture {left_after:.2f} s after SIGKILL "
          f"(lease TTL {LEASE_TTL_S} s)")


async def _reserved_seen(client: AsyncClient, node_name: str, pages: int) -> bool:
    view = await client.get_cluster()
    return any(n.node == node_name and n.reserved_pages >= pages for n in view.nodes)


async def _admitted(client: AsyncClient, request_id: str) -> bool:
    return any(r.request_id.endswith(request_id) and r.state == "admitted"
               for r in await client.list_requests())


@needs_etcd
async def test_etcd_down_then_up_decisions_continue_then_converge(tmp_path, etcd):
    port = _port()
    with node(tmp_path, etcd, "a", "--metrics", f"127.0.0.1:{port}") as a, \
            node(tmp_path, etcd, "b") as b:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            await _wait_for(lambda: _members_are(ca, {"a", "b"}), 10, "a sees a and b")
            events = []
            subscribed = asyncio.Event()

            async def watch():
                async for event in ca.watch_events(kinds=["cluster"],
                                                   on_subscribed=subscribed.set):
                    events.append(event.detail["change"])

            watcher = asyncio.ensure_future(watch())
            await asyncio.wait_for(subscribed.wait(), 10)
            etcd.stop()
            view = await _wait_for(lambda: _etcd_down(ca), 5, "a notices etcd is away")
            assert "unreachable" in view.detail and "deciding on the picture" in view.detail
            # Said so: /healthz (still 200: alive), the metric, the event, the log (below).
            health = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz").read().decode()
            assert health.startswith("ok\n") and "unreachable" in health
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
            assert "kvd_cluster_etcd_up 0.0" in metrics
            # Decisions go on, on the last picture: a's part of the limit is 20 pages.
            admitted = [await ca.admit(f"a{i}", 64, tenant="chat") for i in range(6)]
            assert [r.decision for r in admitted].count(pb.DECISION_ADMITTED) == 5
            assert admitted[-1].decision == pb.DECISION_QUEUED
            assert "part of its cluster limit" in admitted[-1].reason
            assert {n.node for n in view.nodes} == {"a", "b"}  # the last picture stands
            etcd.start()
            await _wait_for(lambda: _etcd_back(ca), 10, "a reaches etcd again")
            await _wait_for(lambda: _etcd_back(cb), 10, "b reaches etcd again")
            await _wait_for(lambda: _members_are(cb, {"a", "b"}), 5, "b sees both again")
            # Converged: a's part of the limit grows where its request waits (it is admitted),
            # and b's picture has a's 24 pages, so b may reserve only the rest.
            await _wait_for(lambda: _admitted(ca, "a5"), 5, "a admits its waiting request")
            await _wait_for(lambda: _reserved_seen(cb, "a", 24), 5, "b sees a's pages")
            view_b = await cb.get_cluster()
            (chat,) = view_b.tenants
            assert chat.reserved_pages == 24
            assert sum(n.may_reserve_pages for n in chat.nodes) <= LIMIT
            await _wait_for(lambda: _has(events, "etcd_back"), 5, "the event etcd_back")
            watcher.cancel()
            assert events[:2] == ["etcd_lost", "etcd_back"]
    log = a.log()
    assert '"etcd unreachable; deciding on the last picture of the cluster"' in log
    assert '"etcd reachable again; converging"' in log


async def _has(items: list, item) -> bool:
    return item in items


async def _etcd_down(client: AsyncClient):
    view = await client.get_cluster()
    return view if not view.etcd_up else None


async def _etcd_back(client: AsyncClient) -> bool:
    return (await client.get_cluster()).etcd_up


def test_kvctl_cluster_on_a_kvd_that_decides_alone(kvd):
    shown = subprocess.run([KVCTL, "--target", kvd.target, "cluster"], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0 and "decides alone" in shown.stdout


@needs_etcd
async def test_with_etcd_away_the_nodes_keep_to_their_parts_of_a_cluster_limit(tmp_path, etcd):
    """Each node's picture of the other is frozen while etcd is away, its own figures are
    not: parts recomputed from the two no longer add up to the limit (both nodes then took
    most of the room, 64 pages reserved against a 40-page limit). Kept as they were, they
    do."""
    with node(tmp_path, etcd, "a") as a, node(tmp_path, etcd, "b") as b:
        async with AsyncClient(a.target) as ca, AsyncClient(b.target) as cb:
            await _wait_for(lambda: _members_are(ca, {"a", "b"}), 10, "a sees a and b")
            await _wait_for(lambda: _members_are(cb, {"a", "b"}), 10, "b sees a and b")
            for name, c in (("a", ca), ("b", cb)):
                for i in range(2):  # 8 pages reserved on each node, nothing waiting
                    await c.admit(f"{name}{i}", 64, tenant="chat")
            await _wait_for(lambda: _reserved_seen(ca, "b", 8), 5, "a sees b's pages")
            await _wait_for(lambda: _reserved_seen(cb, "a", 8), 5, "b sees a's pages")
            etcd.stop()
            await _wait_for(lambda: _etcd_down(ca), 5, "a notices etcd is away")
            await _wait_for(lambda: _etcd_down(cb), 5, "b notices etcd is away")
            for i in range(2, 14):  # both nodes now have requests waiting
                await ca.admit(f"a{i}", 64, tenant="chat")
                await cb.admit(f"b{i}", 64, tenant="chat")
            await asyncio.sleep(10 * RECONCILE_S)  # reconcile attempts come and fail
            total = (await _chat(ca)).reserved_pages + (await _chat(cb)).reserved_pages
    assert 16 < total <= LIMIT, total


@needs_etcd
async def test_a_node_entry_that_does_not_read_is_left_out_and_the_cluster_goes_on(tmp_path,
                                                                                  etcd):
    """Whatever sits under the nodes' prefix (a node of another kvd version, a half-written
    or hand-made value): an entry that does not read is left out, never taken for etcd
    being away (every node would then decide alone on a stale picture while it stood)."""
    import aetcd

    host, port = etcd.address.rsplit(":", 1)
    bad = {b"/kvd/nodes/x1": b'{"pools": []}',
           b"/kvd/nodes/x2": b'{"pools": {"default": {"capacity": Infinity}}}',
           b"/kvd/nodes/x3": b'{"pools": {"default": []}}',
           b"/kvd/nodes/x4": b'{"pools": {"default": {"capacity": 8, "reserved": [1]}}}',
           b"/kvd/nodes/x5": b'{"pools": {"default": {"capacity": 8, "queued": {"c": "9"}}}}',
           b"/kvd/nodes/\xff": b'{"pools": {"default": {"capacity": 8}}}'}
    with node(tmp_path, etcd, "a") as a:
        async with AsyncClient(a.target) as ca, aetcd.Client(host=host, port=int(port)) as raw:
            await _wait_for(lambda: _members_are(ca, {"a"}), 10, "a sees itself")
            for key, value in bad.items():
                await raw.put(key, value)
            with node(tmp_path, etcd, "b") as b:  # a node joining is still seen
                await _wait_for(lambda: _members_are(ca, {"a", "b"}), 10, "a sees b")
                await asyncio.sleep(5 * RECONCILE_S)
                view = await ca.get_cluster()
                assert view.etcd_up, view.detail
                assert {n.node for n in view.nodes} == {"a", "b"}
                assert b.proc.poll() is None
    assert a.log().count('"a node\'s figures do not read; left out"') == len(bad)
