"""A transfer plan made true, or undone (see pages.py): the runtime copies a plan's bytes,
then the pool settles the page table with complete(), or with abort() when the copy failed or
was cancelled."""

from __future__ import annotations

from kvd.core.attribution import NO_REQUEST, EvictionRecord
from kvd.core.blocks import Block, Request, TierKind, evictable
from kvd.core.pages import PageTable
from kvd.core.transfer import MoveKind, Reason, TransferPlan


def complete(pages: PageTable, plan: TransferPlan) -> list[Block]:
    """The plan's bytes are copied: make the page table say so. Returns blocks pinned while
    they were being demoted, which now want a prefetch."""
    now = pages.clock.now()
    c = pages.counters
    if plan.demotions:
        _record_evictions(pages, plan, now)
    dropped_named = []
    followed = pages.named_changed  # see PageTable.named_changed
    for m in plan.demotions:
        b = m.block
        b.moving = False
        b.request.num_moving_blocks -= 1
        b.epoch += 1
        b.request.untold[b] = None
        pages.device_delta(b, -1)
        if not m.src_reassigned:
            pages.device.release(m.src_page)
        b.request.off_device[b] = None
        if m.kind is MoveKind.DROP:
            b.tier, b.page = TierKind.NONE, -1
            c.num_drops += 1
            if b.name is not None:  # a shared block without bytes is no use to anyone
                dropped_named.append(b)
        else:
            b.tier, b.page = TierKind.HOST, m.dst_page
            c.num_demotions += 1
            c.bytes_moved += pages.page_bytes
            if followed is not None and b.name is not None:
                followed.add(b.name)
    if dropped_named:
        pages.discard_all(dropped_named)
    for m in plan.promotions:
        b = m.block
        b.moving = False
        b.request.num_moving_blocks -= 1
        b.epoch += 1
        b.request.untold[b] = None
        pages.device_delta(b, 1)
        if m.kind is MoveKind.PROMOTE:
            pages.host.release(m.src_page)
            c.num_promotions += 1
            c.bytes_moved += pages.page_bytes
        else:
            # Its bytes were dropped: the page was zeroed (runtime), and every reply that
            # hands it out says the engine must recompute it until the engine was told.
            c.num_rematerializations += 1
            c.num_lost_blocks += 1
            b.lost = True
            if b.request.account is not None:
                b.request.account.num_recomputes += 1
        b.tier, b.page = TierKind.DEVICE, m.dst_page
        b.request.off_device.pop(b, None)
        b.request.maybe_relocated = True
        if followed is not None and b.name is not None:
            followed.add(b.name)
        if plan.reason is Reason.ACCESS and b.deadline_at is not None and now > b.deadline_at:
            c.num_deadline_misses += 1
        pages.policy.on_promoted(b)
        if evictable(b):
            pages.policy.insert(b)
    for b in plan.allocated:
        b.moving = False
        b.request.num_moving_blocks -= 1
        if evictable(b):
            pages.policy.insert(b)
    pages.note_peak()
    # Pinned while they went: brought back by a prefetch. Not a shared block dropped (let go
    # of above): brought back, it was a device page's block its keeper no longer had.
    gone = {id(b) for b in dropped_named}
    return [m.block for m in plan.demotions if m.block.pinned and id(m.block) not in gone]


def abort(pages: PageTable, plan: TransferPlan) -> None:
    """The copy failed or was cancelled: put everything back as it was before the plan."""
    victim_pages = {m.src_page for m in plan.demotions}
    for m in plan.promotions:
        if m.dst_page not in victim_pages:
            pages.device.release(m.dst_page)
        m.block.moving = False
        m.block.request.num_moving_blocks -= 1
    gone: dict[Request, list[Block]] = {}
    for b in plan.allocated:
        if b.page not in victim_pages:
            pages.device.release(b.page)
        pages.count_pin(b, -1)
        pages.holds.forget(b)
        req = b.request
        pages.changes.note(req)
        req.num_moving_blocks -= 1
        req.blocks[b.index] = None
        gone.setdefault(req, []).append(b)
        req.num_live_blocks -= 1
        req.num_critical -= b.decode_critical
        pages.device_delta(b, -1)
        b.tier, b.page = TierKind.NONE, -1
        if b.name is not None:
            pages.unname(b)
    named = {id(b) for b in plan.allocated if b.name is not None}
    if named and plan.cause is not None:  # the storer uses them no more
        plan.cause.shared = [b for b in plan.cause.shared if id(b) not in named]
        plan.cause.shared_set = set(plan.cause.shared)
        plan.cause.pinned_shared = [b for b in plan.cause.pinned_shared
                                    if id(b) not in named]
    for req, blocks in gone.items():
        req.unlive(blocks)
        while req.blocks and req.blocks[-1] is None:  # indices nobody was told of
            req.blocks.pop()
    for m in plan.demotions:
        b = m.block
        b.moving = False
        b.request.num_moving_blocks -= 1
        pages.device.owner[m.src_page] = b
        if m.dst_tier is TierKind.HOST:
            pages.host.release(m.dst_page)
        if evictable(b):  # it may have been pinned while in flight
            pages.policy.insert(b)


def _record_evictions(pages: PageTable, plan: TransferPlan, now: float) -> None:
    cause = plan.cause
    evictor_request = cause.request_id if cause else NO_REQUEST
    evictor_tenant = cause.tenant if cause else NO_REQUEST
    policy = pages.policy.name
    for m in plan.demotions:
        b = m.block
        record = EvictionRecord(now, pages.name, b.request.request_id, b.request.tenant,
                                b.index, evictor_request, evictor_tenant, plan.reason, policy)
        b.evicted_by = record
        pages.attribution.evicted(record)
    pages.counters.num_evictions += len(plan.demotions)
    pages.counters.evictions_by_reason[plan.reason] += len(plan.demotions)

