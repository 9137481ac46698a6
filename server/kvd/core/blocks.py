"""Requests, their blocks, and what the engine says about each block (its MemoryIntent)."""

from __future__ import annotations

import bisect
import enum
import itertools
import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class Phase(enum.IntEnum):
    """The lifecycle phase of a block's request (values match kvd.v1.Phase)."""

    UNSPECIFIED = 0
    PREFILL = 1
    DECODE = 2
    VERIFY = 3
    ROLLBACK = 4
    DONE = 5
    IDLE = 6


class Priority(enum.IntEnum):
    """How much the engine needs a block (values match kvd.v1.Priority)."""

    UNSPECIFIED = 0
    COLD = 1
    WARM = 2
    HOT = 3
    DECODE_CRITICAL = 4


class TierKind(enum.IntEnum):
    """Where a block's bytes are (values match kvd.v1.Tier). NONE: dropped, to be recomputed."""

    NONE = 0
    DEVICE = 1
    HOST = 2


class RequestState(enum.Enum):
    """Where a request stands: queued, admitted, or holding a handoff reservation."""
    QUEUED = "queued"
    ADMITTED = "admitted"
    # Pages held in a decode pool for a request still in prefill elsewhere (no blocks yet).
    RESERVED = "reserved"


# Intent fields an update may carry (core/intent.py checks their values). Names follow the
# intent traces (shared/data/INTENT_TRACE_FORMAT.md).
INTENT_INT_FIELDS = (
    "slack_us",
    "recompute_cost_us",
    "spill_cost_us",
    "target_decode_step",
    "expected_reuse_window_tokens",
)
INTENT_BOOL_FIELDS = (
    "pin_requested",
    "is_draft",
    "is_committed",
    "compression_ok",
    "recompute_ok",
    "prefetch_ok",
)


@dataclass(slots=True, eq=False)
class Block:
    """One engine KV block of one request, bound to one page of one tier.

    Identity-hashed: policies keep blocks in dicts and heaps.
    """

    # First, so they share the object's first cache line with its header: the BlockQueue
    # holding it and its position there (policy bookkeeping, opaque to the pool). Looking at
    # the oldest of a million blocks then touches one line of one block.
    queue: Any = field(default=None, kw_only=True)
    queue_pos: int = field(default=0, kw_only=True)
    request: Request
    index: int
    tier: TierKind
    page: int
    # True while its bytes are being copied between tiers: no policy holds it then.
    moving: bool = False
    # Bumped whenever its page changes, so the Step stream reports only relocations.
    epoch: int = 0
    seen_epoch: int = 0
    # Its last read, and the time between its last two reads, as reads of this block alone
    # (and its placement) left them: see last_access and reuse_s, which a read of its
    # whole request since stands above.
    own_access: float = 0.0
    own_reuse_s: float = 0.0
    # Intent.
    phase: Phase = Phase.PREFILL
    priority: Priority = Priority.WARM
    deadline_at: float | None = None  # absolute, on kvd's monotonic clock
    slack_us: int | None = None
    recompute_cost_us: int | None = None
    spill_cost_us: int | None = None
    request_priority: int = 0
    recency_score: float = 0.0
    target_decode_step: int | None = None
    expected_reuse_window_tokens: int | None = None
    pin_requested: bool = False
    is_draft: bool = False
    is_committed: bool = False
    compression_ok: bool = False
    recompute_ok: bool = False
    prefetch_ok: bool = False
    # Derived from the intent by refresh_flags(); plain fields because the access path reads
    # them for every block of every request on every engine step.
    pinned: bool = False
    decode_critical: bool = False
    # Policy bookkeeping (opaque to the pool): its last read when it was queued
    # (ClassedPolicy), its regret level.
    queued_access: float = 0.0
    regret_level: int = 0
    # Its bytes were dropped and it came back as a zeroed page: the engine must recompute
    # it. Cleared once a reply has told the engine so.
    lost: bool = False
    # Holders it was handed to that may still be writing or reading it: not evictable until
    # each holder's next call (see holds.py).
    held: int = 0
    # The eviction that last put this block out of the device tier (an EvictionRecord).
    evicted_by: Any = None
    # A shared prefix block (see prefix.py): its name (namespace, the engine's block hash),
    # the requests using it by tenant, the tenants its page is charged to (1/k each), and
    # whether the engine has said its bytes are written (only then can a lookup find it).
    name: tuple[str, bytes] | None = None
    users: dict[str, int] | None = None
    payers: tuple[str, ...] = ()
    committed: bool = True
    # Uncommitted: the ids of the requests told to write it (Prefixes.to_write); only one
    # of them may commit it.
    writers: set[str] | None = None
    # Requests using it that asked for it pinned, by tenant (Prefixes.use_intent): pinned
    # while any is, the pin counted to the first of those tenants (see pin_tenant).
    pin_users: dict[str, int] | None = None

    def refresh_flags(self) -> bool:
        """DECODE_CRITICAL implies pinned: a decode step depends on the block. An access to
        a decode-critical block that misses the device tier stalls a decode step. Returns
        whether it turned decode-critical or stopped being so (its request's count changed:
        the caller notes the request in its page table's Changes)."""
        self.pinned = self.pin_requested or self.priority == Priority.DECODE_CRITICAL
        critical = self.priority == Priority.DECODE_CRITICAL or self.phase == Phase.DECODE
        if critical == self.decode_critical:
            return False
        self.decode_critical = critical
        self.request.num_critical += 1 if critical else -1
        return True

    @property
    def last_access(self) -> float:
        """When it was last read. A read of its whole request is recorded once, on the
        request (Request.read_at): it stands for a read of each block the request held then,
        which is each block whose own last read is no later."""
        own = self.own_access
        read = self.request.read_at
        return read if read >= own else own

    @last_access.setter
    def last_access(self, now: float) -> None:
        """A read of this block alone (no earlier than its request's last whole read)."""
        self.own_access = now

    @property
    def reuse_s(self) -> float:
        """The time between its last two reads: attention reads a running request's blocks
        every step, so this predicts its next read (the reuse policy uses it). Read with its
        whole request last, from the later of its own last read before and its request's
        whole read before (Request.read_since)."""
        own = self.own_access
        req = self.request
        read = req.read_at
        if own > read:
            return self.own_reuse_s
        since = req.read_since
        return read - (own if own > since else since)

    @reuse_s.setter
    def reuse_s(self, seconds: float) -> None:
        self.own_reuse_s = seconds

    @property
    def key(self) -> str:
        """The block's identity in events and logs: (request id, index)."""
        return f"{self.request.request_id}:{self.index}"

    def __repr__(self) -> str:
        where = "moving" if self.moving else f"{self.tier.name.lower()}[{self.page}]"
        return f"Block({self.key} @ {where})"


