"""Every pool value names its key (value format 4): the header holds a digest
of the full key the value was written under (block hash, kind, rank, layer,
a drafter page's next token), and every read checks it - the worker's loads
(into staging, zero-copy into the page, Mooncake's ranges, whole and staged
reads), the scheduler's lookup verification and ``pool verify``.  A sound
value of another key of the same namespace - its header, namespace, length
and checksum all valid - is ``other-key`` damage: the load fails (the page
is zeroed, the request recomputes), the lookup drops the block, ``pool
verify`` lists it.

Negative control in each test: ``debug_value_key_blind`` (the rule before
format 4, the header checked without the key) lets the wrong value through.

On Mooncake the case that needs it is real: a get session's cached replica
list outlives its object when the object is force-removed, and the master
gives the freed extent to the next object of that size - another block's,
whose slot the session's next ranged read returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from test_pool_mooncake_objects import LAYERS, NS, PAGE, backend, block
from test_pool_mooncake_objects import cluster  # noqa: F401 - the module's own master and holder
from vllm_layerwise_patch.pool.backends.base import (HEADER_SIZE, CorruptEntry, key_digest,
                                                     pack, unpack)
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.config import PoolConfig
from vllm_layerwise_patch.pool.faults import FAULTS_ENV
from vllm_layerwise_patch.pool.keys import ATTN, STATE, group_key, marker_key, page_key
from vllm_layerwise_patch.pool.worker.pipeline import LayerwisePipeline, read_items

BLOCKS = 4
BLIND = json.dumps({"debug_value_key_blind": True})
MODES = pytest.mark.parametrize("blind", [False, True], ids=["checked", "control-key-blind"])


def _blind(monkeypatch, blind: bool) -> None:
    if blind:
        monkeypatch.setenv(FAULTS_ENV, BLIND)
    else:
        monkeypatch.delenv(FAULTS_ENV, raising=False)


def test_the_header_names_its_key_and_every_part_of_the_key_counts():
    k = page_key(NS, ATTN, b"\x01" * 32, 0, "3")
    v = pack(NS, k, b"x" * 64)
    assert int.from_bytes(v[24:32], "little") == key_digest(k)  # (the former padding)
    assert HEADER_SIZE == 48  # payloads stay on a cache line (VALUE_OFFSET)
    others = [page_key(NS, ATTN, b"\x02" * 32, 0, "3"), page_key(NS, STATE, b"\x01" * 32, 0, "3"),
              page_key(NS, ATTN, b"\x01" * 32, 1, "3"), page_key(NS, ATTN, b"\x01" * 32, 0, "4"),
              k + b"@17"]
    for other in others:
        with pytest.raises(CorruptEntry) as e:
            unpack(other, v, NS, check_crc=False)
        assert e.value.kind == "other-key" and e.value.key == other
    assert bytes(unpack(k, v, NS)) == b"x" * 64


# -- LMDB: block B's page copied under block A's key -----------------------------------

def _lmdb_pool(path, hashes):
    """A pool with BLOCKS blocks (one attention and one state layer, random
    pages); then block 2's attention page copied under block 1's key: the
    same namespace and size, a sound checksum.  Returns (backend, the copied
    key, the pages by key)."""
    be = LmdbBackend(str(path), 16 << 20)
    pages: dict[bytes, bytes] = {}
    items = []
    for h in hashes:
        for kind, layer in ((ATTN, "0"), (STATE, "1")):
            pages[page_key(NS, kind, h, 0, layer)] = os.urandom(PAGE)
            items += [page_key(NS, kind, h, 0, layer), marker_key(NS, kind, h, 0)]
    be.put_many([(k, pack(NS, k, pages.get(k, b""))) for k in items])
    key_a, key_b = (page_key(NS, ATTN, h, 0, "0") for h in hashes[1:3])
    be.put_many([(key_a, be.get_many([key_b])[0])])
    return be, key_a, key_b, pages


@MODES
def test_a_value_of_another_key_fails_its_load(tmp_path, monkeypatch, blind):
    _blind(monkeypatch, blind)
    hashes = [bytes([i]) * 32 for i in range(BLOCKS)]
    be, key_a, key_b, pages = _lmdb_pool(tmp_path / "pool", hashes)
    dest = torch.full((PAGE,), 0xEE, dtype=torch.uint8)
    pipe = LayerwisePipeline(["L0"], be, NS, threads=1)
    pipe.load_all({"L0": [(key_a, [dest])]}, tolerate_errors=True)
    if blind:  # the old rule: block B's page is served as block A's
        assert not pipe.failures and bytes(dest.numpy()) == pages[key_b] != pages[key_a]
    else:
        [(layer, i, key, exc)] = pipe.failures
        assert (layer, i, key) == ("L0", 0, key_a)
        assert isinstance(exc, CorruptEntry) and exc.kind == "other-key"
        assert not dest.any()  # zeroed: never the other block's bytes
        # the worker after a verified lookup skips checksums, never the key
        with pytest.raises(CorruptEntry, match="other-key"):
            read_items(be, NS, [(key_a, [dest])], check_crc=False)
    pipe.close()
    be.close()


@MODES
def test_the_lookup_drops_a_block_holding_a_value_of_another_key(tmp_path, monkeypatch,
                                                                 blind):
    from vllm_layerwise_patch.pool.layout import PoolLayout
    from vllm_layerwise_patch.pool.scheduler.planner import PoolScheduler

    _blind(monkeypatch, blind)
    hashes = [bytes([i]) * 32 for i in range(BLOCKS)]
    layout = PoolLayout(kinds=(ATTN, STATE), block_size=4, hash_block_size=4,
                        group_layers=(("model.layers.0.x",), ("model.layers.1.x",)),
                        page_bytes=PAGE)
    names = layout.block_hashes(hashes, 0, BLOCKS)  # (as the scheduler names them)
    be, key_a, _, _ = _lmdb_pool(tmp_path / "pool", names)
    sched = PoolScheduler(vllm_config=SimpleNamespace(kv_transfer_config=None), layout=layout,
                          backend=be, namespace=NS, config=PoolConfig.from_extra({}))
    req = SimpleNamespace(block_hashes=hashes, num_tokens=BLOCKS * 4 + 1, request_id="r")
    if blind:
        assert sched.hits.lookup(req, 0) == BLOCKS and not sched.log.seen
    else:
        assert sched.hits.lookup(req, 0) == 1  # the hit ends before block 1
        assert sched.log.seen == {"other-key"}
        # block 1's attention group went, marker included: it is saved again
        assert be.exists_many([key_a, marker_key(NS, ATTN, names[1], 0)]) == [False, False]
    be.close()


@MODES
def test_pool_verify_reports_a_value_of_another_key(tmp_path, monkeypatch, blind):
    from vllm_layerwise_patch.pool import admin

    _blind(monkeypatch, blind)
    hashes = [bytes([i]) * 32 for i in range(BLOCKS)]
    be, key_a, _, _ = _lmdb_pool(tmp_path / "pool", hashes)
    doc = admin.verify(be)
    group_a = group_key(NS, ATTN, hashes[1], 0).decode()
    assert doc["checked"] == 4 * BLOCKS
    assert doc["damaged"] == ({} if blind else {group_a: [{"key": key_a.decode(),
                                                           "kind": "other-key"}]})
    be.close()
    # the command itself (a process of its own, reading the variable as engines do)
    env = {k: v for k, v in os.environ.items() if k != FAULTS_ENV}
    if blind:
        env[FAULTS_ENV] = BLIND
    out = subprocess.run([sys.executable, "-m", "vllm_layerwise_patch", "pool", "verify",
                          str(tmp_path / "pool"), "--no-progress"], env=env,
                         capture_output=True, text=True, timeout=120)
    if blind:
        assert out.returncode == 0, out.stdout + out.stderr
        assert "checked 16 entries: 0 damaged group(s)" in out.stdout, out.stdout
    else:
        assert out.returncode == 1, out.stdout + out.stderr
        assert "checked 16 entries: 1 damaged group(s)" in out.stdout, out.stdout
        assert f"  {group_a}: 1 entry (other-key)" in out.stdout, out.stdout


# -- Mooncake -----------------------------------------------------------------------------

def _extent(be, name: str) -> int:
    desc = be.conn.store.batch_get_replica_desc([name])[name]
    return desc[0].get_memory_descriptor().buffer_descriptor.buffer_address


@pytest.mark.parametrize("register", [False, True], ids=["ranges", "zero-copy-ranges"])
@MODES
def test_a_slot_of_another_object_read_through_a_stale_session_fails_its_load(
        cluster, monkeypatch, register, blind):
    # Block X's attention object is put and its layer 0 loaded: a get
    # session caches X's replica list.  X is force-removed and block Y's
    # attention object (same namespace, layout and size, other pages) is
    # put: the master gives Y the extent X had.  The load of X's layer 1
    # then reads through the session - Y's slot 1, a sound value whose
    # header names Y's key.
    _blind(monkeypatch, blind)
    be = backend(cluster.master_address, zero_copy_loads=True)
    n = 0x20 + 2 * register + blind
    hx, hy = bytes([n]) * 32, bytes([n + 0x40]) * 32

    def attention(h: bytes, fill: int) -> list[tuple[bytes, bytes]]:
        """Block ``h``'s attention object: layer i's page all ``fill + i``."""
        keys = [page_key(NS, ATTN, h, 0, str(i)) for i in range(len(LAYERS))]
        return [(k, pack(NS, k, bytes([fill + i]) * PAGE)) for i, k in enumerate(keys)] + [
            (marker_key(NS, ATTN, h, 0), pack(NS, marker_key(NS, ATTN, h, 0), b""))]

    be.put_many(attention(hx, 1))
    kv = torch.full((2, PAGE), 0xEE, dtype=torch.uint8)
    pipe = LayerwisePipeline(LAYERS, be, NS, prefetch=1, threads=1)
    if register:  # (zero-copy: headers to staging, payloads straight into the pages)
        assert pipe.register_memory([kv])
    kx = [page_key(NS, ATTN, hx, 0, str(i)) for i in range(2)]
    pipe.load_all({LAYERS[0]: [(kx[0], [kv[0]])]}, tolerate_errors=True)
    assert not pipe.failures and bytes(kv[0].numpy()) == bytes([1]) * PAGE
    obj_x = f"{NS.hex()}/attn/{hx.hex()}/tp0/B"
    assert obj_x in be.ranges.sessions  # (5 of 6 slots left: the session stays)
    at = _extent(be, obj_x)
    assert be.conn.store.batch_remove([obj_x], True) == [0]  # force: the lease ignored
    be.put_many(attention(hy, 0xB0))
    assert _extent(be, f"{NS.hex()}/attn/{hy.hex()}/tp0/B") == at, \
        "precondition: the master gives Y the extent X had"
    assert be.exists_many([marker_key(NS, ATTN, hx, 0)]) == [False]  # X is gone
    pipe.load_all({LAYERS[1]: [(kx[1], [kv[1]])]}, tolerate_errors=True)
    assert be.calls["get_sessions"] == 1  # the read went through X's session
    if blind:  # the old rule: Y's page is served as X's layer 1
        assert not pipe.failures and bytes(kv[1].numpy()) == bytes([0xB1]) * PAGE
    else:
        [(layer, _, key, exc)] = pipe.failures
        assert (layer, key) == (LAYERS[1], kx[1])
        assert isinstance(exc, CorruptEntry) and exc.kind == "other-key"
        assert not kv[1].any()  # zeroed: the request recomputes
    pipe.close()
    be.close()


@pytest.mark.parametrize("own, shm", [(False, False), (True, False), (False, True)],
                         ids=["ranges", "whole", "staged"])
@MODES
def test_every_mooncake_reader_checks_the_key_of_each_slot(cluster, monkeypatch, own, shm,
                                                           blind):
    # slots 2 and 3 of a block object hold each other's values (each sound):
    # their loads fail, the others load - by ranges in a session, whole
    # objects into the pages (a worker holding a segment) or staged whole
    # reads (a same-node client)
    from test_pool_mooncake_objects import client

    _blind(monkeypatch, blind)
    be = client(cluster, own, shm)
    h = bytes([0x70 + own + 2 * shm + 4 * blind]) * 32
    items = block(h)
    items[2], items[3] = (items[2][0], items[3][1]), (items[3][0], items[2][1])
    be.put_many(items)
    kv = torch.full((6, PAGE), 0xEE, dtype=torch.uint8)
    pipe = LayerwisePipeline(LAYERS, be, NS, prefetch=2, threads=2)
    assert pipe.register_memory([kv]) is not shm
    pipe.start({LAYERS[i]: [(page_key(NS, ATTN, h, 0, str(i)), [kv[i]])] for i in range(6)},
               tolerate_errors=True)
    for layer in LAYERS:
        pipe.wait(layer)
    if blind:  # the old rule: layers 2 and 3 get each other's pages
        assert not pipe.failures
        assert [int(kv[i][0]) for i in range(6)] == [1, 2, 4, 3, 5, 6]
    else:
        assert sorted(f[0] for f in pipe.failures) == LAYERS[2:4]
        assert all(isinstance(f[3], CorruptEntry) and f[3].kind == "other-key"
                   for f in pipe.failures)
        assert [int(kv[i].max()) for i in range(6)] == [1, 2, 0, 0, 5, 6]
    pipe.close()
    be.close()
