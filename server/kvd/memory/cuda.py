"""The device tier in GPU memory, through CuPy. The only module of kvd that imports cupy.

Not exercised without a GPU: tests marked `gpu` run it where one is present.
"""

from __future__ import annotations

from kvd.memory.arena import ArenaExport

HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError without a driver, ...
        return False


def free_gpu_memory(device: int) -> int | None:
    """Bytes of free memory on a GPU; None where it cannot be asked (no such GPU, no CuPy)."""
    try:
        import cupy

        with cupy.cuda.Device(device):
            return int(cupy.cuda.runtime.memGetInfo()[0])
    except Exception:  # ImportError, CUDARuntimeError: the allocation itself will tell
        return None


class CupyArena:
    """Device pages allocated with cupy.empty on one GPU; exported as a CUDA IPC handle."""

    backend = "cupy"

    def __init__(self, num_pages: int, page_bytes: int, *, device: int = 0):
        import cupy

        self._cupy = cupy
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.device = device
        with cupy.cuda.Device(device):
            self.pages = cupy.empty((num_pages, page_bytes), dtype=cupy.uint8)
            self.stream = cupy.cuda.Stream(non_blocking=True)

    def export(self) -> ArenaExport:
        handle = self._cupy.cuda.runtime.ipcGetMemHandle(self.pages.data.ptr)
        return ArenaExport(self.backend, self.num_pages, self.num_pages * self.page_bytes,
                           cuda_ipc_handle=bytes(handle), cuda_device=self.device)

    def zero(self, page: int) -> None:
        with self._cupy.cuda.Device(self.device), self.stream:
            self.pages[page].fill(0)
        self.stream.synchronize()

    def close(self) -> None:
        self.stream.synchronize()
        self.pages = None
        with self._cupy.cuda.Device(self.device):  # CuPy keeps a pool per GPU
            self._cupy.get_default_memory_pool().free_all_blocks()


def pin_host_arena(arena) -> None:
    """Page-lock a host arena's memory so device<->host copies run at full DMA speed; the
    arena's close() unlocks it (CUDA refuses to lock a range twice, and a later arena may be
    mapped where this one was). An arena of no pages has nothing to lock."""
    if not arena.num_pages:
        return
    import cupy

    ptr = arena.pages.ctypes.data
    # Portable: page-locked for every GPU's context, not only the current one's (pools on
    # several GPUs copy to and from host arenas in their own device's context).
    cupy.cuda.runtime.hostRegister(ptr, arena.pages.nbytes, HOST_REGISTER_PORTABLE)
    arena.on_close.append(lambda: cupy.cuda.runtime.hostUnregister(ptr))


def copy_device_host(src, src_pages, dst, dst_pages, stream) -> None:
    """Copy a run of consecutive pages between a CuPy arena and a numpy arena (either way),
    or between two CuPy arenas (on one GPU or two), on a CUDA stream of the GPU of the CuPy
    side (the destination's, for two), and wait for it. The copy threads' current device is
    GPU 0's unless set: the copy runs with the stream's GPU current."""
    import cupy

    src_pages, dst_pages = list(src_pages), list(dst_pages)
    s0, s1, d0, d1 = src_pages[0], src_pages[-1] + 1, dst_pages[0], dst_pages[-1] + 1
    gpu = dst.device if isinstance(dst, cupy.ndarray) else src.device
    with gpu, stream:
        if isinstance(dst, cupy.ndarray) and isinstance(src, cupy.ndarray):
            # One copy of the run's bytes (rows of a C-ordered array: contiguous), also from
            # another GPU (peer), which an element-wise assignment refuses.
            run = src[s0:s1]
            dst[d0:d1].data.copy_from_device_async(run.data, run.nbytes, stream)
        elif isinstance(dst, cupy.ndarray):
            dst[d0:d1].set(src[s0:s1], stream=stream)
        else:
            src[s0:s1].get(stream=stream, out=dst[d0:d1])
    stream.synchronize()
