"""The pool's invariants, checked after every test step and by the SelfCheck RPC."""

from __future__ import annotations

from collections import Counter, defaultdict
from fractions import Fraction
from dataclasses import dataclass, field

from kvd.core.admission import counted_pages
from kvd.core.blocks import (Request, RequestState, TierKind, key_hash, pin_room_tenants,
                              pin_tenant)
from kvd.core.pool import Pool


@dataclass
class _Tally:
    """What the walk over the requests counted, to hold against the pool's own counters."""

    pinned: int = 0
    evictable: int = 0
    held: int = 0
    reserved: int = 0
    working_set: int = 0
    pinned_by_tenant: Counter = field(default_factory=Counter)
    pin_room_by_tenant: Counter = field(default_factory=Counter)
    reserved_by_tenant: Counter = field(default_factory=Counter)
    device_by_tenant: Counter = field(default_factory=Counter)
    working_set_by_tenant: Counter = field(default_factory=Counter)


def check_pool(pool: Pool) -> list[str]:
    """Every broken invariant, one line each; empty when the pool is consistent."""
    problems: list[str] = []
    owners = _check_pages(pool, problems)
    tally = _Tally()
    waiting = Counter(r.tenant for r in pool.queue.values())
    if +waiting != +pool.tenancy.waiting_by_tenant:
        problems.append(f"{pool.name}: waiting requests by tenant "
                        f"{dict(+pool.tenancy.waiting_by_tenant)} != the queue's {dict(waiting)}")
    admission = pool.admission
    by_tenant = {t: list(mine) for t, mine in admission._by_tenant.items()}
    in_order: dict[str, list[str]] = {}
    for rid, req in pool.queue.items():
        in_order.setdefault(req.tenant, []).append(rid)
    if by_tenant != in_order or [r.queue_seq for r in pool.queue.values()] != sorted(
            r.queue_seq for r in pool.queue.values()):
        problems.append(f"{pool.name}: the queue by tenant {by_tenant} is not the queue's "
                        f"arrival order {in_order}")
    handing = Counter(r.handoff_pool for r in pool.queue.values() if r.handoff_pool)
    if handing != +admission.handoff_waiting:
        problems.append(f"{pool.name}: queued for handoff reservations "
                        f"{dict(admission.handoff_waiting)}, the queue has {dict(handing)}")
    for req in pool.requests.values():
        _check_request(pool, req, owners, tally, problems)
    _check_totals(pool, tally, problems)
    _check_shared(pool, problems)
    return problems


def _check_shared(pool: Pool, problems: list[str]) -> None:
    """Named blocks: each filed in its keeper under its name, its users those of the live
    requests, its cost split among its payers exactly as the tenancy's figures say."""
    name = pool.name
    named = pool.pages.named
    users: defaultdict[int, Counter] = defaultdict(Counter)  # by block, by tenant
    pinners: defaultdict[int, Counter] = defaultdict(Counter)
    uses: Counter = Counter()
    for req in pool.requests.values():
        if req.shared_set != set(req.shared) or len(req.shared_set) != len(req.shared):
            problems.append(f"{name}: {req.request_id!r} uses {len(req.shared)} shared blocks, "
                            f"its set of them has {len(req.shared_set)}")
        for b in req.shared:
            uses[id(b)] += 1
        for b in req.pinned_shared:
            pinners[id(b)][req.tenant] += 1
            if b not in req.shared:
                problems.append(f"{name}: {req.request_id!r} pins {b}, which it does not use")
        if req.keeper:
            for b in req.live_blocks():
                if b.name is None or named.get(b.name) is not b:
                    problems.append(f"{name}: keeper {req.tenant!r} has {b}, not by name")
            continue
        for b in req.shared:
            if named.get(b.name) is b:
                users[id(b)][req.tenant] += 1
    if sum(uses.values()) != pool.admission.shared_uses:
        problems.append(f"{name}: counts {pool.admission.shared_uses} uses of shared blocks, "
                        f"the requests have {sum(uses.values())}")
    adjust: Counter = Counter()
    idle: Counter = Counter()
    shared: Counter = Counter()
    saved: Counter = Counter()
    in_use: Counter = Counter()
    idle_blocks = {id(b) for b in named.values() if b.tier is TierKind.DEVICE and not b.users}
    filed = pool.pages.idle
    if idle_blocks != {id(b) for b in filed.order}:
        problems.append(f"{name}: {len(filed)} kept blocks filed as used by nobody, "
                        f"{len(idle_blocks)} in the device tier are")
    for key, b in named.items():
        keeper = b.request
        if (b.name != key or not keeper.keeper or b.tier is TierKind.NONE
                or keeper.blocks[b.index] is not b):
            problems.append(f"{name}: {b} is filed under {key!r} but is not kept there")
        have = dict(users.get(id(b), {}))
        if have != b.users:
            problems.append(f"{name}: {b} counts users {b.users}, has {have}")
        pinning = dict(pinners.get(id(b), {}))
        if (b.pin_users or {}) != pinning or b.pin_requested != bool(pinning):
            problems.append(f"{name}: {b} has pinning users {b.pin_users} (pin "
                            f"{b.pin_requested}), its requests say {pinning}")
        if b.users and b.payers != tuple(sorted(b.users)):
            problems.append(f"{name}: {b} is charged to {b.payers}, used by {sorted(b.users)}")
        if b.tier is TierKind.DEVICE and b.payers != (keeper.tenant,):
            adjust[keeper.tenant] -= 1
            for t in b.payers:
                adjust[t] += Fraction(1, len(b.payers))
        if b.tier is TierKind.DEVICE and not b.users:
            for t in b.payers:
                idle[t] += Fraction(1, len(b.payers))
        if b.tier is TierKind.DEVICE and len(b.payers) > 1:
            for t in b.payers:
                shared[t] += 1
                saved[t] += 1 - Fraction(1, len(b.payers))
        in_use.update(b.users.keys())
    if {t: v for t, v in adjust.items() if v} != dict(pool.tenancy.shared_adjust):
        problems.append(f"{name}: shared pages split {dict(pool.tenancy.shared_adjust)}, "
                        f"their payers say {dict(adjust)}")
    if {t: v for t, v in idle.items() if v} != dict(pool.tenancy.idle_kept):
        problems.append(f"{name}: idle kept pages {dict(pool.tenancy.idle_kept)}, "
                        f"the blocks say {dict(idle)}")
    by_hash = {h: sorted(map(id, same)) for h, same in pool.pages.by_hash.items()}
    walked_hashes: dict[int, list[int]] = {}
    for b in named.values():
        walked_hashes.setdefault(key_hash(b.name[1]), []).append(id(b))
    if by_hash != {h: sorted(same) for h, same in walked_hashes.items()}:
        problems.append(f"{name}: {sum(map(len, by_hash.values()))} kept blocks filed by "
                        f"hash, {len(named)} by name")
    ten = pool.tenancy
    for what, walked, kept in (("shared device pages", shared, ten.shared_pages),
                               ("pages the split saves", saved, ten.shared_saved),
                               ("kept blocks in use", in_use, ten.named_in_use)):
        if {t: v for t, v in walked.items() if v} != dict(kept):
            problems.append(f"{name}: {what} by tenant {dict(kept)}, the blocks say "
                            f"{dict(walked)}")


