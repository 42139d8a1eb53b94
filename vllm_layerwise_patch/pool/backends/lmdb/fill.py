"""How full the embedded (LMDB) pool is: bytes of pages in use, capacity and
entries, read from LMDB's own page counts (cheap: no scan).  Used by the
scheduler's metrics (``.scheduler.stats``) and the ``pool`` command."""

from __future__ import annotations

from typing import Any

#: the LMDB backend's named databases, as attributes of the backend
_DATABASES = ("data", "groups", "lru", "pins")


def _pages(stat: dict[str, int]) -> int:
    return stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]


def lmdb_fill(env: Any, dbs: list[Any], data_db: Any = None) -> dict[str, int]:
    """``used_bytes``: pages that hold entries and the pool's indexes (free
    pages LMDB will reuse do not count); ``capacity_bytes``: the map size;
    ``entries``: keys in ``data_db``."""
    psize = env.stat()["psize"]
    with env.begin(buffers=True) as txn:
        pages = _pages(env.stat()) + sum(_pages(txn.stat(db)) for db in dbs)
        entries = txn.stat(data_db)["entries"] if data_db is not None else 0
    return {"used_bytes": pages * psize, "capacity_bytes": env.info()["map_size"],
            "entries": entries}


def pool_fill(backend: Any) -> dict[str, int] | None:
    """The fill of an embedded pool backend; None for a backend without one
    (Mooncake: its master reports its own) or when it cannot be read now.
    A sharded pool's fill covers every shard."""
    env = getattr(backend, "env", None)
    fill = getattr(backend, "fill", None)  # a sharded pool: its shards' fills summed
    if env is None and fill is None:
        return None
    try:
        if env is None:
            return fill()
        dbs = [getattr(backend, name) for name in _DATABASES if hasattr(backend, name)]
        return lmdb_fill(env, dbs, getattr(backend, "data", None))
    except Exception:  # noqa: BLE001 - a metric is never worth an error (map resized, closed)
        return None
