"""Leases: a client that disappears gets its requests released; nothing else changes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from kvd_client import AsyncClient, pb
from kvd_loadgen.local import LocalKvd

from .conftest import SMALL, free_port, scrape

HOLDER = textwrap.dedent("""
    import asyncio, sys
    from kvd_client import AsyncClient

    async def main():
        async with AsyncClient(sys.argv[1]) as kvd:
            for i in range(3):
                await kvd.admit(f"held-{i}", 16 * 8)
                await kvd.allocate(f"held-{i}", 8)
            async with kvd.step_stream() as stream:
                await stream.step(read_all=["held-0"])
                print("ready", flush=True)
                await asyncio.sleep(3600)

    asyncio.run(main())
""")


# Holds a Step stream open, and steps on it again at each line read from stdin.
PAUSED_HOLDER = textwrap.dedent("""
    import asyncio, sys
    from kvd_client import AsyncClient

    async def main():
        async with AsyncClient(sys.argv[1]) as kvd:
            await kvd.admit("held", 16 * 8)
            await kvd.allocate("held", 8)
            async with kvd.step_stream() as stream:
                await stream.step(read_all=["held"])
                print("ready", flush=True)
                for _ in sys.stdin:
                    try:
                        await stream.step(read_all=["held"])
                        print("stepped", flush=True)
                    except Exception as exc:
                        print(f"failed: {exc!r}", flush=True)

    asyncio.run(main())
""")


async def _used_pages(client) -> list[int]:
    return [t.used_pages for t in (await client.pool_stats()).pools[0].tiers]


async def _until_used(client, pages: int, tries: int) -> int:
    """Poll (every 50 ms, `tries` times at most) until `pages` pages are used; the last
    count seen."""
    for _ in range(tries):
        used = sum(await _used_pages(client))
        if used == pages:
            return used
        await asyncio.sleep(0.05)
    return sum(await _used_pages(client))


async def _keep_alive(client) -> None:
    """The client's lease kept, as long as the task runs."""
    while True:
        await client.keep_alive()
        await asyncio.sleep(0.1)


async def test_a_killed_client_gets_every_page_back(tmp_path):
    with LocalKvd(*SMALL, "--lease-ttl-s", "1", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target) as survivor:
            await survivor.admit("survivor", 32)
            await survivor.allocate("survivor", 2)
            # Its next call says it is done writing: its pages may be demoted from now on
            # (until then they are held for it, and the holder would wait for them). Kept
            # alive all along: the holder's start alone once took longer than a TTL.
            keeping = asyncio.ensure_future(_keep_alive(survivor))
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, kvd.target],
                                      stdout=subprocess.PIPE, text=True)
            try:
                ready = await asyncio.to_thread(holder.stdout.readline)
                assert ready.strip() == "ready"
                device, host = await _used_pages(survivor)
                assert device + host == 2 + 24  # 3 x 8 held, demoted where needed
                # The open stream holds the holder's lease well past its TTL.
                await asyncio.sleep(2.0)
                assert sum(await _used_pages(survivor)) == 26
                holder.send_signal(signal.SIGKILL)
                holder.wait()
                assert await _until_used(survivor, 2, tries=100) == 2
            finally:
                holder.kill()
                keeping.cancel()
            # Nothing else changed: the survivor's request is whole and readable.
            access = await survivor.access("survivor")
            assert len(access.handles) == 2
            stats = (await survivor.pool_stats()).pools[0]
            assert stats.num_requests == 1 and stats.reserved_pages == 2
            assert (await survivor.self_check()).ok
        assert '"lease expired: released its requests"' in kvd.log()
        assert '"num_requests": 3' in kvd.log()


# Admits a request, has its blocks demoted, starts reading them back (a promotion over the
# slow link kvd is given below) and waits, to be killed while the copies run.
PROMOTING_HOLDER = textwrap.dedent("""
    import asyncio, sys
    from kvd_client import AsyncClient

    async def main():
        async with AsyncClient(sys.argv[1]) as kvd:
            await kvd.admit("promoting", 16 * 48)
            await kvd.allocate("promoting", 48)
            await kvd.evict(48)
            reading = asyncio.ensure_future(kvd.access("promoting"))
            await asyncio.sleep(0.3)
            print("reading", flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main())
""")