def _check_pages(pool: Pool, problems: list[str]) -> Counter:
    """Free lists and page owners of both tiers; returns how many pages each block owns."""
    name = pool.name
    owners: Counter = Counter()
    kept = pool.pages.holds.kept  # released requests' pages their holders still hold
    for page in kept:
        if pool.device.is_free(page) or pool.device.owner[page] is not None:
            problems.append(f"{name}/DEVICE[{page}]: kept for its holders, but "
                            + ("free" if pool.device.is_free(page) else "owned"))
    for holder in pool.pages.holds.kept_without_holder():
        problems.append(f"{name}: pages kept for holder {holder!r}, which holds nothing")
    for tier in (pool.device, pool.host):
        where = f"{name}/{tier.kind.name}"
        free = set(tier.free_pages())
        if len(free) != tier.num_free:
            problems.append(f"{where}: a page is on the free list twice")
        if tier.num_free + tier.num_used != tier.capacity:
            problems.append(f"{where}: free + used != capacity")
        for page, block in enumerate(tier.owner):
            is_free = page in free
            if is_free and block is not None:
                problems.append(f"{where}[{page}]: free but owned by {block}")
            if block is None:
                if not is_free and (tier is not pool.device or page not in kept):
                    problems.append(f"{where}[{page}]: used but owned by nobody")
                continue
            owners[id(block)] += 1
            if not block.moving and (block.tier is not tier.kind or block.page != page):
                problems.append(f"{where}[{page}]: owner {block} says it is elsewhere")
    return owners


