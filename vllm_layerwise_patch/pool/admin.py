"""What the ``pool`` command does to an embedded (LMDB) pool: describe it,
check every entry, empty it.  The command line is ``..pool_cli``.

The pool is opened as engines open it (same directory checks, LMDB's
multi-process locking, every shard of a sharded pool), never created and
never grown; reads go in short
transactions of at most :data:`BATCH` entries, so a running engine's writes
and evictions are not held back by a long-lived reader.  Removals go through
the backend (``delete_groups``), which moves the pool's generation: the
engines' hit caches drop what they knew at once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from .backends.base import CorruptEntry, unpack
from .backends.lmdb.backend import _GROUP, LmdbBackend
from .backends.lmdb.fill import lmdb_fill
from .backends.lmdb.shards import RECORD
from .directory.security import check_pool_path
from .keys import group_of, is_marker

#: entries read per read transaction
BATCH = 256
#: description fields ``info`` shows
SUMMARY_FIELDS = ("model", "vllm", "dtype", "cache_dtype", "mamba_cache_dtype",
                  "mamba_ssm_cache_dtype", "quantization", "salt")


class AdminError(RuntimeError):
    """The pool cannot be acted on (said in one line)."""


def data_file(path: str) -> str:
    return os.path.join(path, "data.mdb")


def file_size(path: str) -> int:
    """The pool's data file size (never through a link: the backend's own
    open refuses one anyway)."""
    return os.stat(data_file(path), follow_symlinks=False).st_size


def open_pool(path: str, shared_group: str | None = None) -> Any:
    """The existing pool at ``path``, every shard of it (AdminError when
    there is none, or when its directory fails the checks engines apply)."""
    if not os.path.exists(data_file(path)) and not os.path.exists(os.path.join(path, RECORD)):
        raise AdminError(f"no pool at {path} (no data.mdb or {RECORD} there)")
    verdict = check_pool_path(path, shared_group)
    if not verdict.ok:
        raise AdminError(f"refusing the pool at {verdict.summary()}")
    from .backends.base import BackendError
    from .backends.lmdb.sharded import open_existing

    try:
        return open_existing(path, shared_group, file_size)
    except (BackendError, FileNotFoundError) as exc:
        raise AdminError(f"the pool at {path} cannot be opened: {exc}") from None


def shards(backend: Any) -> list[LmdbBackend]:
    """The pool's LMDB environments: a sharded pool's shards, else itself."""
    return list(getattr(backend, "shards", [backend]))


def _namespace(key: bytes) -> str:
    return key.split(b"/", 1)[0].decode(errors="replace")


def _scan(backend: LmdbBackend, db: Any, prefix: bytes = b"",
          values: bool = True) -> Iterator[tuple[bytes, Any]]:
    """(key, value) of ``db`` under ``prefix``, BATCH keys per read
    transaction (a value is a copy: it outlives its transaction)."""
    start = prefix
    while True:
        batch = []
        with backend.env.begin(buffers=True) as txn:
            cur = txn.cursor(db=db)
            if not (cur.set_range(start) if start else cur.first()):
                return
            for k, v in cur:
                k = bytes(k)
                if not k.startswith(prefix) or len(batch) >= BATCH:
                    break
                batch.append((k, bytes(v) if values else None))
        if not batch:
            return
        yield from batch
        if len(batch) < BATCH:
            return
        start = batch[-1][0] + b"\0"  # the next key after the last one read


def _fill(part: LmdbBackend) -> dict[str, int]:
    return {"file_bytes": file_size(part.path),
            **lmdb_fill(part.env, [part.data, part.groups, part.lru, part.pins], part.data)}


def info(backend: Any) -> dict[str, Any]:
    """The pool's fill (every shard's, summed, and each shard's) and, per
    namespace: its description, entries, blocks, bytes, TP ranks and
    oldest/newest access."""
    envs = shards(backend)
    fills = [_fill(p) for p in envs]
    out: dict[str, Any] = {"backend": "lmdb", "path": backend.path, "shards": len(envs),
                           **{k: sum(f[k] for f in fills) for k in fills[0]}}
    if len(envs) > 1:
        out["per_shard"] = [{"path": p.path, **f} for p, f in zip(envs, fills)]
    spaces: dict[str, dict[str, Any]] = {}

    def space(ns: str) -> dict[str, Any]:
        return spaces.setdefault(ns, {"entries": 0, "bytes": 0, "commit_markers": 0,
                                      "groups": {}, "blocks": set(), "ranks": set(),
                                      "oldest_access": None, "newest_access": None})

    for key, value in (kv for p in envs for kv in _scan(p, p.groups)):
        ns, _, rest = key.partition(b"/")
        s = space(ns.decode(errors="replace"))
        last, size = _GROUP.unpack(value)
        s["bytes"] += size
        parts = rest.split(b"/")
        kind = parts[0].decode(errors="replace")
        s["groups"][kind] = s["groups"].get(kind, 0) + 1
        if len(parts) == 3:  # <kind>/<hash>/tp<r>
            s["blocks"].add(parts[1])
            s["ranks"].add(parts[2].decode(errors="replace"))
        if kind != "meta":
            s["oldest_access"] = min(last, s["oldest_access"] or last)
            s["newest_access"] = max(last, s["newest_access"] or last)
    for key, _ in (kv for p in envs for kv in _scan(p, p.data, values=False)):
        s = space(_namespace(key))
        s["entries"] += 1
        if is_marker(key):
            s["commit_markers"] += 1
    for ns, s in spaces.items():
        s["blocks"], s["ranks"] = len(s["blocks"]), sorted(s["ranks"])
        s["description"] = describe_namespace(backend, ns)
    out["namespaces"] = spaces
    return out


def describe_namespace(backend: Any, ns: str) -> dict[str, Any] | None:
    """The namespace's description kept in the pool (``<ns>/meta/namespace``),
    or None when it is absent or unreadable."""
    key = f"{ns}/meta/namespace".encode()
    try:
        value = backend.get_many([key])[0]
        if value is None:
            return None
        return json.loads(bytes(unpack(key, value, bytes.fromhex(ns))))
    except (ValueError, CorruptEntry):
        return None


def summary(description: dict[str, Any] | None) -> dict[str, Any]:
    """The fields of a namespace description that people look for."""
    if not description:
        return {}
    out = {k: description.get(k) for k in SUMMARY_FIELDS if description.get(k) not in (None, "")}
    layout = description.get("layout") or {}
    for k in ("tp_size", "block_size"):
        if k in layout:
            out[k] = layout[k]
    return out


def verify(backend: Any, drop: bool = False,
           progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Read every entry and check its header, length, namespace, key (the
    digest in its header: a value stored under another key) and checksum.
    Returns the damaged groups (a group: one block's pages of one kind on
    one rank and their marker) with why; ``drop`` removes them."""
    checked, damaged = 0, {}
    for key, value in (kv for p in shards(backend) for kv in _scan(p, p.data)):
        checked += 1
        try:
            unpack(key, value, bytes.fromhex(_namespace(key)))
        except CorruptEntry as exc:
            damaged.setdefault(group_of(key), []).append(
                {"key": key.decode(errors="replace"), "kind": exc.kind})
        except ValueError:  # a key that is not the pool's
            damaged.setdefault(group_of(key), []).append(
                {"key": key.decode(errors="replace"), "kind": "foreign-key"})
        if progress is not None:
            progress(1)
    if drop and damaged:
        backend.delete_groups(sorted(damaged))
    return {"checked": checked, "damaged_groups": len(damaged), "dropped": bool(drop and damaged),
            "damaged": {g.decode(errors="replace"): v for g, v in sorted(damaged.items())}}


