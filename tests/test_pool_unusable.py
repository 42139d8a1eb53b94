"""A pool file LMDB cannot use never stops an engine from starting (no
engine here; tests/test_pool_faults.py starts one on a damaged pool): the
backend says which file and why, the connector serves without the pool
(one error line per process) or, with ``on_backend_unavailable: "fail"``,
refuses to start - and the file is left as it was."""

from __future__ import annotations

import logging
import os

import pytest

from vllm_layerwise_patch.pool.backends.base import PoolUnusable
from vllm_layerwise_patch.pool.backends.lmdb import LmdbBackend
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
    from vllm_layerwise_patch.pool.connector import open_backend

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
