"""kvd's configuration: a TOML file (/etc/kvd/kvd.toml when installed), overridable by flags.

With neither, kvd runs its embedded default: one pool on host memory, a unix socket. The
schema (types, ranges, units) is checked by pydantic; a bad value is one line naming the key.
"""

from __future__ import annotations

import os
import secrets
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import structlog
from pydantic import Field, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from kvd.config_values import (
    DEFAULT_SOCKET,
    MODEL_PRESETS,
    SCHEMA,
    Address,
    AgingMs,
    Count,
    FileMode,
    Flag,
    Fraction,
    Name,
    NonNegative,
    Positive,
    PositiveInt,
    PolicyName,
    PositiveSizeOrAuto,
    Quota,
    QuotaPages,
    Size,
    SocketPath,
    Weight,
    bytes_of,
    pages_of,
)
from kvd.core.errors import InvalidArgument
from kvd.core.fairness import TenantQuota


@dataclass(frozen=True, slots=True)
class PoolConfig:
    __pydantic_config__ = SCHEMA
    name: Name = "default"
    model: str = "llama-3-8b"
    block_tokens: PositiveInt = 16
    page_bytes: Count = 0  # 0: block_tokens x the model's bytes per token
    device_pages: PositiveInt = 64
    host_pages: Count = 256
    policy: PolicyName = "lru"
    device_backend: Literal["auto", "cupy", "host"] = "auto"
    gpu: Count = 0
    max_queue: PositiveInt = 1024
    # "working_set": admit while the running requests' working sets fit the device tier
    # (queue the rest); "reservation": while their pages fit both tiers (the device
    # over-subscribed, steps paging through the host tier).
    admission: Literal["working_set", "reservation"] = "working_set"
    # The device<->host link: capacity ("auto": measured at start), burst (0: 5 ms of
    # capacity, at least two chunks), the largest piece a transfer is copied in ("auto": half
    # a millisecond of capacity, 64 KiB to 4 MiB, at least a page), how transfers
    # share it ("fair": classes, weights, caps; "fifo": arrival order, no budgets), and how
    # long a transfer waits before it is served as if one class higher.
    link_bandwidth: PositiveSizeOrAuto = "auto"
    link_burst: Size = 0
    link_chunk: PositiveSizeOrAuto = "auto"
    link_scheduling: Literal["fair", "fifo"] = "fair"
    link_aging_ms: AgingMs = 50.0
    # The tenants that may use this pool (admit into it, hand off to it, map its arenas);
    # empty: every tenant. Engines that map a pool can read and write all of its pages.
    tenants: tuple[Name, ...] = ()

    @property
    def resolved_page_bytes(self) -> int:
        if self.page_bytes:
            return self.page_bytes
        return self.block_tokens * MODEL_PRESETS[self.model].bytes_per_token

    @property
    def arena_bytes(self) -> int:
        """Bytes of shared memory its tiers map (the device tier too, on the host backend)."""
        return (self.device_pages + self.host_pages) * self.resolved_page_bytes

    def validate(self) -> None:
        if self.model not in MODEL_PRESETS and not self.page_bytes:
            raise InvalidArgument(
                f"pool {self.name!r}: unknown model {self.model!r}; choose one of "
                f"{', '.join(sorted(MODEL_PRESETS))} or set page_bytes"
            )


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """A pool->pool link for handoff (`[[link]]` with source and target pools)."""

    __pydantic_config__ = SCHEMA
    source: Name
    target: str  # a pool of this kvd, or PEER/POOL: a pool of a peer kvd on another node
    bandwidth: PositiveSizeOrAuto = "auto"
    burst: Size = 0
    chunk: PositiveSizeOrAuto = "auto"
    scheduling: Literal["fair", "fifo"] = "fair"
    aging_ms: AgingMs = 50.0

    def validate(self, pools: tuple[PoolConfig, ...], peers: tuple = ()) -> None:
        names = {p.name for p in pools}
        if self.source not in names:
            raise InvalidArgument(f"link {self.source}->{self.target}: no pool {self.source!r}")
        if "/" in self.target:  # PEER/POOL: the network to another node's kvd
            peer = self.target.split("/", 1)[0]
            if peer not in {p.name for p in peers}:
                raise InvalidArgument(f"link {self.source}->{self.target}: no [[peer]] "
                                      f"{peer!r}")
        elif self.target not in names:
            raise InvalidArgument(f"link {self.source}->{self.target}: no pool {self.target!r}")
        if self.source == self.target:
            raise InvalidArgument(f"link {self.source}->{self.target}: a link joins two pools")


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """Another node's kvd (`[[peer]]`), for handoffs across nodes: its TCP address, its
    admin token (`token_file`, `token_env` or `token`), and TLS: the CA its certificate is
    signed by, and this kvd's certificate where the peer asks for one (mTLS). A handoff pool
    named `NAME/POOL` is that peer's pool."""

    __pydantic_config__ = SCHEMA
    name: Name
    address: Address
    token: str = field(default="", repr=False)
    tls_ca: str = ""  # "": plaintext (the peer must allow tokens over plaintext TCP)
    tls_cert: str = ""
    tls_key: str = ""
    timeout_s: Positive = 5.0

    def validate(self) -> None:
        if not self.address:
            raise InvalidArgument(f"peer {self.name!r}: address is HOST:PORT")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument(f"peer {self.name!r}: tls_cert and tls_key go together")
        if self.tls_cert and not self.tls_ca:  # else the link would go in clear without them
            raise InvalidArgument(f"peer {self.name!r}: tls_cert and tls_key are for TLS: "
                                  "set tls_ca, the CA the peer's certificate is signed by")


