#!/usr/bin/env bash
# HyTopK's GPU tests on one GPU, 4 pytest-xdist workers where xdist is installed (compiles dominate). On the device
# (carry .whl-tl):  OUT=$OUT bash bench/hytopk_gpu_tests.sh
set -u
source bench/device_env.sh
OUT=${OUT:-/tmp/hytopk_gpu}; mkdir -p "$OUT"
WORKERS=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${HT_WORKERS:-4}")
timeout -s INT -k 20 "${HT_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider $WORKERS -rfEs \
  --durations=10 tests/test_hytopk_gpu.py tests/test_hytopk_exact.py 2>&1 | tee "$OUT/gpu_tests.log" \
  | grep -vE "^\s*$|warn|Warning|^  /" | tail -40