async def test_a_client_killed_while_its_blocks_are_in_transit_gets_them_back(tmp_path):
    """The holder dies while its 48 blocks (3 MiB) come back over a link capped at 256 KiB/s:
    12 s of copies, which go on without it. Its lease lapses within about a second, and the
    request is released once the copies are done. The release used to be given up after
    5 s of waiting for them: the request then stayed admitted, holding 48 device pages, for
    as long as kvd ran."""
    config = tmp_path / "kvd.toml"
    config.write_text(textwrap.dedent("""
        [server]
        lease_ttl_s = 1
        [[pool]]
        name = "default"
        page_bytes = 65536
        device_pages = 64
        host_pages = 128
        link_bandwidth = "256KiB"
    """))
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        holder = subprocess.Popen([sys.executable, "-c", PROMOTING_HOLDER, kvd.target],
                                  stdout=subprocess.PIPE, text=True)
        try:
            reading = await asyncio.to_thread(holder.stdout.readline)
            assert reading.strip() == "reading"
        finally:
            holder.kill()
            holder.wait()
        async with AsyncClient(kvd.target, lease="") as observer:
            assert [r.request_id for r in await observer.list_requests()] == ["promoting"]
            for _ in range(400):  # 40 s: the copies end about 12 s from the read's start
                if not await observer.list_requests():
                    break
                await asyncio.sleep(0.1)
            assert await observer.list_requests() == []
            assert await _used_pages(observer) == [0, 0]
            assert (await observer.self_check()).ok
        assert '"lease release waits for the request\'s blocks in transit"' in kvd.log()


async def test_keep_alive_holds_a_unary_client_and_silence_expires_it(tmp_path):
    # Keep-alives at a quarter of the TTL: at half of it, one 0.2 s late (a busy machine)
    # would lapse the lease.
    with LocalKvd(*SMALL, "--lease-ttl-s", "0.8", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target, lease="unary-client") as client:
            assert (await client.admit("r", 16)).decision == pb.DECISION_ADMITTED
            for _ in range(12):  # 2.4 s of keep-alives, three TTLs
                reply = await client.keep_alive()
                assert reply.leased and reply.lease_ttl_s == 0.8
                await asyncio.sleep(0.2)
            assert (await client.explain("r")).active
        async with AsyncClient(kvd.target, lease="") as observer:  # holds no lease itself
            for _ in range(60):
                if not (await observer.explain("r")).active:
                    break
                await asyncio.sleep(0.05)
            assert not (await observer.explain("r")).active


async def test_a_stopped_client_with_an_open_stream_loses_its_pages(tmp_path):
    # SIGSTOP, not SIGKILL: the process and its socket stay, its stream stays open, but it
    # answers nothing. kvd's pings go unanswered, the connection closes, the lease lapses.
    with LocalKvd(*SMALL, "--lease-ttl-s", "0.5", workdir=tmp_path) as kvd:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, kvd.target],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "ready"
            async with AsyncClient(kvd.target, lease="") as observer:
                assert sum(await _used_pages(observer)) == 24
                holder.send_signal(signal.SIGSTOP)
                # pings every 1 s, 5 s to answer, then the TTL
                assert await _until_used(observer, 0, tries=300) == 0
        finally:
            holder.kill()
            holder.wait()


async def _paused_for(paused, seconds: float, holder) -> str:
    """Stop `paused` (a process) for `seconds`, then have the holder step on its stream once
    more: what it says."""
    paused.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        paused.send_signal(signal.SIGCONT)
    holder.stdin.write("step\n")
    holder.stdin.flush()
    return (await asyncio.to_thread(holder.stdout.readline)).strip()


