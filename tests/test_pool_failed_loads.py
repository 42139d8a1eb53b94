"""A failed load whose request ends before the step's output is processed,
in the order vLLM runs it (no engine here; tests/test_pool_failed_loads_e2e.py
runs it in one), and the saves of blocks a decode completes under
asynchronous scheduling.

vLLM schedules step N+1 before it processes step N's output (asynchronous
scheduling, the GPU default), and ends a request in between when its client
aborts it (``EngineCore`` processes aborts right before
``update_from_output``) or when scheduling N+1 preempts it.  The output of
N then reports the failed load of a request that no longer runs:

* the scheduler side still maps the failure to it (``failures_seen``), so
  the workers' quarantine clears (before: it never did, and saves stopped);
* ``hybrid-load-recompute`` evicts its blocks and everything computed from
  them from vLLM's prefix cache (before: only running holders' blocks, so
  the next request with that prefix hit zeroed pages).

Negative controls: the old rules, as test faults.
"""

from __future__ import annotations

import json
import types

import pytest

from vllm_layerwise_patch.pool.backends.base import pack
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.config import PoolConfig
from vllm_layerwise_patch.pool.faults import FAULTS_ENV
from vllm_layerwise_patch.pool.keys import ATTN, STATE, marker_key, page_key
from vllm_layerwise_patch.pool.metadata import SaveSpec
from vllm_layerwise_patch.pool.worker.quarantine import Quarantine

NS = b"N" * 16
B = 4  # tokens per block


def scheduler(tmp_path, async_scheduling=True):
    """Block 4 tokens, an attention and a state layer; 4 blocks committed."""
    from vllm_layerwise_patch.pool.layout import PoolLayout
    from vllm_layerwise_patch.pool.scheduler.planner import PoolScheduler

    layout = PoolLayout(kinds=(ATTN, STATE), block_size=B, hash_block_size=B,
                        group_layers=(("model.layers.0.x",), ("model.layers.1.x",)))
    cfg = types.SimpleNamespace(kv_transfer_config=None, scheduler_config=types.SimpleNamespace(
        async_scheduling=async_scheduling))
    sched = PoolScheduler(vllm_config=cfg, layout=layout,
                          backend=LmdbBackend(str(tmp_path / "p"), 16 << 20), namespace=NS,
                          config=PoolConfig.from_extra({}))
    hashes = [bytes([i]) * 8 for i in range(6)]
    keys = [k for h in hashes[:4] for kind, layer in ((ATTN, "0"), (STATE, "1"))
            for k in (page_key(NS, kind, h, 0, layer), marker_key(NS, kind, h, 0))]
    sched.hits.backend.put_many([(k, pack(NS, k, b"" if k.endswith(b"commit") else b"x" * 8))
                                 for k in keys])
    return sched, hashes


def request(hashes, rid, tokens=25):
    return types.SimpleNamespace(block_hashes=list(hashes), num_tokens=tokens, request_id=rid,
                                 sampling_params=None)


def step(sched, new=(), cached=(), scheduled=None):
    """One scheduling step: ``new`` = [(request, block table, computed)],
    ``cached`` = [(req_id, computed)]; ``scheduled`` tokens each (4)."""
    out = types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r.request_id, block_ids=table,
                                                  num_computed_tokens=c)
                            for r, table, c in new],
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=[rid for rid, _ in cached], new_block_ids=[None for _ in cached],
            num_computed_tokens=[c for _, c in cached], resumed_req_ids=set()),
        num_scheduled_tokens={**{r.request_id: scheduled or B for r, _, _ in new},
                              **{rid: scheduled or B for rid, _ in cached}})
    return sched.build_connector_meta(out)


def failed_output(block_ids):
    return types.SimpleNamespace(finished_recving=set(), failed_recving=set(),
                                 invalid_block_ids=set(block_ids))


# the request's block table: attention blocks 1-6, the state group's
# columns null but for the hit's end (7) and the running column (8)
TABLE = ([1, 2, 3, 4, 5, 6], [0, 0, 0, 7, 8, 0])
LOADED = {1, 2, 3, 4, 7}


@pytest.fixture(params=["fixed", "old rule"])
def rule(request, monkeypatch):
    if request.param == "old rule":
        monkeypatch.setenv(FAULTS_ENV, json.dumps({"forget_ended_at_once": True}))
    return request.param


