"""Stress: 100 requests, 8 at a time, 90 % sharing one of 4 long prefixes,
served by two engine instances in sequence (50 each) on one pool, against a
single no-pool engine over the same trace (vLLM's own prefix cache with room
for everything: an unbounded HBM cache).

All requests complete; every output equals the baseline's; the prefix hit
tokens with the pool (vLLM's local hits plus external ones, summed over both
engines) are at least the baseline's - although the second engine starts with
an empty HBM cache."""

from __future__ import annotations

import json
import random

import pytest

from conftest import clean_env, run_py

pytestmark = pytest.mark.vllm

N, PREFIXES, SHARED = 100, 4, 0.9

DRIVER = r"""
import json, sys
cfg = json.loads(sys.argv[1])
from vllm_layerwise_patch.testing import cpu_v2_llm_kwargs, tiny_prompt
from vllm import LLM, SamplingParams

kw = cpu_v2_llm_kwargs(enable_prefix_caching=True, max_num_batched_tokens=1280,
                       max_num_seqs=8, kv_cache_memory_bytes=1 << 30)
if cfg.get("pool") is not None:
    kw["kv_transfer_config"] = {"kv_connector": "LayerwisePoolConnector",
        "kv_connector_module_path": "vllm_layerwise_patch.pool", "kv_role": "kv_both",
        "kv_connector_extra_config": cfg["pool"]}
llm = LLM(model=cfg["model"], **kw)
prompts = []
for spec in cfg["requests"]:
    p = tiny_prompt(*spec["prefix"]) if spec.get("prefix") else []
    prompts.append({"prompt_token_ids": p + tiny_prompt(*spec["suffix"])})
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                    use_tqdm=False)
print("RESULT " + json.dumps([{"tokens": list(o.outputs[0].token_ids),
                               "cached": o.num_cached_tokens,
                               "finished": o.finished} for o in outs]))
"""


def trace():
    rng = random.Random(1234)
    reqs = []
    for i in range(N):
        if rng.random() < SHARED:
            k = rng.randrange(PREFIXES)
            reqs.append({"prefix": [1300, 100 + k], "suffix": [40, 1000 + i]})
        else:
            reqs.append({"suffix": [700, 2000 + i]})
    return reqs


def run_engine(model_dir, cwd, requests, pool=None, patches="1"):
    cfg = {"model": str(model_dir), "pool": pool, "requests": requests}
    env = clean_env(VLLM_LAYERWISE_PATCH=patches, VLLM_LAYERWISE_PATCH_CPU_V2="1",
                    VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = run_py(DRIVER.replace("sys.argv[1]", repr(json.dumps(cfg))), env=env, cwd=str(cwd))
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def test_shared_prefix_trace_across_two_engines(tiny_model_dir, tmp_path):
    reqs = trace()
    assert sum("prefix" in r for r in reqs) >= 80
    baseline = run_engine(tiny_model_dir, tmp_path, reqs, patches="0")
    pool = {"path": str(tmp_path / "pool"), "capacity": "512MiB"}
    first = run_engine(tiny_model_dir, tmp_path, reqs[: N // 2], pool=pool)
    second = run_engine(tiny_model_dir, tmp_path, reqs[N // 2:], pool=pool)
    served = first + second
    assert len(served) == N and all(o["finished"] for o in served)
    assert [o["tokens"] for o in served] == [o["tokens"] for o in baseline]
    hbm_hits = sum(o["cached"] for o in baseline)
    pool_hits = sum(o["cached"] for o in served)
    prompt_tokens = sum((1340 if "prefix" in r else 700) for r in reqs)
    print(f"hit rate: pool {pool_hits / prompt_tokens:.3f} vs unbounded HBM "
          f"{hbm_hits / prompt_tokens:.3f} ({pool_hits} vs {hbm_hits} tokens)")
    assert pool_hits >= hbm_hits > 0
    # the second engine's first request of each prefix came from the pool
    assert any(o["cached"] > 0 for o in second)
