"""Protobuf <-> domain conversions."""

from __future__ import annotations

from kvd.core.admission import Decision
from kvd.core.blocks import Block
from kvd.core.intent import IntentChange
from kvd_api.v1 import kvd_pb2 as pb

DECISIONS = {
    Decision.ADMITTED: pb.DECISION_ADMITTED,
    Decision.QUEUED: pb.DECISION_QUEUED,
    Decision.REJECTED: pb.DECISION_REJECTED,
}


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
    block.seen_epoch = block.epoch
    lost, block.lost = block.lost, False
    return pb.PageHandle(
        request_id=block.request.request_id[ns:],
        block_index=block.index,
        pool=block.request.pool,
        tier=int(block.tier),
        page_index=block.page,
        offset_bytes=block.page * page_bytes,
        length_bytes=page_bytes,
        recompute=lost,
    )


def indices(message) -> list[int] | None:
    return None if message.all_blocks else list(message.block_indices)
