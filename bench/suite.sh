#!/usr/bin/env bash
# Named GPU suites, run from the repository root on a machine with a CUDA GPU.
#   bash bench/suite.sh tests            every GPU-marked test (pytest -m gpu), 4 xdist workers when available
#   bash bench/suite.sh ab OLD           old vs new kernels in one process each: HyTopK (64K causal, H 64 / 32)
#                                        and sparse MLA (16K, N = 128); OLD holds an old kernels/ folder
#                                        (git archive <commit> kernels | tar -x -C OLD)
#   bash bench/suite.sh topk             HyTopK vs its floor and stock's TileLang selection (bench/topk.py)
#   bash bench/suite.sh attn             sparse MLA + indexer loss vs stock's TileLang kernels (bench/sparse_attn.py)
#   bash bench/suite.sh replay           one DSA layer under recompute, replay on / off vs stock (bench/replay.py)
#   bash bench/suite.sh e2e              Megatron pretrain, stock vs HyScale (bench/e2e.sh; STEPS picks the runs)
# Several names run in order: bash bench/suite.sh tests ab .ab_old. Results go to $OUT (default /tmp/hyscale_suite).
# Without megatron installed, carry the stock bundle .whl-tl (../shared/tools/stock-tilelang-bundle.sh).
set -u
cd "$(dirname "$0")/.."
source bench/device_env.sh
OUT=${OUT:-/tmp/hyscale_suite}; mkdir -p "$OUT"
rc=0
run() {  # limit command...: run under a time limit (SIGINT first, so pytest still prints its summary)
  local limit=$1; shift
  echo "== $* ($(date +%T))"
  timeout -s INT -k 20 "$limit" "$@" || { local r=$?; echo "-- exit $r: $*"; rc=1; }
}
while [ $# -gt 0 ]; do
  case "$1" in
    tests)
      workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-4}")
      run "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider $workers -rfEs --durations=10 tests ;;
    ab)
      old=${2:?"usage: bench/suite.sh ab OLD (a folder holding the old kernels/)"}; shift
      run "${AB_TIMEOUT:-270}" python3 bench/ab_topk.py --old "$old" --csv "$OUT/ab_topk.csv"
      run "${AB_TIMEOUT:-270}" python3 bench/ab_sparse_mla.py --old "$old" --out "$OUT" ;;
    topk) run "${TOPK_TIMEOUT:-570}" python3 bench/topk.py --out "$OUT" ${TOPK_ARGS:-} ;;
    attn) run "${ATTN_TIMEOUT:-570}" python3 bench/sparse_attn.py --out "$OUT" ${ATTN_ARGS:-} ;;
    replay) run "${REPLAY_TIMEOUT:-570}" python3 bench/replay.py --out "$OUT" ${REPLAY_ARGS:-} ;;
    e2e) OUT="$OUT" bash bench/e2e.sh || rc=1 ;;
    *) echo "bench/suite.sh: unknown suite '$1' (tests, ab OLD, topk, attn, replay, e2e)" >&2; exit 2 ;;
  esac
  shift
done
exit $rc
