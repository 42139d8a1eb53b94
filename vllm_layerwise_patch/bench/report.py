"""The benchmark's outputs: the ratios that matter, a Markdown summary, PNG
plots (when matplotlib is installed: ``pip install
'vllm-layerwise-patch[bench]'``) and what is written to the JSON."""

from __future__ import annotations

import os
from typing import Any


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per scenario: pool-layerwise TTFT (p50) over HBM's, over no prefix
    cache's, over pool-bulk's, and the same with the injected latency."""
    out = {}
    for scenario, by_config in results.items():
        p50 = {c: (r.get("ttft_s") or {}).get("p50") for c, r in by_config.items()}
        out[scenario] = {
            "layerwise_vs_hbm": _ratio(p50.get("pool-layerwise"), p50.get("hbm")),
            "layerwise_deferred_save_vs_hbm": _ratio(p50.get("pool-layerwise-defer"),
                                                     p50.get("hbm")),
            "layerwise_vs_no_prefix_cache": _ratio(p50.get("pool-layerwise"),
                                                   p50.get("no-prefix-cache")),
            "layerwise_vs_bulk": _ratio(p50.get("pool-layerwise"), p50.get("pool-bulk")),
            "layerwise_vs_bulk_with_latency": _ratio(p50.get("pool-layerwise+latency"),
                                                     p50.get("pool-bulk+latency")),
            "async_vs_hbm": _ratio(p50.get("pool-async"), p50.get("hbm")),
            "layerwise_vs_async": _ratio(p50.get("pool-layerwise"), p50.get("pool-async")),
        }
    return out


def _p50(by_config: dict[str, Any], name: str) -> float | None:
    r = by_config.get(name) or {}
    return (r.get("ttft_s") or {}).get("p50")


def mode_suffix(mode: str) -> str:
    """How a result's key names the CPU kernels it ran with: ``+torch-kernels``
    for the host stand-ins, nothing for vLLM's own (interpreted) kernels."""
    return "+torch-kernels" if mode == "torch" else ""


