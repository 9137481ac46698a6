"""EngineSession against a real kvd whose calls go unanswered at random: an engine admits,
allocates, frees and releases requests through the session, each call answered, not
delivered (UNAVAILABLE), done by kvd with its answer lost (DEADLINE_EXCEEDED), or cancelled
by the engine while it waited (before kvd got it, or after kvd did it), with kvd restarted
now and then and the session recovering. Once kvd answers again and the session
has recovered, kvd holds exactly what the session holds: each request it holds, with as
many live blocks as the engine has, and nothing the engine let go of.

KVD_SESSION_EXAMPLES sets the examples (`make soak` runs 500).
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from kvd_client import AsyncClient, EngineSession, KvdClientError, RetryPolicy
from kvd_loadgen.local import LocalKvd

from .conftest import answered_as

EXAMPLES = int(os.environ.get("KVD_SESSION_EXAMPLES", "25"))
REQUESTS = ("r0", "r1")
ARGS = ("--model", "tiny", "--block-tokens", "16", "--device-pages", "64", "--host-pages",
        "64", "--admission", "reservation")
# How a call goes: answered, not delivered, or done with its answer lost. Allocations are
# never done unanswered: blocks kvd handed out in an answer that was lost are the request's
# until it is released, and the session does not claim otherwise.
FAULTS = st.sampled_from(["none", "none", "none", "undelivered", "lost", "cut", "cut early"])
# Weighted toward what builds up blocks to free: most examples free some unanswered, and
# few end in a restart or a release that settles everything for the session.
KINDS = (["admit"] * 4 + ["allocate"] * 6 + ["free"] * 5 + ["release"] * 2 + ["recover"] * 2
         + ["restart"])
ALLOCATE_FAULTS = st.sampled_from(["none", "none", "undelivered"])


@st.composite
def _operation(draw):
    kind = draw(st.sampled_from(KINDS))
    if kind in ("recover", "restart"):
        return kind, "", "none"
    return (kind, draw(st.sampled_from(REQUESTS)),
            draw(ALLOCATE_FAULTS if kind == "allocate" else FAULTS))


OPERATION = _operation()

# Each way a call can go unanswered, once for sure (the generated examples combine them).
_GROWN = [("admit", "r0", "none"), ("allocate", "r0", "none"), ("allocate", "r0", "none")]
EXPLICIT = [
    _GROWN + [("free", "r0", "undelivered")],
    _GROWN + [("free", "r0", "lost"), ("recover", "", "none"), ("free", "r0", "none")],
    _GROWN + [("release", "r0", "undelivered")],
    _GROWN + [("release", "r0", "lost"), ("restart", "", "none")],
    _GROWN + [("restart", "", "none"), ("release", "r0", "none")],
    [("admit", "r1", "lost"), ("admit", "r1", "none"), ("allocate", "r1", "none")],
    [("admit", "r1", "undelivered"), ("recover", "", "none")],
    # Cancelled by the engine after kvd did it: kvd held the request, or the blocks, and
    # the session knew nothing of it.
    [("admit", "r1", "cut"), ("recover", "", "none")],
    _GROWN + [("free", "r0", "cut"), ("recover", "", "none")],
    _GROWN + [("release", "r0", "cut"), ("recover", "", "none")],
    [("admit", "r1", "cut early"), ("admit", "r1", "none"), ("allocate", "r1", "none")],
]


async def _held_by_kvd(client: AsyncClient) -> dict[str, int]:
    return {r.request_id: r.num_blocks for r in await client.list_requests()}


async def _example(kvd: LocalKvd, operations) -> None:
    async with AsyncClient(kvd.target, timeout_s=10,
                           retry=RetryPolicy(max_attempts=30, max_backoff_s=0.2)) as client:
        session = EngineSession(client)
        try:
            for op, rid, fault in operations:
                if op == "restart":
                    assert kvd.stop() == 0
                    kvd.start()
                    continue
                if op == "recover":
                    await session.recover()
                    continue
                held = session.held.get(rid)
                # The engine admits only requests it does not have, and allocates and frees
                # blocks only of requests it has (frees only blocks it has); it may release
                # any.
                if op == "admit" and held is not None:
                    continue
                if op in ("allocate", "free") and held is None:
                    continue
                if op == "free" and not held.blocks:
                    continue
                with (answered_as(client, op, fault),
                      contextlib.suppress(KvdClientError, asyncio.CancelledError)):
                    if op == "admit":
                        await session.admit(rid, 48, 16)
                    elif op == "allocate":
                        await session.allocate(rid, 1)
                    elif op == "free":
                        await session.free(rid, [held.blocks[0]])
                    else:
                        await session.release(rid)
            await session.recover()
            expected = {rid: len(h.blocks) for rid, h in session.held.items()}
            assert await _held_by_kvd(client) == expected
            for rid in list(session.held):
                await session.release(rid)
            assert await _held_by_kvd(client) == {}
            assert (await client.self_check()).ok
        finally:  # the next example starts on an empty kvd
            for rid in REQUESTS:
                with contextlib.suppress(KvdClientError):
                    await client.release(rid)


@pytest.mark.timeout(max(120, EXAMPLES * 3))
def test_kvd_holds_what_the_session_holds_whatever_calls_go_unanswered(tmp_path):
    loop = asyncio.new_event_loop()  # one loop for every example: grpc.aio keeps to it
    kvd = LocalKvd(*ARGS, workdir=tmp_path).start()

    # No shrinking: kvd lives on across examples, so a replay is not the same run.
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(operations=st.lists(OPERATION, min_size=10, max_size=24))
    def run(operations):
        loop.run_until_complete(_example(kvd, operations))

    for operations in EXPLICIT:
        run = example(operations=operations)(run)

    try:
        run()
    finally:
        kvd.stop()
        loop.close()
