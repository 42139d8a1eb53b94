"""LoRA adapters as this worker process loaded them (worker side).

The ``lora-digest-at-load`` patch runs vLLM's ``WorkerLoRAManager._load_adapter``
through :func:`load`: the adapter's digest (:func:`.adapters.adapter_digest`,
kept per file version, so usually read from the digest cache the scheduler
filled) is taken just before vLLM reads the files, and kept only when every
file's version - (device, inode, size, mtime, ctime), :mod:`.digests` - is the
same before the digest, after it and after vLLM read them: then it is the
digest of what vLLM loaded.  Otherwise (a file changed during the load, no
file here) the copy is unknown: None.  :func:`held` answers, for every
adapter the manager holds now, the digest of its copy (None for one loaded
another way, e.g. before the patch was applied).  The worker side of the
connector checks requests against it and reports it to the scheduler
(:mod:`.adapters`)."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .adapters import adapter_digest, adapter_files
from .digests import _signature

_lock = threading.Lock()
_loaded: dict[int, bytes | None] = {}  # adapter id -> digest of its last load here
_manager: weakref.ref | None = None  # the WorkerLoRAManager that loads them


def _versions(files: list[str]) -> list[tuple[int, ...]] | None:
    try:
        return [_signature(os.stat(f)) for f in files]
    except OSError:
        return None


def load(manager: Any, lora_request: Any, load_it: Callable[[], Any]) -> Any:
    """Run vLLM's load of ``lora_request`` (``load_it``) and note the digest
    of what it read.  A failed digest never fails the load."""
    try:
        files = adapter_files(lora_request)
        before = _versions(files)
        digest = adapter_digest(lora_request, files)
        taken = _versions(files)
    except Exception:  # noqa: BLE001 - the adapter is then unknown
        files, before, digest, taken = [], None, None, None
    out = load_it()
    after = _versions(files) if files else None
    same = before is not None and before == taken == after
    global _manager
    with _lock:
        _loaded[int(lora_request.lora_int_id)] = digest if same else None
        _manager = weakref.ref(manager)
    return out


def held() -> dict[int, bytes | None]:
    """Adapter id -> digest of the copy the manager holds now (None: not
    known), for every adapter it holds."""
    manager = _manager() if _manager is not None else None
    if manager is None:
        return {}
    try:
        ids = set(manager.list_adapters())
    except Exception:  # noqa: BLE001 - not created yet
        return {}
    with _lock:
        return {i: _loaded.get(i) for i in ids}


def checked() -> bool:
    """Whether adapters loaded in this process are digested (the
    ``lora-digest-at-load`` patch is applied here)."""
    try:
        from ...registry import process_is_applied

        return bool(process_is_applied("lora-digest-at-load"))
    except Exception:  # noqa: BLE001 - registry unavailable: not checked
        return False
