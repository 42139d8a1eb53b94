"""Admission and the save budget (scheduler side, no engine): which planned
saves reach the workers under ``admission: reused`` and
``save_budget_blocks``, counted exactly; a partially admitted prefix is never
a hit past its first missing block; the stats, the Prometheus metrics and
the configuration's validation errors.  The engine end to end is
tests/test_pool_admission_e2e.py."""

from __future__ import annotations

import types

import pytest

from vllm_layerwise_patch.pool.backends.base import pack
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.config import PoolConfig, PoolConfigError
from vllm_layerwise_patch.pool.keys import ATTN, STATE, marker_key, page_key
from vllm_layerwise_patch.pool.layout import PoolLayout
from vllm_layerwise_patch.pool.scheduler.admission import Admission, within_budget
from vllm_layerwise_patch.pool.metadata import AttnSave, SaveSpec

NS = b"N" * 16
B = 4  # tokens per block


def _layout(hybrid=True):
    layers = ((0, ATTN), (1, STATE)) if hybrid else ((0, ATTN),)
    return PoolLayout(kinds=tuple(k for _, k in layers),
                      group_layers=tuple((f"model.layers.{i}.x",) for i, _ in layers),
                      block_size=B, hash_block_size=B)


def _scheduler(tmp_path, hybrid=True, faults=None, **extra):
    from vllm_layerwise_patch.pool.scheduler.planner import PoolScheduler

    sched = PoolScheduler(vllm_config=types.SimpleNamespace(kv_transfer_config=None),
                          layout=_layout(hybrid),
                          backend=LmdbBackend(str(tmp_path / "p"), 64 << 20), namespace=NS,
                          config=PoolConfig.from_extra(extra))
    if faults is not None:  # (the knob is read when the scheduler is built)
        from vllm_layerwise_patch.pool.faults import Faults

        sched.faults = Faults(**faults)
        sched.save_budget = 0 if sched.faults.save_budget_ignored else \
            sched.save_budget
    return sched


def _req(hashes, num_tokens, rid):
    return types.SimpleNamespace(block_hashes=list(hashes), num_tokens=num_tokens,
                                 request_id=rid)


def _hashes(n, tag=0):
    return [bytes([tag, i]) * 4 for i in range(n)]


def _step(new=(), scheduled=None):
    """A SchedulerOutput with ``new`` requests ((req_id, block ids, computed))."""
    cached = types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                   num_computed_tokens=[])
    reqs = [types.SimpleNamespace(req_id=r, block_ids=ids, num_computed_tokens=c)
            for r, ids, c in new]
    return types.SimpleNamespace(scheduled_new_reqs=reqs, scheduled_cached_reqs=cached,
                                 num_scheduled_tokens=dict(scheduled or {}))


def _prefill(sched, rid, hashes, first_id=1):
    """Look ``rid`` up (prompt: ``hashes``' blocks and one token more) and
    schedule its whole prompt but the last token in one step; the step's
    saves."""
    n = len(hashes)
    assert sched.get_num_new_matched_tokens(_req(hashes, n * B + 1, rid), 0) == (0, False)
    ids = list(range(first_id, first_id + n + 1))
    meta = sched.build_connector_meta(_step([(rid, (ids, ids), 0)], {rid: n * B}))
    return meta.saves


def _blocks(saves):
    return sorted({a.hash for s in saves for a in s.attn}
                  | {h for s in saves for h, _ in s.mamba})


def _commit(sched, saves):
    """Store what ``saves`` save, as the workers would (pages and markers)."""
    items = []
    for s in saves:
        for kind, hashes in ((ATTN, [a.hash for a in s.attn]), (STATE, [h for h, _ in s.mamba])):
            for h in hashes:
                items += [(page_key(NS, kind, h, 0, layer), b"x" * 8)
                          for layer in sched.hits.target[kind]]
                items.append((marker_key(NS, kind, h, 0), b""))
    sched.hits.backend.put_many([(k, pack(NS, k, v)) for k, v in items])
    sched.hits.note_generation()  # (the hit cache answers under the new generation)


# -- the rule ------------------------------------------------------------------------

def test_all_saves_every_block_and_counts_nothing(tmp_path):
    sched = _scheduler(tmp_path)
    h = _hashes(3)
    assert _blocks(_prefill(sched, "a", h)) == sorted(h)
    assert sched.stats["not_admitted"] == 0 and sched.stats["over_budget"] == 0


