"""Pool pieces without an engine: the value format, the LMDB backend (real
LMDB, several processes, eviction), the torch-only transfer pipeline, the
extra-config validation and the scheduler's lookup rules."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import types

import pytest
import torch

from vllm_layerwise_patch.pool.backends.base import CorruptEntry, pack, unpack
from vllm_layerwise_patch.pool.backends.lmdb import LmdbBackend
from vllm_layerwise_patch.pool.config import PoolConfig, PoolConfigError
from vllm_layerwise_patch.pool.pipeline import LayerwisePipeline, LoadError

NS = b"N" * 16


# -- value format --------------------------------------------------------------

def test_pack_unpack_roundtrip_and_each_corruption_kind():
    payload = bytes(range(256)) * 10
    v = pack(NS, payload)
    assert bytes(unpack(b"k", v, NS, expected_length=len(payload))) == payload
    flipped = bytearray(v)
    flipped[-5] ^= 1
    cases = {
        "checksum": bytes(flipped),
        "truncated": v[:-7],
        "foreign-namespace": pack(b"O" * 16, payload),
        "bad-header": b"XXXX" + v[4:],
    }
    for kind, value in cases.items():
        with pytest.raises(CorruptEntry) as e:
            unpack(b"k", value, NS)
        assert e.value.kind == kind
    with pytest.raises(CorruptEntry, match="truncated"):
        unpack(b"k", v[:10], NS)
    # without the checksum (the worker, after a verified lookup) the header,
    # namespace and length are still checked; a flipped payload byte is not
    assert bytes(unpack(b"k", cases["checksum"], NS, check_crc=False)) != payload
    for kind in ("truncated", "foreign-namespace", "bad-header"):
        with pytest.raises(CorruptEntry) as e:
            unpack(b"k", cases[kind], NS, check_crc=False)
        assert e.value.kind == kind
    with pytest.raises(CorruptEntry, match="page is"):
        unpack(b"k", v, NS, expected_length=len(payload) + 1)


def test_values_are_never_pickles():
    v = pack(NS, b"\x80\x04K\x01.")
    assert v.startswith(b"VLPV")


# -- LMDB backend --------------------------------------------------------------

def test_lmdb_put_get_exists_delete(tmp_path):
    be = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    be.put_many([(b"a", pack(NS, b"1")), (b"b", pack(NS, b"22"))])
    assert be.exists_all([b"a", b"b", b"c"]) == [True, True, False]
    got = be.get_many([b"b", b"c"])
    assert bytes(unpack(b"b", got[0], NS)) == b"22" and got[1] is None
    be.delete([b"a"])
    assert be.exists_all([b"a"]) == [False]
    be.close()


def test_lmdb_evicts_least_recently_used_and_reuses_freed_pages(tmp_path):
    be = LmdbBackend(str(tmp_path / "p"), 4 << 20, pin_seconds=0)
    page = bytes(200_000)
    for i in range(60):  # 12 MB through a 4 MiB map
        be.put_many([(f"k{i}".encode(), pack(NS, page))])
        if i == 5:
            be.touch([b"k0"])  # recently used: survives longer than k1..k5
    st = be.stats()
    assert st["evictions"] > 0 and st["entries"] < 60
    assert be.exists_all([b"k59"]) == [True]
    assert be.exists_all([b"k1"]) == [False]
    # the map did not have to grow: freed pages were reused
    assert st["used_bytes"] <= 4 << 20
    be.close()


def test_lmdb_pin_window_protects_recent_entries(tmp_path):
    be = LmdbBackend(str(tmp_path / "p"), 2 << 20, pin_seconds=3600)
    with pytest.raises(RuntimeError, match="pool full"):
        for i in range(40):
            be.put_many([(f"k{i}".encode(), pack(NS, bytes(200_000)))])
    assert be.exists_all([b"k0"]) == [True]  # nothing pinned was evicted
    be.close()


def test_lmdb_is_safe_for_several_processes(tmp_path):
    path = str(tmp_path / "p")
    code = textwrap.dedent(f"""
        import sys
        from vllm_layerwise_patch.pool.backends.lmdb import LmdbBackend
        from vllm_layerwise_patch.pool.backends.base import pack
        be = LmdbBackend({path!r}, 256 << 20)
        w = sys.argv[1]
        for i in range(200):
            be.put_many([(f"{{w}}-{{i}}".encode(), pack(b"N" * 16, bytes([i % 256]) * 4096))])
        """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(w)]) for w in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    be = LmdbBackend(path, 256 << 20)
    keys = [f"{w}-{i}".encode() for w in range(3) for i in range(200)]
    assert all(be.exists_all(keys))
    vals = be.get_many([b"2-7"])
    assert bytes(unpack(b"2-7", vals[0], NS)) == bytes([7]) * 4096
    be.close()


# -- configuration -------------------------------------------------------------

def test_config_defaults_and_sizes():
    c = PoolConfig.from_extra({"capacity": "512MiB", "path": "/tmp/x"})
    assert c.capacity == 512 << 20 and c.prefetch_layers == 2
    assert PoolConfig.from_extra({"capacity": 1000}).capacity == 1000
    assert PoolConfig.from_extra(None).path.endswith("vllm-layerwise-pool")


@pytest.mark.parametrize("extra,field", [
    ({"capacity": "lots"}, "capacity"), ({"capacity": -1}, "capacity"),
    ({"capacity": True}, "capacity"), ({"prefetch_layers": 0}, "prefetch_layers"),
    ({"load_threads": "2"}, "load_threads"), ({"pin_seconds": -1}, "pin_seconds"),
    ({"verify_on_lookup": "yes"}, "verify_on_lookup"), ({"path": ""}, "path"),
    ({"backend": "redis"}, "backend"), ({"capcity": "1GiB"}, "capcity"),
])
def test_config_errors_name_the_field(extra, field):
    with pytest.raises(PoolConfigError) as e:
        PoolConfig.from_extra(extra)
    assert field in str(e.value) and "kv_connector_extra_config" in str(e.value)


# -- the transfer pipeline (torch only) ------------------------------------------

class CountingBackend:
    """Wraps a real LmdbBackend, recording which layers' loads are in flight."""

    def __init__(self, inner, key_layer):
        self.inner, self.key_layer = inner, key_layer
        self.in_flight: set[str] = set()
        self.max_ahead = 0
        self.release = threading.Event()
        self.lock = threading.Lock()

    def read_many(self, keys, consume):
        from vllm_layerwise_patch.pool.backends.base import Backend

        Backend.read_many(self, keys, consume)  # the generic path, via get_many

    def get_many(self, keys):
        layer = self.key_layer[keys[0]]
        with self.lock:
            self.in_flight.add(layer)
            self.max_ahead = max(self.max_ahead, len(self.in_flight))
        try:
            return self.inner.get_many(keys)
        finally:
            with self.lock:
                self.in_flight.discard(layer)


