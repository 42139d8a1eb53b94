"""Block objects on Mooncake (key format 5): one object per (block, kind,
rank) - and per next token for a block's drafter pages - holding every
layer's page as a byte range, instead of one object per page plus a commit
marker.  Here: where each page key lives (:class:`ObjectLayouts`) and the
writes of whole objects (:class:`ObjectWrites`); their reads are
:mod:`.mooncake.ranges`, :mod:`.mooncake.whole` and :mod:`.mooncake.staged`.

Why: every Mooncake object costs master operations (a put is a PutStart and
a PutEnd, a get a replica-list query, each with a lease, an allocation and a
replica record).  With an object per layer a 48-layer model made 48 of each
per block and rank, and at 160 KiB pages that per-object cost, not the
copy, set the speed.  A block object makes them one.

Layout (the connector tells the backend its layers: :meth:`set_layout`)::

    <ns>/<kind>/<hash>/tp<r>/B        the block's target pages of that kind
    <ns>/attn/<hash>/tp<r>/B@<t>      the block's drafter pages (next token t)

Slot ``i`` (``i``-th layer of the kind in forward order) is at
``i * slot`` and holds a whole value (its own header: length, checksum,
namespace), ``slot`` = header + the layout's largest page.  Pool keys stay
what the rest of the pool uses (``.../L<layer>``, ``.../commit``): the
backend maps a page key to its object's range and a marker to the object.

* Commit: a put of an object is atomic in Mooncake (readable only after its
  PutEnd; a holder dying in the transfer revokes it), so the object's
  existence is the commit; markers are not stored.  ``put_many`` writes an
  object only when its marker is in the batch (every layer saved) and every
  slot is there; an incomplete block is not written at all.
* Saves: each packed page (the send thread's copy, with its padding: a
  slot) is put straight from the pack memory, registered with
  ``zero_copy_saves`` on a client of its own; otherwise (a same-node client,
  or a value not from the pack memory) it is copied into the registered
  staging buffer first.  A step's objects are written by one
  ``batch_put_from_multi_buffers`` per region-full; a put that fails with a
  transfer error (-800: a holder just restarted) is retried once, then
  counted (``put_skipped``) and the step's save fails (a failed save).  A put of an existing object
  keeps it (same key, same content).
* Loads: a layer's pages are byte ranges of the objects.  The first layer
  of a hit starts a *get session* (``batch_get_session_start``: one
  replica-list query for all of the step's objects, the read leases
  granted), every layer then reads its ranges with
  ``batch_get_into_multi_buffer_ranges`` without asking the master again;
  the session ends once every slot was read (or after
  ``SESSION_SECONDS``).  Layer ``i`` can thus be used while later layers
  are in flight (the layerwise overlap), at one master query per hit.
  Reads of every slot of an object at once (the lookup's verification)
  read the whole object (``batch_get_into``).  A worker holding a segment
  reads whole objects straight into the KV pages instead
  (:mod:`.mooncake.whole`: local replicas copy at memcpy speed, ranges do
  not).  A same-node client has no get sessions: it reads the step's
  objects whole, a staging region at a time (:mod:`.mooncake.staged`).
  ``get_into_ranges`` asks the master once per object and call (48 x 8
  queries for 8 blocks of 48 layers, measured), the session once: it only
  serves such a client's reads that no load plan announced (or an object
  larger than a staging region).
* A replica list cached in a session can outlive the object only past
  its read lease; if the object was removed meanwhile and another object
  of the same size took its extent, a range reads that object's slot - a
  sound value of the same namespace.  Each slot's header names the key it
  was written under (:func:`..base.key_digest`), so such a read fails its
  check (``other-key``) and takes the load-failure path.
* Hit cache: the backend's ``generation()`` counts this process's own
  stores and removals and moves its epoch whenever the master goes away or
  comes back; Mooncake tells nothing of other clients' stores or of its
  evictions, so the scheduler keeps answers at most ``hit_cache_seconds``
  (its ``hit_cache_cap``): a block another engine saved meanwhile is missed
  for that long, an evicted one taken for a hit fails its load and the
  request recomputes - never wrong tokens.
* Old keys (format 4: per-layer objects and markers) live under other
  namespaces (the key version is part of the namespace) and are never read.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any

from ...faults import faults
from ...keys import ATTN, COMMIT, STATE, layer_id
from ..base import HEADER_SIZE, VALUE_OFFSET, BackendError, PoolFull
from .staging import NO_SPACE, describe

TRANSFER_FAIL = -800
EXISTS = -705
DRAFT = "draft"


class ObjectLayout:
    """Where each page key of one namespace lives: (object, slot, slots)."""

    def __init__(self, ns: bytes, slots: dict[str, list[str]], page_bytes: int) -> None:
        self.prefix = ns.hex() + "/"
        self.index = {k: {lid: i for i, lid in enumerate(ids)} for k, ids in slots.items()}
        self.count = {k: len(ids) for k, ids in slots.items()}
        self.slot = (HEADER_SIZE + page_bytes + 63) & ~63

    @classmethod
    def of(cls, ns: bytes, layout: Any) -> ObjectLayout:
        drafter = layout.drafter_layers
        return cls(ns, {ATTN: [layer_id(n) for n in layout.layers(ATTN) if n not in drafter],
                        STATE: [layer_id(n) for n in layout.layers(STATE)],
                        DRAFT: [layer_id(n) for n in layout.layers(ATTN) if n in drafter]},
                   layout.page_bytes)

    def locate(self, key: str) -> tuple[str, int, int] | None:
        """(object, slot or -1 for a marker, slots in the object), or None
        for a key that is no page or marker of this layout."""
        if not key.startswith(self.prefix):
            return None
        group, _, last = key.rpartition("/")
        parts = group.split("/")
        if len(parts) != 4 or parts[1] not in (ATTN, STATE):
            return None
        name, _, token = last.partition("@")
        kind = DRAFT if token and parts[1] == ATTN else parts[1]
        obj = group + "/B" + (f"@{token}" if token else "")
        if name == COMMIT:
            return (obj, -1, self.count[kind]) if self.count[kind] else None
        if name[:1] == "L" and name[1:] in self.index[kind]:
            return obj, self.index[kind][name[1:]], self.count[kind]
        return None


class ObjectLayouts:
    """The layouts of the namespaces whose pages are block objects
    (``known``), and each key's place in them."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.known: list[ObjectLayout] = []

    def set_layout(self, ns: bytes, layout: Any) -> None:
        """Store this namespace's pages as block objects (see module doc)."""
        if not getattr(self.cfg, "block_objects", True):
            return
        new = ObjectLayout.of(ns, layout)
        self.known = [x for x in self.known if x.prefix != new.prefix] + [new]

    def locate(self, key: bytes) -> tuple[ObjectLayout, str, int, int] | None:
        if not self.known:
            return None
        name = key.decode()
        for lay in self.known:
            where = lay.locate(name)
            if where is not None:
                return (lay, *where)
        return None

    def names(self, keys: Iterable[bytes]) -> list[str]:
        """The Mooncake name each key is kept under."""
        out = []
        for k in keys:
            where = self.locate(k)
            out.append(k.decode() if where is None else where[1])
        return out