def test_reused_saves_a_prefix_the_second_time_it_is_seen(tmp_path):
    sched = _scheduler(tmp_path, admission="reused")
    h = _hashes(3)
    # seen once: nothing saved; its 3 blocks (pages and the state at block 2) counted
    assert _prefill(sched, "a", h) == []
    assert sched.stats["not_admitted"] == 3
    # a second request holding the first 2 blocks and one of its own: the
    # shared two are admitted, its own is not
    other = h[:2] + _hashes(1, tag=9)
    saves = _prefill(sched, "b", other, first_id=10)
    assert [a.hash for s in saves for a in s.attn] == h[:2]
    assert [hh for s in saves for hh, _ in s.mamba] == []  # the state at its own block
    assert sched.stats["not_admitted"] == 3 + 1
    # a third request with the whole prompt: blocks 0 and 1 (seen 3 times) and
    # block 2 (seen twice) with its state
    saves = _prefill(sched, "c", h, first_id=20)
    assert _blocks(saves) == sorted(h) and [x for x, _ in saves[0].mamba] == [h[2]]
    assert sched.stats["not_admitted"] == 4


def test_a_request_counts_once_however_often_it_is_looked_up(tmp_path):
    sched = _scheduler(tmp_path, admission="reused")
    h = _hashes(2)
    req = _req(h, 2 * B + 1, "a")
    for _ in range(5):  # vLLM asks again while the request waits (and after a preemption)
        sched.get_num_new_matched_tokens(req, 0)
    assert dict(sched.admission.counts) == {h[0]: 1, h[1]: 1}
    sched.request_finished(req)
    assert sched.get_num_new_matched_tokens(_req(h, 2 * B + 1, "b"), 0) == (0, False)
    assert dict(sched.admission.counts) == {h[0]: 2, h[1]: 2}


def test_blocks_a_decode_completes_are_seen_when_their_hash_is_known():
    adm = Admission(_layout(), "reused", window=100)
    h = _hashes(3)
    req = _req(h[:1], B + 1, "a")
    adm.see(req)
    req.block_hashes = h  # the decode completed blocks 1 and 2
    adm.see(req)
    adm.see(req)
    assert dict(adm.counts) == dict.fromkeys(h, 1)
    adm.see(_req(h[:2], 2 * B, "b"))
    assert [adm.admitted(x) for x in h] == [True, True, False]


def test_the_window_forgets_the_least_recently_seen_hashes():
    adm = Admission(_layout(), "reused", window=3)
    a, b = _hashes(2, tag=1), _hashes(2, tag=2)
    adm.see(_req(a, 9, "r1"))
    adm.see(_req(b, 9, "r2"))  # 4 hashes seen: a[0] is forgotten
    assert list(adm.counts) == [a[1], b[0], b[1]]
    adm.see(_req(a, 9, "r3"))
    assert adm.counts[a[0]] == 1 and adm.counts[a[1]] == 2  # a[0] counts from zero
    assert [adm.admitted(x) for x in a] == [False, True]
    assert len(adm.counts) == 3


def test_a_partially_admitted_prefix_is_no_hit_past_its_first_missing_block(tmp_path):
    # A window of 2 forgets block 0 of a 3-block prompt: the second request
    # saves blocks 1 and 2 but not block 0.  The lookup walks from block 0:
    # no hit at all, although blocks 1 and 2 (with the state at 2) are stored.
    sched = _scheduler(tmp_path, admission="reused", admission_window=2)
    h = _hashes(3)
    assert _prefill(sched, "a", h) == []
    saves = _prefill(sched, "b", h, first_id=10)
    assert _blocks(saves) == sorted(h[1:])
    _commit(sched, saves)
    assert sched.hits.present(ATTN, h) == [False, True, True]
    assert sched.hits.present(STATE, h) == [False, False, True]
    assert sched.hits.lookup(_req(h, 3 * B + 1, "c"), 0) == 0
    # control: block 0's pages and state stored as well -> the whole prompt hits
    _commit(sched, [SaveSpec("x", [AttnSave(h[0], {0: 1})], [(h[0], {1: 1})])])
    assert sched.hits.lookup(_req(h, 3 * B + 1, "d"), 0) == 3


# -- the budget ----------------------------------------------------------------------

def _spec(rid, hashes, state=True):
    return SaveSpec(rid, [AttnSave(x, {0: i}) for i, x in enumerate(hashes)],
                    [(hashes[-1], {1: 9})] if state else [])


