"""The tiered backend (``backend: "tiered"``, :mod:`..backends.tiered`): a
real LMDB near tier in front of a real Mooncake master and segment holder
on loopback.  A near-tier hit makes no master request (the master's own
request counters); a far-tier hit is promoted - whole blocks, checked, in
one near-tier transaction - and its next hit is near; a hit spanning the
tiers reads each block from where it is; the master killed leaves
near-tier hits working; a writer killed in the middle of its saves or
promotions leaves no torn entry in either tier.  Negative controls: the
fault knobs that skip the near tier (master requests again) and that
write a torn promoted copy (the tear checker finds it)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time

import pytest

from test_pool_mooncake_objects import LAYOUT, NS, PAGE, block
from test_pool_mooncake_retry import cluster_requests
from vllm_layerwise_patch.envvars import TEST_FAULTS_ENV
from vllm_layerwise_patch.mooncake_local import LocalMooncake, free_port
from vllm_layerwise_patch.pool.backends.base import (HEADER_SIZE, CorruptEntry, pack,
                                                     unpack)
from vllm_layerwise_patch.pool.config import PoolConfig, PoolConfigError
from vllm_layerwise_patch.pool.keys import (ATTN, STATE, draft_marker_key, is_marker,
                                            marker_key, page_key)

MARKERS = (ATTN, STATE)


def _cluster(tmp):
    return LocalMooncake(tmp, rpc_port=free_port(), metrics_port=free_port(),
                         holder=128 << 20, holder_port=free_port()).start()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    lm = _cluster(tmp_path_factory.mktemp("mooncake"))
    yield lm
    lm.stop()


def config(master: str, near: str, **tiered) -> PoolConfig:
    return PoolConfig.from_extra({
        "backend": "tiered", "path": near, "capacity": "64MiB", "tiered": tiered,
        "mooncake": {"master_address": master, "global_segment_size": 0,
                     "local_buffer_size": "8MiB", "reconnect_seconds": 1}})


def tiered(master: str, near: str, role: str | None = None, **kw):
    from vllm_layerwise_patch.pool.opening import open_backend

    be = open_backend(config(master, near, **kw), role)
    be.set_layout(NS, LAYOUT)
    return be


def markers(h: bytes, tp: int = 0, token: int = 7) -> list[bytes]:
    return [marker_key(NS, ATTN, h, tp), marker_key(NS, STATE, h, tp),
            draft_marker_key(NS, h, tp, token)]


def pages(h: bytes) -> list[bytes]:
    return [k for k, _ in block(h) if not is_marker(k)]


def hit(be, h: bytes) -> bool:
    """What a lookup with verification and a load do: the markers, then
    every page read and checked."""
    if not all(be.exists_many(markers(h))):
        return False
    keys = pages(h)
    got = be.get_many(keys, [HEADER_SIZE + PAGE] * len(keys))
    want = dict(block(h))
    return all(v is not None and bytes(unpack(k, v, NS)) == bytes(unpack(k, want[k], NS))
               for k, v in zip(keys, got))


def torn(be) -> list[str]:
    """Blocks a tier commits without every page, or with a page that fails
    its check: the near tier's every marker (an LMDB scan), and each
    block object the far tier holds."""
    out, keys = [], []
    for env in getattr(be.near, "shards", [be.near]):  # every shard of the near tier
        with env.env.begin(buffers=True) as txn:
            keys += [bytes(k) for k, _ in txn.cursor(db=env.data)]
    for m in (k for k in keys if is_marker(k)):
        head, _, last = m.rpartition(b"/")
        token = last.partition(b"@")[2]
        want = [k for k in keys if k.startswith(head + b"/L") and not is_marker(k)
                and k.partition(b"@")[2] == token]
        layers = 1 if token else (6 if b"/attn/" in m else 2)
        values = be.near.get_many(want)
        try:
            for k, v in zip(want, values):
                unpack(k, v, NS)
        except CorruptEntry:
            out.append("near damaged " + m.decode())
        if len(want) != layers:
            out.append(f"near {m.decode()}: {len(want)} of {layers} pages")
    return out


@pytest.fixture
def fault_env(monkeypatch):
    def set_faults(**knobs):
        monkeypatch.setenv(TEST_FAULTS_ENV, json.dumps(knobs))
    return set_faults


def test_a_near_tier_hit_makes_no_master_request(cluster, tmp_path, fault_env):
    be = tiered(cluster.master_address, str(tmp_path / "near"))
    h = b"\x31" * 32
    be.put_many(block(h))  # write-through: both tiers
    assert all(be.far.exists_many(markers(h))) and all(be.near.exists_many(markers(h)))
    before = cluster_requests(cluster)
    assert hit(be, h)
    assert cluster_requests(cluster) - before == 0
    assert be.tier_counts["near_pages_loaded"] == len(pages(h))
    assert be.tier_counts["far_pages_loaded"] == 0
    # negative control: lookups and reads that skip the near tier ask the master
    fault_env(debug_tiered_near_blind=True)
    before = cluster_requests(cluster)
    assert hit(be, h)
    assert cluster_requests(cluster) - before > 0
    be.close()


def test_a_far_tier_hit_is_promoted_and_its_next_hit_is_near(cluster, tmp_path):
    near = str(tmp_path / "near")
    be = tiered(cluster.master_address, near)
    h, g = b"\x32" * 32, b"\x33" * 32
    be.far.put_many(block(h) + block(g))  # another node saved them: far only
    assert not any(be.near.exists_many(markers(h) + markers(g)))
    assert hit(be, h)  # the verification reads every page at once
    assert be.tier_counts["far_pages_loaded"] == len(pages(h))
    # a load reads a block's layers one at a time: promoted once all are read
    for k in pages(g):
        assert unpack(k, be.get_many([k])[0], NS)
    assert be.promoter.wait()
    assert be.tier_counts["promoted_blocks"] == 6  # 2 blocks x (attn, state, drafter)
    assert all(be.near.exists_many(markers(h) + markers(g)))
    assert torn(be) == []
    before = cluster_requests(cluster)
    assert hit(be, h) and hit(be, g)
    assert cluster_requests(cluster) - before == 0
    be.close()
    # tiered.promote = false: the near tier holds what was saved through it only
    off = tiered(cluster.master_address, str(tmp_path / "near-off"), promote=False)
    assert hit(off, h) and off.promoter.wait()
    assert off.tier_counts["promoted_blocks"] == 0
    assert not any(off.near.exists_many(markers(h)))
    off.close()


def test_promote_after_far_hits_waits_for_the_second_far_hit(cluster, tmp_path):
    be = tiered(cluster.master_address, str(tmp_path / "near"), promote_after_far_hits=2)
    h = b"\x3f" * 32
    be.far.put_many(block(h))
    assert hit(be, h) and be.promoter.wait()
    assert be.tier_counts["promoted_blocks"] == 0  # read once: not promoted
    assert not any(be.near.exists_many(markers(h)))
    assert hit(be, h) and be.promoter.wait()
    assert be.tier_counts["promoted_blocks"] == 3 and all(be.near.exists_many(markers(h)))
    be.close()


def test_a_hit_spanning_the_tiers_reads_each_block_where_it_is(cluster, tmp_path):
    be = tiered(cluster.master_address, str(tmp_path / "near"), promote=False)
    first, later = b"\x34" * 32, b"\x35" * 32
    be.put_many(block(first))
    be.far.put_many(block(later))
    # the lookup's walk: every marker in order, near or far
    assert be.exists_many([marker_key(NS, ATTN, x, 0) for x in (first, later)]) == [True, True]
    keys = [page_key(NS, ATTN, x, 0, str(i)) for x in (first, later) for i in range(6)]
    got = be.get_many(keys)
    assert [bytes(unpack(k, v, NS))[:1] for k, v in zip(keys, got)] == \
        [bytes([i + 1]) for _ in range(2) for i in range(6)]
    assert be.tier_counts["near_pages_loaded"] == 6 == be.tier_counts["far_pages_loaded"]
    # a block in neither tier ends the run
    assert be.exists_many([marker_key(NS, ATTN, b"\x36" * 32, 0)]) == [False]
    be.close()


def test_a_far_value_that_fails_its_check_is_never_promoted(cluster, tmp_path):
    be = tiered(cluster.master_address, str(tmp_path / "near"))
    h = b"\x37" * 32
    items = block(h)
    k0 = page_key(NS, ATTN, h, 0, "0")
    items = [(k, v[:-1] + bytes([v[-1] ^ 1]) if k == k0 else v) for k, v in items]
    be.far.put_many(items)
    got = be.get_many(pages(h))
    with pytest.raises(CorruptEntry, match="checksum"):  # (what every reader checks)
        unpack(k0, got[0], NS)
    assert be.promoter.wait()
    assert be.tier_counts["promotions_refused"] == 1
    assert not be.near.exists_many([marker_key(NS, ATTN, h, 0)])[0]
    assert be.near.exists_many([marker_key(NS, STATE, h, 0)])[0]  # (its sound objects are)
    be.close()


def test_torn_promotions_are_caught(cluster, tmp_path, fault_env):
    """Negative control of the tear checker: a promotion that leaves a
    page out and commits the block all the same is found."""
    fault_env(debug_tiered_promote_torn=True)
    be = tiered(cluster.master_address, str(tmp_path / "near"))
    h = b"\x38" * 32
    be.far.put_many(block(h))
    assert hit(be, h) and be.promoter.wait()
    assert torn(be), "the tear checker missed a torn promoted block"
    # the torn copy is still never a wrong value: the page it lacks is read
    # from the far tier (and every value is checked by its reader)
    assert hit(be, h)
    be.close()


def test_the_master_killed_keeps_near_tier_hits(tmp_path):
    lm = _cluster(tmp_path / "mc")
    try:
        be = tiered(lm.master_address, str(tmp_path / "near"))
        h, far_only = b"\x39" * 32, b"\x3a" * 32
        be.put_many(block(h))
        be.far.put_many(block(far_only))
        lm.kill("master")
        for _ in range(3):
            assert hit(be, h)
        assert not hit(be, far_only)  # a far miss, no error
        # saves go on into the near tier, counted as far failures
        g = b"\x3b" * 32
        be.put_many(block(g))
        assert hit(be, g) and be.tier_counts["far_save_failures"] >= 1
        be.close()
    finally:
        lm.stop()


def _writer(master: str, near: str, first: int, ready) -> None:
    be = tiered(master, near, role="worker")
    ready.set()
    i = 0
    while True:  # (until killed)
        be.put_many(block(bytes([first, i % 256]) * 16))
        i += 1


def _promoter(master: str, near: str, hashes: list[bytes], ready) -> None:
    be = tiered(master, near)
    ready.set()
    for h in hashes:
        hit(be, h)


@pytest.mark.parametrize("what", ["saves", "promotions"])
def test_a_writer_killed_mid_write_leaves_no_torn_entry_in_either_tier(cluster, tmp_path,
                                                                       what):
    near = str(tmp_path / "near")
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    first = 0x40 if what == "saves" else 0x41
    if what == "saves":
        proc = ctx.Process(target=_writer, args=(cluster.master_address, near, first, ready))
    else:
        hashes = [bytes([first, i]) * 16 for i in range(60)]
        seed = tiered(cluster.master_address, str(tmp_path / "other"))
        for h in hashes:
            seed.far.put_many(block(h))
        seed.close()
        proc = ctx.Process(target=_promoter, args=(cluster.master_address, near, hashes,
                                                   ready))
    proc.start()
    assert ready.wait(60)
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    if what == "saves":  # (it writes until killed: killed in the middle)
        assert proc.exitcode == -signal.SIGKILL
    be = tiered(cluster.master_address, near)
    assert torn(be) == []
    done = [h for h in (bytes([first, i]) * 16 for i in range(256))
            if any(be.exists_many(markers(h)))]
    assert done, "the writer stored nothing before it was killed"
    for h in done:  # every block either tier commits reads whole and sound
        for m in markers(h):
            if be.exists_many([m])[0]:
                kind_pages = [k for k in pages(h) if k.rpartition(b"/")[0] ==
                              m.rpartition(b"/")[0] and (b"@" in k) == (b"@" in m)]
                for tier in (be.near, be.far):
                    if tier.exists_many([m])[0]:
                        got = tier.get_many(kind_pages, [HEADER_SIZE + PAGE] * len(kind_pages))
                        for k, v in zip(kind_pages, got):
                            assert v is not None, k
                            unpack(k, v, NS)
    be.close()


def test_a_failing_tier_is_a_miss_of_that_tier(cluster, tmp_path, fault_env):
    h = b"\x3c" * 32
    seed = tiered(cluster.master_address, str(tmp_path / "near"))
    seed.put_many(block(h))
    seed.close()
    # the near tier's reads fail: the far tier serves the hit
    fault_env(debug_backend_fault="load", debug_tiered_fault_tier="near")
    be = tiered(cluster.master_address, str(tmp_path / "near"), role="worker", promote=False)
    assert hit(be, h) and be.tier_counts["far_pages_loaded"] == len(pages(h))
    be.close()
    # the far tier's lookups fail: near-tier hits go on, far-only blocks miss
    fault_env(debug_backend_fault="lookup", debug_tiered_fault_tier="far")
    be = tiered(cluster.master_address, str(tmp_path / "near"), role="scheduler")
    assert hit(be, h)
    assert be.exists_many([marker_key(NS, ATTN, b"\x3d" * 32, 0)]) == [False]
    be.close()


@pytest.mark.parametrize("field,value,says", [
    ("promote", "yes", "valid boolean"),
    ("promote_pending_blocks", 0, "greater than or equal to 1"),
    ("promote_pending_blocks", "8", "valid integer"),
    ("promote_after_far_hits", 0, "greater than or equal to 1"),
    ("promote_after_far_hits", 17, "less than or equal to 16"),
    ("near_saves", "lukewarm", "Input should be 'hot', 'cold' or 'off'"),
    ("near_saves", 1, "Input should be 'hot', 'cold' or 'off'"),
    ("near_path", "/x", "unknown field (known: promote, near_saves, promote_after_far_hits, "
                        "promote_pending_blocks)"),
])
def test_a_bad_tiered_field_is_an_error_naming_it(field, value, says):
    with pytest.raises(PoolConfigError) as err:
        PoolConfig.from_extra({"backend": "tiered", "tiered": {field: value}})
    assert f"kv_connector_extra_config.tiered.{field}: " in str(err.value)
    assert says in str(err.value)


def test_the_generation_moves_with_either_tier(cluster, tmp_path):
    be = tiered(cluster.master_address, str(tmp_path / "near"))
    g0 = be.generation()
    assert g0 is not None and g0.removals_settled
    be.near.put_many(block(b"\x3e" * 32))
    g1 = be.generation()
    assert g1.stores != g0.stores
    be.far.put_many(block(b"\x3f" * 32))
    assert be.generation().stores != g1.stores
    be.near.delete_groups([marker_key(NS, ATTN, b"\x3e" * 32, 0).rpartition(b"/")[0]])
    g2 = be.generation()
    assert g2.removals != g1.removals and g2.removals_settled
    be.close()


def test_pool_info_shows_the_near_tier_and_the_far_tiers_master(cluster, tmp_path, capsys):
    from vllm_layerwise_patch import pool_cli

    near = str(tmp_path / "near")
    be = tiered(cluster.master_address, near)
    be.put_many(block(b"\x50" * 32))
    be.close()
    cfg = json.dumps({"backend": "tiered", "mooncake": {"master_address": cluster.master_address}})
    assert pool_cli.main(["info", near, "--config", cfg, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["backend"] == "tiered" and doc["tier"] == "near" and doc["path"] == near
    assert doc["namespaces"][NS.hex()]["blocks"] >= 1
    assert doc["far"] == {"backend": "mooncake", "master_address": cluster.master_address,
                          "reachable": True}
    down = json.dumps({"backend": "tiered", "mooncake": {
        "master_address": f"127.0.0.1:{free_port()}", "connect_timeout_seconds": 1}})
    assert pool_cli.main(["info", near, "--config", down]) == 0
    out = capsys.readouterr().out
    assert "(tiered: this lmdb pool is the near tier)" in out and "not reachable" in out
    # an lmdb pool's info says nothing of tiers (negative control)
    assert pool_cli.main(["info", near, "--json"]) == 0
    assert "far" not in json.loads(capsys.readouterr().out)


def test_the_tiered_fields_are_in_the_configuration_reference():
    from pathlib import Path

    from vllm_layerwise_patch.pool.config_tiered import TieredConfig

    page = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    section = page.split("<!-- pool-tiered-table:begin -->")[1].split(
        "<!-- pool-tiered-table:end -->")[0]
    assert section.strip() == TieredConfig.markdown_table().strip()
    for name, f in TieredConfig.model_fields.items():
        assert f"| `{name}` |" in section and f.description in section


def test_bench_splits_the_pools_hit_tokens_by_tier():
    from vllm_layerwise_patch.bench.runs import measure

    def result(line: str) -> dict:
        return {"error": None, "phase_seconds": [1.0],
                "out": [{"phase": 0, "ttft": 0.1, "tpot": 0.01, "prompt_tokens": 2000,
                         "cached": 1280, "tokens": [1]}],
                "log": f"INFO KV Transfer metrics: External hit tokens loaded=1280, {line}\n"}

    got = measure([result("Pages loaded from the near tier=30, "
                          "Pages loaded from the far tier=10")], None)
    assert got["hit_rate"]["external"] == pytest.approx(0.64)
    assert got["hit_rate_by_tier"] == pytest.approx({"near": 0.48, "far": 0.16})
    # no tiered backend: no split
    assert "hit_rate_by_tier" not in measure([result("Loaded (GB)=0.1")], None)


def test_one_side_promotes(cluster, tmp_path):
    """The scheduler promotes what its verification reads; the workers'
    loads copy nothing - unless verify_on_lookup is off."""
    from vllm_layerwise_patch.pool.opening import open_backend

    near = str(tmp_path / "near")
    for verify, scheduler, worker in ((True, True, False), (False, False, True)):
        cfg = config(cluster.master_address, near).model_copy(
            update={"verify_on_lookup": verify})
        sides = [open_backend(cfg, role) for role in ("scheduler", "worker")]
        assert [s.promote for s in sides] == [scheduler, worker]
        for s in sides:
            s.close()


def test_the_scheduler_reports_its_promotions_once():
    from types import SimpleNamespace

    from vllm_layerwise_patch.pool.scheduler.stats import SchedulerSideStats

    backend = SimpleNamespace(tier_counts={"promoted_blocks": 3, "promotions_dropped": 0,
                                           "promotions_refused": 1, "promotions_failed": 0,
                                           "near_pages_loaded": 40})
    stats = SchedulerSideStats(lambda: {}, backend, 640)
    first = stats.take().data
    assert first["promoted_blocks"] == 3 and first["promotions_refused"] == 1
    assert first["near_pages_loaded"] == 0  # (the workers report their loads' pages)
    assert first["near_pages_verified"] == 40  # (the scheduler's reads: verification)
    backend.tier_counts = dict(backend.tier_counts, promoted_blocks=5)
    assert stats.take().data["promoted_blocks"] == 2
    assert stats.take() is None  # nothing new
