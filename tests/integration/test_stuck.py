"""Nothing gets stuck: racing handoffs, cancels mid-copy and releases while blocks are in
transit leave a daemon that answers every call, passes SelfCheck and exits on SIGTERM in
time. (Two Handoff calls for one request used to both start; when the first was cancelled
the second claimed a reservation that was gone, left the request's blocks marked moving
with no owner, and Release, Access, SelfCheck, the lease reaper and shutdown spun on them.)"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from kvd_client import AsyncClient, KvdClientError
from kvd_loadgen.local import LocalKvd

CONFIG = """
[server]
grace_s = 2
lease_ttl_s = 30

[[pool]]
name = "prefill"
model = "tiny"
device_pages = 16
host_pages = 32

[[pool]]
name = "decode"
model = "tiny"
device_pages = 16
host_pages = 16

[[tenant]]
name = "slow"
request_bandwidth_cap = "64KiB/s"

[[link]]
source = "prefill"
target = "decode"
chunk = "16KiB"
"""


IN_PROCESS = CONFIG.replace("grace_s = 2", 'grace_s = 2\nsocket = ""\ntcp = "127.0.0.1:0"')


async def answers(coro, within_s: float = 10.0):
    """The call's reply (or its error: a clean refusal is an answer too) within a bound."""
    try:
        return await asyncio.wait_for(coro, within_s)
    except KvdClientError as exc:
        return exc


async def test_racing_handoffs_and_a_cancel_leave_nothing_stuck(tmp_path):
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG)
    kvd = LocalKvd("--config", str(config), workdir=tmp_path).start()
    try:
        async with AsyncClient(kvd.target, timeout_s=30) as admin, \
                AsyncClient(kvd.target, timeout_s=30, token=None) as c:
            await c.admit("r", 12 * 16, 16, pool="prefill", handoff_pool="decode",
                          tenant="slow")
            await c.allocate("r", 12)
            await c.keep_alive()  # done writing
            # 10 of its pages leave over a link capped at 64 KiB/s for this request: ~2.5 s
            # of blocks in transit.
            # The request's budget is spent by a first eviction, so the next one waits on
            # the link with its blocks in transit.
            await admin.evict(2, pool="prefill")
            evicting = asyncio.ensure_future(admin.evict(8, pool="prefill"))
            await asyncio.sleep(0.2)
            first = c.handoff("r")
            got_first = asyncio.ensure_future(first.__anext__())
            await asyncio.sleep(0.2)  # the first is waiting for the blocks in transit
            second = asyncio.ensure_future(answers(_drain(c.handoff("r")), 30))
            progress = await asyncio.wait_for(got_first, 30)
            assert progress.blocks_total == 12
            await first.aclose()  # cancel the first handoff mid-copy
            outcome = await second
            # The second either did the whole handoff or was refused at once; never a
            # request left half-claimed.
            assert not isinstance(outcome, KvdClientError) or outcome.code.name in (
                "FAILED_PRECONDITION", "ABORTED"), outcome
            await answers(evicting)
            reply = await answers(c.release("r"))
            assert not isinstance(reply, KvdClientError) or "no request" in str(reply)
            check = await answers(admin.self_check())
            assert check.ok, list(check.problems)
            for pool in ("prefill", "decode"):
                stats = (await admin.pool_stats(pool)).pools[0]
                assert stats.num_requests == 0 and stats.reserved_pages == 0
    finally:
        started = time.monotonic()
        code = kvd.stop(signal.SIGTERM, timeout_s=10)
        took = time.monotonic() - started
    assert code == 0 and took < 2 + 3, (code, took, kvd.log()[-2000:])


async def _drain(stream):
    last = None
    async for last in stream:
        pass
    return last


