"""Operator tools without an engine: the stats payload's samples and fill,
the Prometheus metrics recorded from it, the scheduler side's counts and
fill."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

from vllm_layerwise_patch.pool.backends.base import pack
from vllm_layerwise_patch.pool.backends.lmdb import LmdbBackend
from vllm_layerwise_patch.pool.keys import group_key, marker_key, namespace_key, page_key

NS_A, NS_B = bytes(range(16)), bytes(range(16, 32))


def write_pool(path, blocks=3, ns=NS_A, model="m"):
    b = LmdbBackend(str(path), 8 << 20)
    items = []
    for h in range(blocks):
        hb = bytes([h + 1]) * 32
        for kind in ("attn", "state"):
            items += [(page_key(ns, kind, hb, 0, str(layer)), pack(ns, os.urandom(512)))
                      for layer in range(2)]
            items.append((marker_key(ns, kind, hb, 0), pack(ns, b"")))
    desc = {"model": model, "vllm": "0.32.0", "dtype": "bfloat16",
            "layout": {"tp_size": 1, "block_size": 640}}
    items.append((namespace_key(ns), pack(ns, json.dumps(desc).encode())))
    b.put_many(items)
    b.close()
    return [k for k, _ in items]


# -- stats payload and Prometheus ------------------------------------------------

def test_stats_payload_keeps_step_samples_and_the_latest_fill():
    from vllm_layerwise_patch.pool.stats import PoolStats

    a = PoolStats(data={"bytes_loaded": 100, "load_seconds": 0.5}).sample_step()
    b = PoolStats(data={"bytes_loaded": 50, "bytes_saved": 7}).sample_step()
    agg = a.aggregate(b)  # two workers of one step
    assert agg.data["bytes_loaded"] == 150 and agg.data["bytes_loaded_samples"] == [100, 50]
    assert agg.data["load_seconds_samples"] == [0.5] and agg.data["bytes_saved_samples"] == [7]
    assert "wait_seconds_samples" not in agg.data  # nothing waited: no sample
    fill = PoolStats(data={"pool_used_bytes": 10, "pool_capacity_bytes": 99})
    assert not fill.is_empty() and PoolStats().is_empty()
    agg.aggregate(fill).aggregate(PoolStats(data={"pool_used_bytes": 20}))
    assert agg.data["pool_used_bytes"] == 20  # the latest, not a sum
    assert "Pool used (GB)" in agg.reduce() and "Pool used (GB)" not in b.reduce()


def _registry_types():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()

    def bound(cls):
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **kw: cls.__init__(
            self, *a, registry=reg, **kw)})
    return reg, {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def test_prometheus_metrics_record_a_payload_per_engine():
    from prometheus_client import generate_latest

    from vllm_layerwise_patch.pool.prom import METRICS, PoolPromMetrics
    from vllm_layerwise_patch.pool.stats import PoolStats

    reg, types = _registry_types()
    prom = PoolPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                           ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    payload = PoolStats(data={"lookup_hit_tokens": 1280, "lookup_hit_blocks": 2,
                              "bytes_loaded": 4096, "wait_seconds": 0.002, "load_failures": 1,
                              "pool_used_bytes": 5000, "pool_capacity_bytes": 1 << 26}
                        ).sample_step().to_dict()
    prom.observe(payload, engine_idx=1)
    text = generate_latest(reg).decode()

    def value(name, engine="1"):
        (v,) = re.findall(rf'^{re.escape(name)}{{engine="{engine}",model_name="m"}} (\S+)$',
                          text, flags=re.M)
        return float(v)
    assert value("vllm:layerwise_pool_hit_tokens_total") == 1280
    assert value("vllm:layerwise_pool_hit_blocks_total") == 2
    assert value("vllm:layerwise_pool_failed_loads_total") == 1
    assert value("vllm:layerwise_pool_load_bytes_sum") == 4096
    assert value("vllm:layerwise_pool_load_bytes_count") == 1
    assert value("vllm:layerwise_pool_load_wait_seconds_sum") == 0.002
    assert value("vllm:layerwise_pool_capacity_bytes") == 1 << 26
    assert value("vllm:layerwise_pool_used_bytes") == 5000
    assert value("vllm:layerwise_pool_hit_tokens_total", engine="0") == 0
    for m in METRICS:  # every metric registered, under the one prefix
        assert f"# TYPE {m.exposed} {m.kind}" in text


def test_scheduler_side_counts_once_and_sends_the_fill_when_it_changes(tmp_path):
    from vllm_layerwise_patch.pool.sched_stats import SchedulerSideStats

    write_pool(tmp_path / "pool", blocks=1)
    backend = LmdbBackend(str(tmp_path / "pool"), 8 << 20)
    counts = {"hit_tokens": 0}
    side = SchedulerSideStats(lambda: counts, backend, block_size=640, interval=0)
    first = side.take().data
    assert first["pool_entries"] == 7 and first["pool_capacity_bytes"] == 8 << 20
    assert first["pool_used_bytes"] > 0 and first["lookup_hit_tokens"] == 0
    assert side.take() is None  # nothing new
    counts["hit_tokens"] = 3 * 640
    got = side.take().data
    assert (got["lookup_hit_tokens"], got["lookup_hit_blocks"]) == (1920, 3)
    assert "pool_entries" not in got
    backend.delete_groups([group_key(NS_A, "attn", b"\1" * 32, 0)])
    assert side.take().data["pool_entries"] == 4
    backend.close()
