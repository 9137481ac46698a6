"""An engine stand-in: continuous batching against a live kvd over one Step stream.

Each engine step sends one Step message for every running request: allocations for prefills
and for sequences that cross a block boundary, reads of every block (attention), releases of
finished requests. Requests bigger than `chunk_blocks` are read in chunks within the step, as
an engine that streams a long context through a smaller device share does: each chunk a
message of its own, so the pages of one are given back before the next is read.

A request with block keys (its prompt's prefix blocks, named as an engine's prefix cache names
them) shares them: on admission the engine looks the keys up, loads the leading run kvd holds
(a prefix hit, not recomputed) and stores the rest for the next request with that prefix;
only the blocks its decoding adds are its own.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from kvd_client import (
    AbortedError,
    AsyncClient,
    FailedPreconditionError,
    KvdClientError,
    ResourceExhaustedError,
    pb,
)

# Items (requests named, updates) one Step message may hold: kvd's max_items_per_call default.
MAX_ITEMS = 1024
# Steps in a row with nothing refused after which chunks shrunk by refusals double again.
GROW_AFTER = 8


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt_tokens: int
    output_tokens: int
    klass: str = "default"
    arrival_s: float = 0.0  # offset from the start of the run
    # Filled in as it runs.
    arrived_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    rejected: str = ""
    queued: bool = False
    prefill_stall_s: float = 0.0  # the stall of the step that allocated its prompt
    generated: int = 0
    num_blocks: int = 0  # its own blocks (decode), past its shared prompt blocks
    prefilled: bool = False
    keys: tuple[bytes, ...] = ()  # shared prompt blocks (empty: the prompt's blocks are own)
    hit_blocks: int = 0  # of `keys`, the leading run kvd held on arrival

    @property
    def admission_wait_s(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.arrived_at


@dataclass
class StepSample:
    at: float
    latency_s: float
    stall_s: float
    num_running: int
    errors: int
    prefill: bool  # the step allocated some request's prompt (its stall is TTFT's memory part)


@dataclass
class EngineStats:
    steps: list[StepSample] = field(default_factory=list)
    tokens: int = 0
    started: float = 0.0
    ended: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        span = self.ended - self.started
        return self.tokens / span if span > 0 else 0.0


_SECTIONS = ("intents", "frees", "releases", "allocations", "read_all")


def _split(step: pb.StepRequest) -> list[tuple[pb.StepRequest, dict[str, list[int]]]]:
    """The step as messages of at most MAX_ITEMS items, its sections in order, each with
    the step's index of every item by section."""
    parts: list[tuple[pb.StepRequest, dict[str, list[int]]]] = []
    part, where, n = pb.StepRequest(step_id=step.step_id), {s: [] for s in _SECTIONS}, 0
    for section in _SECTIONS:
        for i, item in enumerate(getattr(step, section)):
            if n == MAX_ITEMS:
                parts.append((part, where))
                part, where, n = pb.StepRequest(), {s: [] for s in _SECTIONS}, 0
            getattr(part, section).append(item)
            where[section].append(i)
            n += 1
    parts.append((part, where))
    return parts


