"""Embedded pool backend on LMDB: no server, several processes, LRU eviction
of whole groups (blocks).

One LMDB environment (a directory; by default a per-user one under /dev/shm,
so the file is RAM) with four databases:

* ``data``: key -> header + payload;
* ``groups``: group -> (last use, bytes) - a group is a block's pages of one
  kind on one rank and its commit marker (:func:`..keys.group_of`);
* ``lru``: (last use, group) -> "" - the access-time index, so eviction reads
  the oldest groups first without scanning or sorting the table;
* ``pins``: group -> expiry - groups a pending load reads.

A put runs in one write transaction (atomic), through ``writemap`` when the
file is preallocated (:mod:`.lmdb.files`).  When the map is full, the
least recently used unpinned groups are chosen and deleted
(:mod:`.lmdb.eviction`), then the put is retried.  If pinned groups leave no room, or the
filesystem under the pool is full, the put raises PoolFull: the caller skips
that save.

Across processes: engines opening one path with different ``capacity`` share
the largest map (a process that finds the map grown adopts it); reader slots
left by killed processes are cleared (LMDB's reader check) at open and before
each eviction, so old pages do not stay pinned; a pool path on a filesystem
smaller than ``capacity`` is refused at startup.  (Writes: :mod:`.generation`.)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

from ...keys import group_of
from ..base import Backend, BackendError, PoolFull
from .gate import Gate, GatedTxn, WriterTurn
from ..generation import REMOVALS, STORES, Generation
from .eviction import _GROUP, _T, LruEviction
from .files import file_size, open_environment, unbacked_growth

logger = logging.getLogger("vllm.layerwise_patch")

_PIN_SEP = b"\0"  # pins: group NUL owner -> expiry (one pin per pending load)
#: a cold save's age: its blocks' last use this long before the save, below
#: every block used since (evicted first, oldest first among themselves)
COLD_AGE = 1e7


class LmdbBackend(Backend):
    def __init__(self, path: str, capacity_bytes: int, *, evict_fraction: float = 0.1,
                 pin_seconds: float = 30.0, shared_group: str | None = None,
                 preallocate: bool = True, pool_dir=None) -> None:
        """``pool_dir``: the pool directory already open and checked (a
        shard's: :mod:`.sharded`), closed with the backend."""
        self.path, self.capacity = path, int(capacity_bytes)
        self.pin_seconds = pin_seconds
        self.env, dbs, self._gen, self.writemap, self._files = open_environment(
            path, self.capacity, shared_group, preallocate, pool_dir)
        self.path = self._files.path  # (the directories above it resolved)
        self.data, self.groups, self.lru, self.pins = dbs  # lmdb.files.DATABASES
        # with writemap, a write the file cannot back is a SIGBUS: refuse them
        self._writes_refused: str | None = None
        self.map_size = self.env.info()["map_size"]
        if self.map_size > self.capacity:
            logger.info("vllm-layerwise-patch pool: %s was opened with a larger capacity "
                        "(%d bytes) by another engine; sharing it", path, self.map_size)
        self._gate = Gate()
        self._turn = WriterTurn(self._files.dir.fd)  # (puts take turns)
        self.eviction = LruEviction(self.env, (self.groups, self.lru, self.pins), self._gen,
                                    txn=self._txn, pinned=self._pinned, drop=self._drop,
                                    map_size=lambda: self.map_size, fraction=evict_fraction)
        self.refs = 0
        self.closed = False

    @property
    def evictions(self) -> int:
        """Eviction rounds this process ran."""
        return self.eviction.evictions

    @property
    def writer_wait_seconds(self) -> float:
        """Time puts spent blocked waiting for the writer's turn."""
        return self._turn.wait_seconds

    @property
    def evicted_groups(self) -> int:
        """Groups (blocks) those rounds dropped."""
        return self.eviction.evicted_groups

    # -- transactions -------------------------------------------------------------
    def _txn(self, write: bool = False) -> GatedTxn:
        """``with self._txn(write) as txn``: a transaction under the gate
        (shared), begun again once on a map another process grew."""
        return GatedTxn(self, write)

    def _adopt_map(self) -> bool:
        """Take the map size another process grew the pool to; True if grown.
        (writemap: only when the file grew - LMDB remaps even at the same
        size, and every page of the map then faults in again.)"""
        if self.writemap and file_size(self._files) <= self.env.info()["map_size"]:
            return False
        with self._gate.exclusive():
            before = self.env.info()["map_size"]
            # writemap: never below the file (LMDB would truncate it under other
            # engines); others' data never lies past it.  0: the recorded size.
            self.env.set_mapsize(max(before, file_size(self._files)) if self.writemap else 0)
            self.map_size = self.env.info()["map_size"]
        if self.map_size > before:
            logger.info("vllm-layerwise-patch pool: another engine grew %s to %d bytes; "
                        "sharing it", self.path, self.map_size)
            if self.writemap:
                self._writes_refused = unbacked_growth(self._files, self.map_size)
            return True
        return False

    # -- reads -----------------------------------------------------------------
    def generation(self) -> Generation:
        return self._gen.read()

    def exists_many(self, keys: Iterable[bytes]) -> list[bool]:
        self.calls["exists"] += 1
        with self._txn() as txn:
            cur = txn.cursor(db=self.data)
            return [cur.set_key(k) for k in keys]

    def get_many(self, keys: list[bytes], sizes: list[int] | None = None) -> list[bytes | None]:
        self.calls["get"] += 1
        with self._txn() as txn:
            out = []
            for k in keys:
                v = txn.get(k, db=self.data)
                out.append(None if v is None else bytes(v))
            return out

    def read_many(self, keys: list[bytes], consume, sizes: list[int] | None = None) -> None:
        self.calls["read"] += 1
        # zero-copy: values are views into the map, valid inside this txn
        with self._txn() as txn:
            for i, k in enumerate(keys):
                consume(i, k, txn.get(k, db=self.data))

    # -- groups ----------------------------------------------------------------
    def _use(self, txn, group: bytes, now: float, add: int = 0, create: bool = False,
             keep: bool = False) -> None:
        """``group`` used at ``now`` (``create``: a new one too); ``keep``: an
        existing group keeps its last use (a cold save)."""
        rec = txn.get(group, db=self.groups)
        if rec is None:
            if not create:
                return
            size = 0
        else:
            last, size = _GROUP.unpack(rec)
            if keep:
                txn.put(group, _GROUP.pack(last, max(0, size + add)), db=self.groups)
                return
            txn.delete(_T.pack(last) + group, db=self.lru)
        txn.put(group, _GROUP.pack(now, max(0, size + add)), db=self.groups)
        txn.put(_T.pack(now) + group, b"", db=self.lru)

    def _drop(self, txn, group: bytes) -> int:
        rec = txn.get(group, db=self.groups)
        size = 0
        if rec is not None:
            last, size = _GROUP.unpack(rec)
            txn.delete(_T.pack(last) + group, db=self.lru)
            txn.delete(group, db=self.groups)
        pins = txn.cursor(db=self.pins)
        if pins.set_range(group + _PIN_SEP):
            while bytes(pins.key()).startswith(group + _PIN_SEP):
                if not pins.delete():
                    break
        prefix = group + b"/"
        cur = txn.cursor(db=self.data)
        if cur.set_range(prefix):
            while bytes(cur.key()).startswith(prefix):
                if not cur.delete():
                    break
        txn.delete(group, db=self.data)  # a key that is its own group
        return size

    def touch(self, groups: Iterable[bytes]) -> None:
        self.calls["touch"] += 1
        groups = list(dict.fromkeys(groups))
        if groups:
            now = time.time()
            with self._txn(write=True) as txn:
                for g in groups:
                    self._use(txn, g, now)

    def pin(self, groups: Iterable[bytes], seconds: float, owner: bytes = b"") -> None:
        self.calls["pin"] += 1
        groups = list(dict.fromkeys(groups))
        if not groups:
            return
        now = time.time()
        until = _T.pack(now + seconds)
        with self._txn(write=True) as txn:
            for g in groups:
                txn.put(g + _PIN_SEP + owner, until, db=self.pins)
                self._use(txn, g, now)

    def unpin(self, groups: Iterable[bytes], owner: bytes = b"") -> None:
        self.calls["unpin"] += 1
        groups = list(dict.fromkeys(groups))
        if groups:
            with self._txn(write=True) as txn:
                for g in groups:
                    txn.delete(g + _PIN_SEP + owner, db=self.pins)

    def _pinned(self, txn, group: bytes, now: bytes) -> bool:
        """Any owner's pin on ``group`` still live (expired ones are removed)."""
        prefix = group + _PIN_SEP
        cur = txn.cursor(db=self.pins)
        live = False
        if cur.set_range(prefix):
            while bytes(cur.key()).startswith(prefix):
                if bytes(cur.value()) > now:
                    live = True
                    cur.next()
                elif not cur.delete():
                    break
        return live

    def delete(self, keys: Iterable[bytes]) -> None:
        self.calls["delete"] += 1
        with self._txn(write=True) as txn:
            begun = self._gen.begin(REMOVALS)
            for k in keys:
                old = txn.get(k, db=self.data)
                if old is not None:
                    txn.delete(k, db=self.data)
                    self._use(txn, group_of(k), time.time(), add=-(len(k) + len(old)))
        self._gen.end(REMOVALS, begun)

    def delete_groups(self, groups: Iterable[bytes]) -> None:
        self.calls["delete_groups"] += 1
        groups = list(dict.fromkeys(groups))
        if groups:
            with self._txn(write=True) as txn:
                begun = self._gen.begin(REMOVALS)
                for g in groups:
                    self._drop(txn, g)
            self._gen.end(REMOVALS, begun)

    # -- writes ----------------------------------------------------------------
    def put_many(self, items: list[tuple[bytes, bytes]], *, cold: bool = False) -> None:
        """``cold``: new blocks enter as the least recently used (evicted
        before any block used since; :data:`COLD_AGE`), existing ones keep
        their last use (a tiered pool's near tier, ``tiered.near_saves``)."""
        self._put(items, wait=True, cold=cold)

    def try_put_many(self, items: list[tuple[bytes, bytes]], *, cold: bool = False) -> bool:
        """:meth:`put_many` if the writer is free now; else False, writing
        nothing (a sharded pool writes its other shards meanwhile)."""
        return self._put(items, wait=False, cold=cold)

    def _put(self, items: list[tuple[bytes, bytes]], wait: bool, cold: bool = False) -> bool:
        if not items:
            return True
        import lmdb

        if self._writes_refused:
            raise PoolFull(self._writes_refused)
        need = sum(len(k) + len(v) for k, v in items)
        if need > self.capacity // 2:
            raise PoolFull(f"a batch of {need} bytes cannot fit a pool of {self.capacity}")
        if not self._turn.acquire(wait):
            return False
        try:
            self.calls["put"] += 1
            for attempt in range(4):
                try:
                    self._write(items, cold)
                    return True
                except lmdb.MapFullError:
                    if self._adopt_map():
                        continue
                    if self.eviction.evict(need * (attempt + 2)) == 0:
                        raise PoolFull("no room: every entry is pinned by a pending load "
                                       "(or the pool is smaller than one step's saves)")
                except lmdb.Error as exc:  # I/O: a full filesystem shows as EIO/ENOSPC
                    st = os.fstatvfs(self._files.dir.fd)
                    free = st.f_bavail * st.f_frsize
                    if free < need:
                        raise PoolFull(f"the filesystem of {self.path} is full ({free} "
                                       f"bytes free, {need} needed): {exc}") from None
                    raise BackendError(f"LMDB write failed: {exc}") from None
            raise PoolFull("eviction could not make room")
        finally:
            self._turn.release()

    def _write(self, items: list[tuple[bytes, bytes]], cold: bool = False) -> None:
        now = time.time() - (COLD_AGE if cold else 0.0)
        added: dict[bytes, int] = {}
        replaced = False  # a value changed under its key: as good as removed and stored
        with self._txn(write=True) as txn:
            stored = self._gen.begin(STORES)
            for k, v in items:
                old = txn.get(k, db=self.data)
                if old is not None and replaced is False:
                    replaced = self._gen.begin(REMOVALS)
                txn.put(k, v, db=self.data)
                g = group_of(k)
                added[g] = added.get(g, 0) + len(k) + len(v) - (
                    0 if old is None else len(k) + len(old))
            for g, add in added.items():
                self._use(txn, g, now, add=add, create=True, keep=cold)
        self._gen.end(STORES, stored)
        if replaced is not False:
            self._gen.end(REMOVALS, replaced)

    def stats(self) -> dict[str, int]:
        with self._txn() as txn:
            entries = txn.stat(self.data)["entries"]
            groups = txn.stat(self.groups)["entries"]
        info, stat = self.env.info(), self.env.stat()
        return {"entries": entries, "groups": groups,
                "used_bytes": (info["last_pgno"] + 1) * stat["psize"],
                "map_bytes": info["map_size"], "capacity_bytes": self.capacity,
                "evictions": self.evictions, "evicted_groups": self.evicted_groups,
                "writemap": int(self.writemap)}

    def close(self) -> None:
        self.refs -= 1
        if self.refs <= 0 and not self.closed:
            self.closed = True
            self.env.close()
            self._gen.close()
            self._files.close()
