"""Intent-event traces (shared/data/INTENT_TRACE_FORMAT.md): reading and validating them."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

EVENT_TYPES = frozenset({
    "ALLOCATED", "ACCESSED", "COMMITTED", "MARKED_DECODE_CRITICAL", "MARKED_COLD", "SPILLED",
    "PREFETCHED", "MISS", "EVICTED", "FREED",
})
PHASES = ("PREFILL", "DECODE", "VERIFY", "ROLLBACK", "DONE", "IDLE")
PRIORITIES = ("COLD", "WARM", "HOT", "DECODE_CRITICAL")


class TraceError(ValueError):
    """A line of a trace that is not what the format says, with where it is."""


@dataclass(slots=True)
class IntentEvent:
    line: int
    step: int
    event_type: str
    intent: dict

    @property
    def object_id(self) -> str:
        return self.intent["object_id"]

    @property
    def request_id(self) -> str:
        return self.intent.get("request_id") or self.object_id.split(":", 1)[0]

    @property
    def decode_critical(self) -> bool:
        return (self.intent.get("priority") == "DECODE_CRITICAL"
                or self.intent.get("phase") == "DECODE")


def _check(event: dict) -> IntentEvent:
    if not isinstance(event, dict):
        raise ValueError("not a JSON object")
    step, kind, intent = event.get("step"), event.get("event_type"), event.get("intent")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if kind not in EVENT_TYPES:
        raise ValueError(f"unknown event_type {kind!r}")
    if not isinstance(intent, dict):
        raise ValueError("intent must be an object")
    if not intent.get("object_id"):
        raise ValueError("intent.object_id must be a non-empty string")
    if intent.get("phase") not in PHASES:
        raise ValueError(f"unknown phase {intent.get('phase')!r}")
    if intent.get("priority") not in PRIORITIES:
        raise ValueError(f"unknown priority {intent.get('priority')!r}")
    size = intent.get("size_bytes")
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"size_bytes must be a positive integer, got {size!r}")
    return IntentEvent(0, step, kind, intent)


def read_intent_trace(path: str | Path, *, skip_bad: bool = False) -> list[IntentEvent]:
    """Every event of a trace (.jsonl or .jsonl.gz). A bad line is an error naming the file and
    line number, unless skip_bad, when it is left out."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    events = []
    with opener(path, "rt") as fh:
        for number, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                event = _check(json.loads(text))
            except (ValueError, json.JSONDecodeError) as exc:
                if skip_bad:
                    continue
                raise TraceError(f"{path}:{number}: {exc}") from None
            event.line = number
            events.append(event)
    return events
