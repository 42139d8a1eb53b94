"""Asynchronous loads shared between the requests of one prefix
(pool/scheduler/inflight.py), through the scheduler side with a real LMDB pool: a
request whose hit overlaps another's load in flight is asked to wait (None),
and every way that load can end lets it go - done, failed, aborted,
preempted - as does its own wait running past ``share_loads_seconds``."""

from __future__ import annotations

import types

import pytest

from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.config import PoolConfig

NS = b"N" * 16
BLOCK = 4


def _scheduler(tmp_path, share=10.0, load_async=True):
    from vllm_layerwise_patch.pool.layout import PoolLayout
    from vllm_layerwise_patch.pool.scheduler.planner import PoolScheduler

    layout = PoolLayout(kinds=("attn", "state"), block_size=BLOCK, hash_block_size=BLOCK,
                        group_layers=(("model.layers.0.x",), ("model.layers.1.x",)))
    return PoolScheduler(
        vllm_config=types.SimpleNamespace(kv_transfer_config=None), layout=layout,
        backend=LmdbBackend(str(tmp_path / "p"), 64 << 20), namespace=NS,
        config=PoolConfig.from_extra({"load_async": load_async,
                                      "share_loads_seconds": share}))


def _committed(sched, n, first=0):
    from vllm_layerwise_patch.pool.backends.base import pack
    from vllm_layerwise_patch.pool.keys import ATTN, STATE, marker_key, page_key

    hashes = [bytes([first + i]) * 8 for i in range(n)]
    items = []
    for kind in (ATTN, STATE):
        for h in hashes:
            items += [(page_key(NS, kind, h, 0, layer), b"x" * 8)
                      for layer in sched.hits.target[kind]]
            items.append((marker_key(NS, kind, h, 0), b""))
    sched.hits.backend.put_many([(k, pack(NS, k, v)) for k, v in items])
    return hashes


def _req(hashes, rid):
    return types.SimpleNamespace(block_hashes=hashes, num_tokens=len(hashes) * BLOCK + 1,
                                 request_id=rid)


def _issue(sched, req, hit_blocks):
    """vLLM allocates ``req``'s blocks and its asynchronous load is issued."""
    ids = list(range(10, 10 + hit_blocks + 1))
    blocks = types.SimpleNamespace(get_block_ids=lambda: (ids, [0] * (hit_blocks - 1) + [99, 0]))
    sched.update_state_after_alloc(req, blocks, hit_blocks * BLOCK)


@pytest.fixture
def burst(tmp_path):
    """Request "a" loads 3 stored blocks asynchronously; "b" shares them."""
    sched = _scheduler(tmp_path)
    hashes = _committed(sched, 3)
    a, b = _req(hashes, "a"), _req(hashes, "b")
    assert sched.get_num_new_matched_tokens(a, 0) == (12, True)
    _issue(sched, a, 3)
    assert sched.get_num_new_matched_tokens(b, 0) == (None, False)  # ask again later
    assert sched.get_num_new_matched_tokens(b, 0) == (None, False)
    assert sched.shared_loads.stats == {"waits": 1, "timeouts": 0}
    yield sched, a, b, hashes
    sched.hits.backend.close()


def test_a_done_load_lets_the_waiting_request_take_its_blocks_from_vllms_cache(burst):
    sched, a, b, _ = burst
    sched.update_connector_output(types.SimpleNamespace(finished_recving={"a"}))
    # vLLM cached a's blocks: b's local hit covers them, the pool adds nothing
    assert sched.get_num_new_matched_tokens(b, 12) == (0, False)
    assert not sched.shared_loads.waiting("b")


def test_a_waiting_request_loads_only_what_lies_beyond_the_shared_load(tmp_path):
    sched = _scheduler(tmp_path)
    hashes = _committed(sched, 4)
    a, b = _req(hashes[:2], "a"), _req(hashes, "b")
    assert sched.get_num_new_matched_tokens(a, 0) == (8, True)
    _issue(sched, a, 2)
    assert sched.get_num_new_matched_tokens(b, 0) == (None, False)
    sched.update_connector_output(types.SimpleNamespace(finished_recving={"a"}))
    assert sched.get_num_new_matched_tokens(b, 8) == (8, True)  # blocks 2-3 only


def test_a_failed_load_releases_its_waiters(burst):
    sched, a, b, _ = burst
    sched.update_connector_output(types.SimpleNamespace(
        finished_recving=set(), failed_recving={"a"}, invalid_block_ids=set()))
    # nothing of a's was cached: b loads its own hit
    assert sched.get_num_new_matched_tokens(b, 0) == (12, True)


def test_a_failed_load_reported_by_block_ids_releases_its_waiters(burst):
    sched, a, b, _ = burst
    sched.update_connector_output(types.SimpleNamespace(
        finished_recving=set(), failed_recving=set(), invalid_block_ids={11}))
    assert sched.get_num_new_matched_tokens(b, 0) == (12, True)


def test_an_aborted_load_releases_its_waiters(burst):
    sched, a, b, _ = burst
    sched.request_finished(a)  # its blocks are freed when the load ends, never cached
    assert sched.get_num_new_matched_tokens(b, 0) == (12, True)


def test_a_preempted_loader_looked_up_again_releases_its_waiters(burst):
    sched, a, b, _ = burst
    # a starts over: vLLM looks it up again; its own old load holds nobody back
    assert sched.get_num_new_matched_tokens(a, 0) == (12, True)
    assert sched.get_num_new_matched_tokens(b, 0) == (12, True)


def test_a_wait_is_bounded_by_share_loads_seconds(burst):
    sched, a, b, _ = burst
    now = [0.0]
    sched.shared_loads.clock = lambda: now[0]
    c = _req(b.block_hashes, "c")
    assert sched.get_num_new_matched_tokens(c, 0) == (None, False)
    now[0] = 9.9
    assert sched.get_num_new_matched_tokens(c, 0) == (None, False)
    now[0] = 10.1  # a's load still in flight: c gives up and loads its own hit
    assert sched.get_num_new_matched_tokens(c, 0) == (12, True)
    _issue(sched, c, 3)
    assert sched.shared_loads.stats["timeouts"] == 1
    sched.request_finished(c)
    assert not sched.shared_loads.waiting("c")


def test_unrelated_prefixes_and_sync_loads_never_wait(tmp_path):
    sched = _scheduler(tmp_path)
    a = _req(_committed(sched, 3), "a")
    other = _req(_committed(sched, 3, first=50), "other")
    assert sched.get_num_new_matched_tokens(a, 0) == (12, True)
    _issue(sched, a, 3)
    assert sched.get_num_new_matched_tokens(other, 0) == (12, True)
    sched.hits.backend.close()
    sync = _scheduler(tmp_path, load_async=False)
    hashes = _committed(sync, 3)
    x, y = _req(hashes, "x"), _req(hashes, "y")
    assert sync.get_num_new_matched_tokens(x, 0) == (12, False)
    _issue(sync, x, 3)
    assert sync.get_num_new_matched_tokens(y, 0) == (12, False)


def test_share_loads_seconds_zero_turns_the_sharing_off(tmp_path):
    # the negative control of the engine test: every request loads its hit
    sched = _scheduler(tmp_path, share=0)
    hashes = _committed(sched, 3)
    a, b = _req(hashes, "a"), _req(hashes, "b")
    assert sched.get_num_new_matched_tokens(a, 0) == (12, True)
    _issue(sched, a, 3)
    assert sched.get_num_new_matched_tokens(b, 0) == (12, True)