@pytest.mark.parametrize("paused", ["client", "kvd"])
async def test_a_pause_shorter_than_the_lease_keeps_the_connection(tmp_path, paused):
    # kvd pings its clients to find the stopped ones. A ping had a third of the lease TTL to
    # be answered: a client (or kvd itself) descheduled for longer than that on a busy
    # machine, and still well within its lease, lost its connection: its open Step stream
    # broke and its lease renewals failed until it reconnected, so it lost its lease too.
    with LocalKvd(*SMALL, "--lease-ttl-s", "4", workdir=tmp_path) as kvd:
        holder = subprocess.Popen([sys.executable, "-c", PAUSED_HOLDER, kvd.target],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            ready = await asyncio.to_thread(holder.stdout.readline)
            assert ready.strip() == "ready"
            stopped = holder if paused == "client" else kvd.proc
            said = await _paused_for(stopped, 2.5, holder)
            assert said == "stepped"
            async with AsyncClient(kvd.target, lease="") as observer:
                assert sum(await _used_pages(observer)) == 8
                assert (await observer.explain("held")).active
        finally:
            holder.kill()
            holder.wait()


async def test_a_client_that_names_no_lease_is_held_by_its_connection(tmp_path):
    import grpc

    from kvd_api.v1 import kvd_pb2_grpc as pb_grpc

    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{port.getsockname()[1]}"
    port.close()
    config = tmp_path / "kvd.toml"
    config.write_text(f'[server]\ntcp = "{address}"\nlease_ttl_s = 0.5\n'
                      'allow_plaintext_tokens = true\n'
                      '[[pool]]\nmodel = "tiny"\ndevice_pages = 8\nhost_pages = 8\n'
                      '[[tenant]]\nname = "t"\ntoken = "t-token"\n')
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        # A raw gRPC client: a token, no lease metadata.
        async with grpc.aio.insecure_channel(address) as channel:
            memory = pb_grpc.MemoryStub(channel)
            metadata = (("authorization", "Bearer t-token"),)
            await memory.Admit(pb.AdmitRequest(request_id="r", prompt_tokens=32),
                               metadata=metadata)
            await memory.Allocate(pb.AllocateRequest(request_id="r", num_blocks=2),
                                  metadata=metadata)
        async with AsyncClient(kvd.target, lease="") as observer:  # the unix admin
            for _ in range(100):
                if not (await observer.explain("t/r")).active:
                    break
                await asyncio.sleep(0.05)
            assert not (await observer.explain("t/r")).active
            assert sum(await _used_pages(observer)) == 0


async def test_on_the_unix_socket_a_tenant_admits_only_under_a_lease(tmp_path):
    """gRPC names every unix-socket connection "unix:", so a connection's lease there was
    every lease-less client's: one that admitted and went away kept its pages for as long
    as another called (a request still held after 6 TTLs of another client's calls). A
    tenant's Admit without a lease is refused there, saying why; the same request under a
    lease is released when its client goes away, whatever the lease-less client calls."""
    import grpc

    from kvd_api.v1 import kvd_pb2_grpc as pb_grpc

    config = tmp_path / "kvd.toml"
    config.write_text('[server]\nlease_ttl_s = 0.5\n'
                      '[auth]\nunix_tenant = "t"\nunix_admin = false\n'
                      'admin_token = "admin-token-0123456789"\n'
                      '[[pool]]\nmodel = "tiny"\ndevice_pages = 8\nhost_pages = 8\n'
                      '[[tenant]]\nname = "t"\n')
    with LocalKvd("--config", str(config), workdir=tmp_path) as kvd:
        async with grpc.aio.insecure_channel(kvd.target) as channel:  # no lease metadata
            memory = pb_grpc.MemoryStub(channel)
            try:
                await memory.Admit(pb.AdmitRequest(request_id="r", prompt_tokens=32))
            except grpc.aio.AioRpcError as exc:
                refused = exc
            else:
                refused = None
            assert refused is not None, "admitted without a lease on the unix socket"
            assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "kvd-lease" in refused.details()
            async with AsyncClient(kvd.target) as holder:  # the client library's lease
                await holder.admit("r", 32)
                await holder.allocate("r", 2)
            async with AsyncClient(kvd.target, token="admin-token-0123456789",
                                   lease="") as admin:
                assert (await admin.explain("t/r")).active
                for _ in range(60):  # the lease-less client calls on meanwhile
                    await memory.KeepAlive(pb.KeepAliveRequest())
                    if not (await admin.explain("t/r")).active:
                        break
                    await asyncio.sleep(0.05)
                assert not (await admin.explain("t/r")).active
                assert sum(await _used_pages(admin)) == 0


async def test_a_client_naming_a_new_lease_on_every_call_leaves_none_behind(tmp_path):
    """Leases kvd keeps are those holding requests or streams: a client that names a fresh
    lease on each of its calls (its own mistake, or a tenant's attack on kvd's memory and
    loop) leaves nothing in the table."""
    port = free_port()
    with LocalKvd("--model", "tiny", "--metrics", f"127.0.0.1:{port}", workdir=tmp_path) as kvd:
        async with AsyncClient(kvd.target) as holder:
            await holder.admit("held", 16)  # one lease holds a request
            stub = holder.memory
            for i in range(500):
                await stub.KeepAlive(pb.KeepAliveRequest(),
                                     metadata=(("kvd-lease", f"fresh-{i}"),))
            _, samples = scrape(port)
    assert samples[("kvd_leases", ())] == 1


async def test_a_kvd_whose_log_reader_went_away_goes_on_reaping_and_stops(tmp_path):
    """kvd logs into a pipe whose reader went away (journald restarted, `kvd | tee` killed):
    every lapsed lease is still reaped (the line saying so is dropped, and counted), and
    SIGTERM still drains and exits 0."""
    port = free_port()
    sock = tmp_path / "kvd.sock"
    read, write = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd", "--socket", str(sock), "--metrics", f"127.0.0.1:{port}",
         "--lease-ttl-s", "1", *SMALL], stdout=write, stderr=write)
    os.close(write)
    try:
        for _ in range(600):
            if sock.exists():
                break
            await asyncio.sleep(0.05)
        target = f"unix://{sock}"
        async with AsyncClient(target) as watcher:
            assert await watcher.health() == "SERVING"
            os.close(read)  # the log's reader goes away
            for ghost in ("ghost-0", "ghost-1", "ghost-2"):
                async with AsyncClient(target, lease=ghost) as client:
                    await client.admit(ghost, 32)
                    await client.allocate(ghost, 2)
                # Its lease lapses after 1 s of silence; reaped within a second after that.
                assert await _until_used(watcher, 0, tries=80) == 0, ghost
        _, samples = scrape(port)
        assert samples[("kvd_log_lines_dropped_total", ())] >= 3  # one a lapsed lease
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0
