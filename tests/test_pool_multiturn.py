"""The next turn of a chat hits past the first prompt into the reply, from the
pool, under vLLM's asynchronous scheduling (the GPU default) and with
synchronous scheduling.

A block a decode completes gets its prefix hash only with its last token,
which asynchronous scheduling appends after the next step was planned: the
step that completes it cannot name it, and before the fix no later step
saved it (pool/scheduler/saves.py).  Turn 1: a 2100-token prompt and a
220-token reply (blocks of 384: the prompt fills 5 blocks, prompt and reply
6).  Turn 2, on a fresh engine: prompt, reply and 200 new tokens - a hit of
6 blocks, the 6th and its boundary state computed by turn 1's decode.

The oracle.  vLLM's own prefix cache does not hit into the reply (measured
with a 320-token reply: both turns in one engine hit 1920, with either
scheduling; its align mode keeps no state a decode reaches), so "vLLM's own
cache with the same hit" (DESIGN §9) does not exist for this hit.  Instead:
a decode computes the same bytes with either scheduling (one request, one
token a step), and with synchronous scheduling the reply's block is saved by
the step that computes it - the path every prefill block takes.  So the
pool written under asynchronous scheduling must hold exactly the bytes the
synchronous one does (a page or state not the block's own - another column,
a later step's - would differ), and turn 2 served from it the same tokens
and logprobs.  Negative control: the planning before the fix
(``save_step_blocks_only``): the pool hits only the prompt's 5 blocks under
asynchronous scheduling.
"""

from __future__ import annotations

import pytest

from vllm_layerwise_patch.testing.engines import engine_env, run_engine, served, toks

from test_pool_async_sched import data
from test_pool_default_layout import INTERLEAVED

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # long: the slow set

BLOCK = 384
TURN1 = {"prefix": [2100, 11]}
REPLY = 220  # (prompt and reply: 2320 tokens, past the 6th block's end)
SCHEDULING = {"async": {}, "sync": {"async_scheduling": False}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from vllm_layerwise_patch.testing.tiny_model import build_tiny_qwen3_next

    return build_tiny_qwen3_next(
        tmp_path_factory.mktemp("multiturn"), num_layers=6, layer_types=INTERLEAVED,
        hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
        linear_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2, num_experts=4)


def engine(model, pool, phases, sched, **spec):
    spec = dict({"model": str(model), "pool": pool, "phases": phases, "max_tokens": 8,
                 "llm": SCHEDULING[sched]}, **spec)
    return served(run_engine(spec, env=engine_env()))


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    """Per scheduling and planning: turn 1 on an empty pool, then on a fresh
    engine turn 2 - turn 1, its greedy reply and 200 new tokens: (turn 2's
    hit, its tokens and logprobs, the pool's entries, the reply)."""
    out = {}
    for sched, planning in (("async", "fixed"), ("sync", "fixed"), ("async", "old")):
        faults = {"debug_save_step_blocks_only": True} if planning == "old" else {}
        path = tmp_path_factory.mktemp(f"{sched}-{planning}") / "pool"
        pool = {"path": str(path), "capacity": "64MiB", **faults}
        reply = engine(model, pool, [{"prompts": [TURN1], "max_tokens": REPLY}],
                       sched)["out"][0]["tokens"]
        turn2 = {"prefix": TURN1["prefix"], "tokens": reply, "suffix": [200, 12]}
        res = engine(model, pool, [{"prompts": [turn2]}], sched)
        out[sched, planning] = (res["out"][0]["cached"], toks(res)[0], data(path), reply)
    return out


def test_the_next_turn_hits_into_the_reply_from_the_pool(runs):
    hit, got, stored, reply = runs["async", "fixed"]
    sync_hit, sync_got, sync_stored, sync_reply = runs["sync", "fixed"]
    print(f"pool hits: async {hit}, sync {sync_hit}")
    assert len(reply) == REPLY and reply == sync_reply  # (the same turn 2)
    assert hit == sync_hit == 6 * BLOCK  # past the prompt (5 blocks) into the reply
    # the same entries, byte for byte, as the synchronous save of each block
    assert set(stored) == set(sync_stored)
    assert [k for k in stored if stored[k] != sync_stored[k]] == []
    assert got == sync_got


def test_negative_control_the_old_planning_loses_the_replys_block(runs):
    hit, _, _, _ = runs["async", "old"]
    assert hit == 5 * BLOCK  # (turn 2 then stores the block from its own prefill)
