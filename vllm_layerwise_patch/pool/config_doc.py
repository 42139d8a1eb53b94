"""The configuration reference (docs/configuration.md), rendered from the
pydantic models themselves so that the page has no second source: each
field's name, type (with its bounds), default and description.
``scripts/render_readme.py`` writes it; tests/test_docs.py fails when a
field was added or changed without rendering again."""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

#: defaults better read in the unit a user writes than in bytes
_SIZE_DEFAULTS = {"capacity": "`4GiB`", "global_segment_size": "`4GiB`",
                  "local_buffer_size": "`256MiB`", "pinned_staging_bytes": "`256MiB`"}

#: validators that give a field a user-facing type of its own (by function name)
_VALIDATED = {"parse_size": "size", "_size_or_zero": "size (or `0`)",
              "_staging_size": "size (or `0`)",
              "_address": "`host:port`", "_metadata_server": "string (see meaning)",
              "_number": "number"}

_BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))


def _base_type(annotation: Any) -> str:
    """The annotation in a user's words (a JSON value), without bounds."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " or ".join(f"`{json.dumps(v)}`" for v in typing.get_args(annotation))
    if origin is typing.Annotated:
        inner, *meta = typing.get_args(annotation)
        named = [_VALIDATED[m.func.__name__] for m in meta
                 if getattr(getattr(m, "func", None), "__name__", None) in _VALIDATED]
        return named[0] if named else _base_type(inner)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return " or ".join(_base_type(a) for a in args) + ", or unset"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object (the table below)"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(
        annotation, getattr(annotation, "__name__", str(annotation)))


def type_cell(f: FieldInfo) -> str:
    """A field's type with its validator's name for it and its bounds."""
    kind = _base_type(f.annotation)
    named = [_VALIDATED[m.func.__name__] for m in f.metadata
             if getattr(getattr(m, "func", None), "__name__", None) in _VALIDATED]
    if named:
        kind = named[0]
    bounds = [f"{sign} {getattr(m, attr)}" for m in f.metadata
              for attr, sign in _BOUNDS if getattr(m, attr, None) is not None]
    if any(getattr(m, "min_length", None) for m in f.metadata):
        kind = kind.replace("string", "non-empty string")
    return kind + (f", {' and '.join(bounds)}" if bounds else "")


def default_cell(name: str, f: FieldInfo) -> str:
    if name == "path":
        return "per user"
    if name in _SIZE_DEFAULTS:
        return _SIZE_DEFAULTS[name]
    if f.default_factory is not None:
        return "see below"
    return "unset" if f.default is None else f"`{json.dumps(f.default)}`"


def table(model: type[BaseModel], prefix: str) -> str:
    """One model's fields, in declaration order."""
    rows = [f"| `{prefix}` field | type | default | meaning |", "|---|---|---|---|"]
    for name, f in model.model_fields.items():
        rows.append(f"| `{name}` | {type_cell(f)} | {default_cell(name, f)} | "
                    f"{f.description} |")
    return "\n".join(rows) + "\n"


def reference(pool_model: type[BaseModel], mooncake_model: type[BaseModel]) -> str:
    """The pool connector's fields and the Mooncake client's."""
    return (table(pool_model, "kv_connector_extra_config") + "\n"
            + table(mooncake_model, "kv_connector_extra_config.mooncake"))