@dataclass(frozen=True, slots=True)
class EngineEventsConfig:
    """An engine whose KV cache events kvd follows (`[[engine]]`): its ZMQ publisher
    (vLLM's or SGLang's) and the replay socket beside it, or TensorRT-LLM's events URL; and
    the tenant its blocks count to where kvd keeps nothing under their hashes. `bind`: kvd
    binds the endpoint and the engine connects (vLLM connects to a plain tcp://HOST:PORT)."""

    __pydantic_config__ = SCHEMA
    name: Name
    endpoint: str = ""
    replay_endpoint: str = ""
    topic: str = ""
    bind: Flag = False
    tenant: str = ""
    # TensorRT-LLM instead: trtllm-serve's /kv_cache_events, polled every poll_s.
    url: str = ""
    poll_s: Positive = 0.1
    # Blocks kvd follows of this engine at most (GPU and offloaded alike): what it keeps is
    # bounded whatever the publisher sends (about 100 bytes a block).
    max_blocks: PositiveInt = 1 << 21

    def validate(self) -> None:
        if bool(self.url) == bool(self.endpoint):
            raise InvalidArgument(f"engine {self.name!r}: give either endpoint (vLLM, SGLang) "
                                  "or url (TensorRT-LLM's /kv_cache_events)")
        if self.url:
            if not self.url.startswith(("http://", "https://")):
                raise InvalidArgument(f"engine {self.name!r}: url must be http:// or "
                                      f"https:// (got {self.url!r})")
            return
        for key in ("endpoint", "replay_endpoint"):
            _check_zmq_endpoint(f"engine {self.name!r}: {key}", getattr(self, key))


def _check_unique(kind: str, names: list[str]) -> None:
    if len(set(names)) != len(names):
        raise InvalidArgument(f"{kind} names must be unique, got {names}")


def _check_zmq_endpoint(what: str, value: str) -> None:
    """InvalidArgument unless value is empty or a ZMQ endpoint kvd can bind or connect."""
    if value and not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise InvalidArgument(f"{what} must be tcp://, ipc:// or inproc:// (got {value!r})")


_RATE_KEYS = ("bandwidth_cap", "bandwidth_burst", "request_bandwidth_cap", "read_budget")


