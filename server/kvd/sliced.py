"""Calls that name many blocks, served a slice at a time.

An allocation, a free or a release costs kvd's one event loop a few microseconds a block
(each block placed, held and handed out; each page given back and its policy entry gone),
and a 1M-token request has 65,536 of them: served whole, one tenant's call would keep
every other tenant's calls and steps waiting for a third of a second. A call naming more
than a slice's worth of blocks (`slice_blocks`, 256) is checked whole first, so a bad one
changes nothing, then done a slice at a time (about a millisecond each), with the loop
served between slices; a holder's holds end so too (Node.end_holds).

What another call changes between two slices is taken as it comes: a free's block that
another call freed meanwhile is not freed twice, and a request released meanwhile ends
the free. A big allocation that fails or is cancelled part way gives back the slices it
made: the engine was told of none of them. One whose next slice would wait for room gives
them back too, and is made whole instead, waiting as any allocation does: two big
allocations on a full device each holding the half they made, each waiting for the
other's holds to end, would wait until their holds lapsed. A store of many shared prefix
keys is done alike, and a load or a commit of many (SharedBlocks), a read of many blocks
(one bringing them in too: each slice's copies run on while the next is planned, and are
all waited for at the end), and an operator's evict of many pages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import structlog

from kvd.core.blocks import Block, RequestState, TierKind
from kvd.core.errors import (BlocksInTransit, FailedPrecondition, InvalidArgument, KvdError,
                             NotFound, ResourceExhausted)
from kvd.core.requests import resolve

if TYPE_CHECKING:
    from kvd.node import Node
    from kvd.runtime import PoolRuntime

log = structlog.get_logger("kvd.sliced")



def slices(items: Sequence, size: int) -> list[Sequence]:
    return [items[i:i + size] for i in range(0, len(items), size)]


async def served_slices(items: Sequence, size: int) -> AsyncIterator[tuple[int, Sequence]]:
    """(start, items[start:start + size]) for each slice in turn, kvd's loop served between
    slices: work on a big call's items (a reply's handles, its checks) that another
    tenant's call need not wait for whole."""
    for start in range(0, len(items), size):
        if start:
            await asyncio.sleep(0)
        yield start, items[start:start + size]


async def allocate(node: Node, request_id: str, num_blocks: int, intent: dict | None,
                   scope: str | None, holder: str) -> tuple[list[Block], float]:
    """Node.allocate of more than a slice's blocks: refused whole when the request may not take
    them all now, else made a slice at a time; (blocks, stall)."""
    rt = node.runtime_of(request_id, scope)
    node.handoffs.refuse_while_under_way(request_id, "allocate")
    rt.pool.check_allocation(request_id, num_blocks, intent)
    blocks: list[Block] = []
    stall_s = 0.0
    size = node.slice_blocks
    try:
        while len(blocks) < num_blocks:
            if blocks:
                await asyncio.sleep(0)
            try:
                made, stalled = await node.allocate_at_once(
                    request_id, min(size, num_blocks - len(blocks)), intent, scope, holder,
                    wait=not blocks)
            except BlocksInTransit:  # would wait holding what it made: made whole instead
                give_back(node, request_id, blocks, holder)
                blocks = []
                made, stalled = await node.allocate_at_once(request_id, num_blocks, intent,
                                                            scope, holder)
            blocks += made
            stall_s += stalled
    except BaseException as exc:  # a cancel too: the engine is told of none of them
        if blocks:
            give_back(node, request_id, blocks, holder)
            if isinstance(exc, KvdError):
                exc.args = (f"{exc.args[0]} (after {len(blocks)} of the {num_blocks} blocks "
                            "asked for were made: given back, or gone with the request)",)
        raise
    return blocks, stall_s


