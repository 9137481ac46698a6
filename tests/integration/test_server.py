"""The daemon as a process: drain on SIGTERM, health, reflection, second SIGINT."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvd_client import AsyncClient, Client
from kvd_loadgen.local import LocalKvd

from .conftest import SMALL


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


async def test_in_flight_step_stream_finishes_during_drain(tmp_path):
    kvd = LocalKvd(*SMALL, "--grace-s", "5", workdir=tmp_path).start()
    try:
        async with AsyncClient(kvd.target) as client:
            await client.admit("r", 64)
            async with client.step_stream() as stream:
                await stream.step(allocations=[("r", 4)])
                kvd.proc.send_signal(signal.SIGTERM)
                # The open stream keeps working within the grace period.
                reply = await stream.step(accesses=[("r", None)])
                assert not reply.errors
        assert await asyncio.to_thread(kvd.proc.wait, 20) == 0
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
    second = subprocess.run(
        [sys.executable, "-m", "kvd", "--socket", str(kvd.socket), *SMALL],
        capture_output=True, text=True, timeout=30,
    )
    assert second.returncode != 0
    assert "another kvd is already listening" in second.stderr
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
