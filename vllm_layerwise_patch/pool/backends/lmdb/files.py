"""The LMDB pool's environment, data file and filesystem: opening it safely
when several processes start together, a capacity the filesystem cannot hold
refused at startup, and the file given its whole capacity up front.

A fully preallocated data file is then written through LMDB's ``writemap``:
values are copied once, straight into the mapped file, where the default
mode copies each into malloc'd pages and writes those into the file at
commit (on tmpfs the write then costs ~1.1x a memcpy's time instead of
~4.9x once the pool's pages have been touched; ``benchmarks/bench_pipeline.py``).
Only then: with ``writemap``, a write into a part of the file the
filesystem cannot back is a SIGBUS, not an error - so a file that is not (or can no longer be)
fully allocated is written the default way, or not at all.

LMDB opens its files by name.  It is given a private directory whose
``data.mdb`` and ``lock.mdb`` are links to ``/proc/self/fd/N`` of the files
this process opened and checked (:mod:`..directory.descriptors`), so it maps exactly
those: a file swapped for a link in a shared pool directory between the
check and LMDB's open cannot make it truncate or write another file."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import shutil
import tempfile
from typing import Any

from ...config import PREFIX, PoolConfigError
from ...directory.descriptors import PoolDir, open_pool_dir
from ..base import PoolUnusable
from ..generation import GenerationFile
from .shards import read_record

logger = logging.getLogger("vllm.layerwise_patch")


@dataclasses.dataclass
class PoolFiles:
    """The pool directory and LMDB's two files, open for the backend's life
    (closing a descriptor of ``lock.mdb`` would drop LMDB's locks on it)."""
    dir: PoolDir
    data_fd: int
    lock_fd: int

    @property
    def path(self) -> str:
        return self.dir.path

    def close(self) -> None:
        for fd in (self.data_fd, self.lock_fd):
            os.close(fd)
        self.dir.close()


def check_space(pool: PoolDir, capacity: int, used: int | None = None) -> None:
    """The filesystem under the pool must be able to hold ``capacity`` bytes
    (what the pool already occupies, ``used`` or its data file, counts as
    available)."""
    st = os.fstatvfs(pool.fd)
    free = st.f_bavail * st.f_frsize
    if used is None:
        data = pool.existing("data.mdb")
        used = data.st_blocks * 512 if data is not None else 0
    if free + used < capacity:
        raise PoolConfigError(
            f"{PREFIX}.capacity: {capacity} bytes do not fit the filesystem of "
            f"{pool.path} ({free} bytes free, the pool holds {used}); lower the capacity or "
            "point path at a larger filesystem (a container's /dev/shm is 64 MB "
            "unless started with a larger --shm-size)")


def preallocate_file(files: PoolFiles, size: int) -> bool:
    """Give the data file its whole size now: writes then land in pages the
    filesystem already has, and a filesystem filling up later cannot take
    them.  True when the first ``size`` bytes are allocated."""
    if os.fstat(files.data_fd).st_blocks * 512 >= size:
        return True
    data = os.path.join(files.path, "data.mdb")
    try:
        os.posix_fallocate(files.data_fd, 0, size)
        logger.info("vllm-layerwise-patch pool: %s preallocated (%d bytes)", data, size)
        return True
    except OSError as exc:
        logger.warning("vllm-layerwise-patch pool: could not preallocate %s (%s); the "
                       "pool grows as it fills", data, exc)
        return False


#: the pool's databases (see .lmdb)
DATABASES = (b"data", b"groups", b"lru", b"pins")


def unbacked_growth(files: PoolFiles, map_size: int) -> str | None:
    """A writemap pool grown by another engine: None when the file is
    allocated up to ``map_size`` (now), else why this engine must stop
    writing (logged)."""
    if preallocate_file(files, map_size):
        return None
    why = (f"the grown pool file cannot be allocated on the filesystem of {files.path}: "
           "this engine saves nothing more (restart it, or give the filesystem room)")
    logger.error("vllm-layerwise-patch pool: %s", why)
    return why


def file_size(files: PoolFiles) -> int:
    return os.fstat(files.data_fd).st_size


@contextlib.contextmanager
def _lmdb_view(files: PoolFiles):
    """A directory only this process uses, whose LMDB files are the checked
    descriptors (the pool directory itself without ``/proc``)."""
    if not os.path.isdir(f"/proc/{os.getpid()}/fd"):  # pragma: no cover - Linux has it
        logger.warning("vllm-layerwise-patch pool: no /proc: LMDB opens the pool files by "
                       "name (a shared pool's member could swap them between the check and "
                       "the open)")
        yield files.path
        return
    view = tempfile.mkdtemp(prefix="vlp-lmdb-")
    try:
        for name, fd in (("data.mdb", files.data_fd), ("lock.mdb", files.lock_fd)):
            os.symlink(f"/proc/{os.getpid()}/fd/{fd}", os.path.join(view, name))
        yield view
    finally:
        shutil.rmtree(view, ignore_errors=True)


def _open(files: PoolFiles, capacity: int, writemap: bool) -> tuple[Any, list]:
    """The environment and its databases' handles (created when absent).
    Never a map smaller than the file: with writemap LMDB truncates the file
    to the map, and another engine writing past that point would die of
    SIGBUS."""
    import lmdb

    env = None
    data = os.path.join(files.path, "data.mdb")
    view = ""
    try:
        with _lmdb_view(files) as view:
            env = lmdb.open(view, map_size=max(capacity, file_size(files)),
                            max_dbs=len(DATABASES), subdir=True, lock=True, sync=False,
                            metasync=False, readahead=False, max_readers=256,
                            mode=files.dir.file_mode, writemap=writemap)
        _check_ours(env, data)
        return env, [env.open_db(name) for name in DATABASES]
    except (lmdb.Error, PoolUnusable) as exc:  # damaged, another LMDB's, not LMDB at all
        if env is not None:
            env.close()
        if isinstance(exc, PoolUnusable):
            raise
        why = str(exc).replace(view, files.path) if view else str(exc)
        raise PoolUnusable(f"{data} cannot be opened by LMDB ({why})") from None


def _check_ours(env: Any, data: str) -> None:
    """An LMDB environment holding anything but the pool's databases is
    another program's: nothing is written into it."""
    with env.begin() as txn:
        names = [bytes(k) for k, _ in zip(txn.cursor().iternext(values=False), range(16))]
    other = [n for n in names if n not in DATABASES]
    if other:
        raise PoolUnusable(f"{data} is another program's LMDB (it holds {other[0]!r}), "
                           "not a pool")


def open_environment(path: str, capacity: int, shared_group: str | None,
                     preallocate: bool, pool_dir: PoolDir | None = None
                     ) -> tuple[Any, list, GenerationFile, bool, PoolFiles]:
    """The pool's LMDB environment, the handles of its :data:`DATABASES`, its
    generation file, whether it writes through ``writemap``, and its open
    files: the directory prepared and checked before anything is read, the
    filesystem's room checked, the data file preallocated (then reopened
    with ``writemap``).  Processes starting together (engine core and
    workers) take a lock so they do not race to create the environment.
    ``pool_dir``: the directory, already open and checked (a shard's, which
    is then the backend's to close).  A directory that records several
    shards (:mod:`.shards`) is a sharded pool's top: refused."""
    pool = pool_dir or open_pool_dir(path, shared_group)  # before anything is read
    fds: list[int] = []  # .open.lock (its flock goes with it), data, lock
    try:
        recorded = read_record(pool)
        if recorded is not None and recorded > 1:
            raise PoolUnusable(f"{pool.path} is a sharded pool ({recorded} shards): it is "
                               "opened as a whole (kv_connector_extra_config.path, or the "
                               "pool command), not as one LMDB environment")
        check_space(pool, capacity)
        fds.append(pool.open(".open.lock"))
        fcntl.flock(fds[0], fcntl.LOCK_EX)
        for name in ("data.mdb", "lock.mdb"):
            fds.append(pool.open(name))
        files = PoolFiles(pool, fds[1], fds[2])
        env, dbs = _open(files, capacity, writemap=False)
        gen = GenerationFile(os.path.join(pool.path, "generation"), pool.file_mode,
                             opener=lambda: pool.open("generation"))
        env.reader_check()
        writemap = False
        if preallocate and preallocate_file(files, max(capacity, env.info()["map_size"])):
            env.close()
            env, dbs = _open(files, capacity, writemap=True)
            writemap = True
    except BaseException:
        for fd in reversed(fds):
            os.close(fd)
        pool.close()
        raise
    os.close(fds[0])
    return env, dbs, gen, writemap, files
