"""Promotion: copying a block read from the far tier into the near tier.

Values read from the far tier are offered here as they pass (a load reads
a block's layers one at a time, the lookup's verification all of them at
once); each is copied, and gathered by block object (a block's pages of one
kind on one rank, and a drafter's pages per next token: the units of
:mod:`..mooncake.objects`).  Once every slot of an object is there, a
background thread - never the load's - checks every value (length,
checksum, namespace, the key it was written under: :func:`..base.unpack`)
and writes the pages with their commit marker in one near-tier write (one
LMDB transaction): a reader of the near tier sees the whole block or
nothing, never a torn entry.  A value that fails its check refuses the
whole block (counted).  An object the near tier already commits is
skipped.  At most ``pending`` objects wait for their slots; past it the
oldest is dropped (counted) and stays a far-tier hit; so is a block
completed while ``pending`` others wait for their write.  With ``after`` > 1 a
block is promoted only on its ``after``-th far hit seen here (a block read
once does not evict one read often from a small near tier).

Without block objects (``mooncake.block_objects: false``) nothing is
promoted: the tier does not know which keys make a block."""

from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import Any

from ...faults import faults
from ...logs import LogOnce
from ..base import CorruptEntry, pack, unpack
from ..mooncake.objects import ObjectLayout

logger = logging.getLogger("vllm.layerwise_patch")


def marker_of(obj: str) -> bytes:
    """The commit marker of block object ``obj`` (``<group>/B[@t]``)."""
    group, _, last = obj.rpartition("/")
    token = last.partition("@")[2]
    return (group + "/commit" + (f"@{token}" if token else "")).encode()


class Promoter:
    def __init__(self, near: Any, counts: Any, pending: int = 64,
                 log: LogOnce | None = None, after: int = 1) -> None:
        self.near = near
        self.after = max(1, int(after))  # promote on the after-th far hit of a block
        self._hits: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.counts = counts  # (the tiered backend's counters, under its lock)
        self.limit = max(1, int(pending))
        self.log = log or LogOnce()
        self.layouts: list[ObjectLayout] = []
        self._pending: collections.OrderedDict[str, tuple[ObjectLayout, list]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.closed = False

    def set_layout(self, ns: bytes, layout: Any) -> None:
        new = ObjectLayout.of(ns, layout)
        self.layouts = [x for x in self.layouts if x.prefix != new.prefix] + [new]

    def _locate(self, key: bytes):
        name = bytes(key).decode(errors="replace")
        for lay in self.layouts:
            where = lay.locate(name)
            if where is not None:
                return (lay, *where)
        return None

    def offer(self, key: bytes, value: Any) -> None:
        """A value just read from the far tier (copied here: the reader's
        buffer is reused once the read returns)."""
        if self.closed or not self.layouts:
            return
        where = self._locate(key)
        if where is None or where[2] < 0:
            return
        lay, obj, slot, n = where
        item = (bytes(key), bytes(value))  # (the copy, outside the lock)
        done = None
        with self._lock:
            entry = self._pending.get(obj)
            if entry is None:
                while len(self._pending) >= self.limit:
                    self._pending.popitem(last=False)
                    self.counts.add("promotions_dropped")
                entry = self._pending[obj] = (lay, [None] * n)
            entry[1][slot] = item
            if all(v is not None for v in entry[1]):
                done = self._pending.pop(obj)
                if not self._due(obj):
                    done = None
        if done is not None:
            if self._q.qsize() >= self.limit:  # (the writes fall behind: bounded memory)
                self.counts.add("promotions_dropped")
                return
            self._start()
            self._q.put((obj, *done))

    def _due(self, obj: str) -> bool:
        """Count a far hit of ``obj``: True once it reached ``after`` (the
        counts of the most recent 65536 blocks are kept)."""
        if self.after == 1:
            return True
        n = self._hits.pop(obj, 0) + 1
        if n >= self.after:
            return True
        self._hits[obj] = n
        while len(self._hits) > 65536:
            self._hits.popitem(last=False)
        return False

    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="vlp-promote",
                                                    daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                self._promote(*job)
            except Exception as exc:  # noqa: BLE001 - a promotion is never worth an error
                self.counts.add("promotions_failed")
                self.log.warning("promote", "vllm-layerwise-patch pool: a promotion into the "
                                 "near tier failed (%s); the block stays a far-tier hit "
                                 "(further failures are not logged)", exc)
            finally:
                self._q.task_done()

    def _promote(self, obj: str, lay: ObjectLayout, values: list) -> None:
        marker = marker_of(obj)
        if self.near.exists_many([marker])[0]:
            return  # (saved or promoted meanwhile)
        ns = bytes.fromhex(lay.prefix[:-1])
        try:
            for key, value in values:
                unpack(key, value, ns)
        except CorruptEntry as err:
            self.counts.add("promotions_refused")
            self.log.warning("promote-" + err.kind, "vllm-layerwise-patch pool: %s; that "
                             "block is not promoted into the near tier (further ones are "
                             "not logged)", err)
            return
        items = list(values) + [(marker, pack(ns, marker, b""))]
        if faults().tiered_promote_torn:  # (tests: a torn promoted copy)
            items = items[:len(values) - 1] + items[len(values):]
        self.near.put_many(items)
        self.counts.add("promoted_blocks")

    def wait(self, timeout: float = 30.0) -> bool:
        """Until every queued promotion is written (tests); False on timeout."""
        done = threading.Event()
        threading.Thread(target=lambda: (self._q.join(), done.set()), daemon=True).start()
        return done.wait(timeout)

    def close(self) -> None:
        self.closed = True
        with self._lock:
            self._pending.clear()
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=10)
