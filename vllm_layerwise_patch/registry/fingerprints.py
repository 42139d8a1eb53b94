"""Source fingerprints: the per-release table and the live digest.

A target's fingerprint is the sha256 of ``inspect.getsource`` of the target,
from its first decorator line to its end, indentation kept (the convention of
``shared/reference/vllm-internals.md``); a verified entry may hold a full
digest or a prefix of at least 8 hex digits.  :func:`fingerprint` computes it
on a live object (seen through our own wrappers, :func:`live_object`).  The
per-release table ``fingerprints.json`` holds every target's digest in every
release of the version matrix (:data:`RELEASES`), generated from the wheels by
``scripts/fingerprints.py --update-table`` with the static extractor
:mod:`vllm_layerwise_patch.source_fingerprints` (same digest, no import);
:func:`verified_on` turns the releases a person reviewed a patch on into
:class:`~.declaration.Verified` entries from that table.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from typing import Any

from .declaration import Patch, Target, Verified
from .installation import own_attribute, resolve_parent, unwrap_ours

#: Per-release target fingerprints (see the module docstring).
TABLE_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fingerprints.json")

_TABLE: dict | None = None


def release_table() -> dict[str, dict[str, str | None]]:
    """release label -> {target name -> sha256 or None (absent)}."""
    global _TABLE
    if _TABLE is None:
        with open(TABLE_PATH) as f:
            _TABLE = {rel: entry["fingerprints"]
                      for rel, entry in json.load(f)["releases"].items()}
    return _TABLE


#: The releases of the version matrix: every release in the table.  Patches
#: do not read it: each names the releases a person reviewed it on, so adding
#: a release here widens no claim (the matrix tests then ask every patch to
#: declare it verified or not applicable).
RELEASES = tuple(release_table())


def release_fingerprints(patch: Patch, release: str) -> dict[str, str | None]:
    """Target name -> digest of ``patch``'s targets in ``release`` (table)."""
    table = release_table()[release]
    return {t.name: table.get(t.name) for t in patch.targets}


def verified_on(targets: tuple[Target, ...] | list[Target], releases: tuple[str, ...],
                upstream: str) -> tuple[Verified, ...]:
    """:class:`Verified` entries for ``releases`` (the ones a person reviewed
    the patch against), with the targets' digests from the release table.
    A target absent from a release's table is a declaration error."""
    table = release_table()
    out = []
    for rel in releases:
        fps = table.get(rel)
        if fps is None:
            raise KeyError(f"release {rel!r} is not in {os.path.basename(TABLE_PATH)}")
        missing = [t.name for t in targets if not fps.get(t.name)]
        if missing:
            raise KeyError(f"{rel}: no fingerprint for {', '.join(missing)}")
        out.append(Verified(rel, {t.name: fps[t.name] for t in targets}, upstream))
    return tuple(out)


def live_object(target: Target) -> Any:
    """The object vLLM has at ``target`` now, seen through our own wrappers."""
    parent, attr = resolve_parent(target)
    raw = own_attribute(parent, attr)
    if raw is None:
        raw = getattr(parent, attr)
    if isinstance(raw, (staticmethod, classmethod)):
        raw = raw.__func__
    return unwrap_ours(raw)


def fingerprint(obj: Any) -> str:
    """sha256 of the source of ``obj`` (decorators included).

    A Triton kernel under ``TRITON_INTERPRET=1`` is an ``InterpretedFunction``
    that ``inspect`` cannot read; its ``fn`` is the decorated Python function,
    whose source is the same text."""
    try:
        src = inspect.getsource(obj)
    except (TypeError, OSError):
        fn = getattr(obj, "fn", None)
        if fn is None:
            raise
        src = inspect.getsource(fn)
    return hashlib.sha256(src.encode()).hexdigest()


def live_fingerprints(patch: Patch) -> dict[str, str | None]:
    """Target name -> live fingerprint (None: absent, or no source)."""
    out: dict[str, str | None] = {}
    for t in patch.targets:
        try:
            out[t.name] = fingerprint(live_object(t))
        except Exception:  # absent target, no source (e.g. compiled)
            out[t.name] = None
    return out
