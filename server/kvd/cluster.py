"""This kvd as a member of a cluster that shares tenants' quotas through etcd.

Every `reconcile_s` the member writes its pools' figures (device capacity; per tenant the
pages reserved, queued and wanted) to `PREFIX/nodes/NODE`, under a lease of `lease_ttl_s` it
renews at the same time; reads every node's key (the picture); and sets each tenant with a
cluster quota (`[tenant.cluster]`) to its entitlement on this node (kvd.core.cluster),
through the quotas' cluster layer. A watch on the prefix reconciles at once when a node joins
or leaves. A node that dies stops counting when its lease lapses.

When etcd cannot be reached the member keeps deciding on its last parts of the tenants'
cluster quotas (derived from the last picture: recomputed from the others' stale figures and
its own fresh ones, the nodes' parts would no longer add up to a limit), says so (the log
once, `kvd_cluster_etcd_up` 0, /healthz and `kvctl cluster`), and when etcd answers again
takes a new lease if its own lapsed and converges at the next reconcile. Whatever the picture says, a node never gives more than its own device pages:
entitlements past its capacity are scaled down as guarantees are.

etcd's client is aetcd (asyncio, on the grpcio kvd already runs on): leases, range reads and
watches are what a coordination store's client library is for, and writing them on raw gRPC
stubs would be hand-rolling one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from dataclasses import dataclass, field

import structlog

from kvd.config import ClusterConfig, Config
from kvd.core.cluster import ClusterQuota, Entitlement, NodeReport, entitlements

log = structlog.get_logger("kvd.cluster")


@dataclass
class Picture:
    """The cluster as this node last saw it: each node's reports, by pool."""

    nodes: dict[str, dict[str, NodeReport]] = field(default_factory=dict)  # node -> pool ->
    read_at: float = 0.0  # wall clock of the read (0: never)

    def reports(self, pool: str) -> list[NodeReport]:
        return [pools[pool] for pools in self.nodes.values() if pool in pools]


