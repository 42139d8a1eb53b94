"""Locks around one environment's LMDB transactions: a shared/exclusive gate
for one process's transactions (every transaction holds it shared; adopting
a map grown by another process needs it exclusive: LMDB's set_mapsize wants
no live transaction in the process), and the writer's turn among puts."""

from __future__ import annotations

import contextlib
import fcntl
import threading
import time


class Gate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
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
    blocking).  ``turn(wait=False)`` yields False at once when busy; time
    blocked waiting goes to :attr:`wait_seconds`."""

    def __init__(self, dir_fd: int) -> None:
        self._lock = threading.Lock()
        self._fd = dir_fd
        self.wait_seconds = 0.0

    @contextlib.contextmanager
    def __call__(self, wait: bool):
        t0 = time.perf_counter()
        if not self._lock.acquire(blocking=wait):
            yield False
            return
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            if wait:
                self.wait_seconds += time.perf_counter() - t0
            try:
                yield True
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()
