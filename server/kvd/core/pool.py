"""A KV memory pool: two tiers of fixed-size pages, the requests that hold them, and the
decisions about which block lives where.

The pool is the mechanism (page tables, free lists, accounting, transfer plans); *which*
block leaves the device tier is delegated to an EvictionPolicy. Every public method either
does all it says or raises before changing anything.
"""

from __future__ import annotations

import functools
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvd.core import intent as intents
from kvd.core.admission import AdmitResult, Decision, budget
from kvd.core.attribution import NO_REQUEST, Attribution, EvictionRecord
from kvd.core.blocks import Block, Request, RequestState, TierKind
from kvd.core.clock import Clock
from kvd.core.errors import (
    AlreadyExists,
    BlocksInTransit,
    FailedPrecondition,
    HostShort,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from kvd.core.fairness import TenantQuota
from kvd.core.intent import IntentChange
from kvd.core.policies import EvictionPolicy, make_policy
from kvd.core.reads import Reads
from kvd.core.reservation import Reserver, Verdict
from kvd.core.tenancy import Tenancy
from kvd.core.tier import TierPages
from kvd.core.transfer import Move, MoveKind, Reason, TransferPlan


def _after_reads(method):
    """The pool method first applies the reads read_all() left pending, so every decision sees
    them (see read_all). It may change what read_all() can answer at once: forget the last
    answer."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.reads.pending:
            self.apply_reads()
        self.reads.forget()
        return method(self, *args, **kwargs)

    return wrapper


@dataclass(slots=True)
class AccessResult:
    """blocks is None when the request's every block was read and already resident."""

    blocks: list[Block] | None
    plan: TransferPlan | None
    request: Request
    # The plan brings in only some of the missing blocks (the host tier cannot take all
    # the victims at once): execute it and access again for the rest.
    partial: bool = False


@dataclass(slots=True)
class PoolCounters:
    num_evictions: int = 0
    num_demotions: int = 0
    num_promotions: int = 0
    num_drops: int = 0
    num_rematerializations: int = 0
    # Dropped blocks brought back as zeroed pages, flagged for the engine to recompute.
    num_lost_blocks: int = 0
    bytes_moved: int = 0
    num_decode_critical_accesses: int = 0
    num_decode_critical_misses: int = 0
    num_deadline_misses: int = 0
    num_accesses: int = 0
    num_misses: int = 0
    num_prefetches: int = 0
    num_admitted: int = 0
    num_queued: int = 0
    num_rejected: int = 0
    stall_seconds_total: float = 0.0
    peak_device_pages: int = 0
    evictions_by_reason: Counter = field(default_factory=Counter)


class Pool:
    """One named pool: a device tier, a host tier below it, and its requests."""

    def __init__(
        self,
        name: str,
        *,
        page_bytes: int,
        block_tokens: int,
        device_pages: int,
        host_pages: int,
        policy: str,
        clock: Clock,
        max_queue: int = 1024,
        quotas: dict[str, TenantQuota] | None = None,
        reserve_pages: int | None = None,
        attribution: Attribution | None = None,
        reserver: Reserver | None = None,
        defer: Callable[[Callable[[], None]], Any] | None = None,
    ) -> None:
        if page_bytes <= 0 or block_tokens <= 0:
            raise InvalidArgument("page_bytes and block_tokens must be positive")
        if device_pages <= 0:
            raise InvalidArgument(f"pool {name!r}: the device tier needs at least one page")
        self.name = name
        self.page_bytes = page_bytes
        self.block_tokens = block_tokens
        self.clock = clock
        self.device = TierPages(TierKind.DEVICE, device_pages)
        self.host = TierPages(TierKind.HOST, host_pages)
        self.requests: dict[str, Request] = {}
        self.queue: OrderedDict[str, Request] = OrderedDict()
        self.max_queue = max_queue
        self.reserved_pages = 0
        self.num_pinned = 0
        self.counters = PoolCounters()
        self.attribution = attribution or Attribution()
        # Free device pages kept for tenants below their fair share (a watermark): under a fair
        # policy, a tenant at or above its share evicts its own pages instead of spending them,
        # and the runtime refills them from over-share tenants in the background.
        self.reserve_pages = (max(1, device_pages // 50) if reserve_pages is None
                              else reserve_pages)
        self._newly_admitted: list[Request] = []
        self.tenancy = Tenancy(quotas)
        self.policy: EvictionPolicy = make_policy(policy, clock, self.tenancy)
        self.tenancy.set_share_capacity(self._share_capacity())
        # Reserves pages in a request's handoff pool (None: this pool cannot hand off).
        self.reserver = reserver
        # Reads read_all() answered and not yet recorded, and how to have them recorded
        # soon (the runtime's event loop; None: at once).
        self.reads = Reads(self.requests, clock)
        # Requests made by reserve() and not yet claimed (some may be gone: pruned lazily).
        self._reservations: dict[str, Request] = {}
        # Blocks handed to an engine that may still write or read their pages, by holder
        # (a client's lease, a Step stream): (since when, blocks). See hold().
        self._holds: dict[str, tuple[float, list[Block]]] = {}
        self.num_held = 0
        # How recording the reads is put off (see read_all; None: recorded at once).
        self.defer = defer

    # ------------------------------------------------------------------ queries

    @property
    def capacity_pages(self) -> int:
        """Pages admission may reserve: both tiers, less the transit headroom."""
        return self.device.capacity + self.host.capacity - self.transit_headroom

    @property
    def transit_headroom(self) -> int:
        """Host pages admission leaves unreserved. A promotion holds its host page until its
        copy completes, so swapping a block in while another goes out needs a spare host page;
        without one the victim would have to be dropped."""
        return min(self.host.capacity, max(1, self.device.capacity // 8))

    def tier(self, kind: TierKind) -> TierPages:
        return self.device if kind is TierKind.DEVICE else self.host

    def projected_pages(self, prompt_tokens: int, output_tokens: int) -> int:
        return math.ceil((prompt_tokens + output_tokens) / self.block_tokens)

    def get_request(self, request_id: str) -> Request:
        try:
            return self.requests[request_id]
        except KeyError:
            raise NotFound(f"no request {request_id!r} in pool {self.name!r}") from None

    def _admitted(self, request_id: str) -> Request:
        req = self.get_request(request_id)
        if req.state is RequestState.RESERVED:
            raise FailedPrecondition(
                f"request {request_id!r} has pages reserved in pool {self.name!r} but is not "
                "handed off yet; call Handoff once its prefill is done"
            )
        if req.state is RequestState.QUEUED:
            position = list(self.queue).index(request_id) + 1
            raise FailedPrecondition(
                f"request {request_id!r} is queued for admission (position {position}); "
                "it may allocate once admitted"
            )
        return req

    def _resolve(self, req: Request, indices: Sequence[int] | None) -> list[Block]:
        if indices is None:
            return req.live_blocks()
        blocks = []
        num = len(req.blocks)
        for i in indices:
            if i < 0 or i >= num:
                raise InvalidArgument(
                    f"block {i} out of range for request {req.request_id!r} "
                    f"(it has blocks 0..{num - 1})" if num else
                    f"request {req.request_id!r} has no blocks yet; allocate first"
                )
            block = req.blocks[i]
            if block is None:
                raise NotFound(f"block {i} of request {req.request_id!r} was freed")
            blocks.append(block)
        if len(set(indices)) != len(indices):
            raise InvalidArgument(f"duplicate block indices for request {req.request_id!r}")
        return blocks

    # ------------------------------------------------------------------ admission

    @_after_reads
    def admit(
        self,
        request_id: str,
        *,
        tenant: str,
        prompt_tokens: int,
        output_tokens: int,
        priority: int = 0,
        handoff_pool: str = "",
    ) -> AdmitResult:
        """ADMITTED when the request's projected pages fit the pool now, QUEUED when they can
        fit later, REJECTED when they never can.

        With a handoff pool, this pool only prefills: it holds the prompt's pages, and the
        request is admitted only together with a reservation of prompt plus output pages in
        the handoff pool, so no prefill is spent on a request decode cannot hold."""
        if not request_id:
            raise InvalidArgument("request_id must not be empty")
        if "\0" in request_id:
            raise InvalidArgument("request_id must not contain NUL characters")
        if prompt_tokens < 0 or output_tokens < 0:
            raise InvalidArgument("token counts must be >= 0")
        if prompt_tokens + output_tokens == 0:
            raise InvalidArgument("a request needs at least one prompt or output token")
        if request_id in self.requests:
            raise AlreadyExists(f"request {request_id!r} already exists in pool {self.name!r}")
        if handoff_pool:
            if self.reserver is None:
                raise FailedPrecondition(f"pool {self.name!r} cannot hand off")
            if prompt_tokens == 0:
                raise InvalidArgument("a request handed off after prefill needs prompt tokens")
        # A prefill pool holds the prompt only; the output is decoded in the handoff pool.
        projected = self.projected_pages(prompt_tokens, 0 if handoff_pool else output_tokens)
        never = self._never_fits(tenant, projected, prompt_tokens + output_tokens)
        probe = Request(request_id, tenant, self.name, priority, projected, RequestState.QUEUED,
                        handoff_pool=handoff_pool, prompt_tokens=prompt_tokens,
                        output_tokens=output_tokens)
        if not never and handoff_pool:
            state, why = self.reserver.state(probe)
            never = why if state is Verdict.NEVER else ""
        if never:
            self.counters.num_rejected += 1
            return AdmitResult(Decision.REJECTED, never, 0, projected)
        self._check_queue_share(tenant)
        now = self.clock.now()
        req = probe
        req.queued_at = now
        req.account = self.attribution.open(request_id, tenant)
        budget(req, self.tenancy.quota(req.tenant), self.page_bytes, now)
        self.requests[request_id] = req
        self.queue[request_id] = req
        self.tenancy.queued_by_tenant[tenant] += projected
        self.tenancy.waiting_by_tenant[tenant] += 1
        self.tenancy.demand_changed()
        # Admit in fair order: this request goes now only if it is first in line and fits.
        admitted = self._admit_from_queue()
        if req in admitted:
            self._newly_admitted = [r for r in admitted if r is not req]
            return AdmitResult(Decision.ADMITTED, "", 0, projected)
        self._newly_admitted = admitted
        self.counters.num_queued += 1
        return AdmitResult(Decision.QUEUED, self._why_waiting(req), self.queue_position(request_id),
                           projected)

    def _check_queue_share(self, tenant: str) -> None:
        """The admission queue is shared by weight: a tenant may fill it up to its weighted
        share among the tenants waiting (itself included), so one tenant's flood of requests
        waiting on its own limit never shuts another out. The queue as a whole stays within
        twice max_queue."""
        mine, share = self.tenancy.queue_share(tenant, self.max_queue)
        if mine >= share or len(self.queue) >= 2 * self.max_queue:
            raise ResourceExhausted(
                f"admission queue of pool {self.name!r}: tenant {_short(tenant)} has {mine} "
                f"request(s) waiting, its share of the {self.max_queue}-entry queue is "
                f"{share}; retry after its requests finish")

    def take_newly_admitted(self) -> list[Request]:
        """Queued requests admitted as a side effect of the last admit() (rare)."""
        admitted, self._newly_admitted = self._newly_admitted, []
        return admitted

    def _never_fits(self, tenant: str, projected: int, tokens: int) -> str:
        """Why a request can never be admitted, or "" when it could be."""
        if projected > self.device.capacity:
            return (f"needs {projected} pages ({tokens} tokens at {self.block_tokens} per page) "
                    f"but the device tier of pool {self.name!r} holds {self.device.capacity}; "
                    "it can never be resident")
        quota = self.tenancy.quota(tenant)
        cap = quota.request_cap(self.device.capacity)
        if cap is not None and projected > cap:
            return (f"needs {projected} pages, over tenant {tenant!r}'s per-request cap of "
                    f"{cap} pages in pool {self.name!r}")
        if quota.limit is not None and projected > quota.limit:
            return (f"needs {projected} pages, over tenant {tenant!r}'s limit of {quota.limit} "
                    f"pages in pool {self.name!r}")
        return ""

    def _why_waiting(self, req: Request) -> str:
        if req.handoff_pool:
            state, why = self.reserver.state(req)
            if state is not Verdict.OK:
                return why
        if self.tenancy.over_limit(req.tenant, req.projected_pages):
            return (f"tenant {req.tenant!r} has {self.tenancy.reserved_by_tenant[req.tenant]} "
                    f"of its {self.tenancy.quota(req.tenant).limit}-page limit reserved; waits "
                    "for its own requests to finish")
        if not self._fits(req.projected_pages):
            return (f"needs {req.projected_pages} pages; {self.capacity_pages - self.reserved_pages}"
                    f" of {self.capacity_pages} are unreserved in pool {self.name!r}")
        where = ("free or held by tenants above their fair share" if self.policy.fair
                 else "free or evictable")
        return (f"needs {self._device_need(req)} device pages; only {self._room_for(req)} are "
                f"{where} ({self.num_pinned} of {self.device.capacity} pinned)")

    def _fits(self, pages: int) -> bool:
        return self.reserved_pages + pages <= self.capacity_pages

    def _can_admit(self, req: Request) -> bool:
        if self.tenancy.over_limit(req.tenant, req.projected_pages):
            return False
        if not (self._fits(req.projected_pages) and self._device_need(req) <= self._room_for(req)):
            return False
        return not req.handoff_pool or self.reserver.state(req)[0] is Verdict.OK

    def _device_need(self, req: Request) -> int:
        """Device pages a request must get to run. Under a fair policy: what its tenant's
        fair share leaves room for (a request bigger than that streams the rest through the
        host tier, evicting its own pages); otherwise all of it."""
        if not self.policy.fair:
            return req.projected_pages
        headroom = self.tenancy.headroom(req.tenant)
        return min(req.projected_pages, max(0, headroom))

    def _room_for(self, req: Request) -> int:
        """Device pages the request could have now: free ones, its own tenant's evictable
        pages, and what other tenants hold above their fair share (and guarantee). Under an
        intent-blind or non-fair policy every evictable page counts."""
        room = self.device.num_free
        if not self.policy.fair:
            return room + len(self.policy) + self.num_held  # held: evictable in a moment
        shares = self.tenancy.fair_shares()
        for tenant, used in self.tenancy.device_by_tenant.items():
            evictable = max(0, used - self.tenancy.pinned_by_tenant[tenant])
            if tenant == req.tenant:
                room += evictable
                continue
            keep = max(shares.get(tenant, 0.0), self.tenancy.quota(tenant).guaranteed)
            room += max(0, min(evictable, int(used - keep + 1e-6)))  # shares are floats
        return room

    def _admit_now(self, req: Request) -> None:
        req.state = RequestState.ADMITTED
        req.admitted_at = self.clock.now()
        req.reserved_pages = req.projected_pages
        self.reserved_pages += req.projected_pages
        self.tenancy.reserved_by_tenant[req.tenant] += req.projected_pages
        self.counters.num_admitted += 1
        if req.handoff_pool:
            self.reserver.reserve(req)

    def _admit_from_queue(self) -> list[Request]:
        """Admit queued requests in fair order (the tenant furthest below its fair share
        first, then arrival), stopping at the first that does not fit: a big request is not
        starved by a stream of small ones behind it."""
        admitted = []
        while self.queue:
            req = self._next_in_line()
            if not self._can_admit(req):
                break
            del self.queue[req.request_id]
            self.tenancy.queued_by_tenant[req.tenant] -= req.projected_pages
            self.tenancy.waiting_by_tenant[req.tenant] -= 1
            self.tenancy.demand_changed()
            self._admit_now(req)
            admitted.append(req)
        return admitted

    def _next_in_line(self) -> Request:
        if len(self.queue) == 1 or len({r.tenant for r in self.queue.values()}) == 1:
            return next(iter(self.queue.values()))
        return min(self.queue.values(), key=self._queue_key)

    def _queue_key(self, req: Request) -> tuple[float, float]:
        share = self.tenancy.fair_shares().get(req.tenant, 0.0)
        return (self.tenancy.reserved_by_tenant[req.tenant] / max(share, 1e-9), req.queued_at)

    def queue_positions(self) -> dict[str, int]:
        """Every queued request's 1-based position, in one ordering of the queue."""
        order = sorted(self.queue.values(), key=self._queue_key)
        return {r.request_id: i for i, r in enumerate(order, 1)}

    def queue_position(self, request_id: str) -> int:
        """1-based position in the admission queue (in fair order), 0 when not queued."""
        if request_id not in self.queue:
            return 0
        order = sorted(self.queue.values(), key=self._queue_key)
        return 1 + next(i for i, r in enumerate(order) if r.request_id == request_id)

    # ------------------------------------------------------------------ tenancy

    def _share_capacity(self) -> int:
        """The device pages fair shares divide: under a fair policy the free reserve is
        nobody's share, it is the buffer that lets tenants below their share grow without
        waiting for a demotion."""
        return self.device.capacity - (self.reserve_pages if self.policy.fair else 0)

    @_after_reads
    def set_quota(self, tenant: str, quota: TenantQuota) -> list[Request]:
        """Change a tenant's quota now; returns queued requests it let in."""
        self.tenancy.set_quota(tenant, quota)
        return self._admit_from_queue()

    @_after_reads
    def refill_plan(self) -> TransferPlan | None:
        """Under a fair policy, demote pages of tenants above their fair share until the free
        reserve is whole again (None when it is, or nobody is over)."""
        want = self.reserve_pages - self.device.num_free
        if not self.policy.fair or want <= 0 or self.host.num_free <= self.transit_headroom:
            return None
        over = self.tenancy.over_share()
        if not over:
            return None
        want = min(want, len(self.policy), self.host.num_free - self.transit_headroom)
        victims = self.policy.choose(want)
        if not victims or any(v.request.tenant not in over for v in victims):
            return None  # only what over-share tenants hold refills the reserve
        return TransferPlan(self.name, Reason.RESERVE, None,
                            demotions=self._evict(len(victims), None, Reason.RESERVE, False))

    def _device_delta(self, req: Request, delta: int) -> None:
        req.num_device_blocks += delta
        self.tenancy.device_by_tenant[req.tenant] += delta

    # ------------------------------------------------------------------ room in the device tier

    def _no_room(self, needed: int) -> ResourceExhausted:
        held = ", ".join(f"{t}: {n}" for t, n in self.tenancy.pinned_by_tenant.most_common(5)) or "none"
        return ResourceExhausted(
            f"pool {self.name!r}: cannot free {needed} device page(s): "
            f"{self.device.num_free} free, {len(self.policy)} evictable, "
            f"{self.num_pinned} of {self.device.capacity} pinned (by tenant: {held}), "
            f"{self.num_held} held by engines until their next call, the rest in transit"
        )

    def _evict(self, num: int, cause: Request | None, reason: Reason, reassign: bool,
               protected: Collection[Block] = ()) -> list[Move]:
        """Take num victims (none of them protected) off the device tier: demote them to host,
        or drop those the engine can recompute when the host tier is full. Raises before
        changing anything: the policy's choice is looked at first and taken only after."""
        victims = self.policy.choose(num, cause.tenant if cause else None, protected)
        if victims is None:
            if self.num_held or self.num_moving_blocks():
                # Victims may come free when the copies finish, or when the engines holding
                # pages call again (or their holds lapse).
                raise BlocksInTransit([])
            raise self._no_room(num)
        num_host = self.host.num_free
        if any(not v.recompute_ok for v in victims[num_host:]):
            if self.num_moving_blocks():
                # Host pages held by copies in flight come free when they finish.
                raise BlocksInTransit([])
            demotable = 0  # the victims that can go now: the host has room, or recompute
            for i, v in enumerate(victims):
                if i >= num_host and not v.recompute_ok:
                    break
                demotable += 1
            raise HostShort(
                f"pool {self.name!r}: host tier full ({self.host.capacity} pages) and the "
                "victims cannot be recomputed; free or release requests", demotable
            )
        self.policy.take(victims)
        moves = []
        for i, victim in enumerate(victims):
            assert not victim.pinned, "a policy offered a pinned block"
            victim.moving = True
            victim.request.num_moving_blocks += 1
            if i < num_host:
                moves.append(Move(victim, MoveKind.DEMOTE, TierKind.DEVICE, victim.page,
                                  TierKind.HOST, self.host.take(victim), reassign))
            else:
                moves.append(Move(victim, MoveKind.DROP, TierKind.DEVICE, victim.page,
                                  TierKind.NONE, -1, reassign))
        return moves

    def _make_room(self, num: int, cause: Request | None, reason: Reason,
                   protected: Collection[Block] = ()) -> tuple[list[int], list[Move]]:
        """Claim num device pages: free ones first (the reserve only up to the tenant's fair
        share), then victims' pages (which their incoming blocks may use once the demotions
        are copied)."""
        free = self.device.num_free
        if self.policy.fair and cause is not None:
            # The reserve is for growth up to one's fair share, not beyond it.
            spare = max(0, free - self.reserve_pages)
            headroom = max(0, self.tenancy.headroom(cause.tenant))
            free = spare + min(free - spare, headroom)
        short = num - free
        try:
            demotions = (self._evict(short, cause, reason, True, protected) if short > 0
                         else [])
        except HostShort as exc:
            raise HostShort(str(exc), free + exc.possible) from None
        pages = [self.device.take(None) for _ in range(num - len(demotions))]
        pages.extend(m.src_page for m in demotions)
        return pages, demotions

    # ------------------------------------------------------------------ engine operations

    @_after_reads
    def allocate(self, request_id: str, num_blocks: int,
                 intent: dict[str, Any] | None = None,
                 indices: Sequence[int] | None = None, holder: str = "",
                 reason: Reason = Reason.ALLOCATE) -> TransferPlan:
        """New blocks at the end of the request, each in a device page, with the intent the
        engine already knows (a pin in it is refused, like any pin, if it would overcommit).
        `indices` (increasing, past the last block) places them with gaps, as a handoff
        keeps the block indices of the pool it came from (its reason: Reason.HANDOFF)."""
        if num_blocks <= 0:
            raise InvalidArgument(f"num_blocks must be positive, got {num_blocks}")
        req = self._admitted(request_id)
        if indices is None:
            indices = range(len(req.blocks), len(req.blocks) + num_blocks)
        elif (len(indices) != num_blocks or (indices and indices[0] < len(req.blocks))
              or any(b <= a for a, b in zip(indices, indices[1:]))):
            raise InvalidArgument("indices must be increasing and past the request's blocks")
        if intent:
            intents.validate(intent)
            if intents.pinned_after(Block(req, -1, TierKind.NONE, -1), intent):
                if self.num_pinned + num_blocks > self.device.capacity:
                    raise self._overpinned(num_blocks)
        if num_blocks > self.device.capacity:
            raise InvalidArgument(
                f"cannot allocate {num_blocks} blocks at once: the device tier of pool "
                f"{self.name!r} holds {self.device.capacity} pages"
            )
        # Live blocks, not indices: a request that frees old blocks and allocates new ones
        # (a sliding window) stays within what it reserved.
        growth = max(0, req.num_live_blocks + num_blocks - req.reserved_pages)
        self._check_quota_growth(req, num_blocks, growth)
        if growth and not self._fits(growth):
            raise ResourceExhausted(
                f"request {request_id!r} grows past its {req.reserved_pages} reserved pages and "
                f"pool {self.name!r} has {self.capacity_pages - self.reserved_pages} unreserved"
            )
        pages, demotions = self._make_room(num_blocks, req, reason)
        now = self.clock.now()
        plan = TransferPlan(self.name, reason, req, demotions=demotions)
        for page, index in zip(pages, indices):
            while len(req.blocks) < index:
                req.blocks.append(None)
            block = Block(req, index, TierKind.DEVICE, page, moving=True,
                          last_access=now, request_priority=req.priority)
            req.num_moving_blocks += 1
            if intent:
                intents.apply(block, intent, now)
                self._count_pin(block, 1)
            self.device.owner[page] = block
            req.blocks.append(block)
            req.num_live_blocks += 1
            if holder:  # the engine writes it next: nothing may take its page before
                self._hold(holder, block)
            self._device_delta(req, 1)
            plan.allocated.append(block)
        req.reserved_pages += growth
        self.reserved_pages += growth
        if growth:
            self.tenancy.reserved_by_tenant[req.tenant] += growth
            self.tenancy.demand_changed()
        self._note_peak()
        return plan

    def _check_quota_growth(self, req: Request, num_blocks: int, growth: int) -> None:
        """Quotas hold on every page added after admission too: the request's cap on its
        live blocks, the tenant's limit on the pages reserved for all its requests."""
        quota = self.tenancy.quota(req.tenant)
        cap = quota.request_cap(self.device.capacity)
        if cap is not None and req.num_live_blocks + num_blocks > cap:
            raise ResourceExhausted(
                f"request {_short(req.request_id)} holds {req.num_live_blocks} pages and asks "
                f"for {num_blocks} more: over tenant {req.tenant!r}'s per-request cap of "
                f"{cap} pages in pool {self.name!r}")
        if growth and self.tenancy.over_limit(req.tenant, growth):
            raise ResourceExhausted(
                f"tenant {req.tenant!r} is at its limit of {quota.limit} pages in pool "
                f"{self.name!r} ({self.tenancy.reserved_by_tenant[req.tenant]} reserved); "
                f"request {_short(req.request_id)} asks for {growth} more")

    @_after_reads
    def access(self, request_id: str, indices: Sequence[int] | None,
               holder: str = "") -> AccessResult:
        """The engine reads these blocks now (None: all of them). Resident blocks are touched;
        the rest are promoted by the returned plan. With a holder, the blocks are held for it
        (see hold()) from now on."""
        req = self.requests.get(request_id)
        if req is None or req.state is not RequestState.ADMITTED:
            req = self._admitted(request_id)  # raises the right error
        if (indices is None and req.num_moving_blocks == 0
                and req.num_device_blocks == req.num_live_blocks):
            # The hot path: attention reads a resident request.
            self._record_reads(((req, self.clock.now(), None, 1),))
            if holder:
                for b in req.blocks:
                    if b is not None:
                        self._hold(holder, b)
            return AccessResult(None, None, req)
        blocks = self._resolve(req, indices)
        busy = [b for b in blocks if b.moving]
        if busy:
            raise BlocksInTransit(busy)
        missing = [b for b in blocks if b.tier is not TierKind.DEVICE]
        plan = None
        if missing:
            try:
                plan = self._promote(req, missing, blocks, Reason.ACCESS)
            except HostShort as short:
                if short.possible <= 0:
                    raise
                # Swap in rounds: bring in what the host tier has room to swap out now;
                # the caller executes it and accesses again (the blocks brought in are then
                # resident and protected). Reads are counted once, in the last round.
                missing = missing[:short.possible]
                plan = self._promote(req, missing, blocks, Reason.ACCESS)
                self.counters.num_misses += len(missing)
                self.counters.num_decode_critical_misses += sum(b.decode_critical
                                                                for b in missing)
                return AccessResult(blocks, plan, req, partial=True)
        now = self.clock.now()
        counters = self.counters
        policy = self.policy
        for b in blocks:
            b.reuse_s = now - b.last_access
            b.last_access = now
            if b.decode_critical:
                counters.num_decode_critical_accesses += 1
                if b.moving:
                    counters.num_decode_critical_misses += 1
            if not b.moving and not b.pinned and not b.held:
                policy.touch(b)
        counters.num_accesses += len(blocks)
        counters.num_misses += len(missing)
        self._note_reads(req, len(blocks), now)
        if holder:
            # Only once the access succeeded (an access waiting for room holds nothing, so
            # waiters cannot hold each other up). The promoted blocks are not offered to the
            # policy when their copy lands.
            for b in blocks:
                self._hold(holder, b)
        return AccessResult(blocks, plan, req)

    def read_all(self, request_ids: Sequence[str], tenant: str | None = None,
                 key: bytes | None = None) -> tuple[list[str], list[Request]]:
        """The engine step's hot path: every block of each request is read now. Requests whose
        blocks are all resident are answered here from a few per-request counters; the rest
        are returned for the general path (access), as are requests whose blocks moved since
        the engine was told, and requests of other tenants than `tenant` (None: any), where
        they get their error.

        Recording the reads (recency for the policy, read metering, counters) is per block and
        nothing in the reply depends on it, so it is left to apply_reads(): soon, through
        `defer` (the runtime runs it a little after the reply has gone, with the reads of
        the steps that came meanwhile), and in any case before any other pool method, so
        every decision sees the reads in the order they came.

        `key`, when given, stands for request_ids in telling a repeated read: bytes that are
        equal only for equal lists (the Step message without its id); else the ids are
        joined."""
        general, relocated, first = self.reads.answer(request_ids, tenant, key)
        if first:
            if self.defer is None:
                self.apply_reads()
            else:
                self.defer(self.apply_reads)
        return general, relocated

    def apply_reads(self) -> None:
        """Record the reads read_all() answered (a no-op when there are none). Only a read
        budget is charged late: at the last read rather than each (the refill of that moment
        is lost, never gained)."""
        reads = self.reads.take()
        if reads:
            self._record_reads(reads)

    def _record_reads(self, reads) -> None:
        """Every block of each request (all of them resident) was read `count` times, last at
        `now` and before that at `before` (None: once): recency, the policy's order, and read
        metering. `reads` is (request, now, before, count) in the order of the last reads."""
        tracks_reuse = self.policy.tracks_reuse
        num_critical = num_blocks = 0
        for req, now, before, count in reads:
            critical = 0
            for b in req.blocks:
                if b is not None:
                    if tracks_reuse:
                        b.reuse_s = now - (b.last_access if before is None else before)
                    b.last_access = now
                    if b.decode_critical:
                        critical += 1
            num_critical += critical * count
            num_read = req.num_live_blocks * count
            num_blocks += num_read
            self._note_reads(req, num_read, now)
        if self.policy.eager_touch:
            touch_many = self.policy.touch_many
            for read in reads:
                touch_many(read[0].blocks)
        self.counters.num_decode_critical_accesses += num_critical
        self.counters.num_accesses += num_blocks

    def _note_reads(self, req: Request, num_blocks: int, now: float) -> None:
        """Attention read num_blocks of the request: meter them (and spend its read budget)."""
        req.blocks_read += num_blocks
        self.tenancy.blocks_read_by_tenant[req.tenant] += num_blocks
        if req.read_bucket is not None:
            req.read_bucket.consume(num_blocks * self.page_bytes, now)

    # ------------------------------------------------------------------ holds

    def _hold(self, holder: str, block: Block) -> None:
        """The engine was handed this block's page and may write or read it until its next
        call: until then the block is not evictable, so no eviction can move its bytes
        before the engine wrote them or give its page to another block under the engine's
        feet. Held blocks leave the policy (as pinned ones do) but count as no pin."""
        if block.held:
            return
        block.held = True
        if block in self.policy:
            self.policy.remove(block)
        entry = self._holds.get(holder)
        if entry is None:
            entry = self._holds[holder] = (self.clock.now(), [])
        entry[1].append(block)
        self.num_held += 1

    def hold(self, holder: str, blocks: Iterable[Block]) -> None:
        """Hold blocks handed out by a reply other than allocate's or access's (a handoff's
        last message) for the holder, until its next call."""
        for b in blocks:
            if b.tier is TierKind.DEVICE and not b.moving:
                self._hold(holder, b)

    def holds(self, holder: str) -> bool:
        """Whether the holder has blocks held here."""
        return holder in self._holds

    def holders(self) -> dict[str, float]:
        """Each holder with blocks held, and since when."""
        return {h: since for h, (since, _) in self._holds.items()}

    @_after_reads
    def end_holds(self, holder: str) -> list[Request]:
        """The holder called again (or went away): what it was handed is evictable again.
        Returns queued requests admitted now that those pages may be taken."""
        entry = self._holds.pop(holder, None)
        if entry is None:
            return []
        for b in entry[1]:
            if not b.held:
                continue
            b.held = False
            self.num_held -= 1
            req = b.request
            if (self.requests.get(req.request_id) is req and req.blocks[b.index] is b
                    and _evictable(b)):
                self.policy.insert(b)
        return self._admit_from_queue() if self.queue else []

    def _promote(
        self, req: Request | None, missing: list[Block], keep: Iterable[Block], reason: Reason
    ) -> TransferPlan:
        """A plan bringing `missing` to the device tier without evicting any of `keep`."""
        protected = {b for b in keep if b.tier is TierKind.DEVICE}
        pages, demotions = self._make_room(len(missing), req, reason, protected)
        plan = TransferPlan(self.name, reason, req, demotions=demotions)
        for block, page in zip(missing, pages):
            self.device.owner[page] = block
            block.moving = True
            block.request.num_moving_blocks += 1
            kind = MoveKind.PROMOTE if block.tier is TierKind.HOST else MoveKind.REMATERIALIZE
            plan.promotions.append(
                Move(block, kind, block.tier, block.page, TierKind.DEVICE, page, False)
            )
        return plan

    @_after_reads
    def check_intents(self, changes: Sequence[IntentChange], final: dict) -> None:
        """Validate a slice of a batch without changing anything, adding each block's
        pin-deciding state as the batch leaves it to `final`; check_pins(final) after the
        last slice checks the batch's pins."""
        self._resolve_intents(changes, final)

    def check_pins(self, final: dict) -> None:
        """A batch whose blocks end in these states must not pin more than the device."""
        pin_delta = sum(intents.pinned_after(b, state) - b.pinned for b, state in final.items())
        if pin_delta > 0 and self.num_pinned + pin_delta > self.device.capacity:
            raise self._overpinned(pin_delta)

    def _resolve_intents(self, changes: Sequence[IntentChange], final: dict) -> list:
        # Each block's pin-deciding fields as the batch leaves them: a block named twice
        # counts once, in its final state (an unpin repeated is one unpin).
        resolved = []
        for change in changes:
            req = self._admitted(change.request_id)
            (block,) = self._resolve(req, [change.block_index])
            intents.validate(change.fields)
            state = final.setdefault(block, {})
            for name in intents.PIN_FIELDS:
                if name in change.fields:
                    state[name] = change.fields[name]
            resolved.append((block, change))
        return resolved

    def update_intents(self, changes: Sequence[IntentChange]) -> TransferPlan | None:
        """Apply a batch of intent updates (all or none) and return a prefetch plan for blocks
        that asked for one or became pinned outside the device tier (None if nothing to do)."""
        final: dict[Block, dict[str, Any]] = {}
        resolved = self._resolve_intents(changes, final)
        self.check_pins(final)
        now = self.clock.now()
        to_prefetch: list[Block] = []
        for block, change in resolved:
            was_pinned = block.pinned
            intents.apply(block, change.fields, now)
            resident = (block.tier is TierKind.DEVICE and not block.moving
                        and not block.held)
            if block.pinned != was_pinned:
                delta = 1 if block.pinned else -1
                self.num_pinned += delta
                self.tenancy.pinned_by_tenant[block.request.tenant] += delta
                if resident:
                    (self.policy.remove if block.pinned else self.policy.insert)(block)
            elif resident and not block.pinned:
                self.policy.reorder(block)
            wants = change.prefetch or (block.pinned and not was_pinned)
            if (wants and self.policy.uses_intent and block.tier is not TierKind.DEVICE
                    and not block.moving):
                if block not in to_prefetch:
                    to_prefetch.append(block)
        return self.prefetch(to_prefetch)

    @_after_reads
    def prefetch(self, blocks: list[Block]) -> TransferPlan | None:
        """Promote what fits of `blocks` ahead of their access; a hint, so no room is no error."""
        blocks = [b for b in blocks if b.tier is not TierKind.DEVICE and not b.moving]
        room = self.device.num_free + len(self.policy)
        # Pinned blocks first: a decode step is waiting on them.
        blocks.sort(key=lambda b: not b.pinned)
        blocks = blocks[:room]
        while blocks:
            try:
                plan = self._promote(None, blocks, (), Reason.PREFETCH)
            except (ResourceExhausted, BlocksInTransit):  # fewer, or none until copies land
                blocks = blocks[: len(blocks) // 2]
                continue
            self.counters.num_prefetches += len(blocks)
            return plan
        return None

    @_after_reads
    def free(self, request_id: str, indices: Sequence[int]) -> int:
        """Give back some blocks of a request; their indices stay unused."""
        req = self._admitted(request_id)
        blocks = self._resolve(req, indices)
        busy = [b for b in blocks if b.moving]
        if busy:
            raise BlocksInTransit(busy)
        for b in blocks:
            self._discard(b)
        return len(blocks)

    @_after_reads
    def release(self, request_id: str) -> tuple[int, list[Request]]:
        """Give back a whole request (queued or admitted). Returns the number of blocks freed
        and the queued requests admitted because of it."""
        req = self.get_request(request_id)
        if req.state is RequestState.QUEUED:
            self.attribution.close(request_id)
            del self.queue[request_id]
            del self.requests[request_id]
            self.tenancy.queued_by_tenant[req.tenant] -= req.projected_pages
            self.tenancy.waiting_by_tenant[req.tenant] -= 1
            self.tenancy.demand_changed()
            return 0, self._admit_from_queue()
        live = req.live_blocks()
        busy = [b for b in live if b.moving]
        if busy:
            raise BlocksInTransit(busy)
        for b in live:
            self._discard(b)
        self.attribution.close(request_id)
        self.reserved_pages -= req.reserved_pages
        self.tenancy.reserved_by_tenant[req.tenant] -= req.reserved_pages
        req.reserved_pages = 0
        del self.requests[request_id]
        self.tenancy.demand_changed()
        return len(live), self._admit_from_queue()

    def _discard(self, block: Block) -> None:
        req = block.request
        if block.held:  # its holder's entry forgets it at end_holds
            block.held = False
            self.num_held -= 1
        if block.tier is TierKind.DEVICE:
            if block in self.policy:
                self.policy.remove(block)
            self.device.release(block.page)
            self._device_delta(req, -1)
        elif block.tier is TierKind.HOST:
            self.host.release(block.page)
        self._count_pin(block, -1)
        req.blocks[block.index] = None
        req.num_live_blocks -= 1
        block.tier, block.page = TierKind.NONE, -1

    def _overpinned(self, more: int) -> ResourceExhausted:
        return ResourceExhausted(
            f"pinning {more} more block(s) would exceed the device tier of pool "
            f"{self.name!r}: {self.num_pinned} of {self.device.capacity} pages already pinned "
            f"(by tenant: "
            f"{', '.join(f'{t}: {n}' for t, n in self.tenancy.pinned_by_tenant.most_common(5))})"
        )

    @_after_reads
    def note_late(self, blocks: Iterable[Block]) -> None:
        """An access had to wait for these blocks' promotion (already under way): misses."""
        for b in blocks:
            self.counters.num_misses += 1
            if b.decode_critical:
                self.counters.num_decode_critical_misses += 1

    def num_moving_blocks(self) -> int:
        return sum(r.num_moving_blocks for r in self.requests.values())

    def _count_pin(self, block: Block, delta: int) -> None:
        if block.pinned:
            self.num_pinned += delta
            self.tenancy.pinned_by_tenant[block.request.tenant] += delta

    @_after_reads
    def evict(self, num_pages: int) -> TransferPlan:
        """Demote num_pages victims now (the engine asked for room): all or none."""
        if num_pages <= 0:
            raise InvalidArgument(f"num_pages must be positive, got {num_pages}")
        if num_pages > len(self.policy):
            raise self._no_room(num_pages)
        return TransferPlan(
            self.name, Reason.EVICT, None,
            demotions=self._evict(num_pages, None, Reason.EVICT, False)
        )

    @_after_reads
    def set_policy(self, name: str) -> str:
        """Switch the eviction policy at run time; the evictable blocks carry over."""
        new = make_policy(name, self.clock, self.tenancy)
        old = self.policy
        for block in self._evictable_blocks():
            new.insert(block)
        self.policy = new
        self.tenancy.set_share_capacity(self._share_capacity())
        return old.name

    def _evictable_blocks(self) -> list[Block]:
        # Oldest access first, so order-based policies start from a sensible order.
        blocks = [
            b for b in self.device.owner
            if b is not None and _evictable(b)
        ]
        blocks.sort(key=lambda b: b.last_access)
        return blocks

    # ------------------------------------------------------------------ disaggregation

    def reservation_state(self, tenant: str, projected: int, tokens: int
                          ) -> tuple[Verdict, str]:
        """Whether a handoff reservation of `projected` pages could be made here, and if
        not why."""
        never = self._never_fits(tenant, projected, tokens)
        if never:
            return Verdict.NEVER, f"handoff pool {self.name!r}: {never}"
        if self.tenancy.over_limit(tenant, projected):
            return Verdict.WAIT, (
                f"handoff pool {self.name!r}: tenant {tenant!r} has "
                f"{self.tenancy.reserved_by_tenant[tenant]} of its "
                f"{self.tenancy.quota(tenant).limit}-page limit reserved")
        if not self._fits(projected):
            return Verdict.WAIT, (
                f"handoff pool {self.name!r} cannot reserve {projected} pages: "
                f"{self.capacity_pages - self.reserved_pages} of {self.capacity_pages} are "
                "unreserved")
        return Verdict.OK, ""

    @_after_reads
    def reserve(self, request_id: str, tenant: str, *, prompt_tokens: int, output_tokens: int,
                priority: int, ttl_s: float) -> Request:
        """Hold the pages a request handed off from another pool will need (prompt plus
        output): it holds no blocks until Handoff claims it, and lapses after ttl_s."""
        if request_id in self.requests:
            raise AlreadyExists(f"request {request_id!r} already exists in pool {self.name!r}")
        projected = self.projected_pages(prompt_tokens, output_tokens)
        state, why = self.reservation_state(tenant, projected, prompt_tokens + output_tokens)
        if state is not Verdict.OK:
            raise ResourceExhausted(why)
        now = self.clock.now()
        req = Request(request_id, tenant, self.name, priority, projected, RequestState.RESERVED,
                      queued_at=now, reserved_pages=projected, expires_at=now + ttl_s,
                      prompt_tokens=prompt_tokens, output_tokens=output_tokens)
        req.account = self.attribution.open(request_id, tenant)
        budget(req, self.tenancy.quota(req.tenant), self.page_bytes, now)
        self.requests[request_id] = req
        self._reservations[request_id] = req
        self.reserved_pages += projected
        self.tenancy.reserved_by_tenant[tenant] += projected
        self.tenancy.demand_changed()
        return req

    @_after_reads
    def claim(self, request_id: str) -> Request:
        """A reservation becomes an admitted request (its handoff is starting)."""
        req = self.get_request(request_id)
        if req.state is not RequestState.RESERVED:
            raise FailedPrecondition(f"request {request_id!r} holds no reservation in pool "
                                     f"{self.name!r}")
        req.state = RequestState.ADMITTED
        req.admitted_at = self.clock.now()
        self.counters.num_admitted += 1
        self._reservations.pop(request_id, None)
        return req

    def _live_reservations(self) -> list[Request]:
        """The requests reserve() made and nobody claimed or released yet (the rest are
        pruned here: the expirer asks every second, and a scan of every request would cost
        O(requests) each time)."""
        live = []
        for rid, req in list(self._reservations.items()):
            if req.state is not RequestState.RESERVED or self.requests.get(rid) is not req:
                del self._reservations[rid]
            else:
                live.append(req)
        return live

    def expired_reservations(self) -> list[str]:
        now = self.clock.now()
        return [r.request_id for r in self._live_reservations() if r.expires_at <= now]

    def handoff_reserved_pages(self) -> int:
        """Pages held for requests not yet handed off to this pool."""
        return sum(r.reserved_pages for r in self._live_reservations())

    @_after_reads
    def begin_handoff(self, request_id: str) -> list[Block]:
        """Hold a request's blocks still while they are copied to another pool: none may be
        evicted, freed or moved until end_handoff."""
        req = self._admitted(request_id)
        live = req.live_blocks()
        busy = [b for b in live if b.moving]
        if busy:
            raise BlocksInTransit(busy)
        dropped = [b.index for b in live if b.tier is TierKind.NONE]
        if dropped:
            raise FailedPrecondition(
                f"blocks {dropped[:8]} of request {request_id!r} were dropped for the engine "
                "to recompute; access them (and recompute) before the handoff")
        for b in live:
            if b in self.policy:
                self.policy.remove(b)
            b.moving = True
            req.num_moving_blocks += 1
        return live

    @_after_reads
    def end_handoff(self, blocks: list[Block]) -> None:
        """The copy is over (done or abandoned): the blocks are as they were."""
        for b in blocks:
            b.moving = False
            b.request.num_moving_blocks -= 1
            if _evictable(b):
                self.policy.insert(b)

    # ------------------------------------------------------------------ transfers

    @_after_reads
    def complete(self, plan: TransferPlan) -> list[Block]:
        """The plan's bytes are copied: make the page table say so. Returns blocks pinned while
        they were being demoted, which now want a prefetch."""
        now = self.clock.now()
        c = self.counters
        if plan.demotions:
            self._record_evictions(plan, now)
        for m in plan.demotions:
            b = m.block
            b.moving = False
            b.request.num_moving_blocks -= 1
            b.epoch += 1
            self._device_delta(b.request, -1)
            if not m.src_reassigned:
                self.device.release(m.src_page)
            if m.kind is MoveKind.DROP:
                b.tier, b.page = TierKind.NONE, -1
                c.num_drops += 1
            else:
                b.tier, b.page = TierKind.HOST, m.dst_page
                c.num_demotions += 1
                c.bytes_moved += self.page_bytes
        for m in plan.promotions:
            b = m.block
            b.moving = False
            b.request.num_moving_blocks -= 1
            b.epoch += 1
            self._device_delta(b.request, 1)
            if m.kind is MoveKind.PROMOTE:
                self.host.release(m.src_page)
                c.num_promotions += 1
                c.bytes_moved += self.page_bytes
            else:
                # Its bytes were dropped: the page was zeroed (runtime), and every reply that
                # hands it out says the engine must recompute it until the engine was told.
                c.num_rematerializations += 1
                c.num_lost_blocks += 1
                b.lost = True
                if b.request.account is not None:
                    b.request.account.num_recomputes += 1
            b.tier, b.page = TierKind.DEVICE, m.dst_page
            b.request.maybe_relocated = True
            if plan.reason is Reason.ACCESS and b.deadline_at is not None and now > b.deadline_at:
                c.num_deadline_misses += 1
            self.policy.on_promoted(b)
            if _evictable(b):
                self.policy.insert(b)
        for b in plan.allocated:
            b.moving = False
            b.request.num_moving_blocks -= 1
            if _evictable(b):
                self.policy.insert(b)
        self._note_peak()
        return [m.block for m in plan.demotions if m.block.pinned]

    @_after_reads
    def abort(self, plan: TransferPlan) -> None:
        """The copy failed or was cancelled: put everything back as it was before the plan."""
        victim_pages = {m.src_page for m in plan.demotions}
        for m in plan.promotions:
            if m.dst_page not in victim_pages:
                self.device.release(m.dst_page)
            m.block.moving = False
            m.block.request.num_moving_blocks -= 1
        for b in plan.allocated:
            if b.page not in victim_pages:
                self.device.release(b.page)
            self._count_pin(b, -1)
            if b.held:
                b.held = False
                self.num_held -= 1
            req = b.request
            req.num_moving_blocks -= 1
            req.blocks[b.index] = None
            req.num_live_blocks -= 1
            self._device_delta(req, -1)
            b.tier, b.page = TierKind.NONE, -1
        for req in {id(b.request): b.request for b in plan.allocated}.values():
            while req.blocks and req.blocks[-1] is None:  # indices nobody was told of
                req.blocks.pop()
        for m in plan.demotions:
            b = m.block
            b.moving = False
            b.request.num_moving_blocks -= 1
            self.device.owner[m.src_page] = b
            if m.dst_tier is TierKind.HOST:
                self.host.release(m.dst_page)
            if _evictable(b):  # it may have been pinned while in flight
                self.policy.insert(b)

    def _record_evictions(self, plan: TransferPlan, now: float) -> None:
        cause = plan.cause
        evictor_request = cause.request_id if cause else NO_REQUEST
        evictor_tenant = cause.tenant if cause else NO_REQUEST
        policy = self.policy.name
        for m in plan.demotions:
            b = m.block
            record = EvictionRecord(now, self.name, b.request.request_id, b.request.tenant,
                                    b.index, evictor_request, evictor_tenant, plan.reason, policy)
            b.evicted_by = record
            self.attribution.evicted(record)
        self.counters.num_evictions += len(plan.demotions)
        self.counters.evictions_by_reason[plan.reason] += len(plan.demotions)

    def record_stall(self, seconds: float, plan: TransferPlan | None = None) -> None:
        """An access waited `seconds` for `plan`'s promotions: charge it to the evictions
        that had put those blocks out."""
        self.counters.stall_seconds_total += seconds
        if plan is not None and plan.cause is not None and plan.promotions:
            self.attribution.stalled(plan.cause.request_id,
                                     [m.block.evicted_by for m in plan.promotions], seconds)

    def _note_peak(self) -> None:
        used = self.device.num_used
        if used > self.counters.peak_device_pages:
            self.counters.peak_device_pages = used


def _evictable(b: Block) -> bool:
    """Whether a block belongs in the policy: resident, still, unpinned, not held."""
    return (b.tier is TierKind.DEVICE and not b.moving and not b.pinned and not b.held)


def _short(text: str, limit: int = 64) -> str:
    """A repr of text for an error message, at most about `limit` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"
