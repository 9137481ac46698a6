"""Handoff reservations (DESIGN.md, "What kvd decides": prefill and decode): a request
admitted to a prefill pool with a handoff pool is admitted only together with a reservation
of its decode pages there, so no prefill is spent on a request decode cannot hold.

The prefill pool asks through a `Reserver`, given at its construction; `PoolReserver` is
the one kvd runs, reserving in the pools of the same node. The decode pool keeps what it was
asked for in `Reservations`: requests that hold pages but no blocks until their handoff
claims them, and the blocks a handoff copies out, held still meanwhile.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvd.core.attribution import Attribution
from kvd.core.blocks import Block, Request, RequestState, TierKind, evictable
from kvd.core.clock import Clock
from kvd.core.counters import PoolCounters
from kvd.core.errors import AlreadyExists, FailedPrecondition, ResourceExhausted
from kvd.core.reads import Reads, after_reads
from kvd.core.requests import RequestTable, check_still
from kvd.core.tenancy import Tenancy

if TYPE_CHECKING:
    from kvd.core.admission import Admission
    from kvd.core.pages import PageTable
    from kvd.core.pool import Pool


class Verdict(enum.Enum):
    """Whether a reservation can be made: now, later (after others finish), or never.
    CAPPED is later too, once the tenant's own requests there finish: it is at its limit
    (or its part of a cluster limit), which no other tenant's request takes from or frees."""

    OK = "ok"
    WAIT = "wait"
    CAPPED = "capped"
    NEVER = "never"


class Reserver(Protocol):
    """What a prefill pool asks of its requests' handoff pools."""

    def state(self, req: Request) -> tuple[Verdict, str]:
        """Whether req's decode reservation could be made, and if not why."""

    def reserve(self, req: Request) -> None:
        """Make req's decode reservation (its state was OK just before)."""


class PoolReserver:
    """Reserves a prefill request's decode pages in its handoff pool, found by name with
    `pool_of` (the node's pools)."""

    def __init__(self, pool_of: Callable[[str], Pool], ttl_s: float) -> None:
        self.pool_of = pool_of
        self.ttl_s = ttl_s

    def state(self, req: Request) -> tuple[Verdict, str]:
        """Whether the handoff pool could reserve req's decode pages now, and if not why."""
        target = self.pool_of(req.handoff_pool)
        projected = target.admission.projected_pages(req.prompt_tokens, req.output_tokens)
        return target.admission.reservation_state(req.tenant, projected,
                                        req.prompt_tokens + req.output_tokens)

    def reserve(self, req: Request) -> None:
        """Reserve req's decode pages in its handoff pool."""
        self.pool_of(req.handoff_pool).reservations.reserve(
            req.request_id, req.tenant, prompt_tokens=req.prompt_tokens,
            output_tokens=req.output_tokens, priority=req.priority, ttl_s=self.ttl_s)


class Reservations:
    """One pool's handoff reservations, and the blocks of its requests being handed off."""

    def __init__(self, name: str, *, requests: RequestTable, admission: Admission,
                 pages: PageTable, tenancy: Tenancy, attribution: Attribution,
                 counters: PoolCounters, clock: Clock, page_bytes: int, reads: Reads) -> None:
        self.name = name
        self.reads = reads
        self.requests = requests
        self.admission = admission
        self.pages = pages
        self.tenancy = tenancy
        self.attribution = attribution
        self.counters = counters
        self.clock = clock
        self.page_bytes = page_bytes
        # Requests made by reserve() and not yet claimed (some may be gone: pruned lazily).
        self._unclaimed: dict[str, Request] = {}

    @after_reads
    def reserve(self, request_id: str, tenant: str, *, prompt_tokens: int, output_tokens: int,
                priority: int, ttl_s: float) -> Request:
        """Hold the pages a request handed off from another pool will need (prompt plus
        output): it holds no blocks until Handoff claims it, and lapses after ttl_s."""
        if request_id in self.requests:
            raise AlreadyExists(f"request {request_id!r} already exists in pool {self.name!r}")
        projected = self.admission.projected_pages(prompt_tokens, output_tokens)
        state, why = self.admission.reservation_state(tenant, projected,
                                                      prompt_tokens + output_tokens)
        if state is not Verdict.OK:
            raise ResourceExhausted(why)
        now = self.clock.now()
        req = Request(request_id, tenant, self.name, priority, projected, RequestState.RESERVED,
                      queued_at=now, expires_at=now + ttl_s,
                      prompt_tokens=prompt_tokens, output_tokens=output_tokens)
        req.account = self.attribution.open(request_id, tenant)
        self.tenancy.budget(req, self.page_bytes, now)
        self.requests[request_id] = req
        self._unclaimed[request_id] = req
        self.admission.reserve(req, projected)
        return req

    @after_reads
    def claim(self, request_id: str) -> Request:
        """A reservation becomes an admitted request (its handoff is starting)."""
        req = self.requests.find(request_id)
        if req.state is not RequestState.RESERVED:
            raise FailedPrecondition(f"request {request_id!r} holds no reservation in pool "
                                     f"{self.name!r}")
        req.state = RequestState.ADMITTED
        req.admitted_at = self.clock.now()
        self.counters.num_admitted += 1
        self._unclaimed.pop(request_id, None)
        return req

    def live(self) -> list[Request]:
        """The requests reserve() made and nobody claimed or released yet (the rest are
        pruned here: the expirer asks every second, and a scan of every request would cost
        O(requests) each time)."""
        live = []
        for rid, req in list(self._unclaimed.items()):
            if req.state is not RequestState.RESERVED or self.requests.get(rid) is not req:
                del self._unclaimed[rid]
            else:
                live.append(req)
        return live

    def expired(self) -> list[str]:
        """Ids of reservations past their time to live."""
        now = self.clock.now()
        return [r.request_id for r in self.live() if r.expires_at <= now]

    def reserved_pages(self) -> int:
        """Pages held for requests not yet handed off to this pool."""
        return sum(r.reserved_pages for r in self.live())

    @after_reads
    def begin_handoff(self, request_id: str) -> list[Block]:
        """Hold a request's blocks still while they are copied to another pool: none may be
        evicted, freed or moved until end_handoff."""
        req = self.requests.admitted(request_id, self.admission.queue)
        live = req.live_blocks()
        check_still(live)
        # Dropped, or brought back as a zeroed page (a prefetch) the engine has not been
        # told of: either way not the block's bytes, which only the engine can recompute.
        dropped = [b.index for b in live if b.tier is TierKind.NONE or b.lost]
        if dropped:
            raise FailedPrecondition(
                f"blocks {dropped[:8]} of request {req.request_id!r} were dropped for the "
                "engine to recompute; access them (and recompute) before the handoff")
        pages = self.pages
        pages.moves += 1
        for b in live:
            if b in pages.policy:
                pages.policy.remove(b)
            pages.start_moving(b)
        return live

    @after_reads
    def end_handoff(self, blocks: list[Block]) -> None:
        """The copy is over (done or abandoned): the blocks are as they were."""
        policy = self.pages.policy
        for b in blocks:
            b.moving = False
            b.request.num_moving_blocks -= 1
            if evictable(b):
                policy.insert(b)
