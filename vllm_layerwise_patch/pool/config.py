"""``kv_connector_extra_config`` of the LayerwisePoolConnector: a pydantic
model (pydantic comes with vLLM) with unknown fields forbidden, validated at
startup; every error names ``kv_connector_extra_config.<field>``.

Sizes are an integer number of bytes or a string with a unit spelled exactly:
decimal ``kB``/``MB``/``GB``/``TB`` (powers of 1000) or binary
``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024).  ``"4GiB"`` is 4 294 967 296
bytes, ``"4GB"`` is 4 000 000 000.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

PREFIX = "kv_connector_extra_config"

_UNITS = {"B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

#: debug_backend_fault values: the backend operation that raises (tests)
FAULTS = ("", "lookup", "load", "save")


class PoolConfigError(ValueError):
    pass


def parse_size(value: Any) -> int:
    """Bytes from an int or a string with an exactly spelled unit."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if m is None or m.group(2) not in _UNITS:
            raise ValueError(
                f"cannot read size {value!r}: a number of bytes or a number with one "
                f"of the units {', '.join(_UNITS)} (e.g. '4GiB', '512MiB', '8GB')")
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    else:
        raise ValueError(f"expected a size, got {value!r}")
    if n <= 0:
        raise ValueError(f"must be > 0, got {value!r}")
    return n


def default_path() -> str:
    """Per user: ``/dev/shm/vllm-layerwise-pool-<uid>`` (tmpfs: RAM), or
    ``~/.cache/vllm-layerwise-pool`` where there is no /dev/shm."""
    if os.path.isdir("/dev/shm"):
        return os.path.join("/dev/shm", f"vllm-layerwise-pool-{os.geteuid()}")
    return os.path.join(os.path.expanduser("~"), ".cache", "vllm-layerwise-pool")


class PoolConfig(BaseModel):
    """The pool connector's settings (README: "kv_connector_extra_config")."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    backend: Literal["lmdb"] = "lmdb"
    path: str = Field(default_factory=default_path, min_length=1)
    capacity: int = 4 << 30
    # a group whose members share the pool (0770/0660); None: private (0700/0600)
    shared_group: str | None = Field(default=None, min_length=1)
    prefetch_layers: int = Field(default=2, ge=1, le=64)
    load_threads: int = Field(default=2, ge=1, le=32)
    pin_seconds: float = Field(default=30.0, ge=0)
    verify_on_lookup: bool = True
    namespace_salt: str = ""
    # debug only: leave mamba state pages out of loads (negative-control tests)
    debug_skip_mamba_load: bool = False
    # debug only: the first load of this layer fails (load-failure tests)
    debug_fail_load_layer: str = ""
    # debug only (negative control): failed loads are zeroed, not reported
    debug_hide_load_errors: bool = False
    # debug only: every layer's load takes this long (ordering under slow loads)
    debug_load_delay_ms: float = Field(default=0.0, ge=0, le=60_000)
    # debug only (negative control): the deferred mamba copy of a layer runs
    # before that layer's load has completed
    debug_copy_before_wait: bool = False
    # debug only: this backend operation raises (fault-handling tests)
    debug_backend_fault: Literal["", "lookup", "load", "save"] = ""
    # debug only (negative control): every TP rank loads this rank's pages
    debug_load_tp_rank: int = Field(default=-1, ge=-1)

    @field_validator("capacity", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)

    @field_validator("pin_seconds", "debug_load_delay_ms", mode="before")
    @classmethod
    def _seconds(cls, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"expected a number, got {v!r}")
        return float(v)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> PoolConfig:
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            raise PoolConfigError(_describe(exc)) from None

    @classmethod
    def field_names(cls) -> list[str]:
        return list(cls.model_fields)


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(root)"
        if err["type"] == "extra_forbidden":
            msg = (f"unknown field (known: {', '.join(PoolConfig.field_names())})")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if "input" in err and err["type"] != "missing":
                msg += f" (got {err['input']!r})"
        lines.append(f"{PREFIX}.{field}: {msg}")
    return "; ".join(lines)
