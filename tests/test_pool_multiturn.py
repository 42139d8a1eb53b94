"""The next turn of a chat hits past the first prompt into the reply, from the
pool, under vLLM's asynchronous scheduling (the GPU default) and with
synchronous scheduling.

A block a decode completes gets its prefix hash only with its last token,
which asynchronous scheduling appends after the next step was planned: the
step that completes it cannot name it, and before the fix no later step
saved it (pool/scheduler/saves.py).  Turn 1: a 2100-token prompt and a
320-token reply (blocks of 384: the prompt fills 5 blocks, prompt and reply
6).  Turn 2, on a fresh engine: prompt, reply and 200 new tokens - a hit of
6 blocks, the 6th and its boundary state computed by turn 1's decode.

The hit mixes pages of two forwards (turn 1's prefill and its decode, and
turn 2's own), so the oracle is vLLM's own prefix cache serving both turns in
one engine with the same hit (DESIGN §9).  Negative control: the planning
before the fix (``save_step_blocks_only``): the pool hits only the prompt's
5 blocks under asynchronous scheduling.
"""

from __future__ import annotations

import pytest

from vllm_layerwise_patch.testing.engines import engine_env, run_engine, served, toks

from test_pool_default_layout import INTERLEAVED

pytestmark = pytest.mark.vllm

BLOCK = 384
TURN1 = {"prefix": [2100, 11]}
REPLY = 320
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
def turn2(model):
    """Turn 2's prompt: turn 1, its greedy reply (the same in every engine),
    and 200 new tokens."""
    res = engine(model, None, [{"prompts": [TURN1], "max_tokens": REPLY}], "async")
    reply = res["out"][0]["tokens"]
    assert len(reply) == REPLY
    return {"prefix": TURN1["prefix"], "tokens": reply, "suffix": [200, 12]}


@pytest.fixture(scope="module")
def hbm(model, turn2):
    """vLLM's own prefix cache: both turns in one engine, per scheduling."""
    out = {}
    for sched in SCHEDULING:
        res = engine(model, None, [{"prompts": [TURN1], "max_tokens": REPLY},
                                   {"prompts": [turn2]}], sched)
        out[sched] = (res["out"][1]["cached"], toks(res)[1])
    return out


@pytest.mark.parametrize("planning", ["fixed", "old"])
@pytest.mark.parametrize("sched", list(SCHEDULING))
def test_the_next_turn_hits_into_the_reply_from_the_pool(model, tmp_path, turn2, hbm, sched,
                                                         planning):
    faults = {"debug_save_step_blocks_only": True} if planning == "old" else {}
    pool = {"path": str(tmp_path / "pool"), "capacity": "64MiB", **faults}
    engine(model, pool, [{"prompts": [TURN1], "max_tokens": REPLY}], sched)
    res = engine(model, pool, [{"prompts": [turn2]}], sched)
    hit = res["out"][0]["cached"]
    print(f"{sched}/{planning}: pool hit {hit}; vLLM's own cache in one engine: "
          f"{hbm[sched][0]}")
    if planning == "old" and sched == "async":  # the reply's block was never saved
        assert hit == 5 * BLOCK
        return
    assert hit == 6 * BLOCK  # past the prompt (5 blocks) into the reply
    assert hbm[sched][0] == hit, "vLLM's own cache hit elsewhere: no oracle for this hit"
    assert toks(res)[0] == hbm[sched][1]
