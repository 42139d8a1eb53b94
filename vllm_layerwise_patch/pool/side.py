"""What both sides of the connector (scheduler and worker) hold: the backend,
the namespace, the settings, the shared layout, and a log that says each
kind of trouble once."""

from __future__ import annotations

from typing import Any

from .layout import PoolLayout
from .faults import faults
from .logs import LogOnce


def kv_roles(vllm_config: Any) -> tuple[Any, bool, bool]:
    """The engine's KV-transfer config and whether it loads and saves
    (``kv_both``, or no transfer config: both)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return ktc, ktc is None or bool(ktc.is_kv_consumer), ktc is None or bool(ktc.is_kv_producer)


class PoolSide:
    def __init__(self, *, layout: PoolLayout, backend: Any, namespace: bytes,
                 config: Any) -> None:
        self.backend = backend
        self.ns = namespace
        self.config = config
        self.layout = layout
        self.block_size = layout.block_size
        set_layout = getattr(backend, "set_layout", None)
        if set_layout is not None:  # (Mooncake: one object per block, kind and rank)
            set_layout(namespace, layout)
        self.log = LogOnce()
        self.faults = faults()  # tests only (see .faults)
