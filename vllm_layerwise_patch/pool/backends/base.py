"""The backend interface and the value format shared by every backend.

A value is raw bytes behind a fixed header - never pickle::

    magic "VLPV" | version u8 | kind u8 | reserved u16 | length u64 |
    crc32 u32 | namespace 16 bytes                                    (36 bytes)

``length`` and ``crc32`` cover the payload; ``namespace`` is the pool
namespace fingerprint (model, dtype, block size, layout, TP size), so an entry
written by another model or layout is recognised even under a colliding key.
"""

from __future__ import annotations

import abc
import struct
import zlib
from collections.abc import Iterable

MAGIC = b"VLPV"
VERSION = 1
_HEADER = struct.Struct("<4sBBHQI16s")
HEADER_SIZE = _HEADER.size


class CorruptEntry(ValueError):
    """A stored value failed validation; ``kind`` names how (for logging once
    per kind): ``bad-header``, ``truncated``, ``checksum``, ``foreign-namespace``."""

    def __init__(self, kind: str, key: bytes, detail: str) -> None:
        super().__init__(f"pool entry {key!r}: {kind}: {detail}")
        self.kind = kind
        self.key = key


def pack(namespace: bytes, payload: bytes | memoryview, kind: int = 0) -> bytes:
    payload = memoryview(payload).cast("B")
    header = _HEADER.pack(MAGIC, VERSION, kind, 0, payload.nbytes,
                          zlib.crc32(payload), namespace[:16].ljust(16, b"\0"))
    return header + payload.tobytes()


def unpack(key: bytes, value: bytes | memoryview, namespace: bytes,
           expected_length: int | None = None, check_crc: bool = True) -> memoryview:
    """Validate ``value`` and return a view of its payload (raises CorruptEntry).
    ``check_crc=False`` skips only the checksum (header, namespace and length
    are always checked)."""
    view = memoryview(value)
    if view.nbytes < HEADER_SIZE:
        raise CorruptEntry("truncated", key, f"{view.nbytes} bytes, header needs {HEADER_SIZE}")
    magic, version, _kind, _r, length, crc, ns = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise CorruptEntry("bad-header", key, f"magic {magic!r} version {version}")
    if ns != namespace[:16].ljust(16, b"\0"):
        raise CorruptEntry("foreign-namespace", key, f"namespace {ns.hex()}")
    payload = view[HEADER_SIZE:]
    if payload.nbytes != length:
        raise CorruptEntry("truncated", key, f"payload {payload.nbytes} of {length} bytes")
    if expected_length is not None and length != expected_length:
        raise CorruptEntry("truncated", key, f"payload {length} bytes, page is {expected_length}")
    if check_crc and zlib.crc32(payload) != crc:
        raise CorruptEntry("checksum", key, "crc32 mismatch")
    return payload


class Backend(abc.ABC):
    """Key/value store of raw bytes, safe for several processes."""

    @abc.abstractmethod
    def exists_all(self, keys: Iterable[bytes]) -> list[bool]:
        """Existence of each key (cheap: no value read)."""

    @abc.abstractmethod
    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Values (with header) or None when absent."""

    def read_many(self, keys: list[bytes], consume) -> None:
        """Call ``consume(index, key, value_or_None)`` for each key.  A backend
        may pass zero-copy views that are valid only during the call."""
        for i, (k, v) in enumerate(zip(keys, self.get_many(keys))):
            consume(i, k, v)

    @abc.abstractmethod
    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        """Store all items atomically (readers see all or none)."""

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark keys as recently used (eviction order); optional."""

    def delete(self, keys: Iterable[bytes]) -> None:
        """Remove keys (corrupt entries); optional."""

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass
