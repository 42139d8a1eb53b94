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
fully allocated is written the default way, or not at all."""

from __future__ import annotations

import fcntl
import logging
import os
from typing import Any

from ..config import PREFIX, PoolConfigError
from ..security import fix_file_modes, prepare_pool_dir
from .base import PoolUnusable
from .generation import GenerationFile

logger = logging.getLogger("vllm.layerwise_patch")


def check_space(path: str, capacity: int) -> None:
    """The filesystem under ``path`` must be able to hold ``capacity`` bytes
    (what the pool already occupies counts as available)."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    try:
        used = os.stat(os.path.join(path, "data.mdb")).st_blocks * 512
    except FileNotFoundError:
        used = 0
    if free + used < capacity:
        raise PoolConfigError(
            f"{PREFIX}.capacity: {capacity} bytes do not fit the filesystem of "
            f"{path} ({free} bytes free, the pool holds {used}); lower the capacity or "
            "point path at a larger filesystem (a container's /dev/shm is 64 MB "
            "unless started with a larger --shm-size)")


def preallocate_file(data: str, size: int) -> bool:
    """Give the data file its whole size now: writes then land in pages the
    filesystem already has, and a filesystem filling up later cannot take
    them.  True when the first ``size`` bytes are allocated."""
    if os.stat(data).st_blocks * 512 >= size:
        return True
    fd = os.open(data, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
        logger.info("vllm-layerwise-patch pool: %s preallocated (%d bytes)", data, size)
        return True
    except OSError as exc:
        logger.warning("vllm-layerwise-patch pool: could not preallocate %s (%s); the "
                       "pool grows as it fills", data, exc)
        return False
    finally:
        os.close(fd)


#: the pool's databases (see .lmdb)
DATABASES = (b"data", b"groups", b"lru", b"pins")


def data_file(path: str) -> str:
    return os.path.join(path, "data.mdb")


def unbacked_growth(path: str, map_size: int) -> str | None:
    """A writemap pool grown by another engine: None when the file is
    allocated up to ``map_size`` (now), else why this engine must stop
    writing (logged)."""
    if preallocate_file(data_file(path), map_size):
        return None
    why = (f"the grown pool file cannot be allocated on the filesystem of {path}: this "
           "engine saves nothing more (restart it, or give the filesystem room)")
    logger.error("vllm-layerwise-patch pool: %s", why)
    return why


def file_size(path: str) -> int:
    try:
        return os.stat(data_file(path)).st_size
    except FileNotFoundError:
        return 0


def _open(path: str, capacity: int, file_mode: int, writemap: bool) -> tuple[Any, list]:
    """The environment and its databases' handles (created when absent).
    Never a map smaller than the file: with writemap LMDB truncates the file
    to the map, and another engine writing past that point would die of
    SIGBUS."""
    import lmdb

    env = None
    try:
        env = lmdb.open(path, map_size=max(capacity, file_size(path)), max_dbs=len(DATABASES),
                        subdir=True, lock=True, sync=False, metasync=False, readahead=False,
                        max_readers=256, mode=file_mode, writemap=writemap)
        _check_ours(env, path)
        return env, [env.open_db(name) for name in DATABASES]
    except (lmdb.Error, PoolUnusable) as exc:  # damaged, another LMDB's, not LMDB at all
        if env is not None:
            env.close()
        if isinstance(exc, PoolUnusable):
            raise
        raise PoolUnusable(f"{data_file(path)} cannot be opened by LMDB ({exc})") from None


def _check_ours(env: Any, path: str) -> None:
    """An LMDB environment holding anything but the pool's databases is
    another program's: nothing is written into it."""
    with env.begin() as txn:
        names = [bytes(k) for k, _ in zip(txn.cursor().iternext(values=False), range(16))]
    other = [n for n in names if n not in DATABASES]
    if other:
        raise PoolUnusable(f"{data_file(path)} is another program's LMDB (it holds "
                           f"{other[0]!r}), not a pool")


def open_environment(path: str, capacity: int, shared_group: str | None,
                     preallocate: bool) -> tuple[Any, list, GenerationFile, bool]:
    """The pool's LMDB environment, the handles of its :data:`DATABASES`, its
    generation file and whether it writes through ``writemap``: the
    directory prepared and checked before anything is read, the
    filesystem's room checked, the data file preallocated (then reopened
    with ``writemap``).  Processes starting together (engine core and
    workers) take a lock so they do not race to create the environment."""
    file_mode = prepare_pool_dir(path, shared_group)  # before anything is read
    check_space(path, capacity)
    fd = os.open(os.path.join(path, ".open.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW,
                 file_mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        env, dbs = _open(path, capacity, file_mode, writemap=False)
        gen = GenerationFile(os.path.join(path, "generation"), file_mode)
        fix_file_modes(path, shared_group)
        env.reader_check()
        writemap = False
        if preallocate and preallocate_file(data_file(path),
                                            max(capacity, env.info()["map_size"])):
            env.close()
            env, dbs = _open(path, capacity, file_mode, writemap=True)
            writemap = True
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    return env, dbs, gen, writemap