class Engine:
    """Runs requests through kvd at a steady step pace."""

    def __init__(self, client: AsyncClient, *, block_tokens: int, step_s: float,
                 chunk_blocks: int = 256, pool: str = "", tenant: str = "",
                 namespace: str = "") -> None:
        self.client = client
        self.namespace = namespace  # of the requests' block keys
        self.block_tokens = block_tokens
        self.step_s = step_s
        self.chunk_blocks = chunk_blocks
        self.alloc_chunk = chunk_blocks
        self.max_chunk = chunk_blocks
        self.clean_steps = 0  # steps in a row kvd refused nothing
        self.pool = pool
        self.tenant = tenant
        self.stats = EngineStats()
        self.running: list[SimRequest] = []

    async def arrive(self, req: SimRequest) -> None:
        """Ask kvd to admit; queued requests wait on WaitAdmission and join when admitted."""
        req.arrived_at = time.monotonic()
        try:
            reply = await self.client.admit(req.request_id, req.prompt_tokens,
                                            req.output_tokens, pool=self.pool,
                                            tenant=self.tenant)
        except KvdClientError as exc:
            req.rejected = str(exc)
            return
        if reply.decision == pb.DECISION_REJECTED:
            req.rejected = reply.reason
            return
        if reply.decision == pb.DECISION_QUEUED:
            req.queued = True
            async for update in self.client.wait_admission(req.request_id):
                if update.decision == pb.DECISION_ADMITTED:
                    break
                if update.decision == pb.DECISION_REJECTED:  # a quota changed meanwhile
                    req.rejected = update.reason
                    return
        req.admitted_at = time.monotonic()
        if req.keys:
            await self._share_prompt(req)
        self.running.append(req)

    async def _share_prompt(self, req: SimRequest) -> None:
        """The prompt's blocks through kvd's shared blocks: the leading run kvd holds is
        loaded (a hit), the others stored and committed (this stand-in writes no bytes).
        Storing may wait for room like an allocation; its stall is the prefill's."""
        rid, ns, keys = req.request_id, self.namespace, list(req.keys)
        req.hit_blocks = (await self.client.lookup(ns, keys, pool=self.pool)).num_hit
        if req.hit_blocks:
            await self.client.load(rid, ns, keys[:req.hit_blocks])
        try:
            stored = await self.client.store(rid, ns, keys)
        except ResourceExhaustedError:
            req.keys = ()  # no room to keep them: the prompt's blocks are its own
            return
        except AbortedError:
            return  # this client's other calls ended the holds meanwhile: unsaved
        fresh = [k for k, f in zip(keys, stored.fresh) if f]
        if fresh:
            try:
                await self.client.commit(rid, ns, fresh)
            except FailedPreconditionError:
                pass  # this client's other calls ended the hold and they were dropped: unsaved
        req.prefill_stall_s += stored.stall_us / 1e6

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)

    def _build_step(self):
        step = pb.StepRequest()
        finished = []
        prefill = []
        decoded = []
        allocations = []  # (request, blocks) per allocation item, in order
        for req in self.running:
            shared = len(req.keys)
            prompt_blocks = self._blocks_for(req.prompt_tokens)
            if not req.prefilled:
                req.prefilled = True
                prefill.append(req)
            elif req.num_blocks + shared >= prompt_blocks:  # decoding: one token per step
                req.generated += 1
                decoded.append(req)
            need = (self._blocks_for(req.prompt_tokens + req.generated) - shared
                    - req.num_blocks)
            while need > 0:  # chunked prefill: a prompt bigger than a chunk goes in pieces
                n = min(need, self.alloc_chunk)
                step.allocations.append(pb.AllocateRequest(request_id=req.request_id,
                                                           num_blocks=n))
                allocations.append((req, n))
                req.num_blocks += n
                need -= n
            if req.num_blocks <= self.chunk_blocks:
                step.read_all.append(req.request_id)
            else:
                for start in range(0, req.num_blocks, self.chunk_blocks):
                    stop = min(start + self.chunk_blocks, req.num_blocks)
                    step.accesses.append(pb.AccessRequest(request_id=req.request_id,
                                                          block_indices=range(start, stop)))
            if req.generated >= req.output_tokens:
                finished.append(req)
        return step, finished, prefill, decoded, allocations

    def _absorb_errors(self, step: pb.StepRequest, reply: pb.StepResponse, allocations,
                       finished: list[SimRequest], decoded: list[SimRequest]) -> set[str]:
        """A chunk kvd could not make room for (its tenant's fair share holds less than the
        chunk) is retried next step in smaller chunks, as an engine sizes its prefill and
        attention chunks to the memory it gets; that request makes no progress this step.
        The chunks halve once a step, however many were refused in it (see resize_chunks).
        Anything else is a bug in the run. Returns the requests that stalled."""
        short: set[str] = set()
        alloc_short = read_short = False
        for err in reply.errors:
            if err.code != 8:  # RESOURCE_EXHAUSTED
                continue
            if err.section == "allocations":
                req, n = allocations[err.item_index]
                req.num_blocks -= n
                short.add(req.request_id)
                alloc_short = True
            elif err.section in ("accesses", "read_all"):
                short.add(step.accesses[err.item_index].request_id
                          if err.section == "accesses" else step.read_all[err.item_index])
                read_short = True
        self.resize_chunks(alloc_short, read_short)
        for err in reply.errors:
            rid = (step.accesses[err.item_index].request_id if err.section == "accesses"
                   else step.read_all[err.item_index] if err.section == "read_all"
                   else allocations[err.item_index][0].request_id
                   if err.section == "allocations" else "")
            if rid not in short:
                raise RuntimeError(f"kvd refused part of a step: {err}")
        for req in decoded:
            if req.request_id in short:
                req.generated -= 1
        for req in finished[:]:
            if req.request_id in short:
                finished.remove(req)
        return short

    def resize_chunks(self, alloc_short: bool, read_short: bool) -> None:
        """After a step: a kind of chunk kvd refused halves; after GROW_AFTER steps in a row
        with nothing refused both double, up to where they started. Without growing back,
        one burst of refusals (each halving) left every later step reading one block a
        message, long after the memory had come back."""
        if alloc_short:
            self.alloc_chunk = max(1, self.alloc_chunk // 2)
        if read_short:
            self.chunk_blocks = max(1, self.chunk_blocks // 2)
        if alloc_short or read_short:
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= GROW_AFTER:
            self.clean_steps = 0
            self.alloc_chunk = min(self.max_chunk, self.alloc_chunk * 2)
            self.chunk_blocks = min(self.max_chunk, self.chunk_blocks * 2)

    async def _send(self, stream, step: pb.StepRequest) -> pb.StepResponse:
        """One engine step: the message (several, past MAX_ITEMS items), then each chunk of
        a big request's blocks as a message of its own. What a message hands out is held
        until the next, so a request streamed through a device share smaller than itself
        gives back each chunk before reading the next (read in one message, its chunks would
        all be held at once). Returns the replies merged: stalls added up, errors indexed as
        in `step`."""
        chunks = list(step.accesses)
        items = sum(len(getattr(step, section)) for section in _SECTIONS)
        if len(chunks) <= 1 and items + len(chunks) <= MAX_ITEMS:
            return await stream.send(step)  # the common step: no copy, no split
        main = pb.StepRequest()
        main.CopyFrom(step)
        del main.accesses[:]
        parts = _split(main) if items > MAX_ITEMS else [(main, None)]
        # More items than a message may hold (kvd's max_items_per_call): the step's sections
        # go in order over several messages. (This engine writes no bytes; a real engine
        # keeps a step to one message, as what a message hands out is held until the next.)
        reply = pb.StepResponse(step_id=step.step_id)
        for part, where in parts:
            got = await stream.send(part)
            reply.stall_us += got.stall_us
            reply.allocated.extend(got.allocated)
            reply.relocated.extend(got.relocated)
            reply.errors.extend(e if where is None else pb.StepError(
                section=e.section, item_index=where[e.section][e.item_index], code=e.code,
                message=e.message) for e in got.errors)
        for i, chunk in enumerate(chunks):
            part = await stream.send(pb.StepRequest(accesses=[chunk]))
            reply.stall_us += part.stall_us
            reply.relocated.extend(part.relocated)
            reply.errors.extend(pb.StepError(section="accesses", item_index=i, code=e.code,
                                             message=e.message) for e in part.errors)
        return reply

    async def run(self, *, steps: int | None = None, until: float | None = None,
                  stop: asyncio.Event | None = None) -> EngineStats:
        """Step until `steps` steps, the monotonic time `until`, or `stop` is set."""
        self.stats.started = time.monotonic()
        async with self.client.step_stream() as stream:
            n = 0
            next_at = time.monotonic()
            while (steps is None or n < steps) and (until is None or time.monotonic() < until):
                if stop is not None and stop.is_set() and not self.running:
                    break
                now = time.monotonic()
                if now < next_at:
                    await asyncio.sleep(next_at - now)
                next_at += self.step_s
                if not self.running:
                    continue
                step, finished, prefill, decoded, allocations = self._build_step()
                t0 = time.monotonic()
                reply = await self._send(stream, step)
                t1 = time.monotonic()
                for req in self.running:
                    if req.first_token_at is None and req.prefilled:
                        req.first_token_at = t1
                if reply.errors:
                    short = self._absorb_errors(step, reply, allocations, finished, decoded)
                else:
                    short = set()
                    self.resize_chunks(False, False)
                self.stats.tokens += sum(1 for r in decoded if r.request_id not in short)
                self.stats.steps.append(StepSample(t1, t1 - t0, reply.stall_us / 1e6,
                                                   len(self.running), len(reply.errors),
                                                   bool(prefill)))
                for req in prefill:
                    req.prefill_stall_s += reply.stall_us / 1e6

                if finished:
                    await stream.send(pb.StepRequest(
                        releases=[pb.ReleaseRequest(request_id=r.request_id)
                                  for r in finished]))
                    for r in finished:
                        r.finished_at = t1
                        self.running.remove(r)
                n += 1
        self.stats.ended = time.monotonic()
        return self.stats


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]
