"""Operator tools without an engine: the stats payload's samples and fill,
the Prometheus metrics recorded from it, the scheduler side's counts and
fill, the holder records, the ``pool`` command on a pool written here, and
the Grafana dashboard rendered from the metric list.  The same tools on a
pool a real ``vllm serve`` wrote: tests/test_pool_ops_server.py."""

from __future__ import annotations

import json
import os
import re
import runpy
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_layerwise_patch.pool.directory import holders
from vllm_layerwise_patch.pool.backends.base import HEADER_SIZE, pack
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.keys import group_key, marker_key, namespace_key, page_key
from vllm_layerwise_patch.pool_cli import main as pool_main

ROOT = Path(__file__).resolve().parent.parent
NS_A, NS_B = bytes(range(16)), bytes(range(16, 32))


def write_pool(path, blocks=3, ns=NS_A, model="m"):
    b = LmdbBackend(str(path), 8 << 20)
    items = []
    for h in range(blocks):
        hb = bytes([h + 1]) * 32
        for kind in ("attn", "state"):
            items += [(page_key(ns, kind, hb, 0, str(layer)), os.urandom(512))
                      for layer in range(2)]
            items.append((marker_key(ns, kind, hb, 0), b""))
    desc = {"model": model, "vllm": "0.32.0", "dtype": "bfloat16",
            "layout": {"tp_size": 1, "block_size": 640}}
    items.append((namespace_key(ns), json.dumps(desc).encode()))
    b.put_many([(k, pack(ns, k, v)) for k, v in items])
    b.close()
    return [k for k, _ in items]


def cli(capsys, *args):
    rc = pool_main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


# -- stats payload and Prometheus ------------------------------------------------

def test_stats_payload_keeps_step_samples_and_the_latest_fill():
    from vllm_layerwise_patch.pool.stats import PoolStats

    a = PoolStats(data={"bytes_loaded": 100, "load_seconds": 0.5}).sample_step()
    b = PoolStats(data={"bytes_loaded": 50, "bytes_saved": 7}).sample_step()
    agg = a.aggregate(b)  # two workers of one step
    assert agg.data["bytes_loaded"] == 150 and agg.data["bytes_loaded_samples"] == [100, 50]
    assert agg.data["load_seconds_samples"] == [0.5] and agg.data["bytes_saved_samples"] == [7]
    assert "wait_seconds_samples" not in agg.data  # nothing waited: no sample
    fill = PoolStats(data={"pool_used_bytes": 10, "pool_capacity_bytes": 99})
    assert not fill.is_empty() and PoolStats().is_empty()
    agg.aggregate(fill).aggregate(PoolStats(data={"pool_used_bytes": 20}))
    assert agg.data["pool_used_bytes"] == 20  # the latest, not a sum
    assert "Pool used (GB)" in agg.reduce() and "Pool used (GB)" not in b.reduce()


