"""``bench --trace``'s outputs: a Markdown summary (hits by source, TTFT
percentiles, token equality, the capacity sweep) and one PNG: token hit rate
against the pool's capacity, HBM and pool stacked, the HBM-only replay as a
line."""

from __future__ import annotations

import os
from typing import Any

from .report import _fmt, error_row

HEADER = ("| config | pool capacity | HBM hit | pool hit | total hit | TTFT avg | p50 | p90 | "
          "p99 (s) | replay s | evictions | same tokens as hbm |")


NOTES = [
    "Hit rates are prompt tokens by source from the server's "
    "`vllm:prompt_tokens_by_source_total` over the replay (a restarted replay: both "
    "servers); vLLM hits whole blocks of its own (hybrid) block size, and a request's "
    "last prompt token is always computed: an unbounded prefix cache of the trace's "
    "blocks bounds the rate.",
    "On this CPU emulation a replay step costs about the same whatever it computes "
    "(interpreted Model Runner V2 kernels), so prefix hits save little time: compare "
    "hit rates, and TTFT among the prefix-caching configurations. (Before the "
    "post-sampling align copy's torch stand-in, prefix caching replayed about 3x "
    "slower than `no-prefix-cache`: docs/benchmarks.md.)",
    "Every pool run starts on an empty pool: the pool fills from the replay's own "
    "saves, so what it serves is what an earlier request of the replay left and the HBM "
    "cache evicted (or, after a restart, lost).",
    "Same tokens as hbm: requests whose greedy output tokens equal the HBM-only replay's. "
    "With concurrency > 1 requests are batched differently from run to run and the tiny "
    "random model's near-tied logits can flip under float batch variance (compare "
    "`no-prefix-cache`, which never touches the pool); the exact check replays requests "
    "one at a time, where a pool hit must give the same tokens.",
    "On CPU the servers run Model Runner V2 under the emulation with vLLM's mamba "
    "pre-copy and KV-block zeroing as their byte-identical host stand-ins; read TTFT "
    "as ratios between configurations of one run, not as seconds.",
]


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.0f} MiB"


def markdown(doc: dict[str, Any]) -> str:
    t, st, sel = doc["trace"], doc["trace"]["stats"], doc["trace"]["selection"]
    s = doc["setup"]
    loop = (f"open loop at the trace's timestamps / {s['time_scale']}" if s.get("time_scale")
            else f"closed loop at concurrency {s['concurrency']}")
    lines = [
        "# vllm-layerwise-patch bench --trace", "",
        f"Trace `{t['file']}`: {st['requests']} requests in {st['sessions']} sessions "
        f"(selection: {', '.join(f'{k} {v}' for k, v in sel.items() if v is not None)}), "
        f"scale 1/{s['scale']} ({s['block_tokens']}-token blocks), {st['prompt_tokens']} prompt "
        f"tokens, working set {st['distinct_blocks']} blocks = {st['working_set_tokens']} "
        f"tokens; {st['block_reuse']:.1%} of the blocks used were used before, and an "
        f"unbounded prefix cache would hit {st['prefix_hit_bound']:.1%} of the prompt "
        f"tokens. Outputs: {s['output']}. Replay: {loop}. vLLM KV cache: "
        f"{_mib(s['kv_cache_bytes'])} (`--kv-cache-bytes`, "
        f"{s.get('hbm_tokens') or '?'} tokens: smaller than the working set). "
        f"Model: {doc['model']}. Machine: {doc['machine']}.", "",
        *([f"Command: `{doc['command']}`", ""] if doc.get("command") else []),
        HEADER, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in doc["results"].items():
        if r.get("error"):
            lines.append(error_row(name, r["error"], HEADER))
            continue
        h, tt, eq = r["hit_rate"], r["ttft_s"], r.get("same_tokens_as_hbm") or {}
        lines.append(
            f"| {name} | {_mib(r.get('capacity_bytes'))} | {h['hbm']:.1%} | {h['pool']:.1%} | "
            f"{h['hbm'] + h['pool']:.1%} | {_fmt(tt['avg'])} | {_fmt(tt['p50'])} | "
            f"{_fmt(tt['p90'])} | {_fmt(tt['p99'])} | {_fmt(r['seconds'], 1)} | "
            f"{_fmt(r['pool']['evictions'], 0)} | "
            f"{eq.get('equal', '-')}/{eq.get('of', '-')} |")
    lines += [""]
    sweep = doc.get("capacity_sweep") or []
    hbm = (doc["results"].get("hbm") or {}).get("hit_rate")
    if sweep and hbm:
        top = sweep[-1]
        lines += [f"At pool capacity {top['capacity']}: token hit rate "
                  f"{top['hit_rate']['hbm'] + top['hit_rate']['pool']:.1%} "
                  f"({top['hit_rate']['hbm']:.1%} HBM + {top['hit_rate']['pool']:.1%} pool) "
                  f"against {hbm['hbm']:.1%} with vLLM's HBM cache alone.", ""]
        lines += ["Hit rate vs pool capacity (`hit_rate_vs_capacity.png`): " + ", ".join(
            f"{p['capacity']} {p['hit_rate']['hbm'] + p['hit_rate']['pool']:.1%} "
            f"(pool used {_mib(p['pool_used_bytes'])})" for p in sweep) + ".", ""]
    ex = doc.get("exact_check")
    if ex:
        eq = ex["same_tokens"]
        lines += [f"Exact check (concurrency 1, the first {ex['requests']} requests again on "
                  f"the `hbm` and `pool@{ex['capacity']}` servers after their replay; "
                  f"{ex['pool_hit_tokens']:.0f} prompt tokens of the pool server's pass came "
                  f"from the pool, {ex['hbm_hit_tokens']:.0f} from HBM): "
                  f"**{eq['equal']}/{eq['of']}** requests with the same tokens.", ""]
    from .admission import markdown as admission_markdown

    from .cluster import markdown as cluster_markdown

    lines += admission_markdown(doc.get("admission") or [])
    lines += cluster_markdown(doc)
    lines += ["## Reading it", "", *doc.get("notes", []), ""]
    return "\n".join(lines)


def plot(doc: dict[str, Any], out_dir: str) -> list[str]:
    """Token hit rate vs pool capacity (HBM and pool stacked; the HBM-only
    replay as a dashed line; an unbounded prefix cache's hit rate as a dotted
    one)."""
    sweep = doc.get("capacity_sweep") or []
    if not sweep:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    xs = [p["capacity_bytes"] / (1 << 20) for p in sweep]
    hbm = [100 * p["hit_rate"]["hbm"] for p in sweep]
    pool = [100 * p["hit_rate"]["pool"] for p in sweep]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.stackplot(xs, hbm, pool, labels=["HBM (vLLM prefix cache)", "pool"], alpha=0.7)
    ax.plot(xs, [a + b for a, b in zip(hbm, pool)], "ko-", markersize=4)
    only = (doc["results"].get("hbm") or {}).get("hit_rate")
    if only:
        ax.axhline(100 * only["hbm"], color="C3", ls="--", label="HBM only (no pool)")
    bound = doc["trace"]["stats"].get("prefix_hit_bound")
    if bound:
        ax.axhline(100 * bound, color="grey", ls=":", label="unbounded prefix cache")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([p["capacity"] for p in sweep], fontsize=8)
    ax.set_xlabel("pool capacity")
    ax.set_ylabel("prompt tokens hit (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Token hit rate vs pool capacity (trace replay)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = os.path.join(out_dir, "hit_rate_vs_capacity.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
