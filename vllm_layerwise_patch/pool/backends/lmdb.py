"""Embedded pool backend on LMDB: no server, several processes, LRU eviction.

One LMDB environment (a directory; default under /dev/shm, so the file is
RAM) with two databases: ``data`` (key -> header+payload) and ``atime`` (key ->
8-byte big-endian use counter, for eviction).  Puts run in one write
transaction (atomic).  When the map would overflow the least recently used entries are deleted in one transaction;
LMDB reuses freed pages only after a *later* write transaction commits, so
eviction is followed by a tiny write transaction before the insert is retried
(shared/reference/backends.md).  Entries touched within ``pin_seconds`` are
never evicted: the scheduler touches what it reports as a hit, so the worker
finds it moments later.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Iterable

from .base import Backend

logger = logging.getLogger("vllm.layerwise_patch")

_U64 = struct.Struct(">Q")
_T = struct.Struct(">d")
_TICK = b"\0vlp-evict-tick"


def default_path() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else os.path.join(
        os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vllm-layerwise-pool")


_SHARED: dict[tuple[int, str], "LmdbBackend"] = {}
_SHARED_LOCK = threading.Lock()


def open_shared(path: str, capacity_bytes: int, **kw) -> "LmdbBackend":
    """One environment per path per process (LMDB refuses a second open; the
    scheduler and worker connectors share a process when vLLM runs in-process)."""
    key = (os.getpid(), os.path.realpath(path))
    with _SHARED_LOCK:
        backend = _SHARED.get(key)
        if backend is None or backend.closed:
            backend = _SHARED[key] = LmdbBackend(path, capacity_bytes, **kw)
        backend.refs += 1
        return backend


class LmdbBackend(Backend):
    def __init__(self, path: str, capacity_bytes: int, *,
                 evict_fraction: float = 0.1, pin_seconds: float = 30.0) -> None:
        import lmdb

        import fcntl

        os.makedirs(path, exist_ok=True)
        self.path = path
        self.capacity = int(capacity_bytes)
        self.evict_fraction = evict_fraction
        self.pin_seconds = pin_seconds
        # Processes starting together (engine core and workers) must not
        # race to create the environment and its named databases.
        with open(os.path.join(path, ".open.lock"), "a+") as lockf:
            fcntl.flock(lockf, fcntl.LOCK_EX)
            try:
                self.env = lmdb.open(path, map_size=self.capacity, max_dbs=2, subdir=True,
                                     lock=True, sync=False, metasync=False,
                                     readahead=False, max_readers=256)
                self.data = self.env.open_db(b"data")
                self.atime = self.env.open_db(b"atime")
            finally:
                fcntl.flock(lockf, fcntl.LOCK_UN)
        self._lock = threading.Lock()
        self.evictions = 0
        self.evicted_entries = 0
        self.refs = 0
        self.closed = False

    # -- reads -----------------------------------------------------------------
    def exists_all(self, keys: Iterable[bytes]) -> list[bool]:
        with self.env.begin(db=self.data, buffers=True) as txn:
            cur = txn.cursor()
            return [cur.set_key(k) for k in keys]

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        with self.env.begin(db=self.data) as txn:
            return [txn.get(k) for k in keys]

    def read_many(self, keys: list[bytes], consume) -> None:
        # zero-copy: values are views into the map, valid inside this txn
        with self.env.begin(db=self.data, buffers=True) as txn:
            for i, k in enumerate(keys):
                consume(i, k, txn.get(k))

    # -- writes ----------------------------------------------------------------
    def _used_bytes(self) -> int:
        info, stat = self.env.info(), self.env.stat()
        return (info["last_pgno"] + 1) * stat["psize"]

    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        if not items:
            return
        import lmdb

        need = sum(len(k) + len(v) for k, v in items)
        if need > self.capacity // 2:
            raise ValueError(f"a batch of {need} bytes cannot fit a pool of {self.capacity}")
        with self._lock:
            # LMDB's map never shrinks (freed pages are reused), so "used" is a
            # high-water mark: evict on MapFullError, not on a fill level.
            for attempt in range(4):
                try:
                    self._write(items)
                    return
                except lmdb.MapFullError:
                    self._evict(need * (attempt + 2))
            raise RuntimeError("pool full: eviction could not make room")

    def _write(self, items: list[tuple[bytes, bytes]]) -> None:
        now = _T.pack(time.time())
        with self.env.begin(write=True) as txn:
            for k, v in items:
                txn.put(k, v, db=self.data)
                txn.put(k, now, db=self.atime)

    def touch(self, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        if not keys:
            return
        import lmdb

        now = _T.pack(time.time())
        try:
            with self.env.begin(write=True, db=self.atime) as txn:
                for k in keys:
                    txn.put(k, now)
        except lmdb.MapFullError:
            pass  # touching is best effort

    def delete(self, keys: Iterable[bytes]) -> None:
        with self.env.begin(write=True) as txn:
            for k in keys:
                txn.delete(k, db=self.data)
                txn.delete(k, db=self.atime)

    def _evict(self, need: int) -> None:
        """Delete least recently used entries (never ones used in the last
        ``pin_seconds``) to free about ``evict_fraction`` of the pool."""
        target = max(need * 2, int(self.capacity * self.evict_fraction))
        cutoff = time.time() - self.pin_seconds
        with self.env.begin(db=self.atime, buffers=False) as txn:
            entries = [(_T.unpack(v)[0], k) for k, v in txn.cursor()
                       if not k.startswith(_TICK)]
        entries.sort()
        victims, freed = [], 0
        with self.env.begin(db=self.data, buffers=True) as txn:
            for t, k in entries:
                if t > cutoff or freed >= target:
                    break
                v = txn.get(k)
                freed += len(k) + (len(v) if v is not None else 0)
                victims.append(k)
        if not victims:
            return
        self.delete(victims)
        # freed pages become reusable only after a later write txn commits
        for _ in range(2):
            with self.env.begin(write=True, db=self.atime) as txn:
                txn.put(_TICK, _U64.pack(self.evictions))
        self.evictions += 1
        self.evicted_entries += len(victims)
        logger.info("vllm-layerwise-patch pool: evicted %d entries (%d bytes)",
                    len(victims), freed)

    def stats(self) -> dict[str, int]:
        with self.env.begin() as txn:
            entries = txn.stat(self.data)["entries"]
        return {"entries": entries, "used_bytes": self._used_bytes(),
                "capacity_bytes": self.capacity, "evictions": self.evictions,
                "evicted_entries": self.evicted_entries}

    def close(self) -> None:
        self.refs -= 1
        if self.refs <= 0 and not self.closed:
            self.closed = True
            self.env.close()
