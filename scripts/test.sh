#!/usr/bin/env bash
# Set up everything and run the test suite (the README's test command).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$root/scripts/setup-venv.sh" test | tail -n 1)
cd "$root"
# The pytest script (not `python -m pytest`) keeps the source tree off
# sys.path: the tests exercise the installed wheel, .pth hook included.
set +e
"$venv/bin/pytest" -ra "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
