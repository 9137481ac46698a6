"""kvd's MemoryIntent as TensorRT-LLM's KvCacheRetentionConfig, for whoever submits requests
to TensorRT-LLM (which cannot call kvd from inside: it takes retention per request at submit).

TensorRT-LLM evicts its reusable blocks by priority (0-100; 35 by default), each priority
holding for a duration after which the block falls back to the default. An intent maps to:

| intent | priority | duration |
|---|---|---|
| pinned (pin_requested, or DECODE_CRITICAL) | 100 | none (held while it is used) |
| HOT | 80 | until the deadline, if any |
| WARM | 50 | until the deadline, if any |
| COLD | 10 | until the deadline, if any |
| none | 35 (TensorRT-LLM's default) | until the deadline, if any |

request_priority (0-100), when given, breaks ties within a class: it moves the priority up to
9 points within its band. The prompt's tokens and the decode tokens get the same retention.
Follows TensorRT-LLM 1.x's `tensorrt_llm.llmapi.KvCacheRetentionConfig` (token ranges of
(start, end, priority, duration), decode_retention_priority, decode_duration_ms).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from kvd_api.v1 import kvd_pb2 as pb

DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority
_BY_CLASS = {pb.PRIORITY_HOT: 80, pb.PRIORITY_WARM: 50, pb.PRIORITY_COLD: 10}


@dataclass(frozen=True)
class TokenRange:
    token_start: int
    token_end: int | None  # None: to the end of the sequence
    priority: int
    duration_ms: int | None  # None: for as long as the block is reused


@dataclass(frozen=True)
class Retention:
    """A KvCacheRetentionConfig's fields; to_trtllm() builds TensorRT-LLM's own."""

    token_range_retention_configs: tuple[TokenRange, ...]
    decode_retention_priority: int
    decode_duration_ms: int | None

    def to_trtllm(self) -> Any:
        """TensorRT-LLM's KvCacheRetentionConfig (needs tensorrt_llm)."""
        from tensorrt_llm.llmapi import KvCacheRetentionConfig

        def duration(ms):
            return None if ms is None else timedelta(milliseconds=ms)

        ranges = [KvCacheRetentionConfig.TokenRangeRetentionConfig(
            r.token_start, r.token_end, r.priority, duration(r.duration_ms))
            for r in self.token_range_retention_configs]
        return KvCacheRetentionConfig(ranges, self.decode_retention_priority,
                                      duration(self.decode_duration_ms))


def retention(intent: pb.MemoryIntent | dict | None) -> Retention:
    """The retention TensorRT-LLM should give a request whose blocks have this intent."""
    if isinstance(intent, dict):
        intent = pb.MemoryIntent(**intent)
    intent = intent or pb.MemoryIntent()
    klass = intent.priority if intent.HasField("priority") else pb.PRIORITY_UNSPECIFIED
    if intent.pin_requested or klass == pb.PRIORITY_DECODE_CRITICAL:
        priority, duration_ms = 100, None
    else:
        priority = _BY_CLASS.get(klass, DEFAULT_PRIORITY)
        if intent.HasField("request_priority"):
            priority += min(9, max(0, intent.request_priority) // 11)
        duration_ms = (max(1, intent.deadline_us // 1000)
                       if intent.HasField("deadline_us") and intent.deadline_us > 0 else None)
    return Retention((TokenRange(0, None, priority, duration_ms),), priority, duration_ms)
