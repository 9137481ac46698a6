"""Tenants' quotas as the operator sets them: from the config (at start and on SIGHUP) and
through SetQuota. A change reaches the pool's tenancy, the link caps, the admission queue
(whose order and answers may change) and the event stream, and is logged."""

from __future__ import annotations

import dataclasses
import math

import structlog

from kvd.assembly import Links, apply_caps
from kvd.config import Config
from kvd.config_values import check_quota_pages
from kvd.core.clock import Clock
from kvd.core.errors import InvalidArgument, NotFound, check_printable
from kvd.core.fairness import TenantQuota, weight_problem
from kvd.events import EventBus, publish_admitted
from kvd.runtime import PoolRuntime

log = structlog.get_logger("kvd.quotas")


class Quotas:
    def __init__(self, pools: dict[str, PoolRuntime], links: Links, events: EventBus,
                 clock: Clock) -> None:
        self.pools = pools
        self.links = links
        self.events = events
        self.clock = clock
        # SetQuota's changes, (tenant, pool) -> fields: they stand over the config until a
        # SetQuota(reset) drops them, a reload (SIGHUP) included.
        self.overrides: dict[tuple[str, str], dict] = {}
        # The cluster's word (kvd.cluster), (tenant, pool) -> fields: between the config and
        # SetQuota's changes.
        self.cluster: dict[tuple[str, str], dict] = {}
        self.config: Config | None = None

    def set_cluster(self, layer: dict[tuple[str, str], dict]) -> bool:
        """The cluster's entitlements changed: re-apply; False when nothing did."""
        if layer == self.cluster:
            return False
        self.cluster = layer
        if self.config is not None:
            self.apply(self.config, quiet=True)
        return True

    def known(self) -> set[str]:
        """Tenants kvd knows: configured, or holding, reserving or queueing in a pool."""
        names = {t.name for t in self.config.tenants} if self.config else set()
        for rt in self.pools.values():
            names |= rt.pool.tenancy.names()
        return names

    def apply(self, config: Config, quiet: bool = False) -> None:
        """Set every pool's quotas from the config, the cluster's entitlements over it, and
        SetQuota's changes over those; tenants no longer declared fall back to the default
        quota. Changes are logged and published (quiet: the cluster's reconcile, every
        second: logged at debug, and published only when more than may_reserve changed)."""
        self.config = config
        for rt in self.pools.values():
            pool = rt.pool
            quotas = {t.name: t.quota_for(pool.name, pool.page_bytes) for t in config.tenants}
            for (tenant, name), fields in self.cluster.items():
                if name == pool.name:
                    quotas[tenant] = dataclasses.replace(quotas.get(tenant, TenantQuota()),
                                                         **fields)
            for (tenant, name), fields in list(self.overrides.items()):
                if name != pool.name:
                    continue
                kept = dataclasses.replace(quotas.get(tenant, TenantQuota()), **fields)
                if kept.limit is not None and kept.guaranteed > kept.limit:
                    log.warning("runtime quota change dropped: it no longer fits the config",
                                pool=pool.name, tenant=tenant, changes=fields)
                    del self.overrides[(tenant, name)]
                    continue
                if not quiet:
                    log.info("runtime quota change kept over the config", pool=pool.name,
                             tenant=tenant, changes=fields)
                quotas[tenant] = kept
            promised = sum(q.guaranteed for q in quotas.values())
            if promised > pool.device.capacity:
                log.warning("guarantees overcommitted: scaled down proportionally",
                            pool=pool.name, guaranteed_pages=promised,
                            device_pages=pool.device.capacity,
                            scale=round(pool.device.capacity / promised, 4))
            for tenant in set(pool.tenancy.quotas) | set(quotas):
                new = quotas.get(tenant, TenantQuota())
                old = pool.tenancy.quotas.get(tenant)
                if old == new:
                    continue
                if quiet and old is not None and dataclasses.replace(
                        old, may_reserve=new.may_reserve) == new:
                    # only its part of the cluster limit moved
                    publish_admitted(self.events, pool.name, pool.set_quota(tenant, new))
                    continue
                (log.debug if quiet else log.info)(
                    "quota set", pool=pool.name, tenant=tenant, weight=new.weight,
                    guaranteed=new.guaranteed, limit=new.limit, may_reserve=new.may_reserve)
                self._publish(rt, tenant, new)
            apply_caps(rt.link, pool, self.clock.now())
            rt.waiters.notify()
        for (source, _), link in self.links.handoff.items():
            apply_caps(link, self.pools[source].pool, self.clock.now())

    def set(self, tenant: str, runtimes: list[PoolRuntime], create: bool = False,
            reset: bool = False, **changes) -> list[str]:
        """Change the given fields of a tenant's quota in these pools, all or none; None for
        limit or a per-request cap means none; guaranteed_bytes and limit_bytes are rounded
        up to each pool's pages. The changes stand over the config until `reset` drops
        them. A tenant kvd does not know is refused unless `create`. Returns the pools'
        names."""
        if not tenant:
            raise InvalidArgument("tenant must not be empty")
        check_printable("tenant", tenant)
        if reset:
            if tenant not in self.known():
                raise NotFound(f"no tenant {tenant!r}")
            if changes:
                raise InvalidArgument("reset drops the runtime changes: give no fields with it")
            for rt in runtimes:
                self.overrides.pop((tenant, rt.pool.name), None)
            if self.config is not None:
                self.apply(self.config)
            log.info("runtime quota changes dropped", tenant=tenant,
                     pools=[rt.pool.name for rt in runtimes])
            return [rt.pool.name for rt in runtimes]
        for unit in ("guaranteed", "limit"):
            if f"{unit}_bytes" in changes and unit in changes:
                raise InvalidArgument(f"{unit}: give pages or bytes, not both")
        for key, value in changes.items():
            # NaN passes every comparison and infinity is no quota: neither may reach the
            # policies (or the log, which must stay JSON).
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidArgument(f"{key} must be a finite number, got {value}")
        if "weight" in changes and (problem := weight_problem(changes["weight"])):
            raise InvalidArgument(f"weight {problem}")
        fraction = changes.get("max_request_fraction")
        if fraction is not None and not 0 <= fraction <= 1:
            raise InvalidArgument("max_request_fraction is 0..1")
        per_pool = {rt: _in_pages(changes, rt.pool.page_bytes) for rt in runtimes}
        new = {rt: dataclasses.replace(rt.pool.tenancy.quota(tenant), **per_pool[rt])
               for rt in runtimes}
        for rt, quota in new.items():  # every pool checked before any changes
            if quota.limit is not None and quota.guaranteed > quota.limit:
                raise InvalidArgument(f"pool {rt.pool.name!r}: guaranteed ({quota.guaranteed} "
                                      f"pages) would be above limit ({quota.limit} pages)")
        if tenant not in self.known() and not create:
            known = ", ".join(sorted(self.known())) or "none"
            raise NotFound(f"no tenant {tenant!r} (known: {known}); set create to give a "
                           "quota to a tenant kvd has not seen yet")
        for rt, quota in new.items():
            self.overrides.setdefault((tenant, rt.pool.name), {}).update(per_pool[rt])
            self._publish(rt, tenant, quota)
            apply_caps(rt.link, rt.pool, self.clock.now())
            rt.waiters.notify()
            log.info("quota changed", pool=rt.pool.name, tenant=tenant, weight=quota.weight,
                     guaranteed=quota.guaranteed, limit=quota.limit,
                     max_request_pages=quota.max_request_pages,
                     max_request_fraction=quota.max_request_fraction)
        return [rt.pool.name for rt in runtimes]

    def _publish(self, rt: PoolRuntime, tenant: str, quota: TenantQuota) -> None:
        """The pool takes the quota; watchers are told."""
        publish_admitted(self.events, rt.pool.name, rt.pool.set_quota(tenant, quota))
        self.events.publish("quota", pool=rt.pool.name, tenant=tenant, weight=quota.weight,
                            guaranteed=quota.guaranteed, limit=quota.limit or 0)


def _in_pages(changes: dict, page_bytes: int) -> dict:
    """The changes with sizes in bytes turned into this pool's pages (rounded up, exactly at
    any size; a limit of 0 bytes is no limit, as 0 pages is), each at most what kvd counts
    (see check_quota_pages)."""
    out = {k: v for k, v in changes.items() if not k.endswith("_bytes")}
    for key in ("guaranteed", "limit"):
        size = changes.get(f"{key}_bytes")
        if size is not None:
            pages = -(-size // page_bytes)
            check_quota_pages(pages, size, page_bytes)
            out[key] = pages or (None if key == "limit" else 0)
    return out
