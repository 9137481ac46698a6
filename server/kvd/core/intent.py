"""MemoryIntent: what an engine says about a block (DESIGN.md, "What kvd decides": the
engine's intent), checked before anything changes and applied to the block.

This module holds what a single update means (which fields exist and their ranges, whether
a block is pinned once an update is applied) and `Intents`, which applies a batch all or none
to a pool's blocks: pins counted against the device tier, the policy's order, and the
prefetches the batch asks for.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvd.core.blocks import (
    INTENT_BOOL_FIELDS,
    INTENT_INT_FIELDS,
    Block,
    Phase,
    Priority,
    Request,
    TierKind,
)
from kvd.core.counters import PoolCounters
from kvd.core.errors import BlocksInTransit, InvalidArgument, ResourceExhausted
from kvd.core.requests import resolve
from kvd.core.transfer import Reason, TransferPlan

if TYPE_CHECKING:
    from kvd.core.pages import PageTable

# Costs must be non-negative; deadlines and slack may be negative (already overdue).
_NON_NEGATIVE_FIELDS = frozenset(
    {"recompute_cost_us", "spill_cost_us", "expected_reuse_window_tokens"}
)
# The fields that decide whether a block is pinned (see pinned_after).
PIN_FIELDS = ("pin_requested", "priority")


@dataclass(slots=True)
class IntentChange:
    """One block's intent update: only the fields present in `fields` change."""

    request_id: str
    block_index: int
    fields: dict[str, Any]
    prefetch: bool = False


def validate(fields: dict[str, Any]) -> None:
    """Raise InvalidArgument for an unknown field or a value out of its range."""
    for name, value in fields.items():
        if name == "phase":
            if value not in Phase._value2member_map_ or value == Phase.UNSPECIFIED:
                raise InvalidArgument(f"unknown phase {value!r}")
        elif name == "priority":
            if value not in Priority._value2member_map_ or value == Priority.UNSPECIFIED:
                raise InvalidArgument(f"unknown priority {value!r}")
        elif name == "request_priority":
            if not 0 <= value <= 100:
                raise InvalidArgument(f"request_priority must be 0..100, got {value}")
        elif name == "recency_score":
            if not (0.0 <= value <= 1.0):
                raise InvalidArgument(f"recency_score must be 0..1, got {value}")
        elif name in _NON_NEGATIVE_FIELDS:
            if value < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {value}")
        elif (name not in INTENT_INT_FIELDS and name not in INTENT_BOOL_FIELDS
              and name != "deadline_us"):
            raise InvalidArgument(f"unknown intent field {name!r}")


def pinned_after(block: Block, fields: dict[str, Any]) -> bool:
    """Whether `block` is pinned once `fields` apply: a pin asked for, or decode-critical."""
    pin = fields.get("pin_requested", block.pin_requested)
    priority = fields.get("priority", block.priority)
    return bool(pin) or priority == Priority.DECODE_CRITICAL


def apply(block: Block, fields: dict[str, Any], now: float) -> bool:
    """Set the block's intent fields (validated before) and its derived flags; whether it
    turned decode-critical or stopped being so (see Block.refresh_flags)."""
    for name, value in fields.items():
        if name == "deadline_us":
            block.deadline_at = now + value / 1e6
        elif name == "phase":
            block.phase = Phase(value)
        elif name == "priority":
            block.priority = Priority(value)
        else:
            setattr(block, name, value)
    return block.refresh_flags()


class Intents:
    """Applies batches of intent updates to one pool's blocks. `admitted` finds a request
    that may use pages (the pool's request table)."""

    def __init__(self, pages: PageTable, counters: PoolCounters,
                 admitted: Callable[[str], Request]) -> None:
        self.pages = pages
        self.counters = counters
        self.admitted = admitted

    def check(self, changes: Sequence[IntentChange], final: dict) -> None:
        """Validate a slice of a batch without changing anything, adding each block's
        pin-deciding state as the batch leaves it to `final`; check_pins(final) after the
        last slice checks the batch's pins."""
        self._resolve(changes, final)

    def check_pins(self, final: dict) -> None:
        """A batch whose blocks end in these states must not pin more than the device, nor
        take a page another tenant is guaranteed (PageTable.check_pins)."""
        more: Counter[str] = Counter()
        for b, state in final.items():
            more[b.request.tenant] += pinned_after(b, state) - b.pinned
        self.pages.check_pins(more)

    def _resolve(self, changes: Sequence[IntentChange], final: dict) -> list:
        # Each block's pin-deciding fields as the batch leaves them: a block named twice
        # counts once, in its final state (an unpin repeated is one unpin).
        resolved = []
        for change in changes:
            req = self.admitted(change.request_id)
            (block,) = resolve(req, [change.block_index])
            validate(change.fields)
            state = final.setdefault(block, {})
            for name in PIN_FIELDS:
                if name in change.fields:
                    state[name] = change.fields[name]
            resolved.append((block, change))
        return resolved

    def update(self, changes: Sequence[IntentChange], now: float) -> TransferPlan | None:
        """Apply a batch of intent updates (all or none) and return a prefetch plan for blocks
        that asked for one or became pinned outside the device tier (None if nothing to do)."""
        final: dict[Block, dict[str, Any]] = {}
        resolved = self._resolve(changes, final)
        self.check_pins(final)
        pages = self.pages
        policy = pages.policy
        to_prefetch: list[Block] = []
        for block, change in resolved:
            was_pinned = block.pinned
            if apply(block, change.fields, now):
                pages.changes.note(block.request)
            resident = (block.tier is TierKind.DEVICE and not block.moving
                        and not block.held)
            if block.pinned != was_pinned:
                pages.add_pins(block.request.tenant, 1 if block.pinned else -1)
                if resident:
                    (policy.remove if block.pinned else policy.insert)(block)
            elif resident and not block.pinned:
                policy.reorder(block)
            wants = change.prefetch or (block.pinned and not was_pinned)
            if (wants and policy.uses_intent and block.tier is not TierKind.DEVICE
                    and not block.moving):
                if block not in to_prefetch:
                    to_prefetch.append(block)
        return self.prefetch(to_prefetch)

    def prefetch(self, blocks: list[Block]) -> TransferPlan | None:
        """Promote what fits of `blocks` ahead of their access; a hint, so no room is no
        error."""
        pages = self.pages
        blocks = [b for b in blocks if b.tier is not TierKind.DEVICE and not b.moving]
        room = pages.device.num_free + len(pages.policy)
        # Pinned blocks first: a decode step is waiting on them.
        blocks.sort(key=lambda b: not b.pinned)
        blocks = blocks[:room]
        while blocks:
            try:
                plan = pages.promote(None, blocks, (), Reason.PREFETCH)
            except (ResourceExhausted, BlocksInTransit):  # fewer, or none until copies land
                blocks = blocks[: len(blocks) // 2]
                continue
            self.counters.num_prefetches += len(blocks)
            return plan
        return None
