"""On whichever vLLM build the suite runs (the nox e2e sessions name theirs in
VLP_EXPECT_RELEASE): that build is the one installed, and doctor's one-line
verdict on the pool's path - "layerwise" or "bulk: <reason>" - is what the
declarations decide for that release."""

from __future__ import annotations

import json
import os

import pytest

from conftest import clean_env, run_py

DOCTOR = ("import sys, runpy; sys.argv = ['x', 'doctor', '--json']; "
          "runpy.run_module('vllm_layerwise_patch', run_name='__main__')")


def _doctor(selection: str) -> dict:
    env = clean_env(VLLM_LAYERWISE_PATCH=selection, VLLM_LAYERWISE_PATCH_CPU_V2="1")
    proc = run_py(DOCTOR, env=env, check=False)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_installed_release_is_the_one_the_session_names():
    expect = os.environ.get("VLP_EXPECT_RELEASE")
    if not expect:
        pytest.skip("VLP_EXPECT_RELEASE is unset: only the nox e2e sessions name a release")
    from vllm_layerwise_patch.registry import detect_environment

    assert detect_environment().release == expect


def test_doctor_reports_the_layerwise_path_the_declarations_allow():
    from vllm_layerwise_patch.copy_protocol import LAYERWISE_PATCHES
    from vllm_layerwise_patch.patches import all_patches
    from vllm_layerwise_patch.registry import (
        detect_environment,
        evaluate,
        release_environment,
        release_fingerprints,
    )

    release = detect_environment().release
    patches = {p.id: p for p in all_patches()}
    declared = {pid: evaluate(patches[pid], release_fingerprints(patches[pid], release),
                              release_environment(release))[0]
                for pid in LAYERWISE_PATCHES}
    report = _doctor("1")
    assert report["ok"], [(p["id"], p["state"], p["self_check_detail"])
                          for p in report["patches"]]
    if all(state == "verified" for state in declared.values()):
        assert report["layerwise_path"] == "layerwise", report["layerwise_path"]
    else:
        missing = next(pid for pid, state in declared.items() if state != "verified")
        assert report["layerwise_path"].startswith(f"bulk: {missing}"), report["layerwise_path"]


def test_layerwise_path_says_bulk_and_why_without_the_precopy_patch():
    # negative control: the same doctor with only the GDN hooks selected
    report = _doctor("gdn-layer-hooks")
    assert report["layerwise_path"].startswith("bulk: deferred-mamba-precopy disabled"), (
        report["layerwise_path"])