def give_back(node: Node, request_id: str, blocks: list[Block], holder: str) -> None:
    """Free the blocks a big allocation made before it stopped, those the request still
    has. Its holder holds them, but the engine was told of none: their pages are free at
    once (not kept for the holder, see Holds.keep)."""
    if not blocks:
        return
    req = blocks[0].request
    rt = node.request_index.get(request_id)
    if rt is None or rt.pool.requests.get(request_id) is not req:
        return  # released meanwhile: its blocks went with it
    mine = [b for b in blocks if b.index < len(req.blocks) and req.blocks[b.index] is b]
    if not mine:
        return
    indices = [b.index for b in mine]
    pinned = rt.pool.num_pinned
    try:
        rt.pool.check_free(request_id, indices)
        rt.pool.pages.holds.unhold(holder, mine)
        rt.pool.free(request_id, indices)
    except (KvdError, BlocksInTransit) as exc:  # moving: the request's release frees them
        log.warning("blocks of a failed allocation left with their request",
                    request_id=request_id, blocks=len(indices), error=str(exc))
        return
    rt.room_may_have_changed()
    node.unpinned(rt, pinned)


async def free(node: Node, request_id: str, indices: Sequence[int],
               scope: str | None) -> int:
    """Node.free of more than a slice's indices: every index checked first (a bad one frees
    nothing), then freed a slice at a time; the blocks freed (a block another call freed
    meanwhile is not freed twice; a release of the request ends the free)."""
    rt = node.runtime_of(request_id, scope)
    req = rt.pool.get_admitted(request_id)
    parts = slices(indices, node.slice_blocks)
    async for _ in _checked(node, request_id, rt, req, indices, parts, "free", "freed"):
        pass
    freed = 0
    for i, part in enumerate(parts):
        if i:
            await asyncio.sleep(0)
            if not _same(node, request_id, rt, req):
                break  # released (or handed off) meanwhile
        blocks = req.blocks
        still = [j for j in part if blocks[j] is not None]
        if not still:
            continue
        try:
            freed += await node.free_at_once(request_id, still, scope)
        except KvdError as exc:  # another call's change while this slice waited for copies
            if freed:
                exc.args = (f"{exc.args[0]} (changed by another call while this free was "
                            f"done; {freed} of its blocks were freed)",)
            raise
    return freed


async def access(node: Node, request_id: str, indices: Sequence[int] | None,
                 scope: str | None, holder: str) -> tuple[list[Block], float, int]:
    """Node.access of more than a slice's blocks (`indices` None: every block the request
    has, see Node.reads_in_slices): every index checked first (a bad one or one named twice
    reads nothing), then read a slice at a time, each slice's blocks held for the holder as
    it is read, and those not on the device brought in slice by slice, the loop served
    between slices (a read bringing in a million-token request was one turn of a third of
    a second); (blocks, stall, promoted). Where some must be brought in, the blocks named
    on the device are held first: a slice's room is not made of the blocks the next slices
    read. A block freed meanwhile is not read (as a whole read waiting for its copies does
    not answer one freed)."""
    rt = node.runtime_of(request_id, scope)
    req = rt.pool.get_admitted(request_id)
    named = [b.index for b in req.live] if indices is None else indices
    with rt.pool.pages.holds.reading_in_slices(holder):
        try:
            return await _access(node, request_id, rt, req, named, scope, holder,
                                 whole=indices is None)
        except FailedPrecondition as exc:
            if _same(node, request_id, rt, req):
                raise  # refused for a reason of its own
            if not _handed_off(node, request_id, rt):
                # Released meanwhile: answered as a read done whole is once it went.
                raise NotFound(f"no request {request_id!r}: released while it was "
                               "read") from exc
    # Handed off between two slices: read again where it went, as a read done whole
    # follows it (Node._follow). What the slices read before is the pool it left's.
    return await node.access(request_id, indices, scope, holder)


def _handed_off(node: Node, request_id: str, rt) -> bool:
    """Whether the request is admitted in a pool other than rt's now."""
    now = node.request_index.get(request_id)
    if now is None or now is rt:
        return False
    req = now.pool.requests.get(request_id)
    return req is not None and req.state is RequestState.ADMITTED


