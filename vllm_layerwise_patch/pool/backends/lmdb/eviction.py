"""The eviction that :class:`.lmdb.LmdbBackend` holds: the least recently
used unpinned groups go, chosen inside the write transactions that delete
them (access times read there), in chunks; tiny write transactions after
each let LMDB reuse the freed pages (it does so only after a later commit).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable
from typing import Any

from ..generation import REMOVALS

logger = logging.getLogger("vllm.layerwise_patch")

_T = struct.Struct(">d")  # big-endian positive doubles sort by value
_GROUP = struct.Struct(">dQ")  # a group's record: last use, bytes
_TICK = b"\0vlp-tick"


class LruEviction:
    """Makes room in a full map; counts its rounds (``evictions``) and the
    groups it dropped (``evicted_groups``)."""

    CHUNK_BYTES = 32 << 20  # bytes freed per eviction transaction, at most
    CHUNK_GROUPS = 4096  # and groups (other engines' writes wait for each chunk)

    def __init__(self, env: Any, dbs: tuple[Any, Any, Any], gen: Any, *,
                 txn: Callable[..., Any], pinned: Callable[[Any, bytes, bytes], bool],
                 drop: Callable[[Any, bytes], int], map_size: Callable[[], int],
                 fraction: float) -> None:
        """``dbs``: the backend's (groups, lru, pins) databases; ``txn``, its
        transactions (``txn(write=True)``); ``pinned`` and ``drop``, its
        checks for a live pin and removal of a whole group, inside a
        transaction; ``map_size``, the map's size now (it grows)."""
        self.env, self.gen = env, gen
        self.groups, self.lru, self.pins = dbs
        self._txn, self._pinned, self._drop = txn, pinned, drop
        self.map_size = map_size
        self.fraction = fraction  # of the map freed by one round
        self.evictions = self.evicted_groups = 0

    def evict(self, need: int) -> int:
        """Delete the least recently used unpinned groups to free about
        ``fraction`` of the pool, in write transactions of at most
        ``CHUNK_BYTES`` bytes each (victims chosen inside each).  Returns the
        bytes freed (0: nothing could go).

        Chunks, because a transaction that frees pages must itself write -
        copies of the B-tree pages it changes and the freed page numbers -
        and a full map has no page for that: one transaction freeing a tenth
        of a 2 GiB map failed to commit (MDB_MAP_FULL), and the pool saved
        nothing again.  A chunk that still finds no room is halved, down to
        one group."""
        import lmdb

        self.env.reader_check()  # slots of killed readers would pin old pages
        target = max(need * 2, int(self.map_size() * self.fraction))
        chunk = self.CHUNK_BYTES
        freed = dropped = 0
        while freed < target:
            try:
                got, n = self._chunk(min(chunk, target - freed))
            except lmdb.MapFullError:
                if chunk <= 1:
                    break
                chunk //= 2
                continue
            if not n:
                break
            freed, dropped = freed + got, dropped + n
            self._tick()  # freed pages become reusable only after a later commit
        if not dropped:
            return 0
        self._tick()
        self.evictions += 1
        self.evicted_groups += dropped
        logger.info("vllm-layerwise-patch pool: evicted %d blocks (%d bytes)", dropped, freed)
        return max(freed, 1)

    def _chunk(self, budget: int) -> tuple[int, int]:
        """One write transaction dropping the oldest unpinned groups, until
        ``budget`` bytes or ``CHUNK_GROUPS`` groups (at least one group):
        (bytes freed, groups)."""
        now_t = _T.pack(time.time())
        freed = 0
        with self._txn(write=True) as txn:
            begun = self.gen.begin(REMOVALS)  # (a failed commit leaves it odd: no caching)
            victims = []
            for key, _ in txn.cursor(db=self.lru):
                group = bytes(key[_T.size:])
                if self._pinned(txn, group, now_t):
                    continue  # a pending load reads it
                victims.append(group)
                freed += _GROUP.unpack(txn.get(group, db=self.groups))[1]
                if freed >= budget or len(victims) >= self.CHUNK_GROUPS:
                    break
            for group in victims:
                self._drop(txn, group)
        self.gen.end(REMOVALS, begun)
        return freed, len(victims)

    def _tick(self) -> None:
        """A tiny commit; a map so full that even it finds no page (the pages
        just freed are still held by older readers' snapshots) is left to the
        put's next attempt: the put is skipped (PoolFull) if no room comes."""
        import lmdb

        try:
            with self._txn(write=True) as txn:
                txn.put(_TICK, _T.pack(time.time()), db=self.pins)
        except lmdb.MapFullError:
            pass
