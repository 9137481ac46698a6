"""The eviction policy contract.

A policy orders and chooses; the pool keeps the mechanism (free lists, accounting, copies).
The pool tells the policy which device-tier blocks are evictable (resident, unpinned, not
moving) with insert/remove, and asks it for victims with evict(n, protected): the n first
blocks in eviction order that are not protected (blocks the same operation is about to read),
taken out of the policy, or None and nothing changed. As vLLM's offloading policies do, the
protected set is an argument: protected blocks are never taken out and put back around a call,
which would reorder them. choose() is the same decision without taking the victims, for a
caller that must look at them before it commits (see Pool._evict).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from typing import ClassVar

from kvd.core.blocks import Block
from kvd.core.clock import Clock


class EvictionPolicy(ABC):
    """Holds exactly the evictable blocks of one pool's device tier, in eviction order."""

    name: ClassVar[str]
    # False: touch() need not be called; the policy reads block.last_access when it matters.
    eager_touch: ClassVar[bool] = True
    # Whether the policy acts on the engine's intent: prefetches on hints and on pins. The
    # intent-blind baselines (lru, regret) do not; every policy honours pins, which are a
    # safety property of the pool, not a preference.
    uses_intent: ClassVar[bool] = False
    # Whether the policy orders tenants by fair share (admission then counts only pages
    # above other tenants' shares as room).
    fair: ClassVar[bool] = False
    # Whether each request's blocks are ordered apart from other requests' (eviction picks a
    # request first, by something other than recency, then the block within it): reads of a
    # request recorded after blocks were added to or removed from others leave the order
    # they would have left recorded at once (see reads.changes_blocks).
    per_request_order: ClassVar[bool] = False
    # Whether the policy keeps the blocks it takes in while reads wait to be recorded, in
    # order among them (log_inserts), so that the reads recorded later leave the order that
    # recording them first would: an order by last read or insert alone (LRU) can.
    orders_late_reads: ClassVar[bool] = False
    # While it does: (sequence number, block) of each insert, in order; else None.
    late_inserts: list[tuple[int, Block]] | None = None
    _seq = None  # the numbers of the inserts logged (see log_inserts)

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    @abstractmethod
    def insert(self, block: Block) -> None:
        """block became evictable."""

    @abstractmethod
    def remove(self, block: Block) -> None:
        """block is no longer evictable (demoted, pinned, moving, freed)."""

    @abstractmethod
    def touch(self, block: Block) -> None:
        """block was read now (block.last_access is already updated). Called only when held."""

    def touch_many(self, blocks) -> None:
        """Touch every held block of `blocks` (which may hold None and unheld blocks)."""
        for block in blocks:
            if block is not None and block in self:
                self.touch(block)

    def touch_request(self, req) -> None:
        """Every block of req was read, in index order (attention's read of a request)."""
        self.touch_many(req.live)

    def touch_requests(self, requests: Iterable) -> None:
        """touch_request() of each request in turn (a step's reads, recorded together)."""
        for req in requests:
            self.touch_request(req)

    def log_inserts(self, seq) -> None:
        """Reads are pending: number each insert from `seq` (the reads' own numbers come
        from it too) and keep it in late_inserts (orders_late_reads policies only, whose
        insert appends (next(self._seq), block) while late_inserts is not None)."""
        self.late_inserts = []
        self._seq = seq

    def touch_requests_among_inserts(self, reads) -> None:
        """Reads recorded late, (request, ..., seq) as Reads.take gives them in the order of
        their numbers: each request touched in its place among the inserts logged."""
        raise NotImplementedError

    def end_late_inserts(self) -> None:
        """Every pending read is recorded: the inserts logged after the last go behind it,
        and inserts are logged no more."""
        raise NotImplementedError

    @abstractmethod
    def reorder(self, block: Block) -> None:
        """block's intent changed. Called only when held."""

    @abstractmethod
    def choose(self, n: int, for_tenant: str | None = None,
               protected: Collection[Block] = ()) -> list[Block] | None:
        """n victims in eviction order, none of them protected, or None when fewer than n
        can be given. Changes nothing. `protected` should be a set when it is large.

        for_tenant is the tenant that needs the room (tenant-aware policies may take its own
        pages even when it is within its guarantee). A policy whose first n + 1 victims
        begin with its first n may hand a protected call to choose_around."""

    def choose_around(self, n: int, for_tenant: str | None,
                      protected: Collection[Block]) -> list[Block] | None:
        """choose() with protected blocks, for a policy whose order does not depend on n:
        the first n + (protected blocks held) victims, less the protected."""
        shielded = sum(1 for b in protected if b in self)
        if n > len(self) - shielded:
            return None
        ranked = self.choose(n + shielded, for_tenant)
        if ranked is None or not shielded:
            return ranked
        return [b for b in ranked if b not in protected][:n]

    def evict(self, n: int, for_tenant: str | None = None,
              protected: Collection[Block] = ()) -> list[Block] | None:
        """choose(), and the victims leave the policy: all n, or None and nothing changed."""
        victims = self.choose(n, for_tenant, protected)
        if victims is not None:
            self.take(victims)
        return victims

    def take(self, victims: list[Block]) -> None:
        """The victims choose() gave leave the policy (they are being demoted or dropped)."""
        for victim in victims:
            self.remove(victim)
            self.on_evicted(victim)

    def order_problems(self) -> list[str]:
        """What is wrong with the policy's own bookkeeping (the self-check's; O(n))."""
        return []

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block: Block) -> bool: ...

    def on_evicted(self, block: Block) -> None:
        """block was just demoted or dropped to make room (for policies that learn)."""

    def on_promoted(self, block: Block) -> None:
        """block was just brought back to the device tier (before insert)."""
