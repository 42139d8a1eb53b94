"""Operator tools on a real ``vllm serve`` with the pool (one server start):
its ``/metrics`` carries the pool's Prometheus metrics - hit tokens and load
bytes after pool hits, a failed load (injected) counted - and the Grafana
dashboard's every name; ``pool clear`` is refused while the server holds
the pool and names its processes; after it stops, ``pool info`` describes
what it wrote, ``pool verify`` finds a damaged entry and ``--drop`` removes
its block, and ``pool clear`` empties the pool.

Pool hits with one server: vLLM's dev endpoint ``/reset_prefix_cache``
empties its HBM prefix cache, so the same prompt next comes from the pool.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_layerwise_patch.mooncake_local import free_port
from vllm_layerwise_patch.pool.backends.base import HEADER_SIZE
from vllm_layerwise_patch.testing import tiny_prompt
from vllm_layerwise_patch.testing.raw_pool import raw_data
from vllm_layerwise_patch.testing.server import VllmServer

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
P = tiny_prompt(2000, 5)
Q = tiny_prompt(700, 7)
FAIL_LAYER = "model.layers.1.linear_attn"
M = "vllm:layerwise_pool_"


def pool_cmd(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LAYERWISE_PATCH")}
    return subprocess.run([sys.executable, "-m", "vllm_layerwise_patch", "pool", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def value(text, name):
    """Sum of a metric's samples in a /metrics text (0 when absent)."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text,
                                            flags=re.M))


