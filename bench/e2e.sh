#!/usr/bin/env bash
# End to end on one GPU: stock Megatron DSA (TileLang backend) vs HyScale through Megatron's pretrain.
# STEPS picks the comparisons (default "v32 parity"):
#   tiny     hyscale-compare on the tiny CPU config through pretrain (5 iterations, a smoke check);
#   v32      hyscale-compare on the DeepSeek-V3.2-like config at 64K tokens, full recompute, ITERS
#            iterations (the step-time comparison);
#   parity   the same model at PARITY_SEQ tokens (default 4096) for 100 iterations with a stock-vs-stock
#            bf16-noise reference (--noise-ref): HyScale must not diverge from stock more than 1.5x it does;
#   mem      one HyScale step of the longest config under the allocator trace (bench/mem_peak.py);
#   longest  hyscale-longest on its default config (16 heads = one TP-8 shard, 2 layers), replay offloaded.
# Usage, from the repo root:  OUT=/tmp/e2e STEPS="v32 parity" bash bench/e2e.sh
# Output in $OUT: <step>/{iterations.csv,summary.md,comparison.png,meta.json} per comparison,
# longest/longest.{csv,md}, and logs.tar.gz (console logs, run logs, metrics files).
set -u
# the GPU machine's environment (stock TileLang bundle, PYTHONPATH), when the repository provides it
source bench/device_env.sh
OUT=${OUT:-/tmp/e2e}; mkdir -p "$OUT"
cmp() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T))"
  timeout "$limit" python3 -m hyscale_megatron.tools.compare --out "$OUT/$name" "$@" > "$OUT/$name.console.txt" 2>&1
  echo "$name rc=$?"
  cat "$OUT/$name/summary.md" 2>/dev/null || grep -v -i warn "$OUT/$name.console.txt" | tail -20
}
STEPS=${STEPS:-v32 parity}
case " $STEPS " in *" tiny "*) cmp tiny_gpu "${TINY_TIMEOUT:-100}" --iters 5 --stock-backend none @configs/tiny_cpu.args;; esac
case " $STEPS " in *" v32 "*) cmp v32_64k "${CMP_TIMEOUT:-330}" --iters "${ITERS:-8}" @configs/deepseek_v32_1gpu.args;; esac
PS=${PARITY_SEQ:-4096}
# The three parity runs take ~9.5 min at 4K; PARITY_RUNS splits them over calls (hyscale-compare --runs),
# PARITY_FROM seeds the output folder with an earlier call's meta.json and metrics files:
#   PARITY_RUNS=stock_ref PARITY_FROM=bench/results/e2e/parity_4096 STEPS=parity bash bench/e2e.sh
case " $STEPS " in *" parity "*)
  if [ -n "${PARITY_FROM:-}" ]; then mkdir -p "$OUT/parity_$PS" && cp "$PARITY_FROM"/{meta.json,*.jsonl} "$OUT/parity_$PS/"; fi
  cmp "parity_$PS" "${PARITY_TIMEOUT:-480}" --iters 100 @configs/deepseek_v32_1gpu.args \
    --seq-length "$PS" --max-position-embeddings "$PS" --noise-ref "${PARITY_NOISE_REF:-none}" \
    ${PARITY_RUNS:+--runs "$PARITY_RUNS"};; esac
# mem: what is live at the peak and the local peaks by call site, bytes/token (MEM_SEQ tokens, default 128K)
case " $STEPS " in *" mem "*)
  MS=${MEM_SEQ:-131072}
  echo "== mem $MS ($(date +%T))"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${MEM_TIMEOUT:-200}" python3 bench/mem_peak.py run \
    --out "$OUT/mem_$MS" --tokens "$MS" -- @configs/deepseek_v32_longest.args --seq-length "$MS" \
    --max-position-embeddings "$MS" --train-iters 1 --dsa-kernel-backend tilelang \
    --spec hyscale_megatron.specs hyscale_block_spec --hyscale --hyscale-replay --hyscale-replay-offload \
    --no-hyscale-replay-prefetch > "$OUT/mem.console.txt" 2>&1
  echo "mem rc=$?"; head -75 "$OUT/mem_$MS/peak.txt" 2>/dev/null || grep -v -i warn "$OUT/mem.console.txt" | tail -20
  ;; esac
# longest: LONGEST_KINDS / LONGEST_SEQS / LONGEST_RUN_S split the sweep over calls (stock's selection takes
# minutes per step at 512K+); hyscale-longest --merge joins the output folders
case " $STEPS " in *" longest "*)
  echo "== longest ($(date +%T))"
  # each run gets LONGEST_RUN_S plus hyscale-longest's 60 s kill grace; a shorter outer limit would kill the
  # sweep before it writes longest.csv
  if [ "${LONGEST_TIMEOUT:-540}" -lt $(( ${LONGEST_RUN_S:-240} + 65 )) ]; then
    echo "e2e: LONGEST_TIMEOUT=${LONGEST_TIMEOUT:-540} must be >= LONGEST_RUN_S + 65 = $(( ${LONGEST_RUN_S:-240} + 65 ))" >&2
    exit 2
  fi
  # expandable segments for both kinds: at 512K the caching allocator otherwise reserves 113 GB for a
  # 96 GB allocated peak (LONGEST_ALLOC_CONF= to run without)
  export PYTORCH_CUDA_ALLOC_CONF=${LONGEST_ALLOC_CONF-expandable_segments:True}
  timeout "${LONGEST_TIMEOUT:-540}" python3 -m hyscale_megatron.tools.longest --out "$OUT/longest" \
    --iters "${LONGEST_ITERS:-2}" --seq-lengths "${LONGEST_SEQS:-32768,131072,524288,1048576}" \
    --kinds "${LONGEST_KINDS:-stock,hyscale}" --run-timeout-s "${LONGEST_RUN_S:-240}" > "$OUT/longest.console.txt" 2>&1
  echo "longest rc=$?"; cat "$OUT/longest/longest.md" 2>/dev/null || grep -v -i warn "$OUT/longest.console.txt" | tail -20
  ;; esac
# logs into one archive: the figures and tables stay next to it
(cd "$OUT" && tar czf logs.tar.gz --ignore-failed-read *.console.txt */*.log */*.jsonl */L* */summary.json 2>/dev/null;
 rm -rf *.console.txt */*.log */*.jsonl */L* */summary.json)
ls -R "$OUT"
