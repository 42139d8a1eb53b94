"""Stress: 100 requests, 8 at a time, 90 % sharing one of 4 long prefixes,
served by two engine instances in sequence (50 each) on one pool, against a
single no-pool engine over the same trace (vLLM's own prefix cache with room
for everything: an unbounded HBM cache).

All requests complete; every output equals the baseline's.  The second
engine starts with an empty HBM cache, so the first of its requests on each
prefix can only hit through the pool: every one of its prefixed requests
must have the prefix's 2 full blocks (1280 tokens) cached, and its workers
must have loaded at least one prefix per distinct prefix from the pool."""

from __future__ import annotations

import random

import pytest

from vllm_layerwise_patch.testing.engines import engine_env, kv_metrics, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a long trace: the slow set

N, PREFIXES, SHARED = 100, 4, 0.9
PREFIX_BLOCKS = 1280  # a 1300-token prefix: 2 full 640-token blocks


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


def serve(model_dir, cwd, requests, pool=None, patches="1"):
    spec = {"model": str(model_dir), "pool": pool, "prompts": requests, "batch": True,
            "max_tokens": 2, "logprobs": False,
            "llm": {"max_num_batched_tokens": 1280, "max_num_seqs": 8,
                    "kv_cache_memory_bytes": 1 << 30}}
    res = run_engine(spec, env=engine_env(patches), cwd=str(cwd))
    assert res["error"] is None, res["error"] + "\n" + res["log"][-3000:]
    return res


def test_shared_prefix_trace_across_two_engines(tiny_model_dir, tmp_path):
    reqs = trace()
    assert sum("prefix" in r for r in reqs) >= 80
    baseline = serve(tiny_model_dir, tmp_path, reqs, patches="0")["out"]
    pool = {"path": str(tmp_path / "pool"), "capacity": "128MiB"}
    first = serve(tiny_model_dir, tmp_path, reqs[: N // 2], pool=pool)
    second_run = serve(tiny_model_dir, tmp_path, reqs[N // 2:], pool=pool)
    second = second_run["out"]
    served = first["out"] + second
    assert len(served) == N and all(o["finish"] == "length" for o in served)
    assert [o["tokens"] for o in served] == [o["tokens"] for o in baseline]
    hbm_hits = sum(o["cached"] for o in baseline)
    pool_hits = sum(o["cached"] for o in served)
    prompt_tokens = sum((1340 if "prefix" in r else 700) for r in reqs)
    print(f"hit rate: pool {pool_hits / prompt_tokens:.3f} vs unbounded HBM "
          f"{hbm_hits / prompt_tokens:.3f} ({pool_hits} vs {hbm_hits} tokens)")
    # the second engine's HBM cache starts empty: its first request on each
    # prefix has the prefix only through the pool
    later = [(r, o) for r, o in zip(reqs[N // 2:], second) if "prefix" in r]
    assert later and all(o["cached"] >= PREFIX_BLOCKS for _, o in later), \
        [o["cached"] for _, o in later]
    prefixes = {tuple(r["prefix"]) for r, _ in later}
    loaded = sum(int(m["External hit tokens loaded"]) for m in kv_metrics(second_run["log"]))
    assert loaded >= PREFIX_BLOCKS * len(prefixes), loaded
    assert pool_hits >= hbm_hits > 0
