"""``kv_connector_extra_config`` of the LayerwisePoolConnector: a pydantic
model (pydantic comes with vLLM) with unknown fields forbidden, validated at
startup; every error names ``kv_connector_extra_config.<field>``.

Sizes are an integer number of bytes or a string with a unit spelled exactly:
decimal ``kB``/``MB``/``GB``/``TB`` (powers of 1000) or binary
``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024).  ``"4GiB"`` is 4 294 967 296
bytes, ``"4GB"`` is 4 000 000 000.
"""

from __future__ import annotations

import json
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

    backend: Literal["lmdb"] = Field(
        default="lmdb", description="storage backend: `lmdb` (embedded, one machine)")
    path: str = Field(
        default_factory=default_path, min_length=1,
        description="pool directory; the default is per user "
                    "(`/dev/shm/vllm-layerwise-pool-<uid>`, tmpfs: RAM)")
    capacity: int = Field(
        default=4 << 30,
        description="maximum pool size: bytes or a size with an exact unit (`512MiB`, "
                    "`8GiB`, `1TiB`; `GB` = 10^9); least recently used blocks are "
                    "evicted; the filesystem under `path` must hold it")
    shared_group: str | None = Field(
        default=None, min_length=1,
        description="a group whose members share the pool (directory 2770, files 0660 "
                    "of that group); unset: private to this user (0700/0600)")
    prefetch_layers: int = Field(default=2, ge=1, le=64,
                                 description="layers loaded ahead of compute")
    load_threads: int = Field(default=2, ge=1, le=32, description="load threads per worker")
    pin_seconds: float = Field(
        default=30.0, ge=0,
        description="longest a pending load pins what it reads against eviction (pins "
                    "are released when the load is done; this bounds them if an engine "
                    "dies)")
    verify_on_lookup: bool = Field(
        default=True,
        description="read and check (length, crc32, namespace) every entry of a hit "
                    "before reporting it")
    namespace_salt: str = Field(
        default="", description="extra namespace text (engines with different salts never "
                                "share entries)")
    debug_skip_mamba_load: bool = Field(
        default=False, description="tests only: leave the state pages out of loads (shows "
                                   "a wrong state changes tokens)")
    debug_fail_load_layer: str = Field(
        default="", description="tests only: this layer's first load fails (shows a "
                                "failed load recomputes)")
    debug_hide_load_errors: bool = Field(
        default=False, description="tests only: zero failed loads without reporting them "
                                   "(shows a missed recompute changes tokens)")
    debug_load_delay_ms: float = Field(
        default=0.0, ge=0, le=60_000,
        description="tests only: every layer's load takes this long (loads still in "
                    "flight when the forward reaches the layer)")
    debug_copy_before_wait: bool = Field(
        default=False, description="tests only: run a layer's deferred state copy before "
                                   "its load completes (shows the order matters)")
    debug_backend_fault: Literal["", "lookup", "load", "save"] = Field(
        default="", description="tests only: this backend operation raises (shows a "
                                "fault is a miss, a recompute or a skipped save)")
    debug_load_tp_rank: int = Field(
        default=-1, ge=-1, description="tests only: every TP rank loads this rank's pages "
                                       "(shows ranks' pages differ)")

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

    @classmethod
    def markdown_table(cls) -> str:
        """The README's table of fields (scripts/render_readme.py)."""
        rows = ["| `kv_connector_extra_config` field | default | meaning |", "|---|---|---|"]
        for name, f in cls.model_fields.items():
            default = ("per user" if name == "path" else
                       "`4GiB`" if name == "capacity" else
                       "unset" if f.default is None else f"`{json.dumps(f.default)}`")
            rows.append(f"| `{name}` | {default} | {f.description} |")
        return "\n".join(rows) + "\n"


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
