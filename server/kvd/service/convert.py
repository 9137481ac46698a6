"""Protobuf <-> domain conversions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextvars import ContextVar

from kvd import sliced
from kvd.core.admission import Decision
from kvd.core.blocks import Block, TierKind, public_id
from kvd.core.intent import IntentChange
from kvd.service.auth import namespace
from kvd.stats import LinkFigures, PoolFigures, TenantFigures
from kvd_api.v1 import kvd_pb2 as pb

DECISIONS = {
    Decision.ADMITTED: pb.DECISION_ADMITTED,
    Decision.QUEUED: pb.DECISION_QUEUED,
    Decision.REJECTED: pb.DECISION_REJECTED,
}


def pool_export(rt) -> pb.ExportPoolResponse:
    """A pool's arenas as an engine maps them (ExportPool): each tier's shared memory or
    CUDA IPC handle. `rt`: the pool's PoolRuntime."""
    tiers = []
    for tier, key in ((pb.TIER_DEVICE, "device"), (pb.TIER_HOST, "host")):
        export = rt.arenas[key].export()
        tiers.append(pb.TierExport(
            tier=tier, backend=export.backend, num_pages=export.num_pages,
            shm_name=export.shm_name, cuda_ipc_handle=export.cuda_ipc_handle,
            cuda_device=export.cuda_device, arena_bytes=export.arena_bytes))
    return pb.ExportPoolResponse(pool=rt.pool.name, page_bytes=rt.pool.page_bytes,
                                 tiers=tiers)


def intent_fields(intent: pb.MemoryIntent) -> dict:
    """The fields an update carries (proto3 optional: presence is known)."""
    return {field.name: value for field, value in intent.ListFields()}


def intent_change(update: pb.IntentUpdate, ns: str = "") -> IntentChange:
    return IntentChange(ns + update.request_id, update.block_index,
                        intent_fields(update.intent), update.prefetch)


def handle(block: Block, page_bytes: int, ns: int = 0) -> pb.PageHandle:
    """The block's page as the engine addresses it. The engine is told here that the block
    moved (its epoch is seen) and, once, that its bytes are lost and must be recomputed.
    `ns`: the length of the namespace the caller's request ids are kept in (not shown)."""
    return pb.PageHandle(**_told(block, page_bytes, ns, TOLD.get()))


def add_handles(handles, blocks: Iterable[Block], page_bytes: int, ns: int = 0) -> None:
    """Append the blocks' handles (see handle) to a reply's repeated PageHandle field, each
    made in place (a made handle appended is copied)."""
    told = TOLD.get()
    for block in blocks:
        if its_own(block):  # not freed by another call since (see its_own)
            handles.add(**_told(block, page_bytes, ns, told))


async def add_handles_sliced(handles, blocks: list[Block], page_bytes: int, ns: int,
                             size: int) -> None:
    """add_handles() `size` blocks at a time, the loop served between slices (a reply with
    tens of thousands of handles: see sliced). The blocks are the caller's holder's, held
    until its next call: none moves meanwhile."""
    async for _, part in sliced.served_slices(blocks, size):
        add_handles(handles, part, page_bytes, ns)


# Where a Step stream keeps what its latest reply tells (see Told); None elsewhere.
TOLD: ContextVar[Told | None] = ContextVar("told", default=None)


class Told:
    """What a Step stream's latest reply told the engine of each block in it: (block, its
    epoch, whether it was lost). kvd takes a block as told once the reply is made. An
    engine steps in turn (its next message comes after it read the reply); a stream that
    ends before its next message may not have had that reply read (the engine restarted,
    the connection broke: gRPC shows kvd a cancelled stream as one its client closed), so
    what the reply told is told again at the next read (retell), rather than have the
    engine use a page its block left, or take zeros for its bytes. A client that read
    every reply ends with an empty message (StepStream.close) and is told nothing twice."""

    __slots__ = ("blocks",)

    def __init__(self) -> None:
        self.blocks: list[tuple[Block, int, bool]] = []

    def heard(self) -> None:
        """The engine sent its next message: it read the reply before (Step is in step)."""
        if self.blocks:
            self.blocks = []

    def retell(self, pools: Mapping) -> None:
        """Tell the blocks of the last reply again at their next read: their page (as if
        moved since) and, for a lost one, that its bytes must be recomputed. A block gone
        since is left as it is. `pools`: the node's PoolRuntimes by name."""
        for block, epoch, lost in self.blocks:
            req = block.request
            rt = pools.get(req.pool)
            if (rt is None or rt.pool.requests.get(req.request_id) is not req
                    or not its_own(block)):
                continue
            block.lost = block.lost or lost
            if block.seen_epoch == epoch:  # else it moved since, and is told anyway
                block.seen_epoch = epoch - 1
            req.untold[block] = None
            req.maybe_relocated = True
            rt.pool.pages.changes.note(req)  # a step's answer kept looks at it again
        self.blocks = []


