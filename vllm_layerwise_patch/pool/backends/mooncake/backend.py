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
  once the master has answered a request within ``connect_timeout_seconds``
  (against a master that accepts connections and never answers, Mooncake's
  own setup stops the whole process for about ten minutes).

Security: Mooncake has no authentication.  ``MC_TCP_BIND_ADDRESS`` defaults
to 127.0.0.1 here (the address advertised to peers); the master should
listen on loopback or a trusted network only (``mooncake-local`` does).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterable
from typing import Any

from ...config import PREFIX, PoolConfigError
from ...keys import is_marker
from ...logs import LogOnce
from ..base import Backend, BackendError, values_from_reads
from ..generation import Generation
from .connection import MooncakeConnection
from .objects import ObjectLayouts, ObjectWrites
from .plain import PlainValues
from .ranges import RangeReads
from .staged import StagedReads
from .staging import BackendUnavailable
from .whole import WholeReads

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


class MooncakeBackend(Backend):
    """The backend, built from the pieces of this package and delegating to
    them: ``conn`` (:mod:`.connection`: the master, staging buffer, segment
    and registered memory; built first and given to every other piece),
    ``layouts`` (:mod:`.objects`: where block objects' pages live),
    ``writes`` (puts of block objects), the readers ``ranges`` (get
    sessions and byte ranges), ``whole`` (own-segment whole reads) and
    ``staged`` (same-node staged reads), and ``plain`` (keys that are no
    block object's page).  It counts its own stores and removals
    (:meth:`generation`)."""

    def __init__(self, cfg: Any, *, on_unavailable: str = "recompute") -> None:
        self.cfg = cfg
        self.on_unavailable = on_unavailable
        self.log = LogOnce()
        self.refs = 0
        self.closed = False
        self._stores = self._removals = 0  # this process's own writes (generation())
        self.conn = MooncakeConnection(cfg, self.log)
        self.layouts = ObjectLayouts(cfg)
        self.writes = ObjectWrites(self.conn, self.layouts, cfg, self.log, self.calls)
        self.whole = WholeReads(self.conn, self.layouts, self.calls)
        self.staged = StagedReads(self.conn, self.layouts, cfg, self.calls)
        self.ranges = RangeReads(self.conn, cfg, self.calls, self.whole, self.staged)
        self.plain = PlainValues(self.conn, cfg)
        try:
            self.conn.connect()
        except BackendUnavailable as exc:
            if on_unavailable == "fail":
                raise PoolConfigError(
                    f"{PREFIX}.mooncake.master_address: {exc} (on_backend_unavailable="
                    "'fail'; 'recompute' starts the engine without pool hits until the "
                    "master is reachable)") from None
            self.conn.mark_down(str(exc))

    # -- what the rest of the pool reads ----------------------------------------
    @property
    def epoch(self) -> int:
        """Moves when the master goes away and when it answers again."""
        return self.conn.epoch

    @property
    def attempts(self) -> int:
        """Connect attempts after the first (tests)."""
        return self.conn.attempts

    @property
    def put_skipped(self) -> int:
        """Block objects given up after a retried transfer failure."""
        return self.writes.put_skipped

    @property
    def hit_cache_cap(self) -> float:
        """The longest the scheduler's hit cache may keep an answer."""
        return float(getattr(self.cfg, "hit_cache_seconds", 0.0))

    def generation(self) -> Generation | None:
        """This process's stores and removals and the connection's epoch (see
        :mod:`.objects`); None (nothing cached) without block objects."""
        if not self.layouts.known or not self.hit_cache_cap:
            return None
        return Generation(self.conn.epoch, self._stores, self._removals)

    @contextlib.contextmanager
    def _moving(self, counter: str):
        """Move ``counter`` to odd before a write and to even after it."""
        setattr(self, counter, getattr(self, counter) + 1)
        try:
            yield
        finally:
            setattr(self, counter, getattr(self, counter) + 1)

    def set_layout(self, ns: bytes, layout: Any) -> None:
        """Store this namespace's pages as block objects (:mod:`.objects`)."""
        self.layouts.set_layout(ns, layout)

    def mount_segment(self) -> None:
        """Contribute this process's segment (workers), now or on connect."""
        self.conn.mount_segment()

    def plan_loads(self, tasks: dict[str, list]) -> None:
        """A step's loads (layer -> [(key, [page tensor])]): whole objects
        where this process holds a segment and reads into registered pages
        (:mod:`.whole`), or through a same-node client (:mod:`.staged`)."""
        if self.cfg.client_address:
            self.staged.plan_loads(tasks if self.layouts.known else {})
        else:
            self.whole.plan_loads(tasks)

    # -- reads -----------------------------------------------------------------
    def exists_many(self, keys: Iterable[bytes]) -> list[bool]:
        """(A page or marker of a block object: whether the object exists.)"""
        keys = self.layouts.names(keys)
        if not keys:
            return []
        store = self.conn.ready()
        unique = list(dict.fromkeys(keys))
        found = dict(zip(unique, store.batch_is_exist(unique)))
        rcs = [found[k] for k in keys]
        self.conn.check(rcs, "exists")
        if any(r < 0 for r in rcs):
            raise BackendError(f"Mooncake batch_is_exist returned {sorted(set(rcs))}")
        return [r == 1 for r in rcs]

    def read_many(self, keys: list[bytes], consume, sizes: list[int] | None = None) -> None:
        if not keys:
            return
        store = self.conn.ready()
        where = {i: w for i, w in enumerate(map(self.layouts.locate, keys)) if w is not None}
        if where:  # block objects' slots (mooncake.objects)
            self.ranges.read(store, keys, where, consume, sizes)
            rest = [i for i in range(len(keys)) if i not in where]
            if rest:
                self.read_many([keys[i] for i in rest],
                               lambda j, k, v: consume(rest[j], k, v),
                               None if sizes is None else [sizes[i] for i in rest])
            return
        self.plain.read(store, keys, consume, sizes)

    # -- zero-copy loads and saves -----------------------------------------------
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
        self.conn.register_memory(ptr, size, saves)
        return True

    def read_direct(self, keys: list[bytes], ptrs: list[int], lengths: list[int]
                    ) -> list[bytes | None] | None:
        """Headers into the staging region, payloads straight into the pages
        (one ``batch_get_into_multi_buffers`` call per region-full)."""
        if keys and self.cfg.client_address and self.staged.stage:  # (mooncake.staged)
            return self.staged.direct(self.conn.ready(), keys, ptrs, lengths)
        if keys and self.whole.plan_keys:  # (mooncake.whole: a step planned whole)
            got = self.whole.direct_planned(self.conn.ready(), keys, ptrs)
            if got is not None:
                return got
        if not keys or not self.conn.memory.covers(ptrs, lengths):
            return None
        store = self.conn.ready()
        where = [self.layouts.locate(k) for k in keys]
        if all(w is not None for w in where):  # block objects' slots (mooncake.objects)
            return self.ranges.direct(store, keys, where, ptrs, lengths)
        if any(w is not None for w in where):
            return None  # (a mix: read_many sorts it out)
        return self.plain.direct(store, keys, ptrs, lengths)

    def get_many(self, keys: list[bytes], sizes: list[int] | None = None) -> list[bytes | None]:
        return values_from_reads(self, keys, sizes)

    # -- writes ----------------------------------------------------------------
    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        """Block objects of a layout (:meth:`set_layout`) as whole objects;
        other keys: pages first, commit markers (a drafter's ``commit@<t>``
        too) only once every page is stored."""
        if not items:
            return
        store = self.conn.ready()
        items, objects = self.writes.split(items)
        with self._moving("_stores"):
            if objects:  # block objects (mooncake.objects): no markers
                self.writes.put(store, objects)
            pages = [(k, v) for k, v in items if not is_marker(k)]
            markers = [(k, v) for k, v in items if is_marker(k)]
            self.plain.upsert(store, pages)
            self.plain.upsert(store, markers)

    def delete(self, keys: Iterable[bytes]) -> None:
        """(A block object's page: the whole object.)"""
        keys = list(dict.fromkeys(self.layouts.names(keys)))
        if keys:
            with self._moving("_removals"):
                self.conn.check(self.conn.ready().batch_remove(keys, True), "remove")

    def delete_groups(self, groups: Iterable[bytes]) -> None:
        groups = [g.decode() for g in dict.fromkeys(groups)]
        if groups:
            pattern = "^(" + "|".join(re.escape(g) for g in groups) + ")/"
            with self._moving("_removals"):
                rc = self.conn.ready().remove_by_regex(pattern, True)
            self.conn.check([rc], "remove")

    def stats(self) -> dict[str, int]:
        return {"available": int(not self.conn.down)}

    def close(self) -> None:
        self.refs -= 1
        if self.refs <= 0 and not self.closed:
            self.closed = True
            self.staged.close()  # (mooncake.staged's readers)
            self.conn.close()