class ObjectWrites:
    """Puts of whole block objects: from the pack memory where it is
    registered, else through the staging buffer; a transfer failure retried
    once, then counted (``put_skipped``)."""

    def __init__(self, conn: Any, layouts: ObjectLayouts, cfg: Any, log: Any,
                 calls: Any) -> None:
        self.conn, self.layouts = conn, layouts
        self.cfg, self.log, self.calls = cfg, log, calls
        self.put_skipped = 0  # objects given up after a retried transfer failure
        self._inject_put_fails = faults().mooncake_put_transfer_fails  # (tests)

    def split(self, items: list[tuple[bytes, Any]]):
        """(plain items, {object: (layout, values per slot)}) of a put; only
        objects whose marker is in the batch and whose slots are all there."""
        plain, objs, committed = [], {}, set()
        for k, v in items:
            where = self.layouts.locate(k)
            if where is None:
                plain.append((k, v))
                continue
            lay, obj, slot, n = where
            if slot < 0:
                committed.add(obj)
            else:
                objs.setdefault(obj, (lay, [None] * n))[1][slot] = v
        full = {}
        for obj in committed:
            lay, values = objs.get(obj, (None, [None]))
            if any(v is None or len(v) > lay.slot for v in values):
                self.log.warning("incomplete", "vllm-layerwise-patch pool: block object %r "
                                 "committed without all its pages; not stored (further "
                                 "ones are not logged)", obj)
                continue
            full[obj] = (lay, values)
        return plain, full

    def put(self, store: Any, objs: dict[str, tuple[ObjectLayout, list]]) -> None:
        """Write the objects :meth:`split` found whole, one
        ``batch_put_from_multi_buffers`` per staging region's worth."""
        from mooncake.store import ReplicateConfig

        self.conn.register_offered()
        config = ReplicateConfig()
        config.replica_num = self.cfg.replica_num
        if self.conn.local_segment:
            config.preferred_segment = self.conn.local_segment
        staging = self.conn.staging
        todo = list(objs.items())
        retry: list = []
        with staging.region() as region:
            for attempt in (0, 1):
                while todo:
                    names, ptrs, sizes, used = [], [], [], 0
                    while todo:
                        obj, (lay, values) = todo[0]
                        need = len(values) * (lay.slot + 64)
                        if need > staging.region_size:
                            raise PoolFull(f"block object {obj!r} ({need} bytes) does not fit "
                                           f"a staging region of {staging.region_size} bytes: "
                                           "raise mooncake.local_buffer_size")
                        if used + need > staging.region_size:
                            break
                        todo.pop(0)
                        p, s = [], []
                        for v in values:
                            at = self._in_pack_memory(v, lay.slot)
                            if at is not None:  # (its padding follows it there)
                                p.append(at)
                                s.append(lay.slot)
                                self.calls["slots_from_pack"] += 1
                                continue
                            ptr = region + used + VALUE_OFFSET
                            staging.view(ptr, len(v))[:] = v
                            p.append(ptr)
                            s.append(len(v))
                            if len(v) < lay.slot:  # (a smaller page: pad its slot)
                                pad = lay.slot - len(v)
                                staging.view(ptr + len(v), pad)[:] = bytes(pad)
                                s[-1] = lay.slot
                            used = (used + VALUE_OFFSET + lay.slot + 63) & ~63
                        names.append(obj)
                        ptrs.append(p)
                        sizes.append(s)
                    rcs = self._put_batch(store, names, ptrs, sizes, config)
                    self.conn.check(rcs, "put")
                    self.calls["put_objects"] += 1
                    bad = [(o, rc) for o, rc in zip(names, rcs) if rc not in (0, EXISTS)]
                    if attempt == 0:  # (a holder just restarted: once more)
                        retry += [(o, objs[o]) for o, rc in bad if rc == TRANSFER_FAIL]
                        bad = [(o, rc) for o, rc in bad if rc != TRANSFER_FAIL]
                    else:
                        self.put_skipped += sum(rc == TRANSFER_FAIL for _, rc in bad)
                    for obj, rc in bad:
                        if rc == NO_SPACE:
                            raise PoolFull(f"Mooncake put of {obj!r}: {describe(rc)}")
                    if bad:
                        obj, rc = bad[0]
                        raise BackendError(f"Mooncake put of {obj!r}: {describe(rc)}"
                                           + (" (retried once)" if attempt else ""))
                todo, retry = retry, []

    def _in_pack_memory(self, value: Any, slot: int) -> int | None:
        """The address of a value packed in registered pack memory, whose
        padding fills its slot (:class:`...worker.send_thread.PackArena`), else None."""
        if not isinstance(value, memoryview) or (len(value) + 63) & ~63 != slot:
            return None
        try:
            at = ctypes.addressof(ctypes.c_char.from_buffer(value))
        except (TypeError, ValueError):  # (read-only)
            return None
        return at if self.conn.save_memory.covers([at], [slot]) else None

    def _put_batch(self, store: Any, names: list[str], ptrs: list, sizes: list, config: Any
                   ) -> list[int]:
        """One ``batch_put_from_multi_buffers``; with the fault injection
        ``mooncake_put_transfer_fails`` (tests) the first objects of the
        process report -800 instead, not written."""
        fail = max(0, min(self._inject_put_fails, len(names)))
        if not fail:
            return list(store.batch_put_from_multi_buffers(names, ptrs, sizes, config))
        self._inject_put_fails -= fail
        rest = (store.batch_put_from_multi_buffers(names[fail:], ptrs[fail:], sizes[fail:],
                                                   config) if fail < len(names) else [])
        return [TRANSFER_FAIL] * fail + list(rest)
