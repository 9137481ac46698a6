"""Shared prefix blocks at the node: the engine's calls on blocks named by key (look up,
store, commit, load), each run on the pool that holds the request (see core/prefix.py for
what a pool does with them)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence

import structlog

from kvd.core.blocks import Block, Request, TierKind
from kvd.core.errors import Aborted, BlocksInTransit, FailedPrecondition, KvdError
from kvd.core.prefix import check_keys_sliced
from kvd.runtime import PoolRuntime

log = structlog.get_logger("kvd.shared")


class SharedBlocks:
    """The node's entry to its pools' shared prefix blocks. `runtime` finds a pool by name,
    `runtime_of` the pool of a request the caller may touch (see Node)."""

    def __init__(self, runtime: Callable[[str], PoolRuntime],
                 runtime_of: Callable[[str, str | None], PoolRuntime],
                 on_room: Callable[[PoolRuntime], None] | None = None,
                 refuse_while_handed_off: Callable[[str, str], None] | None = None,
                 slice_blocks: int = 256) -> None:
        self.runtime = runtime
        self.slice_blocks = slice_blocks  # see _store_sliced
        # Requests being released (Node.release): their uses end a slice at a time before
        # they go, and a commit meanwhile is refused as released, not as storing nothing.
        self.releasing: set[str] = set()
        self.runtime_of = runtime_of
        # Refuses a call on a request whose handoff is under way (see
        # Handoffs.refuse_while_under_way).
        self.refuse_while_handed_off = refuse_while_handed_off
        # Told when a store or load left a pool's running working sets smaller (blocks a
        # request stored or loaded are shared, not its working set): queued requests may go.
        self.on_room = on_room

    def _room_grew(self, rt: PoolRuntime, working_set_before: int) -> None:
        if self.on_room is not None and rt.pool.admission.working_set_used() < working_set_before:
            self.on_room(rt)

    def lookup(self, pool: str, namespace: str, keys: Sequence[bytes]) -> list[Block]:
        """The leading run of these prefix keys a pool holds (see Prefixes.lookup)."""
        rt = self.runtime(pool)
        return rt.pool.lookup(namespace, keys)

    async def store(self, request_id: str, namespace: str, keys: Sequence[bytes],
                    scope: str | None = None, holder: str = "", intent: dict | None = None
                    ) -> tuple[list[Block], list[bool], float]:
        """Shared blocks under these keys for a request: (blocks, fresh per key, stall).
        Fresh ones hold no written bytes yet (new pages, or another request's not yet
        committed), held for the holder, which writes them and commits. More than a
        slice's worth of keys are stored a slice at a time (see _store_sliced)."""
        rt = self.runtime_of(request_id, scope)
        if len(keys) > self.slice_blocks:
            blocks, unheld, stall_s = await self._store_sliced(rt, request_id, namespace,
                                                               keys, holder, intent)
        else:
            blocks, _, unheld, stall_s = await self._store(rt, request_id, namespace, keys,
                                                           holder, intent)
        holds = rt.pool.pages.holds
        if any(b.tier is TierKind.NONE for b in blocks):
            # Let go while the room was being made: the holder ended its hold with another
            # call meanwhile. The request keeps what it stored; a second store finds it.
            raise Aborted("blocks found for this store were evicted while it waited for "
                          "room (another call by the same holder ended their hold); store "
                          "again")
        # A handoff begun while it waited: what it placed stays unwritten and goes with
        # the request's pool (nothing is told to write it), see _not_handing_off.
        self._not_handing_off(request_id, rt)
        # The engine writes every block kvd has no written bytes for: its new pages, and
        # those another request stored and has not committed yet (that one may never: its
        # engine may die first). A name is its tokens' hash, so both write the same bytes,
        # and whoever commits first publishes bytes it wrote. A block still moving (placed
        # for another store, or between tiers) is not written into; and a request commits
        # only what it was told to write, so none publishes a page nobody wrote.
        #
        # What the engine is told to write is held for it until its next call, as new
        # pages are: a block found still moving (between tiers, or placed for another
        # store) was not held when the store was planned (`unheld`), nor one whose hold
        # ended with another call of the holder's while the store went on (unheld None,
        # or ended between the slices below), and a release before the engine wrote it
        # would have given its page to another request. (Many blocks' flags are worked
        # out a slice at a time: a block's is what holds at its slice's turn.)
        size = self.slice_blocks
        ended = unheld is None
        missed = set() if ended else {id(b) for b in unheld}
        present = holds.present(holder) if holder else None
        fresh: list[bool] = []
        for start in range(0, len(blocks), size):
            if start:
                await asyncio.sleep(0)
                ended = ended or bool(holder) and holds.called_again(holder, present)
            part = blocks[start:start + size]
            flags = rt.pool.prefixes.to_write(request_id, part)
            fresh += flags
            hold = [b for b, f in zip(part, flags) if f and (ended or id(b) in missed)]
            if holder and hold:
                holds.hold_unheld(holder, hold)
                present = holds.present(holder)
        return blocks, fresh, stall_s

    async def _store(self, rt: PoolRuntime, request_id: str, namespace: str,
                     keys: Sequence[bytes], holder: str, intent: dict | None,
                     wait: bool = True
                     ) -> tuple[list[Block], list[Block], list[Block], float]:
        """The pool's store of these keys, in one go: (blocks, the blocks among them the
        request uses since this store, those it could not hold for the holder (None: the
        holder's holds ended while its copies ran, see store), stall). `wait=False`:
        BlocksInTransit where it would wait for room or for blocks in transit (see
        PoolRuntime.run)."""
        self._not_handing_off(request_id, rt)
        before = rt.pool.admission.working_set_used()
        pool = rt.pool

        def store() -> tuple:
            (plan, blocks), added = _with_new_uses(pool, request_id, lambda: pool.store(
                request_id, namespace, keys, holder, intent))
            # A block found moving was not held (Prefixes.store); its new pages were.
            placed = {id(b) for b in plan.allocated}
            unheld = ([b for b in blocks if (b.moving or b.tier is TierKind.NONE)
                       and id(b) not in placed] if holder else [])
            return plan, blocks, added, unheld, pool.pages.holds.present(holder)

        plan, blocks, added, unheld, holds = await rt.run(store, holder=holder, wait=wait)
        self._room_grew(rt, before)
        stall_s = await rt.execute(plan) if plan.num_copies else rt.complete_now(plan)
        if holder and pool.pages.holds.called_again(holder, holds):
            unheld = None
        return blocks, added, unheld, stall_s

    async def _store_sliced(self, rt: PoolRuntime, request_id: str, namespace: str,
                            keys: Sequence[bytes], holder: str, intent: dict | None
                            ) -> tuple[list[Block], list[Block], float]:
        """A store of more than a slice's keys: refused whole when the request may not store
        them all now, else stored a slice at a time, the loop served between slices (a
        Store of a 128K-token prompt's 8,192 blocks would otherwise hold every other
        tenant's calls for tens of milliseconds). All or nothing still: one that fails or
        is cancelled part way gives back the uses it added (the engine was told of none of
        them), and one whose next slice would wait for room gives them back and is stored
        whole instead, waiting as any store does (see sliced.allocate for why)."""
        self._not_handing_off(request_id, rt)
        req, checks = rt.pool.check_store(request_id, namespace, keys, intent,
                                          self.slice_blocks)
        await _served_between(checks)
        blocks: list[Block] = []
        added: list[Block] = []  # the uses its slices added
        unheld: list[Block] | None = []  # None: see _store
        stall_s = 0.0
        size = self.slice_blocks
        holds = rt.pool.pages.holds
        present = None
        try:
            while len(blocks) < len(keys):
                if blocks:
                    await asyncio.sleep(0)
                    if holder and holds.called_again(holder, present):
                        unheld = None  # the holder's holds ended between two slices
                    if rt.pool.requests.get(request_id) is not req:
                        raise FailedPrecondition(
                            f"request {request_id!r} was released or handed off while "
                            "its store was done")
                try:
                    part, uses, missed, stalled = await self._store(
                        rt, request_id, namespace, keys[len(blocks):len(blocks) + size],
                        holder, intent, wait=not blocks)
                except BlocksInTransit:  # would wait holding what it stored: whole instead
                    self._give_back(rt, req, blocks, added, holder)
                    blocks, added, unheld = [], [], []  # given back: not again (see load)
                    part, uses, missed, stalled = await self._store(
                        rt, request_id, namespace, keys, holder, intent)
                blocks += part
                added += uses
                if unheld is not None:
                    unheld = None if missed is None else unheld + missed
                stall_s += stalled
                present = holds.present(holder)
        except BaseException as exc:  # a cancel too: the engine is told of none of them
            self._stopped(exc, rt, req, blocks, added, holder, f"of the {len(keys)} keys "
                          "were stored")
            raise
        return blocks, unheld, stall_s

    def _stopped(self, exc: BaseException, rt: PoolRuntime, req: Request,
                 stored: list[Block], added: list[Block], holder: str, done: str) -> None:
        """A sliced store or load stopped part way with `exc`: what it did goes back
        (_give_back), and the error says how far it had come (`done`: "of the N keys
        were stored")."""
        if not stored:
            return
        self._give_back(rt, req, stored, added, holder)
        if isinstance(exc, KvdError):
            exc.args = (f"{exc.args[0]} (after {len(stored)} {done}: given back, or gone "
                        "with the request)",)

    def _give_back(self, rt: PoolRuntime, req: Request, stored: list[Block],
                   added: list[Block], holder: str) -> None:
        """The uses a sliced store or load added, given back (see Pool.end_uses_of): not while
        the request is handed off (the handoff's commit lets go of what it stored and
        never committed) or once it is gone (its release did)."""
        request_id = req.request_id
        if (not stored or rt.pool.requests.get(request_id) is not req
                or self._handing_off(request_id)):
            return
        try:
            rt.pool.end_uses_of(req, added, holder, stored)
        except (KvdError, BlocksInTransit) as exc:  # moving: the request's release does it
            log.warning("shared blocks of a failed store or load left with their request",
                        request_id=request_id, blocks=len(added), error=str(exc))
            return
        rt.room_may_have_changed()
        if self.on_room is not None:
            self.on_room(rt)

    def _handing_off(self, request_id: str) -> bool:
        if self.refuse_while_handed_off is None:
            return False
        try:
            self.refuse_while_handed_off(request_id, "store")
        except FailedPrecondition:
            return True
        return False

    def _not_handing_off(self, request_id: str, rt: PoolRuntime) -> None:
        """Refuse a store while the request is handed off, or once it left the pool the
        store placed its blocks in: those pages are that pool's, and the handoff's commit
        (or a release) lets go of what the request stored there and never committed, so an
        engine told to write them would write into pages another request may have by then.
        An Allocate is refused alike."""
        if self.refuse_while_handed_off is not None:
            self.refuse_while_handed_off(request_id, "store")
        if rt.pool.requests.get(request_id) is None:
            raise FailedPrecondition(
                f"request {request_id!r} left pool {rt.pool.name!r} while this store waited "
                "(handed off or released): nothing it placed there is to be written")

    async def commit(self, request_id: str, namespace: str, keys: Sequence[bytes],
                     scope: str | None = None) -> int:
        """The engine wrote these stored blocks: lookups find them from now on. More than a
        slice's worth of keys are checked, then committed, a slice at a time: all are
        checked before any is committed; a block let go between slices (evicted before
        it was committed) is not."""
        rt = self.runtime_of(request_id, scope)
        self._refuse_while_releasing(request_id, 0)
        if len(keys) <= self.slice_blocks:
            return await rt.run(lambda: rt.pool.commit(request_id, namespace, keys))
        pool = rt.pool
        req = pool.get_admitted(request_id)
        size = self.slice_blocks
        await _served_between(check_keys_sliced(namespace, keys, size))
        blocks: list[Block] = []
        newly = 0
        for phase in ("checked", "committed"):
            for start in range(0, len(keys), size):
                await asyncio.sleep(0)
                self._refuse_while_releasing(request_id, newly)
                if pool.requests.get(request_id) is not req:
                    raise FailedPrecondition(
                        f"request {request_id!r} was released or handed off while its "
                        f"commit was done; {newly} of its blocks were committed")
                if phase == "checked":
                    blocks += pool.check_commit(request_id, namespace,
                                                keys[start:start + size])
                else:
                    newly += pool.commit_blocks(request_id, blocks[start:start + size])
        return newly

    def _refuse_while_releasing(self, request_id: str, committed: int) -> None:
        if request_id in self.releasing:
            raise FailedPrecondition(
                f"request {request_id!r} is being released: its blocks cannot be committed "
                f"({committed} of them were)")

    async def load(self, request_id: str, namespace: str, keys: Sequence[bytes],
                   scope: str | None = None, holder: str = "", intent: dict | None = None
                   ) -> list[Block]:
        """The leading run of these keys, held for the holder to copy from. More than a
        slice's worth of keys are loaded a slice at a time (see _load_sliced)."""
        rt = self.runtime_of(request_id, scope)
        if len(keys) > self.slice_blocks:
            return await self._load_sliced(rt, request_id, namespace, keys, holder, intent)
        blocks, _ = await self._load(rt, request_id, namespace, keys, holder, intent)
        return blocks

    async def _load(self, rt: PoolRuntime, request_id: str, namespace: str,
                    keys: Sequence[bytes], holder: str, intent: dict | None,
                    wait: bool = True) -> tuple[list[Block], list[Block]]:
        """The pool's load of these keys, in one go: (the leading run, the blocks among
        them the request uses since this load). `wait`: as _store's."""
        before = rt.pool.admission.working_set_used()
        pool = rt.pool

        run, added = await rt.run(lambda: _with_new_uses(pool, request_id, lambda: pool.load(
            request_id, namespace, keys, holder, intent)), holder=holder, wait=wait)
        self._room_grew(rt, before)
        return run, added

    async def _load_sliced(self, rt: PoolRuntime, request_id: str, namespace: str,
                           keys: Sequence[bytes], holder: str, intent: dict | None
                           ) -> list[Block]:
        """A load of more than a slice's keys, as _store_sliced: checked whole, then loaded
        a slice at a time, the run ending where a slice's does (a key evicted between
        slices ends it there, as it would have had it gone before the load). One that
        fails or is cancelled part way gives back the uses it added; one whose next slice
        would wait in a stalled room line (which may wait for the holds of what it
        loaded) gives them back and loads whole."""
        req, checks = rt.pool.check_load(request_id, namespace, keys, intent,
                                         self.slice_blocks)
        await _served_between(checks)
        blocks: list[Block] = []
        added: list[Block] = []
        size = self.slice_blocks
        try:
            for start in range(0, len(keys), size):
                if start:
                    await asyncio.sleep(0)
                    if rt.pool.requests.get(request_id) is not req:
                        raise FailedPrecondition(
                            f"request {request_id!r} was released or handed off while "
                            "its load was done")
                part = keys[start:start + size]
                try:
                    run, uses = await self._load(rt, request_id, namespace, part, holder,
                                                 intent, wait=not start)
                except BlocksInTransit:  # would wait holding what it loaded: whole instead
                    self._give_back(rt, req, blocks, added, holder)
                    blocks, added = [], []  # given back: not again, should this one fail
                    blocks, added = await self._load(rt, request_id, namespace, keys,
                                                     holder, intent)
                    break
                blocks += run
                added += uses
                if len(run) < len(part):
                    break  # the leading run ends here
        except BaseException as exc:  # a cancel too: the engine is told of none of them
            self._stopped(exc, rt, req, blocks, added, holder, f"of the {len(keys)} keys "
                          "were loaded")
            raise
        return blocks


async def _served_between(steps: Iterator[None]) -> None:
    """Run a call's checks that yield between slices (see Prefixes.check_store), the loop
    served at each yield."""
    for _ in steps:
        await asyncio.sleep(0)


def _with_new_uses(pool, request_id: str, op):
    """op()'s result (a pool's store or load for the request), and the shared blocks the
    request uses since: its new uses come last in its list (Prefixes.store, load)."""
    req = pool.requests.get(request_id)
    n = len(req.shared) if req is not None else 0
    result = op()
    return result, req.shared[n:]
