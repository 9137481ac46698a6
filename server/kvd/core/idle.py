"""Kept prefix blocks nobody uses, in the device tier: cache, not working set (DESIGN.md,
"What kvd decides": a block held by nobody is evicted before one a request is using).

A named block is idle from the moment its last user ends (or, stored and let go at once, from
its store) until a request uses it again or it leaves the device tier. The page table asks
for idle victims before it asks its policy: the tenant-blind policies (whose order knows
nothing of users) take the oldest idle blocks first, the fair policy those of the tenant it
makes pay. Oldest means idle longest: the order in which blocks became idle.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterator

from kvd.core.blocks import Block


class IdleKept:
    """The idle kept blocks of one pool's device tier, oldest first, and by owning tenant
    (the tenant whose keeper holds the block: the one that stored it)."""

    __slots__ = ("order", "by_tenant")

    def __init__(self) -> None:
        self.order: dict[Block, None] = {}
        self.by_tenant: dict[str, dict[Block, None]] = {}

    def add(self, block: Block) -> None:
        """The block became idle (again: it goes to the end)."""
        self.discard(block)
        self.order[block] = None
        self.by_tenant.setdefault(block.request.tenant, {})[block] = None

    def discard(self, block: Block) -> None:
        """The block is used again, or left the device tier."""
        if self.order.pop(block, 0) is None:
            mine = self.by_tenant[block.request.tenant]
            del mine[block]
            if not mine:
                del self.by_tenant[block.request.tenant]

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, block: Block) -> bool:
        return block in self.order

    def first(self, n: int, evictable: Container[Block], protected: Collection[Block] = (),
              tenant: str | None = None, skip: Collection[Block] = ()) -> list[Block]:
        """Up to n idle blocks that are evictable now (the policy holds them: not held, not
        moving), none of them protected or in `skip`, oldest first; of every tenant, or of
        the blocks `tenant` owns."""
        out: list[Block] = []
        if n <= 0:
            return out
        for block in self._of(tenant):
            if block in evictable and block not in protected and block not in skip:
                out.append(block)
                if len(out) == n:
                    break
        return out

    def _of(self, tenant: str | None) -> Iterator[Block]:
        if tenant is None:
            return iter(self.order)
        return iter(self.by_tenant.get(tenant, ()))
