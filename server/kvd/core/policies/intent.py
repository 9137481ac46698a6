"""Evicts by what the engine said about each block."""

from __future__ import annotations

import math

from kvd.core.blocks import Block, Phase, Priority
from kvd.core.policies.classed import ClassedPolicy, log_bucket

# Smaller rank goes first. Finished blocks and speculative drafts not yet committed are the
# cheapest to lose; then COLD, WARM, HOT.
_RANK_FINISHED = 0
_RANK_DRAFT = 1
_PRIORITY_RANK = {
    Priority.COLD: 2,
    Priority.UNSPECIFIED: 3,
    Priority.WARM: 3,
    Priority.HOT: 4,
    Priority.DECODE_CRITICAL: 5,
}


def intent_rank(block: Block) -> int:
    """How valuable the block is by its intent alone (shared with the deadline policy)."""
    if block.phase in (Phase.DONE, Phase.ROLLBACK):
        return _RANK_FINISHED
    if block.is_draft and not block.is_committed:
        return _RANK_DRAFT
    if block.phase == Phase.IDLE:
        return _PRIORITY_RANK[Priority.COLD]
    return _PRIORITY_RANK[block.priority]


class IntentPolicy(ClassedPolicy):
    """DONE and drafts, then COLD, WARM, HOT; within a priority, the block the engine needs
    furthest in the future first (its target decode step: Belady's choice on the engine's own
    hint; a block with none counts as never needed); then lower request priority first;
    cheap-to-recompute before expensive (to a quarter of an octave); least recently read last
    of all."""

    name = "intent"
    uses_intent = True

    def klass(self, block: Block) -> tuple:
        """The block's class from its intent (smallest evicted first): intent rank, then the
        furthest target decode step, then the request's priority, then how costly it is to
        recompute."""
        target = block.target_decode_step
        return (intent_rank(block), -math.inf if target is None else -target,
                block.request_priority, log_bucket(block.recompute_cost_us))