def count_entries(backend: Any) -> int:
    n = 0
    for p in shards(backend):
        with p.env.begin() as txn:
            n += txn.stat(p.data)["entries"]
    return n


def clear(backend: Any, namespace: str | None = None) -> dict[str, Any]:
    """Remove every entry (or those of one namespace: its full hex name or a
    unique prefix of it).  Returns what was removed."""
    prefix = b""
    if namespace:
        known = {_namespace(k) for p in shards(backend)
                 for k, _ in _scan(p, p.groups, values=False)}
        matches = sorted(ns for ns in known if ns.startswith(namespace))
        if len(matches) != 1:
            raise AdminError(f"namespace {namespace!r}: " + (
                "no such namespace in the pool" if not matches else
                f"ambiguous ({', '.join(matches)})"))
        namespace = matches[0]
        prefix = namespace.encode() + b"/"
    before = count_entries(backend)
    groups = [k for p in shards(backend) for k, _ in _scan(p, p.groups, prefix, values=False)]
    for i in range(0, len(groups), 1024):
        backend.delete_groups(groups[i:i + 1024])
    # entries without a group record (none are written so; kept out anyway)
    stray = [k for p in shards(backend) for k, _ in _scan(p, p.data, prefix, values=False)]
    if stray:
        backend.delete(stray)
    return {"namespace": namespace, "groups": len(groups),
            "entries": before - count_entries(backend)}
