"""Holds: device blocks handed to an engine that may still write or read their pages.

An engine is told a block's page (by allocate, access, or a handoff's last message) and then
writes or reads it in its own time, until its next call to kvd. Until then the block must not
be evicted: no demotion may copy its bytes before the engine wrote them, and no other block may
be given its page under the engine's feet. A held block leaves the eviction policy, as a
pinned one does, but counts as no pin; a holder's next call (or its lease lapsing) gives its
blocks back to the policy.

A Step that finds a request's blocks all in place holds the request, not its blocks: the
request is noted for the holder, and its blocks leave the policy only when the policy offers
one of them as a victim (`materialize_some`; all of them, `materialize`, when it cannot offer
enough; a fair policy leaves such a request out of its choice instead). A step costs one
entry per request, not per block, what it handed out is still never taken under the engine,
and another's call that chooses victims elsewhere costs nothing for the blocks an engine
holds so (holding every one of them at each choice cost every such call as much as the
engines' reads: hundreds of thousands of blocks, with long contexts).

A request released by someone else (an operator, a lapsed lease, another of the tenant's
clients) while a holder holds its blocks does not give their device pages to another block
at once: the engine may still be writing them (a decode step writes each request's last
block, or the fresh prefix blocks its Store handed it, which go with the request when it
never committed them). Nor do blocks another client frees. The pages stay out of use, owned
by nobody, until each of their holders calls again or its holds lapse (`keep`): the bytes of
blocks that went never land in another request's.

Likewise, a request another client hands off is not copied while an engine holds its blocks:
the handoff waits for each such holder's next call (`writers`, `called_again`, `watchers`).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping

from kvd.core.blocks import Block, Request, RequestState, TierKind, evictable
from kvd.core.clock import Clock
from kvd.core.policies import EvictionPolicy

# kvd's own holders (no client's holder starts so: see Caller.holder): their holds end when
# kvd's work that took them does, and never lapse.
OWN_HOLDER = "kvd:"
# Who holds the blocks a read swapping in rounds brought in, until it is done (see
# PoolRuntime.access and PageTable.swapping); one such read at a time.
SWAP_HOLDER = OWN_HOLDER + "swap-rounds"
# Who holds what a holder held past a slice when its holds ended (see end's at_most): kvd
# ends them a slice at a time, in turns of the loop of their own (see end_more).
ENDING_HOLDER = OWN_HOLDER + "ending:"


class Holds:
    """Blocks held by holder (a client's lease, a Step stream), and since when."""

    def __init__(self, clock: Clock, requests: Mapping[str, Request],
                 policy: EvictionPolicy, release_page: Callable[[int], None]) -> None:
        self.clock = clock
        self.requests = requests  # read only: whether a held block's request still lives
        # The page table's policy; the page table sets it anew when it switches policy.
        self.policy = policy
        # holder -> (since, blocks held, lists of requests held whose blocks are not yet)
        self._by_holder: dict[str, tuple[float, list[Block], list[list[Request]]]] = {}
        self.count = 0  # blocks held now
        self._lazy = 0  # holders with requests held by request (see hold_requests)
        # holder -> the requests it holds by request whose blocks it holds now (see
        # materialize_some); forgotten with the holder's entry.
        self._materialized: dict[str, set[Request]] = {}
        # Holders whose Step message is being served (the node's set, shared by its pools).
        self.serving: set[str] = set()
        # Holders with a read under way that brings its blocks in a slice at a time (how
        # many, see reading_in_slices).
        self.reading: Counter[str] = Counter()
        # Device pages of blocks that went while held (see keep): page -> its holders, and
        # holder -> its pages; `release_page` frees one once no holder is left.
        self.kept: dict[int, set[str]] = {}
        self._kept_by_holder: dict[str, list[int]] = {}
        self.release_page = release_page
        # id of a read's list of requests held by request -> (the list, its set): see
        # _holding_by_request.
        self._sets: dict[int, tuple[list[Request], set[Request]]] = {}
        # Called whenever a holder's holds end or are replaced (its next call, or a lapse):
        # a handoff waiting for the engines that hold its request's blocks (see writers).
        self.watchers: list[Callable[[], None]] = []
        # Holders (ENDING_HOLDER...) whose holds end a slice at a time, in order.
        self.ending: deque[str] = deque()
        self._num_ending = 0

    def hold_one(self, holder: str, block: Block) -> None:
        """Hold a device block for the holder until its next call (another holder's hold of
        it, ending first, leaves it held)."""
        self._entry(holder)[1].append(block)
        block.held += 1
        if block.held > 1:
            return
        if block in self.policy:
            self.policy.remove(block)
        self.count += 1

    def hold_new(self, holder: str, blocks: list[Block]) -> None:
        """hold_one() of each of these blocks just made (held by nobody, in no policy)."""
        self._entry(holder)[1].extend(blocks)
        for block in blocks:
            block.held = 1
        self.count += len(blocks)

    def hold_unheld(self, holder: str, blocks: list[Block]) -> None:
        """Hold those of these device blocks the holder does not hold yet (hold_one)."""
        if not blocks:
            return
        entry = self._by_holder.get(holder)
        mine = {id(b) for b in entry[1]} if entry is not None else set()
        for b in blocks:
            if id(b) not in mine:
                self.hold_one(holder, b)

    def _entry(self, holder: str) -> tuple[float, list[Block], list[list[Request]]]:
        entry = self._by_holder.get(holder)
        if entry is None:
            # Since its reply, which is still to come (renew): a call holds what it plans
            # at once, and may wait seconds for its copies before it hands them out.
            entry = self._by_holder[holder] = (math.inf, [], [])
        return entry

    def hold_requests(self, holder: str, requests: list[Request]) -> None:
        """Hold these requests' device blocks for the holder until its next call, by request:
        their blocks leave the policy once it offers one of them (materialize_some). The
        list is kept as it is (a read's list of requests, which nobody changes)."""
        if not requests:
            return
        self._materialized.pop(holder, None)  # held anew when next offered
        lazy = self._entry(holder)[2]
        if not lazy:
            self._lazy += 1
        lazy.append(requests)

    def only_requests(self, holder: str) -> bool:
        """Whether the holder holds no block itself (requests at most, or nothing), and no
        page kept for it (see keep)."""
        entry = self._by_holder.get(holder)
        return (entry is None or not entry[1]) and holder not in self._kept_by_holder

    def hold_again(self, holder: str, requests: list[Request]) -> None:
        """The holder's next call holds these requests (see hold_requests) in place of what
        it held, which was requests at most (only_requests): ending those changes nothing
        else (see end_if_only_requests), so the entry is replaced in one step."""
        entry = self._by_holder.get(holder)
        if entry is None or not entry[2]:
            self._lazy += 1
        self._by_holder[holder] = (self.clock.now(), [], [requests])
        self._materialized.pop(holder, None)
        if self.watchers:
            self._tell_watchers()

    def materialize(self) -> None:
        """Hold the blocks of every request held by request (those materialize_some has not
        held yet): before victims are chosen where every block out of the policy's reach
        must be (an operator's Evict, a choice that came short)."""
        if not self._lazy:
            return
        self._lazy = 0
        done = self._materialized
        for holder, (_, _, lazy) in self._by_holder.items():  # hold() adds no holder
            held = done.get(holder, ())
            for requests in lazy:
                for req in requests:
                    if req not in held and self._live(req):  # else released since
                        self.hold(holder, req.live)
            lazy.clear()
        done.clear()

    def held_by_request(self, requests: Collection[Request]) -> set[Request]:
        """Those of `requests` (a choice's victims' requests) some holder holds by request
        whose blocks it does not hold yet (see materialize_some): their blocks must not be
        chosen."""
        return {req for _, req in self._unheld(requests)}

    def materialize_some(self, requests: Collection[Request]) -> None:
        """Hold the blocks of those of `requests` (held_by_request's) that a holder holds by
        request, for each such holder: they leave the policy. A request's blocks are held
        once for each holder (its blocks added since are not, as materialize() would not
        have held them either)."""
        for holder, req in list(self._unheld(requests)):
            self._materialized.setdefault(holder, set()).add(req)
            self.hold(holder, req.live)

    def _unheld(self, requests: Collection[Request]) -> Iterator[tuple[str, Request]]:
        """(holder, request) for each of `requests` still the pool's that a holder holds by
        request and has not held the blocks of yet, once per holder."""
        if not self._lazy:
            return
        done = self._materialized
        for holder, (_, _, lazy) in self._by_holder.items():
            held = done.get(holder, ())
            found = {req for listed in lazy for req in requests
                     if req in self._set_of(listed) and req not in held}
            for req in found:
                if self._live(req):
                    yield holder, req

    def stray_materialized(self) -> list[str]:
        """Holders whose requests held by request are noted as held (materialize_some) while
        they hold no request so (the self-check's): a note that outlived its holder's holds."""
        return [h for h in self._materialized
                if h not in self._by_holder or not self._by_holder[h][2]]

    def has_requests(self) -> bool:
        """Whether some holder holds requests by request (see materialize_some)."""
        return self._lazy > 0

    def _live(self, req: Request) -> bool:
        """Whether a request held by request is still the pool's, admitted."""
        return self.requests.get(req.request_id) is req and req.state is RequestState.ADMITTED

    def hold(self, holder: str, blocks: Iterable[Block]) -> None:
        """Hold the blocks of these that are settled in the device tier."""
        for b in blocks:
            if b.tier is TierKind.DEVICE and not b.moving:
                self.hold_one(holder, b)

    def unhold(self, holder: str, blocks: list[Block], to_policy: bool = False) -> None:
        """The holder's holds of these blocks are void (an allocation or a store gave back
        what it made before telling its engine, see sliced and SharedBlocks): out of its
        entry, which goes when nothing is left in it. `to_policy`: a block held by nobody
        now is evictable again, as at end() (else the caller lets go of them all)."""
        entry = self._by_holder.get(holder)
        if entry is None:
            return
        going = {id(b) for b in blocks}
        kept = []
        for b in entry[1]:
            if id(b) not in going:
                kept.append(b)
            elif b.held:
                b.held -= 1
                if not b.held:
                    self.count -= 1
                    if to_policy:
                        self._back_to_policy(b)
        self._keep_blocks(holder, entry, kept)

    def let_go(self, holder: str, blocks: list[Block]) -> None:
        """Undo these hold_one()s of the holder's, one each (a block in the list twice, two),
        the latest first: a call gives up what it held before telling its engine of it,
        and the holds the holder had before the call stay (a read in slices that would wait
        for room, see sliced). A block held by nobody then is evictable again."""
        entry = self._by_holder.get(holder)
        if entry is None or not blocks:
            return
        going = Counter(id(b) for b in blocks)
        kept = []
        for b in reversed(entry[1]):
            if not going[id(b)]:
                kept.append(b)
                continue
            going[id(b)] -= 1
            if b.held:
                b.held -= 1
                if not b.held:
                    self.count -= 1
                    self._back_to_policy(b)
        kept.reverse()
        self._keep_blocks(holder, entry, kept)

    def _keep_blocks(self, holder: str, entry: tuple, kept: list[Block]) -> None:
        """The holder's entry holds only `kept` of its blocks now (unhold, let_go); it goes
        when nothing is left in it."""
        if kept or entry[2] or holder in self._kept_by_holder:
            self._by_holder[holder] = (entry[0], kept, entry[2])
        else:
            del self._by_holder[holder]
        if self.watchers:
            self._tell_watchers()

    def forget(self, block: Block) -> None:
        """The block is gone (freed or released): it is held no more. Its holder's entry
        forgets it at end()."""
        if block.held:
            block.held = 0
            self.count -= 1

    def has(self, holder: str) -> bool:
        """Whether the holder has blocks (or requests) held."""
        return holder in self._by_holder

    def count_of(self, holder: str) -> int:
        """Blocks held for this holder now (a block it held twice counts once)."""
        entry = self._by_holder.get(holder)
        return 0 if entry is None else len({id(b) for b in entry[1] if b.held})

    def some_may_end(self, *own: str) -> bool:
        """Whether some holds may end while a caller waits: those of a holder whose message
        is not being served (its next call ends them, or they lapse), other than the
        caller's `own` holders (a read's swap rounds; the caller's, while it reads in slices
        what it holds). A Step stream being served gives nothing back until its next
        message, which waits for this one: waiting on its holds, its own or another's
        waiting likewise, would wait for ever."""
        serving = self.serving
        return (any(h not in serving and h not in own and blocks
                    for h, (_, blocks, _) in self._by_holder.items())
                or any(h not in serving and h not in own for h in self._kept_by_holder))

    def end_if_only_requests(self, holder: str) -> bool:
        """End the holder's holds if they are of requests whose blocks never left the policy
        (nothing else changes then); whether they were."""
        entry = self._by_holder.get(holder)
        if entry is None or entry[1] or holder in self._kept_by_holder:
            return False
        del self._by_holder[holder]
        if entry[2]:
            self._lazy -= 1
            self._materialized.pop(holder, None)
        if self.watchers:
            self._tell_watchers()
        return True

    def since(self) -> dict[str, float]:
        """Each holder with blocks held, and since when it was handed them (inf: its call
        is not answered yet, see renew)."""
        return {h: since for h, (since, _, _) in self._by_holder.items()}

    @contextlib.contextmanager
    def reading_in_slices(self, holder: str) -> Iterator[None]:
        """While a read of the holder's brings its blocks in a slice at a time: what it
        holds ends at its caller's next call, after the read, so the read's own slices do
        not wait for it (see sliced.access, PageTable.evict)."""
        self.reading[holder] += 1
        try:
            yield
        finally:
            self.reading[holder] -= 1
            if not self.reading[holder]:
                del self.reading[holder]

    def renew(self, holder: str) -> None:
        """The holder's call was answered now: what it holds counts as handed out now, and
        may lapse from now on. (A call holds its blocks from the moment it plans; one that
        waited seconds for its copies handed out pages whose holds had lapsed meanwhile.)"""
        entry = self._by_holder.get(holder)
        if entry is not None:
            self._by_holder[holder] = (self.clock.now(), entry[1], entry[2])

    def end(self, holder: str, at_most: int | None = None) -> bool:
        """The holder called again (or went away): what it was handed is evictable again.
        Returns whether it held anything. `at_most`: only so many of its blocks go back to
        the policy now; the rest stay held, for a holder of kvd's own (ENDING_HOLDER...)
        whose holds end_more ends a slice at a time (an engine handed 65,536 blocks at once
        would otherwise hold the loop while each goes back)."""
        entry = self._by_holder.pop(holder, None)
        if entry is None:
            return False
        if entry[2]:
            self._lazy -= 1
            self._materialized.pop(holder, None)
        if self._kept_by_holder:
            self._let_go(holder)
        blocks = entry[1]
        if at_most is not None and len(blocks) > at_most:
            self._num_ending += 1
            rest = f"{ENDING_HOLDER}{self._num_ending}"
            self._by_holder[rest] = (entry[0], blocks[at_most:], [])
            self.ending.append(rest)
            blocks = blocks[:at_most]
        for b in blocks:
            if not b.held:
                continue  # gone since
            b.held -= 1
            if b.held:
                continue  # another holder's still
            self.count -= 1
            self._back_to_policy(b)
        if self.watchers:
            self._tell_watchers()
        return True

    def _back_to_policy(self, b: Block) -> None:
        """b, held by nobody now, is evictable again if it is still its request's."""
        req = b.request
        if (self.requests.get(req.request_id) is req and req.blocks[b.index] is b
                and evictable(b)):
            self.policy.insert(b)

    def end_more(self, at_most: int | None) -> bool:
        """End the next slice of the holds that end a slice at a time (see end; None: the
        next holder's whole); whether some are left."""
        if self.ending:
            self.end(self.ending.popleft(), at_most)
        return bool(self.ending)

    def writers(self, req: Request) -> dict[str, object]:
        """The clients' holders that hold a device block of req now (by block, or by a read
        of req): each may still be writing it until its next call. Each with its present
        holds, for `called_again`."""
        found = set(self._holding_by_request(req)) if self._lazy else set()
        found.update(h for h, _ in self._holding_blocks(req.live))
        return {h: self._by_holder[h] for h in found if not h.startswith(OWN_HOLDER)}

    def present(self, holder: str) -> object:
        """The holder's present holds, for called_again (None when it holds nothing)."""
        return self._by_holder.get(holder)

    def called_again(self, holder: str, holds: object) -> bool:
        """Whether the holder called again (or its holds lapsed) since it held `holds` (one
        of writers()' values): what it wrote by then is in the pages."""
        return self._by_holder.get(holder) is not holds

    def _tell_watchers(self) -> None:
        for watcher in list(self.watchers):
            watcher()

    def keep(self, req: Request, blocks: list[Block]) -> set[int]:
        """The device pages of these blocks of req (going now: freed, or req released) that
        a client's holder still holds, by block or by request (a read): kept out of use
        until each such holder's next call, or until its holds lapse. Returns them; the
        caller lets go of the blocks without freeing those pages (PageTable.discard). kvd's
        own holders are not waited for: their work ended before a free or release could
        run. (The caller's own holds ended before its call: see unary and Step.)"""
        held = [b for b in blocks if b.held and b.tier is TierKind.DEVICE]
        lazy_holders = self._holding_by_request(req) if self._lazy else ()
        if not held and not lazy_holders:
            return set()
        holders_of: dict[int, set[str]] = {}
        for h, b in self._holding_blocks(held):  # clients' holders only
            holders_of.setdefault(b.page, set()).add(h)
        for b in blocks:  # a read held every device block its engine was told of
            if lazy_holders and b.tier is TierKind.DEVICE and not b.moving:
                holders_of.setdefault(b.page, set()).update(lazy_holders)
        kept = set()
        for page, holders in holders_of.items():
            holders = {h for h in holders if not h.startswith(OWN_HOLDER)}
            if holders:
                kept.add(page)
                self.kept[page] = holders
                for h in holders:
                    self._kept_by_holder.setdefault(h, []).append(page)
        return kept

    def _holding_blocks(self, blocks: list[Block]) -> Iterator[tuple[str, Block]]:
        """(holder, block) for each hold by block of one of these blocks by a client's
        holder: kvd's own are waited for by nobody (see keep and writers), and not looked
        at (holds ending a slice at a time hold tens of thousands of blocks, see end)."""
        held = {id(b) for b in blocks if b.held}
        if not held:
            return
        for h, (_, entry_blocks, _) in self._by_holder.items():
            if h.startswith(OWN_HOLDER):
                continue
            for b in entry_blocks:
                if id(b) in held and b.held:
                    yield h, b

    def _holding_by_request(self, req: Request) -> list[str]:
        """The holders that hold req by request (a read's lazy hold)."""
        found = []
        for h, (_, _, lazy) in self._by_holder.items():
            for requests in lazy:
                if req in self._set_of(requests):
                    found.append(h)
                    break
        return found

    def _set_of(self, requests: list[Request]) -> set[Request]:
        """A read's list of requests held by request, as a set (by identity), made once:
        nobody changes such a list, so a step's free or a choice's victims ask each
        holder once, not each request of its batch."""
        sets = self._sets
        entry = sets.get(id(requests))
        if entry is None:  # (the entry keeps the list: its id is not reused)
            if len(sets) > 2 * len(self._by_holder) + 16:
                sets.clear()  # lists no holder holds any more
            entry = sets[id(requests)] = (requests, set(requests))
        return entry[1]

    def kept_without_holder(self) -> list[str]:
        """Holders with pages kept for them that hold nothing else (the self-check's): no
        next call or lapse of theirs would let go of those pages."""
        return [h for h in self._kept_by_holder if h not in self._by_holder]

    def _let_go(self, holder: str) -> None:
        """The holder called again: the kept pages only it still held are free."""
        for page in self._kept_by_holder.pop(holder, ()):
            holders = self.kept[page]
            holders.discard(holder)
            if not holders:
                del self.kept[page]
                self.release_page(page)
