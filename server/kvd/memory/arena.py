"""Arenas: one contiguous allocation per tier and pool, cut into fixed-size pages."""

from __future__ import annotations

import fcntl
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Protocol

import numpy as np

from kvd.core.errors import ResourceExhausted


@dataclass(slots=True, frozen=True)
class ArenaExport:
    """What an engine needs to map an arena (kvd.v1.TierExport)."""

    backend: str
    num_pages: int
    arena_bytes: int
    shm_name: str = ""
    cuda_ipc_handle: bytes = b""
    cuda_device: int = -1


class Arena(Protocol):
    backend: str
    num_pages: int
    page_bytes: int

    def export(self) -> ArenaExport: ...

    def zero(self, page: int) -> None: ...

    def close(self) -> None: ...


class ShmArena:
    """Pages in POSIX shared memory, so engines (and tests) can map them by name.

    Used for the host tier, and as the device tier's stand-in when there is no GPU (reported
    as backend "host-standin" so nobody mistakes it for device memory).
    """

    def __init__(self, num_pages: int, page_bytes: int, *, label: str, backend: str = "shm"):
        self.backend = backend
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        size = max(num_pages * page_bytes, 1)
        # Unguessable names: the shm namespace is shared by every process on the host.
        name = f"kvd-{os.getpid()}-{label}-{secrets.token_hex(4)}"
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        try:
            self._owned = _own(name, size)
        except OSError as exc:
            self._shm.close()
            self._shm.unlink()
            raise ResourceExhausted(
                f"cannot reserve {size / 2**20:.0f} MiB of shared memory for the {label} "
                f"arena: {exc.strerror}; {SHM_DIR} holds less than the pools need") from None
        self.pages = np.ndarray((num_pages, page_bytes), dtype=np.uint8, buffer=self._shm.buf)
        self.on_close: list[Callable[[], None]] = []  # before the memory goes (unpinning)

    @property
    def shm_name(self) -> str:
        return self._shm.name

    def export(self) -> ArenaExport:
        return ArenaExport(self.backend, self.num_pages, self.num_pages * self.page_bytes,
                           shm_name=self._shm.name)

    def zero(self, page: int) -> None:
        self.pages[page].fill(0)

    def close(self) -> None:
        while self.on_close:
            self.on_close.pop()()
        self.pages = None  # drop the view before closing the buffer under it
        self._shm.close()
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        if self._owned is not None:
            os.close(self._owned)
            self._owned = None


# Where POSIX shared memory lives on Linux (shm_open's names are files there).
SHM_DIR = "/dev/shm"
_ARENA_NAME = re.compile(r"kvd-(\d+)-")


def _own(name: str, size: int = 0, shm_dir: str = SHM_DIR) -> int | None:
    """Reserve a new arena's `size` bytes and mark it as in use for as long as the process
    lives. Returns the descriptor that holds it (None where shared memory is not in shm_dir);
    an OSError when the memory is not there.

    - Reserved: a new segment is sparse, and a page is taken from /dev/shm only when first
      written. Memory-backed and shared with the engines' own segments, /dev/shm may have
      filled meanwhile, and the write then kills the writer (kvd's copy, the engine's
      kernel) with SIGBUS; reserved, every page is there from the start.
    - In use: a shared lock on its file, which the kernel drops when the process dies
      however it dies (see sweep_stale)."""
    try:
        fd = os.open(os.path.join(shm_dir, name), os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        raise
    return fd


def sweep_stale(shm_dir: str = SHM_DIR) -> list[tuple[str, int]]:
    """Remove the arenas of kvd processes that are gone, and return each (name, bytes it
    held in memory).

    kvd unlinks its arenas when it stops, and Python's resource tracker when kvd alone is
    killed; but a container or unit killed whole (the tracker with it, as a kubelet, docker or
    systemd stop does past its grace period) leaves them, and memory-backed shared memory
    holds its RAM until a reboot: a kvd sidecar restarted in the same pod would find its
    /dev/shm full of the last one's host tier. An arena is stale when the process its name
    holds is not alive here and no process holds its lock (see _own): another pid
    namespace sharing this /dev/shm, whose processes are not seen here, still holds it."""
    removed = []
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return removed  # no shared memory to look at (not Linux)
    for name in entries:
        match = _ARENA_NAME.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = os.fstat(fd).st_blocks * 512  # what it holds, not its (sparse) size
            os.unlink(path)
        except OSError:
            continue  # locked by a live kvd, or not ours to remove
        finally:
            os.close(fd)
        removed.append((name, held))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True