@with_config(SCHEMA)
class QuotaOverrides(TypedDict, total=False):
    """A tenant's quota keys under `[tenant.pools.NAME]`: they replace its defaults there."""

    weight: Weight
    guaranteed: Quota
    limit: Quota
    max_request_pages: QuotaPages
    max_request_fraction: Fraction
    bandwidth_cap: Size
    bandwidth_burst: Size
    request_bandwidth_cap: Size
    read_budget: Size


_QUOTA_KEYS = set(QuotaOverrides.__annotations__)


@with_config(SCHEMA)
class ClusterQuotaConfig(TypedDict, total=False):
    """A tenant's quota over the whole cluster (`[tenant.cluster]`), in every pool: pages of
    the pool, or bytes with a unit."""

    weight: Weight
    guaranteed: Quota
    limit: Quota  # 0: no cluster limit


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """`[cluster]`: the kvds of several nodes share tenants' quotas through etcd. Each kvd
    holds a lease on `PREFIX/nodes/NODE` and publishes its pools' figures under it every
    `reconcile_s`; a node whose lease lapses (`lease_ttl_s` without word) leaves the picture.
    `etcd = ""`: this kvd decides alone."""

    __pydantic_config__ = SCHEMA
    etcd: str = ""  # host:port of an etcd member (v3 API)
    node: str = ""  # this node's name in the cluster ("": the host name)
    prefix: str = "/kvd"
    lease_ttl_s: Annotated[float, Field(ge=2, le=300, strict=True)] = 10.0
    reconcile_s: Annotated[float, Field(gt=0, le=60, strict=True)] = 1.0
    timeout_s: Annotated[float, Field(gt=0, le=60, strict=True)] = 2.0  # one etcd call, at most

    def validate(self) -> None:
        if self.etcd:
            host, _, port = self.etcd.rpartition(":")
            if not host or not port.isdigit():
                raise InvalidArgument(f"[cluster] etcd: not HOST:PORT ({self.etcd!r})")
            if not self.prefix.startswith("/"):
                raise InvalidArgument("[cluster] prefix starts with /")
            if self.reconcile_s * 2 > self.lease_ttl_s:
                raise InvalidArgument("[cluster] reconcile_s must be at most half of "
                                      "lease_ttl_s (the lease is renewed at each reconcile)")


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """A tenant: who it is (a bearer token), and its quota in every pool (with per-pool
    overrides under `pools`). Sizes are pages, or bytes with a unit."""

    __pydantic_config__ = SCHEMA
    name: Name
    token: str = field(default="", repr=False)  # never logged
    weight: Weight = 1.0
    guaranteed: Quota = 0
    limit: Quota = 0  # 0: no limit
    max_request_pages: QuotaPages = 0
    max_request_fraction: Fraction = 0.0
    # Bytes per second (a number or "200MiB/s"; 0: none); see TenantQuota.
    bandwidth_cap: Size = 0
    bandwidth_burst: Size = 0
    request_bandwidth_cap: Size = 0
    read_budget: Size = 0
    # Whether the tenant's engines share prefix blocks with other tenants' (false: what
    # they store and look up is in a space of the tenant's own; see Authenticator).
    share_prefixes: Flag = True
    pools: dict[Name, QuotaOverrides] = field(default_factory=dict)
    cluster: ClusterQuotaConfig | None = None

    def cluster_quota(self, page_bytes: int):
        """Its quota over the cluster in pages of this size (None: it has none)."""
        from kvd.core.cluster import ClusterQuota

        if self.cluster is None:
            return None
        spec = self.cluster
        limit = pages_of(spec.get("limit", 0), page_bytes)
        return ClusterQuota(weight=float(spec.get("weight", self.weight)),
                            guaranteed=pages_of(spec.get("guaranteed", 0), page_bytes),
                            limit=limit or None)

    def quota_for(self, pool: str, page_bytes: int) -> TenantQuota:
        spec = {k: getattr(self, k) for k in _QUOTA_KEYS}
        spec.update(self.pools.get(pool, {}))
        limit = pages_of(spec["limit"], page_bytes)
        return TenantQuota(
            weight=float(spec["weight"]),
            guaranteed=pages_of(spec["guaranteed"], page_bytes),
            limit=limit or None,
            max_request_pages=int(spec["max_request_pages"]) or None,
            max_request_fraction=float(spec["max_request_fraction"]) or None,
            **{key: bytes_of(spec[key]) or None for key in _RATE_KEYS},
        )

    def validate(self, pools: tuple[PoolConfig, ...]) -> None:
        names = {p.name for p in pools}
        for pool in self.pools:
            if pool not in names:
                raise InvalidArgument(f"tenant {self.name!r}: no pool {pool!r}")
        for pool in pools:
            try:
                quota = self.quota_for(pool.name, pool.resolved_page_bytes)
            except InvalidArgument as exc:
                raise InvalidArgument(
                    f"tenant {self.name!r}, pool {pool.name!r}: {exc}") from None
            if quota.limit is not None and quota.guaranteed > quota.limit:
                raise InvalidArgument(
                    f"tenant {self.name!r}, pool {pool.name!r}: guaranteed "
                    f"({quota.guaranteed} pages) is above limit ({quota.limit} pages)")
            # The cluster's quota is pages of each pool too: the cluster's reconcile takes
            # it as the local quota is taken here.
            where = f"tenant {self.name!r}, pool {pool.name!r}: [tenant.cluster]"
            try:
                cluster = self.cluster_quota(pool.resolved_page_bytes)
            except InvalidArgument as exc:
                raise InvalidArgument(f"{where} {exc}") from None
            if (cluster is not None and cluster.limit is not None
                    and cluster.guaranteed > cluster.limit):
                raise InvalidArgument(f"{where} guaranteed ({cluster.guaranteed} pages) is above "
                                      f"limit ({cluster.limit} pages)")


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Who may call. A bearer token names a tenant (or the admin). grpcio does not expose a
    unix peer's uid, so unix-socket callers without a token act as `unix_tenant` (the
    socket's 0660 permissions are the gate); TCP callers must present a token."""

    __pydantic_config__ = SCHEMA
    admin_token: str = field(default="", repr=False)
    unix_tenant: str = "default"  # "": unix callers need a token too
    unix_admin: Flag = True  # unix callers may call admin


