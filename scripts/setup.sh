#!/usr/bin/env bash
# Installs rollout and its test tools into the current Python. A machine with no torch gets the CPU
# build 2.13.0 (a bare `torch` would pull a multi-GB CUDA build); an existing torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
