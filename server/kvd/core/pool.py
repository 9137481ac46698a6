"""A KV memory pool: its requests and the engine operations on them (DESIGN.md, "What kvd
decides" names a room for each decision the operations ask for).

The pool validates a call, finds the request's blocks, and asks: admission (admission.py)
whether a request gets in, the page table (pages.py) for room and moves between tiers, which
asks the eviction policy (policies/) for victims; tenancy (tenancy.py) keeps every tenant's
figures; reads (reads.py) answers the step's hot read path and records it late; intent.py
validates and applies MemoryIntent. Calls go one way, from the pool down: nothing below it
holds the pool. Every public method either does all it says or raises before changing
anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from kvd.core import prefix, settle
from kvd.core.admission import Admission, AdmitResult, Decision, counted_pages
from kvd.core.attribution import Attribution
from kvd.core.blocks import Block, Request, RequestState
from kvd.core.clock import Clock
from kvd.core.counters import PoolCounters
from kvd.core.errors import AlreadyExists, InvalidArgument
from kvd.core.fairness import TenantQuota
from kvd.core.intent import IntentChange, Intents
from kvd.core.pages import PageTable
from kvd.core.policies import EvictionPolicy
from kvd.core.prefix import Prefixes
from kvd.core.reads import AccessResult, Reads, after_reads, changes_blocks
from kvd.core.requests import RequestTable, check_still, resolve
from kvd.core.reservation import Reservations, Reserver
from kvd.core.tenancy import Tenancy
from kvd.core.tier import TierPages
from kvd.core.transfer import Reason, TransferPlan

__all__ = ["AccessResult", "Pool", "PoolCounters"]


class Pool:
    """One named pool: a device tier, a host tier below it, and its requests."""

    def __init__(
        self,
        name: str,
        *,
        page_bytes: int,
        block_tokens: int,
        device_pages: int,
        host_pages: int,
        policy: str,
        clock: Clock,
        max_queue: int = 1024,
        admission: str = "working_set",
        quotas: dict[str, TenantQuota] | None = None,
        reserve_pages: int | None = None,
        attribution: Attribution | None = None,
        reserver: Reserver | None = None,
        defer: Callable[[Callable[[], bool]], Any] | None = None,
    ) -> None:
        if page_bytes <= 0 or block_tokens <= 0:
            raise InvalidArgument("page_bytes and block_tokens must be positive")
        if device_pages <= 0:
            raise InvalidArgument(f"pool {name!r}: the device tier needs at least one page")
        self.name = name
        self.page_bytes = page_bytes
        self.block_tokens = block_tokens
        self.clock = clock
        self.requests = RequestTable(name)
        self.counters = PoolCounters()
        self.attribution = attribution or Attribution()
        self.tenancy = Tenancy(quotas)
        self.pages = PageTable(
            name, page_bytes=page_bytes, device_pages=device_pages, host_pages=host_pages,
            policy=policy, clock=clock, tenancy=self.tenancy, counters=self.counters,
            attribution=self.attribution, requests=self.requests,
            reserve_pages=(max(1, device_pages // 50) if reserve_pages is None
                           else reserve_pages))
        self.tenancy.set_share_capacity(self.pages.share_capacity)
        self.device: TierPages = self.pages.device
        self.host: TierPages = self.pages.host
        self.admission = Admission(
            name, block_tokens=block_tokens, max_queue=max_queue, clock=clock,
            pages=self.pages, tenancy=self.tenancy, counters=self.counters, reserver=reserver,
            mode=admission)
        self.queue = self.admission.queue
        # Reads read_all() answered and not yet recorded.
        self.reads = Reads(self.requests, clock, pages=self.pages, tenancy=self.tenancy,
                           counters=self.counters, page_bytes=page_bytes)
        self.pages.before_choice = self.reads.record_pending
        # How recording the reads is put off (the runtime's event loop; None: at once).
        self.defer = defer
        self._record_due = False  # a call of record_some_reads is deferred or under way
        self.intents = Intents(self.pages, self.counters, self.get_admitted)
        self.prefixes = Prefixes(name, requests=self.requests, pages=self.pages,
                                 admission=self.admission, tenancy=self.tenancy)
        self.reservations = Reservations(
            name, requests=self.requests, admission=self.admission, pages=self.pages,
            tenancy=self.tenancy, attribution=self.attribution, counters=self.counters,
            clock=clock, page_bytes=page_bytes, reads=self.reads)

    # ------------------------------------------------------------------ queries

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy that orders the device tier's evictable blocks."""
        return self.pages.policy

    @property
    def num_pinned(self) -> int:
        """Device blocks pinned by intent (never evicted)."""
        return self.pages.num_pinned

    @property
    def reserved_pages(self) -> int:
        """Pages reserved for admitted requests and handoff reservations."""
        return self.admission.reserved_pages

    def get_request(self, request_id: str) -> Request:
        """A request of this pool, queued or admitted, or NotFound."""
        return self.requests.find(request_id)

    def get_admitted(self, request_id: str) -> Request:
        """The request, if it may use pages now; else the error that says why not."""
        return self.requests.admitted(request_id, self.queue)

    # ------------------------------------------------------------------ admission

    @after_reads
    def admit(self, request_id: str, *, tenant: str, prompt_tokens: int, output_tokens: int,
              priority: int = 0, handoff_pool: str = "") -> AdmitResult:
        """ADMITTED when the request's projected pages fit the pool now, QUEUED when they can
        fit later, REJECTED when they never can.

        With a handoff pool, this pool only prefills: it holds the prompt's pages, and the
        request is admitted only together with a reservation of prompt plus output pages in
        the handoff pool, so no prefill is spent on a request decode cannot hold."""
        if request_id in self.requests:
            raise AlreadyExists(f"request {request_id!r} already exists in pool {self.name!r}")
        req = self.admission.new_request(request_id, tenant, prompt_tokens, output_tokens,
                                         priority, handoff_pool)
        never = self.admission.judge(req)
        if never:
            self.counters.num_rejected += 1
            return AdmitResult(Decision.REJECTED, never, 0, req.projected_pages)
        self.admission.check_queue_share(tenant)
        req.account = self.attribution.open(request_id, tenant)
        self.tenancy.budget(req, self.page_bytes, self.clock.now())
        self.requests[request_id] = req
        return self.admission.submit(req)

    @after_reads
    def admit_waiting(self) -> list[Request]:
        """Admit what the queue lets in now (after a change outside the pool's calls)."""
        return self.admission.admit_from_queue()

    @after_reads
    def set_quota(self, tenant: str, quota: TenantQuota) -> list[Request]:
        """Change a tenant's quota now; returns queued requests it let in."""
        self.tenancy.set_quota(tenant, quota)
        return self.admission.admit_from_queue()

    @after_reads
    def take_never_fitting(self) -> list[tuple[Request, str]]:
        """Queued requests that can never be admitted any more (Admission.take_never_fitting)
        taken out of the pool, each with why; those behind them are the caller's to admit
        (admit_waiting)."""
        rejected = self.admission.take_never_fitting()
        for req, _ in rejected:
            self.attribution.close(req.request_id)
            del self.requests[req.request_id]
            self.counters.num_rejected += 1
        return rejected

    @after_reads
    def refill_plan(self) -> TransferPlan | None:
        """Under a fair policy, a plan demoting pages of tenants above their fair share until
        the free reserve is whole again (None when it is, or nobody is over)."""
        return self.pages.refill()

    # ------------------------------------------------------------------ engine operations

    @changes_blocks
    def allocate(self, request_id: str, num_blocks: int,
                 intent: dict[str, Any] | None = None,
                 indices: Sequence[int] | None = None, holder: str = "",
                 reason: Reason = Reason.ALLOCATE) -> TransferPlan:
        """New blocks at the end of the request, each in a device page, with the intent the
        engine already knows (a pin in it is refused, like any pin, if it would overcommit).
        `indices` (increasing, past the last block) places them with gaps, as a handoff
        keeps the block indices of the pool it came from (its reason: Reason.HANDOFF)."""
        if num_blocks <= 0:
            raise InvalidArgument(f"num_blocks must be positive, got {num_blocks}")
        req = self.get_admitted(request_id)
        pages = self.pages
        indices = pages.check_new(req, num_blocks, indices, intent)
        growth = self.admission.growth(req, num_blocks)
        page_numbers, demotions = pages.make_room(num_blocks, req, reason, holder=holder)
        plan = TransferPlan(self.name, reason, req, demotions=demotions)
        plan.allocated = pages.place(req, page_numbers, indices, intent, holder)
        if growth:
            self.admission.reserve(req, growth)
        return plan

    def check_allocation(self, request_id: str, num_blocks: int,
                         intent: dict[str, Any] | None = None) -> None:
        """allocate()'s checks, changing nothing: the error that says why num_blocks new
        blocks may not be allocated (room aside), if any. An allocation made a slice at a
        time is checked whole first."""
        if num_blocks <= 0:
            raise InvalidArgument(f"num_blocks must be positive, got {num_blocks}")
        req = self.get_admitted(request_id)
        self.pages.check_new(req, num_blocks, None, intent)
        self.admission.growth(req, num_blocks)

    @after_reads
    def access(self, request_id: str, indices: Sequence[int] | None,
               holder: str = "") -> AccessResult:
        """The engine reads these blocks now (None: all of them): see Reads.access."""
        req = self.requests.get(request_id)
        if req is None or req.state is not RequestState.ADMITTED:
            req = self.get_admitted(request_id)  # raises the right error
        return self.reads.access(req, indices, holder)

    def read_all(self, request_ids: Sequence[str], tenant: str | None = None,
                 key: bytes | None = None
                 ) -> tuple[list[str], list[Request], list[Request]]:
        """The engine step's hot path: every block of each request is read now (see
        Reads.answer). Recording the reads is put off: through `defer` (the runtime records
        them a little after the reply has gone), and in any case before any other pool method
        (after_reads), so every decision sees the reads in the order they came. Returns the
        ids left for the general path, the requests read whose blocks moved since the engine
        was told, and the requests read."""
        general, relocated, first, answered = self.reads.answer(request_ids, tenant, key)
        if first:
            self._record_reads_soon()
        return general, relocated, answered

    def read_again(self, key: bytes, count: int, tenant: str | None, holder: str) -> bool:
        """read_all() of the step that read the same `count` requests under `key` last,
        answered as that one was, its requests held for the holder in place of what it held
        (requests at most: see Holds.hold_again); whether it was (False: nothing done,
        read_all answers it)."""
        again = self.reads.answer_again(key, count, tenant)
        if again is None:
            return False
        requests, first = again
        if first:
            self._record_reads_soon()
        self.pages.holds.hold_again(holder, requests)
        return True

    def hold_read(self, requests: list[Request], holder: str) -> None:
        """Hold the device blocks of these requests, read by a step, for the holder until its
        next call: nothing may take their pages while the engine reads them (see Step). Held
        by request: the blocks leave the policy only if victims are chosen meanwhile (reads
        left pending stay so: no block moves or changes hands here)."""
        self.pages.holds.hold_requests(holder, requests)  # read_all's: all admitted

    def _record_reads_soon(self) -> None:
        """The first pending read was answered: recorded a little after the reply has gone
        (through `defer`), or now where nothing defers."""
        if self.defer is None:
            self.record_reads()
        elif not self._record_due:  # else the call that is due takes them too
            self._record_due = True
            self.defer(self.record_some_reads)

    def record_reads(self) -> None:
        """Record the reads read_all() answered (see Reads.record_pending)."""
        self.reads.record_pending()

    def record_some_reads(self) -> bool:
        """Record a slice of the reads read_all() answered (see Reads.record_some); whether
        more are left, for a call on the event loop's next turn (the steps that came
        meanwhile are served in between)."""
        if self.reads.record_some():
            return True
        self._record_due = False
        if self.reads.pending:  # answered while these were recorded: their turn comes
            self._record_reads_soon()
        return False

    @after_reads
    def snapshot(self) -> Pool:
        """The pool with every answered read recorded, for a reader of its figures (stats,
        metrics, the admin's listings): the counters then include the last steps' reads."""
        return self

    @after_reads
    def note_late(self, blocks: Iterable[Block]) -> None:
        """An access had to wait for these blocks' promotion (already under way): misses."""
        self.reads.note_late(blocks)

    # ------------------------------------------------------------------ holds

    @changes_blocks
    def end_holds(self, holder: str, at_most: int | None = None) -> bool:
        """The holder called again (or went away): what it was handed is evictable again
        (`at_most` blocks of it now, the rest by end_more_holds: see Holds.end). Whether
        anything was. No queued request goes for it: admission counts held pages as room
        already (see Admission.room_for), and a hold changes no reservation."""
        return self.pages.holds.end(holder, at_most)

    @changes_blocks
    def end_more_holds(self, at_most: int | None) -> bool:
        """The next slice of the holds that end a slice at a time; whether some are left."""
        return self.pages.holds.end_more(at_most)

    # ------------------------------------------------------------------ intents

    @changes_blocks
    def check_intents(self, changes: Sequence[IntentChange], final: dict) -> None:
        """Validate a slice of a batch without changing anything (see Intents.check)."""
        self.intents.check(changes, final)

    @changes_blocks
    def update_intents(self, changes: Sequence[IntentChange]) -> TransferPlan | None:
        """Apply a batch of intent updates, all or none (see Intents.update). A pin takes a
        block out of the policy and its end puts it back, as a hold does (changes_blocks);
        reads count decode-critical blocks as they were when read; a prefetch's eviction
        records the pending reads first."""
        return self.intents.update(changes, self.clock.now())

    @after_reads
    def prefetch(self, blocks: list[Block]) -> TransferPlan | None:
        """Promote what fits of `blocks` ahead of their access; a hint, so no room is no error."""
        return self.intents.prefetch(blocks)

    # ------------------------------------------------------------------ shared prefix blocks

    def lookup(self, namespace: str, keys: Sequence[bytes]) -> list[Block]:
        """The leading run of keys the pool holds (see Prefixes.lookup)."""
        prefix.check_keys(namespace, keys)
        run = self.prefixes.lookup(namespace, keys)
        self.counters.num_prefix_looked_up += len(keys)
        self.counters.num_prefix_hits += len(run)
        return run

    @after_reads
    def store(self, request_id: str, namespace: str, keys: Sequence[bytes],
              holder: str = "", intent: dict | None = None
              ) -> tuple[TransferPlan, list[Block]]:
        """Blocks under these keys for the request, new ones to write (see Prefixes.store)."""
        return self.prefixes.store(self.get_admitted(request_id), namespace, keys, holder,
                                   intent)

    def check_store(self, request_id: str, namespace: str, keys: Sequence[bytes],
                    intent: dict | None, size: int) -> tuple[Request, Iterator[None]]:
        """store()'s checks, changing nothing: the request, and its checks, which yield
        after each `size` keys (see Prefixes.check_store)."""
        req = self.get_admitted(request_id)
        return req, self.prefixes.check_store(req, namespace, keys, intent, size)

    def check_load(self, request_id: str, namespace: str, keys: Sequence[bytes],
                   intent: dict | None, size: int) -> tuple[Request, Iterator[None]]:
        """load()'s checks, as check_store's (see Prefixes.check_load)."""
        req = self.get_admitted(request_id)
        return req, self.prefixes.check_load(req, namespace, keys, intent, size)

    @after_reads
    def end_uses_of(self, req: Request, blocks: Sequence[Block], holder: str = "",
                    held: Sequence[Block] = ()) -> None:
        """req uses these shared blocks no more (Prefixes.end_some_uses): those nobody else
        uses and nobody committed go, their device pages free at once unless a client's
        holder holds them (Holds.keep). A release of a request using many ends them a
        slice at a time first (see sliced.end_uses_down); a store or load made a slice at
        a time that stopped part way gives back the uses it added, its engine told of none
        of them: `holder`'s holds of what it found or placed (`held`) are void first
        (evictable again, or it would wait for them itself when done whole).
        BlocksInTransit, changing nothing, if one that goes is moving."""
        going = self.prefixes.unused_of(req, blocks)
        check_still(going)
        holds = self.pages.holds
        if holder:
            holds.unhold(holder, held, to_policy=True)
        self.prefixes.end_some_uses(req, blocks, holds.keep(req, going))

    @after_reads
    def commit(self, request_id: str, namespace: str, keys: Sequence[bytes]) -> int:
        """The engine wrote these stored blocks (see Prefixes.commit)."""
        n = self.prefixes.commit(self.get_admitted(request_id), namespace, keys)
        self.counters.num_prefix_stored += n
        return n

    def check_commit(self, request_id: str, namespace: str,
                     keys: Sequence[bytes]) -> list[Block]:
        """commit()'s checks of keys already checked (check_keys), changing nothing: the
        blocks they name (see Prefixes.to_commit)."""
        return self.prefixes.to_commit(self.get_admitted(request_id), namespace, keys,
                                       checked=True)

    @after_reads
    def commit_blocks(self, request_id: str, blocks: Sequence[Block]) -> int:
        """Commit blocks check_commit found (see Prefixes.mark_committed)."""
        n = self.prefixes.mark_committed(self.get_admitted(request_id), blocks)
        self.counters.num_prefix_stored += n
        return n

    @after_reads
    def load(self, request_id: str, namespace: str, keys: Sequence[bytes],
             holder: str = "", intent: dict | None = None) -> list[Block]:
        """The leading run of these keys, for the request to read (see Prefixes.load)."""
        run = self.prefixes.load(self.get_admitted(request_id), namespace, keys, holder,
                                 intent)
        self.counters.num_prefix_loaded += len(run)
        return run

    # ------------------------------------------------------------------ giving back

    def check_free(self, request_id: str, indices: Sequence[int]) -> None:
        """free()'s checks, changing nothing (BlocksInTransit for blocks being copied)."""
        check_still(resolve(self.get_admitted(request_id), indices))

    @changes_blocks
    def free(self, request_id: str, indices: Sequence[int]) -> int:
        """Give back some blocks of a request; their indices stay unused. The device pages
        of those another client's holder holds stay out of use until it calls again (see
        Holds.keep): its engine may be writing them."""
        req = self.get_admitted(request_id)
        blocks = resolve(req, indices)
        check_still(blocks)
        self.pages.discard_all(blocks, self.pages.holds.keep(req, blocks))
        return len(blocks)

    @after_reads
    def release(self, request_id: str) -> tuple[int, list[Request]]:
        """Give back a whole request (queued or admitted). Returns the number of blocks freed
        and the queued requests admitted because of it."""
        req = self.get_request(request_id)
        if req.state is RequestState.QUEUED:
            self.attribution.close(request_id)
            self.admission.dequeue(req)
            del self.requests[request_id]
            return 0, self.admission.admit_from_queue()
        live = req.live_blocks()
        unused = self.prefixes.unused(req)
        check_still(live + unused)
        self.pages.release_blocks(req, live)
        # The blocks it stored and never committed go too, and the engine may be writing
        # them as it does its own blocks.
        self.prefixes.end_uses(req, self.pages.holds.keep(req, unused))
        self.attribution.close(request_id)
        self.admission.unreserve(req)
        del self.requests[request_id]
        return len(live), self.admission.admit_from_queue()

    @after_reads
    def check_evict(self, num_pages: int) -> None:
        """evict()'s check, changing nothing the operator did not ask for: num_pages
        victims there are now (holds that end a slice at a time ended first: their holders
        called again, and the operator asks for what is evictable)."""
        if num_pages <= 0:
            raise InvalidArgument(f"num_pages must be positive, got {num_pages}")
        holds = self.pages.holds
        while holds.end_more(None):
            pass
        holds.materialize()  # requests steps answered are not evictable
        if num_pages > len(self.policy):
            raise self.pages.no_room(num_pages)

    def evict(self, num_pages: int) -> TransferPlan:
        """Demote num_pages victims now (the operator asked for room): all or none, refused
        at once when they cannot go (only copies in flight are waited for)."""
        self.check_evict(num_pages)
        return TransferPlan(self.name, Reason.EVICT, None,
                            demotions=self.pages.evict(num_pages, None, Reason.EVICT, False,
                                                       now=True))

    @after_reads
    def set_policy(self, name: str) -> str:
        """Switch the eviction policy at run time; the evictable blocks carry over."""
        old = self.pages.set_policy(name)
        self.tenancy.set_share_capacity(self.pages.share_capacity)
        return old

    # ------------------------------------------------------------------ transfers

    def complete(self, plan: TransferPlan) -> list[Block]:
        """The plan's bytes are copied: make the page table say so. Returns blocks pinned while
        they were being demoted, which now want a prefetch. (A plan that only allocated
        adds blocks, see changes_blocks; one that moved blocks changes what reads find.)"""
        if plan.demotions or plan.promotions:
            self.reads.settle()
        else:
            self.reads.before_block_changes()
        return settle.complete(self.pages, plan)

    @after_reads
    def abort(self, plan: TransferPlan) -> None:
        """The copy failed or was cancelled: put everything back as it was before the plan."""
        storer = plan.cause
        if storer is not None:
            uses, counted = len(storer.shared), counted_pages(storer)
        settle.abort(self.pages, plan)
        if storer is not None:  # the blocks it stored are gone: it uses them no more
            self.admission.shared_uses_changed(storer, counted, len(storer.shared) - uses)

    def record_stall(self, seconds: float, plan: TransferPlan | None = None) -> None:
        """An access waited `seconds` for `plan`'s promotions: charge it to the evictions
        that had put those blocks out."""
        self.counters.stall_seconds_total += seconds
        if plan is not None and plan.cause is not None and plan.promotions:
            self.attribution.stalled(plan.cause.request_id,
                                     [m.block.evicted_by for m in plan.promotions], seconds)