def _pages(n_layers, n_blocks, size):
    return {f"model.layers.{i}.x": torch.zeros(n_blocks, size, dtype=torch.uint8)
            for i in range(n_layers)}


def test_pipeline_loads_every_layer_in_order_with_prefetch(tmp_path):
    be = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    caches = _pages(6, 4, 1024)
    order = list(caches)
    tasks, key_layer, expect = {}, {}, {}
    for li, layer in enumerate(order):
        for b in (1, 3):
            key = f"{layer}/{b}".encode()
            data = torch.randint(0, 256, (1024,), dtype=torch.uint8)
            be.put_many([(key, pack(NS, data.numpy().tobytes()))])
            tasks.setdefault(layer, []).append((key, [caches[layer][b]]))
            key_layer[key] = layer
            expect[(layer, b)] = data
    counting = CountingBackend(be, key_layer)
    pipe = LayerwisePipeline(order, counting, NS, prefetch=2, threads=4)
    pipe.start(tasks)
    for layer in order:
        pipe.wait(layer)
        for b in (1, 3):
            assert torch.equal(caches[layer][b], expect[(layer, b)])
        assert caches[layer][0].sum() == 0 and caches[layer][2].sum() == 0
    assert pipe.bytes_loaded == 6 * 2 * 1024
    assert counting.max_ahead <= 2  # never more than `prefetch` layers in flight
    pipe.close()
    be.close()


def test_pipeline_surfaces_missing_and_corrupt_entries(tmp_path):
    be = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    caches = _pages(2, 2, 64)
    order = list(caches)
    be.put_many([(b"bad", pack(b"O" * 16, bytes(64)))])
    pipe = LayerwisePipeline(order, be, NS, prefetch=2)
    pipe.start({order[0]: [(b"missing", [caches[order[0]][1]])],
                order[1]: [(b"bad", [caches[order[1]][1]])]})
    with pytest.raises(LoadError, match="vanished"):
        pipe.wait(order[0])
    with pytest.raises(CorruptEntry, match="foreign-namespace"):
        pipe.wait(order[1])
    assert caches[order[1]][1].sum() == 0  # nothing written from a bad entry
    pipe.close()
    be.close()