def test_budget_keeps_whole_requests_on_a_hybrid_layout():
    a, b, c = _hashes(2, 1), _hashes(3, 2), _hashes(1, 3)
    saves = [_spec("a", a), _spec("b", b), _spec("c", c)]
    kept, dropped = within_budget(saves, 3, has_state=True)
    # a (2 blocks) fits, b (3) does not and is skipped whole, c (1) fits
    assert [s.req_id for s in kept] == ["a", "c"] and dropped == 3
    assert within_budget(saves, 0, True) == (saves, 0)  # no limit
    assert within_budget(saves, 6, True) == (saves, 0)
    kept, dropped = within_budget(saves, 1, True)
    assert [s.req_id for s in kept] == ["c"] and dropped == 5


def test_budget_cuts_a_request_to_the_prefix_that_fits_without_state():
    a, b = _hashes(2, 1), _hashes(3, 2)
    kept, dropped = within_budget([_spec("a", a, False), _spec("b", b, False)], 3, False)
    assert [(s.req_id, [x.hash for x in s.attn]) for s in kept] == [("a", a), ("b", b[:1])]
    assert dropped == 2


def test_a_step_hands_at_most_the_budget_to_the_workers(tmp_path):
    def step(sched):
        for rid, tag in (("a", 1), ("b", 2), ("c", 3)):
            sched.get_num_new_matched_tokens(_req(_hashes(2, tag), 2 * B + 1, rid), 0)
        new = [(rid, ([10 * t + i for i in range(3)],) * 2, 0)
               for rid, t in (("a", 1), ("b", 2), ("c", 3))]
        return sched.build_connector_meta(_step(new, {"a": 2 * B, "b": 2 * B,
                                                      "c": 2 * B})).saves

    sched = _scheduler(tmp_path / "k", save_budget_blocks=4)
    saves = step(sched)
    assert len(_blocks(saves)) == 4 and [s.req_id for s in saves] == ["a", "b"]
    assert sched.stats["over_budget"] == 2
    # negative control: the budget not enforced -> 6 blocks go to the workers
    # and nothing is counted
    loose = _scheduler(tmp_path / "x", save_budget_blocks=4,
                       faults={"save_budget_ignored": True})
    saves = step(loose)
    assert len(_blocks(saves)) == 6 and loose.stats["over_budget"] == 0


def test_admission_comes_before_the_budget(tmp_path):
    # only admitted blocks take budget: of a step holding a reused prompt
    # and a new one, the new one is not admitted and the reused one fits
    sched = _scheduler(tmp_path, admission="reused", save_budget_blocks=2)
    old, new = _hashes(2, 1), _hashes(2, 2)
    sched.get_num_new_matched_tokens(_req(old, 2 * B + 1, "seen-before"), 0)
    for rid, h in (("a", new), ("b", old)):
        sched.get_num_new_matched_tokens(_req(h, 2 * B + 1, rid), 0)
    saves = sched.build_connector_meta(_step(
        [("a", ([1, 2, 3],) * 2, 0), ("b", ([4, 5, 6],) * 2, 0)],
        {"a": 2 * B, "b": 2 * B})).saves
    assert [s.req_id for s in saves] == ["b"] and _blocks(saves) == sorted(old)
    assert (sched.stats["not_admitted"], sched.stats["over_budget"]) == (2, 0)


# -- metrics and configuration --------------------------------------------------------

def test_the_counts_reach_the_stats_and_prometheus(tmp_path):
    from vllm_layerwise_patch.pool.prom import METRICS
    from vllm_layerwise_patch.pool.scheduler.stats import SchedulerSideStats
    from vllm_layerwise_patch.pool.stats import PoolStats

    counts = {"not_admitted": 0, "over_budget": 0}
    side = SchedulerSideStats(lambda: counts, None, B, interval=3600)
    side._next_fill = float("inf")
    assert side.take() is None
    counts.update(not_admitted=5, over_budget=2)
    got = side.take().data
    assert (got["blocks_not_admitted"], got["blocks_over_budget"]) == (5, 2)
    counts["not_admitted"] = 7
    assert side.take().data["blocks_not_admitted"] == 2  # increments
    line = PoolStats(data={"blocks_not_admitted": 3, "blocks_over_budget": 4}).reduce()
    assert (line["Blocks not admitted"], line["Blocks over the save budget"]) == (3, 4)
    names = {m.key: m.exposed for m in METRICS}
    assert names["blocks_not_admitted"] == "vllm:layerwise_pool_blocks_not_admitted_total"
    assert names["blocks_over_budget"] == "vllm:layerwise_pool_blocks_over_save_budget_total"


