"""Block objects on Mooncake (key format 5): one object per (block, kind,
rank) - and per next token for a block's drafter pages - holding every
layer's page as a byte range, instead of one object per page plus a commit
marker.  A mixin of :class:`.mooncake.MooncakeBackend`.

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
* Saves: each page is copied once into the registered staging buffer (its
  slot's place) and a step's objects are written by one
  ``batch_put_from_multi_buffers`` per region-full; a put that fails with a
  transfer error (-800: a holder just restarted) is retried once, then
  skipped and counted (``put_skipped``).  A put of an existing object
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
  read the whole object (``batch_get_into``).  ``get_into_ranges`` was not
  used: it asks the master once per object and call (48 x 8 queries for
  8 blocks of 48 layers, measured), the session once.
* A replica list cached in a session can outlive the object only past
  its read lease; each range carries its own header and checksum, so such
  a read fails its check and takes the load-failure path.
* Old keys (format 4: per-layer objects and markers) live under other
  namespaces (the key version is part of the namespace) and are never read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from ..keys import ATTN, COMMIT, STATE, layer_id
from .base import HEADER_SIZE, VALUE_OFFSET, BackendError, PoolFull
from .mooncake_io import MISSING, NO_SPACE, describe

TRANSFER_FAIL = -800
EXISTS = -705
SESSION_SECONDS = 5.0
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


class BlockObjects:
    """The block-object paths of :class:`.mooncake.MooncakeBackend`."""

    _layouts: list[ObjectLayout]

    def _init_objects(self) -> None:
        self._layouts = []
        self._sessions: dict[str, tuple[float, set[int]]] = {}  # object -> (start, slots left)
        self._session_lock = threading.Lock()
        self.put_skipped = 0  # objects given up after a retried transfer failure

    def set_layout(self, ns: bytes, layout: Any) -> None:
        """Store this namespace's pages as block objects (see module doc)."""
        new = ObjectLayout.of(ns, layout)
        self._layouts = [x for x in self._layouts if x.prefix != new.prefix] + [new]

    def _locate(self, key: bytes) -> tuple[ObjectLayout, str, int, int] | None:
        if not self._layouts:
            return None
        name = key.decode()
        for lay in self._layouts:
            where = lay.locate(name)
            if where is not None:
                return (lay, *where)
        return None

    def _names(self, keys: Iterable[bytes]) -> list[str]:
        """The Mooncake name each key is kept under."""
        out = []
        for k in keys:
            where = self._locate(k)
            out.append(k.decode() if where is None else where[1])
        return out

    # -- writes ----------------------------------------------------------------
    def _split_puts(self, items: list[tuple[bytes, Any]]):
        """(plain items, {object: (layout, values per slot)}) of a put; only
        objects whose marker is in the batch and whose slots are all there."""
        plain, objs, committed = [], {}, set()
        for k, v in items:
            where = self._locate(k)
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

    def _put_objects(self, store: Any, objs: dict[str, tuple[ObjectLayout, list]]) -> None:
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.replica_num = self.cfg.replica_num
        if self._local_segment:
            config.preferred_segment = self._local_segment
        staging = self._staging
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
                    rcs = store.batch_put_from_multi_buffers(names, ptrs, sizes, config)
                    self._check(rcs, "put")
                    self.calls["put_objects"] += 1
                    for obj, rc in zip(names, rcs):
                        if rc in (0, EXISTS):
                            continue
                        if rc == NO_SPACE:
                            raise PoolFull(f"Mooncake put of {obj!r}: {describe(rc)}")
                        if rc == TRANSFER_FAIL and attempt == 0:
                            retry.append((obj, objs[obj]))
                            continue
                        if rc == TRANSFER_FAIL:
                            self.put_skipped += 1
                        raise BackendError(f"Mooncake put of {obj!r}: {describe(rc)}")
                todo, retry = retry, []

    # -- reads -----------------------------------------------------------------
    def _end_sessions(self, store: Any, names: list[str]) -> None:
        if names:
            try:
                store.batch_get_session_end(names)
            except Exception:  # noqa: BLE001 - local: drops cached replica lists
                pass

    def _session(self, store: Any, want: dict[str, set[int]], n_slots: dict[str, int]
                 ) -> dict[str, int]:
        """Objects of ``want`` (object -> slots read now) in a get session:
        {object: 0} or the error code of a session start that failed."""
        now = time.monotonic()
        out: dict[str, int] = {}
        with self._session_lock:
            stale = [o for o, (t, _) in self._sessions.items() if now - t > SESSION_SECONDS]
            for o in stale:
                del self._sessions[o]
            self._end_sessions(store, stale)
            start = [o for o in want if o not in self._sessions]
            if start:
                rcs = store.batch_get_session_start(start)
                self._check(rcs, "get")
                self.calls["get_sessions"] += 1
                for o, rc in zip(start, rcs):
                    if rc == 0:
                        self._sessions[o] = (now, set(range(n_slots[o])))
                    else:
                        out[o] = rc
            for o in want:
                out.setdefault(o, 0)
        return out

    def _done_reading(self, store: Any, read: dict[str, set[int]]) -> None:
        ended = []
        with self._session_lock:
            for o, slots in read.items():
                entry = self._sessions.get(o)
                if entry is not None:
                    entry[1].difference_update(slots)
                    if not entry[1]:
                        del self._sessions[o]
                        ended.append(o)
        self._end_sessions(store, ended)

    def _read_objects(self, store: Any, keys: list[bytes], where: dict[int, tuple],
                      consume, sizes: list[int] | None) -> None:
        """Read the located keys ``where`` (index -> (layout, object, slot,
        slots)): whole objects when every slot is asked for, else ranges in a
        get session; ``consume(i, key, value or None)``."""
        by_obj: dict[str, list[int]] = {}
        for i, (_lay, obj, _slot, _n) in where.items():
            by_obj.setdefault(obj, []).append(i)
        whole = [o for o, idx in by_obj.items()
                 if len({where[i][2] for i in idx}) == where[idx[0]][3]]
        ranged = [o for o in by_obj if o not in set(whole)]
        staging = self._staging
        with staging.region() as region:
            if whole:
                total = [where[by_obj[o][0]][3] * where[by_obj[o][0]][0].slot for o in whole]
                for a, b, ptrs in staging.runs(region, total):
                    rcs = store.batch_get_into(whole[a:b], ptrs, total[a:b])
                    self._check(rcs, "get")
                    for o, ptr, rc, size in zip(whole[a:b], ptrs, rcs, total[a:b]):
                        for i in by_obj[o]:
                            lay, slot = where[i][0], where[i][2]
                            if rc != size:
                                self._failed(rc, keys[i])
                                consume(i, keys[i], None)
                            else:
                                consume(i, keys[i], _value(staging.view(ptr + slot * lay.slot,
                                                                        lay.slot)))
            if not ranged:
                return
            n_slots = {o: where[by_obj[o][0]][3] for o in ranged}
            want = {o: {where[i][2] for i in by_obj[o]} for o in ranged}
            started = self._session(store, want, n_slots)
            for o in ranged:
                if started[o] != 0:
                    for i in by_obj[o]:
                        self._failed(started[o], keys[i])
                        consume(i, keys[i], None)
            live = [o for o in ranged if started[o] == 0]
            flat = [i for o in live for i in by_obj[o]]
            lens = [min(where[i][0].slot, sizes[i] if sizes else where[i][0].slot)
                    for i in flat]
            for a, b, ptrs in staging.runs(region, lens):
                chunk = flat[a:b]
                objs = list(dict.fromkeys(where[i][1] for i in chunk))
                at = {i: (p, n) for i, p, n in zip(chunk, ptrs, lens[a:b])}
                groups = [[i for i in chunk if where[i][1] == o] for o in objs]
                rcs = store.batch_get_into_multi_buffer_ranges(
                    objs, [[at[i][0] for i in g] for g in groups],
                    [[at[i][1] for i in g] for g in groups],
                    [[where[i][2] * where[i][0].slot for i in g] for g in groups])
                self._check(rcs, "get")
                self.calls["ranged_gets"] += 1
                for g, rc in zip(groups, rcs):
                    ok = rc == sum(at[i][1] for i in g)
                    for i in g:
                        if not ok:
                            self._failed(rc, keys[i])
                        consume(i, keys[i], _value(staging.view(*at[i])) if ok else None)
        self._done_reading(store, want)

    def _direct_objects(self, store: Any, keys: list[bytes], where: list[tuple],
                        ptrs: list[int], lengths: list[int]) -> list[bytes | None]:
        """Zero-copy ranges: each slot's header into the staging region, its
        payload straight into the page (in a get session)."""
        by_obj: dict[str, list[int]] = {}
        for i, (_lay, obj, _slot, _n) in enumerate(where):
            by_obj.setdefault(obj, []).append(i)
        want = {o: {where[i][2] for i in idx} for o, idx in by_obj.items()}
        started = self._session(store, want, {o: where[idx[0]][3] for o, idx in by_obj.items()})
        out: list[bytes | None] = [None] * len(keys)
        live = [o for o in by_obj if started[o] == 0]
        flat = [i for o in live for i in by_obj[o]]
        staging = self._staging
        with staging.region() as region:
            for a, b, heads in staging.runs(region, [HEADER_SIZE] * len(flat)):
                chunk = flat[a:b]
                head = dict(zip(chunk, heads))
                objs = list(dict.fromkeys(where[i][1] for i in chunk))
                groups = [[i for i in chunk if where[i][1] == o] for o in objs]
                rcs = store.batch_get_into_multi_buffer_ranges(
                    objs, [[x for i in g for x in (head[i], ptrs[i])] for g in groups],
                    [[x for i in g for x in (HEADER_SIZE, lengths[i])] for g in groups],
                    [[x for i in g for x in (where[i][2] * where[i][0].slot,
                                             where[i][2] * where[i][0].slot + HEADER_SIZE)]
                     for g in groups])
                self._check(rcs, "get")
                self.calls["ranged_gets"] += 1
                for g, rc in zip(groups, rcs):
                    ok = rc == sum(HEADER_SIZE + lengths[i] for i in g)
                    for i in g:
                        if ok:
                            out[i] = bytes(staging.view(head[i], HEADER_SIZE))
                        else:
                            self._failed(rc, keys[i])
        for o in by_obj:
            if started[o] != 0 and started[o] != MISSING:
                for i in by_obj[o]:
                    self._failed(started[o], keys[i])
        self._done_reading(store, want)
        return out


def _value(view: memoryview) -> memoryview:
    """A slot's value without the slot's padding (its header says how long
    the payload is; a slot that holds no header is passed whole, for the
    caller's check to reject)."""
    if view.nbytes < HEADER_SIZE:
        return view
    length = int.from_bytes(view[8:16], "little")
    return view[:HEADER_SIZE + length] if HEADER_SIZE + length <= view.nbytes else view