def test_a_load_that_fails_after_its_request_ended_is_still_reported_and_cleared(
        tmp_path, rule):
    sched, hashes = scheduler(tmp_path)
    r = request(hashes, "r")
    assert sched.get_num_new_matched_tokens(r, 0) == (16, False)
    sched.update_state_after_alloc(r, types.SimpleNamespace(get_block_ids=lambda: TABLE), 16)
    meta_n = step(sched, new=[(r, [list(ids) for ids in TABLE], 16)])  # step N: the load
    (spec,) = meta_n.loads
    worker = Quarantine()
    # the client aborts r (before update_from_output(N-1)); step N+1 is planned
    sched.request_finished(r)
    step(sched)
    # the worker: r's load failed at the end of step N
    worker.failed(meta_n.loads, {"r"})
    assert worker
    # step N's output reports the failed blocks
    sched.update_connector_output(failed_output(LOADED))
    seen = step(sched).failures_seen  # step N+2
    worker.seen(seen)
    if rule == "old rule":
        assert seen == [] and worker  # never cleared: every later holder is tainted
        later = SaveSpec("q", [], [], reads=[2, 9])  # block 2 reused by another request
        assert worker.split([later]) == ([], [later])
        return
    assert seen == ["r"]
    assert not worker  # nothing kept out of the pool any more
    later = SaveSpec("q", [], [], reads=[2, 9])
    assert worker.split([later]) == ([later], [])


def test_the_blocks_of_an_ended_requests_failed_load_and_all_derived_leave_the_cache(
        tmp_path, monkeypatch):
    """The patched ``_handle_invalid_blocks`` with nobody running: the
    reported blocks, the aborted request's later blocks, and a running
    request's blocks computed after it hit them in vLLM's prefix cache."""
    from vllm_layerwise_patch.patches import hybrid_load_recompute as patch

    sched, hashes = scheduler(tmp_path)
    r = request(hashes, "r")
    sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, types.SimpleNamespace(get_block_ids=lambda: TABLE), 16)
    step(sched, new=[(r, [list(ids) for ids in TABLE], 16)])
    # q hit r's first 4 blocks in HBM (cached at allocation) and computed 10, 11
    q = request(hashes, "q")
    sched._tracked["q"] = type(sched._tracked["r"])(q, [[1, 2, 3, 4, 10, 11], [0, 0, 0, 0, 12, 0]])
    # p holds nothing of r's; s holds block 2 after a healthy block 50
    sched._tracked["p"] = type(sched._tracked["r"])(q, [[50, 20, 21], [0, 0, 22]])
    sched._tracked["s"] = type(sched._tracked["r"])(q, [[50, 2, 51], [0, 0, 52]])
    sched.request_finished(r)
    step(sched)

    def handle(faults=None):
        if faults:
            monkeypatch.setenv(FAULTS_ENV, json.dumps(faults))
        evicted: set[int] = set()
        vllm_sched = types.SimpleNamespace(
            kv_cache_config=types.SimpleNamespace(kv_cache_groups=[0, 1]),
            connector=types.SimpleNamespace(reports_hybrid_load_errors=True,
                                            blocks_to_evict=sched.blocks_to_evict),
            running=[],  # r was aborted; q is left out: nobody runs to be found
            kv_cache_manager=types.SimpleNamespace(
                get_block_ids=lambda rid: (), evict_blocks=evicted.update,
                block_pool=types.SimpleNamespace(null_block=types.SimpleNamespace(block_id=0))),
            recompute_kv_load_failures=True)
        got = patch._handle_invalid_blocks(lambda *a, **k: pytest.fail("upstream's path"),
                                           vllm_sched, (set(LOADED), {}), {})
        return got, evicted

    got, evicted = handle()
    assert got == set()  # nobody to recompute or fail
    # r's blocks, q's computed after its hit, s's from block 2's column on
    assert evicted == {1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 51, 52}
    # the old rule: only running holders' blocks - here none
    _, evicted = handle({"evict_running_holders_only": True})
    assert evicted == set()