def breakdown(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Where a pool hit's extra time over an HBM hit goes, per scenario, in
    seconds of median (p50) TTFT - robust to one slow request: ``gap`` (pool-layerwise minus hbm), ``saves``
    (what storing the trace's new blocks adds: layerwise minus its
    ``kv_consumer`` twin), ``exposed_load_wait`` (the forward's wait on loads,
    per request), ``interpreted_kernels`` (on CPU, the gap's part that the
    host pre-copy and zeroing stand-ins remove: the emulation's cost) and ``rest``
    (lookups, metadata, page copies, load threads competing for the cores).
    Where ``saves`` goes, per request (not parts of the sum): ``save_in_forward``
    (the forward thread's time in the save hooks: queueing pages and waiting
    for the step's write) and ``save_send_cpu`` (the send thread's CPU time:
    packing and writing, cores taken from the forward); of ``rest``:
    ``layer_precopy`` (the forward's time in the layerwise path's per-layer
    mamba pre-copies, per request; vLLM's own once-per-step pre-copy, which an
    HBM hit runs too, is not in it)."""
    out: dict[str, dict[str, float | None]] = {}
    for key, by_config in results.items():
        lw, hbm, nosave = (_p50(by_config, n) for n in
                           ("pool-layerwise", "hbm", "pool-layerwise-nosave"))
        if lw is None or hbm is None:
            continue
        r = by_config["pool-layerwise"]
        wait = r["forward_wait_s"] / r["requests"] if r.get("requests") else None
        row = {"gap": lw - hbm, "saves": lw - nosave if nosave is not None else None,
               "exposed_load_wait": wait, "interpreted_kernels": None}
        torch_key = key + mode_suffix("torch")
        if torch_key in results:
            t = results[torch_key]
            t_lw, t_hbm = _p50(t, "pool-layerwise"), _p50(t, "hbm")
            if t_lw is not None and t_hbm is not None:
                row["interpreted_kernels"] = row["gap"] - (t_lw - t_hbm)
        row["rest"] = row["gap"] - sum(v for k, v in row.items()
                                       if k != "gap" and v is not None)
        save, n = r.get("save") or {}, r.get("requests") or 0
        if n and "send_thread_cpu_s" in save:
            row["save_in_forward"] = save["forward_hooks_s"] / n
            row["save_send_cpu"] = save["send_thread_cpu_s"] / n
        if n and "layer_precopy_s" in r:
            row["layer_precopy"] = r["layer_precopy_s"] / n
        out[key] = {k: (round(v, 4) if v is not None else None) for k, v in row.items()}
    return out


def error_row(name: str, error: str, header: str, limit: int = 160) -> str:
    """A table row for a configuration that failed: its name, the error's
    first line (cut to ``limit``), and as many empty cells as ``header``
    has columns left."""
    first = (error.splitlines() or [""])[0].replace("|", "/")  # (one table row)
    return f"| {name} | error: {first[:limit]} |" + " |" * (header.count("|") - 3)


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _gbps(d: dict[str, Any] | None) -> float | None:
    return d["GB"] / d["seconds"] if d and d.get("seconds") else None


def markdown(doc: dict[str, Any]) -> str:
    w = doc["workload"]
    lines = [
        "# vllm-layerwise-patch bench", "",
        f"Workload: {w['requests']} requests of {w['input_len']} tokens ({w['repeat_rate']:.0%} "
        f"a shared prefix, {w['prefixes']} prefixes), {w['output_len']} output tokens, "
        f"concurrency {w['concurrency']}. Model: {doc['model']['description']}. "
        f"Machine: {doc['machine']}.", "",
        doc["model"]["note"], "",
    ]
    for scenario, by_config in doc["results"].items():
        header = ("| config | TTFT avg | p50 | p90 | p99 (s) | HBM hit | external hit | "
                  "input tok/s | exposed wait | load GB/s | save GB/s | same tokens as hbm |")
        lines += [f"## Scenario `{scenario}`", "", header,
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for config, r in by_config.items():
            if r.get("error"):
                lines.append(error_row(config, r["error"], header, 80))
                continue
            t, h, ld = r["ttft_s"], r["hit_rate"], r["load"]
            lines.append(
                f"| {config} | {_fmt(t['avg'])} | {_fmt(t['p50'])} | {_fmt(t['p90'])} | "
                f"{_fmt(t['p99'])} | {h['hbm']:.1%} | {h['external']:.1%} | "
                f"{_fmt(r['input_tokens_per_s'], 0)} | "
                f"{_fmt(ld['exposed_wait_fraction'], 2)} | {_fmt(ld['GB_per_s'], 2)} | "
                f"{_fmt(_gbps(r.get('save')), 2)} | "
                f"{_fmt(r.get('same_tokens_as_hbm'))}/{r['requests']} |")
        rt = doc["ratios"][scenario]
        lines += ["", "Ratios (TTFT p50): " + ", ".join(
            f"{k.replace('_', ' ')} {_fmt(v)}" for k, v in rt.items() if v is not None), ""]
        bd = (doc.get("breakdown") or {}).get(scenario)
        if bd:
            lines += ["Pool-layerwise minus HBM, median TTFT (s): " + ", ".join(
                f"{k.replace('_', ' ')} {_fmt(v)}" for k, v in bd.items() if v is not None),
                ""]
    tr = doc.get("transfer")
    if tr:
        lines += ["## Transfer path (LMDB, 2 MiB pages, vs memcpy in the same run)", "",
                  f"save {tr['ratio_to_memcpy']['save']:.2f} x memcpy, load "
                  f"{tr['ratio_to_memcpy']['load']:.2f} x memcpy "
                  f"(memcpy {tr['GB_per_s']['memcpy']:.1f} GB/s).", ""]
    lines += ["## Reading it", "", *doc.get("notes", []), ""]
    return "\n".join(lines)


def plots(doc: dict[str, Any], out_dir: str) -> list[str]:
    """TTFT p50/p90 per configuration and scenario (one PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    scenarios = list(doc["results"])
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 4),
                             squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        by_config = {c: r for c, r in doc["results"][scenario].items() if not r.get("error")}
        names = list(by_config)
        p50 = [by_config[c]["ttft_s"]["p50"] for c in names]
        p90 = [by_config[c]["ttft_s"]["p90"] for c in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], p90, width=0.4, label="p90")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"TTFT, scenario {scenario}")
        ax.set_ylabel("seconds")
        ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "ttft.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    made = [path]
    bd = {k: v for k, v in (doc.get("breakdown") or {}).items() if v}
    if bd:  # where the pool hit's extra time goes, stacked per scenario
        parts = ("saves", "exposed_load_wait", "interpreted_kernels", "rest")
        fig, ax = plt.subplots(figsize=(max(5, 2.2 * len(bd)), 4))
        bottom_pos, bottom_neg = [0.0] * len(bd), [0.0] * len(bd)
        for part in parts:
            vals = [bd[k].get(part) or 0.0 for k in bd]
            base = [bp if v >= 0 else bn for v, bp, bn in zip(vals, bottom_pos, bottom_neg)]
            ax.bar(range(len(bd)), vals, bottom=base, label=part.replace("_", " "))
            bottom_pos = [b + max(v, 0) for b, v in zip(bottom_pos, vals)]
            bottom_neg = [b + min(v, 0) for b, v in zip(bottom_neg, vals)]
        ax.plot(range(len(bd)), [bd[k]["gap"] for k in bd], "k_", markersize=30,
                label="gap (layerwise - hbm)")
        ax.set_xticks(list(range(len(bd))))
        ax.set_xticklabels(list(bd), rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("seconds of median TTFT")
        ax.set_title("pool-layerwise minus HBM hit")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, "breakdown.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made
