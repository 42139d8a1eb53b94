"""The pool's generation: two 64-bit counters in a small file mapped into
every process that uses an LMDB pool - how many times entries were stored,
and removed (or replaced), by any process.  A reader notes them *before* it
reads the pool, and a later change tells it that presence may have changed
since - with one ``stat`` and no backend call, so a cache of lookups can
stay exact across processes.

A write moves its counter twice: to an odd value inside its transaction,
before the commit makes it visible, and to the next even value after the
commit.  So a reader that noted the counter before the commit sees it
change whatever happens next; an odd counter says a write may be committed
and not yet settled - a writer killed in between leaves it odd, and the
pool's next store or removal settles it (one write transaction runs at a
time: an odd counter found inside one belongs to a transaction that has
ended).  Readers cache no presence under an odd removal counter.  Every
change is a read-modify-write under a lock on the file, so concurrent
writers never lose one another's moves.

The file is checked by identity (device and inode) at every read and
write: a generation file deleted and created again is noticed, mapped
afresh and counted as a new *epoch*, so nothing noted under the old file
matches a generation of the new one.
"""

from __future__ import annotations

from collections.abc import Callable

import contextlib
import fcntl
import mmap
import os
import signal
import struct
import threading
from typing import NamedTuple

from ..faults import faults

_PAIR = struct.Struct("<QQ")
STORES, REMOVALS = 0, 8  # the counters' offsets


class Generation(NamedTuple):
    #: this process's count of generation files it has mapped (a deleted and
    #: recreated file is a new epoch)
    epoch: int
    #: writes that stored entries (odd: one may be committed and not settled)
    stores: int
    #: writes that removed or replaced entries (odd: likewise)
    removals: int

    @property
    def removals_settled(self) -> bool:
        return self.removals % 2 == 0


class GenerationFile:
    def __init__(self, path: str, mode: int = 0o600,
                 opener: Callable[[], int] | None = None) -> None:
        """``opener`` (the pool directory's checked open, never through a
        link) gives the file, read-write, each time it is (re)opened; by
        default ``path`` is opened without following a link."""
        self.path, self.mode = path, mode
        self._opener = opener or (lambda: os.open(
            self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, self.mode))
        self.epoch = 0
        self._lock = threading.Lock()  # (flock does not exclude this process's threads)
        self._fd, self._map, self._ident = self._open()

    def _open(self) -> tuple[int, mmap.mmap, tuple[int, int]]:
        fd = self._opener()
        try:
            st = os.fstat(fd)
            if st.st_size < _PAIR.size:  # created now (or by a process killed at once)
                os.pwrite(fd, bytes(_PAIR.size), 0)
                with contextlib.suppress(OSError):  # the pool's file mode, whatever the umask
                    os.fchmod(fd, self.mode)
            # the page behind the map exists now: a store into it can never
            # meet a full filesystem (on tmpfs that would be SIGBUS)
            os.posix_fallocate(fd, 0, _PAIR.size)
            return fd, mmap.mmap(fd, _PAIR.size, mmap.MAP_SHARED), (st.st_dev, st.st_ino)
        except BaseException:
            os.close(fd)
            raise

    def _same_file(self) -> bool:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._ident

    def _current(self) -> mmap.mmap:
        """The map of the file now at the path: a deleted or replaced file is
        opened (created) again, under a new epoch."""
        if not self._same_file():
            with self._lock:
                if not self._same_file():
                    old = self._fd
                    # (the old map stays valid for a thread still reading it)
                    self._fd, self._map, self._ident = self._open()
                    self.epoch += 1
                    os.close(old)
        return self._map

    def read(self) -> Generation:
        stores, removals = _PAIR.unpack_from(self._current(), 0)
        return Generation(self.epoch, stores, removals)

    def _change(self, offset: int, step, checked: bool = False) -> int:
        """``step(value)`` -> new value or None, applied under the file's
        lock; returns the value in place afterwards.  ``checked``: the
        caller has just checked the file's identity (one ``stat``)."""
        if not checked:
            self._current()
        with self._lock:
            m, fd = self._map, self._fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                (value,) = struct.unpack_from("<Q", m, offset)
                new = step(value)
                if new is not None:
                    struct.pack_into("<Q", m, offset, new)
                    value = new
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        return value

    def begin(self, offset: int) -> tuple[int, int] | None:
        """Inside a write transaction, before its commit: the counter at
        ``offset`` moves to an odd value; a store, moved first in its
        transaction, also settles a removal counter left odd.  Returns what
        :meth:`end` needs."""
        if offset == REMOVALS and faults().late_removal_bump:
            return None  # (tests: the order before the fix - both moves after the commit)
        m = self._current()  # (the file's identity, checked once for both moves)
        if offset == STORES and _PAIR.unpack_from(m, 0)[1] % 2:
            self._change(REMOVALS, lambda v: v + 1 if v % 2 else None, checked=True)
        # (odd: a write that has ended left it so - settled and moved on)
        value = self._change(offset, lambda v: v + 1 if v % 2 == 0 else v + 2, checked=True)
        return value, self.epoch

    def end(self, offset: int, begun: tuple[int, int] | None) -> None:
        """After the commit: settle the value :meth:`begin` set (another
        write may have moved it on already).  If the file was replaced in
        between, the new file's counter moves instead."""
        if offset == REMOVALS and faults().kill_after_removal_commit:
            os.kill(os.getpid(), signal.SIGKILL)  # (tests: a writer killed right here)
        if begun is None:
            begun = (self._change(offset, lambda v: v + 1 if v % 2 == 0 else v + 2),
                     self.epoch)
        value, epoch = begun
        self._current()
        if self.epoch != epoch:
            self._change(offset, lambda v: v + 2 if v % 2 == 0 else None, checked=True)
        else:
            self._change(offset, lambda v: v + 1 if v == value else None, checked=True)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
