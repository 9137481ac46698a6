"""What one tenant's big calls cost another tenant's on the same kvd: tenant `a`'s client
goes round a life of single calls as fast as kvd answers, while tenant `b`'s client, in a
process of its own, reads a resident 4-block request (Access) every 2 ms (see beside). b's
Access latency beside a's calls, and in the seconds before they start (alone), under each
policy, for each of two lives (each a run of its own):

- `calls`: a 1M-token request's life (admit it, allocate its 65,536 blocks in one call,
  read them all, free every other one, allocate half back, release it).
- `prefix`: a 1M-token prompt's shared prefix blocks (one request stores its 65,536 keys
  in one call, commits them and is released; the next loads them all and is released).
  Each round's keys are new, so the committed blocks of the rounds before stay cached.
- `swap`: a 1M-token request swapped out and read back (allocated and written, all of its
  pages evicted to the host tier by the operator, then read whole in one call, which
  brings every block back in).

Target: b's p99 beside a's calls <= 50 ms under every policy, for each life.

kvd serves every call on one event loop. Each of a's calls costs it a few microseconds a
block, a third of a second in all for 65,536 of them; done whole, b's read waited for all
of it. kvd does such calls a slice of blocks at a time (`slice_blocks`), the loop served
between slices, and ends the holds of a's calls so too. What b still waits for past a
slice is mostly Python's garbage collection, which a's churn of blocks sets off a few
times a second: a full one walks every object kvd holds (20-50 ms with 130,000 blocks
alive on a 2-core machine, 200 ms with the prefix life's cached blocks piled up), which is
why kvd sets aside what a long one kept (kvd.gcwalk). The target is that bound, not a
slice's.
"""

from __future__ import annotations

import time

from kvd_client import AsyncClient, pb
from kvd_loadgen.beside import POLICIES, beside_reads, p99_targets, print_targets

TARGET_MS = 50.0
BLOCKS = 65_536
NS = "big-calls"


async def _life(a: AsyncClient, rid: str, blocks: int) -> int:
    """One round of a's request's life in single calls; the calls made."""
    await a.admit(rid, 16 * blocks)
    handles = (await a.allocate(rid, blocks)).handles
    if len(handles) != blocks:
        raise RuntimeError(f"allocated {len(handles)} of {blocks} blocks")
    if len((await a.access(rid)).handles) != blocks:
        raise RuntimeError("a read of the whole request came back short")
    await a.free(rid, list(range(0, blocks, 2)))
    await a.allocate(rid, blocks // 2)
    await a.release(rid)
    return 6


async def _shared_life(a: AsyncClient, rid: str, blocks: int) -> int:
    """One round of a long prompt's shared prefix blocks in single calls: one request stores
    its keys (new ones each round), commits them and goes; the next loads them all."""
    keys = [b"%s/%d" % (rid.encode(), i) for i in range(blocks)]
    storer, loader = f"{rid}-store", f"{rid}-load"
    await a.admit(storer, 16 * blocks)
    if len((await a.store(storer, NS, keys)).handles) != blocks:
        raise RuntimeError("a store came back short")
    await a.commit(storer, NS, keys)
    await a.release(storer)
    await a.admit(loader, 16 * blocks)
    # The leading run kvd holds: shorter where a block is on its way between tiers (the
    # room the next round's blocks take is made by demoting this round's, as they go).
    await a.load(loader, NS, keys)
    await a.release(loader)
    return 7


async def _swap_life(a: AsyncClient, rid: str, blocks: int) -> int:
    """One round of a 1M-token request swapped out and read back: allocated, written (a's
    next call ends its holds), all of its pages evicted to the host tier by the operator
    (a drain), then read whole, every block brought back in one call."""
    await a.admit(rid, 16 * blocks)
    await a.allocate(rid, blocks)
    await a.keep_alive()
    async with AsyncClient(a.target) as operator:  # kvd's socket, no token: the admin
        # Short where it evicted b's blocks, or found them held, or b's reads took them.
        out = sum(e.request_id.endswith(rid) and e.to_tier == pb.TIER_HOST
                  for e in (await operator.evict(blocks)).evicted)
    read = await a.access(rid)
    # The fair policy's refill of its free reserve may have demoted a few more since.
    if out < blocks // 2 or len(read.handles) != blocks or read.num_promoted < out:
        raise RuntimeError(f"a read of {blocks} blocks, {out} of them on the host tier, "
                           f"read {len(read.handles)}, brought in {read.num_promoted}")
    await a.release(rid)
    return 6


LIVES = {"calls": _life, "prefix": _shared_life, "swap": _swap_life}


async def _run(policy: str, blocks: int, seconds: float, life) -> dict:
    async with beside_reads(policy, blocks, seconds, "big-calls") as (a, run):
        calls = rounds = 0
        run.start()
        while time.time() < run.started + seconds:
            calls += await life(a, f"r{rounds}", blocks)
            rounds += 1
        run.end()
    return {"rounds": rounds, "a_call_ms": (run.ended - run.started) / calls * 1e3,
            **run.figures}


async def bench_big_calls(policies=POLICIES, blocks: int = BLOCKS,
                          seconds: float = 4.0) -> dict:
    """For each life (LIVES), each policy's run: a's rounds and its mean call time, b's
    reads beside them, and b's Access p50, p99 and worst (ms) beside a's calls, and
    alone."""
    return {name: {policy: await _run(policy, blocks, seconds, life) for policy in policies}
            for name, life in LIVES.items()}


def targets(result: dict) -> dict[str, dict]:
    return {**p99_targets("big_calls", result["calls"], TARGET_MS),
            **p99_targets("big_prefix_calls", result["prefix"], TARGET_MS),
            **p99_targets("big_swap_calls", result["swap"], TARGET_MS)}


def main() -> None:
    from kvd_client import eventloop

    result = eventloop.run(bench_big_calls())
    print(f"{'life':6} {'policy':10} {'a rounds':>8} {'a ms/call':>9} {'b reads':>7} "
          f"{'b p50 / p99 / max ms beside':>28} {'b p50 / p99 ms alone':>21}")
    for life, runs in result.items():
        for policy, r in runs.items():
            print(f"{life:6} {policy:10} {r['rounds']:8} {r['a_call_ms']:9.1f} {r['reads']:7} "
                  f"{r['p50_ms']:8.2f} / {r['p99_ms']:6.2f} / {r['max_ms']:<7.1f} "
                  f"{r['alone_p50_ms']:9.2f} / {r['alone_p99_ms']:.2f}")
    print_targets(targets(result))


if __name__ == "__main__":
    main()
