"""Map a kvd pool's arenas into this process, as an engine does (ExportPool): host memory
through POSIX shared memory, GPU memory through its CUDA IPC handle (with CuPy, the `gpu`
extra).

Shared memory is shared: whoever maps an arena can read every page in it. kvd hands each
engine the page handles it owns; the mapping itself is not a security boundary.
"""

from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from kvd_api.v1 import kvd_pb2 as pb


def arena_names(export: pb.ExportPoolResponse) -> tuple[bytes, ...]:
    """A kvd's arenas by name: shared-memory names and CUDA IPC handles are new each time
    kvd starts, so two exports with the same names come from the same kvd."""
    return tuple(t.shm_name.encode() + t.cuda_ipc_handle for t in export.tiers)


class MappedPool:
    """numpy views of a pool's shared-memory arenas, indexed by PageHandle."""

    def __init__(self, export: pb.ExportPoolResponse) -> None:
        self.page_bytes = export.page_bytes
        self._shms = {}
        self._cuda_ptrs: list[tuple[int, int]] = []  # (device, pointer)
        self.tiers: dict[int, Any] = {}  # numpy arrays, or cupy arrays for GPU memory
        for tier in export.tiers:
            if not tier.shm_name:
                if tier.cuda_ipc_handle:
                    self.tiers[tier.tier] = self._map_cuda(tier)
                continue
            shm = shared_memory.SharedMemory(name=tier.shm_name)
            # kvd owns the segment: stop this process's tracker from unlinking it at exit.
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            self._shms[tier.tier] = shm
            self.tiers[tier.tier] = np.ndarray((tier.num_pages, self.page_bytes), np.uint8,
                                               buffer=shm.buf)

    def _map_cuda(self, tier: pb.TierExport) -> Any:
        """A device arena, opened from its CUDA IPC handle (in another process than kvd's:
        CUDA refuses to open a handle in the process that made it)."""
        try:
            import cupy
        except ImportError:
            return None  # page() says what is missing, should a handle name this tier
        with cupy.cuda.Device(tier.cuda_device):
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(tier.cuda_ipc_handle)
            self._cuda_ptrs.append((tier.cuda_device, ptr))
            memory = cupy.cuda.UnownedMemory(ptr, tier.num_pages * self.page_bytes, owner=self,
                                             device_id=tier.cuda_device)
            return cupy.ndarray((tier.num_pages, self.page_bytes), cupy.uint8,
                                cupy.cuda.MemoryPointer(memory, 0))

    def page(self, handle: pb.PageHandle) -> Any:
        """The bytes of the page a handle names (a writable view): a numpy array, or a cupy
        array for a page in GPU memory."""
        pages = self.tiers.get(handle.tier)
        if pages is None:
            raise LookupError(f"tier {handle.tier} of this pool is not mapped here (a GPU "
                              "arena needs CuPy: pip install '<kvd checkout>[gpu]')")
        return pages[handle.page_index]

    def write(self, handle: pb.PageHandle, data) -> None:
        """Copy bytes (a uint8 numpy array, or bytes; at most a page) into the page a handle
        names, in host or GPU memory alike."""
        src = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray)) else data
        page = self.page(handle)[:len(src)]
        if isinstance(page, np.ndarray):
            page[:] = src
        else:  # host to GPU; in place when this returns, as kvd expects at the next call
            import cupy

            stream = cupy.cuda.get_current_stream()
            page.set(np.ascontiguousarray(src, np.uint8), stream=stream)
            stream.synchronize()

    def read(self, handle: pb.PageHandle) -> np.ndarray:
        """A copy, in host memory, of the page a handle names."""
        page = self.page(handle)
        return page.copy() if isinstance(page, np.ndarray) else page.get()

    def close(self) -> None:
        self.tiers.clear()
        if self._cuda_ptrs:
            import cupy

            for device, ptr in self._cuda_ptrs:
                with cupy.cuda.Device(device):
                    cupy.cuda.runtime.ipcCloseMemHandle(ptr)
            self._cuda_ptrs.clear()
        for shm in self._shms.values():
            shm.close()
        self._shms.clear()
