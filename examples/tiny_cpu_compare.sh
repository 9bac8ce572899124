#!/usr/bin/env bash
# The README's main job: stock Megatron DSA vs HyScale on the tiny DSA GPT (configs/tiny_cpu.args),
# Megatron mock data, same seed / data / full recompute, back to back, on CPU (or GPU if present).
# Writes runs/tiny_cpu/{iterations.csv,summary.md,comparison.png,stock.log,hyscale.log}.
# Extra arguments go to hyscale-compare (e.g. --iters 20, or shared Megatron flags).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-runs/tiny_cpu}
ITERS=${ITERS:-10}
exec "$PY" -m hyscale_megatron.tools.compare --out "$OUT" --iters "$ITERS" @configs/tiny_cpu.args "$@"
