#!/usr/bin/env bash
# One device call: HyTopK's GPU-marked tests, 4 pytest-xdist workers on the one GPU (compiles dominate; 16 cores).
# HT_FILES: the test files (default: every tests/test_hytopk*.py); HT_TIMEOUT seconds (default 540). The ballot-vs-sum
# test's counts are printed first (-s). Usage on the device (carry .whl-tl): OUT=$OUT bash bench/hytopk_gpu_tests.sh
set -u
source bench/device_env.sh
OUT=${OUT:-/tmp/hytopk_gpu}; mkdir -p "$OUT"
FILES=${HT_FILES:-$(ls tests/test_hytopk*.py)}
timeout -s INT -k 20 "${HT_TIMEOUT:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider -n "${HT_WORKERS:-4}" -rfEs \
  --durations=12 $FILES 2>&1 | tee "$OUT/gpu_tests.log" \
  | grep -vE "^\s*$|warn|Warning|^  /|Evict LRU" | tail -60
