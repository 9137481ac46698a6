"""The settings kvd's engine adapters read from the engine's own config (vLLM's
`kv_connector_extra_config`, SGLang's storage `extra_config`), typed and range-checked as
kvd's own config is: a wrong one stops the engine's start with one line naming it, where
`float()` took a negative timeout (every call then failed, and the engine ran without kvd,
saying nothing), a slice of -5 pages (nothing stored) or a policy vLLM does not have. Keys
that do not start with `kvd_` are the engine's own and left alone; a `kvd_` key the adapter
does not know is a typo, and refused."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

# Numbers must be numbers ("2" is not 2 s, true is not 1) and finite.
Seconds = Annotated[float, Field(gt=0, strict=True)]
SecondsOrNone = Annotated[float, Field(ge=0, strict=True)]


class AdapterSettings(BaseModel):
    """What every adapter takes: where kvd is, who it is to kvd, and how long to wait."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)
    kvd_target: StrictStr | None = None  # None: $KVD_TARGET, else kvd's systemd socket
    kvd_token: StrictStr | None = None
    kvd_token_file: StrictStr | None = None
    kvd_timeout_s: Seconds = 2.0
    kvd_retry_s: SecondsOrNone = 1.0  # after a call kvd did not answer, calls skip kvd
    kvd_pool: StrictStr = ""
    kvd_tenant: StrictStr = ""

    def token(self) -> str | None:
        """`kvd_token`, else the contents of `kvd_token_file` (ValueError naming it when it
        cannot be read), else None ($KVD_TOKEN)."""
        if self.kvd_token is not None or not self.kvd_token_file:
            return self.kvd_token
        try:
            return Path(self.kvd_token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"kvd_token_file {self.kvd_token_file}: cannot read it: "
                             f"{exc.strerror}") from None


class VllmSettings(AdapterSettings):
    kvd_save_output: StrictBool = False
    kvd_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    kvd_tenants: Any = None  # read by vllm_connector.allowed_tenants
    kvd_queue_poll_s: Seconds = 0.05
    kvd_lookup_again_s: SecondsOrNone = 0.5


class SglangSettings(AdapterSettings):
    kvd_timeout_s: Seconds = 5.0
    kvd_namespace: StrictStr | None = None
    kvd_slice_pages: Annotated[int, Field(ge=0, strict=True)] = 0  # 0: from kvd's device tier


def read_settings(kind: type[AdapterSettings], extra: Mapping[str, Any] | None,
                  where: str) -> AdapterSettings:
    """The adapter's settings among the engine's `extra` config (`where` names it in an
    error): ValueError, one line naming each bad key, when one is wrong."""
    ours = {k: v for k, v in (extra or {}).items() if isinstance(k, str) and k.startswith("kvd_")}
    try:
        return kind.model_validate(ours)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"])
            if err["type"] == "extra_forbidden":
                problems.append(f"{key}: not a setting of this adapter (it takes "
                                f"{', '.join(kind.model_fields)})")
            else:
                problems.append(f"{key}: {err['msg']} (got {err['input']!r})")
        raise ValueError(f"{where}: {'; '.join(problems)}") from None
