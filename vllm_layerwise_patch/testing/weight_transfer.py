"""A vLLM weight-transfer engine for the tests (backend ``pool-test-files``):
``update_weights({"update_info": {"path": FILE}})`` loads the tensors of a
safetensors file into the running model - vLLM's weight-update session
(``start_weight_update`` / ``update_weights`` / ``finish_weight_update``)
with the trainer replaced by a file, so an engine's weights change from
tensors at run time on a CPU machine (the NCCL and IPC engines need GPUs).
Registered in the engine child by :func:`register`."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "pool-test-files"


@dataclasses.dataclass
class FileInitInfo(WeightTransferInitInfo):
    pass


@dataclasses.dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str = ""


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """Checkpoint-format weights from a file, applied as vLLM's IPC engine
    applies a trainer's (layerwise reload between start and finish)."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # (no device to sync)

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        from safetensors.torch import load_file

        self.model.load_weights(iter(load_file(update_info.path).items()))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass


def register() -> None:
    """Make ``weight_transfer_config={"backend": "pool-test-files"}`` work."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, FileWeightTransferEngine)