def test_a_request_that_still_runs_keeps_the_old_behaviour_and_more(tmp_path):
    """A running holder is still affected (preempted to recompute) and all
    its blocks leave the cache, as before."""
    from vllm_layerwise_patch.patches import hybrid_load_recompute as patch

    sched, hashes = scheduler(tmp_path)
    evicted: set[int] = set()
    running = [types.SimpleNamespace(request_id="a")]
    vllm_sched = types.SimpleNamespace(
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[0, 1]),
        connector=types.SimpleNamespace(reports_hybrid_load_errors=True,
                                        blocks_to_evict=sched.blocks_to_evict),
        running=running,
        kv_cache_manager=types.SimpleNamespace(
            get_block_ids=lambda rid: ([1, 2], [0, 3]), evict_blocks=evicted.update,
            block_pool=types.SimpleNamespace(null_block=types.SimpleNamespace(block_id=0))),
        recompute_kv_load_failures=True)
    got = patch._handle_invalid_blocks(None, vllm_sched, ({3},), {})
    assert got == {"a"} and evicted == {1, 2, 3}
    assert vllm_sched.__dict__[patch._PENDING] == {"a"}


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("planning", ["fixed", "old"])
def test_a_block_a_decode_completes_is_saved_once_its_hash_is_known(
        tmp_path, monkeypatch, async_scheduling, planning):
    """A decode computes block 5's last token in step N.  Synchronous
    scheduling: its hash is known when N is planned.  Asynchronous: only
    when N+1 is - N+1 saves its attention pages and the state in its own
    column (5 -> table column 5, kept by vLLM's align mode)."""
    if planning == "old":
        monkeypatch.setenv(FAULTS_ENV, json.dumps({"save_step_blocks_only": True}))
    sched, hashes = scheduler(tmp_path, async_scheduling)
    r = request(hashes[:5], "r", tokens=23)  # prompt: 5 blocks (20) + 3 tokens
    assert sched.get_num_new_matched_tokens(r, 0) == (16, False)
    sched.update_state_after_alloc(
        r, types.SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5, 6], [0, 0, 0, 7, 8, 9])),
        16)
    table = [[1, 2, 3, 4, 5, 6], [0, 0, 0, 7, 8, 9]]
    saves = step(sched, new=[(r, table, 16)], scheduled=7).saves  # prefill to 23
    assert [a.hash for s in saves for a in s.attn] == [hashes[4]]
    # decode: step N computes token 23, the last of block 5 (tokens 20-23)
    if not async_scheduling:
        r.block_hashes.append(hashes[5])  # (token 23 appended before N is planned)
    meta_n = step(sched, cached=[("r", 23)], scheduled=1)
    if async_scheduling:
        r.block_hashes.append(hashes[5])  # (appended after N+1 was planned... by now)
    meta_next = step(sched, cached=[("r", 24)], scheduled=1)
    planned = [(a.hash, a.ids) for m in (meta_n, meta_next) for s in m.saves for a in s.attn]
    states = [(h, ids) for m in (meta_n, meta_next) for s in m.saves for h, ids in s.mamba]
    if planning == "old" and async_scheduling:  # lost: the next turn cannot hit it
        assert planned == [] and states == []
        return
    assert planned == [(hashes[5], {0: 6})]
    assert states == [(hashes[5], {1: 9})]
    when = meta_n if not async_scheduling else meta_next
    assert [a.hash for s in when.saves for a in s.attn] == [hashes[5]]


@pytest.mark.parametrize("rule", ["fixed", "old"])
def test_a_request_that_hit_a_block_computed_after_the_failure_recomputes(
        tmp_path, monkeypatch, rule):
    """r's load failed; r had computed block 5 after it (cached when it was
    allocated), and q - running - took r's blocks 1-5 as a hit in vLLM's
    prefix cache and computed block 13 from them.  q holds no reported
    block, only one computed from them: it read a wrong page all the same,
    so it is recomputed, and its blocks leave the cache.  The old rule
    (holders of reported blocks only) leaves q running on them."""
    from vllm_layerwise_patch.patches import hybrid_load_recompute as patch

    if rule == "old":
        monkeypatch.setenv(FAULTS_ENV, json.dumps({"evict_running_holders_only": True}))
    sched, hashes = scheduler(tmp_path)
    r = request(hashes, "r")
    sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, types.SimpleNamespace(get_block_ids=lambda: TABLE), 16)
    step(sched, new=[(r, [list(ids) for ids in TABLE], 16)])
    q_table = ([1, 2, 3, 4, 5, 13], [0, 0, 0, 0, 14, 0])
    sched._tracked["q"] = type(sched._tracked["r"])(request(hashes, "q"),
                                                    [list(ids) for ids in q_table])
    evicted: set[int] = set()
    tables = {"q": q_table}
    vllm_sched = types.SimpleNamespace(
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[0, 1]),
        connector=types.SimpleNamespace(reports_hybrid_load_errors=True,
                                        blocks_to_evict=sched.blocks_to_evict),
        running=[types.SimpleNamespace(request_id="q")],  # (r ended)
        kv_cache_manager=types.SimpleNamespace(
            get_block_ids=tables.__getitem__, evict_blocks=evicted.update,
            block_pool=types.SimpleNamespace(null_block=types.SimpleNamespace(block_id=0))),
        recompute_kv_load_failures=True)
    sched.request_finished(r)
    # q holds reported blocks 1-4 too: report only r's state block (7) and
    # block 5, computed after the load, is what q must be found by
    got = patch._handle_invalid_blocks(None, vllm_sched, ({7},), {})
    if rule == "old":
        assert got == set() and evicted == set()
        return
    assert got == {"q"}
    assert {5, 13, 14} <= evicted
