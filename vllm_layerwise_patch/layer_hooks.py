"""Per-layer connector hooks for layers vLLM does not hook itself (GDN, KDA).

vLLM hooks only attention layers (``maybe_transfer_kv_layer``); a layerwise
connector must see every layer that owns KV/state.  :func:`call_with_hooks`
runs a layer body as

    wait_for_layer_load(name) -> on_layer_compute_start(name) -> body -> save_kv_layer(name)

under the same conditions as ``maybe_transfer_kv_layer`` (a v1 connector is
active, the forward context has attention metadata, the connector has
metadata) so profile and warm-up runs never touch the connector.  The save runs
on every normal exit of the body, early returns (idle / warm-up paths with no
per-layer metadata) included.  A re-entrancy guard makes nested hooked entry
points (``_forward_core_fused_norm_packed`` -> ``_forward_core``) hook once.

A layer whose state is still written after its forward (Kimi-K3 KDA under
RecoverSSM: the accepted tokens are folded into the conv/recurrent state by
``RecoverSSMState.commit_step``, after sampling) passes ``save_after_commit``:
when it says so for the step's layer metadata, the save is held back
(:func:`defer_save`) and issued by :func:`flush_deferred_saves`, which the
``kda-k3-layer-hooks`` patch calls right after ``commit_step`` - still
before the connector's ``wait_for_save`` (vLLM runs ``postprocess_state``
before ``post_forward`` / ``finalize_step``, 0.30-0.34).  A held save whose
commit never ran (a capture or placeholder step) is dropped, never issued on
an uncommitted state: the connector then has no save of that layer for
that step (a pool writes no commit marker for its blocks).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .copy_protocol import COMPUTE_START, active_connector

logger = logging.getLogger("vllm.layerwise_patch")

_local = threading.local()


def _active_layers() -> set[str]:
    layers = getattr(_local, "layers", None)
    if layers is None:
        layers = _local.layers = set()
    return layers


def hook_context() -> tuple[Any, Any] | None:
    """``(connector, attn_metadata)`` when per-layer hooks must run, else None."""
    connector = active_connector()
    if connector is None:
        return None
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    attn_metadata = get_forward_context().attn_metadata
    if attn_metadata is None or not connector.has_connector_metadata():
        return None
    return connector, attn_metadata


def _layer_metadata(attn_metadata: Any, layer_name: str) -> Any:
    if isinstance(attn_metadata, dict):
        return attn_metadata.get(layer_name)
    if isinstance(attn_metadata, list) and attn_metadata:
        first = attn_metadata[0]
        return first.get(layer_name) if isinstance(first, dict) else first
    return attn_metadata


def call_with_hooks(layer_name: str, kv_cache: Any, body: Callable[[], Any],
                    save_after_commit: Callable[[Any], bool] | None = None) -> Any:
    """Run ``body()`` between the connector's wait and save for ``layer_name``
    (the save held back until :func:`flush_deferred_saves` when
    ``save_after_commit(layer_metadata)`` is true)."""
    active = _active_layers()
    if layer_name in active:  # nested entry point of the same layer
        return body()
    ctx = hook_context()
    if ctx is None:
        return body()
    connector, attn_metadata = ctx
    _drop_stale_saves(attn_metadata)
    active.add(layer_name)
    try:
        connector.wait_for_layer_load(layer_name)
        fence = getattr(connector, COMPUTE_START, None)
        if fence is not None:
            fence(layer_name)
        result = body()
    finally:
        active.discard(layer_name)
    layer_md = _layer_metadata(attn_metadata, layer_name)
    if save_after_commit is not None and save_after_commit(layer_md):
        defer_save(connector, layer_name, kv_cache, layer_md, attn_metadata)
    else:
        connector.save_kv_layer(layer_name, kv_cache, layer_md)
    return result


# -- saves held until the state is committed (RecoverSSM) ---------------------

def _pending() -> list[tuple[Any, str, Any, Any, Any]]:
    pending = getattr(_local, "pending", None)
    if pending is None:
        pending = _local.pending = []
    return pending


def defer_save(connector: Any, layer_name: str, kv_cache: Any, layer_md: Any,
               step_metadata: Any) -> None:
    """Hold ``layer_name``'s save until :func:`flush_deferred_saves`."""
    _pending().append((connector, layer_name, kv_cache, layer_md, step_metadata))


def pending_saves() -> list[str]:
    """The layers whose save is held (this thread)."""
    return [name for _, name, _, _, _ in _pending()]


def pending_saves_clear() -> None:
    """Forget the held saves without issuing them (tests, self-checks)."""
    _pending().clear()


_dropped_logged = False


def _drop(reason: str) -> None:
    global _dropped_logged
    pending = _pending()
    if pending and not _dropped_logged:
        _dropped_logged = True
        logger.warning("vllm-layerwise-patch: %d held layer save(s) dropped (%s): %s",
                       len(pending), reason, ", ".join(n for _, n, _, _, _ in pending))
    pending.clear()


def _drop_stale_saves(attn_metadata: Any) -> None:
    """A new step's first hook: saves held by another step were never committed."""
    pending = _pending()
    if pending and pending[0][4] is not attn_metadata:
        _drop("the state they were held for was never committed")


def flush_deferred_saves(committed: bool) -> list[str]:
    """Issue the held saves (``committed``: the state they wait for is now
    final), or drop them; returns the layers saved.  A save is issued only
    to the connector that is still active and still has its metadata."""
    pending = _pending()
    if not committed:
        _drop("no RecoverSSM commit ran for their step")
        return []
    saved = []
    current = active_connector()
    for connector, name, kv_cache, layer_md, _ in pending:
        if connector is current and connector.has_connector_metadata():
            connector.save_kv_layer(name, kv_cache, layer_md)
            saved.append(name)
    dropped = len(pending) - len(saved)
    pending.clear()
    if dropped:
        logger.warning("vllm-layerwise-patch: %d held layer save(s) dropped: the "
                       "connector lost its metadata before the commit", dropped)
    return saved


def method_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for a layer method: the layer's ``prefix`` is its name and
    ``kv_cache`` its state tensors (GDN: [conv, ssm])."""
    if instance is None:  # called through the class: nothing to hook
        return wrapped(*args, **kwargs)
    return call_with_hooks(
        instance.prefix,
        getattr(instance, "kv_cache", None),
        lambda: wrapped(*args, **kwargs),
    )
