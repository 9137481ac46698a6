"""The kvd server's lifecycle, top to bottom: allocate arenas, listen, report SERVING, wait for
a signal, drain (NOT_SERVING, end the open streams, stop accepting, let in-flight calls finish
within the grace period), free the arenas, exit 0. A second SIGINT forces exit."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import grp
import os
import shutil
import signal
import socket
import stat
import sys
import time
from collections import Counter
from dataclasses import fields, replace
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from kvd import __version__, sdnotify
from kvd.background import supervised
from kvd.cluster import ClusterMember
from kvd.config import AuthConfig, Config, load_config, log_created_tokens
from kvd.core.errors import KvdError
from kvd.gcwalk import COLLECTIONS
from kvd.memory.arena import SHM_DIR, sweep_stale
from kvd.node import Node
from kvd.tier_events import TierEventPublisher
from kvd.metrics import serve_metrics, watch_loop_lag
from kvd.service.admin import AdminService
from kvd.service.gate import CallGate, StepTurns
from kvd.service.auth import Authenticator, lease_holder
from kvd.service.memory import MemoryService
from kvd.service.peer import PeerService
from kvd.service.register import DRAINING, OpenStreams, add_service
from kvd_api.v1 import kvd_pb2
from kvd_client.pem import read_pem

log = structlog.get_logger("kvd.daemon")

SERVICE_NAMES = tuple(
    kvd_pb2.DESCRIPTOR.services_by_name[name].full_name for name in ("Memory", "Admin", "Peer")
)
# Calls grpc holds for kvd to take up (see GRPC_OPTIONS).
MAX_PENDING_CALLS = 65536
# Engines send big Step batches; allow them.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
    # Calls that arrived and wait for the server to take them up (grpc.aio takes them up
    # one at a time). Past grpc's default (1,000) it cancels new calls, whichever client
    # made them: one client's burst cancelled other clients' calls. Taken up, a client's
    # calls past max_calls_per_client wait in its own line (CallGate).
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
]


# What a reload applies (Daemon.reload): the rest of the config needs a restart.
RELOADED = ("tenants", "auth", "max_streams_per_tenant", "max_calls_per_client",
            "step_turns_per_tenant")


def widened_auth(running: AuthConfig, fresh: AuthConfig) -> list[str]:
    """The auth settings a reload to `fresh` would widen for unix-socket callers without a
    token (whom kvd cannot tell apart, see AuthConfig): acting as a tenant where they had
    to present a token, or calling admin calls where they could not. Those take a restart."""
    widened = []
    if fresh.unix_tenant and not (running.unix_tenant or running.unix_admin):
        widened.append("unix_tenant")
    if fresh.unix_admin and not running.unix_admin:
        widened.append("unix_admin")
    return widened


class StartupError(Exception):
    """kvd cannot start as configured: one line for the operator, exit code 2."""


def check_shared_memory(config: Config, shm: str = SHM_DIR) -> None:
    """Pools' arenas live in POSIX shared memory: refuse to start rather than have engines
    die of SIGBUS when the first page beyond what /dev/shm holds is touched."""
    from kvd.memory.cuda import gpu_available

    gpu = any(p.device_backend == "auto" for p in config.pools) and gpu_available()
    need = 0
    for pool in config.pools:
        on_gpu = pool.device_backend == "cupy" or (pool.device_backend == "auto" and gpu)
        pages = pool.host_pages + (0 if on_gpu else pool.device_pages)
        need += pages * pool.resolved_page_bytes
    try:
        free = shutil.disk_usage(shm).free
    except OSError:
        return  # no /dev/shm to measure (not Linux): the allocation itself will tell
    if need > free:
        raise StartupError(
            f"the pools need {need / 2**20:.0f} MiB of shared memory but {shm} has "
            f"{free / 2**20:.0f} MiB free; make the pools smaller or give kvd more "
            "(docker: --shm-size; Kubernetes: an emptyDir with medium: Memory at /dev/shm)")


# kvd's own memory a page of either tier takes at the start, for its page table (about
# 49 bytes, measured with pools of a million pages; rounded up).
PAGE_TABLE_BYTES = 64


def check_page_tables(config: Config, meminfo: str = "/proc/meminfo",
                      cgroup_root: str = "/sys/fs/cgroup",
                      own_cgroups: str = "/proc/self/cgroup") -> None:
    """Refuse to start, in one line, when the pools' page tables alone would take more of
    kvd's own memory than it has available (the host's, or its cgroup's where that is
    less): pages of a few bytes fit /dev/shm by the billion, and their tables would have
    kvd killed for memory while it made them."""
    pages = sum(p.device_pages + p.host_pages for p in config.pools)
    need = pages * PAGE_TABLE_BYTES
    available = _memory_available(meminfo, cgroup_root, own_cgroups)
    if available is not None and need > available:
        raise StartupError(
            f"the pools' {pages} pages need about {need / 2**20:.0f} MiB of kvd's own memory "
            f"for their page tables but {available / 2**20:.0f} MiB is available; make the "
            "pages larger (page_bytes) or fewer")


def _memory_available(meminfo: str, cgroup_root: str, own_cgroups: str) -> int | None:
    """Bytes of memory kvd may still take: the host's MemAvailable, or what its cgroup
    (v2's memory.max, v1's memory.limit_in_bytes) leaves where that is less; None where
    none of them can be read."""
    found = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(meminfo) as f:
            found += [int(line.split()[1]) * 1024 for line in f
                      if line.startswith("MemAvailable:")]
    with contextlib.suppress(OSError, ValueError):
        with open(own_cgroups) as f:
            for line in f:  # "0::/path" (v2), "4:memory:/path" (v1)
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    where, files = f"{cgroup_root}{path}", ("memory.max", "memory.current")
                elif "memory" in controllers.split(","):
                    where, files = (f"{cgroup_root}/memory{path}",
                                    ("memory.limit_in_bytes", "memory.usage_in_bytes"))
                else:
                    continue
                with contextlib.suppress(OSError, ValueError):
                    with open(f"{where}/{files[0]}") as limit, open(f"{where}/{files[1]}") as used:
                        text = limit.read().strip()
                        if text != "max":
                            found.append(max(0, int(text) - int(used.read().strip())))
    return min(found) if found else None


def check_gpu_memory(config: Config) -> None:
    """Device tiers in GPU memory: refuse to start, in one line, when a GPU has less free
    memory than its pools' device tiers take (rather than build a page table for pages that
    can never be allocated)."""
    from kvd.memory.cuda import free_gpu_memory, gpu_available

    gpu = any(p.device_backend == "auto" for p in config.pools) and gpu_available()
    need: dict[int, int] = {}
    for pool in config.pools:
        if pool.device_backend == "cupy" or (pool.device_backend == "auto" and gpu):
            need[pool.gpu] = need.get(pool.gpu, 0) + pool.device_pages * pool.resolved_page_bytes
    for device, size in need.items():
        free = free_gpu_memory(device)
        if free is not None and size > free:
            raise StartupError(
                f"the pools' device tiers need {size / 2**20:.0f} MiB of GPU {device}'s memory "
                f"but it has {free / 2**20:.0f} MiB free; make device_pages smaller")


class _Health(health.aio.HealthServicer):
    """grpc's health service, whose Watch streams end at a drain as kvd's own do: each once
    it has sent NOT_SERVING (ended by the drain, a watcher could miss it)."""

    def __init__(self, streams: OpenStreams) -> None:
        super().__init__()
        self._streams = streams
        self._watch = streams.serve(self._watch_to_the_end)
        self._watched: Counter[str] = Counter()  # the services watched now, and by how many
        self.shutting_down = False

    async def enter_graceful_shutdown(self) -> None:
        self.shutting_down = True
        for service in list(self._watched):  # services kvd does not serve too: their
            await self.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)  # watches end
        await super().enter_graceful_shutdown()

    async def Watch(self, request, context):
        await self._watch(request, context)

    async def _watch_to_the_end(self, request, context):
        task = asyncio.current_task()
        self._streams.end_themselves.add(task)
        self._watched[request.service] += 1
        try:
            await super().Watch(request, _EndsAfterShutdownWrite(context, self))
        finally:
            self._streams.end_themselves.discard(task)
            left = self._watched[request.service] - 1  # only the names watched now: a
            if left:                                    # client's names do not pile up
                self._watched[request.service] = left
            else:
                del self._watched[request.service]


class _EndsAfterShutdownWrite:
    """A Watch's context that ends the stream once it has written NOT_SERVING in the
    shutdown. Not at the first write to finish after the shutdown began: that can be the
    SERVING the watch was still writing, and its watcher would never be told."""

    def __init__(self, context, health: _Health) -> None:
        self._context = context
        self._health = health

    async def write(self, message) -> None:
        await self._context.write(message)
        if (self._health.shutting_down
                and message.status == health_pb2.HealthCheckResponse.NOT_SERVING):
            await self._context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)

    def __getattr__(self, name):
        return getattr(self._context, name)


class Daemon:
    def __init__(self, config: Config, from_file: Config | None = None) -> None:
        self.config = config
        self.node: Node | None = None
        self.streams = OpenStreams(config.max_streams_per_tenant)
        self.health = _Health(self.streams)
        self._grpc: grpc.aio.Server | None = None
        self._stop = asyncio.Event()
        self._num_signals = 0
        self.addresses: list[str] = []
        self._socket_bound = False
        self._tier_events: TierEventPublisher | None = None
        self._metrics_server = None
        self._health_grpc: grpc.aio.Server | None = None
        self._ready = False  # serving and not draining: /readyz
        self._background: list[asyncio.Task] = []  # see _keep
        # A client's unary calls past its limit, and a tenant's calls and Step messages while
        # tenants compete, wait in lines of their own (see kvd.service.gate).
        self.gate = CallGate(config.max_calls_per_client)
        self.turns = StepTurns(config.step_turns_per_tenant)
        self._apply_limits()
        # The running config as its file gave it (the command line's flags left out): a
        # reload applies what RELOADED names, and warns of the rest the file changed.
        self._from_file = from_file or config

    def _apply_limits(self) -> None:
        """The limits on one tenant's or client's share of the loop, from self.config. Each
        is read when a stream opens or a call or message comes: one already running keeps
        the place it has, and a change applies from the next on."""
        config = self.config
        self.streams.per_tenant.limit = config.max_streams_per_tenant
        self.gate.limit = config.max_calls_per_client
        self.turns.gate.limit = config.step_turns_per_tenant
        self.turns.configure({t.name: t.weight for t in config.tenants})

    async def serve(self) -> int:
        await self.start()
        self._capture_signals()
        await self._stop.wait()
        await self.shutdown()
        return 0

    async def start(self) -> None:
        # Copies run in worker threads; with CPython's default 5 ms GIL switch interval each
        # hand-off between them and the event loop can wait that long, which dominates a
        # step that moves many pages. 0.5 ms keeps hand-offs short.
        sys.setswitchinterval(self.config.switch_interval_s)
        loop = asyncio.get_running_loop()
        if self.config.socket:  # first: a second kvd is told so, not that memory is short
            _prepare_socket_path(Path(self.config.socket))
        stale = sweep_stale()  # before measuring the room: a killed kvd's arenas hold it
        if stale:
            log.warning("removed the arenas of kvd processes that are gone",
                        arenas=[name for name, _ in stale],
                        mib=round(sum(held for _, held in stale) / 2**20, 1))
        check_shared_memory(self.config)
        check_gpu_memory(self.config)
        check_page_tables(self.config)
        # Arena allocation can take a while for large pools: keep the loop free.
        making = loop.run_in_executor(None, Node, self.config)
        try:
            self.node = await asyncio.shield(making)
        except KvdError as exc:
            raise StartupError(str(exc)) from None
        except asyncio.CancelledError:  # Ctrl-C meanwhile: the arenas go once made
            with contextlib.suppress(Exception):
                await (await making).aclose()
            raise
        try:
            try:  # before listening: a bad endpoint or PEM file stops the start
                self.node.peers.open()
                self.node.engines.start()
                if self.config.kv_events_endpoint:
                    self._tier_events = TierEventPublisher(
                        self.node, self.config.kv_events_endpoint,
                        self.config.kv_events_replay_endpoint)
                    self._tier_events.start()
            except (ValueError, KvdError) as exc:
                raise StartupError(str(exc)) from None
            await self._listen(loop)
        except BaseException:
            if self._tier_events is not None:
                self._tier_events.close()
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
                self._metrics_server.server_close()
            if self._health_grpc is not None:
                await self._health_grpc.stop(0)
            await self.node.aclose()  # the arenas' shared memory goes with it
            if self._socket_bound:  # ours: a later start need not find it stale
                Path(self.config.socket).unlink(missing_ok=True)
            raise

    def _grpc_server(self) -> grpc.aio.Server:
        """The gRPC server with kvd's services on it, not yet bound."""
        self.auth = Authenticator(self.config, self.node.leases)
        self.streams.owner = self.auth.stream_owner
        self.streams.refusal = self.auth.refusal
        # kvd pings its clients: one that stops answering (a stopped or partitioned engine
        # with a Step stream open) loses its connection, so its streams close and its lease
        # can lapse, instead of an open stream holding its pages for ever. A ping has as long
        # as the lease to be answered (5 to 20 s): no less, or a client descheduled on a busy
        # machine for less than its lease would lose its connection, its streams and, while it
        # reconnected, its lease.
        ping_ms = int(max(1.0, min(10.0, self.config.lease_ttl_s / 3)) * 1000)
        answer_ms = int(max(5.0, min(20.0, self.config.lease_ttl_s)) * 1000)
        server = grpc.aio.server(options=GRPC_OPTIONS + [
            # A bigger message is refused by grpc (RESOURCE_EXHAUSTED) before kvd reads it.
            ("grpc.max_receive_message_length", self.config.max_message_bytes),
            ("grpc.keepalive_time_ms", ping_ms),
            ("grpc.keepalive_timeout_ms", answer_ms),
            ("grpc.http2.ping_timeout_ms", answer_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ])
        services = kvd_pb2.DESCRIPTOR.services_by_name
        add_service(server, MemoryService(self.node, self.auth, self.gate, self.turns,
                                          self.streams),
                    services["Memory"], raw=MemoryService.RAW,
                    streams=self.streams, finish=MemoryService.FINISH_AT_DRAIN)
        add_service(server, AdminService(self.node, self.auth, self.request_stop, self.gate),
                    services["Admin"])
        add_service(server, PeerService(self.node, self.auth), services["Peer"],
                    streams=self.streams, finish=("Receive",))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        _serve_reflection(server, (*SERVICE_NAMES, health.SERVICE_NAME))
        return server

    async def _listen(self, loop) -> None:
        self._metrics_server = None
        if self.config.metrics:  # a port in use stops the start before gRPC serves
            try:
                self._metrics_server = serve_metrics(
                    self.config.metrics, self.node, loop, lambda: self._ready,
                    self._health_detail,
                    gates={"client_calls": self.gate, "tenant_turns": self.turns.gate},
                    streams=self.streams)
            except OSError as exc:
                raise StartupError(f"cannot serve metrics on {self.config.metrics}: {exc} "
                                   '(metrics = "" runs without)') from None
        server = self._grpc_server()
        if self.config.health:
            # Health only, in clear: Kubernetes' grpc: probes speak neither TLS nor unix.
            self._health_grpc = grpc.aio.server(options=GRPC_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_grpc)
            port = _bind(self._health_grpc, self.config.health)
            await self._health_grpc.start()
            log.info("health listening", address=f"{self.config.health.rsplit(':', 1)[0]}:{port}")
        if self.config.socket:
            gid = _group_id(self.config.socket_group)
            path = Path(self.config.socket)
            _bind(server, f"unix:{path}")  # the socket is there from now on
            self._socket_bound = True
            self.addresses.append(f"unix://{path}")
            # The socket is the gate for unix callers: only the owner and its group, from
            # before the first caller is served.
            try:
                os.chown(path, -1, gid)
                os.chmod(path, self.config.socket_mode)
            except OSError as exc:
                raise StartupError(f"cannot give the socket {path} to group "
                                   f"{self.config.socket_group or gid} with mode "
                                   f"{self.config.socket_mode:#o}: {exc.strerror}") from None
        if self.config.tcp:
            port = _bind(server, self.config.tcp, _tls_credentials(self.config))
            host = self.config.tcp.rsplit(":", 1)[0]
            self.addresses.append(f"{host}:{port}")
        await server.start()
        self._grpc = server
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._ready = True
        node, config = self.node, self.config
        self._keep("lease_reaper", lambda: node.leases.reap_forever(
            node.release, max(0.05, min(1.0, config.lease_ttl_s / 4)), node.events,
            end_holds=lambda lease: node.end_holds(lease_holder(lease))))
        self._keep("expiry", lambda: node.expire_forever(
            max(0.05, min(1.0, config.handoff_ttl_s / 4, config.hold_s / 4))))
        if config.self_check_s:
            self._keep("self_check", lambda: node.health.check_forever(config.self_check_s))
        self._keep("loop_lag", watch_loop_lag)
        if config.engines:
            self._keep("engine_holdings", node.follow_engine_holdings)
        if self.config.cluster.etcd:
            self.node.cluster = ClusterMember(self.node, self.config)
            self.node.cluster.start()
            log.info("cluster member", node=self.node.cluster.name, etcd=self.config.cluster.etcd)
        # Everything allocated so far (modules, config, arenas' page tables) lives as long as
        # the daemon: keep the cyclic GC from traversing it on every collection.
        gc.freeze()
        if config.gc_full_walk_s:
            COLLECTIONS.install()
            self._keep("gc_full_walk",
                       lambda: COLLECTIONS.full_walk_forever(config.gc_full_walk_s))
        sdnotify.notify(f"READY=1\nSTATUS=serving on {', '.join(self.addresses)}\n"
                        f"MAINPID={os.getpid()}")
        interval = sdnotify.watchdog_interval_s()
        if interval:
            self._keep("watchdog", lambda: sdnotify.watchdog_forever(interval))
        log.info("kvd serving", version=__version__, listen=self.addresses, pid=os.getpid())

    def _keep(self, name: str, run) -> None:
        """Run a task of kvd's beside the calls it serves until shutdown, started again
        should it fail (see background.supervised)."""
        self._background.append(asyncio.ensure_future(supervised(name, run)))

    def _health_detail(self) -> str:
        """Lines /healthz adds after "ok" (read from the metrics thread)."""
        cluster = self.node.cluster if self.node is not None else None
        return cluster.health_detail() + "\n" if cluster is not None else ""

    def request_stop(self) -> None:
        self._stop.set()

    def _capture_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self.reload)

    def reload(self) -> None:
        """SIGHUP: re-read the config file and apply tenants, quotas, identities and the
        per-tenant and per-client limits (RELOADED) without dropping state; any other
        setting the file changed (pools, listeners, ...) needs a restart, and is named in a
        warning. A bad file, or one that sets nothing, changes nothing. A reload never lets
        token-less unix callers do more (see widened_auth): a file cut short would have
        them act as the default tenant, or the admin."""
        if not self.config.path:
            log.warning("reload ignored: kvd runs on its embedded default, not a file")
            return
        try:
            fresh = load_config(self.config.path, create_tokens=True, refuse_empty=True)
            log_created_tokens()
        except KvdError as exc:
            log.error("reload failed; keeping the running config", error=str(exc))
            return
        reloaded = {name: getattr(fresh, name) for name in RELOADED}
        # Named at every reload until a restart applies them.
        unapplied = [f.name for f in fields(Config) if f.name not in RELOADED
                     and getattr(fresh, f.name) != getattr(self._from_file, f.name)]
        kept = widened_auth(self.config.auth, fresh.auth)
        if kept:
            reloaded["auth"] = replace(fresh.auth, **{k: getattr(self.config.auth, k)
                                                      for k in kept})
            unapplied += [f"auth.{k}" for k in kept]
        config = replace(self.config, **reloaded)
        try:
            # The file was checked against its own pools; what applies is its tenants over
            # the pools kvd runs (pools need a restart), where a quota may not fit (pages of
            # another size) or name a pool kvd does not run. Checked before anything
            # changes: found half-way, the tenants were taken for applied and never were.
            config.validate()
        except KvdError as exc:
            log.error("reload failed; keeping the running config",
                      error=f"{exc} (with the pools kvd runs: "
                      f"{', '.join(p.name for p in config.pools)})")
            return
        if unapplied:
            log.warning("these settings need a restart; kvd keeps their running values",
                        settings=unapplied)
        self._from_file = replace(self._from_file, **reloaded)
        self.config = config
        self.auth.configure(self.config)
        self._apply_limits()
        sdnotify.notify("RELOADING=1")
        try:
            self.node.apply_tenants(self.config)
            if self.node.cluster is not None:
                self.node.cluster.reload(self.config)
        finally:
            sdnotify.notify("READY=1")  # whatever happened: systemd waits for it
        log.info("config reloaded", path=self.config.path,
                 tenants=[t.name for t in self.config.tenants])

    def _on_signal(self, sig: signal.Signals) -> None:
        self._num_signals += 1
        if self._num_signals > 1 and sig == signal.SIGINT:
            log.warning("second interrupt: exiting now")
            os._exit(130)
        log.info("draining", signal=sig.name, grace_s=self.config.grace_s)
        self._stop.set()

    async def shutdown(self) -> None:
        sdnotify.notify("STOPPING=1\nSTATUS=draining")
        self._ready = False
        await self.health.enter_graceful_shutdown()
        for task in self._background:
            task.cancel()
        if self._tier_events is not None:
            self._tier_events.close()
        if self.node is not None and self.node.cluster is not None:
            await self.node.cluster.aclose()  # leaves the picture now, not at its lease's end
        if self._grpc is not None:
            # Open streams are told kvd is draining and end first (new ones are refused),
            # while their connections are up; then grpc's stop refuses new calls and is done
            # when the unary calls in flight are: grace_s for both. Stopped first, grpc
            # would send its GOAWAY at once and close each connection the moment its last
            # stream ended: a client writing its next message in that moment lost the
            # status, and read "Stream removed" where kvd said "kvd is draining".
            started = time.monotonic()
            ended = self.streams.drain()
            await self.streams.ended(self.config.grace_s)
            await self._grpc.stop(max(0.0, self.config.grace_s - (time.monotonic() - started)))
            log.info("drained", streams_ended=ended,
                     seconds=round(time.monotonic() - started, 3))
        if self._health_grpc is not None:  # NOT_SERVING until the end, as /readyz
            await self._health_grpc.stop(0)
        if self._metrics_server is not None:  # up until the drain is done
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self.node is not None:
            await self.node.aclose()
        if self.config.socket:
            Path(self.config.socket).unlink(missing_ok=True)
        COLLECTIONS.uninstall()
        log.info("kvd stopped")


