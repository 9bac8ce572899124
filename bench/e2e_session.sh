#!/usr/bin/env bash
# One device call for issue 6 (end to end, one H200): hyscale-compare on the DeepSeek-V3.2-like
# config, stock (TileLang backend) vs HyScale, then a 100-iteration loss-parity run.
#   1) 64K tokens, full recompute, ITERS iterations (the headline step-time comparison);
#   2) the same model at PARITY_SEQ tokens for 100 iterations (LM + indexer loss curves) with a
#      stock-vs-stock noise reference (--noise-ref);
# STEPS picks them (default "v32 parity"; "tiny" adds the tiny config through pretrain first;
# "longest" runs hyscale-longest; "mem" traces one longest-config step's memory, bench/mem_peak.py).
# Usage on the device (carry .whl-tl and .tlcache):  OUT=$OUT bash bench/e2e_session.sh
# Back in $OUT: <run>/{iterations.csv,summary.md,comparison.png} per compare step, longest/longest.{csv,md},
# and logs.tar.gz (logs, metrics files); the device tool returns 8 files: at most two compare steps per call.
set -u
source bench/device_env.sh
OUT=${OUT:-/tmp/e2e}; mkdir -p "$OUT"
cmp() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T))"
  timeout "$limit" python3 -m hyscale_megatron.compare --out "$OUT/$name" "$@" > "$OUT/$name.console.txt" 2>&1
  echo "$name rc=$?"
  cat "$OUT/$name/summary.md" 2>/dev/null || grep -v -i warn "$OUT/$name.console.txt" | tail -20
}
STEPS=${STEPS:-v32 parity}
# tiny: Megatron's pretrain on the GPU with the tiny config (the CPU job's config), a smoke check
case " $STEPS " in *" tiny "*) cmp tiny_gpu "${TINY_TIMEOUT:-100}" --iters 5 --stock-backend none @configs/tiny_cpu.args;; esac
case " $STEPS " in *" v32 "*) cmp v32_64k "${CMP_TIMEOUT:-330}" --iters "${ITERS:-8}" @configs/deepseek_v32_1gpu.args;; esac
PS=${PARITY_SEQ:-4096}
# parity: a third run (stock with its default PyTorch path, --noise-ref) measures the bf16 noise floor;
# HyScale must not diverge from stock more than 1.5x that reference does (windowed loss means).
# All three take ~9.5 min at 4K: split them with PARITY_RUNS (hyscale-compare --runs), seeding the
# output directory with the earlier call's files from PARITY_FROM (e.g. bench/results/e2e/parity_4096):
#   PARITY_RUNS=stock_ref PARITY_FROM=bench/results/e2e/parity_4096 STEPS=parity bash bench/e2e_session.sh
case " $STEPS " in *" parity "*)
  if [ -n "${PARITY_FROM:-}" ]; then mkdir -p "$OUT/parity_$PS" && cp "$PARITY_FROM"/{meta.json,*.jsonl} "$OUT/parity_$PS/"; fi
  cmp "parity_$PS" "${PARITY_TIMEOUT:-480}" --iters 100 @configs/deepseek_v32_1gpu.args \
    --seq-length "$PS" --max-position-embeddings "$PS" --noise-ref "${PARITY_NOISE_REF:-none}" \
    ${PARITY_RUNS:+--runs "$PARITY_RUNS"};; esac
# mem: one HyScale step of the longest config under the allocator trace (bench/mem_peak.py): what is live
# at the peak and the local peaks by call site, bytes/token (MEM_SEQ tokens, default 128K)
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
# longest: hyscale-longest on its default config (16 heads = one TP-8 shard, 2 layers), replay offloaded;
# LONGEST_KINDS / LONGEST_SEQS / LONGEST_RUN_S split it over calls (stock's selection takes minutes at 512K+)
case " $STEPS " in *" longest "*)
  echo "== longest ($(date +%T))"
  # each run gets LONGEST_RUN_S plus hyscale-longest's 60 s kill grace: an outer limit below that kills the
  # sweep before it writes longest.csv (session 5 lost a stock 1M attempt that way)
  if [ "${LONGEST_TIMEOUT:-540}" -lt $(( ${LONGEST_RUN_S:-240} + 65 )) ]; then
    echo "e2e_session: LONGEST_TIMEOUT=${LONGEST_TIMEOUT:-540} must be >= LONGEST_RUN_S + 65 = $(( ${LONGEST_RUN_S:-240} + 65 ))" >&2
    exit 2
  fi
  # both kinds alike: at 512K the caching allocator reserved 113 GB for a 96 GB allocated peak;
  # expandable segments cut that fragmentation (LONGEST_ALLOC_CONF= to run without)
  export PYTORCH_CUDA_ALLOC_CONF=${LONGEST_ALLOC_CONF-expandable_segments:True}
  timeout "${LONGEST_TIMEOUT:-540}" python3 -m hyscale_megatron.longest --out "$OUT/longest" --iters "${LONGEST_ITERS:-2}" \
    --seq-lengths "${LONGEST_SEQS:-32768,131072,524288,1048576}" --kinds "${LONGEST_KINDS:-stock,hyscale}" \
    --run-timeout-s "${LONGEST_RUN_S:-240}" > "$OUT/longest.console.txt" 2>&1
  echo "longest rc=$?"; cat "$OUT/longest/longest.md" 2>/dev/null || grep -v -i warn "$OUT/longest.console.txt" | tail -20
  ;; esac
# keep the file count under the device tool's 8: logs go into one archive
(cd "$OUT" && tar czf logs.tar.gz --ignore-failed-read *.console.txt */*.log */*.jsonl */L* */summary.json 2>/dev/null;
 rm -rf *.console.txt */*.log */*.jsonl */L* */summary.json)
ls -R "$OUT"
