"""Admission (DESIGN.md, "What kvd decides": who gets in): a request is admitted when its
projected pages fit the pool now, queued when they can fit later, rejected when they never
can. `Admission` holds the queue, the pages reserved for admitted requests, and the decision;
it reads the page table and the tenancy and changes neither. The pool (Pool.admit) validates
the request and registers it.

Two modes. `working_set` (the default) protects the working set: engines read every block of
every running request each step, so admitted requests' pages (what each will grow to by its
end) must fit the device tier, or every step pages. Shared prefix blocks a request loads or
stores are not its working set: the engine copies a loaded block in (Load hands it out until
the engine's next call), and a step reads a request's own blocks. A
request bigger than its tenant's fair share (a whale, under a fair policy) is counted for its
fair share only: it streams the rest through the host tier, evicting its own pages. The queue
holds the rest, in fair order. A tenant's guarantee is its own: a request whose tenant's
working sets, with it, stay within the tenant's guaranteed pages goes in whatever the other
tenants' working sets hold (they may fill an idle guarantee, and give it back when its owner
comes: their pages are the ones evicted then, as DESIGN's quotas say). `reservation` admits
while the pages fit both tiers: the device
over-subscribed, the host tier paging, as a memory manager that knows nothing of working sets
does (a baseline to compare with, and for pools whose engines do not read every block).
"""

from __future__ import annotations

import enum
import math
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvd.core.blocks import Request, RequestState
from kvd.core.clock import Clock
from kvd.core.counters import PoolCounters
from kvd.core.errors import (FailedPrecondition, InvalidArgument, ResourceExhausted,
                             check_printable, short_repr)
from kvd.core.pages import PageTable
from kvd.core.reservation import Reserver, Verdict
from kvd.core.tenancy import Tenancy, tally


class Decision(enum.StrEnum):
    """An admission answer: let in now, wait in the queue, or never (with a reason)."""
    ADMITTED = "admitted"
    QUEUED = "queued"  # waits in the pool's queue, in fair order across tenants
    REJECTED = "rejected"  # can never fit: bigger than the device tier, a cap or a limit


@dataclass(slots=True)
class AdmitResult:
    """What Admit answers: the decision, why, the queue position when queued, and the pages the
    request is projected to hold."""
    decision: Decision
    reason: str  # why it waits or was rejected ("" when admitted)
    queue_position: int  # 1-based, in fair order; 0 when not queued
    projected_pages: int  # prompt plus expected output, in pages


ADMISSION_MODES = ("working_set", "reservation")