@dataclass(frozen=True, slots=True)
class Config:
    __pydantic_config__ = SCHEMA
    socket: SocketPath = DEFAULT_SOCKET
    socket_mode: FileMode = 0o660
    socket_group: str = ""  # the group engines run as ("": kvd's own)
    tcp: Address = ""  # host:port; empty = no TCP listener
    # TLS on the TCP listener (PEM files, relative to the config file): the server's
    # certificate and key, and a CA whose clients must present certificates (mTLS).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # Bearer tokens over TCP without TLS travel in clear: refused unless this says so.
    allow_plaintext_tokens: Flag = False
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    grace_s: NonNegative = 10.0
    workers: PositiveInt = 2  # copy threads
    inline_copy_bytes: Count = 65536  # smaller copies run on the event loop
    switch_interval_s: Positive = 0.0005  # CPython GIL switch interval (default 0.005)
    lease_ttl_s: Positive = 30.0  # a silent client's requests are released after this
    handoff_ttl_s: Positive = 60.0  # a decode reservation no handoff claimed lapses after this
    # Pages a reply hands to an engine stay put until the engine's next call, at most this
    # long (an engine that never calls again cannot keep them from others for ever).
    hold_s: Positive = 1.0
    # Unary calls of one client (its lease) that run at once; more wait their turn, so a
    # client flooding calls cannot crowd out the others. 0: no limit.
    max_calls_per_client: Count = 16
    # Streams (Step, WaitAdmission, WatchEvents, Handoff) one tenant keeps open at once;
    # past it a new one is refused: each open stream holds about 25 KiB of kvd's memory, and
    # a tenant opening them without end would run the node's daemon out of it. The admin
    # token's are not counted. 0: no limit.
    max_streams_per_tenant: Count = 4096
    # While tenants compete, the Step messages of one tenant kvd reads at once, times its
    # weight (at least 1): a tenant's flood of streams waits its turn. 0: no turns.
    step_turns_per_tenant: Count = 1
    # Work one call may ask for: its size on the wire, and its items (intent updates, block
    # indices, a Step's sections together). Sized for a large engine step.
    max_message_bytes: Annotated[int, Field(ge=4096, le=2**31 - 1, strict=True)] = 4 * 2**20
    max_items_per_call: PositiveInt = 1024  # intent updates, a Step's items (~5 ms of work)
    max_blocks_per_call: PositiveInt = 65536  # block indices (a 1M-token request's pages)
    # A call naming more blocks than this (an allocation, a free, a release, a reply's
    # handles, holds ending) is done that many at a time, the loop served between: about
    # a millisecond each, which is as long as such a call keeps other tenants' calls waiting.
    slice_blocks: PositiveInt = 256
    eviction_ledger: Count = 20_000  # eviction records kept per pool (bounded memory)
    explain_keep: Count = 2_000  # released requests Explain still knows, per pool
    metrics: Address = "127.0.0.1:9464"  # Prometheus exposition address; "" for none
    # A plaintext gRPC listener serving grpc.health.v1 only, for probes that speak neither
    # TLS nor unix sockets (Kubernetes' grpc: probes); "" for none.
    health: Address = ""
    # How often kvd checks its own bookkeeping (kvd_self_check_problems); 0: only on demand.
    self_check_s: NonNegative = 60.0
    # Python's full garbage collections walk every object kvd holds, its cached blocks too
    # (about a microsecond each, the loop stopped meanwhile). kvd sets aside what a long one
    # kept (kvd.gcwalk) and walks everything only this often; 0: Python's own collections.
    gc_full_walk_s: NonNegative = 600.0
    # kvd's own tiers as KV cache events in vLLM's and SGLang's format (kvd.tier_events):
    # the PUB endpoint kvd binds ("" for none) and the replay socket beside it.
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    pools: tuple[PoolConfig, ...] = field(default_factory=lambda: (PoolConfig(),))
    tenants: tuple[TenantConfig, ...] = ()
    links: tuple[LinkConfig, ...] = ()
    engines: tuple[EngineEventsConfig, ...] = ()
    auth: AuthConfig = field(default_factory=AuthConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    peers: tuple[PeerConfig, ...] = ()
    path: str = ""  # the file it came from (SIGHUP re-reads it)

    def validate(self) -> None:
        """Types and ranges (the schema), then what relates one part to another."""
        _checked(lambda: _CONFIG.validate_python(self))
        if not self.socket and not self.tcp:
            raise InvalidArgument("kvd needs a unix socket or a TCP address to listen on")
        if not self.pools:
            raise InvalidArgument("kvd needs at least one [[pool]]")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgument("tls_client_ca needs tls_cert and tls_key")
        if self.tls_cert and not self.tcp:
            raise InvalidArgument("TLS is for the TCP listener: set tcp too")
        _check_unique("pool", [p.name for p in self.pools])
        for pool in self.pools:
            pool.validate()
        _check_unique("tenant", [t.name for t in self.tenants])
        tokens = [t.token for t in self.tenants if t.token] + (
            [self.auth.admin_token] if self.auth.admin_token else [])
        if len(set(tokens)) != len(tokens):
            raise InvalidArgument("two identities share a token")
        for tenant in self.tenants:
            tenant.validate(self.pools)
        ends = [(link.source, link.target) for link in self.links]
        if len(set(ends)) != len(ends):
            raise InvalidArgument("two [[link]] entries join the same pools")
        _check_unique("peer", [p.name for p in self.peers])
        for peer in self.peers:
            peer.validate()
        for link in self.links:
            link.validate(self.pools, self.peers)
        for key in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            _check_zmq_endpoint(key, getattr(self, key))
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise InvalidArgument("kv_events_replay_endpoint needs kv_events_endpoint")
        _check_unique("engine", [e.name for e in self.engines])
        for engine in self.engines:
            engine.validate()
        self.cluster.validate()
        if any(t.cluster for t in self.tenants) and not self.cluster.etcd:
            raise InvalidArgument("[tenant.cluster] quotas need [cluster] etcd")


_CONFIG = TypeAdapter(Config)
# Where a schema error is, in the file's own words.
_SECTIONS = {"pools": "[[pool]]", "tenants": "[[tenant]]", "links": "[[link]]",
             "engines": "[[engine]]", "auth": "[auth]", "cluster": "[cluster]",
             "peers": "[[peer]]"}


def _where(loc: tuple) -> str:
    if loc and loc[0] in _SECTIONS:
        head, rest = _SECTIONS[loc[0]], loc[1:]
        if rest and isinstance(rest[0], int):
            head, rest = f"{head} #{rest[0] + 1}", rest[1:]
        return " ".join([head, ".".join(str(part) for part in rest)]).strip()
    return "[server] " + ".".join(str(part) for part in loc)


def _checked(validate: Callable[[], Any]) -> Any:
    """Run a schema validation; its errors as one line (an InvalidArgument)."""
    try:
        return validate()
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
                msg = "unknown key"
            elif "input" in err and not isinstance(err["input"], (dict, list, tuple)):
                msg += f" (got {_short(repr(err['input']))})"
            problems.append(f"{_where(tuple(err['loc']))}: {msg}")
        raise InvalidArgument("; ".join(problems)) from None


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


_SERVER_KEYS = set(Config.__dataclass_fields__) - {"pools", "tenants", "links", "engines",
                                                    "auth", "path", "cluster", "peers"}


def load_config(path: str | Path | None, create_tokens: bool = False,
                refuse_empty: bool = False) -> Config:
    """The config from a TOML file, or the embedded default when path is None.
    create_tokens: a token file the config names that does not exist yet is created (the
    daemon's start and reload; see _secret). refuse_empty: a file that sets nothing is an
    error (a reload: an editor or a deploy tool caught halfway through writing it would
    otherwise put every setting back to its default)."""
    if path is None:
        return Config()
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"cannot read config {path}: {exc}") from exc
    if refuse_empty and not data:
        raise InvalidArgument(f"config {path} sets nothing (is it still being written?)")
    return replace(config_from_dict(data, base=Path(path).parent, create_tokens=create_tokens),
                   path=str(path))


