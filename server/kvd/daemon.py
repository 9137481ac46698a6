"""The daemon's state: its pools, their arenas, and which pool each request lives in.

The async operations here are what the gRPC servicers call; they know nothing of protobuf.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog

from kvd.config import Config, PoolConfig
from kvd.core.attribution import Attribution, RequestAccount
from kvd.core.blocks import Block, Request, RequestState
from kvd.core.clock import Clock, MonotonicClock
from kvd.core.errors import AlreadyExists, InvalidArgument, NotFound, PermissionDenied
from kvd.core.fairness import TenantQuota
from kvd.core.invariants import check_pool
from kvd.core.pool import AdmitResult, IntentChange, Pool
from kvd.core.transfer import TransferPlan
from kvd.events import EventBus
from kvd.leases import LeaseTable
from kvd.metrics import STALL_SECONDS
from kvd.memory.arena import ShmArena
from kvd.memory.copier import PageCopier
from kvd.runtime import PoolRuntime

log = structlog.get_logger("kvd.daemon")


def make_arenas(pc: PoolConfig) -> dict[str, object]:
    """Allocate a pool's device and host arenas on the configured backend."""
    from kvd.memory.cuda import gpu_available

    page_bytes = pc.resolved_page_bytes
    use_gpu = pc.device_backend == "cupy" or (pc.device_backend == "auto" and gpu_available())
    if use_gpu:
        if not gpu_available():
            raise InvalidArgument(f"pool {pc.name!r}: device_backend=cupy but no GPU/CuPy here")
        from kvd.memory.cuda import CupyArena, pin_host_arena

        device = CupyArena(pc.device_pages, page_bytes, device=pc.gpu)
        host = ShmArena(pc.host_pages, page_bytes, label=f"{pc.name}-host", backend="pinned-shm")
        pin_host_arena(host.pages)
    else:
        device = ShmArena(pc.device_pages, page_bytes, label=f"{pc.name}-dev",
                          backend="host-standin")
        host = ShmArena(pc.host_pages, page_bytes, label=f"{pc.name}-host")
    return {"device": device, "host": host}


