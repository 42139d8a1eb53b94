"""The hit cache is never stale across processes (real LMDB, real processes,
no engine): a removal moves the pool's generation before it becomes visible,
so a writer SIGKILLed between its commit and settling the generation leaves
no cached hit behind; a deleted and recreated generation file is noticed by
readers and writers; pools of builds with another value header are other
namespaces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import types

import pytest

from vllm_layerwise_patch.pool.backends.base import pack
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.config import PoolConfig
from vllm_layerwise_patch.pool.faults import FAULTS_ENV
from vllm_layerwise_patch.pool.keys import ATTN, STATE, group_key, marker_key, page_key

NS = b"N" * 16
CAPACITY = 8 << 20
BLOCKS = 4


HASHES = [bytes([i]) * 8 for i in range(BLOCKS)]


def _store(backend, ns: bytes = NS, value=pack) -> None:
    """Commit BLOCKS blocks (one attention and one state layer) of ``ns``,
    each value ``value(ns, key, payload)`` (as this build writes it)."""
    items = []
    for h in HASHES:
        for kind, layer in ((ATTN, "0"), (STATE, "1")):
            items += [(page_key(ns, kind, h, 0, layer), b"x" * 8),
                      (marker_key(ns, kind, h, 0), b"")]
    backend.put_many([(k, value(ns, k, v)) for k, v in items])


def _scheduler(path, ns: bytes = NS, store: bool = True):
    """Block 4 tokens, one attention and one state layer; BLOCKS blocks
    committed (``store``).  Returns the scheduler and a request covering them."""
    from vllm_layerwise_patch.pool.layout import PoolLayout
    from vllm_layerwise_patch.pool.scheduler.planner import PoolScheduler

    layout = PoolLayout(kinds=(ATTN, STATE), block_size=4, hash_block_size=4,
                        group_layers=(("model.layers.0.x",), ("model.layers.1.x",)))
    sched = PoolScheduler(vllm_config=types.SimpleNamespace(kv_transfer_config=None),
                          layout=layout, backend=LmdbBackend(path, CAPACITY), namespace=ns,
                          config=PoolConfig.from_extra({}))
    if store:
        _store(sched.hits.backend, ns)
    req = types.SimpleNamespace(block_hashes=HASHES, num_tokens=BLOCKS * 4 + 1,
                                request_id="r")
    return sched, req


def _cached_lookup(sched, req) -> tuple[int, int]:
    """(hit blocks, backend calls the lookup made)."""
    before = sum(sched.hits.backend.calls.values())
    k = sched.hits.lookup(req, 0)
    return k, sum(sched.hits.backend.calls.values()) - before


WRITER = """
import sys
sys.path[:0] = {syspath!r}
from vllm_layerwise_patch.pool.backends.base import pack
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
be = LmdbBackend({path!r}, {capacity})
print("ready", flush=True)
sys.stdin.readline()
if {how!r} == "delete":
    be.delete_groups([{group!r}])
else:  # evict: fill the pool until its oldest groups (the reader's) go
    for i in range(64):
        key = b"fill/%04d/tp0/L0" % i
        be.put_many([(key, pack({ns!r}, key, bytes(512 << 10)))])
