"""Pool pieces without an engine: the value format, the LMDB backend (real
LMDB, several processes, eviction), the torch-only transfer pipeline, the
extra-config validation and the scheduler's lookup rules."""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types

import pytest
import torch

from vllm_layerwise_patch.pool.backends.base import CorruptEntry, PoolFull, pack, unpack
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.config import PoolConfig, PoolConfigError
from vllm_layerwise_patch.pool.keys import STATE, page_key
from vllm_layerwise_patch.pool.worker.pipeline import LayerwisePipeline, LoadError

NS = b"N" * 16


# -- value format --------------------------------------------------------------

def test_pack_unpack_roundtrip_and_each_corruption_kind():
    payload = bytes(range(256)) * 10
    v = pack(NS, b"k", payload)
    assert bytes(unpack(b"k", v, NS, expected_length=len(payload))) == payload
    flipped = bytearray(v)
    flipped[-5] ^= 1
    cases = {
        "checksum": bytes(flipped),
        "truncated": v[:-7],
        "foreign-namespace": pack(b"O" * 16, b"k", payload),
        "other-key": pack(NS, b"j", payload),
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
    for kind in ("truncated", "foreign-namespace", "bad-header", "other-key"):
        with pytest.raises(CorruptEntry) as e:
            unpack(b"k", cases[kind], NS, check_crc=False)
        assert e.value.kind == kind
    with pytest.raises(CorruptEntry, match="page is"):
        unpack(b"k", v, NS, expected_length=len(payload) + 1)


def test_values_are_never_pickles():
    v = pack(NS, b"k", b"\x80\x04K\x01.")
    assert v.startswith(b"VLPV")


# -- LMDB backend --------------------------------------------------------------

def _block(i, size=200_000, layers=2):
    """A block's group: its pages and its commit marker."""
    g = f"ns/attn/{i:04d}/tp0"
    keys = [f"{g}/L{j}".encode() for j in range(layers)] + [f"{g}/commit".encode()]
    return [(k, pack(NS, k, bytes(size if j < layers else 0))) for j, k in enumerate(keys)]


def _present(be, i, layers=2):
    g = f"ns/attn/{i:04d}/tp0"
    return be.exists_many([f"{g}/L{j}".encode() for j in range(layers)] + [f"{g}/commit".encode()])


def test_lmdb_put_get_exists_delete(tmp_path):
    be = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    be.put_many([(b"a", pack(NS, b"a", b"1")), (b"b", pack(NS, b"b", b"22"))])
    assert be.exists_many([b"a", b"b", b"c"]) == [True, True, False]
    got = be.get_many([b"b", b"c"])
    assert bytes(unpack(b"b", got[0], NS)) == b"22" and got[1] is None
    be.delete([b"a"])
    assert be.exists_many([b"a"]) == [False]
    be.close()


def test_payloads_are_cache_line_aligned_wherever_the_pool_lays_values_out(tmp_path):
    # A page copied from a payload a few bytes behind its (64-byte aligned)
    # destination runs at a quarter of memcpy below ~1 MiB; with the old
    # 40-byte header every LMDB payload sat 8 bytes behind its KV page.
    import ctypes

    from vllm_layerwise_patch.pool.backends.base import HEADER_SIZE
    from vllm_layerwise_patch.pool.backends.mooncake.staging import Staging
    from vllm_layerwise_patch.pool.worker.send_thread import PackArena

    def addr(view) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly \
            else torch.frombuffer(view, dtype=torch.uint8).data_ptr()

    sizes = [HEADER_SIZE + n for n in (160 << 10, 4096 + 8, 300 << 10)]
    be = LmdbBackend(str(tmp_path / "pool"), 64 << 20)
    be.put_many([(b"k%d" % i, pack(b"N" * 16, b"k%d" % i, bytes(n - HEADER_SIZE)))
                 for i, n in enumerate(sizes)])
    seen = []
    be.read_many([b"k0", b"k1", b"k2"], lambda i, k, v: seen.append(addr(v[HEADER_SIZE:])))
    assert [a % 64 for a in seen] == [0, 0, 0], "LMDB payloads"
    arena = PackArena(b"N" * 16)
    packed = [arena.pack(b"k", torch.zeros(n - HEADER_SIZE, dtype=torch.uint8)) for n in sizes]
    assert [addr(v[HEADER_SIZE:]) % 64 for v in packed] == [0, 0, 0], "packed values"
    keep = (ctypes.c_ubyte * (4 << 20))()
    staging = Staging(ctypes.addressof(keep), 4 << 20, 2, keep)
    ptrs = [p for _, _, run in staging.runs(staging.acquire(), sizes) for p in run]
    assert [(p + HEADER_SIZE) % 64 for p in ptrs] == [0, 0, 0], "Mooncake staging"
    be.close()


def test_pack_arena_values_of_any_size_up_to_and_over_a_chunk():
    # chunk-sized and larger pages get a chunk of their own (with room for
    # the offset that puts their payload on a cache line), smaller ones share
    import signal

    from vllm_layerwise_patch.pool.backends.base import HEADER_SIZE
    from vllm_layerwise_patch.pool.worker.send_thread import PackArena

    arena = PackArena(b"N" * 16)
    arena.CHUNK = 4096
    signal.alarm(20)  # a value that never fits must fail, not spin
    try:
        for n in (100, 4096 - HEADER_SIZE, 4096, 3 * 4096 + 5, 64):
            page = torch.arange(n, dtype=torch.int64).to(torch.uint8)
            value = arena.pack(b"k", page)
            assert bytes(unpack(b"k", value, b"N" * 16)) == bytes(page.numpy())
    finally:
        signal.alarm(0)


def test_lmdb_evicts_least_recently_used_whole_blocks(tmp_path):
    be = LmdbBackend(str(tmp_path / "p"), 4 << 20)
    be.put_many(_block(0))
    for i in range(1, 30):  # ~12 MB through a 4 MiB map
        be.put_many(_block(i))
        be.touch([b"ns/attn/0000/tp0"])  # block 0: the oldest insert, kept in use
    st = be.stats()
    assert st["evictions"] > 0 and st["evicted_groups"] > 0
    # LRU, not FIFO: the first block written but in use survived the evictions
    # that took the blocks written after it
    assert _present(be, 0) == [True] * 3
    assert _present(be, 1) == [False] * 3
    assert _present(be, 29) == [True] * 3
    # eviction works on whole blocks: never a marker without its pages (or
    # pages without their marker)
    for i in range(30):
        assert len(set(_present(be, i))) == 1, i
    be.close()


def test_lmdb_pinned_blocks_are_never_evicted_and_a_full_pool_skips(tmp_path):
    be = LmdbBackend(str(tmp_path / "p"), 2 << 20)
    be.put_many(_block(0))
    be.pin([b"ns/attn/0000/tp0"], 3600, owner=b"req-a")
    be.pin([b"ns/attn/0000/tp0"], 3600, owner=b"req-b")
    be.unpin([b"ns/attn/0000/tp0"], owner=b"req-a")  # req-b still loads it
    for i in range(1, 12):
        be.put_many(_block(i))
    assert _present(be, 0) == [True] * 3  # still pinned by req-b
    assert _present(be, 1) == [False] * 3
    be.unpin([b"ns/attn/0000/tp0"], owner=b"req-b")
    for i in range(12, 24):
        be.put_many(_block(i))
    assert _present(be, 0) == [False] * 3  # evictable once nobody pins it
    # every block pinned: no room is a PoolFull (a skipped save), not a crash
    with pytest.raises(PoolFull):
        for i in range(24, 40):
            be.put_many(_block(i))
            be.pin([f"ns/attn/{i:04d}/tp0".encode()], 3600)
    # an expired pin does not protect
    be2 = LmdbBackend(str(tmp_path / "q"), 2 << 20)
    be2.put_many(_block(0))
    be2.pin([b"ns/attn/0000/tp0"], 0.01)
    time.sleep(0.05)
    for i in range(1, 12):
        be2.put_many(_block(i))
    assert _present(be2, 0) == [False] * 3
    be.close()
    be2.close()


def test_lmdb_delete_groups_drops_pages_marker_and_pins(tmp_path):
    be = LmdbBackend(str(tmp_path / "p"), 16 << 20)
    for i in range(3):
        be.put_many(_block(i))
    be.pin([b"ns/attn/0001/tp0"], 3600)
    be.delete_groups([b"ns/attn/0001/tp0"])
    assert _present(be, 1) == [False] * 3
    assert _present(be, 0) == [True] * 3 and _present(be, 2) == [True] * 3
    assert be.stats()["groups"] == 2
    be.close()


def test_lmdb_is_safe_for_several_processes(tmp_path):
    path = str(tmp_path / "p")
    code = textwrap.dedent(f"""
        import sys
        from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
        from vllm_layerwise_patch.pool.backends.base import pack
        be = LmdbBackend({path!r}, 256 << 20)
        w = sys.argv[1]
        for i in range(200):
            key = f"{{w}}-{{i}}".encode()
            be.put_many([(key, pack(b"N" * 16, key, bytes([i % 256]) * 4096))])
        """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(w)]) for w in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    be = LmdbBackend(path, 256 << 20)
    keys = [f"{w}-{i}".encode() for w in range(3) for i in range(200)]
    assert all(be.exists_many(keys))
    vals = be.get_many([b"2-7"])
    assert bytes(unpack(b"2-7", vals[0], NS)) == bytes([7]) * 4096
    be.close()


