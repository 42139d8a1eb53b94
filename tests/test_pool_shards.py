"""The sharded embedded pool (pool/backends/lmdb/sharded.py, shards.py) on
real LMDB: routing keeps a block's groups of every kind and TP rank in one
shard; each shard evicts whole groups of its own; the pool command, the fill
metrics and the directory checks cover every shard; a pool written before
sharding opens as one environment; the shard count is the pool's, never an
engine's configuration.

Negative control: the ``shard_by_key`` fault routes each key by itself - a
block (and a group's pages and marker) spreads over shards, and the routing
and eviction tests catch it."""

from __future__ import annotations

import hashlib
import json
import logging
import os

import lmdb
import pytest

from vllm_layerwise_patch.envvars import TEST_FAULTS_ENV
from vllm_layerwise_patch.pool import admin
from vllm_layerwise_patch.pool.backends.base import PoolUnusable, pack
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.backends.lmdb.fill import pool_fill
from vllm_layerwise_patch.pool.backends.lmdb.sharded import ShardedLmdbBackend, open_shared
from vllm_layerwise_patch.pool.backends.lmdb.shards import shard_name, shard_of
from vllm_layerwise_patch.pool.config import PoolConfig, PoolConfigError
from vllm_layerwise_patch.pool.directory.security import check_pool_path
from vllm_layerwise_patch.pool.keys import (ATTN, STATE, draft_marker_key, draft_page_key,
                                            group_of, is_marker, marker_key,
                                            namespace_key, page_key)

NS = b"\x11" * 16
MiB = 1 << 20


