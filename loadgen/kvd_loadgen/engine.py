"""An engine stand-in: continuous batching against a live kvd over one Step stream.

Each engine step sends one Step message for every running request: allocations for prefills
and for sequences that cross a block boundary, reads of every block (attention), releases of
finished requests. Requests bigger than `chunk_blocks` are read in chunks within the step, as
an engine that streams a long context through a smaller device share does.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from kvd_client import AsyncClient, KvdClientError, pb


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
    generated: int = 0
    num_blocks: int = 0
    prefilled: bool = False

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


class Engine:
    """Runs requests through kvd at a steady step pace."""

    def __init__(self, client: AsyncClient, *, block_tokens: int, step_s: float,
                 chunk_blocks: int = 256, pool: str = "", tenant: str = "") -> None:
        self.client = client
        self.block_tokens = block_tokens
        self.step_s = step_s
        self.chunk_blocks = chunk_blocks
        self.pool = pool
        self.tenant = tenant
        self.stats = EngineStats()
        self.running: list[SimRequest] = []
        self._waiting: list[asyncio.Task] = []

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
            async for update in self.client.wait_admission(req.request_id):
                if update.decision == pb.DECISION_ADMITTED:
                    break
        req.admitted_at = time.monotonic()
        self.running.append(req)

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)

    def _build_step(self) -> tuple[pb.StepRequest, list[SimRequest], bool]:
        step = pb.StepRequest()
        finished = []
        prefill = False
        for req in self.running:
            if not req.prefilled:
                need = self._blocks_for(req.prompt_tokens)
                req.prefilled = prefill = True
            else:
                req.generated += 1
                need = self._blocks_for(req.prompt_tokens + req.generated) - req.num_blocks
            while need > 0:  # chunked prefill: a prompt bigger than a chunk goes in pieces
                n = min(need, self.chunk_blocks)
                step.allocations.append(pb.AllocateRequest(request_id=req.request_id,
                                                           num_blocks=n))
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
        return step, finished, prefill

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
                step, finished, prefill = self._build_step()
                t0 = time.monotonic()
                reply = await stream.send(step)
                t1 = time.monotonic()
                for req in self.running:
                    if req.first_token_at is None and req.prefilled:
                        req.first_token_at = t1
                self.stats.tokens += sum(1 for r in self.running if r.generated > 0)
                self.stats.steps.append(StepSample(t1, t1 - t0, reply.stall_us / 1e6,
                                                   len(self.running), len(reply.errors),
                                                   prefill))
                if reply.errors:
                    raise RuntimeError(f"kvd refused part of a step: {reply.errors[0]}")
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
