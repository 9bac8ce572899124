#!/usr/bin/env bash
# One device call for the kernel issues (#3, #5), most important first:
#   1) GPU-marked kernel tests (sparse MLA, fused indexer loss, selected scores, HyTopK) at real shapes;
#   2) bench/sparse_bwd_parts.py: per-kernel CUDA times of the backward variants (N = 16/64/128);
#   3) bench/sparse_attn.py, ours only, at KS_SIZES x KS_HEADS (re-times the attention and loss path);
#   topk (not in the default): bench/topk.py exact-variant check + 64K config sweep;
#   target (not in the default): bench/target_sweep.py, launch configs of the loss target kernel;
#   loss (not in the default): bench/loss_parts.py, the loss's selected-scores kernels (KS_LOSS_T, _BUDGET, _TIMEOUT).
# Usage on the device (carry .whl-tl):  OUT=$OUT bash bench/kernel_session.sh
# Env: KS_STEPS ("tests parts attn"; add "topk"), KS_TEST_FILES, KS_TARGET_BUDGET/TIMEOUT, KS_TOPK_S/CFGS/HEADS/BUDGET/TIMEOUT/VARIANTS, KS_TESTS_TIMEOUT, KS_PARTS_T, KS_SIZES, KS_HEADS, KS_ATTN_BUDGET,
#      KS_ATTN_SWEEP (substrings of bench/sparse_attn.py's fwd / bwd variants to sweep in the attn step; unset: no sweep).
set -u
source bench/device_env.sh
OUT=${OUT:-/tmp/kernels}; mkdir -p "$OUT"
STEPS=${KS_STEPS:-tests parts attn}
case " $STEPS " in *" tests "*)
  echo "== tests ($(date +%T))"
  TESTS=${KS_TEST_FILES:-tests/test_sparse_mla.py tests/test_dq_over_query.py tests/test_indexer_loss_fused.py \
    tests/test_selected_scores.py tests/test_hytopk.py tests/test_hytopk_warmstart.py tests/test_hytopk_search2.py \
    tests/test_hytopk_append.py tests/test_sparse_mla_variants.py tests/test_replay.py}
  # SIGINT at the limit: pytest still prints its summary (a plain kill lost it in session 6); --durations: where time goes
  timeout -s INT -k 20 "${KS_TESTS_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs -x --durations=8 $TESTS 2>&1 \
    | grep -E "passed|failed|FAILED|ERROR|Error|assert|[0-9]s (call|setup)" | tail -20;;
esac
# topk: HyTopK's exact variants checked bit for bit against the default, then the 64K config sweep
# (defaults: append warps, early-stopping 2-bit select, warm start 1024; bench/NOTES_hytopk.md)
TOPK_VARIANTS='{"group_mask":"sum"};{"append":"mask"};{"warm_start":512};{"append":"tile"};{"kth_search":"radix"};{"append":"mask","search_bits":1,"kth_search":"radix"};{"append":"tile","search_bits":1,"kth_search":"radix"};{"warm_start":0}'
case " $STEPS " in *" topk "*)
  echo "== topk check + sweep ($(date +%T))"
  timeout "${KS_TOPK_TIMEOUT:-420}" python3 bench/topk.py --out "$OUT" --parts check,sweep --check-specs "${KS_TOPK_CHECK_SPECS:-0,1,2,4}" \
    --check-variants "${KS_TOPK_VARIANTS:-$TOPK_VARIANTS}" \
    --sweep-S "${KS_TOPK_S:-65536}" --sweep-cfgs "${KS_TOPK_CFGS:-0,1,2,4,10}" --sweep-heads "${KS_TOPK_HEADS:-64}" --budget-s "${KS_TOPK_BUDGET:-380}" 2>&1 | grep -v -i warn | grep -E "check|SWEEP|BEST|GPU" | tail -40;;
esac
case " $STEPS " in *" parts "*)
  echo "== bwd parts ($(date +%T))"
  timeout "${KS_PARTS_TIMEOUT:-120}" python3 bench/sparse_bwd_parts.py --out "$OUT" --T "${KS_PARTS_T:-16384}" \
    --budget-s "${KS_PARTS_BUDGET:-100}" 2>&1 | grep -v -i warn | tail -30;;
esac
case " $STEPS " in *" target "*)
  echo "== target sweep ($(date +%T))"
  timeout "${KS_TARGET_TIMEOUT:-240}" python3 bench/target_sweep.py --out "$OUT" --budget-s "${KS_TARGET_BUDGET:-200}" 2>&1 \
    | grep -v -i warn | grep -E "T=|^\||budget" | tail -24;;
esac
case " $STEPS " in *" loss "*)
  echo "== loss parts ($(date +%T))"
  timeout "${KS_LOSS_TIMEOUT:-150}" python3 bench/loss_parts.py --out "$OUT" --T "${KS_LOSS_T:-16384}" \
    --budget-s "${KS_LOSS_BUDGET:-120}" 2>&1 | grep -v -i warn | tail -8;;
esac
case " $STEPS " in *" attn "*)
  echo "== sparse_attn ($(date +%T))"
  timeout "${KS_ATTN_TIMEOUT:-150}" python3 bench/sparse_attn.py --out "$OUT" --sizes "${KS_SIZES:-65536}" \
    --heads "${KS_HEADS:-128}" --no-stock --budget-s "${KS_ATTN_BUDGET:-120}" \
    ${KS_ATTN_SWEEP:+--sweep-only "$KS_ATTN_SWEEP"} $([ -z "${KS_ATTN_SWEEP:-}" ] && echo --no-sweep) 2>&1 | grep -v -i warn | tail -24;;
esac
ls "$OUT"