def its_own(block: Block) -> bool:
    """Whether the block is still its request's: not freed, nor released with it."""
    blocks = block.request.blocks
    return block.index < len(blocks) and blocks[block.index] is block


def _told(block: Block, page_bytes: int, ns: int, told: Told | None) -> dict:
    """A PageHandle's fields for the block, the engine told (see handle); kept in `told`, a
    Step stream's (TOLD), if any."""
    block.seen_epoch = block.epoch
    block.request.untold.pop(block, None)
    lost, block.lost = block.lost, False
    if told is not None:
        told.blocks.append((block, block.epoch, lost))
    return {"request_id": block.request.request_id[ns:], "block_index": block.index,
            "pool": block.request.pool, "tier": int(block.tier), "page_index": block.page,
            "offset_bytes": block.page * page_bytes, "length_bytes": page_bytes,
            "recompute": lost}


async def add_shared_handles(handles, blocks: list[Block], page_bytes: int,
                             request_id: str, size: int) -> None:
    """Append the handles of shared blocks to a reply's repeated PageHandle field, each
    addressed by the caller's request and its key's position (not its keeper's request and
    index) and made in place, `size` blocks at a time, the loop served between slices (as
    add_handles_sliced: the blocks are the caller's holder's until its next call)."""
    told = TOLD.get()
    async for start, part in sliced.served_slices(blocks, size):
        for i, block in enumerate(part, start):
            fields = _told(block, page_bytes, 0, told)
            fields["request_id"], fields["block_index"] = request_id, i
            handles.add(**fields)


def indices(message) -> list[int] | None:
    """The block indices an access names (None: all of its request's blocks)."""
    return None if message.all_blocks else message.block_indices[:]


_TIERS = {TierKind.DEVICE: pb.TIER_DEVICE, TierKind.HOST: pb.TIER_HOST}


def link_stats(f: LinkFigures) -> pb.LinkStats:
    return pb.LinkStats(
        link=f.name, capacity_bytes_per_s=f.capacity_bps, burst_bytes=f.burst_bytes,
        scheduling=f.scheduling, bytes_total=f.bytes_total, transfers_total=f.transfers_total,
        utilisation=f.bytes_last_s / f.capacity_bps, busy_seconds=f.busy_s,
        queues=[pb.LinkStats.Queue(transfer_class=cls, transfers=n, bytes=b)
                for cls, (n, b) in f.queues.items()],
        tenants=[pb.LinkStats.TenantBytes(tenant=t.tenant, bytes=t.bytes, weight=t.weight,
                                          cap_bytes_per_s=t.cap_bytes_per_s)
                 for t in f.tenants])


def tenant_info(f: TenantFigures) -> pb.TenantInfo:
    q = f.quota
    return pb.TenantInfo(
        tenant=f.tenant, pool=f.pool, weight=q.weight, guaranteed_pages=q.guaranteed,
        limit_pages=q.limit or 0, max_request_pages=q.max_request_pages or 0,
        max_request_fraction=q.max_request_fraction or 0.0,
        device_pages=f.device_pages, reserved_pages=f.reserved_pages,
        queued_pages=f.queued_pages, fair_share_pages=f.fair_share_pages,
        evictions_suffered=f.evictions_suffered, evictions_caused=f.evictions_caused,
        stalls_by_cause=[pb.TenantStallByCause(cause_tenant=cause, stall_seconds=secs)
                         for cause, secs in f.stalls_by_cause],
        pinned_pages=f.pinned_pages, bytes_moved=f.bytes_moved, bytes_read=f.bytes_read,
        bandwidth_cap_bytes_per_s=q.bandwidth_cap or 0.0,
        read_budget_bytes_per_s=q.read_budget or 0.0, charged_pages=f.charged_pages,
        shared_pages=f.shared_pages, shared_saved_pages=f.shared_saved_pages,
        engine_gpu_blocks=f.engine_gpu_blocks)


