"""Arenas: one contiguous allocation per tier and pool, cut into fixed-size pages."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Protocol

import numpy as np


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