def test_config_defaults():
    c = PoolConfig.from_extra({})
    assert (c.admission, c.admission_window, c.save_budget_blocks) == ("all", 64_000, 0)
    c = PoolConfig.from_extra({"admission": "reused", "admission_window": 10,
                               "save_budget_blocks": 8})
    assert (c.admission, c.admission_window, c.save_budget_blocks) == ("reused", 10, 8)


@pytest.mark.parametrize("extra,field", [
    ({"admission": "seen-twice"}, "admission"), ({"admission": 2}, "admission"),
    ({"admission_window": 0}, "admission_window"),
    ({"admission_window": "1000"}, "admission_window"),
    ({"admission_window": 10**9}, "admission_window"),
    ({"save_budget_blocks": -1}, "save_budget_blocks"),
    ({"save_budget_blocks": 2.5}, "save_budget_blocks"),
    ({"save_budget_blocks": True}, "save_budget_blocks"),
])
def test_config_errors_name_the_field(extra, field):
    with pytest.raises(PoolConfigError) as e:
        PoolConfig.from_extra(extra)
    assert f"kv_connector_extra_config.{field}" in str(e.value), str(e.value)


# -- bench --trace --admission (no server here) -------------------------------------

def _replayed(hit, pool_hit, saved, not_admitted=0.0, cap=None):
    return {"requests": 2, "seconds": 1.0, "capacity_bytes": cap,
            "ttft_s": {"avg": 0.2, "p50": 0.2, "p90": 0.3, "p99": 0.4},
            "hit_rate": {"hbm": hit - pool_hit, "pool": pool_hit},
            "prompt_tokens_by_source": {}, "tokens": [[1], [2]],
            "pool": {"evictions": 0.0, "save_bytes_sum": saved, "blocks_saved": saved / 8,
                     "blocks_not_admitted": not_admitted}}


def test_bench_compares_each_rule_with_all_at_the_same_capacity(tmp_path):
    from vllm_layerwise_patch.bench.admission import compare, markdown, plot
    from vllm_layerwise_patch.bench.replay import finish

    results = {"hbm": _replayed(0.3, 0.0, 0.0),
               "pool@64MiB": _replayed(0.50, 0.20, 800.0, cap=64 << 20),
               "pool@256MiB": _replayed(0.60, 0.30, 1000.0, cap=256 << 20),
               "pool@64MiB/reused": _replayed(0.46, 0.16, 500.0, 40, cap=64 << 20),
               "pool@256MiB/reused": _replayed(0.50, 0.20, 600.0, 40, cap=256 << 20)}
    doc = finish(results, ["64MiB", "256MiB"])
    # the capacity sweep is admission `all` only
    assert [p["capacity"] for p in doc["capacity_sweep"]] == ["64MiB", "256MiB"]
    rows = compare(doc["results"], ["64MiB", "256MiB"], ["all", "reused"])
    assert [(r["capacity"], r["rule"]) for r in rows] == [
        ("64MiB", "all"), ("64MiB", "reused"), ("256MiB", "all"), ("256MiB", "reused")]
    small, big = rows[1], rows[3]
    assert small["hit_points_lost"] == pytest.approx(0.04)
    assert small["bytes_saved_cut"] == pytest.approx(0.375) and small["goal_met"]
    # 10 points lost: not met, however much less it saves
    assert big["hit_points_lost"] == pytest.approx(0.10) and not big["goal_met"]
    text = "\n".join(markdown(rows))
    assert "| 64MiB | reused | 46.0% | 16.0% |" in text and "| 4.0 | 38% | met |" in text
    assert "| 10.0 | 40% | not met |" in text
    pytest.importorskip("matplotlib")
    (png,) = plot(rows, str(tmp_path))
    assert (tmp_path / png).stat().st_size > 0


def test_a_request_whose_blocks_cannot_be_counted_is_not_counted(caplog):
    # (the engine never stops for the pool: at most a save is not made)
    adm = Admission(_layout(), "reused")
    adm.see(types.SimpleNamespace(request_id="bad", block_hashes=None))
    adm.see(types.SimpleNamespace(request_id="bad2", block_hashes=None))
    assert not adm.counts
    assert caplog.text.count("admission cannot count") == 1
    adm.see(_req(_hashes(1), B + 1, "good"))
    assert len(adm.counts) == 1
