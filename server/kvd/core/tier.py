"""The page table of one tier: which block owns each page, and a free list."""

from __future__ import annotations

from kvd.core.blocks import Block, TierKind


class TierPages:
    """Fixed-size pages of one tier. take() and release() are O(1)."""

    __slots__ = ("kind", "capacity", "owner", "_free", "_is_free")

    def __init__(self, kind: TierKind, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"{kind.name.lower()} tier capacity must be >= 0, got {capacity}")
        self.kind = kind
        self.capacity = capacity
        self.owner: list[Block | None] = [None] * capacity
        # A stack: the most recently released page is reused first (warm in caches).
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * capacity

    @property
    def num_free(self) -> int:
        """Pages on the free list."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages owned by a block."""
        return self.capacity - len(self._free)

    def take(self, block: Block) -> int:
        """Give a free page to block and return its index. The caller checked num_free."""
        page = self._free.pop()
        self._is_free[page] = 0
        self.owner[page] = block
        return page

    def release(self, page: int) -> None:
        """Give a page back to the free list."""
        if self._is_free[page]:
            raise AssertionError(f"{self.kind.name.lower()} page {page} released twice")
        self._is_free[page] = 1
        self.owner[page] = None
        self._free.append(page)

    def is_free(self, page: int) -> bool:
        """Whether the page is on the free list."""
        return bool(self._is_free[page])

    def free_pages(self) -> list[int]:
        """The free pages, in the order they will be handed out."""
        return list(self._free)
