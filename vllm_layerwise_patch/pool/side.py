"""What every part of one side of the connector (the scheduler's, or one
worker's) shares: the backend, the namespace, the settings, the layout, the
test faults, and one log that says each kind of trouble once - shared, so a
kind logged by one part (a failed load, whether synchronous or
asynchronous) is not logged again by another.

Built once per side (:meth:`PoolSide.open`); each part takes what it uses
from it in its constructor."""

from __future__ import annotations

import dataclasses
from typing import Any

from .faults import Faults, faults
from .layout import PoolLayout
from .logs import LogOnce


def kv_roles(vllm_config: Any) -> tuple[Any, bool, bool]:
    """The engine's KV-transfer config and whether it loads and saves
    (``kv_both``, or no transfer config: both)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return ktc, ktc is None or bool(ktc.is_kv_consumer), ktc is None or bool(ktc.is_kv_producer)


@dataclasses.dataclass(frozen=True)
class PoolSide:
    layout: PoolLayout
    backend: Any
    ns: bytes
    config: Any
    log: LogOnce
    faults: Faults  # tests only (see .faults)

    @classmethod
    def open(cls, *, layout: PoolLayout, backend: Any, namespace: bytes,
             config: Any) -> PoolSide:
        set_layout = getattr(backend, "set_layout", None)
        if set_layout is not None:  # (Mooncake: one object per block, kind and rank)
            set_layout(namespace, layout)
        return cls(layout, backend, namespace, config, LogOnce(), faults())
