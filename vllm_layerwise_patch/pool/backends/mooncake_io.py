"""Mooncake Store pieces the backend is built from: its error codes and what
they mean here, and the registered staging buffer cut into regions (one per
concurrent batch)."""

from __future__ import annotations

import ctypes
import queue
from typing import Any

from ..keys import COMMIT
from .base import BackendError

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
MARKER = ("/" + COMMIT).encode()


class BackendUnavailable(BackendError):
    """The Mooncake master cannot be reached (now, or recently)."""


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
        self.region_size = size // regions
        self._keepalive = keepalive
        self._free: queue.Queue = queue.Queue()
        for i in range(regions):
            self._free.put(base + i * self.region_size)

    def acquire(self) -> int:
        return self._free.get()

    def release(self, ptr: int) -> None:
        self._free.put(ptr)

    def view(self, ptr: int, n: int) -> memoryview:
        return memoryview((ctypes.c_ubyte * n).from_address(ptr)).cast("B")
