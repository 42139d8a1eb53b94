"""The pool never stops an engine, without one here (tests/test_pool_faults.py
starts one on a damaged pool, tests/test_pool_e2e.py fails a load without
the overlay's patches):

* a pool file LMDB cannot use: the backend says which file and why, the
  connector serves without the pool (one error line per process) or, with
  ``on_backend_unavailable: "fail"``, refuses to start - and the file is
  left as it was;
* without ``hybrid-load-recompute`` a failed synchronous load of a hybrid
  layout stops vLLM's engine: hits load asynchronously instead (a failed
  one is that request's), or, where vLLM cannot report that, no lookup is
  made."""

from __future__ import annotations

import logging
import os
import types

import pytest

from vllm_layerwise_patch.pool.backends.base import PoolUnusable
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.config import PoolConfig, PoolConfigError


def _damaged(tmp_path):
    """A pool directory whose data.mdb is random bytes."""
    path = tmp_path / "pool"
    path.mkdir(mode=0o700)
    data = path / "data.mdb"
    data.write_bytes(os.urandom(1 << 20))
    data.chmod(0o600)
    return path, data


def _foreign(tmp_path):
    """Another program's LMDB environment where the pool should be."""
    import lmdb

    path = tmp_path / "pool"
    path.mkdir(mode=0o700)
    env = lmdb.open(str(path), map_size=1 << 20, mode=0o600)
    with env.begin(write=True) as txn:
        txn.put(b"their-key", b"their value")
    env.close()
    return path, path / "data.mdb"


@pytest.mark.parametrize("make, why", [(_damaged, "cannot be opened by LMDB"),
                                       (_foreign, "another program's LMDB")])
def test_an_unusable_pool_file_is_named_and_left_as_it_was(tmp_path, make, why):
    path, data = make(tmp_path)
    before = data.read_bytes()
    with pytest.raises(PoolUnusable) as err:
        LmdbBackend(str(path), 8 << 20)
    assert str(data) in str(err.value) and why in str(err.value)
    assert data.read_bytes() == before
    assert not (path / "generation").exists()


def test_the_connector_serves_without_an_unusable_pool_and_says_so_once(tmp_path, caplog):
    from vllm_layerwise_patch.pool.backends.base import NoPool
    from vllm_layerwise_patch.pool.opening import open_backend

    path, data = _damaged(tmp_path)
    config = PoolConfig.from_extra({"path": str(path), "capacity": "8MiB"})
    with caplog.at_level(logging.WARNING, logger="vllm.layerwise_patch"):
        # the scheduler's and a worker's connector in one process
        backends = [open_backend(config, role) for role in ("scheduler", "worker")]
    assert all(isinstance(b, NoPool) for b in backends)
    assert backends[0].exists_many([b"k"]) == [False]
    lines = [r.getMessage() for r in caplog.records if str(data) in r.getMessage()]
    assert len(lines) == 1 and "serves without the pool" in lines[0], lines
    fail = PoolConfig.from_extra({"path": str(path), "capacity": "8MiB",
                                  "on_backend_unavailable": "fail"})
    with pytest.raises(PoolConfigError, match="kv_connector_extra_config.path"):
        open_backend(fail, "scheduler")


def _hybrid_scheduler(tmp_path):
    """Block 4 tokens, an attention and a state layer; 4 blocks committed."""
    from vllm_layerwise_patch.pool.backends.base import pack
    from vllm_layerwise_patch.pool.keys import ATTN, STATE, marker_key, page_key
    from vllm_layerwise_patch.pool.layout import PoolLayout
    from vllm_layerwise_patch.pool.scheduler.planner import PoolScheduler

    ns = b"N" * 16
    layout = PoolLayout(kinds=(ATTN, STATE), block_size=4, hash_block_size=4,
                        group_layers=(("model.layers.0.x",), ("model.layers.1.x",)))
    sched = PoolScheduler(vllm_config=types.SimpleNamespace(kv_transfer_config=None),
                          layout=layout, backend=LmdbBackend(str(tmp_path / "p"), 8 << 20),
                          namespace=ns, config=PoolConfig.from_extra({}))
    hashes = [bytes([i]) * 8 for i in range(4)]
    sched.hits.backend.put_many([(k, pack(ns, k, v)) for h in hashes
                                 for kind, layer in ((ATTN, "0"), (STATE, "1"))
                                 for k, v in ((page_key(ns, kind, h, 0, layer), b"x" * 8),
                                              (marker_key(ns, kind, h, 0), b""))])
    req = types.SimpleNamespace(block_hashes=hashes, num_tokens=17, request_id="r",
                                sampling_params=None)
    return sched, req


@pytest.mark.parametrize("async_supported", [True, False])
def test_without_hybrid_load_recompute_no_failed_load_can_stop_the_engine(
        tmp_path, monkeypatch, caplog, async_supported):
    from vllm_layerwise_patch.activation import registry
    from vllm_layerwise_patch.pool import connector

    assert not registry().is_applied("hybrid-load-recompute")  # (no vLLM scheduler here)
    monkeypatch.setattr(connector, "async_loads_supported", lambda: async_supported)
    sched, req = _hybrid_scheduler(tmp_path)
    assert sched.get_num_new_matched_tokens(req, 0) == (16, False)  # as it was
    with caplog.at_level(logging.WARNING, logger="vllm.layerwise_patch"):
        connector.avoid_engine_stop(sched)
        connector.avoid_engine_stop(sched)  # (decided once)
    said = [r.getMessage() for r in caplog.records if "hybrid-load-recompute" in r.getMessage()]
    assert len(said) == 1, said
    fresh = types.SimpleNamespace(**dict(vars(req), request_id="q"))
    if async_supported:  # vLLM parks the request; a failed load is that request's
        assert sched.get_num_new_matched_tokens(fresh, 0) == (16, True)
        assert "asynchronously" in said[0]
    else:
        assert sched.get_num_new_matched_tokens(fresh, 0) == (0, False)
        assert "not looked up" in said[0]
