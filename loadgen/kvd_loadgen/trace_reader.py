"""Request traces: Mooncake's (`timestamp`, `input_length`, `output_length`, `hash_ids`) and
the simulator's (`request_id`, `arrival_ms`, `prompt_tokens`, `generated_tokens`, ...), read
into one shape, and a rule mapping requests to tenants."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class TraceError(ValueError):
    """A trace line that is not what its format says, with where it is."""


@dataclass(slots=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    line: int
    fields: dict

    @property
    def block_keys(self) -> list[bytes]:
        """The prompt's prefix blocks as kvd block keys: Mooncake's `hash_ids` (one per
        512-token block, equal for equal prefixes across requests), 8 bytes each; none for
        a trace without them."""
        return [h.to_bytes(8, "big") for h in self.fields.get("hash_ids", ())]


def _int(row: dict, key: str, minimum: int = 0) -> int:
    value = row.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _parse(row: dict, number: int) -> TraceRequest:
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    if "input_length" in row:  # Mooncake
        hash_ids = row.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**64
                for h in hash_ids):
            raise ValueError("hash_ids must be a list of integers in [0, 2**64)")
        return TraceRequest(f"req-{number}", _int(row, "timestamp") / 1000,
                            _int(row, "input_length", 1), _int(row, "output_length"),
                            number, row)
    if "prompt_tokens" in row:  # the simulator's request trace
        rid = row.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise ValueError("request_id must be a non-empty string")
        arrival = row.get("arrival_ms")
        if not isinstance(arrival, (int, float)) or arrival < 0:
            raise ValueError(f"arrival_ms must be a number >= 0, got {arrival!r}")
        return TraceRequest(rid, arrival / 1000, _int(row, "prompt_tokens", 1),
                            _int(row, "generated_tokens"), number, row)
    raise ValueError("neither a Mooncake row (input_length) nor a request-trace row "
                     "(prompt_tokens)")


def read_request_trace(path: str | Path, *, skip_bad: bool = False,
                       limit: int | None = None) -> list[TraceRequest]:
    """Requests in arrival order. A bad line is an error naming the file and line, unless
    skip_bad, when it is left out."""
    path = Path(path)
    out = []
    with open(path) as fh:
        for number, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                out.append(_parse(json.loads(text), number))
            except (ValueError, json.JSONDecodeError) as exc:
                if not skip_bad:
                    raise TraceError(f"{path}:{number}: {exc}") from None
            if limit and len(out) >= limit:  # None or 0: all
                break
    out.sort(key=lambda r: (r.arrival_s, r.line))
    return out


def tenant_rule(rule: str):
    """A function request -> tenant name, from a rule:
    `length:N` (prompt < N tokens: "short", else "long"), `round-robin:K` ("t0".."tK-1"),
    `field:NAME` (the value of that field of the row)."""
    kind, _, arg = rule.partition(":")
    if kind == "length" and arg.isdigit():
        threshold = int(arg)
        return lambda r: "short" if r.prompt_tokens < threshold else "long"
    if kind == "round-robin" and arg.isdigit() and int(arg) > 0:
        k = int(arg)
        return lambda r: f"t{r.line % k}"
    if kind == "field" and arg:
        return lambda r: str(r.fields.get(arg, "default"))
    raise ValueError(f"unknown tenant rule {rule!r}: use length:N, round-robin:K or field:NAME")
