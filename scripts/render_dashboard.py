"""Write the Grafana dashboard of the pool (observability/grafana/
vllm_layerwise_pool.json) from the metric list in vllm_layerwise_patch.pool.prom.

It reads a vLLM server's /metrics through a Prometheus data source chosen
when it is imported, with the filters of vLLM's own dashboards (job, model,
instance, engine).  tests/test_pool_ops.py fails when the file is stale;
``--check`` only says whether it is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "observability" / "grafana" / "vllm_layerwise_pool.json"
F = 'job=~"$job", model_name=~"$model_name", instance=~"$instance", engine=~"$engine"'
R = "[$__rate_interval]"
DS = {"type": "prometheus", "uid": "${datasource}"}


def rate(metric: str, extra: str = "") -> str:
    return f"sum(rate({metric}{{{F}{extra}}}{R}))"


def pool(name: str) -> str:
    from vllm_layerwise_patch.pool.prom import METRICS

    (m,) = [m for m in METRICS if m.name == name]
    return m.exposed


def panel(pid: int, kind: str, title: str, desc: str, targets: list[tuple[str, str]],
          unit: str, pos: tuple[int, int, int, int]) -> dict:
    x, y, w, h = pos
    out = {"type": kind, "title": title, "description": desc, "datasource": DS, "id": pid,
           "targets": [{"expr": e, "legendFormat": legend, "refId": chr(65 + i)}
                       for i, (e, legend) in enumerate(targets)],
           "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
           "gridPos": {"h": h, "w": w, "x": x, "y": y}}
    if kind == "timeseries":
        out["fieldConfig"]["defaults"]["custom"] = {"fillOpacity": 10, "lineWidth": 1,
                                                    "showPoints": "never"}
        out["options"] = {"legend": {"displayMode": "list", "placement": "bottom",
                                     "showLegend": True},
                          "tooltip": {"mode": "multi", "sort": "desc"}}
    else:
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                            "values": False}, "colorMode": "none",
                          "graphMode": "area", "textMode": "value"}
    return out


def variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "definition": query, "query": query, "refresh": 2, "includeAll": True,
            "multi": True, "sort": 1, "hide": 0, "options": [], "regex": "",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}


def dashboard() -> dict:
    prompt = rate("vllm:prompt_tokens_total")
    by_source = [(f'{rate("vllm:prompt_tokens_by_source_total", f", source={s!r}")} / '
                  f"({prompt} > 0)".replace("'", '"'), legend)
                 for s, legend in (("local_cache_hit", "HBM prefix cache"),
                                   ("external_kv_transfer", "pool"),
                                   ("local_compute", "computed"))]
    lb, ls = pool("load_bytes") + "_sum", pool("load_seconds") + "_sum"
    sb, ss = pool("save_bytes") + "_sum", pool("save_seconds") + "_sum"
    wait = pool("load_wait_seconds")
    used, cap = pool("used_bytes"), pool("capacity_bytes")
    panels = [
        panel(1, "stat", "Prompt tokens from the pool",
              "Share of prompt tokens loaded from the pool (vLLM's external KV transfer "
              "source).", [by_source[1]], "percentunit", (0, 0, 6, 4)),
        panel(2, "stat", "Pool fill", "Bytes in use over capacity (embedded backend).",
              [(f"max({used}{{{F}}}) / (max({cap}{{{F}}}) > 0)", "fill")], "percentunit",
              (6, 0, 6, 4)),
        panel(3, "stat", "Pool hit tokens / s", "Prompt tokens the scheduler served "
              "from the pool.", [(rate(pool("hit_tokens")), "hit tokens")], "short",
              (12, 0, 6, 4)),
        panel(4, "stat", "Failed loads / s", "Requests whose pool load failed (recomputed "
              "or failed by kv_load_failure_policy).",
              [(rate(pool("failed_loads")), "failed loads")], "short", (18, 0, 6, 4)),
        panel(5, "timeseries", "Hit rate by source", "Share of prompt tokens by where their "
              "KV came from: vLLM's HBM prefix cache, the pool, or computed.",
              by_source, "percentunit", (0, 4, 12, 8)),
        panel(6, "timeseries", "Pool lookups", "Tokens vLLM asked the pool for and tokens "
              "it found (vLLM's external prefix cache counters).",
              [(rate("vllm:external_prefix_cache_queries_total"), "queried"),
               (rate("vllm:external_prefix_cache_hits_total"), "hit"),
               (rate(pool("hit_tokens")), "loaded (pool)")], "short", (12, 4, 12, 8)),
        panel(7, "timeseries", "Load / save throughput", "Bytes moved over the load "
              "threads' and the send thread's time (a load's time includes waiting for "
              "compute to reach its layer: a lower bound of the transfer rate), and bytes "
              "moved per second.",
              [(f"{rate(lb)} / ({rate(ls)} > 0)", "load"),
               (f"{rate(sb)} / ({rate(ss)} > 0)", "save"),
               (rate(lb), "loaded bytes/s"), (rate(sb), "saved bytes/s")],
              "Bps", (0, 12, 12, 8)),
        panel(8, "timeseries", "Exposed load wait", "Time the forward blocked on pool "
              "loads: per second of wall time, and the 99th percentile per worker step.",
              [(rate(wait + "_sum"), "wait (s/s)"),
               (f"histogram_quantile(0.99, sum by (le) (rate({wait}_bucket{{{F}}}{R})))",
                "p99 per step (s)")], "s", (12, 12, 12, 8)),
        panel(9, "timeseries", "Failures and evictions", "Failed loads (recomputed or "
              "failed), skipped saves (no room), failed saves, evicted block groups, "
              "Mooncake block objects given up (transfer failed twice), requests that "
              "waited for another request's load of their prefix and gave up waiting.",
              [(rate(pool("failed_loads")), "failed loads"),
               (rate(pool("skipped_saves")), "skipped saves"),
               (rate(pool("failed_saves")), "failed saves"),
               (rate(pool("evictions")), "evictions"),
               (rate(pool("put_skipped")), "objects given up"),
               (rate(pool("shared_load_timeouts")), "shared-load waits given up")],
              "short", (0, 20, 12, 8)),
        panel(10, "timeseries", "Pool fill", "Bytes of pool pages in use and the capacity "
              "(embedded backend; every engine's entries).",
              [(f"max({used}{{{F}}})", "used"), (f"max({cap}{{{F}}})", "capacity")],
              "bytes", (12, 20, 12, 8)),
    ]
    running = "vllm:num_requests_running"
    templating = [
        {"name": "datasource", "label": "Data source", "type": "datasource",
         "query": "prometheus", "refresh": 1, "hide": 0, "includeAll": False, "multi": False,
         "options": [], "regex": "",
         "current": {"selected": False, "text": "default", "value": "default"}},
        variable("job", "Job", f"label_values({running}, job)"),
        variable("model_name", "Model", f'label_values({running}{{job=~"$job"}}, model_name)'),
        variable("instance", "Instance", f'label_values({running}{{job=~"$job", '
                 f'model_name=~"$model_name"}}, instance)'),
        variable("engine", "Engine", f'label_values({running}{{job=~"$job", model_name=~'
                 f'"$model_name", instance=~"$instance"}}, engine)'),
    ]
    return {"title": "vLLM / Layerwise KV pool", "uid": "vllm-layerwise-pool",
            "description": "The layerwise KV pool of vllm-layerwise-patch: hits by source, "
                           "load and save throughput, exposed load wait, failures, fill.",
            "tags": ["vllm"], "editable": True, "graphTooltip": 1, "id": None,
            "refresh": "30s", "schemaVersion": 39, "time": {"from": "now-1h", "to": "now"},
            "timepicker": {}, "timezone": "", "version": 1, "panels": panels,
            "templating": {"list": templating}, "annotations": {"list": []}}


def rendered() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    text = rendered()
    if "--check" in sys.argv:
        return 0 if OUT.exists() and OUT.read_text() == text else 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