@dataclass(slots=True, eq=False)
class Request:
    """One sequence: who pays for it, how many pages it expects, and its blocks."""

    request_id: str
    tenant: str
    pool: str
    priority: int
    projected_pages: int
    state: RequestState
    admitted_at: float | None = None
    queued_at: float = 0.0
    queue_seq: int = 0  # its place in the order requests came to the admission queue
    # Pages held against the pool for this request: max(projected, blocks ever allocated).
    reserved_pages: int = 0
    # Working-set admission: the device pages it is counted for at most (None: all it
    # reserves). Set for a request bigger than its tenant's fair share, which streams the
    # rest through the host tier.
    working_set_cap: int | None = None
    # Index i holds block i; a freed block leaves None so indices stay stable.
    blocks: list[Block | None] = field(default_factory=list)
    # Its live blocks in index order: what a read walks. A request that frees blocks as it
    # grows (a sliding window, a decode loop giving back what it no longer attends to)
    # leaves ever more None in `blocks`; its reads cost what it holds, not what it held.
    live: list[Block] = field(default_factory=list)
    num_live_blocks: int = 0
    # Its live blocks not in the device tier (in the host tier, or dropped), in no order: a
    # read of the whole request finds what it misses without walking the others.
    off_device: dict[Block, None] = field(default_factory=dict)
    # Its last read of every block at once, and the read before it (or the latest of the
    # reads merged into it, see Reads.take): each block's last_access and reuse_s read them,
    # and recording such a read costs the same for one block or a million.
    read_at: float = -math.inf
    read_since: float = -math.inf
    num_device_blocks: int = 0
    num_moving_blocks: int = 0
    # Of its live blocks, those decode-critical (counted as reads of such blocks).
    num_critical: int = 0
    # Set when a block moved to a new device page; cleared once the engine was told.
    maybe_relocated: bool = False
    # Its blocks whose page changed, or whose telling is to be repeated, since the engine was
    # last told of them (and some told since), in no order: a read of the whole request
    # reports those still untold without looking at the others.
    untold: dict[Block, None] = field(default_factory=dict)
    # What it went through (a RequestAccount), for Explain.
    account: Any = None
    # Bandwidth: bytes its transfers moved, blocks attention read, and its token buckets
    # (a hard cap on its transfers; its read budget, which holds its promotions when spent).
    bytes_moved: int = 0
    blocks_read: int = 0
    transfer_cap: Any = None
    read_bucket: Any = None
    # Disaggregation: the pool this request hands off to, and when an unused reservation
    # there lapses (RESERVED requests only).
    handoff_pool: str = ""
    expires_at: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    # Shared prefix blocks this request uses (owned by a keeper, see prefix.py), and whether
    # this request is itself a keeper: the owner of one tenant's shared blocks, which lives
    # as long as the pool and is never admitted, queued or named by an engine.
    shared: list[Block] = field(default_factory=list)
    # The same blocks, as a set (by identity): whether the request uses a block, at once
    # (a store or load of many keys, a slice at a time, asks for each key it finds).
    shared_set: set[Block] = field(default_factory=set)
    pinned_shared: list[Block] = field(default_factory=list)  # of those, the ones it pins
    keeper: bool = False

    def keep_indices(self, used: int) -> None:
        """The request, handed off here, goes on from the block indices it used where it was
        (the freed ones after its last block included): an engine names blocks by index, and
        a free it sends again (its first answer lost) must find its block gone, not a block
        handed out under that index since."""
        if len(self.blocks) < used:
            self.blocks.extend([None] * (used - len(self.blocks)))

    def live_blocks(self) -> list[Block]:
        """The request's blocks that are not freed, in index order (a copy: the caller may
        free them while it walks it)."""
        return self.live.copy()

    def unlive(self, gone: list[Block]) -> None:
        """These blocks were freed: out of `live`. O(live) whatever their number (in Python
        when they are many; in C, list copies, when they are few); O(gone) when they are its
        newest, in order."""
        live = self.live
        if len(gone) == 1:
            block = gone[0]
            if live[-1] is block:  # the newest: a block that was just placed, or a decode
                live.pop()
            else:
                live.remove(block)  # identity first (eq=False)
        elif gone:
            n = len(gone)
            if n <= len(live) and all(a is b for a, b in zip(live[-n:], gone)):
                del live[-n:]  # its newest, in order: a long request released a slice at a time
                return
            if n * 8 < len(live):
                # A few of many (a long request freed a slice at a time): found by index
                # (live is in index order), and the runs between them joined.
                at = [bisect.bisect_left(live, b.index, key=by_index) for b in gone]
                if all(i < len(live) and live[i] is b for i, b in zip(at, gone)):
                    at.sort()
                    ends = [*at, len(live)]
                    self.live = list(itertools.chain(
                        live[:ends[0]], *(live[i + 1:j] for i, j in zip(ends, ends[1:]))))
                    return
            going = set(gone)  # by identity (eq=False)
            self.live = [b for b in live if b not in going]


