"""Distributed pool backend on Mooncake Store: engines on many machines share
one pool (``kv_connector_extra_config.backend = "mooncake"``).

Data path: one staging buffer per process, registered with the store
(``register_buffer``; from the shared-memory pool of a same-node
``mooncake_client`` with ``client_address``), cut into regions so the load
threads, the send thread and the scheduler each move a batch at a time.
Loads with a client of its own (no ``client_address``): the KV cache's host
memory is registered too (:meth:`register_memory`), and one
``batch_get_into_multi_buffers`` call puts each header into the region and
its payload straight into the KV page, checked there before use (a failed
check fails that load: the request recomputes).  A same-node client can
register only the holder's shared memory: values are ``batch_get_into`` the
region, then each is checked and copied into its KV page.  Saves of block
objects are put straight from the save path's registered pack memory
(``zero_copy_saves``, a client of its own) or copied into the region first;
other keys are packed into the region and written with
``batch_upsert_from``; both into the segment this process holds first
(``prefer_local_segment``: its own hits are then a local copy).

Mooncake's semantics, and what the pool does about them:

* pages are kept as block objects (:mod:`.mooncake.objects`, key format 5:
  one object per block, kind and rank, each layer a byte range): a put of
  an object is atomic, its existence the commit - no markers are stored;
* other keys (and every key with ``block_objects: false``, the per-layer
  layout): a put on an existing key keeps the old value, so they use
  upsert; no transactions: a block's pages are written first, its commit
  marker (``.../commit``, a drafter's ``.../commit@<t>``) only after every
  page was stored, so a reader never sees half a block;
* eviction is Mooncake's own (approximate LRU at a high watermark, skipping
  objects under a read lease, silently): a block found at lookup can be gone
  at load - that request takes vLLM's load-failure path and recomputes; the
  lookup's verification reads grant the leases that keep a hit's pages for
  the load (``pin``/``touch`` have nothing more to do);
* a dead segment holder's keys stay listed for a while (reads fail with
  TRANSFER_FAIL): those loads fail and recompute;
* error codes become one clear log line each (missing object, buffer too
  small, no segment / no space, transfer failure, master unreachable);
* a master that is down (at startup or later) makes every operation fail
  fast (the pool serves no hits and saves nothing, logged once); every
  ``reconnect_seconds`` the connection is tried again in a background
  thread, never in the caller's (:mod:`.mooncake.connection`); Mooncake's client
  reconnects by itself once the master answers.  ``setup`` is only attempted
  when the master's port accepts a connection (Mooncake's own setup blocks
  for about 90 s against a dead master).

Security: Mooncake has no authentication.  ``MC_TCP_BIND_ADDRESS`` defaults
to 127.0.0.1 here (the address advertised to peers); the master should
listen on loopback or a trusted network only (``mooncake-local`` does).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable
from typing import Any

from ...config import PREFIX, PoolConfigError
from ...keys import is_marker
from ...logs import LogOnce
from ..base import HEADER_SIZE, Backend, BackendError, PoolFull
from .connection import MooncakeConnection
from .objects import BlockObjects
from .staging import (MISSING, NO_SPACE, TOO_SMALL, UNREACHABLE,
                          BackendUnavailable, Registered, describe)

logger = logging.getLogger("vllm.layerwise_patch")

_SHARED: dict[tuple[int, str, str], MooncakeBackend] = {}
_SHARED_LOCK = threading.Lock()


def open_shared(cfg: Any, *, on_unavailable: str, segment: bool) -> MooncakeBackend:
    """One client per master per process (the scheduler and worker connectors
    share it when vLLM runs in-process); a worker mounts its segment."""
    key = (os.getpid(), cfg.master_address, cfg.client_address or "")
    with _SHARED_LOCK:
        backend = _SHARED.get(key)
        if backend is None or backend.closed:
            backend = _SHARED[key] = MooncakeBackend(cfg, on_unavailable=on_unavailable)
        backend.refs += 1
    if segment:
        backend.mount_segment()
    return backend


class MooncakeBackend(BlockObjects, MooncakeConnection, Backend):
    def __init__(self, cfg: Any, *, on_unavailable: str = "recompute") -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", cfg.local_hostname)
        if cfg.protocol == "tcp":
            os.environ.setdefault("MC_FORCE_TCP", "1")
        self.cfg = cfg
        self.on_unavailable = on_unavailable
        self._memory = Registered()  # host memory for zero-copy loads
        self._save_memory = Registered()  # pack memory saves put from directly
        self._offered: list[tuple[int, int]] = []  # pack memory not registered yet
        self._offered_lock = threading.Lock()
        self.log = LogOnce()
        self.refs = 0
        self.closed = False
        self._init_objects()
        self._init_connection()
        try:
            self._connect()
        except BackendUnavailable as exc:
            if on_unavailable == "fail":
                raise PoolConfigError(
                    f"{PREFIX}.mooncake.master_address: {exc} (on_backend_unavailable="
                    "'fail'; 'recompute' starts the engine without pool hits until the "
                    "master is reachable)") from None
            self._mark_down(str(exc))

    def _check(self, codes: Iterable[int], op: str) -> None:
        """Master unreachable anywhere in a batch: mark down and raise."""
        if any(c == UNREACHABLE for c in codes):
            self._mark_down(f"Mooncake {op}: master at {self.cfg.master_address} "
                            f"unreachable ({describe(UNREACHABLE)})")
            raise BackendUnavailable(f"Mooncake master at {self.cfg.master_address} is "
                                     "unreachable")

    def _failed(self, code: int, key: bytes) -> None:
        if code != MISSING:  # (a missing value is the common, expected case)
            self.log.warning(f"code{code}", "vllm-layerwise-patch pool: Mooncake get of %r: "
                             "%s (further %d codes are not logged)", key, describe(code), code)

    # -- reads -----------------------------------------------------------------
    def exists_many(self, keys: Iterable[bytes]) -> list[bool]:
        """(A page or marker of a block object: whether the object exists.)"""
        keys = self._names(keys)
        if not keys:
            return []
        store = self._ready()
        unique = list(dict.fromkeys(keys))
        found = dict(zip(unique, store.batch_is_exist(unique)))
        rcs = [found[k] for k in keys]
        self._check(rcs, "exists")
        if any(r < 0 for r in rcs):
            raise BackendError(f"Mooncake batch_is_exist returned {sorted(set(rcs))}")
        return [r == 1 for r in rcs]

    def read_many(self, keys: list[bytes], consume, sizes: list[int] | None = None) -> None:
        if not keys:
            return
        store = self._ready()
        where = {i: w for i, w in enumerate(map(self._locate, keys)) if w is not None}
        if where:  # block objects' slots (mooncake.objects)
            self._read_objects(store, keys, where, consume, sizes)
            rest = [i for i in range(len(keys)) if i not in where]
            if rest:
                self.read_many([keys[i] for i in rest],
                               lambda j, k, v: consume(rest[j], k, v),
                               None if sizes is None else [sizes[i] for i in rest])
            return
        names = [k.decode() for k in keys]
        if sizes is None:  # (callers pass them: the page size is known)
            sizes = [max(store.get_size(k), 1) for k in names]
        staging = self._staging
        with staging.region() as region:
            for i, j, ptrs in staging.runs(region, sizes):  # one call per region-full
                rcs = store.batch_get_into(names[i:j], ptrs, sizes[i:j])
                self._check(rcs, "get")
                for n, ptr, rc in zip(range(i, j), ptrs, rcs):
                    if rc >= 0:
                        consume(n, keys[n], staging.view(ptr, rc))
                    else:
                        self._failed(rc, keys[n])
                        # bigger than the page it should hold: not ours
                        consume(n, keys[n], b"" if rc == TOO_SMALL else None)

    # -- zero-copy loads and saves -----------------------------------------------
    def _register(self, ptr: int, size: int, memory: Registered) -> None:
        rc = self._store.register_buffer(ptr, size)
        if rc == 0:
            memory.add(ptr, size)
        else:
            what = "pack memory" if memory is self._save_memory else "KV cache"
            self.log.warning(f"register-{what}", "vllm-layerwise-patch pool: Mooncake "
                             "register_buffer of the %s returned %s; it goes through the "
                             "staging buffer", what, describe(rc))

    def register_memory(self, ptr: int, size: int, saves: bool = False) -> bool:
        """Zero-copy loads into the KV cache (``zero_copy_loads``), or with
        ``saves`` puts straight from the save path's pack memory
        (``zero_copy_saves``), on a client of its own only: a same-node
        client (``client_address``) can register nothing but the holder's
        shared memory.  Registered memory is open to the transfer engine's
        peers, as the staging buffer is (no auth).  Pack memory is only
        taken note of here (the packing thread never waits for a connect
        attempt); the send thread registers it before its next put."""
        if self.cfg.client_address or not (self.cfg.zero_copy_saves if saves
                                           else self.cfg.zero_copy_loads):
            return False
        if saves:  # (offered by whoever packs - the forward thread on CPU: never waits)
            with self._offered_lock:
                self._offered.append((ptr, size))
            return True
        with self._conn_lock:  # (a connect in the background registers what is wanted)
            self._want(ptr, size, self._memory)
        return True

    def _want(self, ptr: int, size: int, memory: Registered) -> None:
        """Register now if connected, and on every connect (``_conn_lock`` held)."""
        memory.wanted.append((ptr, size))
        if self._store is not None:
            self._register(ptr, size, memory)

    def _register_offered(self) -> None:
        """Register the pack memory offered since the last put (the send
        thread, before a put): not while a connect attempt holds the
        connection - that put goes through the staging buffer."""
        if not self._offered or not self._conn_lock.acquire(blocking=False):
            return
        try:
            with self._offered_lock:
                offered, self._offered = self._offered, []
            for ptr, size in offered:
                self._want(ptr, size, self._save_memory)
        finally:
            self._conn_lock.release()

    def read_direct(self, keys: list[bytes], ptrs: list[int], lengths: list[int]
                    ) -> list[bytes | None] | None:
        """Headers into the staging region, payloads straight into the pages
        (one ``batch_get_into_multi_buffers`` call per region-full)."""
        if keys and self.cfg.client_address and self._stage:  # (mooncake.staged)
            return self._direct_staged(self._ready(), keys, ptrs, lengths)
        if keys and self._plan_keys:  # (mooncake.whole: a step planned whole)
            got = self._direct_planned(self._ready(), keys, ptrs)
            if got is not None:
                return got
        if not keys or not self._memory.covers(ptrs, lengths):
            return None
        store = self._ready()
        where = [self._locate(k) for k in keys]
        if all(w is not None for w in where):  # block objects' slots (mooncake.objects)
            return self._direct_objects(store, keys, where, ptrs, lengths)
        if any(w is not None for w in where):
            return None  # (a mix: read_many sorts it out)
        names = [k.decode() for k in keys]
        out: list[bytes | None] = []
        staging = self._staging
        with staging.region() as region:
            for i, j, heads in staging.runs(region, [HEADER_SIZE] * len(keys)):
                rcs = store.batch_get_into_multi_buffers(
                    names[i:j], [[h, p] for h, p in zip(heads, ptrs[i:j])],
                    [[HEADER_SIZE, n] for n in lengths[i:j]])
                self._check(rcs, "get")
                for n, head, rc in zip(range(i, j), heads, rcs):
                    if rc == HEADER_SIZE + lengths[n]:
                        out.append(bytes(staging.view(head, HEADER_SIZE)))
                    else:  # missing, or a value of another size: not this page's
                        self._failed(rc, keys[n])
                        out.append(None if rc == MISSING else b"")
        return out

    def get_many(self, keys: list[bytes], sizes: list[int] | None = None) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)

        def keep(i: int, _k: bytes, v: Any) -> None:
            out[i] = None if v is None else bytes(v)

        self.read_many(keys, keep, sizes)
        return out

    # -- writes ----------------------------------------------------------------
    def _upsert(self, store: Any, items: list[tuple[bytes, bytes]]) -> None:
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.replica_num = self.cfg.replica_num
        if self._local_segment:  # (Mooncake falls back to other segments when full)
            config.preferred_segment = self._local_segment
        staging = self._staging
        with staging.region() as region:
            for i, j, ptrs in staging.runs(region, [len(v) for _, v in items], PoolFull):
                for (_, v), ptr in zip(items[i:j], ptrs):
                    staging.view(ptr, len(v))[:] = v
                batch = items[i:j]
                rcs = store.batch_upsert_from([k.decode() for k, _ in batch], ptrs,
                                              [len(v) for _, v in batch], config)
                self._check(rcs, "put")
                bad = [(k, rc) for (k, _), rc in zip(batch, rcs) if rc != 0]
                if bad:
                    key, rc = bad[0]
                    if rc == NO_SPACE:
                        raise PoolFull(f"Mooncake put of {key!r}: {describe(rc)}")
                    raise BackendError(f"Mooncake put of {key!r}: {describe(rc)}")

    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        """Block objects of a layout (:meth:`set_layout`) as whole objects;
        other keys: pages first, commit markers (a drafter's ``commit@<t>``
        too) only once every page is stored."""
        if not items:
            return
        store = self._ready()
        items, objects = self._split_puts(items)
        with self._moving("_stores"):
            if objects:  # block objects (mooncake.objects): no markers
                self._put_objects(store, objects)
            pages = [(k, v) for k, v in items if not is_marker(k)]
            markers = [(k, v) for k, v in items if is_marker(k)]
            self._upsert(store, pages)
            self._upsert(store, markers)

    def delete(self, keys: Iterable[bytes]) -> None:
        """(A block object's page: the whole object.)"""
        keys = list(dict.fromkeys(self._names(keys)))
        if keys:
            with self._moving("_removals"):
                self._check(self._ready().batch_remove(keys, True), "remove")

    def delete_groups(self, groups: Iterable[bytes]) -> None:
        groups = [g.decode() for g in dict.fromkeys(groups)]
        if groups:
            pattern = "^(" + "|".join(re.escape(g) for g in groups) + ")/"
            with self._moving("_removals"):
                rc = self._ready().remove_by_regex(pattern, True)
            self._check([rc], "remove")

    def stats(self) -> dict[str, int]:
        return {"available": int(not self._down)}

    def close(self) -> None:
        self.refs -= 1
        if self.refs <= 0 and not self.closed:
            self.closed = True
            if self._stage_pool is not None:  # (mooncake.staged's readers)
                self._stage_pool.shutdown(wait=False)
            if self._store is not None:
                try:
                    self._store.close()
                except Exception:  # noqa: BLE001
                    pass
