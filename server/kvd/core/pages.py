"""Page tables and residency (DESIGN.md, "What kvd decides": which block leaves the device):
a pool's two tiers, which block owns which page, and the moves between tiers.

A block is in the device tier, the host tier, or nowhere (dropped for the engine to
recompute). Moving it is planned here (a TransferPlan of Moves), copied by the runtime, and
then made true by settle.complete() or undone by settle.abort(). Which block leaves is the policy's
decision (policies/); the page table asks it with the blocks the operation is about to read
protected, and takes the victims only once nothing else can fail.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from kvd.core import intent as intents
from kvd.core.attribution import Attribution
from kvd.core.blocks import (Block, Changes, Request, TierKind, evictable, key_hash,
                              pin_room_tenants, pin_tenant)
from kvd.core.clock import Clock
from kvd.core.counters import PoolCounters
from kvd.core.errors import (BlocksInTransit, HostShort, InvalidArgument, NoVictims,
                             ResourceExhausted, short_repr)
from kvd.core.holds import SWAP_HOLDER, Holds
from kvd.core.idle import IdleKept
from kvd.core.policies import EvictionPolicy, make_policy
from kvd.core.tenancy import Tenancy, tally
from kvd.core.tier import TierPages
from kvd.core.transfer import Move, MoveKind, Reason, TransferPlan


# The highest block index placed at an index of its own (a handoff keeps the indices of the
# pool it came from, gaps included). A request's blocks are a list by index, holes and all:
# a peer's Receive naming block 49,609,919 of a one-block request held kvd's loop 18 s and
# 400 MB. 2**20 blocks are 16M tokens at 16 a block.
MAX_BLOCK_INDEX = (1 << 20) - 1


class PageTable:
    """One pool's pages: the tiers, the policy over the evictable device blocks, pins and
    holds, and the transfer plans that move blocks between tiers."""

    def __init__(self, name: str, *, page_bytes: int, device_pages: int, host_pages: int,
                 policy: str, clock: Clock, tenancy: Tenancy, counters: PoolCounters,
                 attribution: Attribution, requests: Mapping[str, Request],
                 reserve_pages: int) -> None:
        self.name = name
        self.page_bytes = page_bytes
        self.clock = clock
        self.tenancy = tenancy
        self.counters = counters
        self.attribution = attribution
        self.requests = requests  # read only
        self.device = TierPages(TierKind.DEVICE, device_pages)
        self.host = TierPages(TierKind.HOST, host_pages)
        # Kept prefix blocks nobody uses: the first victims (see idle.py).
        self.idle = IdleKept()
        self.policy: EvictionPolicy = make_policy(policy, clock, tenancy)
        # Free device pages kept for tenants below their fair share (a watermark): under a fair
        # policy, a tenant at or above its share evicts its own pages instead of spending them,
        # and refill() tops them up from over-share tenants in the background.
        self.reserve_pages = reserve_pages
        self.num_pinned = 0
        # A kept page (see Holds.keep) goes back to the free list once let go of.
        self.holds = Holds(clock, requests, self.policy, self.device.release)
        # Shared prefix blocks by (namespace, key): see prefix.py.
        self.named: dict[tuple[str, bytes], Block] = {}
        # The same blocks by the hash engines publish for their keys (key_hash), which two
        # namespaces' keys may share: what attributes an engine's blocks (kvd.kv_events).
        self.by_hash: dict[int, list[Block]] = {}
        # Names whose block may have been committed, changed tier or gone since a follower of
        # what kvd keeps last looked (kvd.tier_events); None while nobody follows. A follower
        # looks at these, not at every kept block (hundreds of thousands on a large host
        # tier) each time it publishes.
        self.named_changed: set[tuple[str, bytes]] | None = None
        # Every request with blocks in transit, and some that had them (moving_requests()
        # sheds those): what is in transit is looked for among these, not among every
        # request (with thousands running, a walk of them all each time a call waits for
        # room, and four times a second for stuck transfers).
        self._moving: set[Request] = set()
        # Called before the policy chooses (or host blocks are picked by recency): records
        # the reads the pool's hot path left pending (see reads.changes_blocks).
        self.before_choice: Callable[[], None] = _nothing
        # Bumped whenever a block already placed starts to move (demoted, dropped, promoted,
        # handed off): a request whose blocks were all resident and still may not be since.
        # (A new block starts moving too, but its request is noted in `changes` instead.)
        self.moves = 0
        self.changes = Changes()
        # The request of the read swapping in rounds, whose blocks SWAP_HOLDER holds for it
        # between them (see PoolRuntime.access): its own holds are no room it may wait for.
        self.swapping: Request | None = None

    # ------------------------------------------------------------------ queries

    @property
    def tiers_pages(self) -> int:
        """Both tiers, less the transit headroom: the most admission reserves under any
        policy."""
        return self.device.capacity + self.host.capacity - self.transit_headroom

    @property
    def capacity_pages(self) -> int:
        """Pages admission may reserve: tiers_pages, and under a fair policy with a host tier
        less the device's free reserve too. The headroom is counted beside the reserve, not
        in it: a tenant at its share may not spend the reserve, so its reads swap in through
        free host pages alone (with the host full of what admission let in and the spare
        page left in the reserve, every read that must swap would be refused)."""
        if not self.host.capacity:
            return self.device.capacity
        return self.tiers_pages - (self.device.capacity - self.share_capacity)

    @property
    def transit_headroom(self) -> int:
        """Host pages admission leaves unreserved. A promotion holds its host page until its
        copy completes, so swapping a block in while another goes out needs a spare host page;
        without one the victim would have to be dropped."""
        return min(self.host.capacity, max(1, self.device.capacity // 8))

    @property
    def share_capacity(self) -> int:
        """The device pages fair shares divide: under a fair policy the free reserve is
        nobody's share, it is the buffer that lets tenants below their share grow without
        waiting for a demotion."""
        return self.device.capacity - (self.reserve_pages if self.policy.fair else 0)

    def tier(self, kind: TierKind) -> TierPages:
        """The pages of one tier."""
        return self.device if kind is TierKind.DEVICE else self.host

    def num_moving_blocks(self) -> int:
        """Blocks in transit between tiers in this pool."""
        return sum(r.num_moving_blocks for r in self.moving_requests())

    def start_moving(self, block: Block) -> None:
        """The block starts to move between tiers: marked, counted in its request, and its
        request noted among those moving_requests() looks at."""
        block.moving = True
        block.request.num_moving_blocks += 1
        self._moving.add(block.request)

    def moving_requests(self) -> set[Request]:
        """The pool's requests with blocks in transit (those without are shed here)."""
        moving, requests = self._moving, self.requests
        done = [r for r in moving
                if not r.num_moving_blocks or requests.get(r.request_id) is not r]
        moving.difference_update(done)
        return moving

    def noted_moving(self, req: Request) -> bool:
        """Whether req is among those moving_requests() looks at (the self-check's)."""
        return req in self._moving

    def no_room(self, needed: int) -> ResourceExhausted:
        """The error for `num_pages` that no eviction can free (all pinned, held or moving)."""
        pinned = self.tenancy.pinned_by_tenant.most_common(5)
        held = ", ".join(f"{t}: {n}" for t, n in pinned) or "none"
        return ResourceExhausted(
            f"pool {self.name!r}: cannot free {needed} device page(s): "
            f"{self.device.num_free} free, {len(self.policy)} evictable, "
            f"{self.num_pinned} of {self.device.capacity} pinned (by tenant: {held}), "
            f"{self.holds.count} held by engines until their next call"
            + (f", {len(self.holds.kept)} of released requests kept until their engines' "
               "next calls" if self.holds.kept else "")
            + ", the rest in transit"
        )

    def kept_by_fairness(self, needed: int, tenant: str) -> ResourceExhausted:
        """The error for `needed` victims a fair policy will not take for `tenant` although as
        many are evictable: the others' are within their fair shares or guarantees, and the
        tenant's own are too few."""
        tenancy = self.tenancy
        holding = [t for t in sorted(tenancy.usages()) if t != tenant and tenancy.usage(t) > 0]
        others = "; ".join(f"{short_repr(t)} holds {tenancy.usage(t):g}, may keep "
                           f"{max(tenancy.fair_share(t), tenancy.guaranteed(t)):g}"
                           for t in holding[:5])
        return ResourceExhausted(
            f"pool {self.name!r}: cannot free {needed} device page(s) for tenant "
            f"{short_repr(tenant)}: {len(self.policy)} evictable, but under the fair policy "
            "another tenant gives up pages only down to its fair share or guarantee "
            f"({others or 'no other tenant holds any'}), and {short_repr(tenant)} holds "
            f"{tenancy.usage(tenant):g} of its own, its share "
            f"{tenancy.fair_share(tenant):g}; ask for fewer pages at once, or give the tenant "
            "more weight or a guarantee")

    def unevictable(self, needed: int) -> ResourceExhausted:
        """The error for `needed` victims the policy cannot give although as many are
        evictable: a fair policy keeps what each tenant is guaranteed."""
        kept = ", ".join(
            f"{t}: {self.tenancy.usage(t):g} of {self.tenancy.guaranteed(t):g} guaranteed"
            for t in sorted(self.tenancy.usages()) if self.tenancy.guaranteed(t) > 0)
        return ResourceExhausted(
            f"pool {self.name!r}: cannot evict {needed} device page(s) now: "
            f"{len(self.policy)} evictable, but the policy keeps each tenant's pages within "
            f"its guarantee (device pages: {kept or 'none guaranteed'}); "
            f"{self.holds.count} held by engines until their next call"
        )

    def check_pins(self, more: Mapping[str, int], room: Mapping[str, int] | None = None
                   ) -> None:
        """Refuse pins (`more`: by the tenant they count to; negative: pins that end in the
        same change) that would pin more than the device tier holds, or take a page another
        tenant is guaranteed: every tenant that pins more must have its pins, and every
        other tenant's pins or guarantee (whichever is larger), within the tier. Pinned and
        guaranteed pages then never exceed it (DESIGN.md: a guarantee a pin could take,
        which no eviction gives back, would be no guarantee). The guarantees are checked on
        each tenant's pin room (Tenancy.pin_room_by_tenant); `room`, when given, is what the
        change adds to it, where that is not `more` (a shared block pinned already, which
        the change pins for another tenant too)."""
        total = sum(more.values())
        if total > 0 and self.num_pinned + total > self.device.capacity:
            raise self.overpinned(total)
        room = more if room is None else room  # pin room asked for, by tenant
        added = [t for t, n in room.items() if n > 0]
        if not added or not any(q.guaranteed for q in self.tenancy.quotas.values()):
            return
        capacity = self.device.capacity
        claims = self.tenancy.pin_claims(capacity, room)
        claimed = sum(claims.values())
        for tenant in added:
            pins = self.tenancy.pin_room_by_tenant[tenant] + room[tenant]
            if pins + claimed - claims[tenant] > capacity + 1e-6:
                raise self.guarantee_pinned(tenant, room[tenant], claims)

    def overpinned(self, more: int) -> ResourceExhausted:
        """The error for a pin that would pin more than the device tier holds."""
        pinned = self.tenancy.pinned_by_tenant.most_common(5)
        return ResourceExhausted(
            f"pinning {more} more block(s) would exceed the device tier of pool "
            f"{self.name!r}: {self.num_pinned} of {self.device.capacity} pages already pinned "
            f"(by tenant: {', '.join(f'{t}: {n}' for t, n in pinned)})"
        )

    def guarantee_pinned(self, tenant: str, more: int, claims: Mapping[str, float]
                         ) -> ResourceExhausted:
        """The error for a tenant's pin that would take pages other tenants are guaranteed."""
        others = sorted(((t, c) for t, c in claims.items() if t != tenant and c),
                        key=lambda tc: -tc[1])[:5]
        return ResourceExhausted(
            f"pinning {more} more block(s) of tenant {tenant!r} would take device pages of "
            f"pool {self.name!r} guaranteed to other tenants: it pins "
            f"{self.tenancy.pin_room_by_tenant[tenant]} of {self.device.capacity}, and others "
            f"pin or are guaranteed {sum(c for t, c in claims.items() if t != tenant):g} "
            f"(by tenant: {', '.join(f'{t}: {c:g}' for t, c in others)})"
        )

    # ------------------------------------------------------------------ accounting

    def device_delta(self, block: Block, delta: int) -> None:
        """The block came to (delta 1) or left (-1) the device tier: its request's and its
        tenant's counts follow, and a shared block's cost is split among its payers."""
        req = block.request
        req.num_device_blocks += delta
        tally(self.tenancy.device_by_tenant, req.tenant, delta)
        if req.keeper:
            self.tenancy.kept_changed(req.tenant, delta)
        if block.payers:
            self.tenancy.split(req.tenant, block.payers, delta)
            if not block.users:
                self.idle_changed(block, delta)

    def idle_changed(self, block: Block, sign: int) -> None:
        """A kept block nobody uses came into the device tier (1) or left it (-1), or one
        there lost its last user (1) or found one (-1)."""
        self.tenancy.idle_changed(block.payers, sign)
        if sign > 0:
            self.idle.add(block)
        else:
            self.idle.discard(block)

    def count_pin(self, block: Block, delta: int) -> None:
        """A pinned block comes (delta 1) or goes (-1); an unpinned one counts nothing."""
        if block.pinned:
            self.add_pins(pin_tenant(block), delta, room=False)
            for tenant in pin_room_tenants(block):
                tally(self.tenancy.pin_room_by_tenant, tenant, delta)

    def add_pins(self, tenant: str, delta: int, room: bool = True) -> None:
        """Pins changed by `delta` for a tenant: the pool's and the tenant's counts follow,
        and the tenant's pin room unless `room` is False (see Tenancy.pin_room_by_tenant)."""
        self.num_pinned += delta
        tally(self.tenancy.pinned_by_tenant, tenant, delta)
        if room:
            tally(self.tenancy.pin_room_by_tenant, tenant, delta)

    def note_peak(self) -> None:
        """Keep the high-water mark of device pages in use."""
        used = self.device.num_used
        if used > self.counters.peak_device_pages:
            self.counters.peak_device_pages = used

    def set_policy(self, name: str) -> str:
        """Switch the eviction policy; the evictable blocks carry over, oldest access first
        so order-based policies start from a sensible order."""
        new = make_policy(name, self.clock, self.tenancy)
        blocks = [b for b in self.device.owner if b is not None and evictable(b)]
        blocks.sort(key=lambda b: b.last_access)
        for block in blocks:
            new.insert(block)
        old, self.policy = self.policy, new
        self.holds.policy = new
        return old.name

    # ------------------------------------------------------------------ room in the device tier

    def choose(self, num: int, tenant: str | None, protected: Collection[Block] = (),
               held: Collection[Request] = ()) -> list[Block] | None:
        """num victims, or None: kept blocks nobody uses first, then the policy's order.
        A fair policy orders them itself (see idle.py), and leaves the blocks of `held`
        out (see choose_unheld)."""
        policy = self.policy
        if policy.fair:
            return policy.choose(num, tenant, protected, held)
        if not self.idle:
            return policy.choose(num, tenant, protected)
        idle = self.idle.first(num, policy, protected)
        if len(idle) == num:
            return idle
        rest = policy.choose(num - len(idle), tenant,
                             {*protected, *idle} if idle else protected)
        return None if rest is None else idle + rest

    def choose_unheld(self, num: int, tenant: str | None, protected: Collection[Block] = (),
                      at_most: bool = False) -> list[Block] | None:
        """choose(), never a block of a request an engine holds by request (see Holds).
        The requests of such victims are held (their blocks leave the policy; a fair policy,
        which orders requests, leaves them out of its choice instead, and they stay in it)
        and the choice is made again. With fewer than num victims, every request held so is
        held (None: the caller then sees all that the holds keep). `at_most`: as many as
        the policy can give, up to num (None for none). The reads left pending are recorded
        first."""
        self.before_choice()
        holds, policy = self.holds, self.policy
        left_out: set[Request] = set()
        if type(protected) is WholeRequest:
            if policy.fair:  # which orders requests: out of its choice as one
                left_out.add(protected.request)
                protected = ()
            else:
                protected = set(protected)
        while True:
            n = num
            if at_most:
                n = min(num, len(policy) - (policy.num_of(left_out) if left_out else 0))
                if n <= 0:
                    return None
            victims = self.choose(n, tenant, protected, left_out)
            if victims is None:
                if not at_most:
                    holds.materialize()
                return None
            if not holds.has_requests():
                return victims
            offered = holds.held_by_request({v.request for v in victims})
            if not offered:
                return victims
            if policy.fair:
                left_out |= offered
            else:
                holds.materialize_some(offered)

    def evict(self, num: int, cause: Request | None, reason: Reason, reassign: bool,
              protected: Collection[Block] = (), host_room: int | None = None,
              holder: str = "", now: bool = False) -> list[Move]:
        """Take num victims (none of them protected) off the device tier: demote them to host,
        or drop those the engine can recompute when the host tier is full (or has no more
        than `host_room` pages for them). Raises before changing anything: the policy's
        choice is looked at first and taken only after. `holder`: the caller's, whose own
        holds end only at its next call (waiting for them would wait for ever). `now`: the
        victims must be there now, or come free when copies in flight finish; engines'
        holds are not waited for (the operator's Evict: its caller may be the engine that
        would end them)."""
        victims = self.choose_unheld(num, cause.tenant if cause else None, protected)
        if victims is None:
            moving = self.num_moving_blocks()
            if now and not moving:
                raise self.unevictable(num)
            holds = self.holds
            rounds = SWAP_HOLDER if cause is not None and cause is self.swapping else ""
            own = holder if holder in holds.reading else ""
            if moving or holds.some_may_end(rounds, own):
                # Victims may come free when the copies finish, or when the engines
                # holding pages call again (or their holds lapse).
                raise NoVictims()
            if holds.count:
                own = holds.count_of(holder) if holder else 0
                kept = holds.count_of(rounds) if rounds else 0
                raise ResourceExhausted(
                    f"pool {self.name!r}: cannot free {num} device page(s): "
                    f"{len(self.policy)} evictable, {self.num_pinned} of "
                    f"{self.device.capacity} pinned, {holds.count - kept} held by engine "
                    f"steps being served ({own} by this one) until their next messages"
                    + (f", {kept} by this read's own swap rounds" if kept else "")
                    + "; a step cannot read or allocate more than the device tier holds "
                    "beside the others', read it in smaller steps")
            if cause is not None and self.policy.fair and len(self.policy) >= num:
                raise self.kept_by_fairness(num, cause.tenant)
            raise self.no_room(num)
        num_host = self.host.num_free if host_room is None else min(host_room,
                                                                     self.host.num_free)
        last = max((i for i, v in enumerate(victims) if not v.recompute_ok), default=-1)
        if last >= num_host:
            num_host += self.reclaim_host(last + 1 - num_host, protected)
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
        if len(victims) > num_host:
            num_host += self._turn_over_host(victims[num_host:], protected)
        self.policy.take(victims)
        self.moves += 1
        moves = []
        for i, victim in enumerate(victims):
            assert not victim.pinned, "a policy offered a pinned block"
            self.start_moving(victim)
            if i < num_host:
                moves.append(Move(victim, MoveKind.DEMOTE, TierKind.DEVICE, victim.page,
                                  TierKind.HOST, self.host.take(victim), reassign))
            else:
                moves.append(Move(victim, MoveKind.DROP, TierKind.DEVICE, victim.page,
                                  TierKind.NONE, -1, reassign))
        return moves

    def _turn_over_host(self, dropping: list[Block], protected: Collection[Block]) -> int:
        """Victims about to be dropped for want of host room take the host pages of kept
        blocks nobody uses that were read longer ago than they were, oldest first (else
        the host tier would keep the first blocks demoted forever, and drop every later
        one). None of `protected` goes. Returns the host pages made free."""
        kept = sorted(self._unused_kept_host(protected), key=lambda b: b.last_access)
        going = []
        for victim, old in zip(dropping, kept):
            if old.last_access >= victim.last_access:
                break
            going.append(old)
        self.discard_all(going)
        return len(going)

    def _unused_kept_host(self, protected: Collection[Block]) -> list[Block]:
        """Kept blocks in the host tier nobody uses, holds or moves, and not `protected`
        (blocks the caller is about to hand back)."""
        keep = {id(b) for b in protected}
        return [b for b in self.host.owner if b is not None and b.name is not None
                and not b.users and not b.held and not b.moving and id(b) not in keep]

    def reclaim_host(self, num: int, protected: Collection[Block] = ()) -> int:
        """Let go of num shared blocks nobody uses from the host tier, least recently read
        first, so a victim the engine cannot recompute can be demoted there. All or none:
        returns num, or 0 when there are fewer."""
        kept = self._unused_kept_host(protected)
        if len(kept) < num:
            return 0
        self.before_choice()
        kept.sort(key=lambda b: b.last_access)
        self.discard_all(kept[:num])
        return num

    def check_new(self, req: Request, num: int, indices: Sequence[int] | None,
                  intent: Mapping[str, Any] | None) -> Sequence[int]:
        """Refuse num new blocks of req at `indices` (None: after its last) that could never
        be placed: indices not increasing past its blocks, a bad intent, a pin that would
        overcommit the device tier, more blocks than the tier holds. Returns the indices."""
        if indices is None:
            indices = range(len(req.blocks), len(req.blocks) + num)
        elif (len(indices) != num or (indices and indices[0] < len(req.blocks))
              or any(b <= a for a, b in zip(indices, indices[1:]))):
            raise InvalidArgument("indices must be increasing and past the request's blocks")
        elif indices and indices[-1] > MAX_BLOCK_INDEX:
            raise InvalidArgument(f"block index {indices[-1]} is past the last a request may "
                                  f"have ({MAX_BLOCK_INDEX})")
        if intent:
            intents.validate(intent)
            if intents.pinned_after(Block(req, -1, TierKind.NONE, -1), intent):
                self.check_pins({req.tenant: num})
        if num > self.device.capacity:
            raise InvalidArgument(f"cannot allocate {num} blocks at once: the device tier of "
                                  f"pool {self.name!r} holds {self.device.capacity} pages")
        return indices

    def make_room(self, num: int, cause: Request | None, reason: Reason,
                  protected: Collection[Block] = (), holder: str = ""
                  ) -> tuple[list[int], list[Move]]:
        """Claim num device pages: free ones first (the reserve only up to the tenant's fair
        share, or where nothing else can be taken), then victims' pages (which their
        incoming blocks may use once the demotions are copied)."""
        free = usable = self.device.num_free
        if self.policy.fair and cause is not None:
            # The reserve is for growth up to one's fair share, not beyond it.
            spare = max(0, free - self.reserve_pages)
            headroom = max(0, self.tenancy.reserve_headroom(cause.tenant))
            usable = spare + min(free - spare, headroom)
        try:
            demotions = self._victims(num - usable, cause, reason, protected, holder)
        except HostShort as exc:
            raise HostShort(str(exc), usable + exc.possible) from None
        except (NoVictims, ResourceExhausted):
            if usable == free:
                raise
            # The policy has nothing to take now (what the device holds is kept by this
            # call, pinned or held): the reserve is a buffer, not a wall. Waiting for holds
            # to end would stall the call, and for ever when its own blocks are all there
            # is (a request alone in the pool); the refill takes the page back from a
            # tenant over its share once it may.
            try:
                demotions = self._victims(num - free, cause, reason, protected, holder)
            except HostShort as exc:  # no room on the host: the reserve stays whole
                raise HostShort(str(exc), usable + exc.possible) from None
        pages = [self.device.take(None) for _ in range(num - len(demotions))]
        pages.extend(m.src_page for m in demotions)
        return pages, demotions

    def _victims(self, short: int, cause: Request | None, reason: Reason,
                 protected: Collection[Block], holder: str) -> list[Move]:
        """The demotions making `short` more device pages (none when short <= 0)."""
        if short <= 0:
            return []
        return self.evict(short, cause, reason, True, protected, holder=holder)

    def promote(self, req: Request | None, missing: list[Block], keep: Iterable[Block],
                reason: Reason, holder: str = "", whole: bool = False) -> TransferPlan:
        """A plan bringing `missing` to the device tier without evicting any of `keep`.
        `whole`: a read of the whole request, which keeps every block of req (see
        WholeRequest; `keep` is not looked at)."""
        protected: Collection[Block]
        if whole and req is not None:
            protected = WholeRequest(req)
        else:
            protected = {b for b in keep if b.tier is TierKind.DEVICE}
        pages, demotions = self.make_room(len(missing), req, reason, protected, holder)
        plan = TransferPlan(self.name, reason, req, demotions=demotions)
        plan.promotions = self.moves_in(missing, pages)
        return plan

    def moves_in(self, blocks: Sequence[Block], pages: Sequence[int]) -> list[Move]:
        """The moves bringing these blocks (in the host tier, or dropped) to these device
        pages, which make_room claimed."""
        self.moves += 1
        moves = []
        for block, page in zip(blocks, pages):
            self.device.owner[page] = block
            self.start_moving(block)
            kind = MoveKind.PROMOTE if block.tier is TierKind.HOST else MoveKind.REMATERIALIZE
            moves.append(Move(block, kind, block.tier, block.page, TierKind.DEVICE, page, False))
        return moves

    def refill(self) -> TransferPlan | None:
        """Under a fair policy, demote pages of tenants above their fair share, or kept
        prefixes nobody uses, until the free reserve is whole again (None when it is, or
        there are none). With the host tier full
        (of kept prefixes, typically), victims the engine can recompute still go: the host
        turns over for them or they are dropped, as they would be on the path of the next
        allocation, which then finds the reserve whole instead of waiting."""
        want = self.reserve_pages - self.device.num_free
        if not self.policy.fair or want <= 0:
            return None
        over = set(self.tenancy.over_share())
        victims = self.choose_unheld(want, None, at_most=True)
        if not victims or any(v.request.tenant not in over and not _idle_kept(v)
                              for v in victims):
            return None  # only what over-share tenants hold, or idle cache, refills it
        room = max(0, self.host.num_free - self.transit_headroom)
        # Past the host's room, only victims that need no host page.
        num = next((i for i, v in enumerate(victims) if i >= room and not v.recompute_ok),
                   len(victims))
        if num == 0:
            return None
        try:
            demotions = self.evict(num, None, Reason.RESERVE, False, host_room=room)
        except (HostShort, BlocksInTransit):
            return None  # the policy chose otherwise the second time: the next refill tries
        return TransferPlan(self.name, Reason.RESERVE, None, demotions=demotions)

    def place(self, req: Request, page_numbers: list[int], indices: Iterable[int],
              intent: dict[str, Any] | None, holder: str) -> list[Block]:
        """New blocks of req at these indices, in these device pages (from make_room), moving
        until the engine has written them, with the intent the engine already knows; held for
        `holder` (when given), since the engine writes them next and nothing may take their
        pages before."""
        now = self.clock.now()
        placed = []
        self.changes.note(req)
        self._moving.add(req)
        blocks, live, owner, priority = req.blocks, req.live, self.device.owner, req.priority
        for page, index in zip(page_numbers, indices):
            if len(blocks) < index:  # a gap: the indices in it hold no block
                blocks.extend([None] * (index - len(blocks)))
            block = Block(req, index, TierKind.DEVICE, page, moving=True,
                          own_access=now, request_priority=priority)
            if intent:
                intents.apply(block, intent, now)
                self.count_pin(block, 1)
            owner[page] = block
            blocks.append(block)
            live.append(block)  # past every index it had: still in index order
            placed.append(block)
        # What each new block adds to its request's and tenant's counts, once for all
        # (device_delta's, a new block having no payers yet; and hold_one's).
        n = len(placed)
        req.num_moving_blocks += n
        req.num_live_blocks += n
        if holder:
            self.holds.hold_new(holder, placed)
        req.num_device_blocks += n
        tally(self.tenancy.device_by_tenant, req.tenant, n)
        if req.keeper and n:
            self.tenancy.kept_changed(req.tenant, n)
        self.note_peak()
        return placed

    def release_blocks(self, req: Request, blocks: list[Block]) -> None:
        """The blocks of a request being released go (discard_all); the device pages a
        client's holder still holds stay out of use until it calls again (Holds.keep)."""
        self.discard_all(blocks, self.holds.keep(req, blocks))

    def discard_all(self, blocks: Iterable[Block], kept: Collection[int] = ()) -> None:
        """discard() of each block, taking them out of their requests' `live` in one pass a
        request: letting go of k of a keeper's n kept blocks costs O(n), not O(k n).
        `kept`: device pages that stay out of use (see discard)."""
        gone: dict[Request, list[Block]] = {}  # both hash by identity (eq=False)
        for b in blocks:
            self.discard(b, unlive=False, kept=kept)
            gone.setdefault(b.request, []).append(b)
        for req, blocks_gone in gone.items():
            req.unlive(blocks_gone)

    def discard(self, block: Block, unlive: bool = True, kept: Collection[int] = ()) -> None:
        """The block is gone (freed or released): its page, pin and hold go with it.
        `unlive=False`: the caller takes it out of its request's `live` (with others at
        once, see Request.unlive). A device page in `kept` (see Holds.keep) is owned by
        nobody and stays out of use until its holders let go of it."""
        req = block.request
        self.changes.note(req)
        self.holds.forget(block)
        req.untold.pop(block, None)
        if block.tier is TierKind.DEVICE:
            if block in self.policy:
                self.policy.remove(block)
            if block.page in kept:
                self.device.owner[block.page] = None
            else:
                self.device.release(block.page)
            self.device_delta(block, -1)
        else:
            req.off_device.pop(block, None)
            if block.tier is TierKind.HOST:
                self.host.release(block.page)
        self.count_pin(block, -1)
        req.blocks[block.index] = None
        if unlive:
            req.unlive([block])
        req.num_live_blocks -= 1
        req.num_critical -= block.decode_critical
        block.tier, block.page = TierKind.NONE, -1
        if block.name is not None and self.named.get(block.name) is block:
            self.unname(block)

    def file_named(self, block: Block, name: tuple[str, bytes]) -> None:
        """A new kept block is found under `name` (its key's hash too)."""
        block.name = name
        self.named[name] = block
        self.by_hash.setdefault(key_hash(name[1]), []).append(block)

    def unname(self, block: Block) -> None:
        """A kept block is no longer found under its name."""
        del self.named[block.name]
        h = key_hash(block.name[1])
        same = self.by_hash[h]
        if len(same) == 1:
            del self.by_hash[h]
        else:
            same.remove(block)
        for tenant in block.users:
            tally(self.tenancy.named_in_use, tenant, -1)
        if self.named_changed is not None:
            self.named_changed.add(block.name)


class WholeRequest(Collection):
    """The device blocks of a request, all protected from a choice (a read of the whole
    request bringing some back), gathered only where a choice is made: a fair policy leaves
    the request out of its choice as one, as it does a request an engine holds, where a set
    of its blocks costs a look at each (65,536 of them, with a long context); other
    policies get that set (choose_unheld), and the host tier's kept-block checks see the
    same blocks. A promotion that finds free pages gathers none."""

    __slots__ = ("request",)

    def __init__(self, request: Request) -> None:
        self.request = request

    def __contains__(self, block: object) -> bool:
        return (isinstance(block, Block) and block.request is self.request
                and block.tier is TierKind.DEVICE)

    def __iter__(self) -> Iterator[Block]:
        return (b for b in self.request.live if b.tier is TierKind.DEVICE)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _idle_kept(block: Block) -> bool:
    """A kept prefix block no request uses: cache."""
    return block.name is not None and not block.users


def _nothing() -> None:
    pass
