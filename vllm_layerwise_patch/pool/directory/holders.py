"""Which processes hold an embedded pool open, so that ``pool clear`` can
refuse while an engine uses it and say who.

Every process that opens the pool for an engine (engine core, workers)
writes ``holder-<pid>.json`` into the pool directory - pid, role, model,
start time, its command line and its parent's - and keeps an exclusive
``flock`` on it for as long as it lives.  The kernel drops the lock when the
process dies, however it dies, so a holder file whose lock can be taken is
stale (removed by :func:`holders`).  The files are created with the pool
files' modes (0600, or 0660 in a shared pool) and hold no prompt data.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import socket
import stat
import time
from typing import Any

_PREFIX, _SUFFIX = "holder-", ".json"
#: (pool path, pid) -> [the open, locked file of this process, connectors
#: using it, the record written there]
_HELD: dict[tuple[str, int], list[Any]] = {}
#: a file this young may be one a process is about to lock: never removed
_GRACE_SECONDS = 10.0


def _cmdline(pid: int | str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:500]
    except OSError:
        return ""


def _write(fd: int, record: dict[str, Any]) -> None:
    data = json.dumps(record).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def register(path: str, role: str, model: str = "") -> None:
    """Record this process as a holder of the pool at ``path`` (idempotent;
    best effort: a pool is never refused for want of a holder file)."""
    key = (os.path.realpath(path), os.getpid())
    held = _HELD.get(key)
    if held is not None:  # the scheduler and a worker in one process
        held[1] += 1
        if role not in held[2]["role"].split("+"):
            held[2]["role"] += "+" + role
            _write(held[0], held[2])
        return
    try:
        shared = bool(stat.S_IMODE(os.stat(path).st_mode) & 0o070)
        name = os.path.join(path, f"{_PREFIX}{os.getpid()}{_SUFFIX}")
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o660 if shared else 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        record = {"pid": os.getpid(), "role": role, "model": model,
                  "host": socket.gethostname(), "started": time.time(),
                  "cmdline": _cmdline("self"), "ppid": os.getppid(),
                  "parent_cmdline": _cmdline(os.getppid())}
        _write(fd, record)
        _HELD[key] = [fd, 1, record]
    except OSError:
        pass


def release(path: str) -> None:
    """Drop this process's record once its last connector shuts down."""
    key = (os.path.realpath(path), os.getpid())
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] <= 0:
        fd = _HELD.pop(key)[0]
        try:
            os.unlink(os.path.join(path, f"{_PREFIX}{os.getpid()}{_SUFFIX}"))
        except OSError:
            pass
        os.close(fd)


def holders(path: str, clean: bool = True) -> list[dict[str, Any]]:
    """The live holders of the pool at ``path`` (their records); stale files
    are removed when ``clean``."""
    live = []
    for name in sorted(glob.glob(os.path.join(glob.escape(path), f"{_PREFIX}*{_SUFFIX}"))):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # locked: its process lives
                with os.fdopen(os.dup(fd), "rb") as f:
                    try:
                        live.append(json.loads(f.read() or b"{}"))
                    except ValueError:
                        live.append({"file": name})
                continue
            young = time.time() - os.fstat(fd).st_mtime < _GRACE_SECONDS
            if clean and not young:  # nobody holds it: a process that died
                try:
                    os.unlink(name)
                except OSError:
                    pass
        finally:
            os.close(fd)
    return live


def describe(record: dict[str, Any]) -> str:
    """One line about a holder, for people."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
    parts = [f"pid {record.get('pid', '?')} on {record.get('host', '?')}",
             f"{record.get('role', '?')} of {record.get('model') or '?'}", f"since {since}"]
    if record.get("cmdline"):
        parts.append(f"command: {record['cmdline'][:160]}")
    if record.get("parent_cmdline"):
        parts.append(f"parent {record.get('ppid')}: {record['parent_cmdline'][:160]}")
    return "; ".join(parts)