# Reflection as current clients ask for it first (grpcurl, IDEs) and as older ones do:
# grpcio-reflection serves v1alpha only; v1's messages are the same on the wire.
REFLECTION_SERVICES = ("grpc.reflection.v1.ServerReflection", reflection.SERVICE_NAME)


def _serve_reflection(server: grpc.aio.Server, service_names: tuple[str, ...]) -> None:
    servicer = reflection.aio.ReflectionServicer((*service_names, *REFLECTION_SERVICES))
    handlers = {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}
    for name in REFLECTION_SERVICES:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))


def _group_id(group: str) -> int:
    """The socket's group: a name or a number ("": kvd's own, -1 to os.chown)."""
    if not group:
        return -1
    if group.isdecimal():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise StartupError(f"socket_group {group!r}: no such group on this host") from None


def _tls_credentials(config: Config) -> grpc.ServerCredentials | None:
    """grpc's own TLS (and mTLS with a client CA) from the PEM files the config names."""
    if not config.tls_cert:
        return None
    try:
        pem = read_pem({key: getattr(config, key)
                        for key in ("tls_cert", "tls_key", "tls_client_ca")}, server=True)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    return grpc.ssl_server_credentials(
        [(pem["tls_key"], pem["tls_cert"])], root_certificates=pem["tls_client_ca"],
        require_client_auth=pem["tls_client_ca"] is not None)


def _bind(server: grpc.aio.Server, address: str,
          credentials: grpc.ServerCredentials | None = None) -> int:
    try:
        if credentials is not None:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc says only "Failed to bind"
        raise StartupError(f"cannot listen on {address}: the address is in use, not "
                           f"permitted, or not this host's ({exc})") from None


def _prepare_socket_path(path: Path) -> None:
    """Create the socket's directory; remove a stale socket, refuse to steal a live one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        exists = path.exists()
    except OSError as exc:
        raise StartupError(f"cannot create the socket's directory {path.parent}: "
                           f"{exc.strerror}") from None
    if not exists:
        return
    if not stat.S_ISSOCK(path.stat().st_mode):
        raise StartupError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink()
    else:
        raise StartupError(f"another kvd is already listening on {path}")
    finally:
        probe.close()
