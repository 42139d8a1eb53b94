"""The layerwise KV pool connector (``kv_connector_module_path`` target).

``LayerwisePoolConnector`` is imported on first access (it imports vLLM's
connector base classes); the backends, the layout and the transfer pipeline
import without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LayerwisePoolConnector"]


def __getattr__(name: str) -> Any:
    if name == "LayerwisePoolConnector":
        from .connector import LayerwisePoolConnector

        return LayerwisePoolConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
