"""Build the carried vLLM for a GPU machine that has torch and Triton but no
vLLM and no network, and takes at most 64 MiB of files per run.

    python tests/gpu/build_vllm_bundle.py [--release 0.34.0] [--cache DIR]... [--out FILE]

One ``tar.xz`` (default ``.cache/gpu-bundle/vllm-<release>-gpu-bundle.tar.xz``,
ignored by git) holding ``site/``, a directory to put on ``PYTHONPATH``:

* ``vllm/``: the release's ``.py`` files and the JSON kernel configurations
  from its wheel - no compiled module, no C++/CUDA headers, no ``vllm-rs``
  binary - with the edits of ``bundle_edits.py`` applied (listed with their
  reasons in ``BUNDLE.json`` and ``tests/gpu/README.md``), and its
  ``dist-info`` (``importlib.metadata.version("vllm")`` is how vLLM finds
  its platform);
* the Python packages on the engine's import path that the GPU machine's
  image lacks or has in a version vLLM refuses (``DEPS``: pinned to the
  versions of this project's CPU test environment, which satisfy the
  release's requirements, so the CPU import check in the suite imports
  exactly what travels), from their cp312 manylinux x86_64 wheels, without
  tests, ``.pyi`` stubs or scripts;
* ``vllm_layerwise_patch/`` and a ``dist-info`` with its
  ``vllm.general_plugins`` entry point (vLLM loads it in every process).

Wheels come from the ``--cache`` directories (searched one level deep) or are
downloaded into the first with ``pip download --no-deps`` for Python 3.12
(``--no-download``: fail instead).  ``BUNDLE.json`` (inside, and next to the
archive) records the release, the wheels and their sha256, the edits, and the
sizes.  ``--release 0.26.0`` builds the fallback: the last release that pins
the GPU machine's torch 2.11.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

import bundle_edits  # noqa: E402

LIMIT = 64 << 20  # what one GPU run may carry, the checkout included
AIM = 45 << 20

#: (distribution, version): what the engine path imports that the GPU image
#: (torch 2.11, transformers 5.17, huggingface-hub 1.33, tokenizers 0.23.2,
#: numpy, aiohttp, pyyaml, ...; tests/gpu/gpu_image_guard.py) lacks, or has
#: in a version vLLM 0.34 refuses (huggingface-hub >= 2 and tokenizers >=
#: 0.23.3, hence a transformers that accepts them)
DEPS = {
    "0.34.0": [
        ("pydantic", "2.14.4"), ("pydantic-core", "2.50.5"), ("annotated-types", "0.8.0"),
        ("typing-inspection", "0.4.5"), ("typing-extensions", "4.16.0"),
        ("msgspec", "0.23.0"), ("pyzmq", "27.3.0"), ("cbor2", "6.3.0"), ("pybase64", "1.5.1"),
        ("cachetools", "8.0.2"), ("blake3", "1.0.11"), ("compressed-tensors", "0.17.0"),
        ("openai", "3.63.0"), ("jiter", "0.19.0"), ("sniffio", "1.3.1"),
        ("oss-harmony", "0.0.11"), ("fastapi", "0.136.3"), ("starlette", "1.10.0"),
        ("transformers", "5.19.0"), ("huggingface-hub", "2.4.0"), ("tokenizers", "0.23.3"),
        ("httpx2", "2.17.0"), ("httpcore2", "2.17.0"), ("truststore", "0.10.5"),
        ("loguru", "0.7.3"),
        ("lmdb", "3.0.0"),
    ],
}
DEPS["0.26.0"] = list(DEPS["0.34.0"])

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_24_x86_64")

#: what of vLLM's wheel travels
VLLM_SUFFIXES = (".py", ".json")
VLLM_SKIP_DIRS = ("vllm/third_party/deep_gemm/include/", "vllm/third_party/fmha_sm100/")
#: what of a dependency's wheel does not
DEP_SKIP = re.compile(r"(\.pyi$|/__pycache__/|\.pyc$|/tests?/|^[^/]+\.data/|"
                      r"\.dist-info/(RECORD|WHEEL|INSTALLER|REQUESTED|licenses/.*|LICENSE.*)$)")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(caches: list[Path], dist: str, version: str) -> Path | None:
    for cache in caches:
        for w in sorted(cache.glob("*.whl")) + sorted(cache.glob("*/*.whl")):
            name, ver = w.name.split("-")[:2]
            if norm(name) == norm(dist) and ver == version:
                return w
    return None


def download(cache: Path, dist: str, version: str) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-q", "-d", str(cache)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd.append(f"{dist}=={version}")
    print(f"  pip download {dist}=={version}", flush=True)
    subprocess.run(cmd, check=True)
    got = find_wheel([cache], dist, version)
    if got is None:
        raise SystemExit(f"pip downloaded no wheel named {dist}-{version} into {cache}")
    return got


def wheel(caches: list[Path], dist: str, version: str, allow_download: bool) -> Path:
    got = find_wheel(caches, dist, version)
    if got is not None:
        return got
    if not allow_download:
        raise SystemExit(f"no wheel {dist}=={version} in {', '.join(map(str, caches))} "
                         "(--no-download)")
    return download(caches[0], dist, version)


def vllm_files(whl: Path, release: str) -> dict[str, bytes]:
    """``{path under vllm/: bytes}``: the wheel's Python sources and JSON."""
    out = {}
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if (name.startswith("vllm/") and name.endswith(VLLM_SUFFIXES)
                    and not name.startswith(VLLM_SKIP_DIRS)):
                out[name[len("vllm/"):]] = z.read(name)
    if "platforms/cuda.py" not in out:
        raise SystemExit(f"{whl.name}: not a vLLM wheel")
    return out


