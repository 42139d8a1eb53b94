"""The verdicts of the GPU engine checks (tests/gpu/engine_plans.py) on
synthetic engine results: what passes, and that each comparison fails when
one token or logprob, one hit or one flag is off."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

import engine_plans as plans  # noqa: E402

B = 100  # a block


def o(tokens, cached=0, logprobs=None, phase=0, ttft=None):
    return {"tokens": list(tokens), "cached": cached, "phase": phase, "ttft": ttft,
            "logprobs": list(logprobs or [-0.5] * len(tokens))}


COLD = [o([1, 2]), o([3, 4], 300), o([5, 6]), o([7] * 15)]  # P, PX, PB, TURN1 (+ reply)


def runs() -> dict:
    hbm = [o([1, 2], 300), o([3, 4], 300), o([5, 6], 100)]
    c = {"out": COLD[:3] + hbm + [o([7] * 15), o([8, 9], 200)], "block_size": B}
    b = {"out": copy.deepcopy(hbm) + [o([8, 9], 300)], "block_size": B}
    out = {"A": {"out": copy.deepcopy(COLD), "block_size": B}}
    for sched in plans.SCHEDULING:
        out[f"C-{sched}"] = dict(copy.deepcopy(c), async_scheduling=sched == "async")
        out[f"B-{sched}"] = dict(copy.deepcopy(b), async_scheduling=sched == "async")
    out["F"] = {"out": [o([1, 2], 300)], "log": "... debug-missing ... recompute ..."}
    out["N"] = {"out": [o([1, 9], 300), o([3, 4], 300, [-0.5, -0.6])]}
    return out


def failed(rs: dict) -> list[str]:
    return [c for c, ok, _ in plans.correctness_verdicts(B, rs) if not ok]


def test_a_consistent_run_passes():
    assert failed(runs()) == []


def test_each_comparison_can_fail():
    rs = runs()
    rs["B-sync"]["out"][1]["logprobs"][1] = -0.51  # PX: one logprob
    assert failed(rs) == ["sync: PX tokens and logprobs equal the HBM hit"]
    rs = runs()
    rs["B-async"]["out"][0]["cached"] = 100  # P: one block only, no oracle
    assert set(failed(rs)) == {"async: P hits several blocks from the pool",
                               "async: P hit as vLLM's own cache does"}
    rs = runs()
    rs["B-async"]["out"][3]["tokens"][1] = 0  # turn 2, a later token: recorded
    assert failed(rs) == []
    rs["B-async"]["out"][3]["tokens"][0] = 0  # ... the first one: failed
    assert failed(rs) == ["async: TURN2's first token equals vLLM's own cache's (which hit less)"]
    rs = runs()
    rs["C-sync"]["async_scheduling"] = True
    assert failed(rs) == ["sync: async_scheduling=False in B and C"]
    rs = runs()
    rs["F"]["log"] = "no fault"
    assert failed(rs) == ["F: a failed layer load is recomputed with the cold run's tokens"]
    rs = runs()
    rs["N"]["out"] = copy.deepcopy(rs["C-async"]["out"][3:5])  # state loaded after all
    assert failed(rs) == ["N (negative control, state pages not loaded): the comparison "
                          "sees other tokens"]
    rs = runs()
    rs["A"]["out"][2]["cached"] = 100
    assert failed(rs) == ["A serves P, PB and turn 1 cold (PX hits P's blocks in its own cache)"]


def test_a_hit_of_nothing_is_judged_against_the_cold_run():
    row = plans.compare(o([5, 6], 0), o([5, 6], 100, [-0.1, -0.1]), o([5, 6]))
    assert row["oracle"] == "cold" and row["equal"] is True
    row = plans.compare(o([5, 7], 0), o([5, 6], 100), o([5, 6]))
    assert row["equal"] is False and row["first_difference"] == 1


def test_ttft_table():
    def engine(phases):
        return {"out": [dict(x, phase=i) for i, xs in enumerate(phases) for x in xs]}

    warm = [o([1], ttft=9.0)]
    rs = {"T-hbm": engine([warm, [o([1], 0, ttft=2.0)], [o([1], 0, ttft=1.9)],
                           [o([1], 1200, ttft=0.4), o([1], 1200, ttft=0.6)]]),
          "T-fill": engine([warm, [o([1], 0, ttft=2.1)]]),
          "T-layerwise": engine([warm, [o([1], 1200, ttft=0.5), o([1], 1200, ttft=0.7)]]),
          "T-bulk": engine([warm, [o([1], 1200, ttft=1.0), o([1], 1200, ttft=1.0)]])}
    metrics = {"T-layerwise": [{"Forward wait on loads (ms)": "30.0",
                                "External hit tokens loaded": "2400", "Loaded (GB)": "0.5"}],
               "T-bulk": [{"Forward wait on loads (ms)": "0", "External hit tokens loaded": "2400",
                           "Loaded (GB)": "0.5"}]}
    t = plans.ttft_table(rs, metrics)
    assert t["rows"]["hbm_hit"]["median_s"] == 0.5 and t["rows"]["cold"]["median_s"] == 2.0
    assert t["ratios"]["pool_layerwise_over_hbm"] == 1.2
    assert t["ratios"]["pool_bulk_over_hbm"] == 2.0
    assert t["rows"]["pool_hit_layerwise"]["exposed_load_wait_ms_per_request"] == 15.0
    assert t["same_hits"] is True
    assert all(ok for _, ok, _ in plans.ttft_verdicts(t))
    rs["T-bulk"]["out"][-1]["cached"] = 600
    t = plans.ttft_table(rs, metrics)
    assert not t["same_hits"]
    assert [c for c, ok, _ in plans.ttft_verdicts(t) if not ok] == [
        "TTFT pool and HBM hits are the same length"]
