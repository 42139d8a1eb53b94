"""The pool's Prometheus metrics, through vLLM's connector metrics hook
(``KVConnectorBase_V1.build_prom_metrics``, as vLLM's offloading and NIXL
connectors do): registered by vLLM's Prometheus stat logger in the API
server, labelled like vLLM's own metrics (``model_name``, ``engine``), fed
with the connector's stats payloads (``.stats``: counters summed, per-step
samples for histograms, the pool's fill as gauges).

:data:`METRICS` is the one list: docs/operations.md's table and the Grafana
dashboard's names come from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

try:  # vLLM's base class (0.32 on); a stand-in keeps this module importable
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
except ImportError:  # pragma: no cover - older vLLM: the hook is never called
    KVConnectorPromMetrics = object

PREFIX = "vllm:layerwise_pool_"
#: per worker step: 2 KiB .. 8 GiB (vLLM's NIXL connector's byte buckets)
BYTE_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
SECOND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                  1.0, 2.5, 5.0)


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str  #: without the prefix and without Prometheus' ``_total``
    kind: str  #: counter, gauge or histogram
    key: str  #: the stats payload's key (a list of samples for a histogram)
    doc: str
    buckets: tuple[float, ...] = ()

    @property
    def full_name(self) -> str:
        return PREFIX + self.name

    @property
    def exposed(self) -> str:
        """The name ``/metrics`` shows (a counter gains ``_total``)."""
        return self.full_name + ("_total" if self.kind == "counter" else "")


METRICS: tuple[Metric, ...] = (
    Metric("hit_tokens", "counter", "lookup_hit_tokens",
           "Prompt tokens served from the pool (the scheduler's hits: once per engine, "
           "whatever the TP size)."),
    Metric("hit_blocks", "counter", "lookup_hit_blocks",
           "Blocks (vLLM's hybrid block size) served from the pool."),
    Metric("load_bytes", "histogram", "bytes_loaded_samples",
           "Bytes loaded from the pool into KV pages, one sample per worker step that "
           "loaded (`_sum`: all bytes loaded).", BYTE_BUCKETS),
    Metric("load_seconds", "histogram", "load_seconds_samples",
           "Load threads' time per worker step, summed over layers: reading a layer's "
           "pages from the pool and placing them (the transfer alone: not the wait for "
           "compute to reach the layer before its pages may be written, nor the forward's "
           "wait, which is `load_wait_seconds`).",
           SECOND_BUCKETS),
    Metric("load_wait_seconds", "histogram", "wait_seconds_samples",
           "Exposed load wait: time the forward blocked on pool loads, per worker step.",
           SECOND_BUCKETS),
    Metric("save_bytes", "histogram", "bytes_saved_samples",
           "Bytes saved into the pool, one sample per worker step that saved (`_sum`: all "
           "bytes saved).", BYTE_BUCKETS),
    Metric("save_seconds", "histogram", "save_seconds_samples",
           "Send thread's time packing and writing saves, per worker step.",
           SECOND_BUCKETS),
    Metric("blocks_saved", "counter", "blocks_saved",
           "Blocks committed to the pool, once per engine whatever the TP size (TP rank "
           "0's commits; every rank commits its own pages of a block)."),
    Metric("failed_loads", "counter", "load_failures",
           "Requests whose pool load failed, handed to `kv_load_failure_policy`: once per "
           "request and engine, whichever TP ranks failed (the scheduler counts what "
           "vLLM learns)."),
    Metric("skipped_saves", "counter", "saves_skipped",
           "Saves skipped for want of room: pinned entries fill the pool, or its "
           "filesystem is full."),
    Metric("failed_saves", "counter", "save_failures",
           "Saves that failed with a backend error (their blocks are not stored)."),
    Metric("refused_saves", "counter", "saves_tainted",
           "Block saves (a block's attention pages, or a boundary state) refused because "
           "they may be computed from a failed load's pages (the worker's quarantine, "
           "until the scheduler has taken the failure; counted by each TP rank)."),
    Metric("put_skipped", "counter", "put_skipped",
           "Mooncake block objects given up: their put failed with a transfer error "
           "(-800, e.g. a segment holder just restarted) and again when retried once; "
           "that step's save fails (also counted in `failed_saves`)."),
    Metric("shared_load_waits", "counter", "shared_load_waits",
           "Requests whose lookup waited for another request's asynchronous load of the "
           "same blocks (`load_async`; counted once per request, see `share_loads_seconds`)."),
    Metric("shared_load_timeouts", "counter", "shared_load_timeouts",
           "Requests that waited `share_loads_seconds` for another request's load and then "
           "loaded their own hit."),
    Metric("blocks_not_admitted", "counter", "blocks_not_admitted",
           "Computed blocks not saved because the admission rule (`admission: reused`) "
           "did not admit them: their prefix was seen by fewer than two requests "
           "(a later miss, never a wrong token; once per engine)."),
    Metric("blocks_over_save_budget", "counter", "blocks_over_budget",
           "Admitted blocks not saved because their scheduler step had already handed "
           "`save_budget_blocks` blocks to the workers (once per engine)."),
    Metric("evictions", "counter", "evictions",
           "Block groups (one block's pages of one kind on one TP rank) evicted to make "
           "room for this engine's saves."),
    Metric("near_pages_loaded", "counter", "near_pages_loaded",
           "Backend `tiered`: pages (one layer of one block) the workers loaded from the "
           "near tier (LMDB), every TP rank's; with `far_pages_loaded`, the near tier's "
           "share of what hits read."),
    Metric("far_pages_loaded", "counter", "far_pages_loaded",
           "Backend `tiered`: pages the workers loaded from the far tier (Mooncake)."),
    Metric("far_pages_verified", "counter", "far_pages_verified",
           "Backend `tiered`: pages the scheduler's lookups read from the far tier "
           "(Mooncake) to verify a hit (`verify_on_lookup`) - where a hit found only far "
           "crosses the network; what they read is promoted, so the load then finds it "
           "near."),
    Metric("near_pages_verified", "counter", "near_pages_verified",
           "Backend `tiered`: pages the scheduler's lookups read from the near tier to "
           "verify a hit."),
    Metric("promoted_blocks", "counter", "promoted_blocks",
           "Backend `tiered`: blocks (of one kind on one TP rank) read from the far tier "
           "and written into the near tier (`tiered.promote`)."),
    Metric("promotions_dropped", "counter", "promotions_dropped",
           "Backend `tiered`: blocks not promoted because `tiered.promote_pending_blocks` "
           "others were waiting for their pages; they stay far-tier hits."),
    Metric("promotions_refused", "counter", "promotions_refused",
           "Backend `tiered`: blocks not promoted because a value read from the far tier "
           "failed its check (such a load fails and recomputes)."),
    Metric("far_save_failures", "counter", "far_save_failures",
           "Backend `tiered`: saves the far tier (Mooncake) did not take (the master "
           "down, the store full); the near tier keeps what it took - a save neither "
           "tier took is a failed save."),
    Metric("used_bytes", "gauge", "pool_used_bytes",
           "Bytes of pool pages in use, every engine's entries (embedded LMDB backend, "
           "every shard's summed; read while the engine runs steps)."),
    Metric("capacity_bytes", "gauge", "pool_capacity_bytes",
           "The pool's capacity: its LMDB map size (embedded backend; a sharded pool's "
           "shards' map sizes summed)."),
    Metric("entries", "gauge", "pool_entries",
           "Entries (pages, commit markers) in the pool (embedded backend, every shard)."),
)


class PoolPromMetrics(KVConnectorPromMetrics):
    """Registers :data:`METRICS` (one labelled child per engine) and records
    each stats payload vLLM hands over."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.children: dict[str, tuple[str, dict[int, Any]]] = {}
        for m in METRICS:
            if m.kind == "counter":
                metric = self._counter_cls(name=m.full_name, documentation=m.doc,
                                           labelnames=labelnames)
            elif m.kind == "gauge":
                metric = self._gauge_cls(name=m.full_name, documentation=m.doc,
                                         labelnames=labelnames, multiprocess_mode="mostrecent")
            else:
                metric = self._histogram_cls(name=m.full_name, documentation=m.doc,
                                             labelnames=labelnames, buckets=list(m.buckets))
            self.children[m.key] = (m.kind, {idx: metric.labels(*values) for idx, values
                                             in per_engine_labelvalues.items()})

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, (kind, per_engine) in self.children.items():
            value = transfer_stats_data.get(key)
            if value is None or engine_idx not in per_engine:
                continue
            child = per_engine[engine_idx]
            if kind == "counter":
                if value:
                    child.inc(value)
            elif kind == "gauge":
                child.set(value)
            else:
                for sample in value:
                    child.observe(sample)


def markdown_table() -> str:
    """docs/operations.md's table of the metrics (scripts/render_readme.py)."""
    lines = ["| metric | type | meaning |", "|---|---|---|"]
    lines += [f"| `{m.exposed}` | {m.kind} | {m.doc} |" for m in METRICS]
    return "\n".join(lines) + "\n"
