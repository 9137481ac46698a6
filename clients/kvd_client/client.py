"""AsyncClient: one method per kvd RPC, deadlines on every call, exceptions instead of
status codes. Client (kvd_client.blocking) offers the same calls blocking."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd_api.v1 import kvd_pb2 as pb
from kvd_api.v1 import kvd_pb2_grpc as pb_grpc
from kvd_client.errors import from_rpc_error
from kvd_client.pem import read_pem
from kvd_client.step_stream import StepStream, access_request

DEFAULT_TIMEOUT_S = 30.0
# Timeouts from this long on are no deadline: grpc's deadline is kept in nanoseconds of a
# 64-bit clock, and one of about 1e10 s or more overflowed it and failed every call at
# once with DEADLINE_EXCEEDED (a caller who meant "wait as long as it takes").
NO_DEADLINE_S = 1e9
# A unix socket's address (sun_path) holds 108 bytes with the NUL that ends the path.
MAX_SOCKET_PATH_BYTES = 107
SUBSCRIBED = "kvd-subscribed"  # the header a WatchEvents stream opens with, subscribed


def default_target() -> str:
    """$KVD_TARGET, else the systemd unit's socket."""
    return os.environ.get("KVD_TARGET") or "unix:///run/kvd/kvd.sock"  # set empty: unset


NOT_UTF8 = "gRPC takes {} as UTF-8 text, and this one is not"


