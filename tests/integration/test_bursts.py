"""A client's burst of thousands of calls at once: every call is answered, and another
client's calls meanwhile too. grpc holds calls that arrived until the server takes them up,
and past its default of 1,000 it cancelled new ones whichever client made them: one client's
burst cancelled other clients' calls (CANCELLED, no message)."""

from __future__ import annotations

import asyncio

from kvd_client import AsyncClient
from kvd_loadgen.local import LocalKvd

BURST = 4096


async def test_a_burst_of_calls_is_answered_whole_and_cancels_nobody_elses(tmp_path):
    with LocalKvd("--model", "tiny", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, timeout_s=120) as burst, \
                AsyncClient(kvd.target, timeout_s=120) as other:
            await burst.admit("a", 64)
            await burst.allocate("a", 4)
            await other.admit("b", 64)
            await other.allocate("b", 4)

            async def others_calls() -> list:
                out = []
                for _ in range(100):
                    try:
                        out.append(len((await other.access("b")).handles))
                    except Exception as exc:  # kept, and reported below
                        out.append(exc)
                return out

            theirs = asyncio.ensure_future(others_calls())
            mine = await asyncio.gather(*(burst.access("a") for _ in range(BURST)),
                                        return_exceptions=True)
            theirs = await theirs
    failed = [r for r in mine if isinstance(r, Exception)]
    assert not failed, f"{len(failed)} of the burst's calls failed: {failed[0]!r}"
    assert all(len(r.handles) == 4 for r in mine)
    assert theirs == [4] * 100, [r for r in theirs if r != 4][:3]
