#!/usr/bin/env bash
# One device call for the kernel issues (#3, #5), most important first:
#   1) GPU-marked kernel tests (sparse MLA, fused indexer loss, selected scores, HyTopK) at real shapes;
#   2) bench/sparse_bwd_parts.py: per-kernel CUDA times of the backward variants (N = 16/64/128);
#   3) bench/sparse_attn.py, ours only, at KS_SIZES x KS_HEADS (re-times the attention and loss path).
# Usage on the device (carry .whl-tl):  OUT=$OUT bash bench/kernel_session.sh
# Env: KS_STEPS ("tests parts attn"), KS_TESTS_TIMEOUT, KS_PARTS_T, KS_SIZES, KS_HEADS, KS_ATTN_BUDGET.
set -u
source bench/device_env.sh
OUT=${OUT:-/tmp/kernels}; mkdir -p "$OUT"
STEPS=${KS_STEPS:-tests parts attn}
case " $STEPS " in *" tests "*)
  echo "== tests ($(date +%T))"
  timeout "${KS_TESTS_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs -x tests/test_sparse_mla.py tests/test_dq_over_query.py \
    tests/test_indexer_loss_fused.py tests/test_selected_scores.py tests/test_hytopk.py tests/test_hytopk_warmstart.py tests/test_hytopk_search2.py tests/test_hytopk_append.py tests/test_sparse_mla_variants.py tests/test_replay.py 2>&1 \
    | grep -E "passed|failed|FAILED|ERROR|Error|assert" | tail -15;;
esac
case " $STEPS " in *" parts "*)
  echo "== bwd parts ($(date +%T))"
  timeout "${KS_PARTS_TIMEOUT:-120}" python3 bench/sparse_bwd_parts.py --out "$OUT" --T "${KS_PARTS_T:-16384}" \
    --budget-s "${KS_PARTS_BUDGET:-100}" 2>&1 | grep -v -i warn | tail -30;;
esac
case " $STEPS " in *" attn "*)
  echo "== sparse_attn ($(date +%T))"
  timeout "${KS_ATTN_TIMEOUT:-150}" python3 bench/sparse_attn.py --out "$OUT" --sizes "${KS_SIZES:-65536}" \
    --heads "${KS_HEADS:-128}" --no-stock --no-sweep --budget-s "${KS_ATTN_BUDGET:-120}" 2>&1 | grep -v -i warn | tail -20;;
esac
ls "$OUT"