def vllm_dist_info(whl: Path, release: str) -> dict[str, bytes]:
    with zipfile.ZipFile(whl) as z:
        return {n: z.read(n) for n in z.namelist()
                if n.startswith(f"vllm-{release}.dist-info/")
                and n.rsplit("/", 1)[1] in ("METADATA", "entry_points.txt", "top_level.txt")}


def dep_files(whl: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(whl) as z:
        return {n: z.read(n) for n in z.namelist()
                if not n.endswith("/") and not DEP_SKIP.search(n)}


def describe(files: dict[str, bytes], version: str) -> dict:
    """A carried distribution: its version, top-level modules, and whether
    it holds compiled modules (built for the GPU machine's Python 3.12)."""
    tops = sorted({n.split("/")[0].removesuffix(".py") for n in files
                   if not n.split("/")[0].endswith((".dist-info", ".libs"))})
    return {"version": version, "top_level": tops,
            "compiled": any(n.endswith(".so") or ".so." in n for n in files)}


def package_files() -> dict[str, bytes]:
    """This package's sources and a dist-info with its entry point."""
    pkg = ROOT / "vllm_layerwise_patch"
    out = {}
    for f in sorted(pkg.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix in (".py", ".json"):
            out[f.relative_to(ROOT).as_posix()] = f.read_bytes()
    version = re.search(r'__version__\s*=\s*"([^"]+)"',
                        (pkg / "__init__.py").read_text()).group(1)
    info = f"vllm_layerwise_patch-{version}.dist-info"
    out[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: vllm-layerwise-patch\n"
                               f"Version: {version}\n").encode()
    out[f"{info}/entry_points.txt"] = (
        b"[vllm.general_plugins]\n"
        b"vllm_layerwise_patch = vllm_layerwise_patch.activation:plugin\n")
    return out


def pack(files: dict[str, bytes], manifest: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        entries = dict(files)
        entries["BUNDLE.json"] = json.dumps(manifest, indent=1).encode() + b"\n"
        for name in sorted(entries):
            info = tarfile.TarInfo(name if name == "BUNDLE.json" else f"site/{name}")
            data = entries[name]
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, out)


def unpacked(files: dict[str, bytes], manifest: dict, out: Path) -> None:
    """The bundle as its archive unpacks: ``out/site/...``, ``out/BUNDLE.json``."""
    import shutil

    if out.exists():
        shutil.rmtree(out)
    for name, data in files.items():
        f = out / "site" / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
    (out / "BUNDLE.json").write_text(json.dumps(manifest, indent=1) + "\n")


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def build(release: str, caches: list[Path], out: Path, allow_download: bool = True,
          directory: bool = False) -> dict:
    if release not in DEPS:
        raise SystemExit(f"--release {release}: known releases {sorted(DEPS)}")
    vwhl = wheel(caches, "vllm", release, allow_download)
    src = vllm_files(vwhl, release)
    edits = bundle_edits.apply(src, release)
    files = {f"vllm/{k}": v for k, v in src.items()}
    files.update(vllm_dist_info(vwhl, release))
    sizes = {"vllm": sum(map(len, files.values()))}
    wheels = {"vllm": {"wheel": vwhl.name, "sha256": sha256(vwhl)}}
    packages = {}
    for dist, version in DEPS[release]:
        w = wheel(caches, dist, version, allow_download)
        got = dep_files(w)
        clash = sorted(set(got) & set(files))
        if clash:
            raise SystemExit(f"{w.name}: paths already taken: {clash[:3]}")
        files.update(got)
        packages[dist] = describe(got, version)
        sizes[dist] = sum(map(len, got.values()))
        wheels[dist] = {"wheel": w.name, "sha256": sha256(w)}
    ours = package_files()
    files.update(ours)
    sizes["vllm-layerwise-patch"] = sum(map(len, ours.values()))
    manifest = {"release": release, "built_from_commit": git_commit(),
                "python": "3.12 (cp312 / abi3 wheels, manylinux x86_64)",
                "wheels": wheels, "packages": packages, "edits": edits,
                "uncompressed_bytes": sizes, "files": len(files)}
    if directory:
        unpacked(files, manifest, out)
        return manifest
    pack(files, manifest, out)
    manifest["archive_bytes"] = out.stat().st_size
    manifest["archive_sha256"] = sha256(out)
    out.with_name(out.name + ".json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", default="0.34.0", choices=sorted(DEPS))
    ap.add_argument("--cache", action="append", type=Path, default=[],
                    help="a directory of wheels (repeatable; downloads go to the first; "
                         "default $VLP_WHEEL_CACHE or .cache/wheels)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-download", action="store_true")
    ap.add_argument("--unpacked", action="store_true",
                    help="write the bundle as it unpacks (OUT/site, OUT/BUNDLE.json), no archive")
    ap.add_argument("--list-edits", action="store_true", help="print the edits and exit")
    a = ap.parse_args(argv)
    if a.list_edits:
        for e in bundle_edits.EDITS[a.release]:
            print(f"{e.name}: {e.part('File') or e.part('Files')}\n  what: {e.part('What')}\n  why: {e.part('Why')}")
        return 0
    caches = a.cache or [Path(os.environ.get("VLP_WHEEL_CACHE", ROOT / ".cache" / "wheels"))]
    out = a.out or ROOT / ".cache" / "gpu-bundle" / f"vllm-{a.release}-gpu-bundle.tar.xz"
    m = build(a.release, caches, out, allow_download=not a.no_download, directory=a.unpacked)
    if a.unpacked:
        print(f"{out}: {m['files']} files, {sum(m['uncompressed_bytes'].values()) >> 20} MiB")
        return 0
    mib = m["archive_bytes"] / 2**20
    print(f"{out}: {mib:.1f} MiB, {m['files']} files, "
          f"{sum(m['uncompressed_bytes'].values()) / 2**20:.0f} MiB unpacked")
    for name, n in sorted(m["uncompressed_bytes"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:24} {n / 2**20:7.2f} MiB unpacked")
    for e in m["edits"]:
        print(f"  edit {e['edit']}: {e['file']}")
    if m["archive_bytes"] > LIMIT - (4 << 20):
        print(f"FAIL: {mib:.1f} MiB leaves no room in a run's 64 MiB for the checkout")
        return 1
    if m["archive_bytes"] > AIM:
        print(f"note: {mib:.1f} MiB is above the 45 MiB aimed at")
    return 0


if __name__ == "__main__":
    sys.exit(main())
