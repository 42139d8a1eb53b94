"""The embedded pool as several LMDB environments under one path (shards,
:mod:`.shards`): each a :class:`.backend.LmdbBackend` of its own - its own
writer, eviction and generation file - so engines saving different blocks
do not wait on one writer.  This backend composes them: every operation
splits its keys by shard and makes one call per shard it touches (a lookup
of a hit reads only the shards its blocks live in).

Capacity is split evenly: each of ``N`` shards gets ``capacity // N`` bytes
and evicts its own least recently used groups when it is full; a block's
groups all live in one shard, so eviction still drops whole blocks.

:func:`open_shared` opens the pool at a path as engines do: the shard count
the pool records (a new pool records the configured one; a pool written
before sharding is one environment and opens as it is).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ...directory.descriptors import PoolDir, open_pool_dir, open_pool_subdir
from ...faults import faults
from ..base import Backend, BackendError
from ..generation import Generation
from .backend import LmdbBackend
from .files import check_space
from .fill import lmdb_fill
from .shards import decide, read_record, shard_name, shard_of

logger = logging.getLogger("vllm.layerwise_patch")

#: keys whose shard :meth:`ShardedLmdbBackend._split` remembers (then it
#: starts afresh; a few MB): more than a step's saves and a long hit's pages
_ROUTES_KEPT = 1 << 15


class ShardedLmdbBackend(Backend):
    """``N`` shards of one pool directory (``root``, open and checked:
    closed here).  ``capacities``: each shard's; ``create``: make a missing
    shard (engines; the pool command opens only what exists)."""

    def __init__(self, root: PoolDir, capacities: list[int], *, create: bool = True,
                 **kw: Any) -> None:
        self.path = root.path
        self.capacity = sum(capacities)
        self.shards: list[LmdbBackend] = []
        try:
            for i, cap in enumerate(capacities):
                name = shard_name(i)
                if not create and root.existing(name) is None:
                    raise BackendError(f"{os.path.join(root.path, name)} is missing: the pool "
                                       f"records {len(capacities)} shards")
                sub = open_pool_subdir(root, name)
                self.shards.append(LmdbBackend(sub.path, cap, pool_dir=sub, **kw))
        except BaseException:
            for shard in self.shards:
                shard.close()
            raise
        finally:
            root.close()
        self.n = len(self.shards)
        self._turn = 0  # the shard a put starts with (puts spread their waits)
        self._routes: dict[bytes, int] = {}  # key -> shard (see _split)
        self.refs = 0
        self.closed = False

    # -- routing -------------------------------------------------------------------
    def _split(self, keys: Iterable[bytes]) -> dict[int, tuple[list[int], list[bytes]]]:
        """Per shard touched: the keys' indexes and the keys."""
        out: dict[int, tuple[list[int], list[bytes]]] = {}
        if faults().shard_by_key:
            for i, k in enumerate(keys):
                k = bytes(k)
                idx, ks = out.setdefault(shard_of(k, self.n, True), ([], []))
                idx.append(i)
                ks.append(k)
            return out
        # (each key's shard remembered: a save's keys are read back, a hit's
        # looked up again; the table is bounded)
        n, routes = self.n, self._routes
        if len(routes) > _ROUTES_KEPT:
            routes.clear()
        for i, k in enumerate(keys):
            if type(k) is not bytes:
                k = bytes(k)
            s = routes.get(k)
            if s is None:
                s = routes[k] = shard_of(k, n)
            got = out.get(s)
            if got is None:
                got = out[s] = ([], [])
            got[0].append(i)
            got[1].append(k)
        return out

    def _each(self, keys: Iterable[bytes], op: Callable[[LmdbBackend, list[bytes]], Any]) -> None:
        for s, (_, ks) in self._split(keys).items():
            op(self.shards[s], ks)

    # -- reads -----------------------------------------------------------------------
    def generation(self) -> Generation:
        """The shards' generations as one: any shard's store or removal moves
        it (each counter only grows; epochs and stores are summed), removals
        odd while any shard's are (twice the sum, plus one)."""
        gens = [s.generation() for s in self.shards]
        return Generation(sum(g.epoch for g in gens), sum(g.stores for g in gens),
                          2 * sum(g.removals for g in gens)
                          + any(g.removals % 2 for g in gens))

    def exists_many(self, keys: Iterable[bytes]) -> list[bool]:
        self.calls["exists"] += 1
        keys = list(keys)
        out = [False] * len(keys)
        for s, (idx, ks) in self._split(keys).items():
            for i, found in zip(idx, self.shards[s].exists_many(ks)):
                out[i] = found
        return out

    def get_many(self, keys: list[bytes], sizes: list[int] | None = None) -> list[bytes | None]:
        self.calls["get"] += 1
        out: list[bytes | None] = [None] * len(keys)
        for s, (idx, ks) in self._split(keys).items():
            got = self.shards[s].get_many(ks, None if sizes is None else [sizes[i] for i in idx])
            for i, v in zip(idx, got):
                out[i] = v
        return out

    def read_many(self, keys: list[bytes], consume, sizes: list[int] | None = None) -> None:
        self.calls["read"] += 1
        for s, (idx, ks) in self._split(keys).items():
            self.shards[s].read_many(
                ks, lambda j, k, v, idx=idx: consume(idx[j], k, v),
                None if sizes is None else [sizes[i] for i in idx])

    # -- groups ----------------------------------------------------------------------
    def touch(self, groups: Iterable[bytes]) -> None:
        self.calls["touch"] += 1
        self._each(groups, lambda b, gs: b.touch(gs))

    def pin(self, groups: Iterable[bytes], seconds: float, owner: bytes = b"") -> None:
        self.calls["pin"] += 1
        self._each(groups, lambda b, gs: b.pin(gs, seconds, owner))

    def unpin(self, groups: Iterable[bytes], owner: bytes = b"") -> None:
        self.calls["unpin"] += 1
        self._each(groups, lambda b, gs: b.unpin(gs, owner))

    def delete(self, keys: Iterable[bytes]) -> None:
        self.calls["delete"] += 1
        self._each(keys, lambda b, ks: b.delete(ks))

    def delete_groups(self, groups: Iterable[bytes]) -> None:
        self.calls["delete_groups"] += 1
        self._each(groups, lambda b, gs: b.delete_groups(gs))

    # -- writes ----------------------------------------------------------------------
    def put_many(self, items: list[tuple[bytes, bytes]], *, cold: bool = False) -> None:
        """One write transaction per shard touched (a block's items all in
        one), each shard written when its writer is free: a busy shard is
        passed over and tried again after the others, and only when every
        shard left is busy does the put wait (for the first of them).
        Every shard is written even when one fails (its blocks are whole);
        then the first error is raised: those saves are skipped.  ``cold``:
        as :meth:`.backend.LmdbBackend.put_many`."""
        if not items:
            return
        self.calls["put"] += 1
        batches = {s: [items[i] for i in idx]
                   for s, (idx, _) in self._split(k for k, _ in items).items()}
        self._turn += 1
        pending = sorted(batches, key=lambda s: (s - self._turn) % self.n)
        error: BaseException | None = None
        while pending:
            busy = []
            for s in pending:
                try:
                    if not self.shards[s].try_put_many(batches[s], cold=cold):
                        busy.append(s)
                except BackendError as exc:
                    error = error or exc
            if busy and len(busy) == len(pending):  # no shard free: wait for one
                s = busy.pop(0)
                try:
                    self.shards[s].put_many(batches[s], cold=cold)
                except BackendError as exc:
                    error = error or exc
            pending = busy
        if error is not None:
            raise error

    @property
    def writer_wait_seconds(self) -> float:
        """Time puts spent blocked on a busy shard's writer."""
        return sum(s.writer_wait_seconds for s in self.shards)

    # -- figures ---------------------------------------------------------------------
    @property
    def evictions(self) -> int:
        return sum(s.evictions for s in self.shards)

    @property
    def evicted_groups(self) -> int:
        return sum(s.evicted_groups for s in self.shards)

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for shard in self.shards:
            for k, v in shard.stats().items():
                out[k] = out.get(k, 0) + v
        out["writemap"] = int(all(s.writemap for s in self.shards))
        out["shards"] = self.n
        return out

    def fill(self) -> dict[str, int]:
        """Every shard's fill (:func:`.fill.lmdb_fill`), summed."""
        out = {"used_bytes": 0, "capacity_bytes": 0, "entries": 0}
        for s in self.shards:
            for k, v in lmdb_fill(s.env, [s.data, s.groups, s.lru, s.pins], s.data).items():
                out[k] += v
        return out

    def close(self) -> None:
        self.refs -= 1
        if self.refs <= 0 and not self.closed:
            self.closed = True
            for shard in self.shards:
                shard.refs = 0
                shard.close()


