"""kvd's configuration: a TOML file (/etc/kvd/kvd.toml when installed), overridable by flags.

With neither, kvd runs its embedded default: one pool on host memory, a unix socket.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvd.core.errors import InvalidArgument
from kvd.core.fairness import TenantQuota
from kvd.core.policies import policy_names


@dataclass(frozen=True, slots=True)
class ModelPreset:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        # K and V for every layer and head.
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes


MODEL_PRESETS: dict[str, ModelPreset] = {
    "llama-3-8b": ModelPreset(32, 8, 128, 2),
    "llama-3-70b": ModelPreset(80, 8, 128, 2),
    "mistral-7b": ModelPreset(32, 8, 128, 2),
    "qwen2-7b": ModelPreset(28, 4, 128, 2),
    # A toy model for tests and demos: 1 KiB per token.
    "tiny": ModelPreset(2, 2, 64, 2),
}

DEFAULT_SOCKET = "/run/kvd/kvd.sock"


@dataclass(frozen=True, slots=True)
class PoolConfig:
    name: str = "default"
    model: str = "llama-3-8b"
    block_tokens: int = 16
    page_bytes: int = 0  # 0: block_tokens x the model's bytes per token
    device_pages: int = 64
    host_pages: int = 256
    policy: str = "lru"
    device_backend: str = "auto"  # auto | cupy | host
    gpu: int = 0
    max_queue: int = 1024
    # The device<->host link: capacity ("auto": measured at start), burst (0: 5 ms of
    # capacity, at least two chunks), the largest piece a transfer is copied in ("auto": half
    # a millisecond of capacity, 64 KiB to 4 MiB, at least a page), how transfers
    # share it ("fair": classes, weights, caps; "fifo": arrival order, no budgets), and how
    # long a transfer waits before it is served as if one class higher.
    link_bandwidth: int | str = "auto"
    link_burst: int | str = 0
    link_chunk: int | str = "auto"
    link_scheduling: str = "fair"
    link_aging_ms: float = 50.0

    @property
    def resolved_page_bytes(self) -> int:
        if self.page_bytes:
            return self.page_bytes
        return self.block_tokens * MODEL_PRESETS[self.model].bytes_per_token

    def validate(self) -> None:
        if not self.name:
            raise InvalidArgument("a pool needs a name")
        if self.model not in MODEL_PRESETS and not self.page_bytes:
            raise InvalidArgument(
                f"pool {self.name!r}: unknown model {self.model!r}; choose one of "
                f"{', '.join(sorted(MODEL_PRESETS))} or set page_bytes"
            )
        for key in ("block_tokens", "device_pages"):
            if getattr(self, key) <= 0:
                raise InvalidArgument(f"pool {self.name!r}: {key} must be positive")
        if self.host_pages < 0 or self.page_bytes < 0:
            raise InvalidArgument(f"pool {self.name!r}: sizes must be >= 0")
        if self.policy not in policy_names():
            raise InvalidArgument(
                f"pool {self.name!r}: unknown policy {self.policy!r}; choose one of "
                f"{', '.join(policy_names())}"
            )
        if self.device_backend not in ("auto", "cupy", "host"):
            raise InvalidArgument(f"pool {self.name!r}: device_backend is auto, cupy or host")
        _check_link(f"pool {self.name!r}", self.link_bandwidth, self.link_burst,
                    self.link_scheduling, self.link_aging_ms)
        if self.link_chunk != "auto" and bytes_of(self.link_chunk) <= 0:
            raise InvalidArgument(f"pool {self.name!r}: link_chunk must be positive or 'auto'")


def _check_link(where: str, bandwidth, burst, scheduling: str, aging_ms: float) -> None:
    if bandwidth != "auto" and bytes_of(bandwidth) <= 0:
        raise InvalidArgument(f"{where}: link bandwidth must be positive or 'auto'")
    bytes_of(burst)
    if scheduling not in ("fair", "fifo"):
        raise InvalidArgument(f"{where}: link scheduling is fair or fifo, got {scheduling!r}")
    if aging_ms <= 0:
        raise InvalidArgument(f"{where}: link aging must be positive")


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """A pool->pool link for handoff (`[[link]]` with source and target pools)."""

    source: str
    target: str
    bandwidth: int | str = "auto"
    burst: int | str = 0
    chunk: int | str = "auto"
    scheduling: str = "fair"
    aging_ms: float = 50.0

    def validate(self, pools: tuple[PoolConfig, ...]) -> None:
        names = {p.name for p in pools}
        for end in (self.source, self.target):
            if end not in names:
                raise InvalidArgument(f"link {self.source}->{self.target}: no pool {end!r}")
        if self.source == self.target:
            raise InvalidArgument(f"link {self.source}->{self.target}: a link joins two pools")
        _check_link(f"link {self.source}->{self.target}", self.bandwidth, self.burst,
                    self.scheduling, self.aging_ms)
        if self.chunk != "auto" and bytes_of(self.chunk) <= 0:
            raise InvalidArgument(f"link {self.source}->{self.target}: chunk must be positive")


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def bytes_of(value: int | float | str) -> float:
    """A size or a rate in bytes: a number, or a string with a unit ("200MiB", "1.5GB/s")."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidArgument(f"a size is bytes (a number) or a string like '200MiB/s', "
                              f"got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise InvalidArgument(f"a size must be >= 0, got {value}")
        return float(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*(?:/\s*s)?\s*", value)
    unit = (match.group(2) or "b").lower() if match else ""
    if not match or unit not in _UNITS:
        raise InvalidArgument(f"cannot read {value!r} as bytes; use e.g. 200MiB or 1GB/s")
    return float(match.group(1)) * _UNITS[unit]


def pages_of(value: int | str, page_bytes: int) -> int:
    """A quota in pages: an int is pages; a string is bytes with a unit ("512MiB", "2GB"),
    rounded up to whole pages."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"a quota is pages (int) or bytes ('512MiB'), got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"a quota must be >= 0, got {value}")
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"cannot read {value!r} as a size; use e.g. 512MiB or 2GB")
    return math.ceil(float(match.group(1)) * _UNITS[match.group(2).lower()] / page_bytes)


_QUOTA_KEYS = {"weight", "guaranteed", "limit", "max_request_pages", "max_request_fraction",
               "bandwidth_cap", "bandwidth_burst", "request_bandwidth_cap", "read_budget"}
_RATE_KEYS = ("bandwidth_cap", "bandwidth_burst", "request_bandwidth_cap", "read_budget")


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """A tenant: who it is (a bearer token), and its quota in every pool (with per-pool
    overrides under `pools`). Sizes are pages, or bytes with a unit."""

    name: str
    token: str = field(default="", repr=False)  # never logged
    weight: float = 1.0
    guaranteed: int | str = 0
    limit: int | str = 0  # 0: no limit
    max_request_pages: int = 0
    max_request_fraction: float = 0.0
    # Bytes per second (a number or "200MiB/s"; 0: none); see TenantQuota.
    bandwidth_cap: int | str = 0
    bandwidth_burst: int | str = 0
    request_bandwidth_cap: int | str = 0
    read_budget: int | str = 0
    pools: dict = field(default_factory=dict)

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
        if not self.name:
            raise InvalidArgument("a tenant needs a name")
        if self.weight <= 0:
            raise InvalidArgument(f"tenant {self.name!r}: weight must be positive")
        if not 0 <= self.max_request_fraction <= 1:
            raise InvalidArgument(f"tenant {self.name!r}: max_request_fraction is 0..1")
        names = {p.name for p in pools}
        for pool, overrides in self.pools.items():
            if pool not in names:
                raise InvalidArgument(f"tenant {self.name!r}: no pool {pool!r}")
            unknown = set(overrides) - _QUOTA_KEYS
            if unknown:
                raise InvalidArgument(f"tenant {self.name!r}, pool {pool!r}: unknown keys "
                                      f"{', '.join(sorted(unknown))}")
        for pool in pools:
            self.quota_for(pool.name, pool.resolved_page_bytes)  # sizes parse


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Who may call. A bearer token names a tenant (or the admin). grpcio does not expose a
    unix peer's uid, so unix-socket callers without a token act as `unix_tenant` (the
    socket's 0660 permissions are the gate); TCP callers must present a token."""

    admin_token: str = field(default="", repr=False)
    unix_tenant: str = "default"  # "": unix callers need a token too
    unix_admin: bool = True  # unix callers without a token may call the admin service


@dataclass(frozen=True, slots=True)
class Config:
    socket: str = DEFAULT_SOCKET
    socket_mode: int = 0o660  # who may connect: the owner and the socket's group
    socket_group: str = ""  # the group engines run as ("": kvd's own)
    tcp: str = ""  # host:port; empty = no TCP listener
    log_format: str = "auto"  # auto | json | console
    log_level: str = "info"
    grace_s: float = 10.0
    workers: int = 2  # copy threads
    inline_copy_bytes: int = 65536  # smaller copies run on the event loop
    switch_interval_s: float = 0.0005  # CPython GIL switch interval (default 0.005)
    lease_ttl_s: float = 30.0  # a silent client's requests are released after this
    handoff_ttl_s: float = 60.0  # a decode reservation no handoff claimed lapses after this
    # Pages a reply hands to an engine stay put until the engine's next call, at most this
    # long (an engine that never calls again cannot keep them from others for ever).
    hold_s: float = 1.0
    # Unary calls of one client (its lease) that run at once; more wait their turn, so a
    # client flooding calls cannot crowd out the others. 0: no limit.
    max_calls_per_client: int = 16
    eviction_ledger: int = 20_000  # eviction records kept per pool (bounded memory)
    explain_keep: int = 2_000  # released requests Explain still knows, per pool
    metrics: str = "127.0.0.1:9464"  # Prometheus exposition address; "" for none
    pools: tuple[PoolConfig, ...] = field(default_factory=lambda: (PoolConfig(),))
    tenants: tuple[TenantConfig, ...] = ()
    links: tuple[LinkConfig, ...] = ()
    auth: AuthConfig = field(default_factory=AuthConfig)
    path: str = ""  # the file it came from (SIGHUP re-reads it)

    def validate(self) -> None:
        if not self.socket and not self.tcp:
            raise InvalidArgument("kvd needs a unix socket or a TCP address to listen on")
        if self.log_format not in ("auto", "json", "console"):
            raise InvalidArgument("log_format is auto, json or console")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"pool names must be unique, got {names}")
        for pool in self.pools:
            pool.validate()
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"tenant names must be unique, got {names}")
        tokens = [t.token for t in self.tenants if t.token] + (
            [self.auth.admin_token] if self.auth.admin_token else [])
        if len(set(tokens)) != len(tokens):
            raise InvalidArgument("two identities share a token")
        for tenant in self.tenants:
            tenant.validate(self.pools)
        ends = [(link.source, link.target) for link in self.links]
        if len(set(ends)) != len(ends):
            raise InvalidArgument("two [[link]] entries join the same pools")
        for link in self.links:
            link.validate(self.pools)
        if self.handoff_ttl_s <= 0:
            raise InvalidArgument("handoff_ttl_s must be positive")
        if not self.hold_s > 0:
            raise InvalidArgument("hold_s must be positive")
        if self.max_calls_per_client < 0:
            raise InvalidArgument("max_calls_per_client must be >= 0 (0: no limit)")


