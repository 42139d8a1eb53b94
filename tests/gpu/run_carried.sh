#!/usr/bin/env bash
# run_gpu_checks.sh from a folder made by prepare_carry.py (a machine without
# vLLM or network): installs the carried wheels that are missing, unpacks the
# pruned vLLM sources, puts the carried package first on PYTHONPATH.
#
#   bash CARRY/gpu/run_carried.sh OUT_DIR [--dry-run]
set -uo pipefail
carry=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
out=$1; shift
tmp=$(mktemp -d "${TMPDIR:-/tmp}/vlp-carry.XXXXXX")
site="$tmp/site"
mkdir -p "$site"
if ! "$py" -c "import lmdb, pydantic" 2>/dev/null && ls "$carry"/whl/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$carry"/whl/*.whl || exit 2
fi
args=()
for a in "$carry"/vllm-src/*.tar.xz; do
  d="$tmp/$(basename "$a" .tar.xz)"
  mkdir -p "$d" && tar -xJf "$a" -C "$d" || exit 2
  args+=(--vllm-src "$d")
done
[ -f "$carry/gdn-src" ] && args+=(--gdn-src "$tmp/$(cat "$carry/gdn-src")")
export PYTHONPATH="$carry/pkg:$site${PYTHONPATH:+:$PYTHONPATH}"
bash "$carry/gpu/run_gpu_checks.sh" "$out" "$@" "${args[@]}"
rc=$?
rm -rf "$tmp"
exit $rc