def _hash(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()  # (a pool routes by its first bytes)


def block_keys(h: bytes, ranks: int = 2, layers: int = 3) -> list[bytes]:
    """Every key of a block: pages and markers of both kinds on every rank,
    drafter pages and markers."""
    keys = []
    for tp in range(ranks):
        for kind in (ATTN, STATE):
            keys += [page_key(NS, kind, h, tp, str(i)) for i in range(layers)]
            keys.append(marker_key(NS, kind, h, tp))
        keys += [draft_page_key(NS, h, tp, "mtp.0", 7), draft_marker_key(NS, h, tp, 7)]
    return keys


def block_items(h: bytes, page: int = 1000, layers: int = 3) -> list[tuple[bytes, bytes]]:
    return [(k, pack(NS, k, b"" if is_marker(k) else os.urandom(page)))
            for k in block_keys(h, layers=layers)]


def by_key_fault(monkeypatch, on: bool) -> None:
    if on:
        monkeypatch.setenv(TEST_FAULTS_ENV, json.dumps({"shard_by_key": True}))
    else:
        monkeypatch.delenv(TEST_FAULTS_ENV, raising=False)


def shard_keys(path: str, n: int) -> list[set[bytes]]:
    """The keys each shard's LMDB environment holds, read by LMDB itself."""
    out = []
    for i in range(n):
        env = lmdb.open(os.path.join(path, shard_name(i)), max_dbs=4, readonly=True, lock=False)
        with env.begin(db=env.open_db(b"data", create=False)) as txn:
            out.append({bytes(k) for k, _ in txn.cursor()})
        env.close()
    return out


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("by_key", [False, True], ids=["block-hash", "control-by-key"])
def test_a_blocks_keys_of_every_kind_and_rank_share_one_shard(n, by_key):
    spread = [len({shard_of(k, n, by_key) for k in block_keys(_hash(i))}) for i in range(200)]
    if by_key:  # routing by something else than the block hash splits blocks
        assert max(spread) > 1
        return
    assert spread == [1] * 200
    # groups route with their keys (pins, touches, removals find the keys' shard)
    for i in range(50):
        for k in block_keys(_hash(i)):
            assert shard_of(group_of(k), n) == shard_of(k, n)
    for i in range(50):  # the namespace description too (`pool clear` removes its group)
        meta = namespace_key(bytes([i]) * 16)
        assert shard_of(group_of(meta), n) == shard_of(meta, n)
    # and the blocks spread over every shard
    assert {shard_of(page_key(NS, ATTN, _hash(i), 0, "0"), n) for i in range(200)} == set(range(n))


@pytest.mark.parametrize("by_key", [False, True], ids=["block-hash", "control-by-key"])
def test_stored_blocks_live_whole_in_one_shard(tmp_path, monkeypatch, by_key):
    by_key_fault(monkeypatch, by_key)
    path = str(tmp_path / "pool")
    be = open_shared(path, 64 * MiB, shards=4)
    assert isinstance(be, ShardedLmdbBackend) and be.n == 4
    blocks = [_hash(i) for i in range(40)]
    be.put_many([kv for h in blocks for kv in block_items(h)])
    assert all(be.exists_many([k for h in blocks for k in block_keys(h)]))
    be.close()
    held = shard_keys(path, 4)
    homes = [{i for i, keys in enumerate(held) if set(block_keys(h)) & keys} for h in blocks]
    if by_key:
        assert any(len(s) > 1 for s in homes)
    else:
        assert all(len(s) == 1 and set(block_keys(h)) <= held[s.copy().pop()]
                   for h, s in zip(blocks, homes))
        assert len(set().union(*homes)) == 4  # every shard holds blocks
        assert all(shard_of(k, 4) == i for i, keys in enumerate(held) for k in keys)


@pytest.mark.parametrize("by_key", [False, True], ids=["block-hash", "control-by-key"])
def test_each_shard_evicts_whole_groups(tmp_path, monkeypatch, by_key):
    # 4 shards of 8 MiB; 160 blocks of ~780 KB (one put each: a step's
    # saves) are ~4x the pool, so every shard evicts.  Afterwards every
    # group is whole: its commit marker is there exactly when all its
    # pages are.  Control: keys routed one by one - a marker and its pages
    # in different shards are evicted apart.
    by_key_fault(monkeypatch, by_key)
    path = str(tmp_path / "pool")
    be = open_shared(path, 32 * MiB, shards=4)
    for i in range(160):
        be.put_many(block_items(_hash(i), page=64 << 10))
    assert all(s.evictions > 0 for s in be.shards)
    assert be.evictions == sum(s.evictions for s in be.shards)
    be.close()
    present = set().union(*shard_keys(path, 4))
    broken = []
    for i in range(160):
        keys = block_keys(_hash(i))
        for g in {group_of(k) for k in keys}:
            mine = [k for k in keys if group_of(k) == g]
            markers = [k for k in mine if is_marker(k)]
            pages = [k for k in mine if not is_marker(k)]
            # a drafter marker names its token: its pages are those of that token
            for m in markers:
                covered = [p for p in pages if (b"@" in p) == (b"@" in m)]
                if (m in present) != all(p in present for p in covered):
                    broken.append(m)
    survivors = sum(marker_key(NS, ATTN, _hash(i), 0) in present for i in range(160))
    assert 0 < survivors < 160
    if by_key:
        assert broken
    else:
        assert broken == []


def test_pool_command_info_verify_clear_cover_every_shard(tmp_path):
    path = str(tmp_path / "pool")
    be = open_shared(path, 64 * MiB, shards=4)
    blocks = [_hash(i) for i in range(24)]
    meta = namespace_key(NS)
    be.put_many([kv for h in blocks for kv in block_items(h)]
                + [(meta, pack(NS, meta, b'{"model": "m"}'))])
    be.close()
    held = shard_keys(path, 4)
    # damage one page in the last shard (LMDB directly, as a bad disk would)
    victim = sorted(k for k in held[3] if not is_marker(k))[0]
    env = lmdb.open(os.path.join(path, shard_name(3)), max_dbs=4)
    with env.begin(write=True, db=env.open_db(b"data")) as txn:
        v = bytearray(txn.get(victim))
        v[-1] ^= 0xFF
        txn.put(victim, bytes(v))
    env.close()

    pool = admin.open_pool(path)
    try:
        doc = admin.info(pool)
        total = sum(len(k) for k in held)
        assert doc["shards"] == 4 and doc["entries"] == total
        assert [s["entries"] for s in doc["per_shard"]] == [len(k) for k in held]
        assert doc["namespaces"][NS.hex()]["blocks"] == 24
        assert admin.count_entries(pool) == total
        report = admin.verify(pool, drop=True)
        assert report["checked"] == total
        assert list(report["damaged"]) == [group_of(victim).decode()]
        assert admin.verify(pool)["damaged_groups"] == 0
        assert not pool.exists_many([victim])[0]
        cleared = admin.clear(pool)
        assert cleared["entries"] == total - len([k for k in held[3]
                                                  if group_of(k) == group_of(victim)])
        assert admin.count_entries(pool) == 0 and admin.info(pool)["namespaces"] == {}
    finally:
        pool.close()
    assert shard_keys(path, 4) == [set()] * 4


def test_fill_metrics_and_stats_sum_every_shard(tmp_path):
    be = open_shared(str(tmp_path / "pool"), 64 * MiB, shards=4)
    be.put_many([kv for i in range(16) for kv in block_items(_hash(i))])
    fill = pool_fill(be)
    assert fill["entries"] == 16 * len(block_keys(_hash(0)))
    assert fill["capacity_bytes"] == 64 * MiB
    assert fill["used_bytes"] == sum(pool_fill(s)["used_bytes"] for s in be.shards)
    assert be.stats()["shards"] == 4 and be.stats()["entries"] == fill["entries"]
    be.close()


def test_generation_moves_with_any_shards_store_or_removal(tmp_path):
    be = open_shared(str(tmp_path / "pool"), 64 * MiB, shards=4)
    g0 = be.generation()
    items = block_items(_hash(1))
    be.put_many(items)
    g1 = be.generation()
    assert g1.stores != g0.stores and g1.removals == g0.removals and g1.removals_settled
    be.delete_groups([group_of(items[0][0])])
    g2 = be.generation()
    assert g2.removals != g1.removals and g2.removals_settled
    # one shard's removal left odd (a writer killed before settling it)
    home = be.shards[shard_of(items[0][0], 4)]
    from vllm_layerwise_patch.pool.backends.generation import REMOVALS

    home._gen.begin(REMOVALS)
    assert not be.generation().removals_settled
    be.close()


def test_a_pool_written_before_sharding_opens_as_one_environment(tmp_path, caplog):
    path = str(tmp_path / "old")
    old = LmdbBackend(path, 16 * MiB)  # today's layout: data.mdb in the pool directory
    items = block_items(_hash(5))
    old.put_many(items)
    old.close()
    with caplog.at_level(logging.INFO, logger="vllm.layerwise_patch"):
        be = open_shared(path, 64 * MiB, shards=8)
    try:
        assert isinstance(be, LmdbBackend)
        assert all(be.exists_many([k for k, _ in items]))
        assert "written before sharding" in caplog.text
        assert not any(n.startswith("shard") for n in os.listdir(path))  # left as it is
    finally:
        be.close()
    pool = admin.open_pool(path)
    assert admin.info(pool)["shards"] == 1 and admin.count_entries(pool) == len(items)
    pool.close()


def test_the_pool_records_its_shard_count_and_engines_follow_it(tmp_path, caplog):
    path = str(tmp_path / "pool")
    first = open_shared(path, 64 * MiB, shards=4)
    items = [kv for i in range(8) for kv in block_items(_hash(i))]
    first.put_many(items)
    first.close()
    assert open(os.path.join(path, "shards")).read().strip() == "4"
    for configured in (2, 8, 1):
        with caplog.at_level(logging.WARNING, logger="vllm.layerwise_patch"):
            again = open_shared(path, 64 * MiB, shards=configured)
        try:  # the pool's count, never the configured one: every block is found
            assert isinstance(again, ShardedLmdbBackend) and again.n == 4
            assert all(again.exists_many([k for k, _ in items]))
        finally:
            again.close()
        assert f"configured with shards={configured} and follows the pool" in caplog.text
    # a sharded pool's directory is never opened as one environment
    with pytest.raises(PoolUnusable, match="sharded pool"):
        LmdbBackend(path, 64 * MiB)
    assert "data.mdb" not in os.listdir(path)


def test_a_small_pool_gets_fewer_shards_of_at_least_8_mib(tmp_path):
    be = open_shared(str(tmp_path / "small"), 16 * MiB, shards=8)
    assert be.n == 2 and [s.capacity for s in be.shards] == [8 * MiB] * 2
    be.close()
    tiny = open_shared(str(tmp_path / "tiny"), 5 * MiB, shards=8)
    assert isinstance(tiny, LmdbBackend)
    tiny.close()


def test_every_shard_is_checked_like_the_pool_directory(tmp_path):
    path = str(tmp_path / "pool")
    open_shared(path, 32 * MiB, shards=4).close()
    assert check_pool_path(path).ok
    data = os.path.join(path, shard_name(2), "data.mdb")
    os.chmod(data, 0o660)
    verdict = check_pool_path(path)
    assert not verdict.ok and "shard-02/data.mdb in it is writable by group" in verdict.summary()
    with pytest.raises(PoolConfigError, match="writable by group"):
        open_shared(path, 32 * MiB, shards=4)
    with pytest.raises(admin.AdminError, match="shard-02/data.mdb"):
        admin.open_pool(path)


@pytest.mark.parametrize("bad", [0, 65, -1, "8", 2.0, True, None])
def test_shards_bad_values_name_the_field(bad):
    with pytest.raises(PoolConfigError, match=r"kv_connector_extra_config\.shards"):
        PoolConfig.from_extra({"shards": bad})


def test_shards_default_and_range():
    assert PoolConfig.from_extra({}).shards == 8
    assert PoolConfig.from_extra({"shards": 1}).shards == 1
    assert PoolConfig.from_extra({"shards": 64}).shards == 64


def test_the_connectors_opening_follows_the_shards_field(tmp_path):
    from vllm_layerwise_patch.pool.backends.base import NoPool
    from vllm_layerwise_patch.pool.opening import open_backend

    be = open_backend(PoolConfig.from_extra({"path": str(tmp_path / "a"), "capacity": "64MiB"}))
    assert isinstance(be, ShardedLmdbBackend) and be.n == 8
    be.close()
    one = open_backend(PoolConfig.from_extra({"path": str(tmp_path / "b"), "capacity": "64MiB",
                                              "shards": 1}))
    assert isinstance(one, LmdbBackend) and "data.mdb" in os.listdir(tmp_path / "b")
    one.close()
    # a record that is not a count: the pool is unusable, never guessed at
    (tmp_path / "a" / "shards").write_text("eight\n")
    bad = open_backend(PoolConfig.from_extra({"path": str(tmp_path / "a"), "capacity": "64MiB"}))
    assert isinstance(bad, NoPool) and "does not record a shard count" in bad.why
    with pytest.raises(PoolConfigError, match="does not record a shard count"):
        open_backend(PoolConfig.from_extra({"path": str(tmp_path / "a"), "capacity": "64MiB",
                                            "on_backend_unavailable": "fail"}))


def _layout(page_bytes: int, layers: int = 4, block: int = 640, unit: int = 640):
    from vllm_layerwise_patch.pool.layout import PoolLayout

    names = tuple(f"model.layers.{i}.x" for i in range(layers))
    return PoolLayout(kinds=("attn",), block_size=block, hash_block_size=unit,
                      group_layers=(names,), page_bytes=page_bytes)


def test_small_blocks_are_named_in_runs_that_route_together():
    # the span: as many blocks as fit 16 MiB of one rank's pages, a power of
    # two within [1, 64]; a block of 16 MiB or more (a GPU model's 2 MiB
    # pages on 32 layers: 64 MiB) is a run of its own and named by its hash
    assert _layout(160 << 10).route_span == 16  # 640 KiB blocks: 25 fit
    assert _layout(100).route_span == 64
    assert _layout(1 << 20, layers=8).route_span == 2
    assert _layout(2 << 20, layers=32).route_span == 1
    assert _layout(0).route_span == 1  # (page size unknown)
    layout = _layout(160 << 10)
    chain = [_hash(i) for i in range(40)]
    names = layout.block_hashes(chain, 0, 40)
    # a name: the route tag of its run (4 bytes), then the block's own hash
    assert all(name[4:] == h for name, h in zip(names, chain))
    tags = [name[:4] for name in names]
    assert tags[:16] == [tags[0]] * 16 and tags[16:32] == [tags[16]] * 16
    assert len({tags[0], tags[16], tags[32]}) == 3
    # a run lives in one shard, whatever the count
    for n in (2, 8, 64):
        assert len({shard_of(page_key(NS, ATTN, h, 0, "0"), n) for h in names[:16]}) == 1
    # a function of the prefix: another prompt sharing the first 20 blocks
    # names them alike (block 17's run starts at block 16, shared), and the
    # rest otherwise
    other = chain[:20] + [_hash(1000 + i) for i in range(20)]
    others = layout.block_hashes(other, 0, 40)
    assert others[:20] == names[:20] and others[32:] != names[32:]
    # hashes finer than the block (prefix_match_unit): a run's tag is its first
    # block's hash, the one at that block's last unit
    fine = _layout(160 << 10, block=640, unit=160)
    units = [_hash(i) for i in range(4 * 40)]
    named = fine.block_hashes(units, 0, 40)
    assert named[17] == layout.block_hashes(units[3::4], 0, 40)[17]
    assert named[17][4:] == units[4 * 17 + 3]
    # a span of one: the hash alone, as before runs
    assert _layout(2 << 20, layers=32).block_hashes(chain, 0, 3) == chain[:3]


@pytest.mark.parametrize("page_bytes", [100, 0], ids=["runs", "control-span-1"])
def test_a_lookup_touches_only_the_shards_its_blocks_live_in(tmp_path, page_bytes):
    # the scheduler's real lookup (markers, verification, pins) of a 16-block
    # hit on an 8-shard pool, its blocks saved under the names the layout
    # gives them: the shards holding none of its blocks see no call.  Small
    # blocks are named in runs (one route tag for 64 blocks here), so the
    # whole hit lives in one shard; the control (page size unknown: a run
    # per block) spreads the same hit over most shards.
    import types

    from vllm_layerwise_patch.pool.layout import PoolLayout
    from vllm_layerwise_patch.pool.scheduler.planner import PoolScheduler

    be = open_shared(str(tmp_path / "pool"), 64 * MiB, shards=8)
    layers = (("model.layers.0.x", "model.layers.1.x", "model.layers.2.x"),
              ("model.layers.3.x",))
    layout = PoolLayout(kinds=("state", "attn"), block_size=640, hash_block_size=640,
                        group_layers=layers, page_bytes=page_bytes)
    assert layout.route_span == (64 if page_bytes else 1)
    sched = PoolScheduler(vllm_config=types.SimpleNamespace(kv_transfer_config=None),
                          layout=layout, backend=be, namespace=NS,
                          config=PoolConfig.from_extra({"hit_cache_ttl": 0}))
    n = 16
    hashes = [_hash(i) for i in range(3, 3 + n)]
    names = layout.block_hashes(hashes, 0, n)
    items = []
    for h in names:
        keys = [page_key(NS, STATE, h, 0, str(i)) for i in range(3)]
        keys += [page_key(NS, ATTN, h, 0, "3"), marker_key(NS, STATE, h, 0),
                 marker_key(NS, ATTN, h, 0)]
        items += [(k, pack(NS, k, b"" if is_marker(k) else os.urandom(100))) for k in keys]
    be.put_many(items)
    for s in be.shards:
        s.calls.clear()
    homes = {shard_of(page_key(NS, ATTN, h, 0, "3"), 8) for h in names}
    req = types.SimpleNamespace(block_hashes=hashes, num_tokens=n * 640 + 1, request_id="r",
                                all_token_ids=[])
    hit, _ = sched.get_num_new_matched_tokens(req, 0)
    assert hit == n * 640
    touched = {i for i, s in enumerate(be.shards) if sum(s.calls.values())}
    assert touched == homes
    assert len(homes) == 1 if page_bytes else len(homes) >= 4
    assert all(be.shards[i].calls["exists"] >= 1 and be.shards[i].calls["read"] == 1
               for i in homes)
    sched.request_finished(req)
    be.close()


def test_engines_creating_a_pool_together_agree_on_its_shard_count(tmp_path):
    # four processes open one new path at once, configured with 2, 4, 8 and
    # 16 shards: the first to take the pool's open lock fixes the count, and
    # every process routes by it
    import subprocess
    import sys

    path = str(tmp_path / "pool")
    go = tmp_path / "go"
    code = """
import os, sys, time
from vllm_layerwise_patch.pool.backends.lmdb.sharded import open_shared
while not os.path.exists(sys.argv[3]):
    time.sleep(0.001)
be = open_shared(sys.argv[1], 256 << 20, int(sys.argv[2]))
print(getattr(be, "n", 1))
be.close()
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, path, str(n), str(go)],
                              stdout=subprocess.PIPE, text=True) for n in (2, 4, 8, 16)]
    go.touch()
    counts = {int(p.communicate(timeout=120)[0].strip()) for p in procs}
    assert all(p.returncode == 0 for p in procs)
    recorded = int(open(os.path.join(path, "shards")).read())
    assert counts == {recorded} and recorded in (2, 4, 8, 16)
    assert sorted(n for n in os.listdir(path) if n.startswith("shard-")) == [
        shard_name(i) for i in range(recorded)]