class Admission:
    """One pool's admission queue and reserved pages, and the decision of who goes next."""

    def __init__(self, name: str, *, block_tokens: int, max_queue: int, clock: Clock,
                 pages: PageTable, tenancy: Tenancy, counters: PoolCounters,
                 reserver: Reserver | None, mode: str = "working_set") -> None:
        if mode not in ADMISSION_MODES:
            raise InvalidArgument(f"admission mode {mode!r}: choose one of "
                                  f"{', '.join(ADMISSION_MODES)}")
        self.name = name
        self.mode = mode
        self.working_set = mode == "working_set"
        self.block_tokens = block_tokens
        self.max_queue = max_queue
        self.clock = clock
        self.pages = pages  # read only: room in the device tier
        self.tenancy = tenancy
        self.counters = counters
        # Reserves pages in a request's handoff pool (None: this pool cannot hand off).
        self.reserver = reserver
        self.queue: OrderedDict[str, Request] = OrderedDict()
        # The same requests by tenant, each tenant's in arrival order: the head of the line
        # is one of the tenants' firsts (see _firsts), found without a walk of the queue,
        # which one tenant may fill (max_queue) while every other tenant's calls run the line.
        self._by_tenant: dict[str, OrderedDict[str, Request]] = {}
        self._arrivals = 0
        # Bumped whenever the queue's requests change (see submit for the exception).
        self._content = 0
        # Every queued request's position, the state of the queue's fair order it was worked
        # out in, and how many times it was (see queue_positions).
        self._positions: dict[str, int] = {}
        self._positions_of: tuple | None = None
        self.positions_version = 0
        # Queued requests by the pool their handoff reservation waits in (kick_queues).
        self.handoff_waiting: Counter[str] = Counter()
        self.reserved_pages = 0
        # Of those, the pages counted as working set: each request's own, not the shared
        # prefix blocks it uses (counted in its reservation, not its working set), and a
        # whale's only up to its cap (see counted_pages). And how many uses of shared blocks
        # the requests make (kept by Prefixes, through shared_uses_changed).
        self.working_set_pages = 0
        self.working_set_by_tenant: Counter[str] = Counter()  # the same, each tenant's
        self.shared_uses = 0
        self._newly_admitted: list[Request] = []
        # Told when the line's fair order may have moved while requests wait, outside a run
        # of the line: see _demand_moved.
        self.on_order_moved: Callable[[], None] | None = None
        self._in_line = False
        tenancy.on_demand = self._demand_moved

    def projected_pages(self, prompt_tokens: int, output_tokens: int) -> int:
        """Pages a request of these token counts holds at its end (whole blocks)."""
        return math.ceil((prompt_tokens + output_tokens) / self.block_tokens)

    # ------------------------------------------------------------------ the decision

    def never_fits(self, tenant: str, projected: int, tokens: int) -> str:
        """Why a request can never be admitted, or "" when it could be."""
        device = self.pages.device.capacity
        if projected > device:
            return (f"needs {projected} pages ({tokens} tokens at {self.block_tokens} per page) "
                    f"but the device tier of pool {self.name!r} holds {device}; "
                    "it can never be resident")
        quota = self.tenancy.quota(tenant)
        cap = quota.request_cap(device)
        if cap is not None and projected > cap:
            return (f"needs {projected} pages, over tenant {tenant!r}'s per-request cap of "
                    f"{cap} pages in pool {self.name!r}")
        if quota.limit is not None and projected > quota.limit:
            return (f"needs {projected} pages, over tenant {tenant!r}'s limit of {quota.limit} "
                    f"pages in pool {self.name!r}")
        return ""

    def judge(self, req: Request) -> str:
        """Why `req` (not yet queued) can never be admitted, or "" when it could be; a
        request to be handed off also needs its handoff pool's word."""
        tokens = req.prompt_tokens + req.output_tokens
        never = self.never_fits(req.tenant, req.projected_pages, tokens)
        if not never and req.handoff_pool:
            state, why = self.reserver.state(req)
            never = why if state is Verdict.NEVER else ""
        return never

    def check_queue_share(self, tenant: str) -> None:
        """The admission queue is shared by weight: a tenant may fill it up to its weighted
        share among the tenants waiting (itself included), so one tenant's flood of requests
        waiting on its own limit never shuts another out. The queue as a whole stays within
        twice max_queue."""
        if not self.queue:  # nobody waits: a share of at least one entry is free
            return
        mine, share = self.tenancy.queue_share(tenant, self.max_queue)
        if mine >= share or len(self.queue) >= 2 * self.max_queue:
            raise ResourceExhausted(
                f"admission queue of pool {self.name!r}: tenant {short_repr(tenant)} has {mine} "
                f"request(s) waiting, its share of the {self.max_queue}-entry queue is "
                f"{share}; retry after its requests finish")

    def submit(self, req: Request) -> AdmitResult:
        """Queue `req` and admit in fair order: it goes now only if it is first in line and
        fits. Queued requests that go with it are kept for take_newly_admitted()."""
        content = self._content
        self._in_line = True  # the line runs right after it is queued
        try:
            self.enqueue(req)
        finally:
            self._in_line = False
        admitted = self.admit_from_queue()
        if req in admitted:
            self._newly_admitted = [r for r in admitted if r is not req]
            if not self._newly_admitted:  # in and out alone: the queue is as it was
                self._content = content
            return AdmitResult(Decision.ADMITTED, "", 0, req.projected_pages)
        self._newly_admitted = admitted
        self.counters.num_queued += 1
        return AdmitResult(Decision.QUEUED, self.why_waiting(req),
                           self.queue_position(req.request_id), req.projected_pages)

    def take_newly_admitted(self) -> list[Request]:
        """Queued requests admitted as a side effect of the last submit() (rare)."""
        admitted, self._newly_admitted = self._newly_admitted, []
        return admitted

    def why_waiting(self, req: Request) -> str:
        """Why a queued request is not admitted yet, in words for the engine and the operator."""
        if req.handoff_pool:
            state, why = self.reserver.state(req)
            if state is not Verdict.OK:
                return why
        tenancy = self.tenancy
        if tenancy.over_limit(req.tenant, req.projected_pages):
            return (f"tenant {req.tenant!r} has {tenancy.reserved_by_tenant[req.tenant]} "
                    f"of {tenancy.cap_words(req.tenant)} reserved; waits for its own "
                    "requests to finish")
        capacity = self.pages.capacity_pages
        if not self.fits(req.projected_pages):
            return (f"needs {req.projected_pages} pages; {capacity - self.reserved_pages}"
                    f" of {capacity} are unreserved in pool {self.name!r}")
        if self.working_set and not self.working_set_fits(req):
            return (f"needs {self.working_set_charge(req)} device pages for its working set; "
                    f"the running requests' working sets hold {self.working_set_used()} of "
                    f"the {self.pages.share_capacity} the device tier of pool {self.name!r} "
                    "gives them (admitting more would make every step page)")
        need, room = self.device_need(req), self.room_for(req)
        if need <= room:  # it fits: others are ahead of it (whose ids are not its to learn)
            return (f"waits its turn behind {self.queue_position(req.request_id) - 1} "
                    "request(s) ahead of it in fair order (of tenants further below their "
                    "fair share, or queued before it), the first of which does not fit yet")
        where = ("free or held by tenants above their fair share" if self.pages.policy.fair
                 else "free or evictable")
        return (f"needs {need} device pages; only {room} are "
                f"{where} ({self.pages.num_pinned} of {self.pages.device.capacity} pinned)")

    def fits(self, pages: int) -> bool:
        """Whether `pages` more can be reserved in the pool now."""
        return self.reserved_pages + pages <= self.pages.capacity_pages

    def can_admit(self, req: Request) -> bool:
        """Whether a queued request can be admitted now (pool room, tenant limit, working set,
        handoff reservation)."""
        if self.tenancy.over_limit(req.tenant, req.projected_pages):
            return False
        if not (self.fits(req.projected_pages) and self.device_need(req) <= self.room_for(req)):
            return False
        if self.working_set and not self.working_set_fits(req):
            return False
        return not req.handoff_pool or self.reserver.state(req)[0] is Verdict.OK

    # ------------------------------------------------------------------ working sets

    def working_set_used(self) -> int:
        """Device pages the admitted requests' working sets take (see the module)."""
        return self.working_set_pages

    def shared_uses_changed(self, req: Request, counted_before: int, uses: int) -> None:
        """req uses `uses` more shared blocks (fewer when negative) than when it counted
        `counted_before` pages of working set (counted_pages, before req.shared changed)."""
        self.shared_uses += uses
        self._count_working_set(req, counted_pages(req) - counted_before)

    def working_set_cap(self, req: Request) -> int | None:
        """The most pages req is counted for: under a fair policy, a request bigger than its
        tenant's fair share (or guarantee) streams the rest and is counted for that share;
        None: for all of its pages."""
        if not self.pages.policy.fair:
            return None
        tenancy = self.tenancy
        share = max(tenancy.fair_share(req.tenant), tenancy.guaranteed(req.tenant))
        cap = max(1, int(share + 1e-6))
        return cap if req.projected_pages > cap else None

    def working_set_charge(self, req: Request) -> int:
        cap = self.working_set_cap(req)
        return req.projected_pages if cap is None else cap

    def working_set_fits(self, req: Request) -> bool:
        """Whether req's working set fits the device beside those already running, or its
        tenant's guarantee (see within_guarantee)."""
        charge = self.working_set_charge(req)
        return self.working_set_room_for(charge) or self.within_guarantee(req.tenant, charge)

    def within_guarantee(self, tenant: str, pages: int) -> bool:
        """Whether the tenant's running working sets and `pages` more stay within the pages
        it is guaranteed (as honoured, see Tenancy.guaranteed): those are its own, and no
        other tenant's working set keeps it out of them."""
        guaranteed = self.tenancy.guaranteed(tenant)
        return bool(guaranteed) and (self.working_set_by_tenant[tenant] + pages
                                     <= guaranteed + 1e-6)

    def working_set_room_for(self, pages: int) -> bool:
        """Whether `pages` more fit the device beside the running requests' working sets. A
        request alone in the pool always fits (it was judged able to run at all)."""
        used = self.working_set_used()
        return not used or used + pages <= self.pages.share_capacity

    def device_need(self, req: Request) -> int:
        """Device pages a request must get to run. Under a fair policy: what its tenant's
        fair share leaves room for (a request bigger than that streams the rest through the
        host tier, evicting its own pages); otherwise all of it."""
        if not self.pages.policy.fair:
            return req.projected_pages
        headroom = self.tenancy.headroom(req.tenant)
        return min(req.projected_pages, max(0, headroom))

    def room_for(self, req: Request) -> int:
        """Device pages the request could have now: free ones (kept ones included, see
        Holds.keep), its own tenant's evictable pages, and what other tenants hold above
        their fair share (and guarantee). Under a policy blind to tenants, every page no
        pin claims."""
        pages = self.pages
        if not pages.policy.fair:
            # Every page no pin claims: free, evictable, held (evictable once its holder
            # calls again) or in transit (settled in a moment). A pinned block an engine
            # holds stays pinned when the hold ends, and one pinned on the host comes back.
            return max(0, pages.device.capacity - pages.num_pinned)
        # Free pages, and those of released requests kept for their holders (free once
        # the holders call again, as held pages are evictable then).
        room = pages.device.num_free + len(pages.holds.kept)
        tenancy = self.tenancy
        shares = tenancy.fair_shares()
        for tenant, used in tenancy.device_by_tenant.items():
            evictable = max(0, used - tenancy.pinned_by_tenant[tenant])
            if tenant == req.tenant:
                room += evictable
                continue
            keep = max(shares.get(tenant, 0.0), tenancy.guaranteed(tenant))
            room += max(0, min(evictable, int(tenancy.usage(tenant) - keep + 1e-6)))
        return room

    # ------------------------------------------------------------------ the queue

    def enqueue(self, req: Request) -> None:
        """Put a request in the admission queue and count it in its tenant's waiting demand."""
        req.queued_at = self.clock.now()
        self._arrivals += 1
        self._content += 1
        req.queue_seq = self._arrivals
        self.queue[req.request_id] = req
        self._by_tenant.setdefault(req.tenant, OrderedDict())[req.request_id] = req
        if req.handoff_pool:
            tally(self.handoff_waiting, req.handoff_pool, 1)
        tally(self.tenancy.queued_by_tenant, req.tenant, req.projected_pages)
        tally(self.tenancy.waiting_by_tenant, req.tenant, 1)
        self.tenancy.demand_changed()

    def dequeue(self, req: Request) -> None:
        del self.queue[req.request_id]
        self._content += 1
        mine = self._by_tenant[req.tenant]
        del mine[req.request_id]
        if not mine:
            del self._by_tenant[req.tenant]
        if req.handoff_pool:
            tally(self.handoff_waiting, req.handoff_pool, -1)
        tally(self.tenancy.queued_by_tenant, req.tenant, -req.projected_pages)
        tally(self.tenancy.waiting_by_tenant, req.tenant, -1)
        self.tenancy.demand_changed()

    def admit_from_queue(self) -> list[Request]:
        """Admit queued requests in fair order (the tenant furthest below its fair share
        first, then arrival), stopping at the first that does not fit: a big request is not
        starved by a stream of small ones behind it. A request within its tenant's guarantee
        waits behind nobody (see _guaranteed_in_line), and one that waits on its own
        tenant's cap holds nobody up (see _first_not_capped)."""
        admitted = []
        self._in_line = True
        try:
            self._run_line(admitted)
        finally:
            self._in_line = False
        return admitted

    def _run_line(self, admitted: list[Request]) -> None:
        while self.queue:
            req = self._next_in_line()
            if not self.can_admit(req):  # an admissible head is not capped: no look needed
                req = self._first_not_capped() if self.capped(req) else None
                if req is None or not self.can_admit(req):
                    req = self._guaranteed_in_line()
                    if req is None:
                        break
            cap = self.working_set_cap(req)  # its fair share while its demand counts
            self.dequeue(req)
            self._admit_now(req, cap)
            admitted.append(req)

    def _demand_moved(self) -> None:
        """A tenant's reserved, queued or kept pages changed (an allocation or a prefix
        stored past a reservation, a release, a handoff reservation, a kept prefix page in or
        out of the device tier). The line's fair order (reserved pages over fair share) is
        made of them: a change may put at the head a request that fits, while the head it
        had waits. With requests waiting, and outside a run of the line, the owner is told
        (on_order_moved), to run the line again once the operation that moved it is done."""
        if self.queue and not self._in_line and self.on_order_moved is not None:
            self.on_order_moved()

    def take_never_fitting(self) -> list[tuple[Request, str]]:
        """Queued requests that can never be admitted now, taken out of the queue with why
        (see judge): a quota or the policy changed since they queued (a limit or cap
        lowered below them, a device share they outgrew). Left in line, such a request
        would wait for ever, and so would every request behind it."""
        out = []
        for req in list(self.queue.values()):
            why = self.judge(req)
            if why:
                self.dequeue(req)
                out.append((req, why))
        return out

    def capped(self, req: Request) -> bool:
        """Whether a queued request waits on its own tenant's cap, here or in its handoff
        pool (its limit, or its part of a cluster limit): for room that only its tenant's
        own requests ending make, and that no other tenant's request takes."""
        if self.tenancy.over_limit(req.tenant, req.projected_pages):
            return True
        return bool(req.handoff_pool) and self.reserver.state(req)[0] is Verdict.CAPPED

    def _first_not_capped(self) -> Request | None:
        """The first queued request, in fair order, of a tenant whose first is not capped:
        the head of the line once the tenants that wait on their own caps step aside. A
        capped tenant's later requests step aside with its first, or its small requests
        would take the room under its cap that its first waits for."""
        # Fair order ranks a tenant's requests among themselves by arrival: the head is one
        # of the firsts.
        return min((r for r in self._firsts() if not self.capped(r)), key=self._queue_key,
                   default=None)

    def _firsts(self) -> list[Request]:
        """Each waiting tenant's first request, in arrival order (where fair order ties,
        the one that came first goes first)."""
        firsts = [next(iter(mine.values())) for mine in self._by_tenant.values()]
        firsts.sort(key=_arrival)
        return firsts

    def _guaranteed_in_line(self) -> Request | None:
        """The first queued request, in fair order, that its tenant's guarantee admits now
        (within_guarantee, and can_admit), while the head of the line waits: the pages it
        is guaranteed are its tenant's, not the head's. The queue is looked at only while
        a tenant with requests waiting has guaranteed pages its working sets leave spare,
        which is rare."""
        if not self.working_set:
            return None
        tenancy = self.tenancy
        spare = {t for t in tenancy.waiting_by_tenant
                 if tenancy.guaranteed(t) > self.working_set_by_tenant[t] + 1e-6}
        if not spare:
            return None
        waiting = sorted((r for r in self.queue.values() if r.tenant in spare),
                         key=self._queue_key)
        return next((r for r in waiting
                     if self.within_guarantee(r.tenant, self.working_set_charge(r))
                     and self.can_admit(r)), None)

    def _admit_now(self, req: Request, working_set_cap: int | None) -> None:
        req.state = RequestState.ADMITTED
        req.admitted_at = self.clock.now()
        req.working_set_cap = working_set_cap
        self.reserve(req, req.projected_pages)
        self.counters.num_admitted += 1
        if req.handoff_pool:
            self.reserver.reserve(req)

    def _next_in_line(self) -> Request:
        firsts = self._firsts()
        return firsts[0] if len(firsts) == 1 else min(firsts, key=self._queue_key)

    def _queue_key(self, req: Request) -> tuple[float, float]:
        share = self.tenancy.fair_shares().get(req.tenant, 0.0)
        return (self.tenancy.reserved_by_tenant[req.tenant] / max(share, 1e-9), req.queued_at)

    def queue_positions(self) -> dict[str, int]:
        """Every queued request's 1-based position, in one ordering of the queue: sorted
        again only once the queue or its tenants' standing changed. (Each WaitAdmission
        stream asks after every change that moves its request; with a thousand waiting, a
        sort for each held the event loop for a second.)"""
        state = self._order_state()
        if state != self._positions_of:
            order = sorted(self.queue.values(), key=self._queue_key)
            self._positions = {r.request_id: i for i, r in enumerate(order, 1)}
            self._positions_of = state
            self.positions_version += 1
        return self._positions

    def queue_position(self, request_id: str) -> int:
        """1-based position in the admission queue (in fair order), 0 when not queued."""
        return self.queue_positions().get(request_id, 0) if request_id in self.queue else 0

    def _order_state(self) -> tuple:
        """What the queue's fair order is made of: the requests in it (each one's place in
        arrival order and its queued_at stay as they were), and how the waiting tenants
        rank by their standing (see _queue_key: their requests interleave by it, and by
        arrival where two stand equal)."""
        if len(self._by_tenant) < 2:
            return (self._content,)
        shares = self.tenancy.fair_shares()
        reserved = self.tenancy.reserved_by_tenant
        standing = sorted((reserved[t] / max(shares.get(t, 0.0), 1e-9), t)
                          for t in self._by_tenant)
        ranks = []
        for i, (value, tenant) in enumerate(standing):
            tied = i and value == standing[i - 1][0]
            ranks.append((tenant, ranks[-1][1] if tied else i))
        return (self._content, tuple(ranks))

    # ------------------------------------------------------------------ reserved pages

    def reserve(self, req: Request, pages: int) -> None:
        """`pages` more are reserved for req (at admission, or as it grows past them)."""
        before = counted_pages(req)
        req.reserved_pages += pages
        self._count_working_set(req, counted_pages(req) - before)
        self.reserved_pages += pages
        tally(self.tenancy.reserved_by_tenant, req.tenant, pages)
        self.tenancy.demand_changed()

    def unreserve(self, req: Request) -> None:
        """req is gone: what was reserved for it is free to reserve again."""
        self.reserved_pages -= req.reserved_pages
        self._count_working_set(req, -counted_pages(req))
        tally(self.tenancy.reserved_by_tenant, req.tenant, -req.reserved_pages)
        req.reserved_pages = 0
        self.tenancy.demand_changed()

    def _count_working_set(self, req: Request, delta: int) -> None:
        if delta:
            self.working_set_pages += delta
            tally(self.working_set_by_tenant, req.tenant, delta)

    def reservation_state(self, tenant: str, projected: int, tokens: int
                          ) -> tuple[Verdict, str]:
        """Whether a handoff reservation of `projected` pages could be made here, and if
        not why."""
        never = self.never_fits(tenant, projected, tokens)
        if never:
            return Verdict.NEVER, f"handoff pool {self.name!r}: {never}"
        if self.tenancy.over_limit(tenant, projected):
            return Verdict.CAPPED, (
                f"handoff pool {self.name!r}: tenant {tenant!r} has "
                f"{self.tenancy.reserved_by_tenant[tenant]} of "
                f"{self.tenancy.cap_words(tenant)} reserved")
        if not self.fits(projected):
            capacity = self.pages.capacity_pages
            return Verdict.WAIT, (
                f"handoff pool {self.name!r} cannot reserve {projected} pages: "
                f"{capacity - self.reserved_pages} of {capacity} are unreserved")
        if (self.working_set and not self.working_set_room_for(projected)
                and not self.within_guarantee(tenant, projected)):
            return Verdict.WAIT, (
                f"handoff pool {self.name!r}: the running requests' working sets hold "
                f"{self.working_set_used()} of the {self.pages.share_capacity} device pages "
                "it gives them; "
                f"{projected} more would make every step page")
        return Verdict.OK, ""

    def new_request(self, request_id: str, tenant: str, prompt_tokens: int,
                    output_tokens: int, priority: int, handoff_pool: str) -> Request:
        """A request asking to be admitted (not yet judged), or the error that says what is
        wrong with its arguments. With a handoff pool this pool only prefills: the request
        holds the prompt's pages here; its output is decoded in the handoff pool."""
        if not request_id:
            raise InvalidArgument("request_id must not be empty")
        check_printable("request_id", request_id)
        if prompt_tokens < 0 or output_tokens < 0:
            raise InvalidArgument("token counts must be >= 0")
        if prompt_tokens + output_tokens == 0:
            raise InvalidArgument("a request needs at least one prompt or output token")
        if handoff_pool:
            if self.reserver is None:
                raise FailedPrecondition(f"pool {self.name!r} cannot hand off")
            if prompt_tokens == 0:
                raise InvalidArgument("a request handed off after prefill needs prompt tokens")
        projected = self.projected_pages(prompt_tokens, 0 if handoff_pool else output_tokens)
        return Request(request_id, tenant, self.name, priority, projected, RequestState.QUEUED,
                       handoff_pool=handoff_pool, prompt_tokens=prompt_tokens,
                       output_tokens=output_tokens)

    def growth(self, req: Request, num_blocks: int) -> int:
        """Pages past its reservation that adding num_blocks makes the request hold (0 when
        it stays within), or the error that says why it may not grow. Counted in live blocks,
        not indices: a request that frees old blocks and allocates new ones (a sliding
        window) stays within what it reserved."""
        growth = max(0, req.num_live_blocks + len(req.shared) + num_blocks
                     - req.reserved_pages)
        self.check_growth(req, num_blocks, growth)
        if growth and not self.fits(growth):
            raise ResourceExhausted(
                f"request {short_repr(req.request_id)} grows past its {req.reserved_pages} "
                f"reserved pages and pool {self.name!r} has "
                f"{self.pages.capacity_pages - self.reserved_pages} unreserved")
        return growth

    def check_growth(self, req: Request, num_blocks: int, growth: int) -> None:
        """Quotas hold on every page added after admission too: the request's cap on its
        live blocks, the tenant's limit on the pages reserved for all its requests."""
        quota = self.tenancy.quota(req.tenant)
        cap = quota.request_cap(self.pages.device.capacity)
        held = req.num_live_blocks + len(req.shared)
        if cap is not None and held + num_blocks > cap:
            raise ResourceExhausted(
                f"request {short_repr(req.request_id)} holds {held} pages and "
                f"asks for {num_blocks} more: over tenant {req.tenant!r}'s per-request cap of "
                f"{cap} pages in pool {self.name!r}")
        if growth and self.tenancy.over_limit(req.tenant, growth):
            raise ResourceExhausted(
                f"tenant {req.tenant!r} is at {self.tenancy.cap_words(req.tenant, 'of')} in pool "
                f"{self.name!r} ({self.tenancy.reserved_by_tenant[req.tenant]} reserved); "
                f"request {short_repr(req.request_id)} asks for {growth} more")


def counted_pages(req: Request) -> int:
    """The pages req counts for in the working set: its reservation less the shared blocks
    it uses (its own pages), up to its cap. (Its shared blocks taken off the capped count
    instead, a whale with a long shared prefix counted below zero.)"""
    own = max(0, req.reserved_pages - len(req.shared))
    cap = req.working_set_cap
    return own if cap is None else min(own, cap)


def _arrival(req: Request) -> int:
    return req.queue_seq