class Daemon:
    """Pools by name and requests by id; every engine operation goes through here."""

    def __init__(self, config: Config, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        self.started_at = time.time()
        self._executor = ThreadPoolExecutor(config.workers, thread_name_prefix="kvd-copy")
        self.pools: dict[str, PoolRuntime] = {}
        self.leases = LeaseTable(self.clock, config.lease_ttl_s)
        self.events = EventBus()
        self.request_index: dict[str, PoolRuntime] = {}
        try:
            for pc in config.pools:
                self.pools[pc.name] = self._build_pool(pc)
        except BaseException:
            self.close()
            raise
        self.apply_tenants(config)

    def _build_pool(self, pc: PoolConfig) -> PoolRuntime:
        pool = Pool(
            pc.name,
            page_bytes=pc.resolved_page_bytes,
            block_tokens=pc.block_tokens,
            device_pages=pc.device_pages,
            host_pages=pc.host_pages,
            policy=pc.policy,
            clock=self.clock,
            max_queue=pc.max_queue,
            attribution=Attribution(self.config.eviction_ledger, self.config.explain_keep),
        )
        arenas = make_arenas(pc)
        runtime = PoolRuntime(pool, arenas, PageCopier(arenas["device"], arenas["host"]),
                              self._executor, self.config.inline_copy_bytes)
        runtime.on_plan_done.append(self._on_plan_done)
        log.info(
            "pool ready",
            pool=pc.name,
            device_backend=arenas["device"].backend,
            host_backend=arenas["host"].backend,
            device_pages=pc.device_pages,
            host_pages=pc.host_pages,
            page_bytes=pool.page_bytes,
            policy=pool.policy.name,
        )
        return runtime

    def _on_plan_done(self, plan: TransferPlan, stall_s: float) -> None:
        if plan.reason == "access" and stall_s > 0:
            STALL_SECONDS.labels(plan.pool).observe(stall_s)
        events = self.events
        if not events.subscriptions:
            return  # nobody watching: skip grouping the victims
        cause = plan.cause
        if plan.demotions:
            victims: dict = {}
            for m in plan.demotions:
                key = (m.block.request.request_id, m.block.request.tenant)
                victims[key] = victims.get(key, 0) + 1
            for (rid, tenant), n in victims.items():
                events.publish("eviction", pool=plan.pool, tenant=tenant, request_id=rid,
                               count=n, reason=plan.reason,
                               cause_tenant=cause.tenant if cause else "",
                               cause_request=cause.request_id if cause else "")
        if plan.promotions:
            events.publish("promotion", pool=plan.pool,
                           tenant=cause.tenant if cause else "",
                           request_id=cause.request_id if cause else "",
                           count=len(plan.promotions), reason=plan.reason,
                           stall_s=f"{stall_s:.6f}")

    # ------------------------------------------------------------------ lookup

    def runtime(self, pool: str) -> PoolRuntime:
        try:
            return self.pools[pool or "default"]
        except KeyError:
            raise NotFound(
                f"no pool {pool!r}; this kvd has {', '.join(sorted(self.pools))}"
            ) from None

    def runtime_of(self, request_id: str, scope: str | None = None) -> PoolRuntime:
        """The pool runtime of a request the caller may touch (scope: its tenant; None: any)."""
        if not request_id:
            raise InvalidArgument("request_id must not be empty")
        try:
            rt = self.request_index[request_id]
        except KeyError:
            raise NotFound(f"no request {request_id!r}; admit it first") from None
        if scope is not None and rt.pool.requests[request_id].tenant != scope:
            raise PermissionDenied(f"request {request_id!r} belongs to another tenant")
        return rt

    def request(self, request_id: str) -> Request:
        return self.runtime_of(request_id).pool.get_request(request_id)

    # ------------------------------------------------------------------ engine operations

    def admit(self, request_id: str, *, tenant: str, pool: str, prompt_tokens: int,
              output_tokens: int, priority: int, lease: str = "") -> AdmitResult:
        if request_id in self.request_index:
            where = self.request_index[request_id].pool.name
            raise AlreadyExists(f"request {request_id!r} already exists in pool {where!r}")
        rt = self.runtime(pool)
        result = rt.pool.admit(request_id, tenant=tenant or "default",
                               prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                               priority=priority)
        if result.decision != "rejected":
            self.request_index[request_id] = rt
            self.leases.attach(lease, tenant or "default", request_id)
            rt.notify_queue()
        self.events.publish("admission", pool=rt.pool.name, tenant=tenant or "default",
                            request_id=request_id, count=result.projected_pages,
                            decision=result.decision, reason=result.reason)
        for other in rt.pool.take_newly_admitted():
            self.events.publish("admission", pool=rt.pool.name, tenant=other.tenant,
                                request_id=other.request_id, count=other.projected_pages,
                                decision="admitted", reason="from the queue")
        return result

    async def allocate(self, request_id: str, num_blocks: int, intent: dict | None = None,
                       scope: str | None = None) -> tuple[list[Block], float]:
        rt = self.runtime_of(request_id, scope)
        plan = await rt.run(lambda: rt.pool.allocate(request_id, num_blocks, intent))
        stall_s = await rt.execute(plan) if plan.num_copies else rt.complete_now(plan)
        self.events.publish("allocation", pool=rt.pool.name, tenant=plan.cause.tenant,
                            request_id=request_id, count=len(plan.allocated))
        return plan.allocated, stall_s

    async def access(self, request_id: str, indices: Sequence[int] | None,
                     scope: str | None = None) -> tuple[list[Block], float, int]:
        rt = self.runtime_of(request_id, scope)
        result = await rt.access(request_id, indices)
        stall_s = await rt.execute(result.plan) if result.plan else 0.0
        if stall_s:
            rt.pool.record_stall(stall_s, result.plan)
        promoted = len(result.plan.promotions) if result.plan else 0
        blocks = result.blocks if result.blocks is not None else result.request.live_blocks()
        return blocks, stall_s, promoted

    async def update_intents(self, changes: Sequence[IntentChange], scope: str | None = None
                             ) -> tuple[int, int]:
        """Apply updates grouped by pool. Validation of every group happens before any group
        applies, so a bad item changes nothing."""
        by_pool: dict[PoolRuntime, list[IntentChange]] = {}
        for change in changes:
            by_pool.setdefault(self.runtime_of(change.request_id, scope), []).append(change)
        plans = []
        for rt, group in by_pool.items():
            plan = rt.pool.update_intents(group)
            plans.append((rt, plan))
        prefetched = 0
        for rt, plan in plans:
            if plan is not None:
                prefetched += len(plan.promotions)
                await rt.execute(plan)
        return len(changes), prefetched

    async def free(self, request_id: str, indices: Sequence[int], scope: str | None = None
                   ) -> int:
        rt = self.runtime_of(request_id, scope)
        freed = await rt.run(lambda: rt.pool.free(request_id, indices))
        return freed

    async def release(self, request_id: str, scope: str | None = None
                      ) -> tuple[int, list[Request]]:
        rt = self.runtime_of(request_id, scope)
        tenant = rt.pool.requests[request_id].tenant
        freed, admitted = await rt.run(lambda: rt.pool.release(request_id))
        del self.request_index[request_id]
        self.leases.detach(request_id)
        rt.notify_queue()
        self.events.publish("release", pool=rt.pool.name, tenant=tenant,
                            request_id=request_id, count=freed)
        for other in admitted:
            self.events.publish("admission", pool=rt.pool.name, tenant=other.tenant,
                                request_id=other.request_id, count=other.projected_pages,
                                decision="admitted", reason="from the queue")
        return freed, admitted

    def explain(self, request_id: str, scope: str | None = None
                ) -> tuple[RequestAccount, str, bool]:
        """A request's account (active or recently released), its pool, and whether active."""
        if not request_id:
            raise InvalidArgument("request_id must not be empty")
        for rt in self.pools.values():
            account = rt.pool.attribution.account(request_id)
            if account is not None:
                if scope is not None and account.tenant != scope:
                    raise PermissionDenied(f"request {request_id!r} belongs to another tenant")
                return account, rt.pool.name, request_id in rt.pool.attribution.active
        raise NotFound(f"kvd knows nothing of request {request_id!r} (never admitted, or "
                       "released long ago)")

    def admission_state(self, request_id: str, scope: str | None = None):
        """(admitted?, queue position, reason, the event that fires on the next change)."""
        rt = self.runtime_of(request_id, scope)
        req = rt.pool.requests[request_id]
        event = rt.queue_changed
        if req.state is RequestState.ADMITTED:
            return True, 0, "", event
        return False, rt.pool.queue_position(request_id), rt.pool._why_waiting(req), event

    # ------------------------------------------------------------------ tenants

    def apply_tenants(self, config: Config) -> None:
        """Set every pool's quotas from the config (at start and on SIGHUP); tenants no
        longer declared fall back to the default quota. Changes are logged."""
        for rt in self.pools.values():
            pool = rt.pool
            quotas = {t.name: t.quota_for(pool.name, pool.page_bytes) for t in config.tenants}
            promised = sum(q.guaranteed for q in quotas.values())
            if promised > pool.device.capacity:
                log.warning("guarantees overcommitted: scaled down proportionally",
                            pool=pool.name, guaranteed_pages=promised,
                            device_pages=pool.device.capacity,
                            scale=round(pool.device.capacity / promised, 4))
            for tenant in set(pool.quotas) | set(quotas):
                new = quotas.get(tenant, TenantQuota())
                if pool.quotas.get(tenant) != new:
                    log.info("quota set", pool=pool.name, tenant=tenant, weight=new.weight,
                             guaranteed=new.guaranteed, limit=new.limit)
                    pool.set_quota(tenant, new)
                    self.events.publish("quota", pool=pool.name, tenant=tenant,
                                        weight=new.weight, guaranteed=new.guaranteed,
                                        limit=new.limit or 0)
            rt.notify_queue()

    def set_quota(self, tenant: str, pool: str, **changes) -> list[str]:
        """Change the given fields of a tenant's quota in one pool ("" = every pool); None
        for limit or a per-request cap means none."""
        if not tenant:
            raise InvalidArgument("tenant must not be empty")
        if "weight" in changes and not changes["weight"] > 0:
            raise InvalidArgument("weight must be positive")
        fraction = changes.get("max_request_fraction")
        if fraction is not None and not 0 <= fraction <= 1:
            raise InvalidArgument("max_request_fraction is 0..1")
        runtimes = [self.runtime(pool)] if pool else list(self.pools.values())
        for rt in runtimes:
            old = rt.pool.quota(tenant)
            new = TenantQuota(old.weight, old.guaranteed, old.limit, old.max_request_pages,
                              old.max_request_fraction)
            for key, value in changes.items():
                setattr(new, key, value)
            rt.pool.set_quota(tenant, new)
            rt.notify_queue()
            self.events.publish("quota", pool=rt.pool.name, tenant=tenant, weight=new.weight,
                                guaranteed=new.guaranteed, limit=new.limit or 0)
            log.info("quota changed", pool=rt.pool.name, tenant=tenant, weight=new.weight,
                     guaranteed=new.guaranteed, limit=new.limit,
                     max_request_pages=new.max_request_pages,
                     max_request_fraction=new.max_request_fraction)
        return [rt.pool.name for rt in runtimes]

    def tenants(self, pool: str = "") -> list[tuple[str, Pool]]:
        """(tenant, pool) pairs known to each pool: declared or seen."""
        runtimes = [self.runtime(pool)] if pool else list(self.pools.values())
        out = []
        for rt in runtimes:
            p = rt.pool
            names = (set(p.quotas) | set(p.reserved_by_tenant) | set(p.queued_by_tenant)
                     | set(p.device_by_tenant))
            out += [(name, p) for name in sorted(names)]
        return out

    async def evict(self, pool: str, num_pages: int) -> list:
        rt = self.runtime(pool)
        plan = rt.pool.evict(num_pages)
        await rt.execute(plan)
        return plan.demotions

    async def set_policy(self, pool: str, policy: str) -> str:
        rt = self.runtime(pool)
        previous = rt.pool.set_policy(policy)
        log.info("policy changed", pool=rt.pool.name, policy=policy, previous=previous)
        self.events.publish("policy", pool=rt.pool.name, policy=policy, previous=previous)
        return previous

    async def self_check(self) -> list[str]:
        problems = []
        for rt in self.pools.values():
            await rt.quiesce()
            problems.extend(check_pool(rt.pool))
        return problems

    async def drain(self) -> None:
        for rt in self.pools.values():
            await rt.quiesce()

    def close(self) -> None:
        for rt in self.pools.values():
            rt.close()
        self.pools.clear()
        self._executor.shutdown(wait=True)

    async def aclose(self) -> None:
        await self.drain()
        await asyncio.get_running_loop().run_in_executor(None, self.close)
