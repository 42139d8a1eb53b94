"""Digests of whole files: the identity of weights and LoRA adapters.

* A file's digest covers its full content, streamed in 8 MiB reads (xxh3-128
  where the ``xxhash`` package is installed - it comes with the pool extra -,
  else BLAKE3, which vLLM installs).  Measured here (a 1 GB file on tmpfs or
  in the page cache): 0.18-0.24 s/GB with xxh3-128, 0.29 with BLAKE3, both
  releasing the GIL; 2.4 s/GB while both cores ran engines.
* A file in a Hugging Face cache is a link ``snapshots/<rev>/<name> ->
  ../../blobs/<digest>``: the blob's name is the sha256 of its content (the
  git blob sha1 for small files), so it is the digest and nothing is read.
  (Editing a blob in place keeps its name; Hugging Face's tools never do.)
* Digests are kept per file version - (device, inode, size, mtime, ctime) -
  in this process and in this user's cache directory
  (:func:`.paths.user_cache_dir`), so a restart reads nothing.  ctime is in
  the key because no user can set it: a write that restores the mtime
  (``touch -r``, ``rsync --inplace -t``) still changes it.
* Processes that need the same files at once (TP workers, the engine core)
  share the work: a file is hashed by the process that locks its entry first,
  the others wait for that entry.
* A file that changes while it is hashed is hashed again (three tries, then
  :class:`DigestError`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import random
import re
import threading
import time
from typing import Any

from ..directory.paths import user_cache_dir

_CHUNK = 8 << 20
_LOCK_STRIPES = 64
_MAX_AGE = 60 * 86400  # cache entries not used for this long are pruned
_HF_BLOB = re.compile(r"^(?:[0-9a-f]{64}|[0-9a-f]{40})$")


def _hasher() -> tuple[str, Any]:
    try:
        import xxhash

        return "xxh3_128", xxhash.xxh3_128
    except ImportError:  # pragma: no cover - xxhash comes with the pool extra
        pass
    try:
        import blake3

        return "blake3", blake3.blake3
    except ImportError:  # pragma: no cover - vLLM installs blake3
        return "blake2b", lambda: hashlib.blake2b(digest_size=16)


ALGO, _new_hash = _hasher()


class DigestError(RuntimeError):
    pass


@dataclasses.dataclass
class DigestStats:
    """What a digest run cost (logged at startup)."""
    files: int = 0
    bytes_total: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    hashed: int = 0  # files read in full
    cached: int = 0  # digests from this process or the cache directory
    named: int = 0  # Hugging Face blobs, named by their digest

    def summary(self) -> str:
        gb = self.bytes_read / 1e9
        rate = f" ({self.seconds / gb:.2f} s/GB)" if gb > 1e-3 else ""
        return (f"{self.files} files, {self.bytes_total / 1e9:.3f} GB: read "
                f"{self.bytes_read} bytes in {self.seconds:.2f} s{rate}, {self.hashed} "
                f"hashed, {self.cached} from the digest cache, {self.named} named by "
                f"their Hugging Face blob ({ALGO})")


def _signature(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def hf_blob_digest(path: str) -> str | None:
    """The digest a Hugging Face cache names a snapshot file's blob by, or None."""
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    name = os.path.basename(target)
    if os.path.basename(os.path.dirname(target)) != "blobs" or not _HF_BLOB.match(name):
        return None
    return ("sha256:" if len(name) == 64 else "git-sha1:") + name


def _stream(path: str, stats: DigestStats) -> tuple[tuple[int, ...], str]:
    """(the version hashed, its digest)."""
    for _ in range(3):
        sig = _signature(os.stat(path))
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _signature(os.fstat(fd)) != sig:
                continue
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            h, buf = _new_hash(), bytearray(_CHUNK)
            view = memoryview(buf)
            while True:
                n = os.readv(fd, [buf])
                if not n:
                    break
                stats.bytes_read += n
                h.update(view[:n])
            if _signature(os.fstat(fd)) == sig == _signature(os.stat(path)):
                stats.hashed += 1
                return sig, f"{ALGO}:{h.hexdigest()}"
        finally:
            os.close(fd)
    raise DigestError(f"{path} kept changing while it was hashed; start the engine once "
                      "the file is written")


