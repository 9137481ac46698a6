"""A pool's running counters: what metrics, GetPoolStats and the load generator read."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class PoolCounters:
    """Monotonic counts of a pool's events since it started (peak_device_pages: a high-water
    mark)."""

    num_evictions: int = 0
    num_demotions: int = 0
    num_promotions: int = 0
    num_drops: int = 0
    num_rematerializations: int = 0
    # Dropped blocks brought back as zeroed pages, flagged for the engine to recompute.
    num_lost_blocks: int = 0
    bytes_moved: int = 0
    num_decode_critical_accesses: int = 0
    num_decode_critical_misses: int = 0
    num_deadline_misses: int = 0
    num_accesses: int = 0
    num_misses: int = 0
    num_prefetches: int = 0
    num_admitted: int = 0
    num_queued: int = 0
    num_rejected: int = 0
    # Prefix blocks: keys engines looked up and the blocks found for them (the leading run
    # of each lookup), blocks handed out by loads, and blocks committed (written, found by
    # lookups from then on).
    num_prefix_looked_up: int = 0
    num_prefix_hits: int = 0
    num_prefix_loaded: int = 0
    num_prefix_stored: int = 0
    stall_seconds_total: float = 0.0
    peak_device_pages: int = 0
    evictions_by_reason: Counter = field(default_factory=Counter)
