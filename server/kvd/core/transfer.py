"""Transfer plans: the page moves one pool operation needs, decided at once, copied later.

A pool operation that needs bytes moved (an allocation that demotes victims, an access that
promotes) reserves every page it needs and marks the blocks `moving`, then returns a plan.
The runtime copies the bytes off the event loop and calls Pool.complete(plan) (or
Pool.abort(plan)); only then does the page table say the blocks moved. Demotions are copied
before promotions because an incoming block may be given the page a victim is leaving.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvd.core.blocks import Block, Request, TierKind


class Reason(enum.StrEnum):
    """Why a plan moves pages: the operation that made it. It decides the transfer's class
    on the link (see PoolRuntime._job) and is what the eviction ledger and events name."""

    ALLOCATE = "allocate"  # room for new blocks
    ACCESS = "access"  # blocks an engine reads, brought back
    PREFETCH = "prefetch"  # blocks asked for ahead of their read (intent, pins)
    EVICT = "evict"  # the admin asked for pages
    RESERVE = "reserve"  # the free reserve refilled from over-share tenants (fair policies)
    HANDOFF = "handoff"  # a request's blocks arriving from its prefill pool

    @property
    def on_demand(self) -> bool:
        """An engine waits on this plan's copies (its step, or its allocation)."""
        return self in (Reason.ACCESS, Reason.ALLOCATE)


class MoveKind(enum.Enum):
    """What one move does to a block's bytes."""
    DEMOTE = "demote"  # device -> host, bytes copied
    DROP = "drop"  # device -> nowhere; the engine recomputes it on next use
    PROMOTE = "promote"  # host -> device, bytes copied
    REMATERIALIZE = "rematerialize"  # nowhere -> device; nothing to copy, must be recomputed


@dataclass(slots=True)
class Move:
    """One block's move between pages of the pool's tiers (or to nowhere, or back from nowhere)."""
    block: Block
    kind: MoveKind
    src_tier: TierKind
    src_page: int
    dst_tier: TierKind
    dst_page: int
    # The source page was handed to an incoming block at plan time: do not free it on completion.
    src_reassigned: bool

    @property
    def copies_bytes(self) -> bool:
        """Whether the move copies bytes (a drop or a rematerialisation copies none)."""
        return self.kind in (MoveKind.DEMOTE, MoveKind.PROMOTE)


@dataclass(slots=True, eq=False)
class TransferPlan:
    """What one operation moves. Empty plans complete at once, without a copy."""

    pool: str
    reason: Reason
    cause: Request | None
    demotions: list[Move] = field(default_factory=list)
    promotions: list[Move] = field(default_factory=list)
    allocated: list[Block] = field(default_factory=list)

    @property
    def num_copies(self) -> int:
        """Moves that copy bytes."""
        if not self.demotions and not self.promotions:
            return 0
        return sum(m.copies_bytes for m in self.demotions) + sum(
            m.copies_bytes for m in self.promotions
        )

    def blocks(self) -> list[Block]:
        """Every block the plan moves or allocates."""
        return (
            [m.block for m in self.demotions]
            + [m.block for m in self.promotions]
            + list(self.allocated)
        )
