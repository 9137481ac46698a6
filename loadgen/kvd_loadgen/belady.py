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


def belady_min(events: list[IntentEvent], capacity: int,
               must_place: bool = False) -> MinResult:
    """References are ALLOCATED (the block must be placed) and ACCESSED (a miss when it is not
    resident); FREED ends a block. On a placement into a full cache, whichever block is used
    furthest in the future goes, which may be the incoming block itself (a bypass).

    must_place: no bypass: the incoming block always goes in (a resident one goes), as in kvd,
    where the engine writes an allocated block into the page it is handed and reads an
    accessed one from the device. The optimum kvd's policies can be held to."""
    refs = [(e.event_type, e.object_id, e.decode_critical) for e in events
            if e.event_type in ("ALLOCATED", "ACCESSED", "FREED")]
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
