"""Python's cyclic garbage collector beside a large cache of blocks.

CPython's full collection walks every container object the process holds, however old: a
cached block is a Block with a list and a tuple around it in its policy's queues, about a
microsecond of walking, so 200 ms with 200,000 of them cached, in one piece, while every
engine's call waits. And a full collection comes far more often than the cache doubles:
Python starts one once a quarter as many objects as the last one kept have lived through
two younger collections, which the medium-lived objects of a stream of calls see to.

kvd's own objects go by reference counting (a released request, its blocks, a finished
transfer leave no cycle behind: tests/integration/test_gcwalk.py), so among long-lived
objects the collector has little to find. After a full collection that took longer than
`set_aside_s`, kvd sets everything that lived through it aside (gc.freeze): later
collections walk only what is younger. A collection short enough leaves everything where
it is, so a kvd whose heap does not grow sets nothing aside after its first long
collections.

What is set aside while alive and later joins a garbage cycle (a gRPC call in flight at that
moment: grpc's server leaves one small cycle behind each call) is not freed until kvd walks
everything again, every `full_walk_s` seconds (gc.unfreeze, collect, set aside again): one
long pause then, and what it frees is counted (kvd_gc_full_walk_freed_objects).
"""

from __future__ import annotations

import asyncio
import gc
import time

import structlog

log = structlog.get_logger("kvd.gcwalk")

SET_ASIDE_S = 0.005  # a full collection longer than this sets its survivors aside


class Collections:
    """The collector's callback that sets long-lived objects aside, and the full walks that
    free what was set aside and became garbage since. One per process (the collector is)."""

    def __init__(self) -> None:
        self.set_aside_s = SET_ASIDE_S
        self.installed = False
        self.set_asides = 0  # full collections whose survivors were set aside
        self.full_walks = 0
        self.full_walk_freed = 0  # unreachable objects the full walks found
        self.last_full_walk_s = 0.0
        self._started = 0.0

    def install(self, set_aside_s: float = SET_ASIDE_S) -> None:
        """From now on, a full collection longer than set_aside_s sets its survivors aside."""
        self.set_aside_s = set_aside_s
        if not self.installed:
            gc.callbacks.append(self._collection)
            self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            gc.callbacks.remove(self._collection)
            self.installed = False

    def _collection(self, phase: str, info: dict) -> None:
        # Called by the collector, before and after each collection, in whichever thread
        # set it off; under the GIL, as every collection is.
        if phase == "start":
            self._started = time.perf_counter()
        elif (info["generation"] == 2
              and time.perf_counter() - self._started >= self.set_aside_s):
            gc.freeze()  # a full collection leaves no younger generation: all it kept
            self.set_asides += 1

    def full_walk(self) -> int:
        """Walk everything once, what was set aside too, and set the survivors aside again;
        returns the unreachable objects found."""
        started = time.perf_counter()
        gc.unfreeze()
        freed = gc.collect()
        gc.freeze()
        self.last_full_walk_s = time.perf_counter() - started
        self.full_walks += 1
        self.full_walk_freed += freed
        return freed

    async def full_walk_forever(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            freed = self.full_walk()
            log.info("full garbage collection", freed=freed, set_aside=gc.get_freeze_count(),
                     ms=round(self.last_full_walk_s * 1e3, 1))


COLLECTIONS = Collections()
