"""Locks around one environment's LMDB transactions: a shared/exclusive gate
for one process's transactions (every transaction holds it shared,
:class:`GatedTxn`; adopting a map grown by another process needs it
exclusive: LMDB's set_mapsize wants no live transaction in the process), and
the writer's turn among puts."""

from __future__ import annotations

import contextlib
import fcntl
import threading
import time


class Gate:
    """Shared (``enter_shared``/``exit_shared``: every transaction, plain
    calls on the hot path) or exclusive (``with gate.exclusive()``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    def enter_shared(self) -> None:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._shared += 1

    def exit_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if self._exclusive and not self._shared:  # (only it waits on readers)
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._shared:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class WriterTurn:
    """The writer's turn among puts of one environment: this process's lock,
    then a ``flock`` on the environment's directory (``dir_fd``; other
    processes' puts - LMDB's own writer mutex cannot be tried without
    blocking).  ``acquire(wait=False)`` returns False at once when busy
    (else :meth:`release` follows); time blocked waiting goes to
    :attr:`wait_seconds`."""

    def __init__(self, dir_fd: int) -> None:
        self._lock = threading.Lock()
        self._fd = dir_fd
        self.wait_seconds = 0.0

    def acquire(self, wait: bool) -> bool:
        t0 = time.perf_counter() if wait else 0.0
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            self._lock.release()
            return False
        except BaseException:
            self._lock.release()
            raise
        if wait:
            self.wait_seconds += time.perf_counter() - t0
        return True

    def release(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()


class GatedTxn:
    """A transaction of ``be`` (an :class:`.backend.LmdbBackend`) under its
    gate, shared: ``with GatedTxn(be, write) as txn``; begun again once on a
    map another process grew (``be._adopt_map``).  A class, not a
    generator: every transaction of the pool goes through it."""

    __slots__ = ("be", "write", "txn")

    def __init__(self, be, write: bool) -> None:
        self.be, self.write = be, write

    def __enter__(self):
        import lmdb

        be = self.be
        for attempt in (0, 1):
            be._gate.enter_shared()
            try:
                self.txn = be.env.begin(write=self.write, buffers=True)
                return self.txn  # (the gate is left on __exit__)
            except lmdb.MapResizedError:
                be._gate.exit_shared()
                if attempt:
                    raise
            except BaseException:
                be._gate.exit_shared()
                raise
            be._adopt_map()
        raise AssertionError("unreachable")

    def __exit__(self, *exc):
        try:
            return self.txn.__exit__(*exc)
        finally:
            self.be._gate.exit_shared()
