"""Whole block objects, read once per step: straight into the KV pages for a
worker that holds a
segment of the pool (``global_segment_size`` > 0): its own saves sit in its
own segment (``prefer_local_segment``) and Mooncake copies a whole object
from a local replica at memcpy speed, while a ranged read of the same bytes
goes through the transfer engine (measured: 3.3-3.8 GB/s whole, 1.9 GB/s as
ranges, memcpy 3.8 GB/s, 160 KiB pages).  :class:`WholeReads`, which
:class:`.mooncake.MooncakeBackend` holds and its ranged reads
(:mod:`.mooncake.ranges`) hand planned objects to.

The load pipeline announces a step's loads (:meth:`plan_loads`, every
layer's key -> page); the first layer that reads an object then reads the
whole object with one ``batch_get_into_multi_buffers``: each slot's header
into a registered header area, its payload straight into that layer's page
(a slot no page of this step takes, and each slot's padding, into a
scratch area).  Later layers find their pages already written and get the
headers to check them (each page is still checked before use, in place).
The price: the first layer waits for the whole block (no layer overlap for
these objects) - at memcpy speed.

A same-node client (``client_address``) reads whole objects too, through
its staging buffer (:mod:`.mooncake.staged`).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from ..base import HEADER_SIZE

#: header area: this many headers per step at most (others load as ranges)
HEADERS = 16384


class WholeReads:
    """The step's plan (``plan``: object -> slot -> its page; ``plan_keys``:
    key -> (object, slot, page address)) and the whole reads that serve it."""

    def __init__(self, conn: Any, layouts: Any, calls: Any) -> None:
        self.conn, self.layouts, self.calls = conn, layouts, calls
        self.plan: dict[str, dict[int, tuple[int, int]]] = {}  # object -> slot -> (ptr, len)
        self._plan_slots: dict[str, tuple[Any, int]] = {}  # object -> (layout, slots)
        self.plan_keys: dict[bytes, tuple[str, int, int]] = {}  # key -> (object, slot, ptr)
        self._heads: dict[str, int | None] = {}  # fetched object -> its header area
        self._plan_lock = threading.Lock()
        self._head_buf: Any = None

    def _head_area(self, slot: int) -> int | None:
        """The registered header and scratch area (allocated once)."""
        need = HEADERS * HEADER_SIZE + slot
        if self._head_buf is None or len(self._head_buf) < need:
            buf = (ctypes.c_ubyte * need)()
            if self.conn.store.register_buffer(ctypes.addressof(buf), need) != 0:
                return None
            self._head_buf = buf
        return ctypes.addressof(self._head_buf)

    def plan_loads(self, tasks: dict[str, list]) -> None:
        """A step's loads (layer -> [(key, [page tensor])]): whole objects
        where this process holds a segment and reads into registered pages."""
        conn = self.conn
        with self._plan_lock:
            self.plan, self._plan_slots, self._heads, self.plan_keys = {}, {}, {}, {}
            if not (conn.segment_mounted and self.layouts.known and conn.store is not None):
                return
            found = []
            for items in tasks.values():
                for key, dests in items:
                    where = self.layouts.locate(key)
                    if where is None or len(dests) != 1 or dests[0].device.type != "cpu":
                        continue
                    found.append((key, where, dests[0].data_ptr(), dests[0].numel()))
            every = conn.memory.covers([f[2] for f in found], [f[3] for f in found])
            for key, (lay, obj, slot, n), ptr, size in found:
                if every or conn.memory.covers([ptr], [size]):
                    self.plan.setdefault(obj, {})[slot] = (ptr, size)
                    self._plan_slots[obj] = (lay, n)
                    self.plan_keys[key] = (obj, slot, ptr)

    def _whole(self, store: Any, objs: list[str]) -> None:
        """Read ``objs`` whole into their planned pages (``_plan_lock`` held)."""
        todo = [o for o in objs if o not in self._heads]
        if not todo:
            return
        lay = self._plan_slots[todo[0]][0]
        base = self._head_area(lay.slot)
        used = sum(self._plan_slots[o][1] for o in self._heads if self._heads[o] is not None)
        if base is None or used + sum(self._plan_slots[o][1] for o in todo) > HEADERS:
            for o in todo:
                self._heads[o] = None  # (read as ranges instead)
            return
        scratch = base + HEADERS * HEADER_SIZE
        ptrs, sizes, heads = [], [], {}
        for o in todo:
            lay, n = self._plan_slots[o]
            heads[o] = base + used * HEADER_SIZE
            p, s = [], []
            for slot in range(n):
                page = self.plan[o].get(slot)
                p.append(heads[o] + slot * HEADER_SIZE)
                s.append(HEADER_SIZE)
                rest = lay.slot - HEADER_SIZE
                if page is not None and page[1] <= rest:
                    p.append(page[0])
                    s.append(page[1])
                    rest -= page[1]
                if rest:
                    p.append(scratch)
                    s.append(rest)
            ptrs.append(p)
            sizes.append(s)
            used += n
        rcs = store.batch_get_into_multi_buffers(todo, ptrs, sizes)
        self.conn.check(rcs, "get")
        self.calls["whole_gets"] += 1
        for o, rc in zip(todo, rcs):
            lay, n = self._plan_slots[o]
            self._heads[o] = heads[o] if rc == n * lay.slot else min(rc, -1)

    def direct_planned(self, store: Any, keys: list[bytes], ptrs: list[int]
                       ) -> list[bytes | None] | None:
        """Headers of a layer whose every key the step planned into these
        pages (the whole read done by the first such layer), found by key -
        no parsing, no range checks; None: not such a layer (the caller
        takes the general path)."""
        got = [self.plan_keys.get(k) for k in keys]
        if any(g is None or g[2] != p for g, p in zip(got, ptrs)):
            return None
        out: list[bytes | None] = [None] * len(keys)
        where = [(None, obj, slot, None) for obj, slot, _ in got]
        if self.direct(store, keys, where, ptrs, out):
            return None  # (an object read as ranges)
        return out

    def direct(self, store: Any, keys: list[bytes], where: list[tuple],
               ptrs: list[int], out: list) -> list[int]:
        """Serve the slots of planned objects (their pages written by a whole
        read); returns the indices left for ranged reads."""
        with self._plan_lock:
            mine = [i for i, w in enumerate(where)
                    if self.plan.get(w[1], {}).get(w[2], (None,))[0] == ptrs[i]]
            self._whole(store, list(dict.fromkeys(where[i][1] for i in mine)))
            left, planned = [], set(mine)
            for i in range(len(keys)):
                head = self._heads.get(where[i][1]) if i in planned else None
                if head is None:
                    left.append(i)
                elif head < 0:  # the whole read failed: this page's load fails
                    self.conn.failed(head, keys[i])
                else:
                    at = head + where[i][2] * HEADER_SIZE
                    out[i] = bytes((ctypes.c_ubyte * HEADER_SIZE).from_address(at))
        return left
