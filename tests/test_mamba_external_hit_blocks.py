"""mamba-external-hit-blocks on vLLM's own KVCacheManager (one attention
and one align-mode Mamba group, 128-token blocks): a first allocation with
an external (pool) hit and new tokens in the same step - the pool's
layerwise loads - must be deferred, not crash, when one block short; the
negative control (patch off) shows vLLM's ValueError, the one that stopped
engines in the small-HBM trace replays."""

from __future__ import annotations

import json

from conftest import clean_env, run_py

_CASES = """
import json
from vllm_layerwise_patch.patches import mamba_external_hit_blocks as m

def outcome(**kw):
    try:
        got, taken = m.allocate_with_external_hit(**kw)
    except ValueError as exc:
        return ["ValueError", str(exc)]
    return ["allocated" if got is not None else "deferred", taken]

def local_only(free_blocks):
    # no external tokens: 6 new blocks (attention 6, Mamba 1)
    manager = m.hybrid_manager(free_blocks + 1)
    request = m.hit_request(6)
    before = manager.block_pool.get_num_free_blocks()
    got = manager.allocate_slots(request, 6 * 128, num_new_computed_tokens=0,
                                 new_computed_blocks=None)
    return ["allocated" if got is not None else "deferred",
            before - manager.block_pool.get_num_free_blocks()]

def async_load(free_blocks):
    # an external hit with no new tokens this step (an asynchronous load):
    # attention 4, Mamba 1 (the hit's state)
    manager = m.hybrid_manager(free_blocks + 1)
    request = m.hit_request(6)
    before = manager.block_pool.get_num_free_blocks()
    got = manager.allocate_slots(request, 0, num_new_computed_tokens=0,
                                 new_computed_blocks=None,
                                 num_external_computed_tokens=4 * 128,
                                 delay_cache_blocks=True)
    return ["allocated" if got is not None else "deferred",
            before - manager.block_pool.get_num_free_blocks()]

print("RESULT", json.dumps({
    "hit_7": outcome(free_blocks=7), "hit_8": outcome(free_blocks=8),
    "hit1_new1_3": outcome(free_blocks=3, hit_blocks=1, new_blocks=1),
    "hit1_new1_4": outcome(free_blocks=4, hit_blocks=1, new_blocks=1),
    "local_7": local_only(7), "local_6": local_only(6),
    "async_5": async_load(5), "async_4": async_load(4),
}))
"""


def _run(patch: str) -> dict:
    out = run_py(_CASES, env=clean_env(VLLM_LAYERWISE_PATCH_CPU_V2="1",
                                       VLLM_LAYERWISE_PATCH=patch)).stdout
    return json.loads(out.split("RESULT", 1)[1])


def test_external_hit_one_block_short_is_deferred_and_upstream_crashes():
    patched = _run("1")
    # 4 hit blocks + 2 new blocks take 8: deferred at 7 free, allocated at 8
    assert patched["hit_7"] == ["deferred", 0]
    assert patched["hit_8"] == ["allocated", 8]
    # 1 + 1: attention 2, Mamba 2 (the hit's state, the new tokens' state)
    assert patched["hit1_new1_3"] == ["deferred", 0]
    assert patched["hit1_new1_4"] == ["allocated", 4]
    # without an external hit, or without new tokens, nothing changes:
    # exactly enough free blocks still allocate
    assert patched["local_7"] == ["allocated", 7]
    assert patched["local_6"] == ["deferred", 0]
    assert patched["async_5"] == ["allocated", 5]
    assert patched["async_4"] == ["deferred", 0]

    # negative control: vLLM's own estimate admits the request one block
    # short and the allocation raises in the engine core
    upstream = _run("0")
    for case in ("hit_7", "hit1_new1_3"):
        assert upstream[case][0] == "ValueError", upstream[case]
        assert "free blocks from the pool" in upstream[case][1]
    for case in ("hit_8", "hit1_new1_4", "local_7", "local_6", "async_5", "async_4"):
        assert upstream[case] == patched[case], (case, upstream[case], patched[case])
