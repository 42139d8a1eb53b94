"""The pool's generation: two 64-bit counters in a small file mapped into
every process that uses an LMDB pool - the LMDB transaction id of the last
write that stored entries, and of the last that removed any.  Writers set
them after their transaction committed; a reader notes them *before* it
reads, and a later change tells it that presence may have changed since -
without a system call, so a cache of lookups can stay exact across
processes (transaction ids only grow, so the value always changes when a
write commits after the reader noted it)."""

from __future__ import annotations

import mmap
import os
import struct

_PAIR = struct.Struct("<QQ")


class GenerationFile:
    def __init__(self, fd: int) -> None:
        """``fd``: the file, open read-write (checked by the caller; it may
        be closed once this returns)."""
        if os.fstat(fd).st_size < _PAIR.size:
            os.pwrite(fd, bytes(_PAIR.size), 0)
        # the page behind the map exists now: a store into it can never
        # meet a full filesystem (on tmpfs that would be SIGBUS)
        os.posix_fallocate(fd, 0, _PAIR.size)
        self._map = mmap.mmap(fd, _PAIR.size, mmap.MAP_SHARED)

    def read(self) -> tuple[int, int]:
        """(last store, last removal)."""
        return _PAIR.unpack_from(self._map, 0)

    def stored(self, txn_id: int) -> None:
        struct.pack_into("<Q", self._map, 0, txn_id)

    def removed(self, txn_id: int) -> None:
        struct.pack_into("<Q", self._map, 8, txn_id)

    def close(self) -> None:
        self._map.close()
