#!/usr/bin/env bash
# Set up everything and run the CPU demo (the README's first command).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$root/scripts/setup-venv.sh" cpu | tail -n 1)
cd /
exec "$venv/bin/python" -m vllm_layerwise_patch demo "$@"
