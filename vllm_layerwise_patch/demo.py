"""``python -m vllm_layerwise_patch demo``: a hybrid prefix hit from the
embedded pool, on CPU.

Builds the tiny hybrid Qwen3-Next (3 Gated DeltaNet + 1 attention layers,
seeded weights whose outputs depend on the GDN state), then runs vLLM with
Model Runner V2 on CPU (Triton interpreter emulation) and the
LayerwisePoolConnector on a fresh LMDB pool, twice, each engine in its own
process: engine A serves a prompt cold and fills the pool; engine B, a new
process with an empty HBM cache, serves the same prompt from the pool.  It
prints the hit tokens, both times to first token, whether the greedy tokens
and logprobs are identical, and which overlay patches each process applied.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import json, os, sys, time
from vllm_layerwise_patch.cpu_emulation import cpu_v2_llm_kwargs
from vllm_layerwise_patch.testing import tiny_prompt
from vllm import LLM, SamplingParams

model, extra, out, n = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
kw = cpu_v2_llm_kwargs(enable_prefix_caching=True, max_num_batched_tokens=640,
                       disable_log_stats=False)
kw["kv_transfer_config"] = {
    "kv_connector": "LayerwisePoolConnector",
    "kv_connector_module_path": "vllm_layerwise_patch.pool",
    "kv_role": "kv_both",
    "kv_connector_extra_config": extra}
t0 = time.perf_counter()
llm = LLM(model=model, **kw)
t1 = time.perf_counter()
prompt = tiny_prompt(n, seed=1)
sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
t2 = time.perf_counter()
res = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
t3 = time.perf_counter()
ttft = getattr(res.metrics, "first_token_latency", 0.0) or None
json.dump({"tokens": list(res.outputs[0].token_ids),
           "logprobs": [next(iter(d.values())).logprob for d in res.outputs[0].logprobs],
           "hit_tokens": res.num_cached_tokens, "prompt_len": len(prompt),
           "engine_start_s": t1 - t0, "request_s": t3 - t2, "ttft_s": ttft,
           "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
           "driver_pid": os.getpid()}, open(out, "w"))
"""


def _run_engine(model_dir: Path, pool: dict, tmp: Path, name: str, n: int) -> dict:
    reports = tmp / f"reports-{name}"
    result = tmp / f"result-{name}.json"
    env = dict(os.environ)
    env.update(
        VLLM_LAYERWISE_PATCH=os.environ.get("VLLM_LAYERWISE_PATCH", "1"),
        VLLM_LAYERWISE_PATCH_CPU_V2="1",
        VLLM_LAYERWISE_PATCH_REPORT_DIR=str(reports),
        VLLM_ENABLE_V1_MULTIPROCESSING=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
    )
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(model_dir), json.dumps(pool),
                           str(result), str(n)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"demo: engine {name} failed (exit {proc.returncode})")
    res = json.loads(result.read_text())
    res["reports"] = [json.loads(p.read_text()) for p in sorted(reports.glob("*.json"))]
    res["log"] = proc.stdout + proc.stderr
    return res


def _ttft(res: dict) -> str:
    return f"{res['ttft_s']:.2f} s" if res["ttft_s"] else f"~{res['request_s']:.2f} s (request)"


