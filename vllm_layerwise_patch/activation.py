"""Turning the overlay on: the environment variable, the vLLM plugin entry
point and the post-import hooks that apply each patch when its target module
is imported (in the API server, the engine core and every worker alike).

``VLLM_LAYERWISE_PATCH`` (parsed by :mod:`.envvars`, like every variable of
the overlay):

* unset, empty, ``0``, ``false``, ``no`` or ``off``: off (nothing is
  registered, no vLLM import);
* ``1``, ``all``, ``true``, ``yes`` or ``on``: every default-enabled patch;
* a comma list of ids selects those (``hybrid-block-size,gdn-layer-hooks``);
* ``-id`` removes one (``all,-bytewise-precopy-kernel`` or just
  ``-bytewise-precopy-kernel``, which means "all but").

``VLLM_LAYERWISE_PATCH_FORCE`` takes the same grammar (``all``: every patch).
An unknown id or value is an error naming the variable.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import threading
from typing import Any

from .envvars import ENV, FORCE_ENV, REPORT_DIR_ENV, explicit_ids, is_off, parse_selection
from .registry import PatchStatus, Registry, set_process_registry

logger = logging.getLogger("vllm.layerwise_patch")

__all__ = ["ENV", "FORCE_ENV", "REPORT_DIR_ENV", "activate", "apply_imported", "deactivate",
           "env_enabled", "explicit_ids", "parse_selection", "plugin", "registry", "status"]

_registry: Registry | None = None
_active = False
_hooked: set[str] = set()
_lock = threading.RLock()


def env_enabled(value: str | None = None) -> bool:
    """True when the overlay variable asks for any patch.  Imports nothing."""
    return not is_off(os.environ.get(ENV) if value is None else value)


def registry() -> Registry:
    """The process-wide registry (patch modules imported lazily, no vLLM)."""
    global _registry
    with _lock:
        if _registry is None:
            from .patches import all_patches

            _registry = Registry(all_patches())
            _registry.listeners.append(_write_report)
            set_process_registry(_registry)
        return _registry


def is_active() -> bool:
    return _active


def activate(selection: str | None = None) -> Registry:
    """Enable the selected patches and hook their target modules.

    ``selection`` defaults to ``$VLLM_LAYERWISE_PATCH``.  Safe to call many
    times (the entry point and the interpreter-start hook both call it)."""
    global _active
    reg = registry()
    value = os.environ.get(ENV) if selection is None else selection
    known = list(reg.patches)
    ids = parse_selection(value, known, [p.id for p in reg.patches.values() if p.default_enabled])
    if ids:  # an unknown FORCE id fails here, like an unknown selected one
        parse_selection(os.environ.get(FORCE_ENV), known, known, FORCE_ENV)
    with _lock:
        reg.enable(ids, explicit_ids(value) & ids)
        _active = bool(ids)
        if not ids:
            return reg
        import wrapt

        for pid in ids:
            for module in reg.patches[pid].modules:
                if module not in _hooked:
                    _hooked.add(module)
                    wrapt.register_post_import_hook(_on_import, module)
        if _FACTORY not in _hooked:
            _hooked.add(_FACTORY)
            wrapt.register_post_import_hook(_register_connector, _FACTORY)
    _write_report(None)
    return reg


_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
CONNECTOR_NAME = "LayerwisePoolConnector"


def _register_connector(module: Any) -> None:
    """Make ``"kv_connector": "LayerwisePoolConnector"`` work without
    ``kv_connector_module_path`` while the overlay is active."""
    factory = module.KVConnectorFactory
    if _active and CONNECTOR_NAME not in factory._registry:
        factory.register_connector(CONNECTOR_NAME, "vllm_layerwise_patch.pool.connector",
                                   CONNECTOR_NAME)


def _imported(name: str) -> bool:
    """True once ``name`` is fully imported (not half-way through its own
    import, as a module is while it imports the module whose hook fires)."""
    mod = sys.modules.get(name)
    spec = getattr(mod, "__spec__", None)
    return mod is not None and not getattr(spec, "_initializing", False)


def _on_import(module: Any) -> None:
    """Post-import hook: apply every enabled patch whose modules are all in."""
    if not _active:
        return
    reg = registry()
    for pid, patch in reg.patches.items():
        st = reg.status[pid]
        if not st.enabled or reg.is_applied(pid):
            continue
        # The module whose hook fires has finished executing (its spec still
        # says "initializing" until importlib returns); the others must be done.
        if module.__name__ in patch.modules and all(
            m == module.__name__ or _imported(m) for m in patch.modules
        ):
            reg.apply(pid)


def apply_imported() -> Registry:
    """Apply now every enabled patch whose target modules are already imported
    (hooks do this by themselves; useful after :func:`activate` in tests)."""
    reg = registry()
    for pid, patch in reg.patches.items():
        if reg.status[pid].enabled and all(_imported(m) for m in patch.modules):
            reg.apply(pid)
    return reg


def deactivate() -> None:
    """Revert every applied patch; later imports of targets patch nothing."""
    global _active
    with _lock:
        _active = False
        if _registry is not None:
            _registry.revert_all()
            _registry.enable(set())
    _write_report(None)


def plugin() -> None:
    """``vllm.general_plugins`` entry point: vLLM calls this in every process."""
    if not env_enabled():
        return
    activate()


def status() -> dict[str, dict[str, Any]]:
    """Per-patch status of this process, as plain dicts."""
    if _registry is None:
        return {}
    return {pid: st.to_json() for pid, st in _registry.status.items()}


def _process_name() -> str:
    mp = sys.modules.get("multiprocessing")
    try:
        return mp.current_process().name if mp is not None else "MainProcess"
    except Exception:
        return "?"


def _write_report(_: PatchStatus | None) -> None:
    """Write this process's status to ``$VLLM_LAYERWISE_PATCH_REPORT_DIR/<pid>.json``
    (for tests and operators who want to see what each vLLM process did)."""
    directory = os.environ.get(REPORT_DIR_ENV)
    if not directory or _registry is None:
        return
    try:
        os.makedirs(directory, exist_ok=True)
        doc = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "process_name": _process_name(),
            "argv": sys.argv[:3],
            "active": _active,
            "patches": status(),
        }
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, os.path.join(directory, f"{os.getpid()}.json"))
    except OSError:
        logger.debug("cannot write status report", exc_info=True)
