"""Mooncake Store pieces the backend is built from: its error codes and what
they mean here, the registered staging buffer cut into regions (one per
concurrent batch), and the host memory registered for zero-copy loads."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import queue
import threading
from typing import Any

from ..base import HEADER_SIZE, VALUE_OFFSET, BackendError

#: Mooncake Store error codes (mooncake-store types.h) and what they mean here
CODES = {
    -1: "internal error", -200: "no segment or no space (NO_AVAILABLE_HANDLE)",
    -600: "invalid parameters or buffer too small (INVALID_PARAMS)",
    -704: "missing object (OBJECT_NOT_FOUND)", -705: "object exists",
    -706: "object has a read lease", -707: "lease expired during the read",
    -800: "transfer failed (TRANSFER_FAIL: the segment holder may be gone)",
    -900: "master unreachable (RPC_FAIL)",
}
MISSING, TOO_SMALL, NO_SPACE, UNREACHABLE = -704, -600, -200, -900


class BackendUnavailable(BackendError):
    """The Mooncake master cannot be reached (now, or recently): the
    connection said so when it went down (``announced``)."""

    announced = True


def describe(code: int) -> str:
    return f"{code} ({CODES.get(code, 'unknown error')})"


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class Staging:
    """The registered staging buffer, cut into regions handed out one per
    concurrent batch."""

    def __init__(self, base: int, size: int, regions: int, keepalive: Any) -> None:
        self.base, self.size = base, size
        self.region_size = (size - 64) // regions & ~63  # regions on cache lines
        self._keepalive = keepalive
        # one view of the whole buffer: a value's view is a slice of it
        self._mem = memoryview((ctypes.c_ubyte * size).from_address(base)).cast("B")
        self._free: queue.Queue = queue.Queue()
        first = (base + 63) & ~63
        for i in range(regions):
            self._free.put(first + i * self.region_size)

    def acquire(self) -> int:
        return self._free.get()

    def try_acquire(self) -> int | None:
        """A region if one is free now, else None."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return None

    def release(self, ptr: int) -> None:
        self._free.put(ptr)

    @contextlib.contextmanager
    def region(self):
        ptr = self.acquire()
        try:
            yield ptr
        finally:
            self.release(ptr)

    def runs(self, region: int, sizes: list[int], what: type[Exception] = BackendError):
        """Cut values of ``sizes`` into runs that fit one region: yields (i, j,
        the addresses of values i..j-1), each value's payload cache-line
        aligned (values start ``VALUE_OFFSET`` past a line)."""
        i = 0
        while i < len(sizes):
            j, used, ptrs = i, 0, []
            while j < len(sizes) and (j == i or
                                      used + VALUE_OFFSET + sizes[j] <= self.region_size):
                if VALUE_OFFSET + sizes[j] > self.region_size:
                    raise what(f"a {sizes[j]}-byte value does not fit a staging region of "
                               f"{self.region_size} bytes: raise mooncake.local_buffer_size")
                ptrs.append(region + used + VALUE_OFFSET)
                used = (used + VALUE_OFFSET + sizes[j] + 63) & ~63
                j += 1
            yield i, j, ptrs
            i = j

    def view(self, ptr: int, n: int) -> memoryview:
        return self._mem[ptr - self.base:ptr - self.base + n]


def make_staging(store: Any, cfg: Any, regions: int) -> Staging:
    """The staging buffer: from the shared memory of a same-node holder
    (``client_address``: only that memory can be registered there), else
    host memory of this process; pre-faulted and registered."""
    size = cfg.local_buffer_size
    if cfg.client_address:
        ptr = store.alloc_from_mem_pool(size)
        if not ptr:
            raise BackendError("Mooncake alloc_from_mem_pool failed")
        keep = None
    else:
        keep = (ctypes.c_ubyte * size)()
        ptr = ctypes.addressof(keep)
    ctypes.memset(ptr, 0, size)  # pre-fault: first touch costs 5-20x a copy
    rc = store.register_buffer(ptr, size)
    if rc != 0:
        raise BackendError(f"Mooncake register_buffer returned {describe(rc)}")
    return Staging(ptr, size, regions, keep)


class Registered:
    """Host memory ranges registered with the store (zero-copy loads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.wanted: list[tuple[int, int]] = []
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, ptr: int, size: int) -> None:
        with self._lock:
            i = bisect.bisect(self._starts, ptr)
            self._starts.insert(i, ptr)
            self._ends.insert(i, ptr + size)

    def covers(self, ptrs: list[int], lengths: list[int]) -> bool:
        starts, ends = self._starts, self._ends
        if not starts:
            return False
        for p, n in zip(ptrs, lengths):
            i = bisect.bisect(starts, p) - 1
            if i < 0 or p + n > ends[i]:
                return False
        return True


def slot_value(view: memoryview) -> memoryview:
    """A slot's value without the slot's padding (its header says how long
    the payload is; a slot that holds no header is passed whole, for the
    caller's check to reject)."""
    if view.nbytes < HEADER_SIZE:
        return view
    length = int.from_bytes(view[8:16], "little")
    return view[:HEADER_SIZE + length] if HEADER_SIZE + length <= view.nbytes else view