def _used(root: PoolDir, n: int) -> int:
    """Bytes the shards' data files occupy now."""
    used = 0
    for i in range(n):
        try:
            st = os.stat(f"{shard_name(i)}/data.mdb", dir_fd=root.fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        used += st.st_blocks * 512
    return used


def open_pool(path: str, capacity: int, shards: int, *, shared_group: str | None = None,
              **kw: Any) -> Backend:
    """The pool at ``path`` as engines open it: its directory checked, the
    shard count it records (or, new, the configured one recorded), then its
    environment(s)."""
    root = open_pool_dir(path, shared_group)  # before anything is read
    try:
        lock = root.open(".open.lock")
        try:  # (engines starting together agree on the count)
            fcntl.flock(lock, fcntl.LOCK_EX)
            n = decide(root, capacity, shards)
        finally:
            os.close(lock)
        if n > 1:
            check_space(root, capacity, _used(root, n))
    except BaseException:
        root.close()
        raise
    if n == 1:
        root.close()
        return LmdbBackend(path, capacity, shared_group=shared_group, **kw)
    return ShardedLmdbBackend(root, [capacity // n] * n, shared_group=shared_group, **kw)


def open_existing(path: str, shared_group: str | None, capacity_of: Callable[[str], int]
                  ) -> Backend:
    """An existing pool (the ``pool`` command): never created or grown; a
    shard's capacity is ``capacity_of(its directory)``."""
    root = open_pool_dir(path, shared_group)
    try:
        n = read_record(root) or 1
    except BaseException:
        root.close()
        raise
    if n == 1:
        root.close()
        return LmdbBackend(path, capacity_of(path), preallocate=False, shared_group=shared_group)
    caps = [capacity_of(os.path.join(root.path, shard_name(i))) for i in range(n)]
    return ShardedLmdbBackend(root, caps, create=False, preallocate=False,
                              shared_group=shared_group)


_SHARED: dict[tuple[int, str], Backend] = {}
_SHARED_LOCK = threading.Lock()


def open_shared(path: str, capacity_bytes: int, shards: int = 1, **kw: Any) -> Backend:
    """One pool per path per process (LMDB refuses a second open of an
    environment; the scheduler and worker connectors share a process when
    vLLM runs in-process)."""
    key = (os.getpid(), os.path.realpath(path))
    with _SHARED_LOCK:
        backend = _SHARED.get(key)
        if backend is None or backend.closed:
            backend = _SHARED[key] = open_pool(path, capacity_bytes, shards, **kw)
        backend.refs += 1
        return backend
