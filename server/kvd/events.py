"""The event stream behind WatchEvents: what kvd decided, in order, with a sequence number
per daemon run. Publishing never blocks: a subscriber that falls behind its bounded buffer
loses events, and is told how many with a gap marker before the next one it gets."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvd.core.errors import ResourceExhausted

# Event watchers one tenant may have open at once.
MAX_PER_OWNER = 16

KINDS = ("admission", "allocation", "eviction", "promotion", "recompute", "release", "quota",
         "policy", "lease", "handoff")


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
