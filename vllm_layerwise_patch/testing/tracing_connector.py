"""A tracing KV connector (SupportsHMA) for protocol tests: it transfers
nothing, records every call it receives into :data:`EVENTS`, and takes part in
the layerwise mamba copy protocol.

Load it with ``kv_transfer_config={"kv_connector": "TracingConnector",
"kv_connector_module_path": "vllm_layerwise_patch.testing.tracing_connector",
"kv_role": "kv_both", "kv_connector_extra_config": {...}}``.

Extra config:

* ``defer`` (bool, default True): ``requires_mamba_state_copy_after_layer_load``
  and the answer of ``prepare_mamba_state_copy``;
* ``skip_copy_layer`` (str): never trigger the copy for this layer (to show the
  next step raises);
* ``repeat_copy`` (bool): call ``do_mamba_copy_for_layer`` twice per layer.

Every layer's ``wait_for_layer_load`` calls ``do_mamba_copy_for_layer`` (for
attention layers too: it must be a no-op there).  Events are plain tuples
``(kind, name, step)``; the engine must run in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) for a test to read them.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

#: Every call, in order: (kind, name, step).
EVENTS: list[tuple[str, str, int]] = []


def record(kind: str, name: str = "") -> None:
    EVENTS.append((kind, name, _STEP[0]))


_STEP = [0]


class TracingMetadata(KVConnectorMetadata):
    def __init__(self, step: int) -> None:
        self.step = step


class TracingConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.defer = bool(extra.get("defer", True))
        self.skip_copy_layer = extra.get("skip_copy_layer")
        self.repeat_copy = bool(extra.get("repeat_copy", False))
        self._model_state: Any = None
        self._sched_step = 0

    # -- layerwise mamba copy protocol ---------------------------------------
    @property
    def requires_mamba_state_copy_after_layer_load(self) -> bool:
        return self.defer

    def prepare_mamba_state_copy(self, model_state: Any) -> bool:
        record("prepare", type(model_state).__name__)
        self._model_state = model_state if self.defer else None
        return self.defer

    def finish_mamba_state_copy(self) -> None:
        record("finish")
        self._model_state = None

    # -- worker side -----------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        record("register_kv_caches", ",".join(sorted(kv_caches)))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        _STEP[0] = getattr(connector_metadata, "step", -1)
        record("bind")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        record("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        record("load", layer_name)  # this connector's own "load" of the layer
        state = self._model_state
        if state is not None and layer_name != self.skip_copy_layer:
            launched = state.do_mamba_copy_for_layer(layer_name)
            record("copy_call", f"{layer_name}:{bool(launched)}")
            if self.repeat_copy:
                again = state.do_mamba_copy_for_layer(layer_name)
                record("copy_call", f"{layer_name}:{bool(again)}")
        record("wait_done", layer_name)

    def on_layer_compute_start(self, layer_name: str) -> None:
        record("fence", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        record("save", layer_name)

    def wait_for_save(self) -> None:
        record("wait_for_save")

    # -- scheduler side --------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._sched_step += 1
        return TracingMetadata(self._sched_step)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]):
        return False, None
