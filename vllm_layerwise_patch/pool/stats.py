"""Connector statistics in vLLM's own KV-transfer stats (logged with the
engine's periodic stats and aggregated across workers).

vLLM itself reports the external prefix-cache queries and hits (its
"External prefix cache hit rate"); these add what only the worker sees:
tokens and bytes loaded and saved, their throughput, and how long the forward
waited on loads.  Besides the summed counters, a stats payload may carry
per-step samples (lists: Prometheus histograms, :meth:`PoolStats.sample_step`)
and the pool's fill (gauges: the latest value wins); both come through vLLM's
aggregation across workers and steps and reach ``.prom``.

vLLM sums the workers' payloads over the TP ranks: bytes and times add up,
but a figure per request (:data:`ONCE_PER_ENGINE`) would count each request
once per rank, so each comes from one place only (:func:`worker_share`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = ("hit_tokens", "bytes_loaded", "load_seconds", "wait_seconds",
            "bytes_saved", "save_seconds", "blocks_saved", "load_failures",
            "saves_skipped", "save_failures", "evictions", "save_write_seconds",
            "save_cpu_seconds", "save_hook_seconds", "precopy_seconds", "put_skipped",
            "saves_tainted",
            # the tiered backend's (backends.tiered): each side its own
            "near_pages_loaded", "far_pages_loaded", "promoted_blocks",
            "promotions_dropped", "promotions_refused", "promotions_failed",
            "near_save_failures", "far_save_failures", "near_pages_verified",
            "far_pages_verified",
            # the scheduler's: once per engine whatever the TP size
            "lookup_hit_tokens", "lookup_hit_blocks", "shared_load_waits",
            "shared_load_timeouts", "blocks_not_admitted", "blocks_over_budget")
#: figures per request, counted once per engine whatever the TP size (every
#: rank loads and saves the same requests' blocks, each its own pages):
#: "rank0" - only TP rank 0's worker reports it; "scheduler" - the scheduler
#: side counts it (a failed load: vLLM reports a request's failure once,
#: whichever ranks failed), the workers' own counts are not reported
ONCE_PER_ENGINE = {"hit_tokens": "rank0", "blocks_saved": "rank0",
                   "load_failures": "scheduler"}
#: the pool's fill, sent by the scheduler side (latest value wins)
GAUGES = ("pool_used_bytes", "pool_capacity_bytes", "pool_entries")
#: counters of which each worker step's amount is also kept as a sample
#: (``<name>_samples``: one list entry per worker step that moved data)
SAMPLED = ("bytes_loaded", "load_seconds", "wait_seconds", "bytes_saved", "save_seconds")


def worker_share(data: dict[str, Any], tp_rank: int, every_rank: bool = False
                 ) -> dict[str, Any]:
    """What one worker reports of its stats ``data``: the figures per request
    only on TP rank 0, and not those the scheduler counts (``every_rank``:
    the rule before the fix, tests only - each rank reports them all)."""
    if every_rank:
        return data
    mine = {k for k, who in ONCE_PER_ENGINE.items() if who == "rank0" and tp_rank == 0}
    return {k: v for k, v in data.items() if k not in ONCE_PER_ENGINE or k in mine}


@dataclasses.dataclass
class PoolStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS}

    def add(self, **values: float) -> None:
        for k, v in values.items():
            self.data[k] = self.data.get(k, 0) + v

    def sample_step(self) -> PoolStats:
        """Keep this step's amounts of :data:`SAMPLED` as samples too (the
        worker's stats of one step: one sample each where non-zero)."""
        for k in SAMPLED:
            if self.data.get(k):
                self.data[f"{k}_samples"] = [self.data[k]]
        return self

    def aggregate(self, other: KVConnectorStats) -> PoolStats:
        for k, v in other.data.items():
            if isinstance(v, (list, tuple)):  # samples
                self.data[k] = list(self.data.get(k, ())) + list(v)
            elif k in GAUGES:
                self.data[k] = v
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS) and not any(
            k in self.data for k in GAUGES)

    def reduce(self) -> dict[str, Any]:
        d = self.data
        gb = 1e9
        return {
            "External hit tokens loaded": int(d["hit_tokens"]),
            "Loaded (GB)": round(d["bytes_loaded"] / gb, 4),
            "Load throughput (GB/s)": round(d["bytes_loaded"] / gb / d["load_seconds"], 3)
            if d["load_seconds"] else 0.0,
            "Load time (ms)": round(d["load_seconds"] * 1e3, 2),
            "Forward wait on loads (ms)": round(d["wait_seconds"] * 1e3, 2),
            "Saved (GB)": round(d["bytes_saved"] / gb, 4),
            "Save time (ms)": round(d["save_seconds"] * 1e3, 2),
            "Save throughput (GB/s)": round(d["bytes_saved"] / gb / d["save_seconds"], 3)
            if d["save_seconds"] else 0.0,
            "Save write time (ms)": round(d["save_write_seconds"] * 1e3, 2),
            "Send thread CPU (ms)": round(d["save_cpu_seconds"] * 1e3, 2),
            "Forward time in save hooks (ms)": round(d["save_hook_seconds"] * 1e3, 2),
            "State pre-copy (ms)": round(d["precopy_seconds"] * 1e3, 2),
            "Blocks saved": int(d["blocks_saved"]),
            "Requests with failed loads": int(d["load_failures"]),
            "Saves skipped (pool full)": int(d["saves_skipped"]),
            "Failed saves": int(d["save_failures"]),
            "Saves refused after a failed load": int(d["saves_tainted"]),
            "Block objects given up (transfer failed twice)": int(d["put_skipped"]),
            "Blocks evicted": int(d["evictions"]),
            "Lookups waiting on a shared load": int(d["shared_load_waits"]),
            "Blocks not admitted": int(d["blocks_not_admitted"]),
            "Blocks over the save budget": int(d["blocks_over_budget"]),
        } | ({"Pages loaded from the near tier": int(d["near_pages_loaded"]),
              "Pages loaded from the far tier": int(d["far_pages_loaded"]),
              "Blocks promoted into the near tier": int(d["promoted_blocks"]),
              "Pages lookups verified from the far tier": int(d["far_pages_verified"])}
             if d["near_pages_loaded"] or d["far_pages_loaded"] or d["promoted_blocks"]
             or d["far_pages_verified"]
             else {}) | ({"Pool used (GB)": round(d["pool_used_bytes"] / gb, 4)}
             if "pool_used_bytes" in d else {})
