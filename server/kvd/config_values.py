"""The values config keys are checked against: sizes and rates with units, quotas in pages
or bytes, addresses, policy names, file modes; and the model presets a pool's page size can
be named by. Each is typed and range-checked by pydantic: numbers must be numbers ("30" is
not 30), finite, and in range; sizes and rates are numbers of bytes or strings with a unit.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field

from kvd.core.errors import InvalidArgument
from kvd.core.fairness import MAX_QUOTA_PAGES, MAX_WEIGHT, MIN_WEIGHT
from kvd.core.policies import accepted_policy_names
from kvd_client.client import NOT_UTF8, is_utf8, socket_path_problem


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


def _size(value: Any) -> Any:
    try:
        bytes_of(value)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None
    return value


def _positive_size_or_auto(value: Any) -> Any:
    if value != "auto" and bytes_of(_size(value)) <= 0:
        raise ValueError("must be a positive size, or 'auto'")
    return value


def _quota(value: Any) -> Any:
    try:
        pages_of(value, 1, bounded=False)  # in pages of the pool's size: see quota_for
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None
    return value


def _address(value: str) -> str:
    """"" (none) or HOST:PORT with an explicit port (a missing one is not 443)."""
    if value == "":
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT with a port in 0..65535")
    if not is_utf8(value):
        raise ValueError("an address is UTF-8 text, and this one is not")
    return value


def _socket_path(value: str) -> str:
    """"" (none) or a path a unix socket can be bound at, as written (relative to where kvd
    starts): no NUL in it, and no longer than the kernel's address holds."""
    if "\0" in value:
        raise ValueError("a path may not hold a NUL character")
    if not is_utf8(value):
        raise ValueError(NOT_UTF8.format("a socket's path"))
    if problem := socket_path_problem(value):
        raise ValueError(f"{problem}: put it in a shorter directory (e.g. /run/kvd)")
    return value


def _policy(value: str) -> str:
    if value not in accepted_policy_names():
        raise ValueError(f"unknown policy {value!r}; choose one of "
                         f"{', '.join(accepted_policy_names())}")
    return value


def _mode(value: int) -> int:
    if not 0 <= value <= 0o777:
        raise ValueError(f"{value} is not a file mode; write it in octal, e.g. 0o660")
    return value


_STRICT = {"strict": True}
PositiveInt = Annotated[int, Field(gt=0, **_STRICT)]
Count = Annotated[int, Field(ge=0, **_STRICT)]
QuotaPages = Annotated[int, Field(ge=0, le=MAX_QUOTA_PAGES, **_STRICT)]
Positive = Annotated[float, Field(gt=0, **_STRICT)]  # seconds, milliseconds
Weight = Annotated[float, Field(ge=MIN_WEIGHT, le=MAX_WEIGHT, **_STRICT)]
# A link's aging step: a microsecond at least (in seconds, a smaller one may come to 0).
AgingMs = Annotated[float, Field(ge=0.001, **_STRICT)]
NonNegative = Annotated[float, Field(ge=0, **_STRICT)]
Fraction = Annotated[float, Field(ge=0, le=1, **_STRICT)]
Flag = Annotated[bool, Field(**_STRICT)]  # true or false: not "no", 0 or "yes"
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
# A number of bytes, or a string with a unit; true or false is neither (a lax int would
# take true for 1).
_Bytes = Annotated[int, Field(**_STRICT)] | Annotated[float, Field(**_STRICT)] | str
Size = Annotated[_Bytes, AfterValidator(_size)]
PositiveSizeOrAuto = Annotated[_Bytes, AfterValidator(_positive_size_or_auto)]
Quota = Annotated[Annotated[int, Field(strict=True)] | str, AfterValidator(_quota)]
Address = Annotated[str, AfterValidator(_address)]
SocketPath = Annotated[str, AfterValidator(_socket_path)]
PolicyName = Annotated[str, AfterValidator(_policy)]
FileMode = Annotated[int, Field(strict=True), AfterValidator(_mode)]
# Extra keys are typos; dataclass instances built in code are checked again by validate().
SCHEMA = ConfigDict(extra="forbid", allow_inf_nan=False, revalidate_instances="always")


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def bytes_of(value: int | float | str) -> float:
    """A size or a rate in bytes: a number, or a string with a unit ("200MiB", "1.5GB/s")."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidArgument(f"a size is bytes (a number) or a string like '200MiB/s', "
                              f"got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"a size must be a finite number >= 0, got {value}")
        return float(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*(?:/\s*s)?\s*", value)
    unit = (match.group(2) or "b").lower() if match else ""
    if not match or unit not in _UNITS:
        raise InvalidArgument(f"cannot read {value!r} as bytes; use e.g. 200MiB or 1GB/s")
    return float(match.group(1)) * _UNITS[unit]


def pages_of(value: int | str, page_bytes: int, bounded: bool = True) -> int:
    """A quota in pages: an int is pages; a string is bytes with a unit ("512MiB", "2GB"),
    rounded up to whole pages. `bounded`: at most MAX_QUOTA_PAGES (what kvd reports)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"a quota is pages (int) or bytes ('512MiB'), got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"a quota must be >= 0, got {value}")
        pages = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise InvalidArgument(f"cannot read {value!r} as a size; use e.g. 512MiB or 2GB")
        pages = math.ceil(float(match.group(1)) * _UNITS[match.group(2).lower()] / page_bytes)
    if bounded:
        check_quota_pages(pages, value if isinstance(value, str) else None, page_bytes)
    return pages


def check_quota_pages(pages: int, size: str | int | None = None, page_bytes: int = 0) -> None:
    """Refuse a quota of more pages than kvd counts (see MAX_QUOTA_PAGES); `size`: the bytes
    it was given in, if it was."""
    if pages > MAX_QUOTA_PAGES:
        given = (f"{pages} pages" if size is None else
                 f"{size if isinstance(size, str) else f'{size} bytes'} is {pages} pages of "
                 f"{page_bytes} bytes")
        raise InvalidArgument(f"a quota of {given}: at most {MAX_QUOTA_PAGES} pages "
                              "(a limit of 0 is none)")
