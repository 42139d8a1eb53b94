"""``kv_connector_extra_config`` of the LayerwisePoolConnector, validated at
startup with errors that name the field."""

from __future__ import annotations

import dataclasses
from typing import Any

from .backends.lmdb import default_path

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


class PoolConfigError(ValueError):
    pass


def parse_size(field: str, value: Any) -> int:
    if isinstance(value, bool):
        raise PoolConfigError(f"kv_connector_extra_config.{field}: expected a size, got {value!r}")
    if isinstance(value, (int, float)):
        n = int(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num):]
        if unit not in _UNITS or not num:
            raise PoolConfigError(
                f"kv_connector_extra_config.{field}: cannot read size {value!r} "
                "(examples: 4294967296, '4GiB', '512MB')")
        n = int(float(num) * _UNITS[unit])
    else:
        raise PoolConfigError(f"kv_connector_extra_config.{field}: expected a size, got {value!r}")
    if n <= 0:
        raise PoolConfigError(f"kv_connector_extra_config.{field}: must be > 0, got {value!r}")
    return n


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    backend: str = "lmdb"
    path: str = dataclasses.field(default_factory=default_path)
    capacity: int = 4 << 30
    prefetch_layers: int = 2
    load_threads: int = 2
    pin_seconds: float = 30.0
    verify_on_lookup: bool = True
    namespace_salt: str = ""
    # debug only: leave mamba state pages out of loads (negative-control tests)
    debug_skip_mamba_load: bool = False
    # debug only: the first load of this layer fails (load-failure tests)
    debug_fail_load_layer: str = ""
    # debug only (negative control): failed loads are zeroed, not reported
    debug_hide_load_errors: bool = False

    FIELDS = ("backend", "path", "capacity", "prefetch_layers", "load_threads",
              "pin_seconds", "verify_on_lookup", "namespace_salt",
              "debug_skip_mamba_load", "debug_fail_load_layer",
              "debug_hide_load_errors")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> PoolConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.FIELDS))
        if unknown:
            raise PoolConfigError(
                f"kv_connector_extra_config: unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(cls.FIELDS)}")
        kw: dict[str, Any] = {}
        if "backend" in extra:
            if extra["backend"] not in ("lmdb",):
                raise PoolConfigError(
                    f"kv_connector_extra_config.backend: {extra['backend']!r} is not "
                    "available (known: 'lmdb')")
            kw["backend"] = extra["backend"]
        if "path" in extra:
            if not isinstance(extra["path"], str) or not extra["path"]:
                raise PoolConfigError(
                    f"kv_connector_extra_config.path: expected a directory path, got {extra['path']!r}")
            kw["path"] = extra["path"]
        if "capacity" in extra:
            kw["capacity"] = parse_size("capacity", extra["capacity"])
        for name, lo, hi in (("prefetch_layers", 1, 64), ("load_threads", 1, 32)):
            if name in extra:
                v = extra[name]
                if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                    raise PoolConfigError(
                        f"kv_connector_extra_config.{name}: expected an integer "
                        f"{lo}..{hi}, got {v!r}")
                kw[name] = v
        if "pin_seconds" in extra:
            v = extra["pin_seconds"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise PoolConfigError(
                    f"kv_connector_extra_config.pin_seconds: expected seconds >= 0, got {v!r}")
            kw["pin_seconds"] = float(v)
        for name in ("verify_on_lookup", "debug_skip_mamba_load", "debug_hide_load_errors"):
            if name in extra:
                if not isinstance(extra[name], bool):
                    raise PoolConfigError(
                        f"kv_connector_extra_config.{name}: expected true/false, got {extra[name]!r}")
                kw[name] = extra[name]
        if "debug_fail_load_layer" in extra:
            if not isinstance(extra["debug_fail_load_layer"], str):
                raise PoolConfigError(
                    "kv_connector_extra_config.debug_fail_load_layer: expected a layer name")
            kw["debug_fail_load_layer"] = extra["debug_fail_load_layer"]
        if "namespace_salt" in extra:
            if not isinstance(extra["namespace_salt"], str):
                raise PoolConfigError(
                    "kv_connector_extra_config.namespace_salt: expected a string")
            kw["namespace_salt"] = extra["namespace_salt"]
        return cls(**kw)

    def make_backend(self):
        try:
            import lmdb  # noqa: F401
        except ImportError as exc:
            raise PoolConfigError(
                "kv_connector_extra_config.backend: 'lmdb' needs the lmdb package: "
                "pip install 'vllm-layerwise-patch[pool]'") from exc
        from .backends.lmdb import open_shared

        return open_shared(self.path, self.capacity, pin_seconds=self.pin_seconds)