def test_pipeline_tolerant_mode_zeroes_and_lists_failed_items(tmp_path):
    # The mode used when the scheduler can take load errors: a failed item
    # does not raise; its pages are zeroed (not left with stale or
    # half-written bytes) and it is listed for the worker to report; the
    # other items of the same layer still load.
    be = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    caches = _pages(2, 3, 64)
    order = list(caches)
    good = torch.randint(1, 256, (64,), dtype=torch.uint8)
    be.put_many([(b"good", pack(NS, good.numpy().tobytes())),
                 (b"bad", pack(b"O" * 16, bytes(64)))])
    for layer in order:
        caches[layer].fill_(7)  # what a previous request left there
    pipe = LayerwisePipeline(order, be, NS, prefetch=2)
    pipe.start({order[0]: [(b"good", [caches[order[0]][0]]), (b"missing", [caches[order[0]][1]])],
                order[1]: [(b"bad", [caches[order[1]][2], caches[order[1]][0]])]},
               tolerate_errors=True)
    for layer in order:
        pipe.wait(layer)  # no raise
    assert torch.equal(caches[order[0]][0], good)
    assert caches[order[0]][1].sum() == 0
    assert caches[order[1]][2].sum() == 0 and caches[order[1]][0].sum() == 0
    assert caches[order[1]][1].sum() == 7 * 64  # not a destination: untouched
    got = sorted((layer, i, type(e).__name__) for layer, i, e in pipe.failures)
    assert got == [(order[0], 1, "LoadError"), (order[1], 0, "CorruptEntry")]
    pipe.start({order[0]: [(b"missing", [caches[order[0]][1]])]})  # strict again
    with pytest.raises(LoadError):
        pipe.wait(order[0])
    assert pipe.failures == []
    pipe.close()
    be.close()


def test_save_queue_commit_leaves_out_excluded_pages(tmp_path):
    # A request whose load failed computed on zeroed pages: its pages are
    # excluded from the step's commit.
    from vllm_layerwise_patch.pool.pipeline import SaveQueue

    be = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    q = SaveQueue(be, NS)
    pages = torch.randint(0, 256, (2, 64), dtype=torch.uint8)
    q.submit([(b"keep", pages[0]), (b"drop", pages[1])])
    assert q.commit([b"m"], exclude={b"drop"}) is True
    assert be.exists_all([b"keep", b"drop", b"m"]) == [True, False, True]
    q.close()
    be.close()


# -- scheduler lookup rules ----------------------------------------------------

def _scheduler(tmp_path, *, layers=((0, "a"), (1, "m")), verify=True):
    from vllm_layerwise_patch.pool.keys import ATTN, MAMBA
    from vllm_layerwise_patch.pool.scheduler import PoolScheduler

    sched = PoolScheduler.__new__(PoolScheduler)
    sched.backend = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    sched.ns, sched.block_size, sched.tp_size = NS, 4, 1
    sched.config = PoolConfig.from_extra({"verify_on_lookup": verify})
    sched.layers = {ATTN: [str(i) for i, k in layers if k == "a"],
                    MAMBA: [str(i) for i, k in layers if k == "m"]}
    sched._warned = set()
    sched.trim_blocks = 0
    return sched


def _store(sched, hashes, blocks, kind):
    from vllm_layerwise_patch.pool.keys import marker_key, page_key

    items = []
    for i in blocks:
        for layer in sched.layers[kind]:
            items.append((page_key(NS, kind, hashes[i], 0, layer), pack(NS, b"x" * 8)))
        items.append((marker_key(NS, kind, hashes[i], 0), pack(NS, b"")))
    sched.backend.put_many(items)


def test_lookup_ends_at_the_last_stored_boundary_state(tmp_path):
    from vllm_layerwise_patch.pool.keys import ATTN, MAMBA

    sched = _scheduler(tmp_path)
    hashes = [bytes([i]) * 8 for i in range(5)]
    req = types.SimpleNamespace(block_hashes=hashes, num_tokens=5 * 4 + 2)
    assert sched.lookup(req, 0) == 0  # empty pool
    _store(sched, hashes, range(5), ATTN)
    assert sched.lookup(req, 0) == 0  # attention alone is not a hybrid hit
    _store(sched, hashes, [1, 3], MAMBA)
    assert sched.lookup(req, 0) == 4  # state at the end of block 3
    assert sched.lookup(req, 8) == 4  # beyond a local hit of 2 blocks
    assert sched.lookup(req, 16) == 0  # cannot beat a local hit of 4
    # a full-prompt hit leaves one token to compute: 5 blocks + 2 tokens -> cap 5
    exact = types.SimpleNamespace(block_hashes=hashes[:4], num_tokens=16)
    assert sched.lookup(exact, 0) == 2  # cap (16-1)//4 = 3 blocks; state after block 1
    # first attention miss stops the walk
    sched.backend.delete([b"".join([NS.hex().encode(), b"/A/", hashes[2].hex().encode(), b"/0"])])
    assert sched.lookup(req, 0) == 2


