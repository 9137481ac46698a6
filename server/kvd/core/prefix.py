"""Shared prefix blocks (DESIGN.md, "What kvd decides": who pays for a shared page).

Engines name a prefix block by a chained hash of its tokens (vLLM's block hashes, SGLang's
radix keys, Mooncake's hash_ids) within a namespace of model and cache salt, and share it
between every request with that prefix. kvd stores such a block once, under its name, and
keeps it after the requests using it end, for the next request that asks.

A named block belongs to a keeper: one request per tenant that owns what that tenant stored,
never admitted or named by an engine. Keeping the blocks in a request lets every decision
below (the policy, the moves between tiers, attribution) treat them as any other block. The
requests using a block hold it in their `shared` list and count it in their footprint
(admission reserved their prompt's pages). Its page is charged to the tenants using it, 1/k
each for k tenants (Tenancy.split); once nobody uses it, to those who used it last, so a
tenant over its share loses its kept prefixes first. A block nobody uses is the cheapest to
lose: named blocks may always be dropped (the engine recomputes a miss), and when the host
tier is short those in it are let go first (PageTable.reclaim_host).

A block stored is invisible to lookups until the engine that wrote it commits it; one never
committed goes when its last user does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

from kvd.core import intent as intents
from kvd.core.admission import Admission, counted_pages
from kvd.core.blocks import (KEEPER_PREFIX, Block, Request, RequestState, TierKind,
                              pin_tenant)
from kvd.core.errors import (BlocksInTransit, FailedPrecondition, InvalidArgument,
                             ResourceExhausted)
from kvd.core.pages import PageTable
from kvd.core.tenancy import Tenancy, tally
from kvd.core.transfer import Reason, TransferPlan

MAX_KEY_BYTES = 256
# A tenant's private namespace (see Authenticator.prefix_namespace) is its name (64 characters
# at most) and two more before the namespace it names.
PRIVATE_ROOM = 66
# What a request may say of the shared blocks it uses: they are other requests' too, so only
# what holds per user (a pin, held while any user asks for it) or can only make a block
# matter more (the earliest deadline stands, until it passes).
SHARED_INTENT_FIELDS = frozenset({"pin_requested", "deadline_us"})


def check_intent(intent: dict | None) -> None:
    """InvalidArgument unless the intent is one shared blocks take."""
    if not intent:
        return
    other = set(intent) - SHARED_INTENT_FIELDS
    if other:
        raise InvalidArgument(f"shared blocks take only {', '.join(sorted(SHARED_INTENT_FIELDS))}"
                              f" in an intent (got {', '.join(sorted(other))})")
    intents.validate(intent)


def check_namespace(namespace: str, most: int = MAX_KEY_BYTES) -> None:
    if len(namespace) > most:
        raise InvalidArgument(f"namespace is longer than {most} characters")


def check_keys(namespace: str, keys: Sequence[bytes]) -> None:
    """InvalidArgument unless the keys are non-empty, short, and distinct."""
    for _ in check_keys_sliced(namespace, keys, len(keys) or 1):
        pass


def check_keys_sliced(namespace: str, keys: Sequence[bytes], size: int) -> Iterator[None]:
    """check_keys, yielding after each `size` keys (a call of many keys served a slice at a
    time: its caller serves the loop at each yield)."""
    check_namespace(namespace, MAX_KEY_BYTES + PRIVATE_ROOM)
    if not keys:
        raise InvalidArgument("no block keys given")
    seen: set[bytes] = set()
    for start in range(0, len(keys), size):
        if start:
            yield
        part = keys[start:start + size]
        for k in part:
            if not k or len(k) > MAX_KEY_BYTES:
                raise InvalidArgument(f"a block key must be 1..{MAX_KEY_BYTES} bytes")
        had = len(seen)
        seen.update(part)
        if len(seen) != had + len(part):
            raise InvalidArgument("block keys repeat within one call")


@dataclass(slots=True)
class Shares:
    """What shared blocks cost a request or a tenant: the blocks it uses, the device pages
    among them shared with other tenants, the pages charged to it, and what the 1/k split
    saves it (1 - 1/k for each shared page)."""

    num_blocks: int = 0
    shared_pages: int = 0
    charged_pages: float = 0.0
    saved_pages: float = 0.0


class Prefixes:
    """One pool's named blocks: the index by name, the keepers, and the users."""

    def __init__(self, pool: str, *, requests: dict[str, Request], pages: PageTable,
                 admission: Admission, tenancy: Tenancy) -> None:
        self.pool = pool
        self.requests = requests
        self.pages = pages
        self.admission = admission
        self.tenancy = tenancy
        self.num_keepers = 0

    @property
    def named(self) -> dict[tuple[str, bytes], Block]:
        """Every named block by (namespace, key); the page table keeps it (see discard)."""
        return self.pages.named

    def lookup(self, namespace: str, keys: Sequence[bytes]) -> list[Block]:
        """The leading run of keys kvd holds committed bytes for, in order."""
        run = []
        named = self.named
        for k in keys:
            b = named.get((namespace, k))
            if b is None or not b.committed:
                break
            run.append(b)
        return run

    def store(self, req: Request, namespace: str, keys: Sequence[bytes],
              holder: str, intent: dict | None = None) -> tuple[TransferPlan, list[Block]]:
        """Blocks for these keys, used by req: those kvd has, and new device pages for the
        rest (in plan.allocated, held for `holder`: the engine writes them, then commits),
        with the request's intent for them (see use_intent). All or nothing."""
        check_keys(namespace, keys)
        check_intent(intent)
        named = self.named
        found = [named.get((namespace, k)) for k in keys]
        fresh = [k for k, b in zip(keys, found) if b is None]
        self._check_pins(req, found, intent)
        used = req.shared_set
        new_uses = sum(1 for b in found if b is None or b not in used)
        growth = self.admission.growth(req, new_uses)
        pages = self.pages
        # The blocks found are req's from now on, their cost split with its tenant before
        # room is made: the fair order must see who pays for what once the store is done
        # (else a tenant whose kept block req takes over could be taken below its
        # guarantee for the new pages). Undone if there is no room.
        taken_over = [(b, b.payers) for b in found if b is not None and b not in used]
        counted = counted_pages(req)
        for b, _ in taken_over:
            self._use(req, b, count=False)
        if taken_over:
            self.admission.shared_uses_changed(req, counted, len(taken_over))
        # Blocks nobody committed that went to the host tier come back to be written: an
        # engine is told to write device pages only (to_write), so there the block would
        # stay unwritten, and unfound, while any request uses it (a hot prefix, never
        # cached again, after one engine that stored it died before writing).
        lift = [b for b in found if b is not None and not b.committed and not b.moving
                and b.tier is TierKind.HOST]
        # The blocks found are handed back: none may be a victim of the new pages' room.
        kept = [b for b in found if b is not None]
        try:
            try:
                page_numbers, demotions = pages.make_room(
                    len(fresh) + len(lift), req, Reason.ALLOCATE, kept, holder)
            except (ResourceExhausted, BlocksInTransit):
                if not lift:
                    raise
                # No room for them now (or not without waiting): the store goes on as it
                # would have, and a later one brings them back.
                lift = []
                page_numbers, demotions = pages.make_room(
                    len(fresh), req, Reason.ALLOCATE, kept, holder)
        except BaseException:
            for b, payers in reversed(taken_over):
                self._unuse(req, b, payers)
            raise
        plan = TransferPlan(self.pool, Reason.ALLOCATE, req, demotions=demotions)
        if lift:
            plan.promotions = pages.moves_in(lift, page_numbers[len(fresh):])
            page_numbers = page_numbers[:len(fresh)]
        keeper = self.keeper(req.tenant)
        start = len(keeper.blocks)
        plan.allocated = pages.place(keeper, page_numbers, range(start, start + len(fresh)),
                                     None, holder)
        made = iter(plan.allocated)
        blocks = []
        # The new blocks are req's first use of each (those found are req's already, see
        # taken_over), charged to its tenant alone: _use's work, once for all of them.
        tenant = req.tenant
        counted = counted_pages(req)
        num_made = 0
        for k, b in zip(keys, found):
            if b is None:
                b = next(made)
                b.committed, b.recompute_ok = False, True
                b.users, b.payers = {tenant: 1}, (tenant,)
                b.writers = {req.request_id}  # its new page: req writes it (to_write)
                pages.file_named(b, (namespace, k))
                req.shared.append(b)
                req.shared_set.add(b)
                num_made += 1
            if holder and not b.moving and b.tier is not TierKind.NONE:
                # Found or new, the block is the engine's to read or write until its next
                # call: nothing lets it go meanwhile.
                pages.holds.hold_one(holder, b)
            blocks.append(b)
        if num_made:
            tally(self.tenancy.named_in_use, tenant, num_made)
            self.admission.shared_uses_changed(req, counted, num_made)
        if growth:
            self.admission.reserve(req, growth)
        self.use_intent(req, blocks, intent)
        return plan, blocks

    @staticmethod
    def to_write(request_id: str, blocks: Sequence[Block], engine: bool = True) -> list[bool]:
        """Which of these blocks, just stored for a request, its engine is to write: those kvd has
        no written bytes for (new pages, or another request's not yet committed: both write
        the same bytes, a name being its tokens' hash) that are in place (a block still
        moving, placed for another store or between tiers, is not written into). The
        request may commit those, and only those (see commit).

        An engine is told to write only blocks in the device tier, whose pages kvd keeps out
        of use until its next call should the block go meanwhile (Holds.keep); store brings
        an uncommitted block back from the host tier where it can. Told to write a host page,
        an engine whose request was released before it wrote wrote into a host page kvd had
        given to another request's demoted block. (kvd's own writers, `engine=False`, write
        before anything else runs.)

        What the request's latest store says stands: an uncommitted block it is not told to
        write now is no longer its to commit, even if an earlier store told it to. (Its
        engine may never have written it then; the page went to the host tier unwritten,
        and a commit of every key stored published it.)"""
        fresh = []
        for b in blocks:
            told = (not b.committed and not b.moving
                    and (b.tier is TierKind.DEVICE
                         or not engine and b.tier is not TierKind.NONE))
            if told:
                if b.writers is None:
                    b.writers = set()
                b.writers.add(request_id)
            elif b.writers:
                b.writers.discard(request_id)
            fresh.append(told)
        return fresh

    @classmethod
    def writes_of(cls, request_id: str, items: Sequence[tuple], at: int) -> list[tuple]:
        """The items (tuples) whose block, item[at], the request is to write (to_write):
        for kvd's own writers of stored blocks (a handoff's copies, a peer's pages)."""
        told = cls.to_write(request_id, [item[at] for item in items], engine=False)
        return [item for item, write in zip(items, told) if write]

    def commit(self, req: Request, namespace: str, keys: Sequence[bytes]) -> int:
        """The engine wrote these blocks: lookups find them from now on. Returns how many
        were not committed before. A block req was not told to write (to_write) is left to
        the request that was: committed by req, it published a page nobody had written
        (req's store found it still being placed for another store, whose engine was then
        told nothing was left to write)."""
        return self.mark_committed(req, self.to_commit(req, namespace, keys))

    def to_commit(self, req: Request, namespace: str, keys: Sequence[bytes],
                  checked: bool = False) -> list[Block]:
        """The blocks these keys name, each one req stored; else the error that says why
        not, changing nothing (commit's checks). `checked`: the keys were (check_keys)."""
        if not checked:
            check_keys(namespace, keys)
        used = req.shared_set
        blocks = []
        for k in keys:
            b = self.named.get((namespace, k))
            if b is None or b not in used:
                if any(u.name == (namespace, k) for u in req.shared):
                    # Its holder called again before committing, and the block was dropped.
                    raise FailedPrecondition(
                        f"block key {k.hex()[:32]!r} of request {req.request_id!r} was "
                        "evicted before it was committed (its hold ended with the holder's "
                        "next call); store it again")
                raise InvalidArgument(
                    f"request {req.request_id!r} did not store block key {k.hex()[:32]!r}")
            blocks.append(b)
        return blocks

    def mark_committed(self, req: Request, blocks: Sequence[Block]) -> int:
        """Commit these blocks of req's (to_commit's) that req was told to write and are
        still named and req's (a commit done a slice at a time: one let go meanwhile is
        not); how many were not committed before."""
        named, used = self.named, req.shared_set
        newly = 0
        for b in blocks:
            if (not b.committed and b.writers is not None and req.request_id in b.writers
                    and b in used and named.get(b.name) is b):
                b.committed, b.writers = True, None
                newly += 1
                if self.pages.named_changed is not None:
                    self.pages.named_changed.add(b.name)
        return newly

    def load(self, req: Request, namespace: str, keys: Sequence[bytes],
             holder: str, intent: dict | None = None) -> list[Block]:
        """The leading run of these keys kvd holds, used by req and held for `holder` until
        its next call, so the engine can copy them in, in whichever tier they are (both are
        mapped), with the request's intent for them (see use_intent). A block being moved
        ends the run: the engine recomputes the rest."""
        check_keys(namespace, keys)
        check_intent(intent)
        run = []
        for b in self.lookup(namespace, keys):
            if b.moving:
                break
            run.append(b)
        self._check_pins(req, run, intent)
        used = req.shared_set
        growth = self.admission.growth(req, sum(1 for b in run if b not in used))
        counted = counted_pages(req)
        num_used = 0
        for b in run:
            if b not in used:
                self._use(req, b, count=False)
                num_used += 1
            if holder:
                self.pages.holds.hold_one(holder, b)
        if num_used:
            self.admission.shared_uses_changed(req, counted, num_used)
        if growth:
            self.admission.reserve(req, growth)
        self.use_intent(req, run, intent)
        return run

    def unused(self, req: Request) -> list[Block]:
        """Blocks that go when req ends: those it stored and never committed that no one
        else uses (so the caller can check they are still)."""
        return self.unused_of(req, req.shared)

    def unused_of(self, req: Request, blocks: Sequence[Block]) -> list[Block]:
        """Those of these blocks of req's that go when req's use of them ends (see unused)."""
        return [b for b in blocks
                if not b.committed and self.named.get(b.name) is b
                and sum(b.users.values()) == b.users.get(req.tenant, 0) == 1]

    def end_uses(self, req: Request, kept: Collection[int] = ()) -> None:
        """req ends: it uses its shared blocks no more. A block still used by others is
        charged to them; one nobody uses stays, charged to its last users, unless it was
        never committed. Its pins go (a block stays pinned while another user pins it, the
        pin then counted to the first tenant still pinning it). `kept`: device pages of the
        blocks that go which stay out of use (see Holds.keep)."""
        for b in req.pinned_shared:
            self._unpin(req, b)
        req.pinned_shared.clear()
        counted = counted_pages(req)
        for b in req.shared:
            self._end_use(req, b, kept)
        uses = len(req.shared)
        req.shared.clear()
        req.shared_set.clear()
        self.admission.shared_uses_changed(req, counted, -uses)

    def check_store(self, req: Request, namespace: str, keys: Sequence[bytes],
                    intent: dict | None, size: int) -> Iterator[None]:
        """store()'s checks, changing nothing: the error that says why req may not store
        these keys (room aside), if any, yielding after each `size` keys (see
        check_keys_sliced). A store made a slice at a time is checked whole first."""
        check_intent(intent)
        yield from check_keys_sliced(namespace, keys, size)
        named = self.named
        found: list[Block | None] = []
        for start in range(0, len(keys), size):
            yield
            found += [named.get((namespace, k)) for k in keys[start:start + size]]
        yield
        self._check_pins(req, found, intent)
        used = req.shared_set
        self.admission.growth(req, sum(1 for b in found if b is None or b not in used))

    def check_load(self, req: Request, namespace: str, keys: Sequence[bytes],
                   intent: dict | None, size: int) -> Iterator[None]:
        """load()'s checks, changing nothing (see check_store)."""
        check_intent(intent)
        yield from check_keys_sliced(namespace, keys, size)
        run: list[Block] = []
        for start in range(0, len(keys), size):
            yield
            part = keys[start:start + size]
            found = self.lookup(namespace, part)
            for b in found:
                if b.moving:
                    break
                run.append(b)
            if len(run) < start + len(part):
                break  # the leading run ends here
        yield
        self._check_pins(req, run, intent)
        used = req.shared_set
        self.admission.growth(req, sum(1 for b in run if b not in used))

    def end_some_uses(self, req: Request, blocks: Sequence[Block],
                      kept: Collection[int] = ()) -> None:
        """req uses these of its shared blocks no more (a store made a slice at a time
        that stopped part way gives back the uses it added: its engine was told of none),
        as end_uses lets go of all of them. `kept`: as end_uses'."""
        going = {id(b) for b in blocks}
        if req.pinned_shared:
            pinned = []
            for b in req.pinned_shared:
                if id(b) in going:
                    self._unpin(req, b)
                else:
                    pinned.append(b)
            req.pinned_shared[:] = pinned
        counted = counted_pages(req)
        for b in blocks:
            self._end_use(req, b, kept)
        shared, k = req.shared, len(blocks)
        if k and len(shared) >= k and all(a is b for a, b in zip(shared[-k:], blocks)):
            del shared[-k:]  # its newest (a release's slices, a store's): no walk of all
        else:
            shared[:] = [b for b in shared if id(b) not in going]
        req.shared_set.difference_update(blocks)
        self.admission.shared_uses_changed(req, counted, -len(blocks))

    def _end_use(self, req: Request, b: Block, kept: Collection[int]) -> None:
        """req's use of b ends (see end_uses); the caller takes b out of req.shared."""
        if b.writers is not None:
            b.writers.discard(req.request_id)  # its id may come again, for another
        n = b.users.get(req.tenant, 0) - 1
        named = self.named.get(b.name) is b
        if n > 0:
            b.users[req.tenant] = n
        elif b.users.pop(req.tenant, None) is not None and named:
            tally(self.tenancy.named_in_use, req.tenant, -1)
        if not named:
            return  # already let go
        if not b.users and b.tier is TierKind.DEVICE:
            self.pages.idle_changed(b, 1)
        if not b.users and not b.committed:
            self.pages.discard(b, kept=kept)
        else:
            self._recharge(b)

    def keeper(self, tenant: str) -> Request:
        """The request that owns the tenant's named blocks (made on first use)."""
        rid = KEEPER_PREFIX + tenant
        keeper = self.requests.get(rid)
        if keeper is None:
            keeper = Request(rid, tenant, self.pool, 0, 0, RequestState.ADMITTED, keeper=True)
            self.requests[rid] = keeper
            self.num_keepers += 1
        elif len(keeper.blocks) > 2 * keeper.num_live_blocks + 64:
            self._compact(keeper)
        return keeper

    def shared_figures(self) -> dict[str, tuple[int, float]]:
        """Per tenant: (shared device pages charged in part to it, the pages the split saves
        it); a page with k payers saves each of them 1 - 1/k. Kept as shared pages come and
        go and their payers change (Tenancy.split): no walk of the kept blocks."""
        tenancy = self.tenancy
        return {tenant: (shared, float(tenancy.shared_saved[tenant]))
                for tenant, shared in tenancy.shared_pages.items()}

    def _check_pins(self, req: Request, blocks: Sequence[Block | None],
                    intent: dict | None) -> None:
        """Before any change: the pins this call would add must fit the device tier (None
        in `blocks`: a block the call makes, pinned once made)."""
        if not intent or not intent.get("pin_requested"):
            return
        # A pin counts to the tenant that pins the block first (blocks.pin_tenant), and
        # takes room of every tenant pinning it (its pin passes to them in turn): a block
        # pinned already adds no pin, but takes room of req's tenant's unless it pins it.
        tenant = req.tenant
        more = sum(1 for b in blocks if b is None or not b.pinned)
        room = sum(1 for b in blocks if b is None or tenant not in (b.pin_users or ()))
        if room:
            self.pages.check_pins(Counter({tenant: more}), Counter({tenant: room}))

    def use_intent(self, req: Request, blocks: Sequence[Block], intent: dict | None) -> None:
        """What req says of the shared blocks it uses: a pin holds while req (or another
        user that pinned it) uses the block; a deadline stands until it passes or an earlier
        one comes."""
        if not intent:
            return
        now = self.pages.clock.now()
        pin = intent.get("pin_requested")
        deadline_us = intent.get("deadline_us")
        mine = {id(b) for b in req.pinned_shared}
        for b in blocks:
            if pin and id(b) not in mine:
                req.pinned_shared.append(b)
                if b.pin_users is None:
                    b.pin_users = {}
                n = b.pin_users[req.tenant] = b.pin_users.get(req.tenant, 0) + 1
                if n == 1 and len(b.pin_users) == 1:
                    self._set_pin(b, True)
                elif n == 1:  # pinned already, by other tenants: room of req's tenant's too
                    tally(self.tenancy.pin_room_by_tenant, req.tenant, 1)
            if deadline_us is not None and (b.deadline_at is None or b.deadline_at < now
                                            or now + deadline_us / 1e6 < b.deadline_at):
                if intents.apply(b, {"deadline_us": deadline_us}, now):
                    self.pages.changes.note(b.request)
                if self._resident(b) and not b.pinned:
                    self.pages.policy.reorder(b)

    def _unpin(self, req: Request, b: Block) -> None:
        """req pins b no more."""
        users = b.pin_users
        if users[req.tenant] > 1:
            users[req.tenant] -= 1
            return
        counted = next(iter(users))
        del users[req.tenant]
        if self.named.get(b.name) is not b:  # let go: its pin counts nowhere now
            b.pin_users = users or None
            return
        if not users:
            self._set_pin(b, False, counted)
            b.pin_users = None
            return
        tally(self.tenancy.pin_room_by_tenant, req.tenant, -1)
        if next(iter(users)) != counted:  # passed to the next tenant pinning it
            self.pages.add_pins(counted, -1, room=False)
            self.pages.add_pins(next(iter(users)), 1, room=False)

    def _set_pin(self, b: Block, on: bool, tenant: str | None = None) -> None:
        """Pin or unpin b as its users ask, its pin counted to `tenant` (pin_tenant's)."""
        was = b.pinned
        b.pin_requested = on
        if b.refresh_flags():
            self.pages.changes.note(b.request)
        if b.pinned != was:
            self.pages.add_pins(tenant or pin_tenant(b), 1 if b.pinned else -1)
            if self._resident(b):
                (self.pages.policy.remove if b.pinned else self.pages.policy.insert)(b)

    @staticmethod
    def _resident(b: Block) -> bool:
        return b.tier is TierKind.DEVICE and not b.moving and not b.held

    def request_shares(self, req: Request) -> Shares:
        """The shared blocks req uses now, and their cost to it."""
        shares = Shares(num_blocks=len(req.shared))
        for b in req.shared:
            k = len(b.payers)
            if b.tier is TierKind.DEVICE and req.tenant in b.payers:
                shares.charged_pages += 1 / k
                if k > 1:
                    shares.shared_pages += 1
                    shares.saved_pages += 1 - 1 / k
        return shares

    def tenant_shares(self, tenant: str) -> Shares:
        """The named blocks the tenant uses now, the device pages charged to it (its own
        and its part of shared ones), and what the split saves it."""
        shared, saved = self.shared_figures().get(tenant, (0, 0.0))
        in_use = self.tenancy.named_in_use[tenant]
        return Shares(in_use, shared, self.tenancy.usage(tenant), saved)

    def _use(self, req: Request, b: Block, count: bool = True) -> None:
        """req uses b (once more). `count=False`: the caller tells admission of its uses
        (shared_uses_changed) once for all of them."""
        counted = counted_pages(req) if count else 0
        if not b.users and b.tier is TierKind.DEVICE:
            self.pages.idle_changed(b, -1)
        uses = b.users.get(req.tenant, 0)
        if not uses:
            tally(self.tenancy.named_in_use, req.tenant, 1)
        b.users[req.tenant] = uses + 1
        req.shared.append(b)
        req.shared_set.add(b)
        if count:
            self.admission.shared_uses_changed(req, counted, 1)
        self._recharge(b)

    def _unuse(self, req: Request, b: Block, payers: tuple[str, ...]) -> None:
        """Undo the last _use(req, b), b charged to `payers` again."""
        n = b.users[req.tenant] - 1
        if n:
            b.users[req.tenant] = n
        else:
            del b.users[req.tenant]
            tally(self.tenancy.named_in_use, req.tenant, -1)
        counted = counted_pages(req)
        req.shared_set.discard(req.shared.pop())
        self.admission.shared_uses_changed(req, counted, -1)
        if b.payers != payers:
            if b.tier is TierKind.DEVICE:
                owner = b.request.tenant
                self.tenancy.split(owner, b.payers, -1)
                self.tenancy.split(owner, payers, 1)
            b.payers = payers
        if not b.users and b.tier is TierKind.DEVICE:
            self.pages.idle_changed(b, 1)

    def _recharge(self, b: Block) -> None:
        """Charge b to the tenants using it now (or, when none does, to its last payers)."""
        payers = tuple(sorted(b.users)) or b.payers
        if payers == b.payers:
            return
        if b.tier is TierKind.DEVICE:
            owner = b.request.tenant
            self.tenancy.split(owner, b.payers, -1)
            self.tenancy.split(owner, payers, 1)
        b.payers = payers

    @staticmethod
    def _compact(keeper: Request) -> None:
        """Close the holes blocks let go of left in a keeper's block list."""
        live = keeper.live_blocks()
        for i, b in enumerate(live):
            b.index = i
        keeper.blocks = live
