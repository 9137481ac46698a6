"""kvd's configuration: a TOML file (/etc/kvd/kvd.toml when installed), overridable by flags.

With neither, kvd runs its embedded default: one pool on host memory, a unix socket.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvd.core.errors import InvalidArgument
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


@dataclass(frozen=True, slots=True)
class Config:
    socket: str = DEFAULT_SOCKET
    tcp: str = ""  # host:port; empty = no TCP listener
    log_format: str = "auto"  # auto | json | console
    log_level: str = "info"
    grace_s: float = 10.0
    workers: int = 2  # copy threads
    inline_copy_bytes: int = 65536  # smaller copies run on the event loop
    pools: tuple[PoolConfig, ...] = field(default_factory=lambda: (PoolConfig(),))

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


_SERVER_KEYS = {"socket", "tcp", "log_format", "log_level", "grace_s", "workers",
                "inline_copy_bytes"}
_POOL_KEYS = set(PoolConfig.__dataclass_fields__)


def load_config(path: str | Path | None) -> Config:
    """The config from a TOML file, or the embedded default when path is None."""
    if path is None:
        return Config()
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgument(f"cannot read config {path}: {exc}") from exc
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> Config:
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
    config = Config(**server, pools=tuple(pools))
    config.validate()
    return config


def override_default_pool(config: Config, **changes: Any) -> Config:
    """Apply flag overrides to the first pool (flags describe the single-pool case)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    if not changes:
        return config
    first, *rest = config.pools
    return replace(config, pools=(replace(first, **changes), *rest))