# Tokens kvd creates: 32 random bytes, URL-safe (43 characters).
TOKEN_BYTES = 32
# Token files created at this start or reload, (key, path, mode), for the log once it is set
# up (log_created_tokens).
CREATED_TOKENS: list[tuple[str, str, str]] = []


def log_created_tokens() -> None:
    while CREATED_TOKENS:
        key, path, mode = CREATED_TOKENS.pop(0)
        structlog.get_logger("kvd.config").warning(
            "created a token file at first start; give it to the callers it names",
            key=key, path=path, mode=mode)


def _secret(entry: dict, key: str, base: Path | None, create: bool = False,
            mode: int = 0o640, where: str = "") -> str:
    """A token given inline (`token`), in an environment variable (`token_env`: a Kubernetes
    Secret, a systemd credential), or in a file (`token_file`). A relative file is found
    beside the config, else in $STATE_DIRECTORY (systemd's StateDirectory=). With `create`,
    a file found in neither is created at first start with a new random token, beside the
    config if kvd may write there, else in $STATE_DIRECTORY, and the log says where."""
    given = [k for k in (key, f"{key}_env", f"{key}_file") if k in entry]
    if len(given) > 1:
        raise InvalidArgument(f"{where}{' and '.join(given)}: give one")
    env_key, file_key = f"{key}_env", f"{key}_file"
    if env_key in entry:
        name = str(entry.pop(env_key))
        value = os.environ.get(name, "").strip()
        if not value:
            raise InvalidArgument(f"{where}{env_key}: the environment variable {name} is "
                                  "not set")
        entry[key] = value
    elif file_key in entry:
        entry[key] = _token_from_file(Path(str(entry.pop(file_key))), f"{where}{file_key}",
                                      base, create, mode)
    return entry.get(key, "")


