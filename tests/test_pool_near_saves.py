"""``tiered.near_saves``: how a save enters the near tier.  ``cold`` saves
enter a real LMDB pool (one environment, and sharded) as its least
recently used blocks: eviction takes them before a block read since, and a
cold save of a block already there keeps its last use.  Negative control:
the same sequence with ``hot`` saves evicts the block that was read.  On
the tiered backend with a real Mooncake master on loopback: ``off`` writes
the far tier only and a far hit is then promoted near; ``cold`` writes both
tiers, the near copy cold."""

from __future__ import annotations

import time

import pytest

from test_pool_mooncake_objects import block
from test_pool_tiered import cluster, hit, markers, tiered  # noqa: F401 - the fixture
from vllm_layerwise_patch.pool.backends.lmdb.backend import COLD_AGE
from vllm_layerwise_patch.pool.backends.lmdb.eviction import _GROUP
from vllm_layerwise_patch.pool.backends.lmdb.sharded import open_pool
from vllm_layerwise_patch.pool.keys import group_of


def _h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def _present(be, i: int) -> bool:
    return all(be.exists_many(markers(_h(i))))


def _last_uses(be, i: int | bytes) -> list[float]:
    """The last use of block ``i``'s groups, in whichever shard holds them."""
    out = []
    h = i if isinstance(i, bytes) else _h(i)
    for shard in getattr(be, "shards", [be]):
        with shard.env.begin(buffers=True) as txn:
            for k in dict.fromkeys(group_of(k) for k, _ in block(h)):
                rec = txn.get(k, db=shard.groups)
                if rec is not None:
                    out.append(_GROUP.unpack(rec)[0])
    return out


@pytest.mark.parametrize("shards", [1, 4])
@pytest.mark.parametrize("cold", [True, False])
def test_cold_saves_are_evicted_before_a_block_read_since(tmp_path, shards, cold):
    be = open_pool(str(tmp_path / "pool"), 4 << 20, shards, pin_seconds=0)
    be.refs = 1
    be.put_many(block(_h(0)), cold=cold)
    be.pin([group_of(k) for k, _ in block(_h(0))], 0.0)  # a lookup hit it (expired pin)
    saved = 1
    while be.evictions < 3 * shards:  # every shard evicted several times
        be.put_many(block(_h(saved)), cold=cold)
        saved += 1
    assert not _present(be, 1)  # the oldest save was evicted either way
    if cold:
        assert _present(be, 0), "the block read since was evicted before cold saves"
    else:  # negative control: hot saves are newer than the read, so it went
        assert not _present(be, 0)
    be.close()


def test_a_cold_save_of_a_block_it_holds_keeps_its_last_use(tmp_path):
    be = open_pool(str(tmp_path / "pool"), 4 << 20, 1, pin_seconds=0)
    be.refs = 1
    be.put_many(block(_h(7)))
    hot = _last_uses(be, 7)
    assert hot and all(t > time.time() - 60 for t in hot)
    be.put_many(block(_h(7)), cold=True)
    assert _last_uses(be, 7) == hot
    be.put_many(block(_h(8)), cold=True)
    assert all(t < time.time() - COLD_AGE + 60 for t in _last_uses(be, 8))
    be.close()


def test_near_saves_off_writes_the_far_tier_then_promotes(cluster, tmp_path):  # noqa: F811
    be = tiered(cluster.master_address, str(tmp_path / "near"), near_saves="off")
    h = b"\x51" * 32
    be.put_many(block(h))
    assert all(be.far.exists_many(markers(h)))
    assert not any(be.near.exists_many(markers(h)))
    assert hit(be, h) and be.promoter.wait()
    assert all(be.near.exists_many(markers(h)))
    assert hit(be, h)
    assert be.tier_counts["near_pages_loaded"] > 0
    be.close()


def test_near_saves_cold_writes_both_tiers_the_near_copy_cold(cluster, tmp_path):  # noqa: F811
    be = tiered(cluster.master_address, str(tmp_path / "near"), near_saves="cold")
    h = b"\x52" * 32
    be.put_many(block(h))
    assert all(be.far.exists_many(markers(h))) and all(be.near.exists_many(markers(h)))
    uses = _last_uses(be.near, h)
    assert uses and all(t < time.time() - COLD_AGE + 60 for t in uses)
    be.close()


def test_a_save_one_tier_has_no_room_for_is_not_logged_as_that_tier_failing(tmp_path, caplog):
    """Two real LMDB tiers: a batch larger than half the near tier is
    skipped there (PoolFull) and kept far; that is said as a skip, and a
    real near-tier fault afterwards still gets its own warning (the skip
    used to take the tier's one 'failed' warning and silence the fault)."""
    import logging

    from vllm_layerwise_patch.pool.backends.base import FaultInjectingBackend
    from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
    from vllm_layerwise_patch.pool.backends.tiered.backend import TieredBackend

    near = LmdbBackend(str(tmp_path / "near"), 4 << 20, pin_seconds=0)
    far = LmdbBackend(str(tmp_path / "far"), 64 << 20, pin_seconds=0)
    be = TieredBackend(near, far, promote=False)
    big = [(f"{'ab' * 16}/attn/{i:064x}/0/3".encode(), bytes(512 << 10)) for i in range(5)]
    caplog.set_level(logging.WARNING, logger="vllm.layerwise_patch")
    be.put_many(big)  # 2.5 MiB: more than half of the 4 MiB near tier
    assert far.exists_many([k for k, _ in big]) == [True] * 5
    assert near.exists_many([k for k, _ in big]) == [False] * 5
    said = [r.getMessage() for r in caplog.records]
    assert any("the near tier skipped a save" in m for m in said), said
    assert not any("the near tier failed" in m for m in said), said
    be.near = FaultInjectingBackend(near, "save")  # (tests' fault knob: a failing tier)
    be.put_many(big[:1])
    said = [r.getMessage() for r in caplog.records]
    assert any("the near tier failed" in m and "injected fault" in m for m in said), said
    assert be.tier_counts["near_save_failures"] == 2
    near.close()
    far.close()
