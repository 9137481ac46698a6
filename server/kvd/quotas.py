"""Tenants' quotas as the operator sets them: from the config (at start and on SIGHUP) and
through SetQuota. A change reaches the pool's tenancy, the link caps, the admission queue
(whose order and answers may change) and the event stream, and is logged."""

from __future__ import annotations

import dataclasses
import math

import structlog

from kvd.assembly import Links, apply_caps
from kvd.config import Config
from kvd.core.clock import Clock
from kvd.core.errors import InvalidArgument
from kvd.core.fairness import TenantQuota
from kvd.events import EventBus
from kvd.runtime import PoolRuntime

log = structlog.get_logger("kvd.quotas")


class Quotas:
    def __init__(self, pools: dict[str, PoolRuntime], links: Links, events: EventBus,
                 clock: Clock) -> None:
        self.pools = pools
        self.links = links
        self.events = events
        self.clock = clock

    def apply(self, config: Config) -> None:
        """Set every pool's quotas from the config; tenants no longer declared fall back to
        the default quota. Changes are logged."""
        for rt in self.pools.values():
            pool = rt.pool
            quotas = {t.name: t.quota_for(pool.name, pool.page_bytes) for t in config.tenants}
            promised = sum(q.guaranteed for q in quotas.values())
            if promised > pool.device.capacity:
                log.warning("guarantees overcommitted: scaled down proportionally",
                            pool=pool.name, guaranteed_pages=promised,
                            device_pages=pool.device.capacity,
                            scale=round(pool.device.capacity / promised, 4))
            for tenant in set(pool.tenancy.quotas) | set(quotas):
                new = quotas.get(tenant, TenantQuota())
                if pool.tenancy.quotas.get(tenant) != new:
                    log.info("quota set", pool=pool.name, tenant=tenant, weight=new.weight,
                             guaranteed=new.guaranteed, limit=new.limit)
                    self._publish(rt, tenant, new)
            apply_caps(rt.link, pool, self.clock.now())
            rt.waiters.notify()
        for (source, _), link in self.links.handoff.items():
            apply_caps(link, self.pools[source].pool, self.clock.now())

    def set(self, tenant: str, runtimes: list[PoolRuntime], **changes) -> list[str]:
        """Change the given fields of a tenant's quota in these pools, all or none; None for
        limit or a per-request cap means none. Returns the pools' names."""
        if not tenant:
            raise InvalidArgument("tenant must not be empty")
        for key, value in changes.items():
            # NaN passes every comparison and infinity is no quota: neither may reach the
            # policies (or the log, which must stay JSON).
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidArgument(f"{key} must be a finite number, got {value}")
        if "weight" in changes and not changes["weight"] > 0:
            raise InvalidArgument("weight must be positive")
        fraction = changes.get("max_request_fraction")
        if fraction is not None and not 0 <= fraction <= 1:
            raise InvalidArgument("max_request_fraction is 0..1")
        new = {rt: dataclasses.replace(rt.pool.tenancy.quota(tenant), **changes)
               for rt in runtimes}
        for rt, quota in new.items():  # every pool checked before any changes
            if quota.limit is not None and quota.guaranteed > quota.limit:
                raise InvalidArgument(f"pool {rt.pool.name!r}: guaranteed ({quota.guaranteed} "
                                      f"pages) would be above limit ({quota.limit} pages)")
        for rt, quota in new.items():
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
        rt.pool.set_quota(tenant, quota)
        self.events.publish("quota", pool=rt.pool.name, tenant=tenant, weight=quota.weight,
                            guaranteed=quota.guaranteed, limit=quota.limit or 0)
