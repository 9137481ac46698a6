"""The sync client cannot drift from the async one: it has every public call the async
client has, and a blocking version of each works against a real kvd."""

from __future__ import annotations

import inspect
import signal
import time

import pytest

from kvd_client import AsyncClient, Client, pb
from kvd_client.client import intent_update
from kvd_loadgen.local import LocalKvd

from .conftest import SMALL, free_port, scrape

# The async client's only hot path with no blocking twin: engines step from async code.
ASYNC_ONLY = {"step_stream"}


def test_the_sync_client_has_every_call_of_the_async_one():
    def calls(cls):
        return {name for name, _ in inspect.getmembers(cls, inspect.isfunction)
                if not name.startswith("_")}

    assert calls(AsyncClient) - ASYNC_ONLY <= calls(Client), (
        calls(AsyncClient) - ASYNC_ONLY - calls(Client))
    # Derived, not copied: each blocking call takes what the async one takes and returns
    # what it returns (a copied twin lacked keep_alive, wait_admission and return types).
    for name in calls(AsyncClient) - ASYNC_ONLY:
        sync, aio = inspect.signature(getattr(Client, name)), inspect.signature(
            getattr(AsyncClient, name))
        assert sync == aio, (name, sync, aio)


def test_blocking_calls_work(kvd):
    with Client(kvd.target, timeout_s=10) as c:
        c.wait_ready(5)
        assert c.keep_alive().lease_ttl_s > 0
        assert c.admit("r", 32).decision == pb.DECISION_ADMITTED
        assert len(c.allocate("r", 2).handles) == 2
        c.update_intents([intent_update("r", 0, priority=1)])
        assert [u.decision for u in c.wait_admission("r")] == [pb.DECISION_ADMITTED]
        assert c.explain("r").tenant
        c.release("r")
        assert c.self_check().ok
        assert "lru" in c.list_policies()


async def test_wait_ready_keeps_its_timeout(tmp_path):
    import asyncio

    async with AsyncClient(f"unix://{tmp_path}/nobody.sock") as c:
        with pytest.raises(asyncio.TimeoutError):
            await c.wait_ready(0.3)


def test_a_followed_stream_calls_back_on_each_item_until_cancelled(kvd):
    import threading
    import time

    from kvd_client import InvalidArgumentError

    seen: list[tuple[str, str]] = []
    heard = threading.Event()

    def on_event(event: pb.Event) -> None:
        seen.append((event.request_id, event.detail["decision"]))
        heard.set()

    with Client(kvd.target, timeout_s=10) as c:
        subscribed = threading.Event()
        watch = c.follow("watch_events", on_event, kinds=["admission"],
                         on_subscribed=subscribed.set)
        assert subscribed.wait(10)
        c.admit("r", 32)
        assert heard.wait(5)
        assert seen == [("r", "admitted")] and not watch.done()
        watch.cancel()
        time.sleep(0.2)
        c.admit("s", 32)
        time.sleep(0.3)
        assert seen == [("r", "admitted")]  # no longer read
        bad = c.follow("watch_events", on_event, kinds=["no-such-kind"])
        with pytest.raises(InvalidArgumentError):  # the stream's error, as kvd_client's
            bad.result(timeout=5)


def test_a_callback_that_waits_on_a_call_is_told_not_left_hanging(kvd):
    # A follow() callback runs on the thread that runs the client's calls: a blocking call
    # from it on its own client waited for ever on the thread it held, and the stream with
    # it. The process's clients share that thread, so that holds for any client's call,
    # and for a close (which waits for the client's calls to end).
    import itertools
    import time

    ids = (f"r{i}" for i in itertools.count())

    def admit_until(heard) -> None:
        """Admit (and release) requests until the watch has heard one: it is subscribed
        some time after follow() returns."""
        deadline = time.monotonic() + 10
        while not heard() and time.monotonic() < deadline:
            request = next(ids)
            c.admit(request, 32)
            c.release(request)
            time.sleep(0.05)

    with Client(kvd.target, timeout_s=10) as c, Client(kvd.target, timeout_s=10) as other:
        for waits in (c.keep_alive, other.keep_alive, other.close):
            watch = c.follow("watch_events", lambda _, waits=waits: waits(),
                             kinds=["admission"])
            admit_until(watch.done)
            with pytest.raises(RuntimeError, match="would wait on itself"):
                watch.result(timeout=5)
        assert not other.closed
        started = []
        watch = c.follow("watch_events", lambda _: started.append(other.start("keep_alive")),
                         kinds=["admission"])
        admit_until(lambda: started)
        assert started[0].result(timeout=5).lease_ttl_s > 0
        watch.cancel()


