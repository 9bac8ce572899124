#!/usr/bin/env bash
# The CPU test suite at both ends of the supported range: the pinned versions (.venv, constraints.txt)
# and the newest supported releases (.venv-latest, constraints-latest.txt). GPU tests skip without CUDA.
#   bash scripts/test.sh            both ends (what CI runs)
#   bash scripts/test.sh --pinned   the pinned end only
# Extra arguments after the option go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
ends="pinned latest"
if [ "${1:-}" = "--pinned" ]; then ends="pinned"; shift; fi
for end in $ends; do
  if [ "$end" = pinned ]; then bash scripts/setup.sh; py=.venv/bin/python; else bash scripts/setup.sh --latest; py=.venv-latest/bin/python; fi
  echo "== tests ($end: $($py -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'))"
  # each environment builds its own C++ extensions (torch versions differ)
  TORCH_EXTENSIONS_DIR="$PWD/$( [ $end = pinned ] && echo .venv || echo .venv-latest )/torch_extensions" "$py" -m pytest -q "$@"
done