async def test_second_handoff_of_a_request_cannot_wedge_it(tmp_path):
    """The same race in-process, step by step: the second Handoff comes while the first
    waits for the request's blocks in transit, then the first is cancelled."""
    from kvd.config import load_config
    from kvd.core.errors import KvdError
    from kvd.node import Node

    config = tmp_path / "kvd.toml"
    config.write_text(IN_PROCESS)
    daemon = Node(load_config(config))
    try:
        daemon.admit("r", tenant="slow", pool="prefill", prompt_tokens=12 * 16,
                     output_tokens=16, priority=0, handoff_pool="decode")
        await daemon.allocate("r", 12)
        # The request's budget is spent by a first eviction, so the next one waits on the
        # link with its blocks in transit.
        await daemon.evict("prefill", 2)
        evicting = asyncio.ensure_future(daemon.evict("prefill", 8))
        await asyncio.sleep(0.1)
        first = daemon.handoff("r")
        got_first = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0.1)  # the first waits for the blocks in transit
        second = daemon.handoff("r")
        got_second = asyncio.ensure_future(second.__anext__())
        await asyncio.sleep(0.1)
        await asyncio.wait_for(got_first, 30)
        await first.aclose()  # the caller cancels the first mid-copy
        try:
            outcome = await asyncio.wait_for(got_second, 30)
            await second.aclose()
        except KvdError as exc:
            outcome = exc
        assert not isinstance(outcome, KvdError) or type(outcome).__name__ in (
            "FailedPrecondition", "Aborted"), repr(outcome)
        await asyncio.wait_for(evicting, 10)
        await asyncio.wait_for(daemon.release("r"), 10)
        assert await asyncio.wait_for(daemon.self_check(), 10) == []
    finally:
        await asyncio.wait_for(daemon.aclose(), 10)


async def test_blocks_in_transit_that_nothing_owns_are_reported(tmp_path, monkeypatch):
    """If a bug ever leaves blocks in transit with no owner, SelfCheck, the metric's source
    and the log say so (and nothing waiting on them spins)."""
    from structlog.testing import capture_logs

    import kvd.transit
    from kvd.config import load_config
    from kvd.node import Node

    monkeypatch.setattr(kvd.transit, "ORPHANED_AFTER_S", 0.0)
    config = tmp_path / "kvd.toml"
    config.write_text(IN_PROCESS)
    daemon = Node(load_config(config))
    try:
        daemon.admit("r", tenant="slow", pool="prefill", prompt_tokens=32, output_tokens=0,
                     priority=0)
        blocks, _ = await daemon.allocate("r", 2)
        assert await daemon.self_check() == []
        # what the handoff race used to leave behind
        daemon.runtime("prefill").pool.pages.start_moving(blocks[0])
        with capture_logs() as logs:
            problems = await asyncio.wait_for(daemon.self_check(), 10)
        assert any("in transit with no owner" in p for p in problems), problems
        assert daemon.stuck["prefill"] and any(e["event"] == "transfer stuck" for e in logs)
        # A caller waiting on them sleeps between looks instead of spinning.
        rt = daemon.runtime("prefill")
        waiter = asyncio.ensure_future(rt.transit.wait_for([blocks[0]]))
        await asyncio.sleep(0.2)
        assert waiter.done()
        blocks[0].moving = False
        blocks[0].request.num_moving_blocks -= 1
    finally:
        await asyncio.wait_for(daemon.aclose(), 10)


async def test_the_stuck_check_looks_only_at_requests_with_blocks_in_transit(tmp_path):
    """kvd looks for stuck transfers four times a second: walking every request took 5 ms
    a look at 100,000 requests here. It looks at those with blocks in transit."""
    from kvd.config import load_config
    from kvd.node import Node

    class Unwalked(dict):
        def __iter__(self):
            raise AssertionError("walked every request")

        values = items = keys = __iter__

    config = tmp_path / "kvd.toml"
    config.write_text(IN_PROCESS)
    daemon = Node(load_config(config))
    try:
        for i in range(8):
            daemon.admit(f"r{i}", tenant="slow", pool="prefill", prompt_tokens=16,
                         output_tokens=0, priority=0)
            await daemon.allocate(f"r{i}", 1)
        pool = daemon.runtime("prefill").pool
        walked = pool.requests
        pool.requests = pool.pages.requests = Unwalked(walked)
        try:
            assert daemon.check_stuck() == []
        finally:
            pool.requests = pool.pages.requests = walked
    finally:
        await asyncio.wait_for(daemon.aclose(), 10)


