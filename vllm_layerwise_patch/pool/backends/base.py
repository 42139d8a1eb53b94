"""The backend interface and the value format shared by every backend.

A value is raw bytes behind a fixed header - never pickle::

    magic "VLPV" | version u8 | checksum algorithm u8 | reserved u16 |
    length u64 | checksum u64 | key digest u64 | namespace 16 bytes  (48 bytes)

``length`` and the checksum cover the payload (xxh3-64, about 10 GB/s here,
where the ``xxhash`` package is installed - it comes with the ``pool`` extra -
else crc32); ``namespace`` is the pool namespace fingerprint, so an entry
written for another model or layout is recognised even under a colliding key.
The key digest (:func:`key_digest`: blake2b-64 of the value's full key) names
the one key the value was written under - block hash, kind, rank, layer and
a drafter page's next token - so a value read from the wrong place (a
Mooncake range read through a replica list that outlived its object, whose
extent another block's object of the same size took) fails its check
(``other-key``) although its header, namespace and checksum are sound.

Entries are grouped (:func:`..keys.group_of`: everything before a key's last
``/``): a block's pages of one kind on one rank and their commit marker.
Recency, pins and eviction work on whole groups, so a block is never
half-evicted and a marker never outlives its pages.

Faults: a backend raises :class:`BackendError` (or lets its own error out);
callers turn any error into a miss (lookup), the load-failure path (load) or
a skipped save (save).  :class:`PoolFull` says a put found no room even after
eviction - pinned entries fill the pool, or the filesystem is full - and is
counted as a skipped save.
"""

from __future__ import annotations

import abc
import collections
import hashlib
import struct
import zlib
from collections.abc import Callable, Iterable
from typing import Any

from ..faults import faults

MAGIC = b"VLPV"
#: 4: the key digest (in what were 8 bytes of padding); values of 3 name no
#: key, and live under other namespaces (the version is part of the format
#: every namespace covers, :mod:`..identity.namespace`): never read
VERSION = 4
#: magic, version, checksum id, reserved, payload length, checksum, key
#: digest, namespace: 48 bytes, so that a value starting VALUE_OFFSET past a
#: 64-byte boundary has its payload on one
_HEADER = struct.Struct("<4sBBHQQQ16s")
HEADER_SIZE = _HEADER.size
#: where values start, modulo 64, in the buffers the pool lays out (as in
#: LMDB's overflow pages, whose data starts 16 bytes in): payloads are then
#: 64-byte aligned, like KV pages.  A page copied from a payload 8 bytes
#: behind its destination (modulo 4 KiB: LMDB's 16 bytes and a 40-byte
#: header did that) ran at a quarter of memcpy below ~1 MiB.
VALUE_OFFSET = 16
CRC32, XXH3 = 1, 2  # checksum algorithm ids


def _checksums() -> dict[int, Callable[[Any], int]]:
    out: dict[int, Callable[[Any], int]] = {CRC32: zlib.crc32}
    try:
        import xxhash

        out[XXH3] = xxhash.xxh3_64_intdigest
    except ImportError:  # pragma: no cover - xxhash comes with the pool extra
        pass
    return out


CHECKSUMS = _checksums()
#: what new values are written with
WRITE_CHECKSUM = XXH3 if XXH3 in CHECKSUMS else CRC32


def key_digest(key: bytes) -> int:
    """The 64-bit digest of a value's full key in its header (blake2b: the
    same in every build, whether or not ``xxhash`` is installed)."""
    return int.from_bytes(hashlib.blake2b(bytes(key), digest_size=8).digest(), "little")


class CorruptEntry(ValueError):
    """A stored value failed validation; ``kind`` names how (for logging once
    per kind): ``bad-header``, ``truncated``, ``checksum``,
    ``foreign-namespace``, ``other-key`` (a sound value written under
    another key)."""

    def __init__(self, kind: str, key: bytes, detail: str) -> None:
        super().__init__(f"pool entry {key!r}: {kind}: {detail}")
        self.kind = kind
        self.key = key


class BackendError(RuntimeError):
    """A backend operation failed (I/O, server, injected fault)."""

    #: the backend logged this condition itself, saying what it means (a
    #: Mooncake master down: once per outage); callers need not say it again
    announced = False


class PoolFull(BackendError):
    """No room for a put, even after eviction: the save is skipped."""


class PoolUnusable(BackendError):
    """The pool cannot be used at all (a data file LMDB cannot open, or
    another program's LMDB): the message names the file."""


