"""Belady's MIN, computed offline on an intent trace: the fewest misses any replacement policy
could have with the same device capacity, knowing the whole future."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from kvd_loadgen.intent_trace import IntentEvent


@dataclass(slots=True)
class MinResult:
    accesses: int
    misses: int
    decode_critical_accesses: int
    decode_critical_misses: int
    # Blocks brought to the cache: misses, and prefetched blocks that were not resident.
    fetches: int = 0


def belady_min(events: list[IntentEvent], capacity: int,
               must_place: bool = False, prefetches: bool = False) -> MinResult:
    """References are ALLOCATED (the block must be placed) and ACCESSED (a miss when it is not
    resident); FREED ends a block. On a placement into a full cache, whichever block is used
    furthest in the future goes, which may be the incoming block itself (a bypass).

    must_place: no bypass: the incoming block always goes in (a resident one goes), as in kvd,
    where the engine writes an allocated block into the page it is handed and reads an
    accessed one from the device. The optimum kvd's policies can be held to.

    prefetches: PREFETCHED is a reference too: the block is brought in (a fetch when it is
    not resident, not a miss), as kvd's intent-aware policies do when the engine asks."""
    kinds = ("ALLOCATED", "ACCESSED", "FREED") + (("PREFETCHED",) if prefetches else ())
    refs = []
    live: set[str] = set()
    for e in events:  # as the replay sends them: events of blocks not allocated are skipped
        if e.event_type not in kinds:
            continue
        if e.event_type == "ALLOCATED":
            live.add(e.object_id)
        elif e.object_id not in live:
            continue
        elif e.event_type == "FREED":
            live.discard(e.object_id)
        refs.append((e.event_type, e.object_id, e.decode_critical))
    next_use = [math.inf] * len(refs)
    seen: dict[str, float] = {}
    for i in range(len(refs) - 1, -1, -1):
        kind, obj, _ = refs[i]
        if kind == "FREED":
            seen[obj] = math.inf
        else:
            next_use[i] = seen.get(obj, math.inf)
            seen[obj] = i
    resident: dict[str, float] = {}  # object -> its next use
    heap: list[tuple[float, str]] = []  # (-next use, object), lazily invalidated
    result = MinResult(0, 0, 0, 0)
    for i, (kind, obj, critical) in enumerate(refs):
        if kind == "FREED":
            resident.pop(obj, None)
            continue
        nxt = next_use[i]
        if kind == "ACCESSED":
            result.accesses += 1
            result.decode_critical_accesses += critical
        if obj in resident:
            resident[obj] = nxt
            heapq.heappush(heap, (-nxt, obj))
            continue
        if kind == "ACCESSED":
            result.misses += 1
            result.decode_critical_misses += critical
        if kind != "ALLOCATED":
            result.fetches += 1
        if len(resident) < capacity:
            resident[obj] = nxt
            heapq.heappush(heap, (-nxt, obj))
            continue
        while True:  # the resident block used furthest in the future
            neg, victim = heap[0]
            if resident.get(victim) == -neg:
                break
            heapq.heappop(heap)
        if nxt >= -neg and not must_place:
            continue  # the incoming block is needed last of all: bypass it
        heapq.heappop(heap)
        del resident[victim]
        resident[obj] = nxt
        heapq.heappush(heap, (-nxt, obj))
    return result