class _CancelledWhileWriting:
    """A ServicerContext whose first write is where the client's cancel lands (grpc raises
    CancelledError in the handler's task at whatever it awaits)."""

    def invocation_metadata(self):
        return ()

    def peer(self):
        return "unix:/test"

    async def write(self, message):
        raise asyncio.CancelledError()

    _write = write

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


async def _serve_stream(handler, request, context):
    """What grpc.aio's server does with a unary-stream handler (grpc's
    _finish_handler_with_stream_responses in src/python/grpcio/grpc/_cython/_cygrpc/aio/
    server.pyx.pxi): an async generator is drained into writes, and nothing closes it when
    a write is cancelled; a coroutine writes for itself."""
    import inspect

    if inspect.isasyncgenfunction(handler):
        # Nothing closes it when the write is cancelled: only the garbage collector would,
        # once nothing refers to it (in kvd a reference cycle through the exception kept it
        # for seconds). The context keeps it, as that cycle did.
        context.generator = handler(request, context)
        async for message in context.generator:
            await context._write(message)
    else:
        await handler(request, context)


async def test_a_handoff_whose_call_is_cancelled_while_writing_rolls_back(tmp_path):
    """The cancel came while kvd wrote a progress message: the handoff went on without an
    owner and moved the request the caller had given up on."""
    from kvd.config import load_config
    from kvd.node import Node
    from kvd.service.auth import Authenticator
    from kvd.service.memory import MemoryService
    from kvd_api.v1 import kvd_pb2 as pb

    config = tmp_path / "kvd.toml"
    config.write_text(IN_PROCESS)
    daemon = Node(load_config(config))
    service = MemoryService(daemon, Authenticator(daemon.config, daemon.leases))
    try:
        daemon.admit("r", tenant="slow", pool="prefill", prompt_tokens=64, output_tokens=0,
                     priority=0, handoff_pool="decode")
        await daemon.allocate("r", 4)
        context = _CancelledWhileWriting()
        with pytest.raises(asyncio.CancelledError):
            await _serve_stream(service.Handoff, pb.HandoffRequest(request_id="r"), context)
        for _ in range(100):  # 4 blocks at 64 KiB/s: 1 s had it gone on
            await asyncio.sleep(0.05)
            if not daemon.handoffs.under_way("r"):
                break
        await asyncio.sleep(1.2)
        assert daemon.runtime_of("r").pool.name == "prefill"
        assert "r" not in daemon.runtime("decode").pool.requests
        assert await asyncio.wait_for(daemon.self_check(), 10) == []
    finally:
        await asyncio.wait_for(daemon.aclose(), 10)


async def test_a_request_in_a_pool_that_the_node_does_not_index_is_reported(tmp_path):
    """A request left in a pool with no entry in the node's index (a handoff that failed
    half-way through its commit left one in decode) is no one's: no call reaches it and
    its id is taken there for good. SelfCheck names it, and an index entry with no
    request behind it."""
    from kvd.config import load_config
    from kvd.node import Node

    config = tmp_path / "kvd.toml"
    config.write_text(IN_PROCESS)
    daemon = Node(load_config(config))
    try:
        for rid in ("r", "s"):
            daemon.admit(rid, tenant="slow", pool="prefill", prompt_tokens=2 * 16,
                         output_tokens=16, priority=0, handoff_pool="decode")
            await daemon.allocate(rid, 2)
        assert await daemon.self_check() == []
        daemon.request_index["s"] = daemon.runtime("decode")  # s is prefill's
        del daemon.request_index["r"]
        assert sorted(await daemon.self_check()) == [
            "decode: request 's' is indexed to the pool, not admitted or queued there",
            "prefill: request 'r' is in the pool, not indexed",
            "prefill: request 's' is in the pool, indexed to 'decode'"]
    finally:
        await asyncio.wait_for(daemon.aclose(), 10)