def run(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m vllm_layerwise_patch demo")
    ap.add_argument("--model-dir", default=None,
                    help="where to build the tiny model (default: a cache dir)")
    ap.add_argument("--prompt-tokens", type=int, default=2000,
                    help="prompt length (block size is 640 on this model)")
    ap.add_argument("--backend", choices=("lmdb", "mooncake"), default="lmdb",
                    help="lmdb: the embedded pool; mooncake: a Mooncake Store master and "
                         "segment holder started on loopback for the demo")
    ns = ap.parse_args(argv)

    from .testing.tiny_model import build_tiny_qwen3_next, default_tiny_model_dir

    where = ("the embedded pool" if ns.backend == "lmdb" else
             "a Mooncake Store pool (master and segment holder on loopback)")
    print(f"vllm-layerwise-patch demo: hybrid prefix hit from {where} "
          "(CPU, Model Runner V2 emulated with the Triton interpreter)\n")
    model_dir = Path(ns.model_dir) if ns.model_dir else default_tiny_model_dir()
    print(f"[1/4] tiny hybrid Qwen3-Next (3 GDN + 1 attention layers) in {model_dir}",
          flush=True)
    model_dir = build_tiny_qwen3_next(model_dir)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    tmp = Path(tempfile.mkdtemp(prefix="vlp-demo-"))
    pool = Path(tempfile.mkdtemp(prefix="vlp-demo-pool-", dir=shm))
    extra: dict = {"path": str(pool), "capacity": "1GiB"}
    local = None
    if ns.backend == "mooncake":
        from .mooncake_local import LocalMooncake, free_port

        local = LocalMooncake(tmp / "mooncake", rpc_port=free_port(), metrics_port=free_port(),
                              holder=1 << 30, holder_port=free_port()).start()
        extra = {"backend": "mooncake", "mooncake": {
            "master_address": local.master_address, "global_segment_size": 0}}
        where = f"Mooncake master {local.master_address}, holder {local.holder_address}"
    else:
        where = str(pool)
    try:
        print(f"[2/4] engine A (cold, empty pool at {where}) ...", flush=True)
        t0 = time.perf_counter()
        a = _run_engine(model_dir, extra, tmp, "A", ns.prompt_tokens)
        print(f"      {time.perf_counter() - t0:.0f} s; prompt {a['prompt_len']} tokens, "
              f"block {a['block_size']}, hit {a['hit_tokens']} tokens, TTFT {_ttft(a)}")
        print("[3/4] engine B (new process, empty HBM cache, same pool) ...", flush=True)
        t0 = time.perf_counter()
        b = _run_engine(model_dir, extra, tmp, "B", ns.prompt_tokens)
        print(f"      {time.perf_counter() - t0:.0f} s; hit {b['hit_tokens']} tokens "
              f"from the pool, TTFT {_ttft(b)}")
        same_tokens = a["tokens"] == b["tokens"]
        same_lp = a["logprobs"] == b["logprobs"]
        print("\n[4/4] result")
        print(f"  external hit tokens (engine B): {b['hit_tokens']} of {b['prompt_len']}")
        if a["ttft_s"] and b["ttft_s"]:
            print(f"  TTFT A {a['ttft_s']:.2f} s -> B {b['ttft_s']:.2f} s "
                  f"(ratio {b['ttft_s'] / a['ttft_s']:.2f}; the Triton interpreter and "
                  "a tiny model make CPU timings indicative only)")
        print(f"  greedy tokens A: {a['tokens']}")
        print(f"  greedy tokens B: {b['tokens']}")
        print(f"  identical tokens: {same_tokens}; identical logprobs: {same_lp}")
        mode = ("layerwise" if "layerwise loads and saves" in b["log"]
                else "bulk fallback" if "bulk path" in b["log"] else "unknown")
        print(f"  pool path used by engine B's worker: {mode}")
        print("  overlay patches per process of engine B:")
        for rep in b["reports"]:
            applied = sorted(p for p, st in rep["patches"].items() if st["state"] == "applied")
            role = ("driver" if rep["pid"] == b["driver_pid"] else rep.get("process_name"))
            print(f"    pid {rep['pid']:>7} {role:<14} {', '.join(applied) or '-'}")
        ok = same_tokens and same_lp and b["hit_tokens"] > 0
        print("\nresult:", "OK - hybrid prefix hit restored, outputs bit-identical" if ok
              else "NOT OK")
        return 0 if ok else 1
    finally:
        if local is not None:
            local.stop()
        shutil.rmtree(pool, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