# Closing clients, run in a Python process of its own: grpc.aio binds to its completion
# queue every loop that ever made a call in a process and hands completions out from any of
# them, so in this process, where async tests leave their closed loops behind, a loop the
# test watches may report another test's late completions.
CLOSING = """
import concurrent.futures, gc, sys, time
from kvd_client import Client, RetryPolicy

target, not_yet, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
problems = []
with Client(target, timeout_s=30) as alive:
    alive._loop.set_exception_handler(
        lambda _, context: problems.append((context["message"], repr(context.get("exception")))))
    for _ in range(rounds):
        following = Client(target, timeout_s=30)
        watch = following.follow("watch_events", lambda _: None, kinds=["admission"])
        waiting = Client(not_yet, timeout_s=30, retry=RetryPolicy())
        call = waiting.start("keep_alive")
        time.sleep(0.05)
        assert not watch.done() and not call.done()  # both waiting
        for closing in (waiting, following):
            closing.close()
            assert not closing._loop.is_closed(), "a closed loop is left bound to grpc"
        gc.collect()
        for future in (watch, call):
            try:
                future.result(timeout=5)
            except concurrent.futures.CancelledError:  # ended by the close, not left pending
                pass
            else:
                raise AssertionError("a call outlived its client's close")
        assert alive.keep_alive().lease_ttl_s > 0
    try:
        following.keep_alive()
    except RuntimeError as exc:
        assert "closed" in str(exc), exc
    else:
        raise AssertionError("a closed client made a call")
print(problems)
"""


def test_closing_clients_ends_their_calls_and_leaves_the_process_no_errors(kvd, tmp_path):
    # close() stopped the client's loop under a followed stream still reading and a started
    # call still waiting: their futures never ended (a thread waiting on one waited for
    # ever) and their tasks were destroyed pending ("Task was destroyed but it is pending!").
    # The call waits on a kvd not yet listening (a client that rides out restarts waits for
    # its channel to be ready).
    # Then each Client ran its own event loop and closed it on close(). A completion for a
    # closed client's call that came after its close (a cancelled call's last ones do) made
    # the loop reading it raise "Event loop is closed" in grpc's reader, logged as an error
    # in the process (SGLang's backend keeps a client a thread and closes each in turn).
    # It came by timing, in a few closes in a hundred (once in a CI run), so each of many
    # closes is checked to leave no closed loop for grpc to hand a completion to, and the
    # loop in use to have logged nothing.
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", CLOSING, kvd.target, f"unix://{tmp_path}/not-yet.sock", "60"],
        capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


def test_a_call_started_as_its_client_closes_is_refused_as_closed(kvd, monkeypatch):
    # A call that passed start()'s check while another thread closed the client, and was
    # queued on the loop after the close, ran on the closed channel: not one of the calls
    # the close ended, nor refused as closed. The interleaving is forced: the close runs
    # between the call's check and its queueing.
    import asyncio

    c = Client(kvd.target, timeout_s=10)
    queue = asyncio.run_coroutine_threadsafe
    closing = [True]

    def close_first(coro, loop):
        if closing:
            closing.clear()
            c.close()
        return queue(coro, loop)

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", close_first)
    call = c.start("keep_alive")
    with pytest.raises(RuntimeError, match="this kvd client is closed"):
        call.result(timeout=5)


# A client made, then the process forked (a server that forks its workers, a pool of
# processes started by fork), in a Python process of its own.
FORKED = """
import faulthandler, os, sys
from kvd_client import Client

c = Client(sys.argv[1], timeout_s=10)
assert c.health() == "SERVING"
pid = os.fork()
if pid == 0:
    faulthandler.dump_traceback_later(20, exit=True)  # a wait for ever fails, saying where
    try:
        c.health()
        print("answered in the child", flush=True)
    except RuntimeError as exc:
        print("refused:", exc, flush=True)
    c.close()
    print("closed:", c.closed, flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exit:", os.waitstatus_to_exitcode(status), flush=True)
print("the parent's:", c.health(), flush=True)
c.close()
"""


def test_a_client_made_before_a_fork_is_refused_in_the_child_not_a_hang(kvd):
    # Its calls ran on the shared loop's thread, which stayed in the parent: in the child
    # a call (and close()) waited for ever on a loop no thread runs. Refused at once, and
    # closing it in the child leaves the parent's connection alone.
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", FORKED, kvd.target],
                         capture_output=True, text=True, timeout=90)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stderr
    assert lines[0].startswith("refused: this kvd client was made in process "), run.stdout
    assert "which this process forked from" in lines[0]
    assert lines[1:] == ["closed: True", "child exit: 0", "the parent's: SERVING"], \
        (run.stdout, run.stderr[-2000:])