class _DiskCache:
    """Digests by file version, one small JSON file each, in a private directory."""

    def __init__(self, where: str) -> None:
        self.where = where

    def _name(self, sig: tuple[int, ...]) -> str:
        return hashlib.sha256(f"{ALGO}|{sig}".encode()).hexdigest()[:40]

    def get(self, sig: tuple[int, ...]) -> str | None:
        path = os.path.join(self.where, self._name(sig))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            with os.fdopen(fd) as f:
                entry = json.load(f)
            if entry.get("sig") != list(sig) or not str(entry.get("digest")).startswith(ALGO):
                return None
            if time.time() - os.stat(path).st_mtime > 86400:
                os.utime(path)  # in use: not pruned
            return str(entry["digest"])
        except (OSError, ValueError, AttributeError):
            return None

    def put(self, sig: tuple[int, ...], digest: str, source: str) -> None:
        path = os.path.join(self.where, self._name(sig))
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"sig": list(sig), "digest": digest, "file": source}, f)
            os.replace(tmp, path)
        except OSError:
            return
        if random.random() < 1 / 32:
            self.prune()

    def prune(self) -> None:
        now = time.time()
        for name in os.listdir(self.where):
            p = os.path.join(self.where, name)
            try:
                if os.path.isfile(p) and now - os.lstat(p).st_mtime > _MAX_AGE:
                    os.unlink(p)
            except OSError:
                pass

    def lock(self, sig: tuple[int, ...], wait: bool) -> int | None:
        """An exclusive lock on ``sig``'s entry (None: someone else holds it)."""
        stripe = int(self._name(sig)[:8], 16) % _LOCK_STRIPES
        fd = os.open(os.path.join(self.where, f".lock-{stripe}"),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        return fd


_memo: dict[tuple[int, ...], str] = {}
_memo_lock = threading.Lock()


def _disk_cache() -> _DiskCache | None:
    where = user_cache_dir("digests")
    return None if where is None else _DiskCache(where)


def _known(cache: _DiskCache | None, sig: tuple[int, ...]) -> str | None:
    with _memo_lock:
        d = _memo.get(sig)
    if d is None and cache is not None:
        d = cache.get(sig)
        if d is not None:
            with _memo_lock:
                _memo[sig] = d
    return d


def _hash(path: str, sig: tuple[int, ...], cache: _DiskCache | None,
          stats: DigestStats) -> str:
    d = _known(cache, sig)  # (someone may have finished it while we waited)
    if d is not None:
        stats.cached += 1
        return d
    got, d = _stream(path, stats)
    with _memo_lock:
        _memo[got] = d
    if cache is not None:
        cache.put(got, d, path)
    return d


def digest_files(paths: list[str], stats: DigestStats | None = None) -> list[str]:
    """The content digest of each file (``"<algorithm>:<hex>"``)."""
    stats = DigestStats() if stats is None else stats
    t0 = time.monotonic()
    cache = _disk_cache()
    out: list[str | None] = [None] * len(paths)
    todo: list[tuple[int, tuple[int, ...]]] = []
    for i, path in enumerate(paths):
        st = os.stat(path)
        stats.files += 1
        stats.bytes_total += st.st_size
        out[i] = hf_blob_digest(path)
        if out[i] is not None:
            stats.named += 1
            continue
        out[i] = _known(cache, _signature(st))
        if out[i] is not None:
            stats.cached += 1
            continue
        todo.append((i, _signature(st)))
    busy = []
    for i, sig in todo:  # first what nobody else is hashing, then wait for the rest
        fd = cache.lock(sig, wait=False) if cache is not None else None
        if cache is not None and fd is None:
            busy.append((i, sig))
            continue
        try:
            out[i] = _hash(paths[i], sig, cache, stats)
        finally:
            if fd is not None:
                os.close(fd)
    for i, sig in busy:
        fd = cache.lock(sig, wait=True)
        try:
            out[i] = _hash(paths[i], sig, cache, stats)
        finally:
            os.close(fd)
    stats.seconds += time.monotonic() - t0
    return [str(d) for d in out]