def test_lmdb_engines_with_different_capacities_share_one_pool(tmp_path):
    # A second engine opens the path with a larger capacity and grows the
    # map; the first one adopts the grown map instead of failing
    # (MDB_MAP_RESIZED), and both keep reading and writing.
    path = str(tmp_path / "p")
    small = LmdbBackend(path, 4 << 20)
    small.put_many(_block(0))
    code = textwrap.dedent(f"""
        from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
        from vllm_layerwise_patch.pool.backends.base import pack
        be = LmdbBackend({path!r}, 32 << 20)
        for i in range(100, 160):
            g = f"ns/attn/{{i:04d}}/tp0"
            key = f"{{g}}/L0".encode()
            be.put_many([(key, pack(b"N" * 16, key, bytes(200_000)))])
        print(be.stats()["evictions"])
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split()[-1] == "0"  # 12 MB in a 32 MiB map: no eviction
    assert small.exists_many([b"ns/attn/0150/tp0/L0", b"ns/attn/0000/tp0/L0"]) == [True, True]
    small.put_many(_block(1))  # writes into the grown map
    assert small.map_size == 32 << 20
    assert _present(small, 1) == [True] * 3
    small.close()


def test_lmdb_reader_slot_of_a_killed_process_is_cleared(tmp_path):
    # A process SIGKILLed inside a read transaction leaves its reader slot,
    # which pins the pages of that snapshot: freed pages are never reused and
    # eviction frees nothing.  The backend clears such slots (LMDB's reader
    # check) before evicting, so the pool keeps evicting and saving.
    path = str(tmp_path / "p")
    be = LmdbBackend(path, 4 << 20)
    for i in range(8):
        be.put_many(_block(i))
    code = textwrap.dedent(f"""
        import time
        from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
        be = LmdbBackend({path!r}, 4 << 20)
        def hold(i, k, v):
            print("reading", flush=True)
            time.sleep(600)
        be.read_many([b"ns/attn/0000/tp0/L0"], hold)
        """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "reading"
    child.kill()
    child.wait()
    assert any(str(child.pid) in line for line in be.env.readers().splitlines())
    for i in range(8, 60):  # ~24 MB more through the 4 MiB map
        be.put_many(_block(i))
    assert _present(be, 59) == [True] * 3
    assert be.stats()["evictions"] > 0
    assert not any(str(child.pid) in line for line in be.env.readers().splitlines())
    be.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MiB tmpfs (needs root: mount)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_lmdb_capacity_larger_than_the_filesystem_is_a_startup_error(small_tmpfs):
    path = str(small_tmpfs / "pool")
    with pytest.raises(PoolConfigError) as e:
        LmdbBackend(path, 64 << 20)
    msg = str(e.value)
    assert "kv_connector_extra_config.capacity" in msg and path in msg
    assert "bytes free" in msg and str(64 << 20) in msg


def test_lmdb_filesystem_filling_up_at_runtime_skips_saves(small_tmpfs):
    # The pool fits at startup; then something else fills the filesystem
    # (a pool that did not take its space up front: preallocate=False).
    path = str(small_tmpfs / "pool")
    be = LmdbBackend(path, 2 << 20, preallocate=False)
    be.put_many(_block(0, size=100_000))
    with open(small_tmpfs / "other-file", "wb") as f:
        try:
            f.write(bytes(8 << 20))
        except OSError:
            pass  # filled the filesystem
    with pytest.raises(PoolFull, match="full"):
        for i in range(1, 20):
            be.put_many(_block(i, size=100_000))
    assert _present(be, 0) == [True] * 3  # what was stored is still readable
    be.close()


def test_lmdb_preallocated_pool_keeps_its_space_when_the_filesystem_fills(small_tmpfs):
    path = str(small_tmpfs / "pool")
    be = LmdbBackend(path, 2 << 20)  # preallocate=True: the default
    assert os.stat(os.path.join(path, "data.mdb")).st_blocks * 512 >= 2 << 20
    with open(small_tmpfs / "other-file", "wb") as f:
        try:
            f.write(bytes(12 << 20))
        except OSError:
            pass  # filled the filesystem
    for i in range(12):  # ~5 MB through the 2 MiB pool: evicts, never fails
        be.put_many(_block(i, size=100_000))
    assert _present(be, 11) == [True] * 3
    be.close()


class _OneTransactionEviction(LmdbBackend):
    """The eviction before the fix: a round in one transaction, no retry."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.eviction.CHUNK_BYTES = 1 << 62
        chunk = self.eviction._chunk

        def one_transaction(budget):
            import lmdb

            try:
                return chunk(budget)
            except lmdb.MapFullError as exc:
                raise RuntimeError(f"eviction commit failed: {exc}") from None

        self.eviction._chunk = one_transaction


@pytest.mark.parametrize("backend", [LmdbBackend, _OneTransactionEviction])
def test_lmdb_eviction_commits_in_a_full_large_map(backend):
    # A transaction that frees pages writes too (copies of the B-tree pages
    # it changes, the freed page numbers): one freeing 300 MiB of a full
    # 1 GiB map could not commit (MDB_MAP_FULL), and the pool never saved
    # again.  Eviction commits in chunks, halved while there is no room;
    # the negative control (one transaction per round) shows the failure.
    shm = tempfile.mkdtemp(prefix="vlp-test-evict-", dir="/dev/shm")
    try:
        be = backend(os.path.join(shm, "pool"), 1 << 30, evict_fraction=0.3, pin_seconds=0)
        page = pack(NS, b"page", os.urandom(160 << 10))  # (never read: one value for all)
        rounds = 0
        with contextlib.ExitStack() as stack:
            if backend is _OneTransactionEviction:
                stack.enter_context(pytest.raises(RuntimeError, match="MDB_MAP_FULL"))
            for i in range(700):  # 1.75 GB through the 1 GiB pool
                be.put_many([(page_key(NS, STATE, bytes([i % 256, i // 256]) * 16, 0, str(j)),
                              page) for j in range(16)])
                rounds = be.stats()["evictions"]
        if backend is LmdbBackend:
            assert rounds >= 2
        be.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# -- configuration -------------------------------------------------------------

def test_config_defaults_and_sizes():
    c = PoolConfig.from_extra({"capacity": "512MiB", "path": "/tmp/x"})
    assert c.capacity == 512 << 20 and c.prefetch_layers == 2
    assert PoolConfig.from_extra({"capacity": 1000}).capacity == 1000
    # units are spelled exactly: decimal and binary are different sizes
    sizes = {"4GB": 4 * 10**9, "4GiB": 4 << 30, "1TiB": 1 << 40, "2TB": 2 * 10**12,
             "512 kB": 512_000, "1.5MiB": 3 << 19, "64B": 64}
    for text, n in sizes.items():
        assert PoolConfig.from_extra({"capacity": text}).capacity == n, text
    for bad in ("4gb", "4G", "4 gigabytes", "MiB", "-1MiB", "0"):
        with pytest.raises(PoolConfigError, match="kv_connector_extra_config.capacity"):
            PoolConfig.from_extra({"capacity": bad})
    # per-user default path (resolved when the pool opens: .paths)
    from vllm_layerwise_patch.pool.directory.paths import default_path

    assert PoolConfig.from_extra(None).path is None
    assert default_path().endswith(f"vllm-layerwise-pool-{os.geteuid()}")


@pytest.mark.parametrize("extra,field", [
    ({"capacity": "lots"}, "capacity"), ({"capacity": -1}, "capacity"),
    ({"capacity": True}, "capacity"), ({"prefetch_layers": 0}, "prefetch_layers"),
    ({"load_threads": "2"}, "load_threads"), ({"pin_seconds": -1}, "pin_seconds"),
    ({"verify_on_lookup": "yes"}, "verify_on_lookup"), ({"path": ""}, "path"),
    ({"backend": "redis"}, "backend"), ({"capcity": "1GiB"}, "capcity"),
    ({"shared_group": ""}, "shared_group"),
    ({"pin_seconds": 0}, "pin_seconds"),
    # the tests' fault injection is no user setting (pool.faults)
    ({"debug_backend_fault": "load"}, "debug_backend_fault"),
    ({"debug_fail_load_layer": "model.layers.0.linear_attn"}, "debug_fail_load_layer"),
])
def test_config_errors_name_the_field(extra, field):
    with pytest.raises(PoolConfigError) as e:
        PoolConfig.from_extra(extra)
    assert f"kv_connector_extra_config.{field}" in str(e.value), str(e.value)


def test_test_faults_come_only_from_their_variable(monkeypatch):
    from vllm_layerwise_patch.pool import faults as f

    monkeypatch.delenv(f.FAULTS_ENV, raising=False)
    assert f.faults() == f.Faults() and not f.faults().active
    monkeypatch.setenv(f.FAULTS_ENV, '{"debug_fail_load_layer": "x", "load_delay_ms": 5}')
    got = f.faults()
    assert (got.fail_load_layer, got.load_delay_ms, got.active) == (
        "x", 5.0, ["fail_load_layer", "load_delay_ms"])
    for bad, key in (('{"debug_nope": 1}', "debug_nope"), ('{"hide_load_errors": 1}',
                     "hide_load_errors"), ('{"backend_fault": "disk"}', "backend_fault"),
                     ("[1]", "JSON object"), ("{", "not JSON")):
        with pytest.raises(ValueError, match=key):
            f.parse(bad)
    assert f.split({"path": "p", "debug_event_log": "e"}) == (
        {"path": "p"}, {"debug_event_log": "e"})


# -- the transfer pipeline (torch only) ------------------------------------------

class CountingBackend:
    """Wraps a real LmdbBackend, recording which layers' loads are in flight."""

    def __init__(self, inner, key_layer):
        self.inner, self.key_layer = inner, key_layer
        self.in_flight: set[str] = set()
        self.max_ahead = 0
        self.release = threading.Event()
        self.lock = threading.Lock()

    def read_many(self, keys, consume, sizes=None):
        from vllm_layerwise_patch.pool.backends.base import Backend

        Backend.read_many(self, keys, consume, sizes)  # the generic path, via get_many

    def get_many(self, keys, sizes=None):
        layer = self.key_layer[keys[0]]
        with self.lock:
            self.in_flight.add(layer)
            self.max_ahead = max(self.max_ahead, len(self.in_flight))
        try:
            return self.inner.get_many(keys)
        finally:
            with self.lock:
                self.in_flight.discard(layer)


def _pages(tmp_path, n_layers, n_blocks, size):
    """A real LMDB pool and zeroed KV pages: (backend, layer -> pages, layer order)."""
    caches = {f"model.layers.{i}.x": torch.zeros(n_blocks, size, dtype=torch.uint8)
              for i in range(n_layers)}
    return LmdbBackend(str(tmp_path / "p"), 64 << 20), caches, list(caches)


def test_pipeline_loads_every_layer_in_order_with_prefetch(tmp_path):
    be, caches, order = _pages(tmp_path, 6, 4, 1024)
    tasks, key_layer, expect = {}, {}, {}
    for li, layer in enumerate(order):
        for b in (1, 3):
            key = f"{layer}/{b}".encode()
            data = torch.randint(0, 256, (1024,), dtype=torch.uint8)
            be.put_many([(key, pack(NS, key, data.numpy().tobytes()))])
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


class _Fence:
    """The compute-start fence as the load threads see it (``synchronize``:
    block until compute reached the layer).  On a GPU it is a CUDA event the
    forward records (``record_compute_start``); on CPU there is no stream, so
    the test's consumer releases it by hand."""

    def __init__(self):
        self.reached = threading.Event()

    def synchronize(self):
        assert self.reached.wait(30)


@pytest.mark.parametrize("rule", ["fixed", "old-rule"])
def test_pipeline_load_seconds_is_the_transfer_without_the_fence_wait(tmp_path, rule):
    # 4 layers, each load taking DELAY (the pipeline's delay fault), prefetch
    # 2: layers 0 and 1 start at once; once the forward reaches layer 0, the
    # load of layer 2 is submitted behind the fence and waits until a slow
    # consumer - computing layer 0 for HOLD - lets it write.  load_seconds
    # counts the transfers (4 x DELAY), not the HOLD that load sat behind the
    # fence.  Negative control: the rule before the fix
    # (load_seconds_with_fence) counts the fence too.
    DELAY, HOLD = 0.05, 0.6
    be, caches, order = _pages(tmp_path, 4, 2, 256)
    tasks = {}
    for layer in order:
        key = f"{layer}/1".encode()
        be.put_many([(key, pack(NS, bytes(range(256))))])
        tasks[layer] = [(key, [caches[layer][1]])]
    pipe = LayerwisePipeline(order, be, NS, prefetch=2, threads=4, delay=DELAY,
                             fence_in_load_seconds=rule == "old-rule")
    pipe.start(tasks)
    fence = pipe._gate = _Fence()  # (what record_compute_start sets on a GPU)
    pipe.wait(order[0])  # submits layer 2, behind the fence
    time.sleep(HOLD)  # the slow consumer computes layer 0
    fence.reached.set()
    for layer in order[1:]:
        pipe.wait(layer)
        assert caches[layer][1].tolist() == list(range(256))
    transfer = 4 * DELAY
    if rule == "fixed":
        assert transfer * 0.9 <= pipe.load_seconds < transfer + HOLD / 2, pipe.load_seconds
    else:
        assert pipe.load_seconds >= transfer * 0.9 + HOLD * 0.9, pipe.load_seconds
    pipe.close()
    be.close()


def test_pipeline_surfaces_missing_and_corrupt_entries(tmp_path):
    be, caches, order = _pages(tmp_path, 2, 2, 64)
    be.put_many([(b"bad", pack(b"O" * 16, b"bad", bytes(64)))])
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
    be, caches, order = _pages(tmp_path, 2, 3, 64)
    good = torch.randint(1, 256, (64,), dtype=torch.uint8)
    be.put_many([(b"good", pack(NS, b"good", good.numpy().tobytes())),
                 (b"bad", pack(b"O" * 16, b"bad", bytes(64)))])
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
    got = sorted((layer, i, type(e).__name__) for layer, i, _k, e in pipe.failures)
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
    from vllm_layerwise_patch.pool.worker.send_thread import SaveQueue

    be = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    q = SaveQueue(be, NS)
    pages = torch.randint(0, 256, (2, 64), dtype=torch.uint8)
    q.submit([(b"keep", pages[0]), (b"drop", pages[1])])
    assert q.commit([b"m"], exclude={b"drop"}) is True
    assert be.exists_many([b"keep", b"drop", b"m"]) == [True, False, True]
    q.close()
    be.close()


# -- scheduler lookup rules ----------------------------------------------------

def _scheduler(tmp_path, *, layers=((0, "attn"), (1, "state")), verify=True, block=4,
               unit=None, role=None, load_async=False):
    from vllm_layerwise_patch.pool.layout import PoolLayout
    from vllm_layerwise_patch.pool.scheduler.planner import PoolScheduler

    kinds = tuple(k for _, k in layers)
    layout = PoolLayout(kinds=kinds,
                        group_layers=tuple((f"model.layers.{i}.x",) for i, _ in layers),
                        block_size=block, hash_block_size=unit or block)
    ktc = None
    if role is not None:
        from vllm.config import KVTransferConfig

        ktc = KVTransferConfig(kv_connector="LayerwisePoolConnector", kv_role=role)
    cfg = types.SimpleNamespace(kv_transfer_config=ktc)
    return PoolScheduler(vllm_config=cfg, layout=layout,
                         backend=LmdbBackend(str(tmp_path / "p"), 64 << 20), namespace=NS,
                         config=PoolConfig.from_extra({"verify_on_lookup": verify,
                                                       "load_async": load_async}))


def _step(new=(), scheduled=None):
    """A SchedulerOutput with ``new`` requests ((req_id, block ids, computed))
    scheduled ``scheduled[req_id]`` tokens each."""
    cached = types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                   num_computed_tokens=[])
    reqs = [types.SimpleNamespace(req_id=r, block_ids=ids, num_computed_tokens=c)
            for r, ids, c in new]
    return types.SimpleNamespace(scheduled_new_reqs=reqs, scheduled_cached_reqs=cached,
                                 num_scheduled_tokens=dict(scheduled or {}))


def _store(sched, hashes, blocks, kind):
    """Commit pool blocks ``blocks`` (named by ``hashes``) of ``kind``."""
    from vllm_layerwise_patch.pool.keys import marker_key, page_key

    items = []
    for i in blocks:
        items += [(page_key(NS, kind, hashes[i], 0, layer), b"x" * 8)
                  for layer in sched.hits.target[kind]]
        items.append((marker_key(NS, kind, hashes[i], 0), b""))
    sched.hits.backend.put_many([(k, pack(NS, k, v)) for k, v in items])


def _committed(sched, n):
    """The hashes of ``n`` blocks whose attention pages and boundary states
    ``sched``'s pool now holds."""
    from vllm_layerwise_patch.pool.keys import ATTN, STATE

    hashes = [bytes([i]) * 8 for i in range(n)]
    _store(sched, hashes, range(n), ATTN)
    _store(sched, hashes, range(n), STATE)
    return hashes


def _req(hashes, num_tokens, rid="r"):
    return types.SimpleNamespace(block_hashes=hashes, num_tokens=num_tokens, request_id=rid)


@pytest.fixture
def stored(tmp_path):
    """A scheduler (block 4 tokens, one attention and one state layer) and
    the hashes of 4 blocks whose attention pages and boundary states are all
    committed."""
    sched = _scheduler(tmp_path)
    return sched, _committed(sched, 4)


def test_lookup_ends_at_the_last_stored_boundary_state(tmp_path):
    from vllm_layerwise_patch.pool.keys import ATTN, STATE, marker_key

    sched = _scheduler(tmp_path)
    hashes = [bytes([i]) * 8 for i in range(5)]
    req = _req(hashes, 5 * 4 + 2)
    assert sched.hits.lookup(req, 0) == 0  # empty pool
    _store(sched, hashes, range(5), ATTN)
    assert sched.hits.lookup(req, 0) == 0  # attention alone is not a hybrid hit
    _store(sched, hashes, [1, 3], STATE)
    assert sched.hits.lookup(req, 0) == 4  # state at the end of block 3
    assert sched.hits.lookup(req, 8) == 4  # beyond a local hit of 2 blocks
    assert sched.hits.lookup(req, 16) == 0  # cannot beat a local hit of 4
    # a full-prompt hit leaves one token to compute
    exact = _req(hashes[:4], 16)
    assert sched.hits.lookup(exact, 0) == 2  # cap (16-1)//4 = 3 blocks; state after block 1
    # first attention miss stops the walk
    sched.hits.backend.delete([marker_key(NS, ATTN, hashes[2], 0)])
    assert sched.hits.lookup(req, 0) == 2


def test_lookup_names_blocks_by_the_hash_at_their_last_unit(tmp_path):
    # prefix_match_unit a quarter of the block: 4 hashes per pool block.
    # Pool block i is named by hashes[4i+3], the one covering exactly
    # [0, (i+1)*block); a prompt sharing only the first unit of a stored
    # block (same hashes[0], different hashes[3]) must not hit it.
    from vllm_layerwise_patch.pool.keys import ATTN, STATE

    sched = _scheduler(tmp_path, block=8, unit=2)
    stored = [bytes([1, i]) * 4 for i in range(12)]  # 3 blocks, 24 tokens
    names = [stored[4 * i + 3] for i in range(3)]
    _store(sched, names, range(3), ATTN)
    _store(sched, names, range(3), STATE)
    assert sched.hits.lookup(_req(stored, 25), 0) == 3
    # shares units 0..4 (one block and one unit): one block
    other = stored[:5] + [bytes([2, i]) * 4 for i in range(5, 12)]
    assert sched.hits.lookup(_req(other, 25), 0) == 1
    # shares only the first unit: nothing
    first = stored[:1] + [bytes([3, i]) * 4 for i in range(1, 12)]
    assert sched.hits.lookup(_req(first, 25), 0) == 0
    # a request hashed at another granularity than the layout says: no lookup
    assert sched.hits.lookup(_req(stored[:6], 25), 0) == 0


def _mtp_scheduler(tmp_path, rule="next-token"):
    """Block 4 tokens; attention layer 0, state layer 1, drafter layer mtp.0."""
    from vllm_layerwise_patch.pool.layout import PoolLayout
    from vllm_layerwise_patch.pool.scheduler.planner import PoolScheduler

    layout = PoolLayout(kinds=("attn", "state"), block_size=4, hash_block_size=4,
                        group_layers=(("model.layers.0.x", "mtp.layers.0.x"),
                                      ("model.layers.1.x",)))
    return PoolScheduler(vllm_config=types.SimpleNamespace(kv_transfer_config=None),
                         layout=layout, backend=LmdbBackend(str(tmp_path / "p"), 64 << 20),
                         namespace=NS, config=PoolConfig.from_extra({"draft_hit_rule": rule}))


def _store_mtp(sched, hashes, tokens, blocks):
    """Commit blocks with the drafter's pages keyed by the token after each."""
    from vllm_layerwise_patch.pool.keys import (ATTN, STATE, draft_marker_key,
                                                draft_page_key, marker_key, page_key)

    keys = []
    for i in blocks:
        tok = tokens[(i + 1) * 4]
        keys += [page_key(NS, ATTN, hashes[i], 0, "0"), marker_key(NS, ATTN, hashes[i], 0),
                 draft_page_key(NS, hashes[i], 0, "mtp.0", tok),
                 draft_marker_key(NS, hashes[i], 0, tok),
                 page_key(NS, STATE, hashes[i], 0, "1"), marker_key(NS, STATE, hashes[i], 0)]
    sched.hits.backend.put_many([(k, pack(NS, k, b"" if b"/commit" in k else b"x" * 8))
                                 for k in keys])


def test_drafter_pages_hit_whole_blocks_when_the_next_token_matches(tmp_path):
    sched = _mtp_scheduler(tmp_path)
    assert sched.hits.drafter == ["mtp.0"]
    hashes = [bytes([i]) * 8 for i in range(4)]
    tokens = list(range(100, 117))  # 17 tokens: 4 blocks + 1
    _store_mtp(sched, hashes, tokens, range(4))
    same = types.SimpleNamespace(block_hashes=hashes, num_tokens=17, request_id="r",
                                 all_token_ids=tokens)
    assert sched.hits.lookup(same, 0) == 4  # no blanket trim
    # continues differently after block 3 (token 16): block 3's drafter page
    # is another token's, so the hit ends one block earlier
    other = types.SimpleNamespace(block_hashes=hashes, num_tokens=17, request_id="q",
                                  all_token_ids=tokens[:16] + [999])
    assert sched.hits.lookup(other, 0) == 3
    # the old rule: one block off every hit
    trim = _mtp_scheduler(tmp_path / "trim", rule="trim")
    _store_mtp(trim, hashes, ["any"] * 17, range(4))
    assert trim.hits.lookup(same, 0) == 3 and trim.hits.lookup(other, 0) == 3


def test_repeated_lookups_of_a_cached_prefix_make_no_backend_call(stored):
    sched, hashes = stored
    req = _req(hashes, 4 * 4 + 1, rid="r1")
    assert sched.get_num_new_matched_tokens(req, 0) == (16, False)
    before = dict(sched.hits.backend.calls)
    for _ in range(5):  # vLLM asks again while the request waits for KV space
        assert sched.get_num_new_matched_tokens(req, 0) == (16, False)
    assert dict(sched.hits.backend.calls) == before
    # another request, same prefix: cached markers and verification
    other = _req(hashes, 4 * 4 + 1, rid="r2")
    assert sched.get_num_new_matched_tokens(other, 0) == (16, False)
    assert {k: v - before.get(k, 0) for k, v in sched.hits.backend.calls.items()
            if v != before.get(k, 0)} == {"pin": 1}  # its own pins only


def test_a_block_another_process_saves_after_a_cached_miss_hits_next_time(stored):
    sched, hashes = stored
    more = hashes + [bytes([9]) * 8]
    req = _req(more, 5 * 4 + 1)
    assert sched.hits.lookup(req, 0) == 4  # block 4 is a (cached) miss
    assert sched.hits.lookup(req, 0) == 4
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = {sys.path!r}
        from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
        from vllm_layerwise_patch.pool.backends.base import pack
        from vllm_layerwise_patch.pool.keys import ATTN, STATE, marker_key, page_key
        be = LmdbBackend({sched.hits.backend.path!r}, 64 << 20)
        h, ns = {more[4]!r}, {NS!r}
        be.put_many([(k, pack(ns, k, v)) for k, v in (
            (page_key(ns, ATTN, h, 0, "0"), b"x" * 8), (marker_key(ns, ATTN, h, 0), b""),
            (page_key(ns, STATE, h, 0, "1"), b"x" * 8), (marker_key(ns, STATE, h, 0), b""))])
        """)
    subprocess.run([sys.executable, "-c", code], check=True)
    assert sched.hits.lookup(req, 0) == 5


def test_an_evicted_block_is_never_a_hit_from_the_cache(stored):
    sched, hashes = stored
    req = _req(hashes, 4 * 4 + 1)
    assert sched.hits.lookup(req, 0) == 4 and sched.hits.lookup(req, 0) == 4  # cached
    from vllm_layerwise_patch.pool.keys import ATTN, group_key

    sched.hits.backend.delete_groups([group_key(NS, ATTN, hashes[2], 0)])  # as eviction does
    assert sched.hits.lookup(req, 0) == 2


def test_eight_requests_sharing_a_prefix_read_each_key_once_per_step(tmp_path):
    # The worker's loads of one step: 8 requests loading the same 2 blocks
    # into their own pages; each key is read once and fills all 8 pages.
    from vllm_layerwise_patch.pool.layout import PoolLayout
    from vllm_layerwise_patch.pool.metadata import LoadSpec, PoolMetadata
    from vllm_layerwise_patch.pool.worker.forward import PoolWorker

    layout = PoolLayout(kinds=("attn", "state"), block_size=4, hash_block_size=4,
                        group_layers=(("model.layers.0.x",), ("model.layers.1.x",)))
    worker = PoolWorker(vllm_config=None, layout=layout, namespace=NS,
                        backend=LmdbBackend(str(tmp_path / "p"), 64 << 20),
                        config=PoolConfig.from_extra({}))
    worker.pages.register({n: torch.zeros(40, 64, dtype=torch.uint8) for n in layout.order})
    hashes = [b"a" * 8, b"b" * 8]
    loads = [LoadSpec(f"r{i}", 0, 2, hashes, {0: [2 + 4 * i, 3 + 4 * i]}, {1: 3 + 4 * i}, {})
             for i in range(8)]
    tasks = worker.loads.tasks(PoolMetadata(loads, []), bulk=False)
    assert [len(tasks[n]) for n in layout.order] == [2, 1]  # distinct keys
    assert all(len(dests) == 8 for items in tasks.values() for _, dests in items)
    assert worker.loads.owners["model.layers.1.x"] == [[f"r{i}" for i in range(8)]]


def test_lookup_verification_shortens_the_hit_and_drops_the_block(stored):
    from vllm_layerwise_patch.pool.keys import ATTN, STATE, marker_key, page_key

    sched, hashes = stored
    req = _req(hashes, 4 * 4 + 1)
    assert sched.hits.lookup(req, 0) == 4
    key = page_key(NS, STATE, hashes[3], 0, "1")
    sched.hits.backend.put_many([(key, pack(NS, key, b"x" * 8)[:-3])])  # truncated state, block 3
    assert sched.hits.lookup(req, 0) == 3
    # the whole block's state group went, marker included: it can be saved again
    assert sched.hits.backend.exists_many([key, marker_key(NS, STATE, hashes[3], 0)]) == [False] * 2
    key = page_key(NS, ATTN, hashes[1], 0, "0")
    sched.hits.backend.put_many([(key, pack(b"O" * 16, key, b"x" * 8))])  # foreign attention page
    assert sched.hits.lookup(req, 0) == 1
    assert sched.log.seen == {"truncated", "foreign-namespace"}
    # a page that vanished (its marker stayed): the marker is dropped too
    sched.hits.backend.delete([page_key(NS, ATTN, hashes[0], 0, "0")])
    assert sched.hits.lookup(req, 0) == 0
    assert sched.hits.backend.exists_many([marker_key(NS, ATTN, hashes[0], 0)]) == [False]


def test_a_hit_pins_and_refreshes_what_its_load_reads(stored):
    # The scheduler pins every group a reported hit's load reads (all TP
    # ranks' attention pages of the loaded blocks, the boundary state of
    # the last one); the request's end releases them.
    from vllm_layerwise_patch.pool.keys import ATTN, STATE, group_key

    sched, hashes = stored
    req = _req(hashes[:3], 3 * 4 + 1, rid="req-1")
    assert sched.get_num_new_matched_tokens(req, 4) == (8, False)
    pinned = sorted(sched.pins.held["req-1"][0])
    load = {group_key(NS, ATTN, hashes[1], 0), group_key(NS, ATTN, hashes[2], 0),
            group_key(NS, STATE, hashes[2], 0)}
    # pinned before they were verified, and nothing else (pinning refreshes)
    assert set(pinned) == load
    be = sched.hits.backend
    now = struct.pack(">d", time.time())
    with be._txn() as txn:
        assert all(be._pinned(txn, g, now) for g in pinned)
        assert not be._pinned(txn, group_key(NS, ATTN, hashes[0], 0), now)
    with be._txn() as txn:  # refreshed: the pinned groups are the most recent
        newest = [bytes(k[8:]) for k, _ in txn.cursor(db=be.lru)][-len(pinned):]
    assert sorted(newest) == pinned
    sched.request_finished(req)
    with be._txn() as txn:
        assert not any(be._pinned(txn, g, now) for g in pinned)


def test_a_backend_error_in_a_lookup_is_a_miss(stored, caplog):
    from vllm_layerwise_patch.pool.backends.base import FaultInjectingBackend

    sched, hashes = stored
    req = _req(hashes[:3], 3 * 4 + 1)
    assert sched.get_num_new_matched_tokens(req, 0) == (12, False)
    sched.hits.backend = FaultInjectingBackend(sched.hits.backend, "lookup")
    with caplog.at_level("WARNING", logger="vllm.layerwise_patch"):
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sum("a lookup failed" in r.getMessage() for r in caplog.records) == 1


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


@pytest.mark.parametrize("device", [None, "cpu", "meta"])
def test_save_queue_commits_pages_and_markers_in_one_transaction(tmp_path, device):
    """Host pages (no device, or CPU) are packed in the caller's thread;
    pages on another device by the send thread (``meta`` stands in for a GPU
    here: no event to wait for, the pages themselves are host tensors)."""
    from vllm_layerwise_patch.pool.worker.send_thread import SaveQueue

    be = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    q = SaveQueue(be, NS)
    packed_by, pack = [], q._arena.pack
    q._arena.pack = lambda key, page: (packed_by.append(threading.current_thread().name)
                                       or pack(key, page))
    pages = torch.randint(0, 256, (3, 512), dtype=torch.uint8)
    dev = torch.device(device) if device else None
    q.submit([(b"p0", pages[0]), (b"p1", pages[1])], dev)
    q.submit([(b"p2", pages[2])], dev)
    assert be.exists_many([b"p0", b"m"]) == [False, False]  # nothing before commit
    assert q.commit([b"m"]) is True
    assert be.exists_many([b"p0", b"p1", b"p2", b"m"]) == [True] * 4
    got = be.get_many([b"p2"])[0]
    assert bytes(unpack(b"p2", got, NS)) == pages[2].numpy().tobytes()
    assert q.bytes_saved > 3 * 512
    assert packed_by == ["vlp-send" if device == "meta" else "MainThread"] * 3
    # where the save's time went: writing is part of it, the thread's CPU time is counted
    assert 0 < q.write_seconds <= q.seconds
    assert 0 < q.cpu_seconds
    q.close()
    be.close()


def test_save_queue_full_pool_and_failures_are_counted_not_raised(tmp_path):
    import logging

    from vllm_layerwise_patch.pool.backends.base import FaultInjectingBackend
    from vllm_layerwise_patch.pool.worker.send_thread import SaveQueue

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("vllm.layerwise_patch")
    log.addHandler(handler)

    be = LmdbBackend(str(tmp_path / "p"), 1 << 20)
    q = SaveQueue(be, NS)
    big = torch.zeros(700_000, dtype=torch.uint8)  # more than half the pool: no room
    failing = SaveQueue(FaultInjectingBackend(be, "save"), NS)
    small = torch.zeros(1000, dtype=torch.uint8)
    try:
        for _ in range(2):
            q.submit([(b"big", big)])
            assert q.commit([b"m"]) is False
            failing.submit([(b"small", small)])
            assert failing.commit([b"m2"]) is False
    finally:
        log.removeHandler(handler)
    assert (q.skipped, q.failures) == (2, 0)
    assert (failing.skipped, failing.failures) == (0, 2)
    messages = [r.getMessage() for r in records]
    assert sum("no room for this step's saves" in m for m in messages) == 1
    assert sum("a save failed" in m for m in messages) == 1
    assert be.exists_many([b"m", b"m2", b"small"]) == [False] * 3  # no marker without pages
    q.close()
    failing.close()
    be.close()


# -- kv_role and asynchronous loads (scheduler side) --------------------------------

@pytest.mark.parametrize("role", [None, "kv_both", "kv_consumer", "kv_producer"])
def test_kv_role_decides_lookups_and_saves(tmp_path, role):
    # kv_consumer loads but plans no save; kv_producer saves but every lookup
    # answers 0 without a backend call; kv_both (and no kv_transfer_config,
    # as in these tests) does both.
    from vllm_layerwise_patch.pool.keys import ATTN, STATE

    sched = _scheduler(tmp_path, role=role)
    loads = role != "kv_producer"
    saves = role != "kv_consumer"
    hashes = [bytes([i]) * 8 for i in range(3)]
    new = _req(hashes, 3 * 4 + 1, rid="new")
    assert sched.get_num_new_matched_tokens(new, 0) == (0, False)  # empty pool
    meta = sched.build_connector_meta(_step([("new", ([1, 2, 3], [4, 5, 6]), 0)],
                                            {"new": 8}))
    assert bool(meta.saves) == saves, meta.saves
    if saves:  # blocks 0 and 1 completed, the state at their end (8 tokens)
        assert [a.hash for a in meta.saves[0].attn] == hashes[:2]
        assert [h for h, _ in meta.saves[0].mamba] == [hashes[1]]
    _store(sched, hashes, range(3), ATTN)
    _store(sched, hashes, range(3), STATE)
    before = dict(sched.hits.backend.calls)
    got = sched.get_num_new_matched_tokens(_req(hashes, 3 * 4 + 1, rid="hit"), 0)
    assert got == ((12, False) if loads else (0, False))
    assert (dict(sched.hits.backend.calls) != before) == loads


def test_async_hit_is_loaded_outside_the_forward_and_keeps_its_pins(tmp_path):
    # load_async: the hit is answered (n, True); its load goes to the
    # workers as an asynchronous load (not one of the step's forward loads);
    # its pins outlive a request that ends while the load is in flight and
    # are released once the workers report it done.
    from vllm_layerwise_patch.pool.keys import ATTN, STATE, group_key

    sched = _scheduler(tmp_path, load_async=True)
    hashes = _committed(sched, 3)
    req = _req(hashes, 3 * 4 + 1, rid="a")
    assert sched.get_num_new_matched_tokens(req, 4) == (8, True)
    blocks = types.SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 0], [0, 0, 11, 0]))
    sched.update_state_after_alloc(req, blocks, 8)
    meta = sched.build_connector_meta(_step())  # the request is parked: nothing scheduled
    assert meta.loads == [] and len(meta.async_loads) == 1
    spec = meta.async_loads[0]
    assert (spec.start, spec.end, spec.hashes) == (1, 3, hashes[1:3])
    assert spec.attn_blocks == {0: [8, 9]} and spec.mamba_blocks == {1: 11}
    assert sched.build_connector_meta(_step()).async_loads == []  # handed over once
    pinned = sorted([group_key(NS, ATTN, hashes[1], 0), group_key(NS, ATTN, hashes[2], 0),
                     group_key(NS, STATE, hashes[2], 0)])
    be = sched.hits.backend
    now = struct.pack(">d", time.time())

    def pins():
        with be._txn() as txn:
            return [g for g in pinned if be._pinned(txn, g, now)]

    sched.request_finished(req)  # aborted while its load is in flight
    assert pins() == pinned
    sched.update_connector_output(types.SimpleNamespace(finished_recving={"a"}))
    assert pins() == []


def test_failed_async_load_is_not_looked_up_again(tmp_path):
    sched = _scheduler(tmp_path, load_async=True)
    hashes = _committed(sched, 3)
    req = _req(hashes, 3 * 4 + 1, rid="a")
    assert sched.get_num_new_matched_tokens(req, 0) == (12, True)
    sched.update_connector_output(types.SimpleNamespace(
        finished_recving={"a"}, failed_recving={"a"}, invalid_block_ids=set()))
    # vLLM's recompute policy starts it again from token 0: no pool hit
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_save_queue_reserve_prefaults_the_pack_memory_the_first_save_uses(tmp_path):
    from vllm_layerwise_patch.pool.worker.send_thread import SaveQueue

    be = LmdbBackend(str(tmp_path / "p"), 64 << 20)
    q = SaveQueue(be, NS)
    assert q._arena._chunks == []  # lazily allocated unless reserved
    q.reserve()
    (chunk,) = q._arena._chunks
    q.submit([(b"p0", torch.ones(4096, dtype=torch.uint8))])
    assert q.commit([b"m"]) is True
    assert q._arena._chunks == [chunk]  # the first save packed into the reserved chunk
    q.close()
    be.close()


def test_a_request_reloaded_after_a_preemption_pins_again(stored):
    # The workers release a load's pins once it has read the pool; when vLLM
    # preempts the request and looks it up again, its hit must be pinned
    # anew (the scheduler's own record of the old pins is no proof).
    sched, hashes = stored
    req = _req(hashes, 4 * 4 + 1, rid="re")
    assert sched.get_num_new_matched_tokens(req, 0) == (16, False)
    pins = sched.hits.backend.calls["pin"]
    assert sched.get_num_new_matched_tokens(req, 0) == (16, False)  # still waiting
    assert sched.hits.backend.calls["pin"] == pins
    blocks = types.SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5], [0, 0, 0, 6, 0]))
    sched.update_state_after_alloc(req, blocks, 16)
    assert sched.get_num_new_matched_tokens(req, 0) == (16, False)  # after a preemption
    assert sched.hits.backend.calls["pin"] == pins + 1


@pytest.mark.parametrize("rule", ["fixed", "old-rule"])
def test_a_request_reloaded_after_its_async_load_pins_again(tmp_path, monkeypatch, rule):
    # load_async: the workers release a load's pins once it is done; when
    # vLLM preempts the request soon after (within pin_seconds/2 of the last
    # pin) and looks it up again, its hit must be pinned in the pool anew.
    # Negative control (async_pins_kept, the rule before the fix): the
    # scheduler's record of the released pins answers the re-lookup and the
    # hit it serves is not pinned.
    from vllm_layerwise_patch.pool.faults import FAULTS_ENV
    from vllm_layerwise_patch.pool.keys import ATTN, group_key
    from vllm_layerwise_patch.pool.metadata import load_groups, owner_of

    if rule == "old-rule":
        monkeypatch.setenv(FAULTS_ENV, '{"debug_async_pins_kept": true}')
    sched = _scheduler(tmp_path, load_async=True)
    hashes = _committed(sched, 3)
    be = sched.hits.backend
    req = _req(hashes, 3 * 4 + 1, rid="a")
    wanted = sorted(group_key(NS, ATTN, h, 0) for h in hashes) + [
        group_key(NS, STATE, hashes[2], 0)]

    def pinned():
        now = struct.pack(">d", time.time())
        with be._txn() as txn:
            return sorted(g for g in wanted if be._pinned(txn, g, now))

    assert sched.get_num_new_matched_tokens(req, 0) == (12, True)
    blocks = types.SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 0], [0, 0, 11, 0]))
    sched.update_state_after_alloc(req, blocks, 12)
    (spec,) = sched.build_connector_meta(_step()).async_loads
    assert pinned() == sorted(wanted)
    # the worker (rank 0, the only one) read the hit and releases its pins
    # (worker.loads.WorkerLoads.release_pins), then reports the load done
    be.unpin(load_groups(NS, spec.hashes, [0], True), owner_of("a"))
    assert pinned() == []
    sched.update_connector_output(types.SimpleNamespace(finished_recving={"a"}))
    # preempted at once; looked up again: the same hit
    assert sched.get_num_new_matched_tokens(req, 0) == (12, True)
    assert pinned() == (sorted(wanted) if rule == "fixed" else [])


@pytest.mark.parametrize("rule", ["fixed", "old-rule"])
@pytest.mark.parametrize("tp,failing", [(1, {0}), (2, {0, 1}), (2, {1})])
def test_figures_per_request_count_once_per_engine_whatever_the_tp_size(tmp_path, rule, tp,
                                                                        failing):
    # One step of an engine at TP=1 or TP=2 through vLLM's own aggregation:
    # every rank loaded request "a"'s hit (12 tokens) and committed 2 blocks,
    # and the asynchronous load of request "b" failed on the ranks
    # ``failing``.  vLLM's KVOutputAggregator sums the workers' stats and
    # reports b's failure once; the scheduler side adds its counts; the log
    # line (PoolStats.reduce) must read the same at TP=2 as at TP=1.
    # Negative control (stats_every_rank, the rule before the fix): every
    # rank reports them, vLLM's sums double at TP=2.
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput

    from vllm_layerwise_patch.pool.scheduler.stats import SchedulerSideStats
    from vllm_layerwise_patch.pool.stats import PoolStats, worker_share

    every_rank = rule == "old-rule"
    sched = _scheduler(tmp_path, load_async=True)
    hashes = _committed(sched, 3)
    req = _req(hashes, 3 * 4 + 1, rid="b")
    assert sched.get_num_new_matched_tokens(req, 0) == (12, True)
    blocks = types.SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 0], [0, 0, 11, 0]))
    sched.update_state_after_alloc(req, blocks, 12)
    sched.build_connector_meta(_step())
    side = SchedulerSideStats(lambda: sched.stats, sched.hits.backend, 4,
                              failures=not every_rank)
    side.take()  # (what the lookups counted so far)

    def worker(rank):
        data = {"hit_tokens": 12, "blocks_saved": 2, "bytes_loaded": 4096,
                "load_failures": int(rank in failing)}
        stats = PoolStats(data=worker_share(data, rank, every_rank)).sample_step()
        return types.SimpleNamespace(kv_connector_output=KVConnectorOutput(
            kv_connector_stats=stats, finished_recving={"b"},
            failed_recving={"b"} if rank in failing else set()))

    out = KVOutputAggregator(tp).aggregate([worker(r) for r in range(tp)]).kv_connector_output
    assert out.failed_recving == {"b"}
    sched.update_connector_output(out)  # (as vLLM's scheduler hands it over)
    stats, own = out.kv_connector_stats, side.take()
    stats = (stats.aggregate(own) if own is not None else stats).reduce()
    got = (stats["External hit tokens loaded"], stats["Blocks saved"],
           stats["Requests with failed loads"])
    if rule == "fixed" or tp == 1:
        assert got == (12, 2, 1)
    else:
        assert got == (24, 4, len(failing))


def test_the_scheduler_counts_each_failed_load_once(stored):
    # a load in a forward fails: vLLM hands the scheduler the failed block
    # ids (in that step's output; a later step's output may name them
    # again) - one failed request; then vLLM fails request "z" by policy
    # 'fail' (finished, no longer tracked) before it hands the scheduler the
    # output that reports z's failed asynchronous load - counted too.
    sched, hashes = stored
    req = _req(hashes, 4 * 4 + 1, rid="s")
    assert sched.get_num_new_matched_tokens(req, 0) == (16, False)
    blocks = types.SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5], [0, 0, 0, 6, 0]))
    sched.update_state_after_alloc(req, blocks, 16)
    ids = blocks.get_block_ids()
    assert len(sched.build_connector_meta(_step([("s", ids, 0)], {"s": 17})).loads) == 1
    for _ in range(2):
        sched.update_connector_output(types.SimpleNamespace(invalid_block_ids={2, 6}))
    assert sched.stats["load_failures"] == 1
    sched.update_connector_output(types.SimpleNamespace(finished_recving={"z"},
                                                        failed_recving={"z"}))
    assert sched.stats["load_failures"] == 2


@pytest.mark.parametrize("attr", ["prompt_logprobs", "skip_reading_prefix_cache"])
def test_a_request_vllm_serves_without_its_cache_is_neither_looked_up_nor_pinned(stored,
                                                                                  attr):
    sched, hashes = stored
    req = _req(hashes, 4 * 4 + 1, rid="nocache")
    if attr == "prompt_logprobs":
        req.sampling_params = types.SimpleNamespace(prompt_logprobs=1)
    else:
        req.skip_reading_prefix_cache = True
    before = dict(sched.hits.backend.calls)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert dict(sched.hits.backend.calls) == before and "nocache" not in sched.pins.held
    # the same request otherwise: a hit (the test can fail)
    assert sched.get_num_new_matched_tokens(_req(hashes, 4 * 4 + 1, rid="x"), 0) == (16, False)


def test_a_failed_load_taints_its_request_and_blocks_until_the_scheduler_saw_it():
    # The worker's account (worker.quarantine): the failed request, and any request
    # holding a block the failed load wrote, saves nothing - across steps -
    # until the step metadata reports the failure handled; a healthy save of
    # a block a tainted one also saves loses that block (no marker without
    # its pages).  Unit level; the e2e test is test_pool_async_sched.py.
    from vllm_layerwise_patch.pool.metadata import AttnSave, LoadSpec, SaveSpec
    from vllm_layerwise_patch.pool.worker.quarantine import Quarantine

    q = Quarantine()
    load = LoadSpec("a", 0, 2, [b"h0", b"h1"], {0: [5, 6]}, {1: 7}, {})
    q.failed([load], {"a"})
    step = [SaveSpec("a", [AttnSave(b"h2", {0: 8})], [], [5, 6, 8]),
            SaveSpec("b", [AttnSave(b"h3", {0: 9})], [], [5, 6, 9]),  # hit a's blocks
            SaveSpec("c", [AttnSave(b"h2", {0: 10}), AttnSave(b"h4", {0: 11})],
                     [(b"h4", {1: 12})], [10, 11, 12])]  # same block h2 as a
    healthy, bad = q.split(step)
    assert [s.req_id for s in bad] == ["a", "b"]
    assert [(s.req_id, [x.hash for x in s.attn], [h for h, _ in s.mamba])
            for s in healthy] == [("c", [b"h4"], [b"h4"])]
    # a later step, before the scheduler saw it: still tainted (b's new block 13
    # is poisoned through b), c healthy
    later = [SaveSpec("a", [AttnSave(b"h5", {0: 13})], [], [13]),
             SaveSpec("d", [AttnSave(b"h6", {0: 14})], [], [9, 14])]
    healthy, bad = q.split(later)
    assert [s.req_id for s in bad] == ["a", "d"] and healthy == []
    q.seen(["a"])
    assert not q and q.split(later) == (later, [])


@pytest.mark.parametrize("verify", [True, False])
def test_a_removal_between_the_walk_and_the_pin_shortens_the_hit(tmp_path, verify):
    # Another process removes block 2 after the lookup read the markers (the
    # hit cache holds them, and with verification the checked pages) but
    # before the pin: the hit must end before it - by reading the pages
    # (verify_on_lookup) or by asking the markers again - both under the
    # generation noted after the pin.
    from vllm_layerwise_patch.pool.keys import ATTN, group_key

    def remove(sched, hashes):
        return lambda *_: sched.hits.backend.delete_groups([group_key(NS, ATTN, hashes[2], 0)])

    sched = _scheduler(tmp_path, verify=verify)
    hashes = _committed(sched, 4)
    req = _req(hashes, 4 * 4 + 1)
    assert sched.hits.lookup(req, 0) == 4  # cached now
    assert sched.hits.lookup(req, 0, pin=remove(sched, hashes)) == 2
    assert sched.hits.lookup(req, 0) == 2
    # negative control: the generation not noted again after the pin - the
    # cache answers with the walk's generation and the removed block is a hit
    stale = _scheduler(tmp_path / "stale", verify=verify)
    hashes = _committed(stale, 4)
    assert stale.hits.lookup(req, 0) == 4
    noted = stale.hits.note_generation

    def once():
        noted()
        stale.hits.note_generation = lambda: None
    stale.hits.note_generation = once
    assert stale.hits.lookup(req, 0, pin=remove(stale, hashes)) == 4
