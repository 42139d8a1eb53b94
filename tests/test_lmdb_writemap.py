"""The LMDB pool writes through ``writemap`` only when its data file is
fully allocated, and never lets LMDB truncate the file under another engine
(with writemap, LMDB truncates the file to the map size at open; a process
writing past the new end dies of SIGBUS).  Real LMDB, real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from vllm_layerwise_patch.pool.backends.lmdb import files as lmdb_files
from vllm_layerwise_patch.pool.backends.base import PoolFull
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend

MiB = 1 << 20


def test_preallocated_pool_writes_through_writemap_and_others_do_not(tmp_path):
    for prealloc, expected in ((True, True), (False, False)):
        be = LmdbBackend(str(tmp_path / f"pool-{prealloc}"), 8 * MiB, preallocate=prealloc)
        assert be.writemap is expected and be.stats()["writemap"] == int(expected)
        be.put_many([(b"g/a", b"x" * 300_000), (b"g/b", b"y" * 10)])
        assert be.get_many([b"g/a", b"g/b"]) == [b"x" * 300_000, b"y" * 10]
        be.close()


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=300)


_WRITER = """
    import os, sys, time
    from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
    be = LmdbBackend({path!r}, 16 << 20)
    assert be.writemap
    print("opened", flush=True)
    while not os.path.exists({go!r}):
        time.sleep(0.02)
    for i in range(12):  # ~12 MiB: past the smaller engine's 4 MiB
        be.put_many([(b"w%d/p" % i, bytes([i]) * (1 << 20))])
    assert be.get_many([b"w11/p"])[0] == bytes([11]) * (1 << 20)
    print("wrote", os.stat(os.path.join({path!r}, "data.mdb")).st_size, flush=True)
"""

_SMALLER = """
    import os
    from vllm_layerwise_patch.pool.backends.lmdb import files as lmdb_files
    from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
    if {legacy}:  # negative control: open with the configured capacity only
        lmdb_files.file_size = lambda path: 0
    be = LmdbBackend({path!r}, 4 << 20)
    print("size", os.stat(os.path.join({path!r}, "data.mdb")).st_size, flush=True)
"""


@pytest.mark.parametrize("legacy", [False, True], ids=["map-never-below-file", "legacy"])
def test_a_smaller_engine_never_truncates_the_file_under_a_writer(tmp_path, legacy):
    """A writemap engine with a 16 MiB pool is open; an engine with a 4 MiB
    capacity opens the same path; the first then fills 12 MiB.  The file
    must keep its 16 MiB and the writer must live.  Negative control (the
    map sized from the capacity alone): the file is cut to 4 MiB and the
    writer dies of SIGBUS."""
    path, go = str(tmp_path / "pool"), str(tmp_path / "go")
    writer = subprocess.Popen([sys.executable, "-c",
                               textwrap.dedent(_WRITER.format(path=path, go=go))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "opened"
        smaller = _child(_SMALLER.format(path=path, legacy=legacy))
        assert smaller.returncode == 0, smaller.stderr[-3000:]
        size = int(smaller.stdout.split("size ")[-1])
        open(go, "w").close()
        out, err = writer.communicate(timeout=300)
    finally:
        writer.kill()
    if legacy:
        assert size == 4 * MiB
        assert writer.returncode == -signal.SIGBUS, (writer.returncode, err[-2000:])
    else:
        assert size == 16 * MiB
        assert writer.returncode == 0, err[-3000:]
        assert "wrote 16777216" in out


def test_a_grown_file_the_filesystem_cannot_back_stops_saves_not_the_engine(
        tmp_path, monkeypatch):
    """Another engine grows the pool; with writemap this engine must have the
    grown file allocated before writing into it.  When that fails (the
    filesystem is full: injected here), saves are refused as PoolFull, with
    the reason, and reads go on."""
    path = str(tmp_path / "pool")
    be = LmdbBackend(path, 4 * MiB)
    be.put_many([(b"a/p", b"a" * 100_000)])
    big = _child(f"""
        from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
        be = LmdbBackend({path!r}, 32 << 20, preallocate=False)
        for i in range(8):
            be.put_many([(b"b%d/p" % i, b"b" * (1 << 20))])
    """)
    assert big.returncode == 0, big.stderr[-3000:]
    assert os.stat(os.path.join(path, "data.mdb")).st_size > 4 * MiB
    monkeypatch.setattr(lmdb_files, "preallocate_file", lambda data, size: False)
    assert be.get_many([b"b7/p"]) == [b"b" * MiB]  # adopts the grown map to read
    with pytest.raises(PoolFull, match="cannot be allocated"):
        be.put_many([(b"c/p", b"c" * 100)])
    assert be.get_many([b"a/p"]) == [b"a" * 100_000]
    be.close()


class _CountingEnv:
    """An LMDB environment whose ``set_mapsize`` calls are counted."""

    def __init__(self, env) -> None:
        self._env, self.remaps = env, 0

    def set_mapsize(self, size):
        self.remaps += 1
        return self._env.set_mapsize(size)

    def __getattr__(self, name):
        return getattr(self._env, name)


@pytest.mark.parametrize("old", [False, True], ids=["fixed", "control-always-remap"])
def test_a_full_map_is_evicted_without_remapping_it(tmp_path, monkeypatch, old):
    # LMDB's set_mapsize remaps the file even at the same size, and every
    # page then faults in again (a sharded pool's small shards fill often):
    # a full map whose file did not grow is evicted, never remapped
    be = LmdbBackend(str(tmp_path / "pool"), 8 * MiB)
    assert be.writemap
    if old:  # (the control: the map adopted as before, whether the file grew or not)
        def adopt_always(self):
            with self._gate.exclusive():
                before = self.env.info()["map_size"]
                self.env.set_mapsize(max(before, lmdb_files.file_size(self._files)))
                self.map_size = self.env.info()["map_size"]
            return self.map_size > before

        monkeypatch.setattr(LmdbBackend, "_adopt_map", adopt_always)
    be.env = env = _CountingEnv(be.env)
    for i in range(40):
        be.put_many([(b"g%d/a" % i, os.urandom(500_000))])
    assert be.evictions > 0
    assert be.get_many([b"g39/a"])[0] is not None
    if old:
        assert env.remaps >= be.evictions
    else:
        assert env.remaps == 0
    be.close()
