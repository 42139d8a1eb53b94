"""Every patch's self-check on this GPU, with vLLM's kernels compiled for it
(on CPU the matrix runs the same checks with Triton's interpreter).

    python tests/gpu/check_self_checks.py

Runs ``python -m vllm_layerwise_patch doctor --json`` twice in fresh
interpreters: with ``VLLM_LAYERWISE_PATCH=1`` (what a user gets) and with
every patch selected by id (the opt-in ones too). One PASS/FAIL line per
patch and run, then ``RESULT:``. Exit 0: every self-check that ran passed and
doctor's one-line layerwise verdict is printed; 1: a self-check failed or a
patch was skipped where the declarations verify it; 2: no CUDA device, or
doctor could not run (a setup problem, not a verdict).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

DOCTOR = [sys.executable, "-m", "vllm_layerwise_patch", "doctor", "--json"]


def doctor(selection: str) -> dict | None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LAYERWISE_PATCH")}
    env["VLLM_LAYERWISE_PATCH"] = selection
    proc = subprocess.run(DOCTOR, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode not in (0, 1) or not proc.stdout.strip().startswith("{"):
        print(proc.stderr[-3000:])
        return None
    return json.loads(proc.stdout)


def verdicts(report: dict, label: str) -> tuple[int, int]:
    """(checks passed, checks failed) of one doctor run, printed per patch."""
    ok = bad = 0
    for row in report["patches"]:
        state, check = row["state"], row["self_check"]
        if state in ("opt-in", "disabled", "not-needed", "carried", "pending"):
            print(f"  --   {label:8} {row['id']:28} {state}")
            continue
        passed = state == "applied" and check == "ok"
        ok, bad = ok + passed, bad + (not passed)
        detail = row["self_check_detail"] if check else row["reason"]
        print(f"  {'PASS' if passed else 'FAIL'} {label:8} {row['id']:28} {state}, "
              f"self-check {check}: {detail[:300]}")
    return ok, bad


def main() -> int:
    try:
        import torch

        if not torch.cuda.is_available():
            print("RESULT: SETUP ERROR - no CUDA device (on CPU see scripts/matrix.py)")
            return 2
    except ImportError:
        print("RESULT: SETUP ERROR - torch is not installed")
        return 2
    from vllm_layerwise_patch.patches import all_patches

    runs = {"default": "1", "by id": ",".join(p.id for p in all_patches())}
    total_ok = total_bad = 0
    default = None
    for label, selection in runs.items():
        report = doctor(selection)
        if report is None:
            print(f"RESULT: SETUP ERROR - doctor did not run ({label})")
            return 2
        env = report["environment"]
        print(f"{label}: {env['vllm_distribution']} {env['vllm_version']}, "
              f"platform {env['platform']}")
        default = default or report
        ok, bad = verdicts(report, label)
        total_ok, total_bad = total_ok + ok, total_bad + bad
    print(f"layerwise path: {default['layerwise_path']}")
    print(f"\nRESULT: {'PASS' if total_bad == 0 and total_ok else 'FAIL'} "
          f"({total_ok} passed, {total_bad} failed)")
    return 0 if total_bad == 0 and total_ok else 1


if __name__ == "__main__":
    sys.exit(main())