print("done", flush=True)
"""


def _writer(path, how, group, faults=None):
    """Another process on the pool; it acts once :func:`_go` is called."""
    env = dict(os.environ)
    env.pop(FAULTS_ENV, None)
    if faults:
        env[FAULTS_ENV] = json.dumps(faults)
    code = WRITER.format(syspath=sys.path, path=path, capacity=CAPACITY, how=how,
                         group=group, ns=NS)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _go(proc) -> tuple[int, str]:
    out, _ = proc.communicate("go\n", timeout=120)
    return proc.returncode, out


@pytest.mark.parametrize("how, order, expect", [
    ("delete", "fixed", 2),  # block 2's attention group went: the hit ends before it
    ("evict", "fixed", 0),  # every block of the reader went (the oldest groups)
    # negative control: the generation moved only after the commit (the order
    # before the fix) - the killed writer never moved it, the cached hit stays
    ("delete", "late", BLOCKS),
])
def test_a_writer_killed_between_a_removal_and_its_generation_bump(tmp_path, how, order,
                                                                     expect):
    path = str(tmp_path / "pool")
    sched, req = _scheduler(path)
    assert _cached_lookup(sched, req)[0] == BLOCKS
    assert _cached_lookup(sched, req) == (BLOCKS, 0)  # from the hit cache
    faults = {"kill_after_removal_commit": True, "late_removal_bump": order == "late"}
    writer = _writer(path, how, group_key(NS, ATTN, req.block_hashes[2], 0), faults)
    rc, out = _go(writer)
    assert rc == -signal.SIGKILL and "done" not in out  # killed inside the removal
    assert sched.hits.backend.exists_many([marker_key(NS, ATTN, req.block_hashes[2], 0)]) == [False]
    assert _cached_lookup(sched, req)[0] == expect
    if order == "late" or expect == 0:  # (a miss is cached whatever the removals)
        return
    # the killed writer left the removal counter odd: hits are not cached
    # (each lookup asks the pool) until the next store settles it
    assert _cached_lookup(sched, req)[1] > 0
    sched.hits.backend.put_many([(b"other/tp0/L0", pack(NS, b"other/tp0/L0", b"y"))])
    assert _cached_lookup(sched, req)[1] > 0
    assert _cached_lookup(sched, req) == (expect, 0)


def test_a_recreated_generation_file_is_noticed_by_readers_and_writers(tmp_path):
    # The reader and a writer map the generation file; it is deleted and the
    # reader's next lookup creates it again.  The reader must drop what it
    # cached under the old file, and the writer - still mapping the old
    # one - must move the new one when it removes a block.
    path = str(tmp_path / "pool")
    sched, req = _scheduler(path)
    assert _cached_lookup(sched, req)[0] == BLOCKS
    writer = _writer(path, "delete", group_key(NS, ATTN, req.block_hashes[2], 0))
    assert _cached_lookup(sched, req) == (BLOCKS, 0)
    os.unlink(os.path.join(path, "generation"))
    k, calls = _cached_lookup(sched, req)
    assert (k, calls > 0) == (BLOCKS, True)  # a new file: nothing cached holds
    assert os.path.exists(os.path.join(path, "generation"))
    assert _cached_lookup(sched, req) == (BLOCKS, 0)  # cached under the new file
    assert _go(writer) == (0, "done\n")
    assert _cached_lookup(sched, req)[0] == 2


def _description() -> dict:
    """A namespace description of this build (a model that does not exist)."""
    from vllm_layerwise_patch.pool.identity.namespace import namespace_description
    from vllm_layerwise_patch.pool.layout import PoolLayout

    layout = PoolLayout(kinds=(ATTN,), block_size=4, hash_block_size=4,
                        group_layers=(("model.layers.0.x",),))
    vc = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=None, model="/nonexistent",
                                           revision=None, quantization=None, dtype="bf16"),
        cache_config=types.SimpleNamespace(cache_dtype="auto",
                                           prefix_caching_hash_algo="sha256"))
    return namespace_description(vc, types.SimpleNamespace(kv_cache_groups=[]), layout)


def test_pools_of_builds_with_another_value_header_are_other_namespaces():
    # The value header went to version 3 under key format 3, the format of
    # the version-2 builds: those builds and this one shared namespaces, and
    # each dropped the other's groups as damaged.  The header's version is
    # now part of the format every namespace covers.
    from vllm_layerwise_patch.pool.backends.base import VERSION
    from vllm_layerwise_patch.pool.identity.namespace import FORMAT

    described = _description()
    assert described["format"] == FORMAT != 3
    assert VERSION in FORMAT


def _format3_value(ns: bytes, key: bytes, payload: bytes) -> bytes:
    """A value as the builds of value format 3 wrote it: its header names no
    key (8 bytes of padding where the key digest is now)."""
    import struct

    from vllm_layerwise_patch.pool.backends.base import CHECKSUMS, WRITE_CHECKSUM

    return struct.pack("<4sBBHQQ8x16s", b"VLPV", 3, WRITE_CHECKSUM, 0, len(payload),
                       CHECKSUMS[WRITE_CHECKSUM](payload), ns) + payload


def test_an_lmdb_pool_written_before_values_named_their_keys_is_never_read(tmp_path):
    # Value format 4 puts the key's digest in every header; the entries a
    # format-3 build wrote (which a wrong slot could pass for) live under
    # other namespaces: a pool written before starts empty once.  Fails on
    # the format-3 build: its namespace is this one.
    from vllm_layerwise_patch.pool import admin
    from vllm_layerwise_patch.pool.identity.namespace import namespace_of
    from vllm_layerwise_patch.pool.keys import KEY_VERSION

    described = _description()
    new, old = namespace_of(described), namespace_of(dict(described, format=[KEY_VERSION, 3]))
    assert old != new
    sched, req = _scheduler(str(tmp_path / "pool"), ns=new, store=False)
    be = sched.hits.backend
    _store(be, old, _format3_value)  # what the format-3 build left in the pool
    assert be.exists_many([marker_key(old, ATTN, HASHES[0], 0)]) == [True]
    assert sched.hits.lookup(req, 0) == 0  # never read: another namespace
    # `pool verify` lists them (its --drop empties the pool of them)
    damaged = admin.verify(be)["damaged"]
    assert len(damaged) == 2 * BLOCKS and {d["kind"] for v in damaged.values() for d in v} \
        == {"bad-header"}
    # and were one under this build's keys, its header is refused
    _store(be, new, _format3_value)
    assert sched.hits.lookup(req, 0) == 0 and sched.log.seen == {"bad-header"}
    # negative control: this build's values under the same keys are hits
    _store(be, new)
    assert sched.hits.lookup(req, 0) == BLOCKS
