"""What an engine spec (:mod:`.engines`) changes in the child before vLLM
starts: the tests' negative controls and simulated conditions."""

from __future__ import annotations

from typing import Any


def apply(spec: dict[str, Any]) -> None:
    if spec.get("legacy_block_hash"):  # pool block i named by hashes[i]
        from vllm_layerwise_patch.pool.layout import PoolLayout

        PoolLayout.block_hash = lambda self, hashes, i: bytes(hashes[i])
    if spec.get("legacy_namespace"):  # a namespace blind to the weights
        from vllm_layerwise_patch.pool.identity import weights

        weights.weights_identity = lambda *args, **kw: {"resolved": True}
    if spec.get("transformers_version"):  # an upgrade of transformers alone
        import transformers.configuration_utils

        transformers.configuration_utils.__version__ = spec["transformers_version"]
    if spec.get("default_pool_path"):  # not this user's real default
        from vllm_layerwise_patch.pool.directory import paths

        paths.default_path = lambda: spec["default_pool_path"]
    if spec.get("weights_trace"):  # when vLLM reads the weights files
        observe_weight_reading()
    transfer = (spec.get("llm") or {}).get("weight_transfer_config") or {}
    if transfer.get("backend") == "pool-test-files":  # weights from a file, as tensors
        from .weight_transfer import register

        register()
    if spec.get("dense_mlp"):
        allow_dense_qwen3_next()
    if spec.get("exact_load_bytes"):  # the stats line's loaded bytes, unrounded
        from vllm_layerwise_patch.pool.stats import PoolStats

        reduce = PoolStats.reduce
        PoolStats.reduce = lambda self: dict(reduce(self), **{
            "Loaded (bytes)": int(self.data["bytes_loaded"])})


def allow_dense_qwen3_next() -> None:
    """``Qwen3NextForCausalLM.set_moe_parameters`` gives a model without MoE
    layer zero MoE parameters instead of raising (the GPU bundle's
    ``dense_qwen3_next`` edit, for a vLLM that is not edited)."""
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM as Model

    original = Model.set_moe_parameters

    def set_moe_parameters(self):
        try:
            return original(self)
        except RuntimeError as exc:
            if "No Qwen3Next layer" not in str(exc):
                raise
        self.moe_layers = []
        self.num_moe_layers = self.num_logical_experts = self.num_physical_experts = 0
        self.num_local_physical_experts = self.num_routed_experts = 0
        self.num_redundant_experts = self.num_shared_experts = 0
        self.num_expert_groups = 1

    Model.set_moe_parameters = set_moe_parameters


def observe_weight_reading() -> None:
    """Note each ``DefaultModelLoader.load_weights`` call (where vLLM reads
    the weights files) in the pool's digest trace as ``{"event":
    "read-weights", "start", "end"}`` - an observer of the test harness,
    independent of the overlay's patches."""
    import time

    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from vllm_layerwise_patch.pool.identity import weights

    original = DefaultModelLoader.load_weights

    def load_weights(self, *args, **kwargs):
        entry = weights.note({"event": "read-weights", "start": time.monotonic(), "end": None})
        try:
            return original(self, *args, **kwargs)
        finally:
            entry["end"] = time.monotonic()

    DefaultModelLoader.load_weights = load_weights


def change_weights(llm: Any, change: dict[str, Any]) -> None:
    """A phase's ``weights``: change the running engine's weights through
    vLLM's API - ``reload`` (``reload_weights`` from the files at a path),
    ``reload_tensors`` (``reload_weights`` given the tensors of a safetensors
    file), ``update`` (the weight-update session with the ``pool-test-files``
    transfer engine: ``start_weight_update``, ``update_weights`` with a
    safetensors file, ``finish_weight_update`` with ``version``) - then, with
    ``reset_connector``, ``reset_prefix_cache(reset_connector=True)``.  vLLM's
    own prefix cache still holds the old weights' KV: it is always reset
    (``reset_prefix_cache()``, which leaves the connector alone)."""
    if change.get("reload"):
        llm.collective_rpc("reload_weights", kwargs={"weights_path": change["reload"]})
    if change.get("reload_tensors"):
        from safetensors.torch import load_file

        tensors = list(load_file(change["reload_tensors"]).items())
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
    if change.get("update"):
        llm.start_weight_update()
        llm.update_weights({"update_info": {"path": change["update"]}})
        llm.finish_weight_update(change.get("version"))
    if change.get("reset_connector"):
        llm.reset_prefix_cache(reset_connector=True)
    llm.reset_prefix_cache()


def report(spec: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """``res`` with what the spec asked to see of the child."""
    if spec.get("weights_trace"):
        from vllm_layerwise_patch.pool.identity import weights

        res["weights_trace"] = list(weights.TRACE)
    return res
