"""MemoryIntent: what an engine says about a block (DESIGN.md, "What kvd decides": the
engine's intent), checked before anything changes and applied to the block.

The pool applies a batch all or none (Pool.update_intents); this module holds what a
single update means: which fields exist and their ranges, and whether a block is pinned
once an update is applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvd.core.blocks import INTENT_BOOL_FIELDS, INTENT_INT_FIELDS, Block, Phase, Priority
from kvd.core.errors import InvalidArgument

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


def apply(block: Block, fields: dict[str, Any], now: float) -> None:
    """Set the block's intent fields (validated before) and its derived flags."""
    for name, value in fields.items():
        if name == "deadline_us":
            block.deadline_at = now + value / 1e6
        elif name == "phase":
            block.phase = Phase(value)
        elif name == "priority":
            block.priority = Priority(value)
        else:
            setattr(block, name, value)
    block.refresh_flags()
