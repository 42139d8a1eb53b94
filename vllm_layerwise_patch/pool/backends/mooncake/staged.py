"""Block objects through a same-node client (``client_address``): whole
objects, a staging region at a time.  :class:`StagedReads`, which
:class:`.mooncake.MooncakeBackend` holds and its ranged reads
(:mod:`.mooncake.ranges`) hand planned objects to.

Such a client has no get sessions (``batch_get_session_start`` answers
-600), its ranged reads (``get_into_ranges``) ask the master once per object
and call - a layer of 8 blocks is 8 queries, a 48-layer hit 384 - and it can
register nothing but the holder's shared memory, so no read lands in a KV
page.  So the first layer's read of a step takes every planned object of
the step (:meth:`plan_loads`) whole, in batches of ``batch_get_into`` of at
most a staging region each (one master query per batch), and copies each slot's
payload straight into its layer's page, keeping the slot's header; every
layer then gets its headers (the backend's ``read_direct``) and checks its
pages in place, as after a zero-copy read.  Up to three batches are read
at once, each into a region of its own (when free) by a thread that copies
it into the pages as soon as it arrives, whichever batch the holder
finishes first (it serves them one after another, not in the order asked):
the holder's copy of one batch and ours of another overlap.

Each slot is served once (its page holds this step's bytes only until the
step's compute moves on); a later read of it reads again.  The price is
the layer overlap: the first layer waits for the whole step.
A slot whose page cannot take a direct copy (several pages per key, or a
page that is not plain host memory) keeps a copy of its value for the
backend's ``read_many``; an object larger than a region, or a key not
planned, is read as ranges (``get_into_ranges``).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import threading
from typing import Any

from ..base import HEADER_SIZE, VALUE_OFFSET
from .staging import slot_value as _value


#: batches of whole objects in flight at once (a region each, when free)
STAGE_REGIONS = 3
#: a batch is at least this large (smaller ones cost more than they overlap)
MIN_BATCH = 8 << 20


class StagedReads:
    """The step's planned objects (``stage``), read whole through the
    staging buffer by up to ``STAGE_REGIONS`` threads, and what each read
    left for the layers to take."""

    def __init__(self, conn: Any, layouts: Any, cfg: Any, calls: Any) -> None:
        self.conn, self.layouts, self.cfg, self.calls = conn, layouts, cfg, calls
        self.stage: dict[str, tuple[Any, int]] = {}  # object -> (layout, slots)
        self._stage_dest: dict[str, dict[int, tuple[int, int] | None]] = {}
        self._stage_keys: dict[bytes, tuple] = {}  # planned key -> where (locate)
        #: read objects -> {slot: its header, or its whole value (no page)}
        #: or the error code of the failed read
        self._staged: dict[str, dict[int, bytes] | int] = {}
        self._kept = 0  # bytes of whole values kept this step
        self._kept_lock = threading.Lock()
        self._stage_pool: cf.ThreadPoolExecutor | None = None
        self._plan_lock = threading.Lock()

    def plan_loads(self, tasks: dict[str, list]) -> None:
        """Record the step's objects and where each slot's page is."""
        with self._plan_lock:
            self.stage, self._stage_dest, self._staged, self._kept = {}, {}, {}, 0
            self._stage_keys = {}
            for items in tasks.values():
                for key, dests in items:
                    where = self.layouts.locate(key)
                    if where is None:
                        continue
                    self._stage_keys[key] = where
                    lay, obj, slot, n = where
                    self.stage[obj] = (lay, n)
                    d = dests[0] if len(dests) == 1 else None
                    ok = (d is not None and d.device.type == "cpu" and d.is_contiguous()
                          and d.element_size() * d.numel() <= lay.slot - HEADER_SIZE)
                    self._stage_dest.setdefault(obj, {})[slot] = (
                        (d.data_ptr(), d.element_size() * d.numel()) if ok else None)

    def _stage_threads(self) -> cf.ThreadPoolExecutor:
        if self._stage_pool is None:
            self._stage_pool = cf.ThreadPoolExecutor(STAGE_REGIONS,
                                                     thread_name_prefix="vlp-mc-stage")
        return self._stage_pool

    def _object_bytes(self, obj: str) -> int:
        """A planned object's size: its slots, header and page each."""
        lay, n = self.stage[obj]
        return lay.slot * n

    def _fill(self, store: Any) -> None:
        """Read every planned object not read yet (``_plan_lock`` held): up
        to ``STAGE_REGIONS`` batches in flight, each in a region of its own
        and copied out by the thread that read it, the next batch taking the
        region of whichever finished first."""
        staging = self.conn.staging
        room = staging.region_size - 64  # (objects start VALUE_OFFSET past a line)
        todo = [o for o in self.stage if o not in self._staged
                and self._object_bytes(o) <= room]  # (others: ranges)
        if not todo:
            return
        regions = [staging.acquire()]
        running: dict[cf.Future, int] = {}
        try:
            total = sum(self._object_bytes(o) for o in todo)
            while len(regions) < STAGE_REGIONS and total > room * len(regions):
                extra = staging.try_acquire()
                if extra is None:
                    break
                regions.append(extra)
            # batches: as even as the regions allow (concurrent reads go faster)
            share = min(room, max(MIN_BATCH, -(-total // len(regions))))
            chunks: list[list[str]] = []
            used = share
            for o in todo:
                size = self._object_bytes(o)
                if used + size > share:
                    chunks.append([])
                    used = 0
                chunks[-1].append(o)
                used += size
            pool, left = self._stage_threads(), iter(chunks)

            def submit(region: int) -> None:  # the next chunk, if any, into ``region``
                chunk = next(left, None)
                if chunk is not None:
                    running[pool.submit(self._read_chunk, store, chunk, region)] = region
                    self.calls["whole_gets"] += 1

            for r in regions:
                submit(r)
            while running:  # (in the order they finish: the holder's are not FIFO)
                done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    r = running.pop(fut)
                    fut.result()
                    submit(r)
        finally:
            for fut in running:  # (never release a region still being written)
                try:
                    fut.result()
                except Exception:  # noqa: BLE001
                    pass
            for r in regions:
                staging.release(r)

    def _read_chunk(self, store: Any, chunk: list[str], region: int) -> None:
        """Read ``chunk`` into ``region`` and copy it out (a stage thread:
        its copy overlaps the holder's copy of the next chunk)."""
        got = self._get_chunk(store, chunk, region)
        self.conn.check([rc for _, rc in got], "get")
        self._copy_out(chunk, got)

    def _get_chunk(self, store: Any, chunk: list[str], region: int) -> list[tuple[int, int]]:
        """(address, code) of each object of ``chunk`` read whole into ``region``."""
        ptrs, sizes, at = [], [], region + VALUE_OFFSET  # (payloads on cache lines)
        for o in chunk:
            ptrs.append(at)
            sizes.append(self._object_bytes(o))
            at += sizes[-1]
        rcs = store.batch_get_into(chunk, ptrs, sizes)
        return [(p, rc if rc != s else 0) for p, s, rc in zip(ptrs, sizes, rcs)]

    def _copy_out(self, chunk: list[str], got: list[tuple[int, int]]) -> None:
        """Each read slot's payload into its page, its header kept; a slot
        without a page keeps its whole value (at most ``local_buffer_size``
        bytes of them a step; beyond, ranges)."""
        view = self.conn.staging.view
        for o, (ptr, rc) in zip(chunk, got):
            if rc != 0:
                self._staged[o] = min(rc, -1)
                continue
            lay = self.stage[o][0]
            kept: dict[int, bytes] = {}
            for slot, dest in self._stage_dest[o].items():
                base = ptr + slot * lay.slot
                if dest is None:
                    with self._kept_lock:  # (stage threads copy out at once)
                        keep = self._kept + lay.slot <= self.cfg.local_buffer_size
                        self._kept += lay.slot if keep else 0
                    if keep:
                        kept[slot] = bytes(_value(view(base, lay.slot)))
                else:
                    ctypes.memmove(dest[0], base + HEADER_SIZE, dest[1])
                    kept[slot] = bytes(view(base, HEADER_SIZE))
            self._staged[o] = kept

    def direct(self, store: Any, keys: list[bytes], ptrs: list[int],
               lengths: list[int]) -> list[bytes | None] | None:
        """Headers of planned slots whose pages the step's whole reads wrote
        (None: not every key is such a slot; the caller reads them)."""
        known = self._stage_keys
        where = [known.get(k) or self.layouts.locate(k) for k in keys]
        with self._plan_lock:
            for w, p, n in zip(where, ptrs, lengths):
                if w is None or self._stage_dest.get(w[1], {}).get(w[2]) != (p, n):
                    return None
            self._fill(store)
            if any(w[1] not in self._staged for w in where):
                return None  # (larger than a region)
            if any(not isinstance(self._staged[w[1]], int) and w[2] not in self._staged[w[1]]
                   for w in where):
                return None  # (served already: read again)
            out: list[bytes | None] = []
            for k, w in zip(keys, where):
                got = self._staged[w[1]]
                if isinstance(got, int):
                    self.conn.failed(got, k)
                    out.append(None)
                else:
                    out.append(got.pop(w[2]))
            return out

    def read(self, store: Any, keys: list[bytes], where: dict[int, tuple], consume,
             ranged: list[str], by_obj: dict[str, list[int]]) -> dict[str, list[int]]:
        """Serve ``read_many``'s slots of planned objects from the step's
        whole reads; returns the slots left for ranges (object -> indices)."""
        left: dict[str, list[int]] = {}
        with self._plan_lock:
            if any(o in self.stage for o in ranged):
                self._fill(store)
            for o in ranged:
                got = self._staged.get(o)
                for i in by_obj[o]:
                    slot = where[i][2]
                    if got is None:
                        left.setdefault(o, []).append(i)
                    elif isinstance(got, int):
                        self.conn.failed(got, keys[i])
                        consume(i, keys[i], None)
                    elif slot not in got:
                        left.setdefault(o, []).append(i)
                    elif self._stage_dest[o].get(slot) is None:
                        consume(i, keys[i], got.pop(slot))
                    else:  # (its page holds the payload)
                        ptr, n = self._stage_dest[o][slot]
                        consume(i, keys[i], got.pop(slot) + ctypes.string_at(ptr, n))
        return left

    def close(self) -> None:
        """Let the reading threads go (the backend closes)."""
        if self._stage_pool is not None:
            self._stage_pool.shutdown(wait=False)
