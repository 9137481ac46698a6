"""Kept prefix blocks nobody uses, in the device tier: cache, not working set (DESIGN.md,
"What kvd decides": a block held by nobody is evicted before one a request is using).

A named block is idle from the moment its last user ends (or, stored and let go at once, from
its store) until a request uses it again or it leaves the device tier. Under the tenant-blind
policies (whose order knows nothing of users) the page table takes the oldest idle blocks
before it asks its policy; oldest means idle longest, the order in which blocks became idle.

The fair policy keeps its own order: the tenant most over its share pays, with its largest
request, which for a tenant with a prefix cache is mostly its keeper (its kept blocks, used
or not, in the base policy's order; a block a request uses is one its engine copied at load,
not one its steps read). Taking the paying tenant's idle blocks before its keeper's others
costs more than it saves on the shared-prefix trace (`kvd-loadgen request-trace`, 1,000
requests, 600 device pages): the short tenant's step-stall p99 went from 0 to 2.1 ms, kvd
demoting every victim (no drops, against 982 in fair's order, which drops kept blocks from
a full host tier) and steps waiting for the copies.
"""

from __future__ import annotations

from collections.abc import Collection, Container

from kvd.core.blocks import Block


class IdleKept:
    """The idle kept blocks of one pool's device tier, oldest first."""

    __slots__ = ("order",)

    def __init__(self) -> None:
        self.order: dict[Block, None] = {}

    def add(self, block: Block) -> None:
        """The block became idle (again: it goes to the end)."""
        self.order.pop(block, None)
        self.order[block] = None

    def discard(self, block: Block) -> None:
        """The block is used again, or left the device tier."""
        self.order.pop(block, None)

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, block: Block) -> bool:
        return block in self.order

    def first(self, n: int, evictable: Container[Block],
              protected: Collection[Block] = ()) -> list[Block]:
        """Up to n idle blocks that are evictable now (the policy holds them: not held, not
        moving), none of them protected, oldest first."""
        out: list[Block] = []
        if n <= 0:
            return out
        for block in self.order:
            if block in evictable and block not in protected:
                out.append(block)
                if len(out) == n:
                    break
        return out
