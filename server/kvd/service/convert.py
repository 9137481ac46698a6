"""Protobuf <-> domain conversions."""

from __future__ import annotations

from kvd.core.blocks import INTENT_BOOL_FIELDS, INTENT_INT_FIELDS, Block
from kvd.core.pool import IntentChange
from kvd_api.v1 import kvd_pb2 as pb

_INTENT_FIELDS = (
    "phase", "priority", "deadline_us", "request_priority", "recency_score",
    *INTENT_INT_FIELDS, *INTENT_BOOL_FIELDS,
)

DECISIONS = {
    "admitted": pb.DECISION_ADMITTED,
    "queued": pb.DECISION_QUEUED,
    "rejected": pb.DECISION_REJECTED,
}


def intent_change(update: pb.IntentUpdate) -> IntentChange:
    intent = update.intent
    fields = {name: getattr(intent, name) for name in _INTENT_FIELDS if intent.HasField(name)}
    return IntentChange(update.request_id, update.block_index, fields, update.prefetch)


def handle(block: Block, page_bytes: int) -> pb.PageHandle:
    block.seen_epoch = block.epoch
    return pb.PageHandle(
        request_id=block.request.request_id,
        block_index=block.index,
        pool=block.request.pool,
        tier=int(block.tier),
        page_index=block.page,
        offset_bytes=block.page * page_bytes,
        length_bytes=page_bytes,
    )


def indices(message) -> list[int] | None:
    return None if message.all_blocks else list(message.block_indices)
