"""Belady's MIN fed by the engine's hints: evict the block needed furthest in the future."""

from __future__ import annotations

import math

from kvd.core.blocks import Block
from kvd.core.policies.classed import ClassedPolicy, log_bucket
from kvd.core.policies.intent import intent_rank

# Deadlines are ordered to the millisecond: an engine steps every 10-50 ms, so blocks due
# within the same millisecond are due at the same step, and the finer order is left to the
# tie-breakers (and to recency). It keeps the number of classes to the deadlines' span in ms.
DEADLINE_RESOLUTION_S = 1e-3


class DeadlinePolicy(ClassedPolicy):
    """Orders by absolute deadline (furthest first; no deadline counts as never needed), then
    by target decode step, slack (more slack goes first, to a quarter-octave), intent rank,
    recompute cost, and recency. Deadlines are absolute on kvd's clock, so classes do not drift
    as time passes."""

    name = "deadline"
    uses_intent = True

    def klass(self, block: Block) -> tuple:
        """The block's class (smallest evicted first): the furthest deadline, then the furthest
        target decode step, then the most slack, then intent and recompute cost."""
        due = block.deadline_at
        next_use = math.inf if due is None else math.floor(due / DEADLINE_RESOLUTION_S)
        target = block.target_decode_step if block.target_decode_step is not None else math.inf
        return (-next_use, -target, -log_bucket(block.slack_us), intent_rank(block),
                log_bucket(block.recompute_cost_us))