def header(namespace: bytes, key: bytes, payload: Any) -> bytes:
    """The header of the value stored under ``key`` whose payload is
    ``payload`` (any buffer)."""
    payload = memoryview(payload).cast("B")
    return _HEADER.pack(MAGIC, VERSION, WRITE_CHECKSUM, 0, payload.nbytes,
                        CHECKSUMS[WRITE_CHECKSUM](payload), key_digest(key),
                        namespace[:16].ljust(16, b"\0"))


def pack(namespace: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    """Header and payload as one bytes object, the value of ``key`` (small
    values; the save path packs pages in place, see
    :class:`...worker.send_thread.PackArena`)."""
    return header(namespace, key, payload) + memoryview(payload).cast("B").tobytes()


def unpack(key: bytes, value: bytes | memoryview, namespace: bytes,
           expected_length: int | None = None, check_crc: bool = True) -> memoryview:
    """Validate ``value``, read as the value of ``key``, and return a view of
    its payload (raises CorruptEntry).  ``check_crc=False`` skips only the
    checksum (header, namespace, key and length are always checked)."""
    view = memoryview(value)
    if view.nbytes < HEADER_SIZE:
        raise CorruptEntry("truncated", key, f"{view.nbytes} bytes, header needs {HEADER_SIZE}")
    payload = view[HEADER_SIZE:]
    verify(key, view[:HEADER_SIZE], payload, namespace, expected_length, check_crc)
    return payload


def verify(key: bytes, head: Any, payload: memoryview, namespace: bytes,
           expected_length: int | None = None, check_crc: bool = True) -> None:
    """Validate the value of ``key``, read as its header ``head`` and its
    ``payload`` (which a direct read may have put straight into a KV page):
    raises CorruptEntry."""
    magic, version, algo, _r, length, checksum, digest, ns = _HEADER.unpack_from(head)
    if magic != MAGIC or version != VERSION or algo not in CHECKSUMS:
        raise CorruptEntry("bad-header", key,
                           f"magic {magic!r} version {version} checksum {algo}")
    if ns != namespace[:16].ljust(16, b"\0"):
        raise CorruptEntry("foreign-namespace", key, f"namespace {ns.hex()}")
    if digest != key_digest(key) and not faults().value_key_blind:
        raise CorruptEntry("other-key", key, f"the value of another key (digest {digest:016x})")
    if payload.nbytes != length:
        raise CorruptEntry("truncated", key, f"payload {payload.nbytes} of {length} bytes")
    if expected_length is not None and length != expected_length:
        raise CorruptEntry("truncated", key, f"payload {length} bytes, page is {expected_length}")
    if check_crc and CHECKSUMS[algo](payload) != checksum:
        raise CorruptEntry("checksum", key, "checksum mismatch")


Consumer = Callable[[int, bytes, "bytes | memoryview | None"], None]


def values_from_reads(backend: "Backend", keys: list[bytes],
                      sizes: list[int] | None = None) -> list[bytes | None]:
    """``get_many`` for a backend whose reads are its ``read_many``: each
    value copied out of the (possibly zero-copy) view it is handed."""
    out: list[bytes | None] = [None] * len(keys)

    def keep(i: int, _k: bytes, v: Any) -> None:
        out[i] = None if v is None else bytes(v)

    backend.read_many(keys, keep, sizes)
    return out


class Backend(abc.ABC):
    """Key/value store of raw bytes, safe for several processes.

    ``calls`` counts the operations made (by name), for tests and metrics."""

    @property
    def calls(self) -> collections.Counter:
        got = self.__dict__.get("_calls")
        if got is None:  # (not setdefault: it would build a Counter on every call)
            got = self.__dict__["_calls"] = collections.Counter()
        return got

    def generation(self) -> Any:
        """A :class:`.generation.Generation`: counters that any process's
        store or removal moves - before it becomes visible, and again after -
        read without a backend call; None where the backend cannot tell
        (then nothing is cached)."""
        return None

    @abc.abstractmethod
    def exists_many(self, keys: Iterable[bytes]) -> list[bool]:
        """Existence of each key (cheap: no value read)."""

    @abc.abstractmethod
    def get_many(self, keys: list[bytes], sizes: list[int] | None = None) -> list[bytes | None]:
        """Values (with header) or None when absent.  ``sizes``: the largest
        each value can be (header included); a backend that reads into
        buffers of its own sizes them by it."""

    def read_many(self, keys: list[bytes], consume: Consumer,
                  sizes: list[int] | None = None) -> None:
        """Call ``consume(index, key, value_or_None)`` for each key.  A backend
        may pass zero-copy views that are valid only during the call."""
        for i, (k, v) in enumerate(zip(keys, self.get_many(keys, sizes))):
            consume(i, k, v)

    def register_memory(self, ptr: int, size: int, saves: bool = False) -> bool:
        """Offer host memory (the KV cache) that :meth:`read_direct` may write
        loaded pages into; False where the backend cannot read into it.  With
        ``saves``: a chunk of the save path's pack memory
        (:class:`..saving.PackArena`), whose values :meth:`put_many` may
        store without copying them first; False where it does not."""
        return False

    def read_direct(self, keys: list[bytes], ptrs: list[int], lengths: list[int]
                    ) -> list[memoryview | None] | None:
        """Zero-copy load: each value's payload goes straight to ``ptrs[i]``
        (``lengths[i]`` bytes of registered memory), its header is returned
        for the caller to verify before the page is used (a header of a
        value that does not fit the page is ``b""``; a missing value is
        None).  None: not possible here (the caller uses :meth:`read_many`)."""
        return None

    @abc.abstractmethod
    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        """Store all items so that a reader never sees a commit marker
        (``.../commit``) before the pages it covers: atomically where the
        store has transactions, else pages first and markers only once every
        page is stored.  Evicts least recently used unpinned groups when
        full; raises PoolFull when no room can be made."""

    def touch(self, groups: Iterable[bytes]) -> None:
        """Mark whole groups as just used (eviction order)."""

    def pin(self, groups: Iterable[bytes], seconds: float, owner: bytes = b"") -> None:
        """Never evict these groups until ``owner`` unpins them or ``seconds``
        pass (a pending load reads them); also marks them as just used.
        Several owners may pin one group; it is evictable once none does."""

    def unpin(self, groups: Iterable[bytes], owner: bytes = b"") -> None:
        """Release ``owner``'s :meth:`pin`."""

    def delete(self, keys: Iterable[bytes]) -> None:
        """Remove exact keys."""

    def delete_groups(self, groups: Iterable[bytes]) -> None:
        """Remove whole groups (a damaged or missing page drops its block)."""

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class NoPool(Backend):
    """Stands in for a pool that cannot be used (:class:`PoolUnusable`):
    nothing is found, nothing is kept - the connector makes no lookups or
    saves with it."""

    def __init__(self, why: str) -> None:
        self.why = why

    def exists_many(self, keys: Iterable[bytes]) -> list[bool]:
        return [False for _ in keys]

    def get_many(self, keys: list[bytes], sizes: list[int] | None = None) -> list[bytes | None]:
        return [None] * len(keys)

    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        pass


class FaultInjectingBackend(Backend):
    """Tests only (``debug_backend_fault``): the named operations raise
    BackendError, as a backend failing at that point would."""

    _OPS = {"lookup": ("exists_many", "get_many", "read_many"),
            # a backend whose reads fail cannot drop the entries either
            "load": ("get_many", "read_many", "read_direct", "delete", "delete_groups"),
            "save": ("put_many",)}

    def __init__(self, inner: Backend, fault: str) -> None:
        self.inner = inner
        self.fault = fault
        self.failing = set(self._OPS[fault])

    def _check(self, op: str) -> None:
        if op in self.failing:
            raise BackendError(f"injected fault in {op} (debug_backend_fault={self.fault!r})")

    def exists_many(self, keys):
        self._check("exists_many")
        return self.inner.exists_many(keys)

    def get_many(self, keys, sizes=None):
        self._check("get_many")
        return self.inner.get_many(keys, sizes)

    def read_many(self, keys, consume, sizes=None):
        self._check("read_many")
        return self.inner.read_many(keys, consume, sizes)

    def register_memory(self, ptr, size, saves=False):
        return self.inner.register_memory(ptr, size, saves)

    def read_direct(self, keys, ptrs, lengths):
        self._check("read_direct")
        return self.inner.read_direct(keys, ptrs, lengths)

    def put_many(self, items, **kw):
        self._check("put_many")
        return self.inner.put_many(items, **kw)

    def touch(self, groups):
        return self.inner.touch(groups)

    def pin(self, groups, seconds, owner=b""):
        return self.inner.pin(groups, seconds, owner)

    def unpin(self, groups, owner=b""):
        return self.inner.unpin(groups, owner)

    def delete(self, keys):
        self._check("delete")
        return self.inner.delete(keys)

    def delete_groups(self, groups):
        self._check("delete_groups")
        return self.inner.delete_groups(groups)

    def stats(self):
        return self.inner.stats()

    def close(self):
        return self.inner.close()

    def __getattr__(self, name):  # counters and the like
        return getattr(self.inner, name)
