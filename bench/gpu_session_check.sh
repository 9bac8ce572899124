#!/usr/bin/env bash
# One device call that validates the GPU paths and refreshes layer-level numbers, most important first:
#   1) hyscale-compare through Megatron's pretrain on one GPU (tiny config, stock vs HyScale);
#   2) GPU-marked tests (HyTopK, sparse MLA, selected scores, replay offload) at real shapes;
#   3) bench/replay.py at more sequence lengths (rows saved as measured).
# Usage on the device (carry .whl-tl, and .tlcache when present: prebuilt stock TileLang kernels):  bash bench/gpu_session_check.sh
# (session 1 ran it with the tests capped at 60 s: 8 GPU tests passed before the cap, none failed;
#  the pretrain compare then stopped at eval_interval=None, fixed afterwards)
set -u
source bench/device_env.sh
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
echo "== 1. pretrain compare"
timeout 90 python3 -m hyscale_megatron.tools.compare --out "$OUT/cmp" --iters 5 --stock-backend none @configs/tiny_cpu.args \
  > "$OUT/cmp_console.txt" 2>&1; rc=$?
echo "compare rc=$rc"; grep -E "^\||speedup|difference|device" "$OUT/cmp/summary.md" 2>/dev/null || tail -15 "$OUT/cmp_console.txt"
rm -f "$OUT"/cmp/*.jsonl "$OUT"/cmp/summary.json "$OUT"/cmp/iterations.csv
[ $rc -eq 0 ] && rm -f "$OUT"/cmp/*.log "$OUT"/cmp_console.txt
echo "== 2. GPU tests"
timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_hytopk.py \
  tests/test_sparse_mla.py tests/test_selected_scores.py tests/test_replay.py tests/test_indexer_loss_fused.py \
  2>&1 | grep -E "passed|failed|FAILED|ERROR|error" | tail -12
echo "== 3. replay bench"
timeout ${REPLAY_TIMEOUT:-150} python3 bench/replay.py --out "$OUT" --sizes "${REPLAY_SIZES:-32768,131072}" \
  --model-sizes "${MODEL_SIZES:-}" --budget-s ${REPLAY_BUDGET:-110} 2>&1 | grep -E "^\[|^\|" | tail -16
ls "$OUT" "$OUT/cmp" 2>/dev/null
