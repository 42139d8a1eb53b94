"""What an engine spec (:mod:`.engines`) changes in the child before vLLM
starts: the tests' negative controls and simulated conditions."""

from __future__ import annotations

from typing import Any


def apply(spec: dict[str, Any]) -> None:
    if spec.get("legacy_block_hash"):  # pool block i named by hashes[i]
        from vllm_layerwise_patch.pool.layout import PoolLayout

        PoolLayout.block_hash = lambda self, hashes, i: bytes(hashes[i])
    if spec.get("legacy_namespace"):  # a namespace blind to the weights
        from vllm_layerwise_patch.pool import weights

        weights.weights_identity = lambda *args, **kw: {"resolved": True}
    if spec.get("transformers_version"):  # an upgrade of transformers alone
        import transformers.configuration_utils

        transformers.configuration_utils.__version__ = spec["transformers_version"]
    if spec.get("default_pool_path"):  # not this user's real default
        from vllm_layerwise_patch.pool import paths

        paths.default_path = lambda: spec["default_pool_path"]
