"""The LMDB pool's data file and its filesystem: a capacity the filesystem
cannot hold is refused at startup, and the file can take its whole capacity
up front."""

from __future__ import annotations

import logging
import os

from ..config import PREFIX, PoolConfigError

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