def _check_request(pool: Pool, req: Request, owners: Counter, tally: _Tally,
                   problems: list[str]) -> None:
    """One request's blocks against its counters, its pages and the policy. Blocks in
    transit legitimately own two pages (source and destination): only still ones are held
    to owning exactly their own."""
    name, rid = pool.name, req.request_id
    if req.state is RequestState.QUEUED:
        if req.blocks:
            problems.append(f"{name}: queued request {rid} holds blocks")
        if rid not in pool.queue:
            problems.append(f"{name}: queued request {rid} not in the queue")
        return
    tally.reserved += req.reserved_pages
    tally.working_set += counted_pages(req)
    tally.working_set_by_tenant[req.tenant] += counted_pages(req)
    tally.reserved_by_tenant[req.tenant] += req.reserved_pages
    tally.device_by_tenant[req.tenant] += req.num_device_blocks
    live = [b for b in req.blocks if b is not None]
    if len(live) != len(req.live) or any(a is not b for a, b in zip(live, req.live)):
        problems.append(f"{name}: {rid}'s live blocks are not those of its index table, "
                        f"in index order")
    if sum(b.decode_critical for b in live) != req.num_critical:
        problems.append(f"{name}: {rid} counts {req.num_critical} decode-critical blocks, "
                        f"has {sum(b.decode_critical for b in live)}")
    if len(live) != req.num_live_blocks:
        problems.append(f"{name}: {rid} counts {req.num_live_blocks} live blocks, "
                        f"has {len(live)}")
    moving = sum(b.moving for b in live)
    if moving != req.num_moving_blocks:
        problems.append(f"{name}: {rid} counts {req.num_moving_blocks} blocks in transit, "
                        f"has {moving}")
    if req.num_moving_blocks and not pool.pages.noted_moving(req):
        problems.append(f"{name}: {rid} has {req.num_moving_blocks} block(s) in transit "
                        "that the pool's look for them would miss")
    on_device = sum(b.tier is TierKind.DEVICE for b in live)
    untold = [b.index for b in live if b.epoch != b.seen_epoch and b not in req.untold]
    if untold:
        problems.append(f"{name}: {rid}'s blocks {untold} moved since the engine was told, "
                        "and it does not list them")
    off = {id(b) for b in live if b.tier is not TierKind.DEVICE}
    if off != {id(b) for b in req.off_device}:
        problems.append(f"{name}: {rid}'s blocks off the device tier are "
                        f"{sorted(b.index for b in live if id(b) in off)}, it lists "
                        f"{sorted(b.index for b in req.off_device)}")
    if on_device != req.num_device_blocks:
        problems.append(f"{name}: {rid} counts {req.num_device_blocks} device blocks, "
                        f"has {on_device}")
    for i, b in enumerate(req.blocks):
        if b is None:
            continue
        if b.index != i or b.request is not req:
            problems.append(f"{name}: {b} is filed at {rid}[{i}]")
        if b.pinned:
            tally.pinned += 1
            tally.pinned_by_tenant[pin_tenant(b)] += 1
            for tenant in pin_room_tenants(b):
                tally.pin_room_by_tenant[tenant] += 1
        if b.tier is not TierKind.NONE and not b.moving:
            if pool.pages.tier(b.tier).owner[b.page] is not b:
                problems.append(f"{name}: {b} is not the owner of its page")
            if owners[id(b)] != 1:
                problems.append(f"{name}: {b} owns {owners[id(b)]} pages")
        tally.held += b.held > 0
        evictable = (b.tier is TierKind.DEVICE and not b.moving and not b.pinned
                     and not b.held)
        tally.evictable += evictable
        held = b in pool.policy
        if evictable != held:
            problems.append(f"{name}: {b} evictable={evictable} but policy holds={held}")


def _check_totals(pool: Pool, t: _Tally, problems: list[str]) -> None:
    """The pool's and its tenancy's counters against what the walk counted."""
    name, ten = pool.name, pool.tenancy
    if t.evictable != len(pool.policy):
        problems.append(f"{name}: policy holds {len(pool.policy)} blocks, "
                        f"{t.evictable} are evictable")
    problems += [f"{name}: {p}" for p in pool.policy.order_problems()]
    if t.held != pool.pages.holds.count:
        problems.append(f"{name}: counts {pool.pages.holds.count} held blocks, has {t.held}")
    stray = pool.pages.holds.stray_materialized()
    if stray:
        problems.append(f"{name}: requests held for holders that hold none by request: "
                        f"{sorted(stray)[:5]}")
    if +t.reserved_by_tenant != +ten.reserved_by_tenant:
        problems.append(f"{name}: reserved-by-tenant counts are off")
    if +t.device_by_tenant != +ten.device_by_tenant:
        problems.append(f"{name}: device-by-tenant counts are off")
    if t.pinned != pool.num_pinned:
        problems.append(f"{name}: counts {pool.num_pinned} pinned blocks, has {t.pinned}")
    if +t.pinned_by_tenant != +ten.pinned_by_tenant:
        problems.append(f"{name}: pinned-by-tenant counts are off")
    if +t.pin_room_by_tenant != +ten.pin_room_by_tenant:
        problems.append(f"{name}: pin room by tenant {dict(+ten.pin_room_by_tenant)}, the "
                        f"pinned blocks say {dict(+t.pin_room_by_tenant)}")
    if t.pinned > pool.device.capacity:
        problems.append(f"{name}: {t.pinned} pinned blocks exceed {pool.device.capacity} "
                        "device pages")
    admission = pool.admission
    if t.working_set != admission.working_set_pages:
        problems.append(f"{name}: working set pages {admission.working_set_pages} != sum over "
                        f"requests {t.working_set}")
    if +t.working_set_by_tenant != +admission.working_set_by_tenant:
        problems.append(f"{name}: working set pages by tenant are off")
    if t.reserved != pool.reserved_pages:
        problems.append(f"{name}: reserved pages {pool.reserved_pages} != sum over requests "
                        f"{t.reserved}")
    # A switch to a fair policy lowers the capacity by the free reserve; what was admitted
    # before it stays admitted until it ends, within what any policy admits.
    if pool.reserved_pages > pool.pages.tiers_pages:
        problems.append(f"{name}: {pool.reserved_pages} reserved pages exceed capacity "
                        f"{pool.pages.tiers_pages}")