def _token_from_file(path: Path, file_key: str, base: Path | None, create: bool,
                     mode: int) -> str:
    places = [path] if path.is_absolute() else [
        (base or Path.cwd()) / path,
        *([Path(os.environ["STATE_DIRECTORY"]) / path] if os.environ.get("STATE_DIRECTORY")
          else [])]
    for place in places:
        try:
            return place.read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            continue
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"cannot read {file_key} {place}: {exc}") from exc
    if not create:
        raise InvalidArgument(f"cannot read {file_key} {places[0]}: no such file")
    token = secrets.token_urlsafe(TOKEN_BYTES)
    problems = []
    for place in places:
        try:
            place.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(place, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except OSError as exc:
            problems.append(f"{place}: {exc.strerror}")
            continue
        with os.fdopen(fd, "w") as out:
            out.write(token + "\n")
        CREATED_TOKENS.append((file_key, str(place), oct(mode)))
        return token
    raise InvalidArgument(
        f"{file_key} {places[0]} does not exist and kvd cannot create it "
        f"({'; '.join(problems)}): create it (any secret string), run kvd where it may write "
        "there or with $STATE_DIRECTORY set, or give the token in an environment variable "
        f"with {file_key.rsplit(' ', 1)[-1].removesuffix('_file')}_env")


def _entries(data: dict, section: str) -> list[dict]:
    entries = data.get(section, [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise InvalidArgument(f"[[{section}]] is a list of tables: write [[{section}]] above "
                              "each entry")
    return [dict(e) for e in entries]


def config_from_dict(data: dict[str, Any], base: Path | None = None,
                     create_tokens: bool = False) -> Config:
    unknown = set(data) - {"server", "pool", "tenant", "auth", "link", "engine", "cluster",
                           "peer"}
    if unknown:
        raise InvalidArgument(f"unknown config sections: {', '.join(sorted(unknown))}")
    server = data.get("server", {})
    auth = data.get("auth", {})
    if not isinstance(server, dict) or not isinstance(auth, dict):
        raise InvalidArgument("[server] and [auth] are tables")
    unknown = set(server) - _SERVER_KEYS
    if unknown:
        raise InvalidArgument(f"unknown [server] keys: {', '.join(sorted(unknown))}")
    tenants = _entries(data, "tenant")
    for entry in tenants:
        # A tenant's engines read its token: the group (the engines') may read it.
        _secret(entry, "token", base, create_tokens, 0o640,
                f"[[tenant]] {entry.get('name', '')!r}: ")
    auth = dict(auth)
    _secret(auth, "admin_token", base, create_tokens, 0o600, "[auth] ")
    peers = _entries(data, "peer")
    for entry in peers:
        _secret(entry, "token", base, where=f"[[peer]] {entry.get('name', '')!r}: ")
        for key in ("tls_ca", "tls_cert", "tls_key"):
            if isinstance(entry.get(key), str) and entry[key] and base is not None:
                entry[key] = str(base / entry[key])
    pools = _entries(data, "pool") if "pool" in data else [{}]
    server = dict(server)
    for key in ("tls_cert", "tls_key", "tls_client_ca"):
        if isinstance(server.get(key), str) and server[key] and base is not None:
            server[key] = str(base / server[key])  # absolute stays absolute
    config = _checked(lambda: _CONFIG.validate_python({
        **server, "pools": pools, "tenants": tenants, "links": _entries(data, "link"),
        "engines": _entries(data, "engine"), "auth": auth,
        "cluster": data.get("cluster", {}), "peers": peers}))
    config.validate()
    return config


def override_default_pool(config: Config, **changes: Any) -> Config:
    """Apply flag overrides to the first pool (flags describe the single-pool case)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    if not changes:
        return config
    first, *rest = config.pools
    return replace(config, pools=(replace(first, **changes), *rest))