def test_speculative_decoding_trims_the_final_block(tmp_path):
    from vllm_layerwise_patch.pool.keys import ATTN, MAMBA

    sched = _scheduler(tmp_path)
    hashes = [bytes([i]) * 8 for i in range(4)]
    req = types.SimpleNamespace(block_hashes=hashes, num_tokens=4 * 4 + 1)
    _store(sched, hashes, range(4), ATTN)
    _store(sched, hashes, range(4), MAMBA)
    assert sched.lookup(req, 0) == 4
    sched.trim_blocks = 1
    assert sched.lookup(req, 0) == 3
    # the trimmed hit still needs the state at its own end
    from vllm_layerwise_patch.pool.keys import marker_key

    sched.backend.delete([marker_key(NS, MAMBA, hashes[2], 0)])
    assert sched.lookup(req, 0) == 2


def test_lookup_verification_shortens_the_hit_on_damage(tmp_path):
    from vllm_layerwise_patch.pool.keys import ATTN, MAMBA, page_key

    sched = _scheduler(tmp_path)
    hashes = [bytes([i]) * 8 for i in range(4)]
    req = types.SimpleNamespace(block_hashes=hashes, num_tokens=4 * 4 + 1)
    _store(sched, hashes, range(4), ATTN)
    _store(sched, hashes, range(4), MAMBA)
    assert sched.lookup(req, 0) == 4
    key = page_key(NS, MAMBA, hashes[3], 0, "1")
    sched.backend.put_many([(key, pack(NS, b"x" * 8)[:-3])])  # truncated state at block 3
    assert sched.lookup(req, 0) == 3
    assert sched.backend.exists_all([key]) == [False]  # dropped from the pool
    key = page_key(NS, ATTN, hashes[1], 0, "0")
    sched.backend.put_many([(key, pack(b"O" * 16, b"x" * 8))])  # foreign attention page
    assert sched.lookup(req, 0) == 1
    assert sched._warned == {"truncated", "foreign-namespace"}


def test_layer_ids_keep_drafter_layers_apart():
    from vllm_layerwise_patch.pool.keys import check_unique_ids, forward_order, layer_id

    assert layer_id("model.layers.3.self_attn.attn") == "3"
    assert layer_id("model.layers.0.linear_attn") == "0"
    assert layer_id("mtp.layers.0.self_attn.attn") == "mtp.0"
    assert layer_id("model.mtp.layers.1.attn") == "model.mtp.1"
    names = ["mtp.layers.0.self_attn.attn", "model.layers.10.x", "model.layers.2.x"]
    assert sorted(names, key=forward_order) == [names[2], names[1], names[0]]
    check_unique_ids(["model.layers.0.self_attn.attn", "mtp.layers.0.self_attn.attn"])
    with pytest.raises(ValueError, match="same pool key"):
        check_unique_ids(["model.layers.0.a", "layers.0.b"])


def test_save_queue_commits_pages_and_markers_in_one_transaction(tmp_path):
    from vllm_layerwise_patch.pool.pipeline import SaveQueue

    be = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    q = SaveQueue(be, NS)
    pages = torch.randint(0, 256, (3, 512), dtype=torch.uint8)
    q.submit([(b"p0", pages[0]), (b"p1", pages[1])])
    q.submit([(b"p2", pages[2])])
    assert be.exists_all([b"p0", b"m"]) == [False, False]  # nothing before commit
    assert q.commit([b"m"]) is True
    assert be.exists_all([b"p0", b"p1", b"p2", b"m"]) == [True] * 4
    got = be.get_many([b"p2"])[0]
    assert bytes(unpack(b"p2", got, NS)) == pages[2].numpy().tobytes()
    assert q.bytes_saved > 3 * 512
    q.close()
    be.close()


def test_save_queue_failure_is_logged_not_raised(tmp_path):
    import logging

    from vllm_layerwise_patch.pool.pipeline import SaveQueue

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("vllm.layerwise_patch")
    log.addHandler(handler)

    be = LmdbBackend(str(tmp_path / "p"), 1 << 20, pin_seconds=3600)
    q = SaveQueue(be, NS)
    big = torch.zeros(700_000, dtype=torch.uint8)  # more than half the pool
    q.submit([(b"big", big)])
    try:
        assert q.commit([b"m"]) is False
        q.submit([(b"big2", big)])
        assert q.commit([]) is False
    finally:
        log.removeHandler(handler)
    assert q.failures == 2
    assert sum("a save failed" in r.getMessage() for r in records) == 1
    assert be.exists_all([b"m"]) == [False]  # no marker without its pages
    q.close()
    be.close()
