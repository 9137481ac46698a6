"""The pool's invariants, checked after every test step and by the SelfCheck RPC."""

from __future__ import annotations

from collections import Counter

from kvd.core.blocks import RequestState, TierKind
from kvd.core.pool import Pool


def check_pool(pool: Pool) -> list[str]:
    """Every broken invariant, one line each; empty when the pool is consistent.

    Blocks in transit legitimately own two pages (source and destination), so a quiescent
    pool (no plan outstanding) gets the strict check and a busy one a looser one.
    """
    problems: list[str] = []
    name = pool.name
    owners = Counter()
    for tier in (pool.device, pool.host):
        free = set(tier.free_pages())
        if len(free) != tier.num_free:
            problems.append(f"{name}/{tier.kind.name}: a page is on the free list twice")
        if tier.num_free + tier.num_used != tier.capacity:
            problems.append(f"{name}/{tier.kind.name}: free + used != capacity")
        for page, block in enumerate(tier.owner):
            is_free = page in free
            if is_free and block is not None:
                problems.append(f"{name}/{tier.kind.name}[{page}]: free but owned by {block}")
            if block is None:
                if not is_free:
                    problems.append(f"{name}/{tier.kind.name}[{page}]: used but owned by nobody")
                continue
            owners[id(block)] += 1
            if not block.moving and (block.tier is not tier.kind or block.page != page):
                problems.append(
                    f"{name}/{tier.kind.name}[{page}]: owner {block} says it is elsewhere"
                )
    num_pinned = 0
    pinned_by_tenant: Counter[str] = Counter()
    num_evictable = 0
    num_held = 0
    reserved = 0
    reserved_by_tenant: Counter[str] = Counter()
    device_by_tenant: Counter[str] = Counter()
    waiting = Counter(r.tenant for r in pool.queue.values())
    if +waiting != +pool.tenancy.waiting_by_tenant:
        problems.append(f"{name}: waiting requests by tenant {dict(+pool.tenancy.waiting_by_tenant)} "
                        f"!= the queue's {dict(waiting)}")
    for req in pool.requests.values():
        if req.state is RequestState.QUEUED:
            if req.blocks:
                problems.append(f"{name}: queued request {req.request_id} holds blocks")
            if req.request_id not in pool.queue:
                problems.append(f"{name}: queued request {req.request_id} not in the queue")
            continue
        reserved += req.reserved_pages
        reserved_by_tenant[req.tenant] += req.reserved_pages
        device_by_tenant[req.tenant] += req.num_device_blocks
        live = [b for b in req.blocks if b is not None]
        if len(live) != req.num_live_blocks:
            problems.append(f"{name}: {req.request_id} counts {req.num_live_blocks} live blocks, has {len(live)}")
        on_device = sum(b.tier is TierKind.DEVICE for b in live)
        if on_device != req.num_device_blocks:
            problems.append(f"{name}: {req.request_id} counts {req.num_device_blocks} device blocks, has {on_device}")
        for i, b in enumerate(req.blocks):
            if b is None:
                continue
            if b.index != i or b.request is not req:
                problems.append(f"{name}: {b} is filed at {req.request_id}[{i}]")
            if b.pinned:
                num_pinned += 1
                pinned_by_tenant[req.tenant] += 1
            if b.tier is not TierKind.NONE and not b.moving:
                tier = pool.tier(b.tier)
                if tier.owner[b.page] is not b:
                    problems.append(f"{name}: {b} is not the owner of its page")
                if owners[id(b)] != 1:
                    problems.append(f"{name}: {b} owns {owners[id(b)]} pages")
            num_held += b.held
            evictable = (b.tier is TierKind.DEVICE and not b.moving and not b.pinned
                         and not b.held)
            num_evictable += evictable
            held = b in pool.policy
            if evictable != held:
                problems.append(f"{name}: {b} evictable={evictable} but policy holds={held}")
    if num_evictable != len(pool.policy):
        problems.append(f"{name}: policy holds {len(pool.policy)} blocks, {num_evictable} are evictable")
    if num_held != pool.num_held:
        problems.append(f"{name}: counts {pool.num_held} held blocks, has {num_held}")
    if +reserved_by_tenant != +pool.tenancy.reserved_by_tenant:
        problems.append(f"{name}: reserved-by-tenant counts are off")
    if +device_by_tenant != +pool.tenancy.device_by_tenant:
        problems.append(f"{name}: device-by-tenant counts are off")
    if num_pinned != pool.num_pinned:
        problems.append(f"{name}: counts {pool.num_pinned} pinned blocks, has {num_pinned}")
    if +pinned_by_tenant != +pool.tenancy.pinned_by_tenant:
        problems.append(f"{name}: pinned-by-tenant counts are off")
    if num_pinned > pool.device.capacity:
        problems.append(f"{name}: {num_pinned} pinned blocks exceed {pool.device.capacity} device pages")
    if reserved != pool.reserved_pages:
        problems.append(f"{name}: reserved pages {pool.reserved_pages} != sum over requests {reserved}")
    if pool.reserved_pages > pool.capacity_pages:
        problems.append(f"{name}: {pool.reserved_pages} reserved pages exceed capacity {pool.capacity_pages}")
    return problems