class Changes:
    """The requests of a pool whose blocks were added or taken away, or turned decode-
    critical or not, in the order it happened. A step's read answered earlier still holds
    while no block of the pool has started to move since (PageTable.moves) for each of its
    requests not noted here since (see LastRead.still): it looks at those, not at all of
    its requests (an engine's 64, which other engines' steps in between rarely touch).

    Positions count from the pool's start; what lies before `start` is forgotten (at most
    LIMIT are kept, and none once the answers kept are forgotten): an answer older than
    that is given again the long way."""

    __slots__ = ("start", "log")

    LIMIT = 4096

    def __init__(self) -> None:
        self.start = 0
        self.log: list[Request] = []

    def note(self, req: Request) -> None:
        if len(self.log) >= self.LIMIT:
            self.forget()
        self.log.append(req)

    @property
    def end(self) -> int:
        """The position the next noted request will have."""
        return self.start + len(self.log)

    def since(self, mark: int) -> list[Request] | None:
        """The requests noted from position `mark` on; None when some are forgotten."""
        return None if mark < self.start else self.log[mark - self.start:]

    def forget(self) -> None:
        self.start += len(self.log)
        self.log = []


# Keepers' request ids (see prefix.py): a NUL cannot be in an engine's request id, so none
# can collide.
KEEPER_PREFIX = "\0kept/"


MASK_64 = (1 << 64) - 1


def key_hash(key: bytes) -> int:
    """A prefix block's key as the 64-bit hash engines publish for it in their KV cache
    events (vLLM folds a bytes hash to its low 64 bits)."""
    return int.from_bytes(key, "big") & MASK_64


def public_id(request_id: str) -> str:
    """A request id as kvd's callers are told it: a keeper's (the record of a tenant's kept
    prefix blocks, see prefix.py) is kvd's own, and names no request of theirs: empty."""
    return "" if request_id.startswith(KEEPER_PREFIX) else request_id


def pin_tenant(b: Block) -> str:
    """The tenant a pin of the block counts to: its request's; for a shared block, the first
    tenant among those whose requests pin it (not its keeper's: a tenant pinning what
    another stored pins in its own room, not the other's)."""
    return next(iter(b.pin_users)) if b.pin_users else b.request.tenant


def pin_room_tenants(b: Block) -> Iterable[str]:
    """The tenants in whose pin room a pin of the block is (Tenancy.pin_room_by_tenant):
    its request's; for a shared block, each tenant whose requests pin it."""
    return b.pin_users or (b.request.tenant,)


# A sort key: blocks in index order (a request's lists of some of its blocks keep none).
by_index = operator.attrgetter("index")


def evictable(b: Block) -> bool:
    """Whether a block belongs in its pool's policy: resident, still, unpinned, not held."""
    return (b.tier is TierKind.DEVICE and not b.moving and not b.pinned and not b.held)