def settled(server, check, timeout=20):
    """/metrics once ``check`` holds on it (stats reach Prometheus with the
    engine's outputs, not with the HTTP response)."""
    deadline = time.monotonic() + timeout
    while True:
        text = server.metrics()
        if check(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def reset_prefix_cache(server):
    """Empty vLLM's HBM prefix cache (refused while a request holds blocks)."""
    for _ in range(40):
        if server._post("/reset_prefix_cache", {})["success"]:
            return
        time.sleep(0.25)
    raise AssertionError("vLLM did not reset its prefix cache")


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool-ops")
    path = str(tmp / "pool")
    pool = {"path": path, "capacity": "64MiB", "debug_fail_load_layer": FAIL_LAYER}
    out = {"path": path}
    with VllmServer(tiny_model_dir, port=free_port(), log=tmp / "server.log", pool=pool,
                    env={"VLLM_SERVER_DEV_MODE": "1"}) as s:
        out["first"] = s.complete(P)["token_ids"]
        out["saved"] = settled(s, lambda t: value(t, M + "blocks_saved_total") >= 3
                               and value(t, M + "used_bytes") > 0)
        reset_prefix_cache(s)  # P from the pool: its first load fails (injected)
        out["after_failure"] = s.complete(P)["token_ids"]
        out["failed"] = settled(s, lambda t: value(t, M + "failed_loads_total") >= 1)
        reset_prefix_cache(s)  # P from the pool again: this load succeeds
        out["hit"] = s.complete(P)["token_ids"]
        s.complete(Q)  # one more request: the last steps' stats are sent
        out["hits"] = settled(s, lambda t: value(t, M + "hit_tokens_total")
                              > value(out["failed"], M + "hit_tokens_total"))
        out["clear_while_serving"] = pool_cmd("clear", path)
        out["server_pid"] = s.proc.pid
        out["log"] = s.log()
    yield out


def test_metrics_show_pool_hits_loads_and_an_injected_failed_load(served):
    saved, failed, hits = served["saved"], served["failed"], served["hits"]
    # the first request saved its blocks; the pool's fill is published
    assert value(saved, M + "blocks_saved_total") >= 3
    assert value(saved, M + "save_bytes_sum") > 0 and value(saved, M + "save_bytes_count") >= 1
    assert value(saved, M + "capacity_bytes") == 64 << 20
    assert 0 < value(saved, M + "used_bytes") < 64 << 20 and value(saved, M + "entries") > 0
    assert value(saved, M + "failed_loads_total") == 0 and value(saved, M + "hit_tokens_total") == 0
    assert 'model_name="' in saved and re.search(rf'^{M}hit_tokens_total{{engine="0"', saved,
                                                  flags=re.M)
    # the injected failure: counted once, the request recomputed with the same tokens
    assert value(failed, M + "failed_loads_total") == 1
    assert "debug-missing" in served["log"]
    assert served["after_failure"] == served["first"]
    # the successful hit: P's three blocks from the pool, their bytes loaded
    assert served["hit"] == served["first"]
    hit_tokens = value(hits, M + "hit_tokens_total") - value(failed, M + "hit_tokens_total")
    assert hit_tokens >= 3 * 640 and value(hits, M + "hit_blocks_total") >= 6
    assert value(hits, M + "load_bytes_sum") > value(failed, M + "load_bytes_sum")
    assert value(hits, M + "load_seconds_count") >= 1
    assert value(hits, M + "load_wait_seconds_count") >= 1
    assert value(hits, M + "failed_loads_total") == 1
    assert value(hits, 'vllm:prompt_tokens_by_source_total') > 0
    # every name the Grafana dashboard queries is on this server's /metrics
    mod = runpy.run_path(str(ROOT / "scripts" / "render_dashboard.py"))
    names = {n for p in mod["dashboard"]()["panels"] for t in p["targets"]
             for n in re.findall(r"vllm:[a-z_]+", t["expr"])}
    missing = [n for n in sorted(names) if not re.search(rf"^{n}[{{ ]", hits, flags=re.M)]
    assert not missing, missing


def test_pool_clear_is_refused_while_the_server_holds_the_pool(served):
    proc = served["clear_while_serving"]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "refused" in proc.stderr and "--force" in proc.stderr
    pids = [int(p) for p in re.findall(r"pid (\d+) on ", proc.stderr)]
    assert pids and served["server_pid"] not in pids  # the engine's processes, not the API
    assert "scheduler" in proc.stderr and "worker" in proc.stderr, proc.stderr
    assert "tiny-qwen3-next" in proc.stderr


def test_pool_info_verify_clear_on_the_pool_the_server_wrote(served, tiny_model_dir):
    path = served["path"]
    info = pool_cmd("info", path, "--json")
    assert info.returncode == 0, info.stderr
    doc = json.loads(info.stdout)
    assert doc["holders"] == []  # the server is gone
    ((ns, space),) = doc["namespaces"].items()
    desc = space["description"]
    assert desc["model"] == str(tiny_model_dir) and desc["layout"]["tp_size"] == 1
    assert desc["vllm"] and desc["mamba_ssm_cache_dtype"]
    assert space["blocks"] >= 3 and space["groups"]["attn"] >= 3 and space["groups"]["state"] >= 1
    text = pool_cmd("info", path).stdout
    assert f"namespace {ns}" in text and f"model {tiny_model_dir}" in text

    # damage one attention page: verify finds it, --drop removes its block
    with raw_data(path) as txn:  # (every shard of a sharded pool)
        page = next(bytes(k) for k, _ in txn.cursor() if b"/attn/" in bytes(k)
                    and b"/L" in bytes(k))
        v = bytearray(txn.get(page))
        v[HEADER_SIZE + 100] ^= 0xFF
        txn.put(page, bytes(v))
    group = page.rpartition(b"/")[0].decode()
    found = pool_cmd("verify", path)
    assert found.returncode == 1 and "1 damaged group(s)" in found.stdout
    assert f"{group}: 1 entry (checksum)" in found.stdout
    assert "100%" in found.stderr  # the progress bar
    dropped = pool_cmd("verify", path, "--drop", "--json")
    assert dropped.returncode == 0 and json.loads(dropped.stdout)["dropped"]
    clean = pool_cmd("verify", path, "--json", "--no-progress")
    assert clean.returncode == 0 and json.loads(clean.stdout)["damaged_groups"] == 0
    after = json.loads(pool_cmd("info", path, "--json").stdout)["namespaces"][ns]
    assert after["groups"]["attn"] == space["groups"]["attn"] - 1

    cleared = pool_cmd("clear", path)
    assert cleared.returncode == 0 and "cleared every namespace" in cleared.stdout
    doc = json.loads(pool_cmd("info", path, "--json").stdout)
    assert doc["entries"] == 0 and doc["namespaces"] == {}
