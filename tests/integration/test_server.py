"""The daemon as a process: drain on SIGTERM, health, reflection, second SIGINT."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvd_client import AsyncClient, Client, DrainingError
from kvd_loadgen.local import LocalKvd

from .conftest import SMALL, slow_link_kvd, start_slow_read


async def test_sigterm_drains_reports_not_serving_and_exits_zero(tmp_path):
    kvd = LocalKvd(*SMALL, "--grace-s", "5", workdir=tmp_path).start()
    try:
        async with grpc.aio.insecure_channel(kvd.target) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            first = await watch.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            kvd.proc.send_signal(signal.SIGTERM)
            second = await asyncio.wait_for(watch.read(), 10)
            assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await asyncio.to_thread(kvd.proc.wait, 20) == 0
        assert not kvd.socket.exists()
        assert '"kvd stopped"' in kvd.log()
    finally:
        kvd.stop()


async def test_every_health_watch_is_told_not_serving_before_its_stream_ends(tmp_path):
    """Ended by the drain before it wrote NOT_SERVING, a watch (a load balancer's) would only
    see its stream end; a watch of a service kvd does not serve is told too."""
    kvd = LocalKvd(*SMALL, "--grace-s", "30", workdir=tmp_path).start()
    try:
        async with grpc.aio.insecure_channel(kvd.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watches = [stub.Watch(health_pb2.HealthCheckRequest(service=name))
                       for name in ("", "kvd.v1.Memory", "no.such.Service")]
            first = [(await watch.read()).status for watch in watches]
            assert first == [health_pb2.HealthCheckResponse.SERVING] * 2 + [
                health_pb2.HealthCheckResponse.SERVICE_UNKNOWN]
            # Each read waiting (grpc's aio client raises the status at a read of a call
            # that has ended, a message it had not read yet or not).
            seconds = [asyncio.ensure_future(watch.read()) for watch in watches]
            await asyncio.sleep(0.1)
            kvd.proc.send_signal(signal.SIGTERM)
            for watch, second in zip(watches, seconds):
                assert (await asyncio.wait_for(second, 10)).status == \
                    health_pb2.HealthCheckResponse.NOT_SERVING
                assert await asyncio.wait_for(watch.code(), 10) == grpc.StatusCode.UNAVAILABLE
                assert await watch.details() == "kvd is draining"
        assert await asyncio.to_thread(kvd.proc.wait, 20) == 0
    finally:
        kvd.stop()


async def test_a_drain_ends_open_streams_at_once_saying_kvd_is_draining(tmp_path):
    """Engines keep a Step and an events stream open all the time: a stop must not wait
    its whole grace period for them. Each is told "kvd is draining" (UNAVAILABLE, which
    retry policies wait out) and kvd exits well inside the grace period."""
    kvd = LocalKvd(*SMALL, "--grace-s", "30", workdir=tmp_path).start()
    try:
        async with AsyncClient(kvd.target) as client:
            await client.admit("r", 64)
            async def watch():
                async for _ in client.watch_events():
                    pass

            events = asyncio.ensure_future(watch())
            async with client.step_stream() as stream:
                reply = await stream.step(allocations=[("r", 4)])
                assert not reply.errors
                await asyncio.sleep(0.2)  # the events stream is open on the server
                started = time.monotonic()
                kvd.proc.send_signal(signal.SIGTERM)
                with pytest.raises(DrainingError) as ended:  # once kvd took the signal
                    while time.monotonic() - started < 10:
                        await asyncio.wait_for(stream.step(accesses=[("r", None)]), 10)
                        await asyncio.sleep(0.02)
                assert ended.value.details == "kvd is draining"
                with pytest.raises(DrainingError):
                    await asyncio.wait_for(events, 10)
            code = await asyncio.to_thread(kvd.proc.wait, 20)
        assert code == 0
        assert time.monotonic() - started < 10  # not the 30 s grace period
        assert '"drained"' in kvd.log() and '"streams_ended": 2' in kvd.log()
    finally:
        kvd.stop()


async def test_a_step_sent_to_a_stream_idle_when_the_drain_began_is_told_kvd_is_draining(
        tmp_path):
    """An idle Step stream is told at its next message: ended under a client writing one,
    the client would see grpc's INTERNAL "Internal error from Core" (not retried) instead
    of UNAVAILABLE "kvd is draining" (retried once kvd is back)."""
    kvd = LocalKvd(*SMALL, "--grace-s", "30", workdir=tmp_path).start()
    try:
        async with AsyncClient(kvd.target) as client:
            await client.admit("r", 64)
            async with client.step_stream() as stream:
                await stream.step(allocations=[("r", 4)])
                kvd.proc.send_signal(signal.SIGTERM)
                time.sleep(0.5)  # the engine computes; its loop has not looked at kvd since
                with pytest.raises(DrainingError, match="kvd is draining"):
                    await asyncio.wait_for(stream.step(accesses=[("r", None)]), 10)
            assert await asyncio.to_thread(kvd.proc.wait, 20) == 0
    finally:
        kvd.stop()


async def test_a_step_being_served_when_the_drain_starts_gets_its_reply(tmp_path):
    """A Step message kvd is serving finishes and is answered; the stream ends after it.

    The connection stays up (no GOAWAY: the channel stays READY) until the stream has
    ended. grpc closes a connection the moment its last stream ends once it has sent its
    GOAWAY, and a client writing its next message in that moment lost the stream's status:
    it read UNAVAILABLE "Stream removed (sendmsg: Broken pipe)", not "kvd is draining"."""
    kvd = slow_link_kvd(tmp_path, "--grace-s", "30").start()
    try:
        async with AsyncClient(kvd.target) as client:
            async with client.step_stream() as stream:
                pending = await start_slow_read(client, stream)
                await asyncio.sleep(0.3)  # kvd is serving it, waiting on the link
                kvd.proc.send_signal(signal.SIGTERM)
                states = set()
                while not pending.done():
                    states.add(client.channel.get_state().name)
                    await asyncio.wait([pending], timeout=0.02)
                assert states == {"READY"}, states
                reply = await asyncio.wait_for(pending, 20)
                assert not reply.errors
                assert reply.stall_us > 500_000  # it did wait on the link, past the signal
                with pytest.raises(DrainingError):
                    await asyncio.wait_for(stream.step(accesses=[("r", [0])]), 10)
        assert await asyncio.to_thread(kvd.proc.wait, 20) == 0
    finally:
        kvd.stop()


def test_kvctl_says_kvd_is_draining_not_that_it_cannot_be_reached(tmp_path):
    kvd = LocalKvd(*SMALL, "--grace-s", "30", workdir=tmp_path).start()
    try:
        kvctl = [str(Path(sys.executable).with_name("kvctl")), "--target", kvd.target]
        events = subprocess.Popen([*kvctl, "events"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)

        # Stopped once kvctl says it watches (stopped before, kvd is gone instead).
        assert events.stderr.readline().startswith("kvctl: watching kvd's events")
        kvd.proc.send_signal(signal.SIGTERM)
        _, err = events.communicate(timeout=20)
        assert "is draining" in err, err
        assert "cannot reach" not in err, err
        assert kvd.proc.wait(20) == 0
    finally:
        kvd.stop()


async def test_a_generic_client_discovers_services_by_reflection(kvd):
    async with grpc.aio.insecure_channel(kvd.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]))
        names = set()
        async for reply in call:
            names |= {s.name for s in reply.list_services_response.service}
        assert {"kvd.v1.Memory", "kvd.v1.Admin", "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection"} <= names
        # grpc.reflection.v1, which current grpcurl and IDEs ask for first (same messages).
        v1 = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        described = set()
        async for reply in v1(iter([reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="kvd.v1.Memory")])):
            assert not reply.HasField("error_response"), reply.error_response
            described |= {len(f) for f in reply.file_descriptor_response.file_descriptor_proto}
        assert described and all(described)
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvd.v1.Memory"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_second_kvd_refuses_a_live_socket(kvd):
    """Started with the first's config, a second kvd says another kvd is on the socket: its
    metrics port is taken too and the first holds the shared memory its pools need (both
    as here), but neither is the cause to report."""
    page_bytes = 16 * 1024  # SMALL's
    too_many = shutil.disk_usage("/dev/shm").free // page_bytes + 1
    args = [*SMALL]
    args[args.index("--host-pages") + 1] = str(too_many)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        second = subprocess.run(
            [sys.executable, "-m", "kvd", "--socket", str(kvd.socket), *args,
             "--metrics", "127.0.0.1:%d" % taken.getsockname()[1]],
            capture_output=True, text=True, timeout=30,
        )
    assert second.returncode == 2
    assert f"another kvd is already listening on {kvd.socket}" in second.stderr
    with Client(kvd.target) as client:
        assert client.health() == "SERVING"


def test_the_socket_is_owner_and_group_only(tmp_path):
    import grp
    import os
    import stat

    group = grp.getgrgid(os.getgid()).gr_name
    config = tmp_path / "kvd.toml"
    config.write_text(f'[server]\nsocket_group = "{group}"\n\n[[pool]]\nmodel = "tiny"\n'
                      "device_pages = 8\nhost_pages = 8\n")
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        mode = kvd.socket.stat().st_mode
        assert stat.S_IMODE(mode) == 0o660
        assert kvd.socket.stat().st_gid == grp.getgrnam(group).gr_gid


async def test_health_watches_of_many_names_leave_nothing_behind(tmp_path):
    """kvd remembers the services watched (to tell each NOT_SERVING at a drain) only while
    they are watched: a client watching name after name must not grow it for ever."""
    from kvd.daemon import _Health
    from kvd.service.register import OpenStreams

    health = _Health(OpenStreams())
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"unix://{tmp_path}/h.sock")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{tmp_path}/h.sock") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watches = [stub.Watch(health_pb2.HealthCheckRequest(service=f"s{i}"))
                       for i in range(50)]
            for watch in watches:
                await watch.read()
            assert len(health._watched) == 50
            for watch in watches:
                watch.cancel()
            for _ in range(100):
                if not health._watched:
                    break
                await asyncio.sleep(0.05)
            assert not health._watched
    finally:
        await server.stop(0)


class _WatchContext:
    """A health Watch's context whose first write (SERVING) stays in flight until released:
    the moment a drain can begin in."""

    def __init__(self) -> None:
        self.written: list[int] = []
        self.writing = asyncio.Event()
        self.release = asyncio.Event()
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def write(self, message) -> None:
        self.writing.set()
        if not self.written:
            await self.release.wait()
        self.written.append(message.status)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise grpc.aio.AbortError()

    def done(self) -> bool:
        return self.status is not None


async def test_a_watch_writing_serving_when_the_drain_begins_is_told_not_serving():
    """The drain began while a watch's SERVING was still being written: the watch ended
    UNAVAILABLE there, its watcher never told NOT_SERVING."""
    from kvd.daemon import _Health
    from kvd.service.register import DRAINING, OpenStreams

    health = _Health(OpenStreams())
    context = _WatchContext()
    watch = asyncio.ensure_future(health.Watch(health_pb2.HealthCheckRequest(), context))
    await asyncio.wait_for(context.writing.wait(), 5)
    shutdown = asyncio.ensure_future(health.enter_graceful_shutdown())
    await asyncio.sleep(0.01)  # shutting down, waiting for the watch's lock
    context.release.set()
    with pytest.raises(grpc.aio.AbortError):
        await asyncio.wait_for(watch, 5)
    await asyncio.wait_for(shutdown, 5)
    assert context.written == [health_pb2.HealthCheckResponse.SERVING,
                               health_pb2.HealthCheckResponse.NOT_SERVING]
    assert context.status == (grpc.StatusCode.UNAVAILABLE, DRAINING)