def pool_stats(f: PoolFigures) -> pb.PoolStats:
    c = f.counters
    return pb.PoolStats(
        pool=f.name, policy=f.policy, page_bytes=f.page_bytes, block_tokens=f.block_tokens,
        tiers=[pb.TierStats(tier=_TIERS[t.kind], backend=t.backend, capacity_pages=t.capacity,
                            used_pages=t.used, free_pages=t.free, pinned_pages=t.pinned)
               for t in f.tiers],
        num_requests=f.num_requests, num_queued=f.num_queued,
        reserved_pages=f.reserved_pages, num_evictions=c.num_evictions,
        num_demotions=c.num_demotions, num_promotions=c.num_promotions,
        num_drops=c.num_drops, bytes_moved=c.bytes_moved,
        num_decode_critical_accesses=c.num_decode_critical_accesses,
        num_decode_critical_misses=c.num_decode_critical_misses,
        num_deadline_misses=c.num_deadline_misses,
        stall_seconds_total=c.stall_seconds_total, peak_device_pages=c.peak_device_pages,
        num_prefetches=c.num_prefetches, num_accesses=c.num_accesses,
        num_misses=c.num_misses, links=[link_stats(link) for link in f.links],
        bytes_read=f.bytes_read, handoff_reserved_pages=f.handoff_reserved_pages,
        num_admitted=c.num_admitted, num_lost_blocks=c.num_lost_blocks,
        held_pages=f.held_pages, admission=f.admission,
        working_set_pages=f.working_set_pages,
        working_set_capacity_pages=f.working_set_capacity_pages,
        num_prefix_looked_up=c.num_prefix_looked_up, num_prefix_hits=c.num_prefix_hits,
        num_prefix_loaded=c.num_prefix_loaded, num_prefix_stored=c.num_prefix_stored)


def explain_response(explained, scope: str | None = None) -> pb.ExplainResponse:
    """A request's account; a tenant (scope) sees other tenants' requests by tenant only."""
    account = explained.account

    def cause(key):
        return pb.Cause(tenant=key[0], request_id=shown_id(key[0], key[1], scope))

    return pb.ExplainResponse(
        request_id=shown_id(account.tenant, account.request_id, scope),
        tenant=account.tenant,
        pool=explained.pool,
        active=explained.active,
        stall_seconds=account.stall_s,
        num_stalls=account.num_stalls,
        stalls_by_cause=[pb.StallShare(cause=cause(k), stall_seconds=v)
                         for k, v in account.stall_s_by_cause.most_common()],
        evictions_suffered=[pb.EvictionCount(other=cause(k), count=v)
                            for k, v in account.evictions_suffered.most_common()],
        evictions_caused=[pb.EvictionCount(other=cause(k), count=v)
                          for k, v in account.evictions_caused.most_common()],
        num_recomputes=account.num_recomputes,
        request_shares=_shares(explained.request_shares),
        tenant_shares=_shares(explained.tenant_shares),
    )


def _shares(s) -> pb.Shares:
    return pb.Shares(num_blocks=s.num_blocks, shared_pages=s.shared_pages,
                     charged_pages=s.charged_pages, saved_pages=s.saved_pages)


def redacted(detail: dict, scope: str | None) -> dict:
    if "cause_request" in detail and scope is not None:
        return {**detail, "cause_request": shown_id(detail["cause_tenant"],
                                                   detail["cause_request"], scope)}
    return detail


def shown_id(tenant: str, request_id: str, scope: str | None) -> str:
    """A request id as this caller may see it: the admin (None) sees all, whole; a tenant
    sees its own without their namespace (one the admin chose for it, whole) and other
    tenants' not at all. A keeper's id is no request's (public_id)."""
    if scope is None:
        return public_id(request_id)
    return public_id(request_id).removeprefix(namespace(scope)) if tenant == scope else ""
