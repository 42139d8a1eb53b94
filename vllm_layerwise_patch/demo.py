"""``python -m vllm_layerwise_patch demo``: the overlay in a real vLLM run on CPU.

Builds the tiny hybrid Qwen3-Next (seeded random weights), starts vLLM with
Model Runner V2 on CPU (Triton interpreter emulation, engine core in its own
process) with ``VLLM_LAYERWISE_PATCH=1``, generates from a token-id prompt
and prints, for every vLLM process, which patches were applied there.

The layerwise KV pool is not part of this release yet: the demo shows the
patches active in a real V2 run, and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import json, os, sys, time
from vllm_layerwise_patch.testing import cpu_v2_llm_kwargs, tiny_prompt
from vllm import LLM, SamplingParams

model, out = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
llm = LLM(model=model, **cpu_v2_llm_kwargs(enable_prefix_caching=True))
t1 = time.perf_counter()
prompt = tiny_prompt(700, seed=1)
t2 = time.perf_counter()
res = llm.generate([{"prompt_token_ids": prompt}],
                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                   use_tqdm=False)
t3 = time.perf_counter()
cc = llm.llm_engine.vllm_config.cache_config
json.dump({"tokens": list(res[0].outputs[0].token_ids), "prompt_len": len(prompt),
           "engine_start_s": t1 - t0, "generate_s": t3 - t2,
           "block_size": cc.block_size, "mamba_block_size": cc.mamba_block_size,
           "driver_pid": os.getpid()}, open(out, "w"))
"""


def run(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m vllm_layerwise_patch demo")
    ap.add_argument("--model-dir", default=None,
                    help="where to build the tiny model (default: a cache dir)")
    ns = ap.parse_args(argv)

    from .testing.tiny_model import build_tiny_qwen3_next, default_tiny_model_dir

    print("vllm-layerwise-patch demo (CPU, Model Runner V2 emulated with the "
          "Triton interpreter)")
    print("NOTE: the layerwise KV pool is not implemented in this release; this "
          "demo shows the overlay's patches active in every process of a real "
          "vLLM V2 run.\n")
    model_dir = Path(ns.model_dir) if ns.model_dir else default_tiny_model_dir()
    print(f"[1/3] building the tiny hybrid Qwen3-Next in {model_dir} ...", flush=True)
    model_dir = build_tiny_qwen3_next(model_dir)

    with tempfile.TemporaryDirectory(prefix="vlp-demo-") as tmp:
        reports = Path(tmp, "reports")
        result = Path(tmp, "result.json")
        env = dict(os.environ)
        env.update(
            VLLM_LAYERWISE_PATCH=os.environ.get("VLLM_LAYERWISE_PATCH", "1"),
            VLLM_LAYERWISE_PATCH_CPU_V2="1",
            VLLM_LAYERWISE_PATCH_REPORT_DIR=str(reports),
            VLLM_ENABLE_V1_MULTIPROCESSING="1",
        )
        print("[2/3] starting vLLM (engine core in its own process; ~30-60 s on "
              "2 cores) ...", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(model_dir), str(result)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n", file=sys.stderr)
            print(f"demo: vLLM run failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        res = json.loads(result.read_text())
        print(f"      done in {time.perf_counter() - t0:.0f} s "
              f"(engine start {res['engine_start_s']:.1f} s, generate "
              f"{res['generate_s']:.1f} s)")
        print(f"      prompt {res['prompt_len']} tokens -> greedy tokens {res['tokens']}")
        print(f"      KV block size {res['block_size']} tokens (hybrid-aligned)\n")
        print("[3/3] patches per vLLM process:")
        ok = True
        for path in sorted(reports.glob("*.json")):
            rep = json.loads(path.read_text())
            role = ("driver (LLM)" if rep["pid"] == res["driver_pid"]
                    else rep.get("process_name") or "subprocess")
            print(f"  pid {rep['pid']:>7}  {role}")
            for pid_, st in rep["patches"].items():
                if not st["enabled"]:
                    continue
                # pending: this process never imported the target (nothing to patch)
                state = "not imported" if st["state"] == "pending" else st["state"]
                where = st["verified_release"] or ("FORCED" if st["forced"] else "")
                print(f"      {pid_:<28}{state:<14}{where}")
                ok &= st["state"] in ("applied", "not-needed", "pending")
        print("\nresult:", "every enabled patch applied in every process" if ok
              else "some patch was not applied (see above; run doctor)")
        return 0 if ok else 1