def test_an_interrupt_while_a_stream_waits_ends_the_stream(tmp_path):
    # Ctrl-C (or any exception the thread gets) while a blocking iterator waited for its
    # next item: the iterator closed the stream while the read still ran it, and raised
    # "aclose(): asynchronous generator is already running" in place of the interrupt,
    # leaving the stream open in kvd (counted against its tenant) until the client closed.
    port = free_port()
    with LocalKvd(*SMALL, "--metrics", f"127.0.0.1:{port}", workdir=tmp_path) as kvd, \
            Client(kvd.target) as client:
        def interrupt(signum, frame):
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            for _ in range(3):
                signal.setitimer(signal.ITIMER_REAL, 0.3)
                with pytest.raises(KeyboardInterrupt):
                    for _ in client.watch_events():  # no event comes: it waits
                        pass
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

        def open_streams() -> float:
            return sum(v for (name, _), v in scrape(port)[1].items()
                       if name == "kvd_streams_open")

        def settled(want: float) -> float:
            for _ in range(100):  # kvd sees a call begin or end a moment after the client
                if (now := open_streams()) == want:
                    break
                time.sleep(0.05)
            return now

        assert settled(0) == 0
        # The measure sees a watch, and the client goes on: a stream read after them.
        events = client.watch_events(
            kinds=["admission"], on_subscribed=lambda: client.start("admit", "after", 16))
        assert next(events).request_id == "after"
        assert settled(1) == 1
        events.close()
        assert settled(0) == 0


async def test_a_timeout_too_long_for_grpcs_clock_is_no_deadline(kvd, monkeypatch):
    """A timeout of 1e10 s or more (or inf: "as long as it takes") overflowed grpc's
    deadline, and every call failed at once with DEADLINE_EXCEEDED; one of 0 or nan failed
    every call too, far from where it was given."""
    import math

    for timeout_s in (1e10, 1e300, math.inf):
        async with AsyncClient(kvd.target, timeout_s=timeout_s) as c:
            assert (await c.admit(f"r{timeout_s}", 16)).decision == pb.DECISION_ADMITTED
            updates = [u async for u in c.wait_admission(f"r{timeout_s}", timeout_s=1e12)]
            assert updates[-1].decision == pb.DECISION_ADMITTED
    for timeout_s in (0, -1, math.nan):
        with pytest.raises(ValueError, match="timeout_s must be more than 0"):
            AsyncClient(kvd.target, timeout_s=timeout_s)
    # An empty $KVD_TARGET is no target: the default is used, not a channel to "".
    monkeypatch.setenv("KVD_TARGET", "")
    async with AsyncClient(timeout_s=1) as default:
        assert default.target == "unix:///run/kvd/kvd.sock"


async def test_a_step_cancelled_mid_way_leaves_the_next_step_its_own_reply(tmp_path):
    """A step cancelled after its message went (a timeout around it, its task cancelled)
    left its reply on the stream: the next step read it as its own, handles of another
    request's new block for the engine to write its KV into, or found the call cancelled
    under it (CANCELLED, every later step too). Cut at many points, on a stream of its own
    each time and on one stream throughout: every later step gets its own reply."""
    import asyncio

    went = 0  # cancelled steps whose message reached kvd (the cut this test is about)
    wrong, failed = [], []
    with LocalKvd("--model", "tiny", "--device-pages", "1024", "--host-pages", "1024",
                  workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target) as c:
            async def cut_then_step(stream, i: int) -> None:
                nonlocal went
                a, b = f"a{i}", f"b{i}"
                for rid in (a, b):
                    assert (await c.admit(rid, 64)).decision == pb.DECISION_ADMITTED
                cut = asyncio.ensure_future(stream.step(allocations=[(a, 1)]))
                for _ in range(i % 7):
                    await asyncio.sleep(0)
                if i % 3 == 0:
                    await asyncio.sleep(0.0002 * (i % 5))
                cut.cancel()
                try:
                    await cut
                except asyncio.CancelledError:
                    pass
                except Exception as exc:  # noqa: BLE001 - tallied, and the test fails on it
                    failed.append((i, "the cut step", repr(exc)))
                try:
                    reply = await stream.step(allocations=[(b, 1)])
                except Exception as exc:  # noqa: BLE001 - tallied, and the test fails on it
                    failed.append((i, repr(exc)))
                else:
                    got = [(h.request_id, h.block_index) for h in reply.allocated]
                    if got != [(b, 0)] or reply.errors:
                        wrong.append((i, got, list(reply.errors)))
                went += len((await c.access(a)).handles)
                for rid in (a, b):
                    await c.release(rid)

            for i in range(100):
                async with c.step_stream() as stream:
                    await cut_then_step(stream, i)
            async with c.step_stream() as stream:
                for i in range(100, 200):
                    await cut_then_step(stream, i)
            assert (await c.self_check()).ok
    assert not wrong and not failed, (len(wrong), wrong[:3], len(failed), failed[:3])
    assert went >= 20, went  # the cut happened often enough to have been hunted


async def test_a_step_on_a_stream_not_open_says_so(kvd):
    """Outside its `async with` a StepStream had no call, and a step failed with
    AttributeError ('NoneType' object has no attribute 'write')."""
    async with AsyncClient(kvd.target) as c:
        stream = c.step_stream()
        with pytest.raises(RuntimeError, match="this Step stream is not open"):
            await stream.step(read_all=["r"])
        async with stream:
            assert (await stream.step()).step_id == 1
        with pytest.raises(RuntimeError, match="this Step stream is not open"):
            await stream.pipeline([pb.StepRequest()], lambda request, reply: None)
