"""Bursts on one stored prefix: how many times a fresh engine reads the
prefix from the pool when N requests sharing it arrive together - the
``bursts`` curve of the scale results (a sibling of bench_scale.py, which
needs no engine).

One engine (vLLM CPU harness, Model Runner V2, tiny Qwen3-Next: 3 GDN
layers and one attention layer) stores a prefix of ``--blocks`` blocks; then,
for each configuration and N in 1, 4, 16, a fresh engine on a copy of that
pool serves N prompts at once (one ``generate`` call, vLLM's asynchronous
scheduling as the harness runs it) made of the prefix and a suffix of their
own.  Configurations: sync loads (layerwise, in the step that computes the
request), ``load_async`` with in-flight loads shared (``share_loads_seconds``,
the default) and ``load_async`` without sharing (``share_loads_seconds=0``:
what every parked request did before).  The figure: bytes the workers loaded
from the pool divided by the bytes of one load of the prefix's hit (its
attention pages and its boundary state, what N=1 reads).

    python benchmarks/bench_bursts.py [--blocks 8] [--out benchmarks/results/scale]

Writes ``bursts.json``, ``bursts.md`` and ``bursts.png`` (matplotlib, when
installed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import _results

from vllm_layerwise_patch.testing.engines import engine_env, kv_metrics, run_engine

BLOCK = 640
CONFIGS = {"sync": {},
           "load_async, shared": {"load_async": True},
           "load_async, not shared": {"load_async": True, "share_loads_seconds": 0}}


def _engine(model: str, cwd: str, prompts: list, pool: dict | None, **spec) -> dict:
    res = run_engine(dict({"model": model, "prompts": prompts, "pool": pool,
                           "exact_load_bytes": True,
                           "llm": {"max_num_seqs": 16}}, **spec),
                     env=engine_env("1" if pool is not None else "0"), cwd=cwd)
    if res["error"] is not None or not all(o["tokens"] for o in res["out"]):
        sys.exit(f"engine failed: {res['error']}\n{res['log'][-4000:]}")
    return res


def burst(model: str, work: str, filled: str, prompts: list, extra: dict) -> dict:
    path = os.path.join(work, "pool-run")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(filled, path)
    pool = dict({"path": path, "capacity": "256MiB"}, **extra)
    t0 = time.perf_counter()
    res = _engine(model, work, prompts, pool, batch=True)
    wall = time.perf_counter() - t0
    lines = kv_metrics(res["log"])
    return {"bytes_loaded": sum(int(f.get("Loaded (bytes)", 0)) for f in lines),
            "hit_tokens_loaded": sum(int(f["External hit tokens loaded"]) for f in lines),
            "cached_tokens": [o["cached"] for o in res["out"]],
            "tokens": [o["tokens"] for o in res["out"]],
            "engine_seconds": round(wall, 1),
            "ttft_s": [round(o["ttft"], 3) if o["ttft"] else None for o in res["out"]]}


def _plot(out_dir: str, rows: list[dict], sizes: list[int]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, style in zip(CONFIGS, ("s-", "o--", "^-")):
        pts = [r for r in rows if r["config"] == name]
        ax.plot([r["requests"] for r in pts], [r["reads_per_prefix"] for r in pts], style,
                label=name, markersize=9 if style == "s-" else 6)
    ax.axhline(1.1, color="grey", ls=":", label="goal 1.1x")
    ax.set(xscale="log", yscale="log", xticks=sizes, xticklabels=[str(n) for n in sizes],
           xlabel="requests arriving together on one stored prefix",
           ylabel="bytes read / bytes of the prefix",
           title="Bursts: pool reads per distinct block")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bursts.png"))


def _summary(out_dir: str, doc: dict) -> None:
    sizes = doc["requests"]
    lines = ["# Bursts on one stored prefix (benchmarks/bench_bursts.py)", "",
             f"A fresh engine, N requests at once sharing a stored prefix of {doc['blocks']} "
             f"blocks ({doc['blocks'] * BLOCK} tokens; one load of its hit: "
             f"{doc['prefix_bytes']:,} bytes), each with a suffix of its own; bytes read "
             "from the pool / the prefix's bytes:", "",
             "| configuration | " + " | ".join(f"N = {n}" for n in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for name in CONFIGS:
        row = {r["requests"]: r for r in doc["results"] if r["config"] == name}
        lines.append(f"| {name} | " + " | ".join(
            f"{row[n]['reads_per_prefix']:.2f}x" for n in sizes) + " |")
    lines += ["", "Tokens equal across the configurations for every N: "
              f"{doc['tokens_equal_across_configs']}.", ""]
    with open(os.path.join(out_dir, "bursts.md"), "w") as f:
        f.write("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "scale"))
    ap.add_argument("--blocks", type=int, default=8, help="blocks in the stored prefix")
    ap.add_argument("--requests", default="1,4,16")
    ap.add_argument("--suffix", type=int, default=64, help="tokens after the prefix")
    args = ap.parse_args()
    sizes = [int(n) for n in args.requests.split(",")]
    from vllm_layerwise_patch.testing.tiny_model import build_tiny_qwen3_next

    work = tempfile.mkdtemp(prefix="vlp-bench-bursts-")
    shm = tempfile.mkdtemp(prefix="vlp-bench-bursts-", dir="/dev/shm")
    try:
        model = str(build_tiny_qwen3_next(os.path.join(work, "model")))
        prefix = [args.blocks * BLOCK, 7]
        filled = os.path.join(shm, "pool")
        # the prefix's blocks, stored by one engine (a suffix of its own, so the
        # state at the prefix's last boundary is stored too)
        _engine(model, work, [{"prefix": prefix, "suffix": [args.suffix, 1]}],
                {"path": filled, "capacity": "256MiB"})
        rows = []
        for n in sizes:
            prompts = [{"prefix": prefix, "suffix": [args.suffix, 100 + i]} for i in range(n)]
            for name, extra in CONFIGS.items():
                r = burst(model, work, filled, prompts, extra)
                rows.append(dict({"config": name, "requests": n}, **r))
                print(f"N={n:>2} {name:<24} read {r['bytes_loaded']:>12,} bytes, hit tokens "
                      f"loaded {r['hit_tokens_loaded']:>7}, cached {r['cached_tokens']}, "
                      f"{r['engine_seconds']} s", flush=True)
        one = [r["bytes_loaded"] for r in rows if r["requests"] == 1]
        prefix_bytes = min(one)
        for r in rows:
            r["reads_per_prefix"] = round(r["bytes_loaded"] / prefix_bytes, 3)
        equal = all(len({str(r["tokens"]) for r in rows if r["requests"] == n}) == 1
                    for n in sizes)
        print("\n" + "".join(f"N={r['requests']:>2} {r['config']:<24} "
                             f"{r['reads_per_prefix']:.2f}x\n" for r in rows)
              + f"tokens equal across configurations: {equal}")
        doc = {"blocks": args.blocks, "block_tokens": BLOCK, "suffix_tokens": args.suffix,
               "requests": sizes, "prefix_bytes": prefix_bytes,
               "n1_bytes_equal": len(set(one)) == 1, "tokens_equal_across_configs": equal}
        os.makedirs(args.out, exist_ok=True)
        _results.write(os.path.join(args.out, "bursts.json"),
                       "bursts on one stored prefix: pool bytes read per distinct block",
                       rows, argv=sys.argv[1:], **doc)
        _plot(args.out, rows, sizes)
        _summary(args.out, dict(doc, results=rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
