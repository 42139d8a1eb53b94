"""The LMDB pool's environment, data file and filesystem: opening it safely
when several processes start together, a capacity the filesystem cannot hold
refused at startup, and the file given its whole capacity up front."""

from __future__ import annotations

import fcntl
import logging
import os
from typing import Any

from ..config import PREFIX, PoolConfigError
from ..security import fix_file_modes, prepare_pool_dir
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


def preallocate_file(data: str, size: int) -> None:
    """Give the data file its whole size now: writes then land in pages the
    filesystem already has (about twice as fast on tmpfs), and a
    filesystem filling up later cannot take them."""
    if os.stat(data).st_blocks * 512 >= size:
        return
    fd = os.open(data, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
        logger.info("vllm-layerwise-patch pool: %s preallocated (%d bytes)", data, size)
    except OSError as exc:
        logger.warning("vllm-layerwise-patch pool: could not preallocate %s (%s); the "
                       "pool grows as it fills", data, exc)
    finally:
        os.close(fd)


def open_environment(path: str, capacity: int, shared_group: str | None,
                     preallocate: bool) -> tuple[Any, GenerationFile]:
    """The pool's LMDB environment (its four databases created) and its
    generation file: the directory prepared and checked before anything is
    read, the filesystem's room checked, the data file preallocated.
    Processes starting together (engine core and workers) take a lock so
    they do not race to create the environment."""
    import lmdb

    file_mode = prepare_pool_dir(path, shared_group)  # before anything is read
    check_space(path, capacity)
    fd = os.open(os.path.join(path, ".open.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW,
                 file_mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        env = lmdb.open(path, map_size=capacity, max_dbs=4, subdir=True, lock=True,
                        sync=False, metasync=False, readahead=False, max_readers=256,
                        mode=file_mode)
        for name in (b"data", b"groups", b"lru", b"pins"):
            env.open_db(name)
        gen = GenerationFile(os.path.join(path, "generation"), file_mode)
        fix_file_modes(path, shared_group)
        env.reader_check()
        if preallocate:
            preallocate_file(os.path.join(path, "data.mdb"), max(capacity, env.info()["map_size"]))
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    return env, gen
