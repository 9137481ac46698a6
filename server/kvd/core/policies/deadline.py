"""Belady's MIN fed by the engine's hints: evict the block needed furthest in the future."""

from __future__ import annotations

import math

from kvd.core.blocks import Block
from kvd.core.policies.intent import intent_rank
from kvd.core.policies.scored import ScoredPolicy


class DeadlinePolicy(ScoredPolicy):
    """Orders by absolute deadline (furthest first; no deadline counts as never needed), then
    by target decode step, slack (more slack goes first), intent rank, recompute cost, and
    recency. Deadlines are absolute on kvd's clock, so scores do not drift as time passes."""

    name = "deadline"
    uses_intent = True

    def score(self, block: Block) -> tuple:
        next_use = block.deadline_at if block.deadline_at is not None else math.inf
        target = block.target_decode_step if block.target_decode_step is not None else math.inf
        slack = block.slack_us if block.slack_us is not None else 0
        cost = block.recompute_cost_us if block.recompute_cost_us is not None else 0
        return (-next_use, -target, -slack, intent_rank(block), cost, block.last_access)
