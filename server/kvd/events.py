"""The event stream behind WatchEvents: what kvd decided, in order, with a sequence number
per daemon run. Publishing never blocks: a subscriber that falls behind its bounded buffer
loses events, and is told how many with a gap marker before the next one it gets."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvd.core.admission import Decision
from kvd.core.blocks import Request, public_id
from kvd.core.errors import ResourceExhausted
from kvd.core.transfer import MoveKind, Reason, TransferPlan

# Event watchers one tenant may have open at once.
MAX_PER_OWNER = 16
# An eviction's detail when its victims are a tenant's kept prefix blocks (no request's).
KEPT = {"kept": "prefix blocks"}

KINDS = ("admission", "allocation", "eviction", "promotion", "recompute", "release", "quota",
         "policy", "lease", "handoff", "cluster")


@dataclass(slots=True)
class Event:
    seq: int
    at: float  # wall-clock seconds
    kind: str
    pool: str = ""
    tenant: str = ""
    request_id: str = ""
    count: int = 0
    detail: dict = field(default_factory=dict)
    lost: int = 0  # kind "gap": how many events this subscriber lost just before


@dataclass(eq=False)
class Subscription:
    pools: frozenset[str]
    tenants: frozenset[str]
    kinds: frozenset[str]
    queue: asyncio.Queue
    lost: int = 0
    owner: str = ""

    def wants(self, kind: str, pool: str, tenant: str) -> bool:
        return ((not self.kinds or kind in self.kinds)
                and (not self.pools or pool in self.pools)
                and (not self.tenants or tenant in self.tenants))


class EventBus:
    def __init__(self) -> None:
        self.seq = 0
        self.subscriptions: set[Subscription] = set()

    def publish(self, kind: str, *, pool: str = "", tenant: str = "", request_id: str = "",
                count: int = 0, **detail) -> None:
        self.seq += 1
        if not self.subscriptions:
            return
        event = Event(self.seq, time.time(), kind, pool, tenant, request_id, count,
                      {k: str(v) for k, v in detail.items()})
        for sub in self.subscriptions:
            if not sub.wants(kind, pool, tenant):
                continue
            if sub.lost and sub.queue.qsize() < sub.queue.maxsize - 1:
                sub.queue.put_nowait(Event(0, event.at, "gap", lost=sub.lost))
                sub.lost = 0
            if sub.queue.full() or sub.lost:
                sub.lost += 1
            else:
                sub.queue.put_nowait(event)

    def subscribe(self, pools=(), tenants=(), kinds=(), buffer: int = 1024, owner: str = ""
                  ) -> Subscription:
        """A watcher; an owner (a tenant) may have at most MAX_PER_OWNER at once, so its
        never-read buffers cannot grow kvd without bound."""
        if owner and sum(s.owner == owner for s in self.subscriptions) >= MAX_PER_OWNER:
            raise ResourceExhausted(f"{MAX_PER_OWNER} event watchers of tenant "
                                    f"{owner[:64]!r} are open already")
        sub = Subscription(frozenset(pools), frozenset(tenants), frozenset(kinds),
                           asyncio.Queue(max(2, buffer)), owner=owner)
        self.subscriptions.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self.subscriptions.discard(sub)

    async def next(self, sub: Subscription) -> Event:
        """The subscriber's next event; a gap marker first when it lost some."""
        if sub.queue.empty() and sub.lost:
            lost, sub.lost = sub.lost, 0
            return Event(0, time.time(), "gap", lost=lost)
        return await sub.queue.get()


class PlanEvents:
    """What a pool runtime reports when a plan is done (given to it at construction): the
    stall of an access, and eviction, recompute and promotion events."""

    def __init__(self, bus: EventBus, stall_seconds: Callable[[str, float], None]) -> None:
        self.bus = bus
        self.stall_seconds = stall_seconds  # (pool, seconds): the stall histogram

    def __call__(self, plan: TransferPlan, stall_s: float) -> None:
        if plan.reason is Reason.ACCESS and stall_s > 0:
            self.stall_seconds(plan.pool, stall_s)
        bus = self.bus
        if not bus.subscriptions:
            return  # nobody watching: skip grouping the victims
        cause = plan.cause
        cause_tenant = cause.tenant if cause else ""
        cause_request = cause.request_id if cause else ""
        victims = Counter((public_id(m.block.request.request_id), m.block.request.tenant)
                          for m in plan.demotions)
        for (rid, tenant), n in victims.items():
            bus.publish("eviction", pool=plan.pool, tenant=tenant, request_id=rid, count=n,
                        reason=plan.reason, cause_tenant=cause_tenant,
                        cause_request=cause_request, **({} if rid else KEPT))
        # Blocks whose bytes were dropped came back as zeroed pages: the engine recomputes.
        lost = Counter((m.block.request.request_id, m.block.request.tenant)
                       for m in plan.promotions if m.kind is MoveKind.REMATERIALIZE)
        for (rid, tenant), n in lost.items():
            bus.publish("recompute", pool=plan.pool, tenant=tenant, request_id=rid, count=n,
                        reason=plan.reason)
        if plan.promotions:
            bus.publish("promotion", pool=plan.pool, tenant=cause_tenant,
                        request_id=cause_request, count=len(plan.promotions),
                        reason=plan.reason, stall_s=f"{stall_s:.6f}")

def publish_admitted(bus: EventBus, pool: str, admitted: list[Request]) -> None:
    """Queued requests that were admitted (by a release, a quota, room coming free)."""
    for other in admitted:
        bus.publish("admission", pool=pool, tenant=other.tenant, request_id=other.request_id,
                    count=other.projected_pages, decision=Decision.ADMITTED,
                    reason="from the queue")
