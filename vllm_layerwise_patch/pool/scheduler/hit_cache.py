"""The scheduler's hit cache: which commit markers exist, and which groups
were verified, remembered so repeated lookups of a prefix cost no backend
call - and never stale.

Each answer is kept with the backend's generation noted *before* it was
asked (:meth:`..backends.base.Backend.generation`: how many stores and
removals any process made, and the generation file's epoch).  A cached miss
holds while no store happened since; a cached hit, and a verification, while
no removal happened since; both for at most ``ttl`` seconds and within one
epoch.  So a block saved by any engine on the pool is a hit at the next
lookup, and an evicted or dropped block is never reported from the cache.
A removal moves the generation before it becomes visible and a removal
counter left odd (a writer killed between its commit and settling the
counter, :mod:`..backends.generation`) caches no hit or verification.
Where the backend has no generation (Mooncake: its eviction is silent)
nothing is cached.  Bounded to ``size`` entries (least recently used go
first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from ..backends.generation import Generation


def _same_stores(a: Generation, b: Generation) -> bool:
    return a.epoch == b.epoch and a.stores == b.stores


def _same_removals(a: Generation, b: Generation) -> bool:
    return a.epoch == b.epoch and a.removals == b.removals and b.removals_settled


class HitCache:
    def __init__(self, ttl: float = 30.0, size: int = 200_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.size = size
        self.clock = clock
        self._present: OrderedDict[bytes, tuple[bool, float, Generation]] = OrderedDict()
        self._verified: OrderedDict[bytes, tuple[float, Generation]] = OrderedDict()
        self.hits = self.misses = 0  # answers from the cache / from the backend

    @property
    def enabled(self) -> bool:
        return self.ttl > 0 and self.size > 0

    def _keep(self, table: OrderedDict, key: bytes, value) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self.size:
            table.popitem(last=False)

    def presence(self, keys: list[bytes], gen: Generation | None,
                 query: Callable[[list[bytes]], list[bool]]) -> list[bool]:
        """Whether each key exists: cached answers where still exact, the
        rest in one ``query`` call."""
        if gen is None or not self.enabled:
            return query(keys) if keys else []
        now = self.clock()
        out: list[bool | None] = []
        ask: list[int] = []
        for i, key in enumerate(keys):
            entry = self._present.get(key)
            if entry is not None:
                present, at, was = entry
                fresh = now - at < self.ttl
                if fresh and (_same_removals(was, gen) if present else _same_stores(was, gen)):
                    self._present.move_to_end(key)
                    out.append(present)
                    continue
            out.append(None)
            ask.append(i)
        self.hits += len(keys) - len(ask)
        self.misses += len(ask)
        if ask:
            found = query([keys[i] for i in ask])
            for i, present in zip(ask, found):
                out[i] = present
                if gen.removals_settled or not present:
                    self._keep(self._present, keys[i], (present, now, gen))
        return out  # type: ignore[return-value]

    def verified(self, group: bytes, gen: Generation | None) -> bool:
        """The group's pages were read and checked since the last removal."""
        if gen is None or not self.enabled:
            return False
        entry = self._verified.get(group)
        return (entry is not None and self.clock() - entry[0] < self.ttl
                and _same_removals(entry[1], gen))

    def mark_verified(self, groups: list[bytes], gen: Generation | None) -> None:
        if gen is not None and self.enabled and gen.removals_settled:
            now = self.clock()
            for g in groups:
                self._keep(self._verified, g, (now, gen))