_SERVER_KEYS = {"socket", "socket_mode", "socket_group", "tcp", "log_format", "log_level", "grace_s", "workers",
                "inline_copy_bytes", "switch_interval_s", "lease_ttl_s", "handoff_ttl_s", "hold_s", "metrics",
                "max_calls_per_client",
                "eviction_ledger", "explain_keep"}
_POOL_KEYS = set(PoolConfig.__dataclass_fields__)


def load_config(path: str | Path | None) -> Config:
    """The config from a TOML file, or the embedded default when path is None."""
    if path is None:
        return Config()
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgument(f"cannot read config {path}: {exc}") from exc
    return replace(config_from_dict(data, base=Path(path).parent), path=str(path))


def _secret(entry: dict, key: str, base: Path | None) -> str:
    """A token given inline (`token`) or in a file (`token_file`, relative to the config)."""
    file_key = f"{key}_file"
    if file_key in entry:
        path = Path(entry.pop(file_key))
        if base is not None and not path.is_absolute():
            path = base / path
        try:
            entry[key] = path.read_text().strip()
        except OSError as exc:
            raise InvalidArgument(f"cannot read {file_key} {path}: {exc}") from exc
    return entry.get(key, "")


def config_from_dict(data: dict[str, Any], base: Path | None = None) -> Config:
    unknown = set(data) - {"server", "pool", "tenant", "auth", "link"}
    if unknown:
        raise InvalidArgument(f"unknown config sections: {', '.join(sorted(unknown))}")
    server = data.get("server", {})
    unknown = set(server) - _SERVER_KEYS
    if unknown:
        raise InvalidArgument(f"unknown [server] keys: {', '.join(sorted(unknown))}")
    pools = []
    for entry in data.get("pool", [{}]):
        unknown = set(entry) - _POOL_KEYS
        if unknown:
            raise InvalidArgument(f"unknown [[pool]] keys: {', '.join(sorted(unknown))}")
        pools.append(PoolConfig(**entry))
    tenants = []
    for entry in data.get("tenant", []):
        entry = dict(entry)
        _secret(entry, "token", base)
        unknown = set(entry) - set(TenantConfig.__dataclass_fields__)
        if unknown:
            raise InvalidArgument(f"unknown [[tenant]] keys: {', '.join(sorted(unknown))}")
        tenants.append(TenantConfig(**entry))
    links = []
    for entry in data.get("link", []):
        unknown = set(entry) - set(LinkConfig.__dataclass_fields__)
        if unknown:
            raise InvalidArgument(f"unknown [[link]] keys: {', '.join(sorted(unknown))}")
        try:
            links.append(LinkConfig(**entry))
        except TypeError as exc:
            raise InvalidArgument(f"[[link]] needs source and target pools: {exc}") from exc
    auth = dict(data.get("auth", {}))
    _secret(auth, "admin_token", base)
    unknown = set(auth) - set(AuthConfig.__dataclass_fields__)
    if unknown:
        raise InvalidArgument(f"unknown [auth] keys: {', '.join(sorted(unknown))}")
    try:
        config = Config(**server, pools=tuple(pools), tenants=tuple(tenants),
                        links=tuple(links), auth=AuthConfig(**auth))
    except TypeError as exc:
        raise InvalidArgument(f"bad config value: {exc}") from exc
    config.validate()
    return config


def override_default_pool(config: Config, **changes: Any) -> Config:
    """Apply flag overrides to the first pool (flags describe the single-pool case)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    if not changes:
        return config
    first, *rest = config.pools
    return replace(config, pools=(replace(first, **changes), *rest))