def is_utf8(text: str) -> bool:
    """Whether text is UTF-8 (a command line's bytes that are not come as surrogates)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def socket_path_problem(path: str) -> str:
    """Why no unix socket can be at this path ("" when one can): kvd binds it, a client
    connects to it, and neither can past what a socket's address holds. (Whether it is
    UTF-8, which gRPC needs too, its callers ask first: is_utf8.)"""
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH_BYTES:
        return (f"a unix socket's path holds at most {MAX_SOCKET_PATH_BYTES} bytes, "
                f"this one is {size}")
    return ""


def _check_unix_path(target: str) -> None:
    """ValueError for a target that is not UTF-8 text (grpc's UnicodeEncodeError), or a
    unix socket's path longer than a socket's address holds (grpc answers every call
    UNKNOWN, "the target uri is not valid")."""
    if not is_utf8(target):
        raise ValueError(f"{target.encode(errors='replace').decode()}: "
                         f"{NOT_UTF8.format('a target')}")
    if target.startswith("unix:"):
        path = target.removeprefix("unix://") if target.startswith("unix://") else target[5:]
        if problem := socket_path_problem(path):
            raise ValueError(f"{target}: {problem}")


def _deadline(timeout_s: float | None) -> float | None:
    """A timeout as grpc takes it: None (no deadline) for None, and for one too long for
    grpc's clock (NO_DEADLINE_S, or inf)."""
    return None if timeout_s is None or timeout_s >= NO_DEADLINE_S else timeout_s


def _check_timeout(timeout_s: float) -> float:
    if not timeout_s > 0:  # nan too
        raise ValueError(f"timeout_s must be more than 0 (got {timeout_s!r})")
    return timeout_s


def _channel_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        # kvd is a local daemon: once it is back after a restart, a client reconnects
        # within two seconds (gRPC's default backoff grows to two minutes).
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def _metadata(token: str | None, metadata: Sequence[tuple[str, str]], lease: str | None
              ) -> tuple:
    """Call metadata: the tenant's bearer token ($KVD_TOKEN when not given), this client's
    lease (so kvd releases its requests if it disappears), and any extra."""
    token = token if token is not None else os.environ.get("KVD_TOKEN", "")
    extra = (("authorization", f"Bearer {token}"),) if token else ()
    if lease is None:
        lease = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    if lease:
        extra += (("kvd-lease", lease),)
    return extra + tuple(metadata)


def _intent_update(request_id: str, block_index: int, prefetch: bool = False, **fields
                   ) -> pb.IntentUpdate:
    return pb.IntentUpdate(request_id=request_id, block_index=block_index,
                           intent=pb.MemoryIntent(**fields), prefetch=prefetch)


class _Requests:
    """Builds the request messages both clients send."""

    intent_update = staticmethod(_intent_update)

    @staticmethod
    def admit(request_id, prompt_tokens, output_tokens, *, tenant="", pool="", priority=0,
              handoff_pool=""):
        return pb.AdmitRequest(request_id=request_id, tenant=tenant, pool=pool,
                               prompt_tokens=prompt_tokens, expected_output_tokens=output_tokens,
                               priority=priority, handoff_pool=handoff_pool)


@dataclass(frozen=True)
class RetryPolicy:
    """How a client rides out kvd restarting: calls wait for the connection to come back
    (gRPC's wait_for_ready) within their deadline, and a call that still fails UNAVAILABLE
    (cut off by a shutdown) is tried again with exponential backoff.

    A retried mutating call may have been applied before the connection broke; after a
    restart that cannot matter (kvd starts empty: see EngineSession.recover), and on a live
    kvd a retried Admit answers ALREADY_EXISTS rather than doing it twice."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0

    def backoffs(self):
        delay = self.initial_backoff_s
        for _ in range(self.max_attempts - 1):
            yield delay
            delay = min(self.max_backoff_s, delay * self.multiplier)


def _retry_delay(err: grpc.RpcError, backoffs) -> float:
    """How long to wait before trying a failed call again; raises the call's error when it
    is not UNAVAILABLE or the retry policy's attempts are spent."""
    delay = next(backoffs, None) if err.code() == grpc.StatusCode.UNAVAILABLE else None
    if delay is None:
        raise from_rpc_error(err) from None
    return delay


@dataclass(frozen=True)
class Tls:
    """TLS to a kvd's TCP listener: the CA that signed its certificate (None: the system's
    roots), and this client's certificate and key when kvd wants them (mTLS). PEM bytes or
    paths. $KVD_TLS_CA, $KVD_TLS_CERT and $KVD_TLS_KEY give the defaults."""

    ca: str | bytes | None = None
    cert: str | bytes | None = None
    key: str | bytes | None = None
    server_name: str | None = None  # when the certificate names another host

    @classmethod
    def from_env(cls) -> Tls | None:
        env = {k: os.environ.get(f"KVD_TLS_{k.upper()}") for k in ("ca", "cert", "key")}
        return cls(**env) if any(env.values()) else None

    def credentials(self) -> grpc.ChannelCredentials:
        """grpc's credentials from the PEM files, read and checked now: ValueError naming
        the file that cannot be read or used (grpc would fail every call instead)."""
        pem = read_pem({"tls_ca": self.ca, "tls_cert": self.cert, "tls_key": self.key},
                       server=False)
        return grpc.ssl_channel_credentials(pem["tls_ca"], pem["tls_key"], pem["tls_cert"])


class AsyncClient:
    """kvd over grpc.aio. Use as `async with AsyncClient(target) as kvd: ...`."""

    def __init__(self, target: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 token: str | None = None, lease: str | None = None,
                 metadata: Sequence[tuple[str, str]] = (),
                 retry: RetryPolicy | None = None, tls: Tls | None = None) -> None:
        self.target = target or default_target()
        _check_unix_path(self.target)
        self.timeout_s = _check_timeout(timeout_s)
        self.retry = retry
        self.metadata = _metadata(token, metadata, lease)
        tls = tls or (None if self.target.startswith("unix:") else Tls.from_env())
        options = _channel_options()
        if tls is None:
            self.channel = grpc.aio.insecure_channel(self.target, options=options)
        else:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self.channel = grpc.aio.secure_channel(self.target, tls.credentials(),
                                                     options=options)
        self.memory = pb_grpc.MemoryStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)


    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def _call(self, method, request, timeout_s: float | None = None):
        if self.retry is None:
            try:
                return await method(request, timeout=_deadline(timeout_s or self.timeout_s),
                                    metadata=self.metadata)
            except grpc.RpcError as err:
                raise from_rpc_error(err) from None
        backoffs = self.retry.backoffs()
        while True:
            try:
                return await method(request, timeout=_deadline(timeout_s or self.timeout_s),
                                    metadata=self.metadata, wait_for_ready=True)
            except grpc.RpcError as err:
                delay = _retry_delay(err, backoffs)
            await asyncio.sleep(delay)

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        await asyncio.wait_for(self.channel.channel_ready(), timeout_s)

    async def health(self, service: str = "") -> str:
        resp = await self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def admit(self, request_id: str, prompt_tokens: int, output_tokens: int = 0, **kw
                    ) -> pb.AdmitResponse:
        return await self._call(self.memory.Admit,
                                _Requests.admit(request_id, prompt_tokens, output_tokens, **kw))

    async def allocate(self, request_id: str, num_blocks: int) -> pb.AllocateResponse:
        return await self._call(self.memory.Allocate,
                                pb.AllocateRequest(request_id=request_id, num_blocks=num_blocks))

    async def lookup(self, namespace: str, keys: Sequence[bytes], pool: str = ""
                     ) -> pb.LookupResponse:
        """How many leading blocks of a prefix (its block keys, in order) kvd holds."""
        return await self._call(self.memory.Lookup, pb.LookupRequest(
            pool=pool, namespace=namespace, keys=list(keys)))

    async def store(self, request_id: str, namespace: str, keys: Sequence[bytes],
                    intent: pb.MemoryIntent | None = None) -> pb.StoreResponse:
        """Pages for a request's prefix blocks; write the fresh ones, then commit them.
        `intent`: a pin (while the request uses them) or a deadline for the blocks."""
        return await self._call(self.memory.Store, pb.StoreRequest(
            request_id=request_id, namespace=namespace, keys=list(keys), intent=intent))

    async def commit(self, request_id: str, namespace: str, keys: Sequence[bytes]
                     ) -> pb.CommitResponse:
        """The stored blocks under these keys are written: others may now find them."""
        return await self._call(self.memory.Commit, pb.CommitRequest(
            request_id=request_id, namespace=namespace, keys=list(keys)))

    async def load(self, request_id: str, namespace: str, keys: Sequence[bytes],
                   intent: pb.MemoryIntent | None = None) -> pb.LoadResponse:
        """The pages of the leading run of these keys kvd holds, to copy from before the
        next call. `intent`: as for store."""
        return await self._call(self.memory.Load, pb.LoadRequest(
            request_id=request_id, namespace=namespace, keys=list(keys), intent=intent))

    async def access(self, request_id: str, blocks: Sequence[int] | None = None
                     ) -> pb.AccessResponse:
        return await self._call(self.memory.Access, access_request(request_id, blocks))

    async def update_intents(self, updates: Iterable[pb.IntentUpdate]) -> pb.UpdateIntentsResponse:
        return await self._call(self.memory.UpdateIntents,
                                pb.UpdateIntentsRequest(updates=list(updates)))

    async def free(self, request_id: str, blocks: Sequence[int]) -> pb.FreeResponse:
        return await self._call(self.memory.Free,
                                pb.FreeRequest(request_id=request_id, block_indices=blocks))

    async def release(self, request_id: str) -> pb.ReleaseResponse:
        return await self._call(self.memory.Release, pb.ReleaseRequest(request_id=request_id))

    async def evict(self, num_pages: int, pool: str = "") -> pb.EvictResponse:
        return await self._call(self.memory.Evict, pb.EvictRequest(pool=pool, num_pages=num_pages))

    async def export_pool(self, pool: str = "") -> pb.ExportPoolResponse:
        return await self._call(self.memory.ExportPool, pb.ExportPoolRequest(pool=pool))

    async def pool_stats(self, pool: str = "") -> pb.GetPoolStatsResponse:
        return await self._call(self.memory.GetPoolStats, pb.GetPoolStatsRequest(pool=pool))

    async def set_policy(self, policy: str, pool: str = "") -> pb.SetPolicyResponse:
        return await self._call(self.admin.SetPolicy,
                                pb.SetPolicyRequest(pool=pool, policy=policy))

    async def list_policies(self) -> list[str]:
        return list((await self._call(self.admin.ListPolicies, pb.ListPoliciesRequest())).policies)

    async def self_check(self) -> pb.SelfCheckResponse:
        return await self._call(self.admin.SelfCheck, pb.SelfCheckRequest())

    async def drain(self) -> None:
        await self._call(self.admin.Drain, pb.DrainRequest())

    async def keep_alive(self, timeout_s: float | None = None) -> pb.KeepAliveResponse:
        """Renew this client's lease, and say it is done with the pages its calls were
        handed (any call does both; this one does nothing else)."""
        return await self._call(self.memory.KeepAlive, pb.KeepAliveRequest(), timeout_s)

    async def explain(self, request_id: str) -> pb.ExplainResponse:
        return await self._call(self.memory.Explain, pb.ExplainRequest(request_id=request_id))

    async def wait_admission(self, request_id: str, timeout_s: float | None = None):
        """Yield AdmissionUpdates until the request is admitted, or rejected (a quota or
        policy changed while it waited, so that it can never be admitted: the last update
        says REJECTED, and why). Stopping early (break, or cancelling the task) withdraws a
        still-queued request from the queue; one kvd admitted as the stream ended (its
        ADMITTED on the way) stays admitted: release() it if it is no longer wanted."""
        async for update in self._stream(self.memory.WaitAdmission,
                                         pb.WaitAdmissionRequest(request_id=request_id),
                                         timeout_s):
            yield update

    async def _stream(self, method, request, timeout_s: float | None):
        """A server stream's messages; closing the generator cancels the call."""
        call = method(request, timeout=_deadline(timeout_s), metadata=self.metadata)
        try:
            async for message in call:
                yield message
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()

    async def handoff(self, request_id: str, target_pool: str = "",
                      timeout_s: float | None = None):
        """Yield HandoffProgress messages until the last (done, with the target pool's page
        handles). Stopping early (break, or cancelling the task) rolls the handoff back."""
        async for progress in self._stream(
                self.memory.Handoff,
                pb.HandoffRequest(request_id=request_id, target_pool=target_pool), timeout_s):
            yield progress

    async def handoff_all(self, request_id: str, target_pool: str = "",
                          timeout_s: float | None = None) -> pb.HandoffProgress:
        """Hand a request off and return the final progress message."""
        last = None
        async for last in self.handoff(request_id, target_pool, timeout_s):
            pass
        return last

    async def list_requests(self, pool: str = "", limit: int = 0) -> list[pb.RequestInfo]:
        return list((await self._call(self.admin.ListRequests,
                                      pb.ListRequestsRequest(pool=pool, limit=limit))).requests)

    async def list_links(self) -> list[pb.LinkStats]:
        return list((await self._call(self.admin.ListLinks, pb.ListLinksRequest())).links)

    async def get_cluster(self, pool: str = "") -> pb.GetClusterResponse:
        """The cluster this kvd shares tenants' quotas with, as it sees it (admin)."""
        return await self._call(self.admin.GetCluster, pb.GetClusterRequest(pool=pool))

    async def watch_events(self, *, pools=(), tenants=(), kinds=(), buffer: int = 0,
                           on_subscribed: Callable[[], object] | None = None):
        """Yield kvd's events as they happen (a "gap" event counts ones this watcher lost).
        `on_subscribed` is called once kvd has subscribed the watcher, before its first
        event: every event from then on is yielded (or counted by a gap)."""
        call = self.memory.WatchEvents(
            pb.WatchEventsRequest(pools=pools, tenants=tenants, kinds=kinds, buffer=buffer),
            metadata=self.metadata)
        try:
            if on_subscribed is not None:
                # Refused, the call ends with no such header, and its error is raised below.
                if any(key == SUBSCRIBED for key, _ in await call.initial_metadata() or ()):
                    on_subscribed()
            async for event in call:
                yield event
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                raise from_rpc_error(err) from None
        finally:
            call.cancel()

    async def list_tenants(self, pool: str = "") -> list[pb.TenantInfo]:
        reply = await self._call(self.admin.ListTenants, pb.ListTenantsRequest(pool=pool))
        return list(reply.tenants)

    async def set_quota(self, tenant: str, pool: str = "", **fields) -> list[pb.TenantInfo]:
        """fields: weight, guaranteed_pages, limit_pages (0: none), max_request_pages,
        max_request_fraction; only those given change."""
        reply = await self._call(self.admin.SetQuota,
                                 pb.SetQuotaRequest(tenant=tenant, pool=pool, **fields))
        return list(reply.tenants)

    def step_stream(self) -> StepStream:
        return StepStream(self)


intent_update = _intent_update