def _registry_types():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()

    def bound(cls):
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **kw: cls.__init__(
            self, *a, registry=reg, **kw)})
    return reg, {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def test_prometheus_metrics_record_a_payload_per_engine():
    from prometheus_client import generate_latest

    from vllm_layerwise_patch.pool.prom import METRICS, PoolPromMetrics
    from vllm_layerwise_patch.pool.stats import PoolStats

    reg, types = _registry_types()
    prom = PoolPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                           ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    payload = PoolStats(data={"lookup_hit_tokens": 1280, "lookup_hit_blocks": 2,
                              "bytes_loaded": 4096, "wait_seconds": 0.002, "load_failures": 1,
                              "pool_used_bytes": 5000, "pool_capacity_bytes": 1 << 26}
                        ).sample_step().to_dict()
    prom.observe(payload, engine_idx=1)
    text = generate_latest(reg).decode()

    def value(name, engine="1"):
        (v,) = re.findall(rf'^{re.escape(name)}{{engine="{engine}",model_name="m"}} (\S+)$',
                          text, flags=re.M)
        return float(v)
    assert value("vllm:layerwise_pool_hit_tokens_total") == 1280
    assert value("vllm:layerwise_pool_hit_blocks_total") == 2
    assert value("vllm:layerwise_pool_failed_loads_total") == 1
    assert value("vllm:layerwise_pool_load_bytes_sum") == 4096
    assert value("vllm:layerwise_pool_load_bytes_count") == 1
    assert value("vllm:layerwise_pool_load_wait_seconds_sum") == 0.002
    assert value("vllm:layerwise_pool_capacity_bytes") == 1 << 26
    assert value("vllm:layerwise_pool_used_bytes") == 5000
    assert value("vllm:layerwise_pool_hit_tokens_total", engine="0") == 0
    for m in METRICS:  # every metric registered, under the one prefix
        assert f"# TYPE {m.exposed} {m.kind}" in text


def test_scheduler_side_counts_once_and_sends_the_fill_when_it_changes(tmp_path):
    from vllm_layerwise_patch.pool.scheduler.stats import SchedulerSideStats

    write_pool(tmp_path / "pool", blocks=1)
    backend = LmdbBackend(str(tmp_path / "pool"), 8 << 20)
    counts = {"hit_tokens": 0, "waits": 0, "timeouts": 0}
    side = SchedulerSideStats(lambda: counts, backend, block_size=640, interval=0)
    first = side.take().data
    assert first["pool_entries"] == 7 and first["pool_capacity_bytes"] == 8 << 20
    assert first["pool_used_bytes"] > 0 and first["lookup_hit_tokens"] == 0
    assert side.take() is None  # nothing new
    counts["hit_tokens"] = 3 * 640
    got = side.take().data
    assert (got["lookup_hit_tokens"], got["lookup_hit_blocks"]) == (1920, 3)
    assert "pool_entries" not in got and got["shared_load_waits"] == 0
    counts["waits"] += 2  # two lookups waited for another request's load (inflight)
    assert side.take().data["shared_load_waits"] == 2
    counts["waits"] += 1
    counts["timeouts"] += 1
    got = side.take().data
    assert (got["shared_load_waits"], got["shared_load_timeouts"]) == (1, 1)
    backend.delete_groups([group_key(NS_A, "attn", b"\1" * 32, 0)])
    assert side.take().data["pool_entries"] == 4
    backend.close()


# -- holders -------------------------------------------------------------------------

HOLDER = """
import sys, time
from vllm_layerwise_patch.pool.directory import holders
holders.register(sys.argv[1], "scheduler", "the-model")
holders.register(sys.argv[1], "worker", "the-model")
print("ready", flush=True)
time.sleep(120)
"""


def start_holder(path):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_holders_name_a_live_process_and_forget_a_dead_one(tmp_path, monkeypatch):
    monkeypatch.setattr(holders, "_GRACE_SECONDS", 0.0)
    path = tmp_path / "pool"
    path.mkdir(mode=0o700)
    proc = start_holder(path)
    try:
        (rec,) = holders.holders(str(path))
        assert (rec["pid"], rec["role"], rec["model"]) == (proc.pid, "scheduler+worker",
                                                          "the-model")
        assert "vllm_layerwise_patch" in rec["cmdline"] or rec["cmdline"].startswith(
            sys.executable)
        assert oct(os.stat(path / f"holder-{proc.pid}.json").st_mode & 0o777) == "0o600"
        assert f"pid {proc.pid}" in holders.describe(rec)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert holders.holders(str(path)) == []  # the lock died with it: the file is stale
    assert not (path / f"holder-{proc.pid}.json").exists()


# -- the pool command -------------------------------------------------------------------

def test_pool_info_verify_clear_on_a_written_pool(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(holders, "_GRACE_SECONDS", 0.0)
    path = tmp_path / "pool"
    keys_a = write_pool(path, blocks=3, ns=NS_A, model="model-a")
    write_pool(path, blocks=1, ns=NS_B, model="model-b")
    rc, out, _ = cli(capsys, "info", str(path), "--json")
    doc = json.loads(out)
    a, b = doc["namespaces"][NS_A.hex()], doc["namespaces"][NS_B.hex()]
    assert rc == 0 and doc["backend"] == "lmdb" and doc["capacity_bytes"] == 8 << 20
    assert (a["entries"], a["blocks"], a["commit_markers"], a["ranks"]) == (19, 3, 6, ["tp0"])
    assert a["groups"] == {"attn": 3, "state": 3, "meta": 1} and b["blocks"] == 1
    assert a["description"]["model"] == "model-a" and a["oldest_access"] <= a["newest_access"]
    rc, out, _ = cli(capsys, "info", str(path))
    assert "model model-a, vllm 0.32.0, dtype bfloat16, tp_size 1, block_size 640" in out

    # two kinds of damage in one group of A, one in B's description
    import lmdb

    env = lmdb.open(str(path), max_dbs=4, subdir=True)
    data = env.open_db(b"data")
    page, other = keys_a[0], keys_a[1]
    with env.begin(write=True, db=data) as txn:
        v = bytearray(txn.get(page))
        v[HEADER_SIZE + 10] ^= 0xFF
        txn.put(page, bytes(v))
        txn.put(other, bytes(txn.get(other))[:HEADER_SIZE + 3])
        v = bytearray(txn.get(namespace_key(NS_B)))
        v[:4] = b"XXXX"
        txn.put(namespace_key(NS_B), bytes(v))
    env.close()
    rc, out, err = cli(capsys, "verify", str(path))
    assert rc == 1 and "checked 26 entries: 2 damaged group(s)" in out, out
    group_a = page.rpartition(b"/")[0].decode()
    assert f"{group_a}: 2 entries (checksum, truncated)" in out
    assert f"{NS_B.hex()}/meta: 1 entry (bad-header)" in out and "--drop" in out
    assert "verify" in err and "26/26" in err  # the progress bar
    rc, out, _ = cli(capsys, "verify", str(path), "--drop", "--json", "--no-progress")
    assert rc == 0 and json.loads(out)["dropped"] and json.loads(out)["damaged_groups"] == 2
    rc, out, _ = cli(capsys, "verify", str(path), "--no-progress")
    assert rc == 0 and "checked 22 entries: 0 damaged group(s)" in out

    # clear: refused while a holder lives, one namespace by prefix, then all
    proc = start_holder(path)
    try:
        rc, out, err = cli(capsys, "clear", str(path))
        assert rc == 1 and "refused: 1 engine process(es)" in err and f"pid {proc.pid}" in err
        assert "scheduler+worker of the-model" in err and "--force" in err
        rc, out, _ = cli(capsys, "clear", str(path), "--namespace", NS_B.hex()[:6], "--force")
        assert rc == 0 and f"cleared namespace {NS_B.hex()}: 6 entries in 2 groups" in out
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    rc, _, err = cli(capsys, "clear", str(path), "--namespace", "ffff")
    assert rc == 1 and "no such namespace" in err
    rc, out, _ = cli(capsys, "clear", str(path), "--json")
    assert rc == 0 and json.loads(out)["entries"] == 16
    rc, out, _ = cli(capsys, "info", str(path), "--json")
    assert json.loads(out)["namespaces"] == {} and json.loads(out)["entries"] == 0


def test_pool_command_refusals(tmp_path, capsys):
    rc, _, err = cli(capsys, "info", str(tmp_path / "nothing"))
    assert rc == 1 and "no pool at" in err
    (tmp_path / "p").mkdir(mode=0o700)
    write_pool(tmp_path / "p", blocks=1)
    os.chmod(tmp_path / "p", 0o777)
    rc, _, err = cli(capsys, "info", str(tmp_path / "p"))
    assert rc == 1 and "writable by group or others" in err
    rc, _, err = cli(capsys, "info", "--config", '{"capacity": "1XB"}')
    assert rc == 2 and "kv_connector_extra_config.capacity" in err
    cfg = json.dumps({"kv_connector_extra_config": {
        "backend": "mooncake", "mooncake": {"master_address": "127.0.0.1:9"}}})
    rc, _, err = cli(capsys, "verify", "--config", cfg)
    assert rc == 1 and "not supported on the Mooncake backend" in err


def test_main_lists_the_pool_command():
    proc = subprocess.run([sys.executable, "-m", "vllm_layerwise_patch", "pool", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "info" in proc.stdout and "clear" in proc.stdout


# -- Grafana dashboard ------------------------------------------------------------------

def test_grafana_dashboard_is_rendered_from_the_metric_list():
    mod = runpy.run_path(str(ROOT / "scripts" / "render_dashboard.py"))
    assert mod["OUT"].read_text() == mod["rendered"](), "run: python scripts/render_dashboard.py"
    doc = json.loads(mod["OUT"].read_text())
    titles = {p["title"] for p in doc["panels"]}
    assert {"Hit rate by source", "Load / save throughput", "Exposed load wait",
            "Failures and evictions", "Pool fill"} <= titles
    assert [v["name"] for v in doc["templating"]["list"]] == [
        "datasource", "job", "model_name", "instance", "engine"]
    # every name the dashboard queries is ours or one vLLM's stat logger registers
    from vllm_layerwise_patch.pool.prom import METRICS
    import vllm.v1.metrics.loggers as loggers

    ours = {m.exposed for m in METRICS} | {m.full_name + s for m in METRICS
                                            for s in ("_sum", "_count", "_bucket")}
    vllm_names = set(re.findall(r'name="(vllm:[a-z_]+)"', Path(loggers.__file__).read_text()))
    vllm_names |= {n + "_total" for n in vllm_names}
    for p in doc["panels"]:
        for t in p["targets"]:
            for name in re.findall(r"vllm:[a-z_]+", t["expr"]):
                assert name in ours | vllm_names, (p["title"], name)


# -- Mooncake: info only, and it says what it cannot tell -----------------------------

def test_pool_info_on_mooncake_reads_a_namespace_description(tmp_path, capsys):
    pytest.importorskip("mooncake.store")
    from vllm_layerwise_patch.mooncake_local import LocalMooncake, free_port
    from vllm_layerwise_patch.pool.backends.mooncake.backend import MooncakeBackend
    from vllm_layerwise_patch.pool.config import PoolConfig

    lm = LocalMooncake(tmp_path / "mc", rpc_port=free_port(), metrics_port=free_port(),
                       holder=64 << 20, holder_port=free_port()).start()
    try:
        cfg = {"backend": "mooncake", "mooncake": {
            "master_address": lm.master_address, "global_segment_size": 0,
            "local_buffer_size": "16MiB"}}
        be = MooncakeBackend(PoolConfig.from_extra(cfg).mooncake)
        desc = {"model": "model-mc", "vllm": "0.32.0", "layout": {"tp_size": 2}}
        key = namespace_key(NS_A)
        be.put_many([(key, pack(NS_A, key, json.dumps(desc).encode()))])
        be.close()
        rc, out, _ = cli(capsys, "info", "--config", json.dumps(cfg), "--namespace", NS_A.hex())
        assert rc == 0 and f"namespace {NS_A.hex()}: model model-mc, vllm 0.32.0, tp_size 2" in out
        assert "cannot list keys" in out
        rc, out, _ = cli(capsys, "info", "--config", json.dumps(cfg), "--namespace",
                         NS_B.hex(), "--json")
        assert rc == 0 and json.loads(out)["description"] is None
    finally:
        lm.stop()
    rc, _, err = cli(capsys, "info", "--config", json.dumps(cfg))
    assert rc == 1 and "unreachable" in err