async def _access(node: Node, request_id: str, rt, req, indices: Sequence[int],
                  scope: str | None, holder: str, whole: bool
                  ) -> tuple[list[Block], float, int]:
    """`whole`: the read is of every block of the request (`indices` are those it had)."""
    parts = slices(indices, node.slice_blocks)
    still = True
    async for named in _checked(node, request_id, rt, req, indices, parts, "read", "read"):
        still = still and all(b.tier is TierKind.DEVICE and not b.moving for b in named)
    # What the read holds for the holder (a block once per hold): while it holds any, a
    # slice that would wait for room does not (see below).
    held: list[Block] = []
    if not still and holder:
        held = await _hold_resident(node, request_id, rt, req, parts, holder)
    started = time.perf_counter()
    reads: list = []  # each slice's read (StartedAccess), its copies running on
    at_once = False
    try:
        for i, part in enumerate(parts):
            if i:
                await _next_slice(node, request_id, rt, req, f"it was read ({i} of its "
                                  f"{len(parts)} slices of blocks read)")
            named = req.blocks
            todo = [j for j in part if named[j] is not None]
            if todo:
                try:
                    reads.append(await node.begin_access(
                        request_id, todo, scope, holder, wait=not (holder and (held or reads))))
                except BlocksInTransit:
                    at_once = True
                    break
    finally:
        # The copies started finish (each settled by its own task) whatever stopped it.
        outcomes = await asyncio.gather(*(r.wait() for r in reads), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome  # a copy failed: its slice's plan was rolled back
    promoted = sum(len(r.result.plan.promotions) for r in reads if r.result.plan)
    if at_once:
        # It would wait holding what it read: another read may hold what this one waits
        # for, and wait for what this one holds, neither call answered, so neither's holds
        # end or lapse. It lets go of what it held and reads at once, holding nothing
        # while it waits, as a read done whole does (and a big allocation, see allocate).
        rt.pool.pages.holds.let_go(holder, held + [b for r in reads for b in r.result.blocks])
        rt.room_may_have_changed()
        if not _same(node, request_id, rt, req):
            raise FailedPrecondition(f"request {request_id!r} was released or handed off "
                                     "while it was read")
        named = req.blocks
        blocks, stall_s, more = await node.access_at_once(
            request_id, None if whole else [j for j in indices if named[j] is not None],
            scope, holder)
        stalled = stall_s or any(outcomes)
        return blocks, time.perf_counter() - started if stalled else 0.0, promoted + more
    blocks: list[Block] = []
    for r in reads:
        blocks += r.result.blocks
    return blocks, time.perf_counter() - started if any(outcomes) else 0.0, promoted


async def _hold_resident(node: Node, request_id: str, rt, req, parts: list[Sequence],
                         holder: str) -> list[Block]:
    """Hold for the holder the blocks a read names that are on the device and still, a
    slice at a time: the slices bringing the others in take no room from them. (The
    read holds them anyway once it has read them.) Returns them."""
    holds = rt.pool.pages.holds
    held = []
    for i, part in enumerate(parts):
        if i:
            await _next_slice(node, request_id, rt, req, "its blocks were held")
        named = req.blocks
        for j in part:
            b = named[j]
            if b is not None and b.tier is TierKind.DEVICE and not b.moving:
                holds.hold_one(holder, b)
                held.append(b)
    return held


async def evict(node: Node, rt: PoolRuntime, num_pages: int) -> list:
    """Node.evict of more than a slice's pages: the holds ending a slice at a time ended
    first (their holders called again), then refused whole when the pool has fewer victims
    now (as a whole evict is), else chosen a slice at a time, each slice's copies
    started before the next is chosen and all waited for at the end; the moves. Victims
    another call took meanwhile (read, held, pinned, freed) leave fewer for the last
    slices: those that find none end the evict, with the moves made."""
    pool = rt.pool
    while pool.end_more_holds(node.slice_blocks):  # what check_evict would end whole
        rt.room_may_have_changed()
        await asyncio.sleep(0)
    pool.check_evict(num_pages)
    moves: list = []
    copying = []
    try:
        while len(moves) < num_pages:
            if moves:
                await asyncio.sleep(0)
            n = min(node.slice_blocks, num_pages - len(moves))
            try:
                plan = await rt.run(lambda: pool.evict(n))
            except ResourceExhausted:
                if not moves:
                    raise
                log.info("operator's evict ended short: victims taken meanwhile",
                         pool=pool.name, asked=num_pages, evicted=len(moves))
                break
            started = rt.start(plan)
            if callable(started):
                copying.append(started())
            moves += plan.demotions
    finally:
        # The copies started finish (each settled by its own task) whatever stopped it.
        outcomes = await asyncio.gather(*copying, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome  # a copy failed: its plan was rolled back, as a whole evict's
    return moves


async def _checked(node: Node, request_id: str, rt, req, indices: Sequence[int],
                   parts: list[Sequence], call: str, done: str):
    """The blocks each part of a big call's indices names (none named twice, each a live
    block's, else the error that says which), the loop served between parts; a release of
    the request meanwhile ends the check, nothing done."""
    if len(set(indices)) != len(indices):
        raise InvalidArgument(f"duplicate block indices for request {request_id!r}")
    for i, part in enumerate(parts):
        if i:
            await _next_slice(node, request_id, rt, req,
                              f"its {call} was checked; nothing was {done}")
        yield resolve(req, part)


async def _next_slice(node: Node, request_id: str, rt, req, meanwhile: str) -> None:
    """The loop served before a big call's next slice; FailedPrecondition, saying what was
    done `meanwhile`, if the request was released or handed off in between."""
    await asyncio.sleep(0)
    if not _same(node, request_id, rt, req):
        raise FailedPrecondition(f"request {request_id!r} was released or handed off while "
                                 f"{meanwhile}")


def _same(node: Node, request_id: str, rt, req) -> bool:
    """Whether the request is still `req`, admitted in rt's pool."""
    return (node.request_index.get(request_id) is rt
            and rt.pool.requests.get(request_id) is req
            and req.state is RequestState.ADMITTED)


async def end_uses_down(node: Node, request_id: str, scope: str | None) -> int:
    """Before a release: end an admitted request's uses of shared blocks a slice at a time,
    newest first, while it uses more than a slice's (Pool.end_uses_of; the release ends
    the rest); the uses ended."""
    async def end(rt, req, newest: list[Block]) -> int:
        pinned = rt.pool.num_pinned
        rt.pool.end_uses_of(req, newest)
        rt.room_may_have_changed()
        node.unpinned(rt, pinned)
        return len(newest)

    return await _down(node, request_id, scope, lambda req: req.shared, end)


async def free_down(node: Node, request_id: str, scope: str | None) -> int:
    """Before a release: free an admitted request's blocks a slice at a time, newest first,
    while it has more than a slice's; the blocks freed. The release gives back the rest."""
    async def free(rt, req, newest: list[Block]) -> int:
        return await node.free_at_once(request_id, [b.index for b in newest], scope)

    return await _down(node, request_id, scope, lambda req: req.live, free)


async def _down(node: Node, request_id: str, scope: str | None, items, step) -> int:
    """While the admitted request has more than a slice's `items(req)`, `step(rt, req, the
    newest slice of them)`, the loop served between slices; what the steps did. Ends where
    a step is refused (KvdError) or would wait for blocks in transit: the release waits for
    them, or says what became of the request."""
    done = 0
    size = node.slice_blocks
    while True:
        rt = node.runtime_of(request_id, scope)
        req = rt.pool.requests.get(request_id)
        if req is None or req.state is not RequestState.ADMITTED or len(items(req)) <= size:
            return done
        try:
            done += await step(rt, req, items(req)[-size:])
        except (KvdError, BlocksInTransit):
            return done
        await asyncio.sleep(0)
