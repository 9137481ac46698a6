"""How long one call on a policy's queue holds kvd's event loop (every tenant's call waits
for it): a policy holding N resident blocks, 64 to a request, goes through what an engine's
steps do to it, for a few seconds: requests read whole (LRU and regret record one entry a
request), blocks read one by one, and blocks held and let go (out of the policy and back
in). Each of those leaves a stale entry behind in the policy's queues, and the stale
entries are compacted away once they outnumber the blocks; the longest single call is
reported (in the thread's CPU time: the machine's other processes taking the core away
is not the queue's doing), with Python's garbage collector off (kvd.gcwalk's business).

Compacting every entry in one call held the loop half a second at half a million blocks,
once per that many calls; the queues compact a bounded piece a call instead (see
kvd.core.policies.queue). Target: the longest call <= 5 ms at 131,072 blocks.
"""

from __future__ import annotations

import gc
import random
import time

from kvd.core.blocks import Block, Request, RequestState, TierKind
from kvd.core.clock import FakeClock
from kvd.core.policies import make_policy

TARGET_MS = 5.0
BLOCKS = 131_072
PER_REQUEST = 64
POLICIES = ("lru", "intent")  # a RunQueue; BlockQueues, one per intent class


def _longest_call(policy_name: str, blocks: int, seconds: float) -> dict:
    """The longest call and the calls made in `seconds` on one policy."""
    policy = make_policy(policy_name, FakeClock())
    reqs = [Request(f"r{i}", "t", "default", 0, PER_REQUEST, RequestState.ADMITTED)
            for i in range(blocks // PER_REQUEST)]
    every = []
    for req in reqs:
        req.live = [Block(req, i, TierKind.DEVICE, i) for i in range(PER_REQUEST)]
        every += req.live
    for b in every:
        policy.insert(b)
    rng = random.Random(1)
    clock = time.thread_time
    calls, longest = 0, 0.0
    enabled = gc.isenabled()
    gc.disable()
    try:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            kind = calls % 3
            started = clock()
            if kind == 0:  # a step reads four requests whole
                policy.touch_requests([reqs[rng.randrange(len(reqs))] for _ in range(4)])
            elif kind == 1:  # a block read on its own
                policy.touch(every[rng.randrange(len(every))])
            else:  # four blocks held while an engine reads them, then let go
                held = [every[i] for i in rng.sample(range(len(every)), 4)]
                for block in held:
                    policy.remove(block)
                for block in held:
                    policy.insert(block)
            longest = max(longest, clock() - started)
            calls += 1
    finally:
        if enabled:
            gc.enable()
    return {"blocks": blocks, "calls": calls, "longest_call_ms": longest * 1e3}


def bench_queues(policies=POLICIES, blocks: int = BLOCKS, seconds: float = 6.0) -> dict:
    return {name: _longest_call(name, blocks, seconds) for name in policies}


def targets(result: dict) -> dict[str, dict]:
    return {f"queue_{name}_longest_call_ms": {
        "op": "<=", "value": TARGET_MS, "measured": row["longest_call_ms"],
        "met": row["longest_call_ms"] <= TARGET_MS} for name, row in result.items()}


def main() -> None:
    from kvd_loadgen.beside import print_targets

    result = bench_queues()
    for name, row in result.items():
        print(f"{name}: {row['calls']:,} calls on {row['blocks']:,} blocks, longest "
              f"{row['longest_call_ms']:.2f} ms")
    print_targets(targets(result))


if __name__ == "__main__":
    main()
