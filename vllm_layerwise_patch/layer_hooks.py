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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .copy_protocol import COMPUTE_START, active_connector

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


def call_with_hooks(layer_name: str, kv_cache: Any, body: Callable[[], Any]) -> Any:
    """Run ``body()`` between the connector's wait and save for ``layer_name``."""
    active = _active_layers()
    if layer_name in active:  # nested entry point of the same layer
        return body()
    ctx = hook_context()
    if ctx is None:
        return body()
    connector, attn_metadata = ctx
    active.add(layer_name)
    try:
        connector.wait_for_layer_load(layer_name)
        fence = getattr(connector, COMPUTE_START, None)
        if fence is not None:
            fence(layer_name)
        result = body()
    finally:
        active.discard(layer_name)
    connector.save_kv_layer(layer_name, kv_cache, _layer_metadata(attn_metadata, layer_name))
    return result


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
