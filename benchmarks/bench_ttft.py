"""Time to first token with the pool, side by side in one run, on CPU (Model
Runner V2 emulated with the Triton interpreter) or on whatever vLLM machine
runs it.

Configurations, each measured in a fresh engine process (empty HBM cache),
interleaved over ``--repeats`` rounds so machine noise hits all alike:

* ``cold``: stock vLLM, no connector (the prompt is computed);
* ``pool-layerwise``: the pool holds the prompt (filled once by an extra
  engine), overlay patches on: per-layer loads overlap compute;
* ``pool-bulk``: same pool, overlay patches off: the connector's patch-free
  path loads everything before the forward.

Every engine first serves a short unrelated warm-up prompt, then the measured
one.  Prints a table, saves JSON (medians, ratios to cold, hit tokens, whether
tokens equal the cold run's).  On CPU the interpreter's per-step overhead
dominates small models: read ratios, not seconds, and prefer a model large
enough that the cold prefill is several times the per-step overhead.

    python benchmarks/bench_ttft.py [--repeats 3] [--prompt-tokens 3200]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys
cfg = json.loads(sys.argv[1])
from vllm_layerwise_patch.cpu_emulation import cpu_v2_llm_kwargs
from vllm_layerwise_patch.testing import tiny_prompt
from vllm import LLM, SamplingParams
kw = cpu_v2_llm_kwargs(enable_prefix_caching=True, max_num_batched_tokens=cfg["mbt"],
                       disable_log_stats=False)
if cfg["pool"]:
    kw["kv_transfer_config"] = {"kv_connector": "LayerwisePoolConnector",
        "kv_connector_module_path": "vllm_layerwise_patch.pool", "kv_role": "kv_both",
        "kv_connector_extra_config": {"path": cfg["pool"], "capacity": "2GiB"}}
llm = LLM(model=cfg["model"], **kw)
sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
llm.generate([{"prompt_token_ids": tiny_prompt(200, seed=999)}], sp, use_tqdm=False)
o = llm.generate([{"prompt_token_ids": tiny_prompt(cfg["n"], seed=11)}], sp, use_tqdm=False)[0]
print("RESULT " + json.dumps({"ttft": o.metrics.first_token_latency,
                              "hit": o.num_cached_tokens, "tokens": list(o.outputs[0].token_ids)}))
"""


def engine(model, pool, n, mbt, patches):
    env = dict(os.environ, VLLM_LAYERWISE_PATCH=patches, VLLM_LAYERWISE_PATCH_CPU_V2="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cfg = {"model": str(model), "pool": pool, "n": n, "mbt": mbt}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], env=env,
                          capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        sys.exit(f"engine failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][7:])


def main() -> None:
    ap = argparse.ArgumentParser(description="TTFT with the pool vs cold")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=3200)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--full-attention-layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                   "ttft-cpu.json"))
    a = ap.parse_args()
    from vllm_layerwise_patch.testing.tiny_model import build_tiny_qwen3_next

    work = tempfile.mkdtemp(prefix="vlp-bench-")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else work
    pool = tempfile.mkdtemp(prefix="vlp-bench-pool-", dir=shm)
    try:
        model = build_tiny_qwen3_next(os.path.join(work, "model"), num_layers=a.layers,
                                      num_full_attention_layers=a.full_attention_layers,
                                      hidden_size=a.hidden)
        fill = engine(model, pool, a.prompt_tokens, a.max_num_batched_tokens, "1")
        runs = {"cold": [], "pool-layerwise": [], "pool-bulk": []}
        for r in range(a.repeats):
            runs["cold"].append(engine(model, None, a.prompt_tokens, a.max_num_batched_tokens, "0"))
            runs["pool-layerwise"].append(
                engine(model, pool, a.prompt_tokens, a.max_num_batched_tokens, "1"))
            runs["pool-bulk"].append(
                engine(model, pool, a.prompt_tokens, a.max_num_batched_tokens, "0"))
            print(f"round {r + 1}/{a.repeats}: " + ", ".join(
                f"{k} {v[-1]['ttft']:.3f}s" for k, v in runs.items()), flush=True)
        med = {k: statistics.median(x["ttft"] for x in v) for k, v in runs.items()}
        ref = runs["cold"][0]["tokens"]
        doc = {
            "benchmark": "TTFT, fresh engine per measurement",
            "model": {"layers": a.layers, "full_attention_layers": a.full_attention_layers,
                      "hidden": a.hidden},
            "prompt_tokens": a.prompt_tokens, "repeats": a.repeats,
            "max_num_batched_tokens": a.max_num_batched_tokens,
            "median_ttft_s": med,
            "ratio_to_cold": {k: round(v / med["cold"], 3) for k, v in med.items()},
            "hit_tokens": {k: [x["hit"] for x in v] for k, v in runs.items()},
            "tokens_equal_cold": {k: all(x["tokens"] == ref for x in v) for k, v in runs.items()},
            "fill_run": {"hit": fill["hit"], "tokens_equal_cold": fill["tokens"] == ref},
            "ttft_s": {k: [x["ttft"] for x in v] for k, v in runs.items()},
        }
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"\n{'config':<16}{'median TTFT':>12}{'x cold':>8}{'hit':>7}  tokens = cold")
        for k in runs:
            print(f"{k:<16}{med[k]:>11.3f}s{doc['ratio_to_cold'][k]:>8.2f}"
                  f"{runs[k][0]['hit']:>7}  {doc['tokens_equal_cold'][k]}")
        print(f"saved {a.out}")
    finally:
        shutil.rmtree(pool, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
