"""What the scheduler side adds to the connector's stats (vLLM asks the
scheduler's connector for stats after every step's output): the tokens and
blocks its lookups served from the pool and the requests whose loads failed
- counted once per engine, where the workers' counts would repeat on every
TP rank -, the lookups that waited for another request's load of the same
blocks (``inflight``), the blocks the admission rule and the save budget
kept from the workers (``admission``), and the pool's fill (embedded backend), read at
most once per ``interval`` seconds and sent only when it changed, so an idle
pool adds nothing to vLLM's periodic log line."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..backends.lmdb.fill import pool_fill
from ..stats import PoolStats

#: running totals of the scheduler side sent as increments: name in the
#: scheduler's counts -> counter in :class:`PoolStats`
DELTAS = {"waits": "shared_load_waits", "timeouts": "shared_load_timeouts",
          "load_failures": "load_failures",
          "not_admitted": "blocks_not_admitted", "over_budget": "blocks_over_budget"}
#: the tiered backend's counts of the scheduler's own reads (its lookups'
#: verification promotes far-tier hits); the workers report their loads'
_SCHEDULER_TIER = {"promoted_blocks": "promoted_blocks",
                   "promotions_dropped": "promotions_dropped",
                   "promotions_refused": "promotions_refused",
                   "promotions_failed": "promotions_failed",
                   # (its reads are the lookups' verifications, not loads)
                   "near_pages_loaded": "near_pages_verified",
                   "far_pages_loaded": "far_pages_verified"}


class SchedulerSideStats:
    def __init__(self, counts: Callable[[], dict[str, int]], backend: Any, block_size: int,
                 interval: float = 1.0, failures: bool = True) -> None:
        self.counts = counts  # the scheduler's running totals (PoolScheduler.stats)
        # (False: the failed loads are left to the workers, every TP rank's - the
        # rule before the fix, tests only)
        self.deltas = {k: v for k, v in DELTAS.items() if failures or k != "load_failures"}
        self.backend = backend
        self.block_size = max(1, int(block_size))
        self.interval = interval
        self._hit_tokens = 0
        self._sent = dict.fromkeys(self.deltas, 0)
        self._next_fill = 0.0
        self._fill: dict[str, int] | None = None

    def take(self) -> PoolStats | None:
        """Counts since the last call, and the fill when it changed; None when
        there is nothing to report."""
        out: dict[str, Any] = {}
        counts = self.counts()
        hit = int(counts.get("hit_tokens", 0))
        if hit != self._hit_tokens:
            B = self.block_size
            out["lookup_hit_tokens"] = hit - self._hit_tokens
            out["lookup_hit_blocks"] = hit // B - self._hit_tokens // B
            self._hit_tokens = hit
        for name, counter in self.deltas.items():
            n = int(counts.get(name, 0))
            if n != self._sent[name]:
                out[counter] = n - self._sent[name]
                self._sent[name] = n
        tiers = getattr(self.backend, "tier_counts", None)  # (backend tiered: promotions)
        for name, counter in _SCHEDULER_TIER.items() if tiers else ():
            n = tiers.get(name, 0)
            if n != self._sent.get(name, 0):
                out[counter] = n - self._sent.get(name, 0)
                self._sent[name] = n
        now = time.monotonic()
        if now >= self._next_fill:
            self._next_fill = now + self.interval
            fill = pool_fill(self.backend)
            if fill is not None and fill != self._fill:
                self._fill = fill
                out.update(pool_used_bytes=fill["used_bytes"],
                           pool_capacity_bytes=fill["capacity_bytes"],
                           pool_entries=fill["entries"])
        return PoolStats(data=out) if out else None
