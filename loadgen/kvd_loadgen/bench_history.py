"""Whether a step's cost grows with its requests' history: one engine on a real kvd, its Step
stream stepping as the engines bench's do (64 requests of 4 blocks read every step, one
request grown by a block and the block it grew by a round before freed, an intent update
every fourth step), for many steps. A decode loop that gives back blocks leaves their indices
unused for ever; what a step costs must follow what the requests hold, not what they held.

kvd's main-thread CPU time a step (from /proc: the thread that runs every handler) over an
early window of the run against the last window, under `lru` (which touches every block read
each step) and `fair` (which records a stream's reads together, every 50 ms). Target: late /
early <= 1.5. Walking every index a request ever had made it 3.2 under `lru` over 40,000
steps; what is left grows about 10-20% as the blocks made over the run spread through memory.
"""

from __future__ import annotations

import asyncio
import contextlib

from kvd_api.v1 import kvd_pb2 as pb
from kvd_client import AsyncClient
from kvd_loadgen.bench_engines import BLOCKS, Engine
from kvd_loadgen.local import LocalKvd
from kvd_loadgen.measures import cpu_s

TARGET = 1.5
POLICIES = ("lru", "fair")


async def _history(policy: str, steps: int, window: int) -> dict:
    args = ("--page-bytes", "4096", "--device-pages", "65536", "--host-pages", "65536",
            "--policy", policy)
    with LocalKvd(*args) as kvd:
        async with AsyncClient(kvd.target, timeout_s=30) as client:
            engine = Engine("h")
            for rid in engine.rids:
                await client.admit(rid, 2 * BLOCKS * 16)
                await client.allocate(rid, BLOCKS)
            call = client.channel.stream_stream(
                "/kvd.v1.Memory/Step", request_serializer=None,
                response_deserializer=pb.StepResponse.FromString)(metadata=client.metadata)
            pid = kvd.proc.pid
            marks = {window: None, 2 * window: None, steps - window: None, steps: None}
            try:
                for n in range(1, steps + 1):
                    await call.write(engine.message())
                    reply = await call.read()
                    if reply.errors:
                        raise RuntimeError(f"a step failed: {reply.errors[0]}")
                    engine.seen(reply)
                    if n in marks:
                        marks[n] = cpu_s(pid, main_thread=True)
            finally:
                with contextlib.suppress(Exception):
                    await call.done_writing()
            check = await client.self_check()
            assert check.ok, check.problems
    if None in marks.values():
        return {"steps": steps, "early_us": None, "late_us": None}
    # The first window warms up; the second is the early one.
    early = (marks[2 * window] - marks[window]) / window * 1e6
    late = (marks[steps] - marks[steps - window]) / window * 1e6
    return {"steps": steps, "early_us": early, "late_us": late}


async def bench_step_history(steps: int = 40_000, window: int = 4_000,
                             policies=POLICIES) -> dict:
    return {policy: await _history(policy, steps, window) for policy in policies}


def targets(result: dict) -> dict[str, dict]:
    out = {}
    for policy, r in result.items():
        if r["early_us"] is None:
            continue
        ratio = r["late_us"] / r["early_us"]
        out[f"step_cost_late_vs_early_{policy}"] = {"op": "<=", "value": TARGET,
                                                    "measured": ratio,
                                                    "met": ratio <= TARGET}
    return out


if __name__ == "__main__":
    print(asyncio.run(bench_step_history()))