class ClusterMember:
    def __init__(self, node, config: Config) -> None:
        self.node = node  # kvd.node.Node
        self.settings: ClusterConfig = config.cluster
        self.config = config
        self.name = self.settings.node or socket.gethostname()
        self.prefix = self.settings.prefix.rstrip("/")
        self.key = f"{self.prefix}/nodes/{self.name}".encode()
        self.picture = Picture()
        self.etcd_up = False
        self.down_since: float | None = time.time()  # unreachable since (None: reachable)
        self.reconciles = {"ok": 0, "failed": 0}
        self.entitled: dict[tuple[str, str], Entitlement] = {}  # (tenant, pool) -> here
        self._client = None
        self._lease = None
        self._task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._unread: set[bytes] = set()  # keys under the nodes' prefix that did not read
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def aclose(self) -> None:
        for task in (self._task, self._watch_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._client is not None:
            with contextlib.suppress(Exception):  # leave at once instead of at the lease's end
                if self._lease is not None:
                    await asyncio.wait_for(self._lease.revoke(), self.settings.timeout_s)
            with contextlib.suppress(Exception):
                await self._client.close()

    def reload(self, config: Config) -> None:
        """New tenants' cluster quotas (SIGHUP): applied at the next reconcile."""
        self.config = config
        self._wake.set()

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        while True:
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # etcd away, a timeout, a refused lease
                self._lost(exc)
            else:
                # Only on a fresh picture. While etcd is away the parts stay as they were
                # (this node keeps admitting within its part, as its own requests end and
                # free it): recomputed from the others' stale figures and this node's fresh
                # ones, the nodes' parts no longer add up to the limit.
                try:
                    self.apply()
                except Exception:  # a bug here must not end the member: say it, go on
                    log.exception("applying the cluster's picture failed")
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.reconcile_s)

    async def reconcile(self) -> None:
        """Publish this node's figures under its lease, and read everyone's."""
        import aetcd

        timeout = self.settings.timeout_s
        if self._client is None:
            host, _, port = self.settings.etcd.rpartition(":")
            self._client = aetcd.Client(host=host, port=int(port), timeout=timeout)
            await asyncio.wait_for(self._client.connect(), timeout)
        if self._lease is None:
            self._lease = await asyncio.wait_for(
                self._client.lease(int(self.settings.lease_ttl_s)), timeout)
        else:
            reply = await asyncio.wait_for(self._lease.refresh(), timeout)
            if reply.TTL <= 0:  # it lapsed while etcd was away: our key went with it
                self._lease = await asyncio.wait_for(
                    self._client.lease(int(self.settings.lease_ttl_s)), timeout)
        mine = {"pools": {name: r.to_json() for name, r in self.reports().items()},
                "at": time.time()}
        await asyncio.wait_for(self._client.put(self.key, json.dumps(mine).encode(),
                                                lease=self._lease), timeout)
        found = await asyncio.wait_for(self._client.get_prefix(f"{self.prefix}/nodes/".encode()),
                                       timeout)
        nodes = {}
        unread = set()
        for kv in found:
            try:
                name, reports = read_node(kv.key, kv.value)
            except (ValueError, KeyError, RecursionError) as exc:
                unread.add(kv.key)
                if kv.key not in self._unread:  # said once while it stays so
                    log.warning("a node's figures do not read; left out", key=repr(kv.key),
                                error=repr(exc)[:200])
                continue
            nodes[name] = reports
        self._unread = unread
        self._changed_membership(set(self.picture.nodes), set(nodes))
        self.picture = Picture(nodes, time.time())
        if not self.etcd_up:
            if self.down_since is not None and self.reconciles["ok"]:
                log.info("etcd reachable again; converging", etcd=self.settings.etcd,
                         after_s=round(time.time() - self.down_since, 1))
                self.node.events.publish("cluster", change="etcd_back", node=self.name)
            self.etcd_up, self.down_since = True, None
        self.reconciles["ok"] += 1
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.ensure_future(self._watch())

    def _lost(self, exc: Exception) -> None:
        self.reconciles["failed"] += 1
        if self.etcd_up or self.reconciles["failed"] == 1:
            log.error("etcd unreachable; deciding on the last picture of the cluster",
                      etcd=self.settings.etcd, error=repr(exc),
                      picture_age_s=round(self.picture_age_s(), 1))
            self.node.events.publish("cluster", change="etcd_lost", node=self.name)
        if self.etcd_up:
            self.down_since = time.time()
        self.etcd_up = False
        if self._client is not None and not isinstance(exc, asyncio.TimeoutError):
            # A broken channel: a new client at the next try.
            client, self._client, self._lease = self._client, None, None
            asyncio.ensure_future(_close_quietly(client))

    async def _watch(self) -> None:
        """Reconcile at once when a node joins or leaves (its key is created or deleted)."""
        try:
            watch = await self._client.watch_prefix(f"{self.prefix}/nodes/".encode())
            async for event in watch:
                if event.kind == "DELETE" or event.kv.version == 1:
                    self._wake.set()
        except asyncio.CancelledError:
            raise
        except Exception:  # etcd went away: the loop notices, and watches again after
            return

    def _changed_membership(self, before: set[str], after: set[str]) -> None:
        for name in sorted(after - before):
            if before or name != self.name:
                log.info("node joined the cluster", node=name)
                self.node.events.publish("cluster", change="node_joined", node=name)
        for name in sorted(before - after):
            log.warning("node left the cluster (its lease lapsed or it stopped)", node=name)
            self.node.events.publish("cluster", change="node_left", node=name)

    # ------------------------------------------------------------------ figures

    def reports(self) -> dict[str, NodeReport]:
        """This node's figures, by pool."""
        out = {}
        for rt in self.node.runtimes():
            tenancy = rt.pool.tenancy
            reserved, queued, kept = (tenancy.reserved_by_tenant, tenancy.queued_by_tenant,
                                      tenancy.kept_by_tenant)
            tenants = {t for t in set(reserved) | set(queued) | set(kept)
                       if reserved[t] or queued[t] or kept[t]}
            smallest: dict[str, int] = {}
            for req in rt.pool.queue.values():
                pages = req.projected_pages
                if pages < smallest.get(req.tenant, pages + 1):
                    smallest[req.tenant] = pages
            out[rt.pool.name] = NodeReport(
                self.name, rt.pool.device.capacity,
                {t: int(reserved[t]) for t in tenants if reserved[t]},
                {t: int(queued[t]) for t in tenants if queued[t]},
                {t: int(reserved[t] + queued[t] + kept[t]) for t in tenants}, smallest)
        return out

    def quotas(self, pool: str) -> dict[str, ClusterQuota]:
        page_bytes = self.node.runtime(pool).pool.page_bytes
        return {t.name: q for t in self.config.tenants
                if (q := t.cluster_quota(page_bytes)) is not None}

    def view(self, pool: str) -> tuple[list[NodeReport], dict[str, ClusterQuota]]:
        """The picture of one pool with this node's own figures fresh in it."""
        mine = self.reports().get(pool)
        others = [r for r in self.picture.reports(pool) if r.node != self.name]
        return ([mine] if mine else []) + others, self.quotas(pool)

    def apply(self) -> None:
        """Each tenant with a cluster quota gets its entitlement here; with no picture yet,
        its local quota alone."""
        layer, entitled = {}, {}
        if self.picture.read_at:
            for rt in self.node.runtimes():
                pool = rt.pool.name
                reports, quotas = self.view(pool)
                for tenant, e in entitlements(self.name, reports, quotas).items():
                    entitled[(tenant, pool)] = e
                    quota = quotas[tenant]
                    fields = {"weight": quota.weight, "guaranteed": e.guaranteed,
                              "may_reserve": e.may_reserve}
                    local = next((t for t in self.config.tenants if t.name == tenant), None)
                    limit = local.quota_for(pool, rt.pool.page_bytes).limit if local else None
                    if quota.limit is not None:  # a request past it fits nowhere: rejected
                        fields["limit"] = min(quota.limit, limit or quota.limit)
                    if fields.get("limit") is not None:
                        fields["guaranteed"] = min(fields["guaranteed"], fields["limit"])
                    layer[(tenant, pool)] = fields
        self.entitled = entitled
        if self.node.quotas.set_cluster(layer):
            self.node.settle_queues()  # a request past a lowered limit waits no more
            for rt in self.node.runtimes():
                rt.waiters.notify()
                rt.room_may_have_changed()

    def describe(self, pool: str = "") -> dict:
        """The cluster as this node sees it, for GetCluster: every node's figures, and each
        tenant with a cluster quota in each pool, with every node's part of it."""
        nodes, tenants = [], []
        pools = [pool] if pool else [rt.pool.name for rt in self.node.runtimes()]
        for name in pools:
            reports, quotas = self.view(name)
            for r in sorted(reports, key=lambda r: r.node):
                nodes.append({"node": r.node, "pool": name, "device_pages": r.capacity,
                              "reserved_pages": sum(r.reserved.values()),
                              "queued_pages": sum(r.queued.values())})
            parts = {r.node: entitlements(r.node, reports, quotas) for r in reports}
            for tenant, quota in sorted(quotas.items()):
                any_part = next((p[tenant] for p in parts.values() if tenant in p), None)
                tenants.append({
                    "pool": name, "tenant": tenant, "weight": quota.weight,
                    "guaranteed_pages": quota.guaranteed, "limit_pages": quota.limit or 0,
                    "reserved_pages": any_part.reserved if any_part else 0,
                    "demand_pages": any_part.demand if any_part else 0,
                    "share_pages": any_part.share if any_part else 0.0,
                    "nodes": [{"node": r.node, "reserved_pages": r.reserved.get(tenant, 0),
                               "demand_pages": r.demand.get(tenant, 0),
                               "entitlement_pages": parts[r.node][tenant].guaranteed,
                               "may_reserve_pages": (-1 if parts[r.node][tenant].may_reserve
                                                     is None
                                                     else parts[r.node][tenant].may_reserve)}
                              for r in sorted(reports, key=lambda r: r.node)]})
        age = self.picture_age_s()
        return {"enabled": True, "node": self.name, "etcd": self.settings.etcd,
                "etcd_up": self.etcd_up,
                "picture_age_s": -1.0 if age == float("inf") else (0.0 if self.etcd_up
                                                                     else age),
                "detail": self.health_detail(), "nodes": nodes, "tenants": tenants}

    def picture_age_s(self) -> float:
        return time.time() - self.picture.read_at if self.picture.read_at else float("inf")

    def health_detail(self) -> str:
        if self.etcd_up:
            return f"cluster: {len(self.picture.nodes)} nodes, etcd {self.settings.etcd} reachable"
        if not self.picture.read_at:
            return (f"cluster: etcd {self.settings.etcd} unreachable; no picture yet, local "
                    "quotas only")
        return (f"cluster: etcd {self.settings.etcd} unreachable for "
                f"{time.time() - (self.down_since or time.time()):.0f} s; deciding on the "
                f"picture of {self.picture_age_s():.0f} s ago")


async def _close_quietly(client) -> None:
    with contextlib.suppress(Exception):
        await client.close()


def read_node(key: bytes, value: bytes) -> tuple[str, dict[str, NodeReport]]:
    """A node's name and figures by pool from its entry under the nodes' prefix, as
    reconcile() publishes them; ValueError or KeyError for an entry that is not one."""
    name = key.decode().rsplit("/", 1)[-1]  # UnicodeDecodeError is a ValueError
    data = json.loads(value)
    pools = data.get("pools") if isinstance(data, dict) else None
    if not isinstance(pools, dict):
        raise ValueError("no map of pools")
    return name, {str(pool): NodeReport.from_json(name, report)
                  for pool, report in pools.items()}
