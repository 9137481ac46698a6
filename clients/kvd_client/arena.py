"""Map a kvd pool's host-memory arenas into this process, as an engine does (ExportPool).

Shared memory is shared: whoever maps an arena can read every page in it. kvd hands each
engine the page handles it owns; the mapping itself is not a security boundary.
"""

from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory

import numpy as np

from kvd_api.v1 import kvd_pb2 as pb


class MappedPool:
    """numpy views of a pool's shared-memory arenas, indexed by PageHandle."""

    def __init__(self, export: pb.ExportPoolResponse) -> None:
        self.page_bytes = export.page_bytes
        self._shms = {}
        self.tiers: dict[int, np.ndarray] = {}
        for tier in export.tiers:
            if not tier.shm_name:
                continue  # a CUDA arena: map it with cupy.cuda.runtime.ipcOpenMemHandle
            shm = shared_memory.SharedMemory(name=tier.shm_name)
            # kvd owns the segment: stop this process's tracker from unlinking it at exit.
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            self._shms[tier.tier] = shm
            self.tiers[tier.tier] = np.ndarray((tier.num_pages, self.page_bytes), np.uint8,
                                               buffer=shm.buf)

    def page(self, handle: pb.PageHandle) -> np.ndarray:
        """The bytes of the page a handle names (a writable view)."""
        return self.tiers[handle.tier][handle.page_index]

    def close(self) -> None:
        self.tiers.clear()
        for shm in self._shms.values():
            shm.close()
        self._shms.clear()
