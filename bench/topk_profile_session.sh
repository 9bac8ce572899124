#!/usr/bin/env bash
# One device call for HyTopK's time over the floor (issue #3): GPU tests of the HyTopK kernel, then the clock64
# phase profile (bench/topk.py --parts profile: interleaved rounds against the lazy floor) at TP_S x TP_HEADS with
# TP_VARIANTS (';'-separated json Config overrides; {"kernel": "ab_base/_kernel.py"} times an older kernel file
# interleaved with the checkout's: an A/B of code changes that no Config field selects), then each size of TP_S2
# (e.g. "131072 262144") with TP_VARIANTS2 at TP_HEADS2 (default TP_HEADS).
# Usage on the device (carry .whl-tl, and ab_base if a variant names a file there):  OUT=$OUT bash bench/topk_profile_session.sh
set -u
source bench/device_env.sh
OUT=${OUT:-/tmp/topk_prof}; mkdir -p "$OUT"
ROUNDS=${TP_ROUNDS:-5}
TESTS=${TP_TESTS-tests/test_hytopk.py tests/test_hytopk_interp.py tests/test_hytopk_ballot.py tests/test_hytopk_rewrite.py tests/test_hytopk_warps.py}  # TP_TESTS="": none
if [ -n "$TESTS" ]; then
  echo "== tests ($(date +%T))"
  timeout -s INT -k 20 "${TP_TESTS_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs -x \
    $TESTS 2>&1 \
    | grep -E "passed|failed|FAILED|ERROR|Error|assert" | tail -12
fi
prof() {  # $1: out subfolder, $2: S, $3: variants, $4: heads
  echo "== profile $1 S $2 H $4 ($(date +%T))"
  timeout "${TP_TIMEOUT:-300}" python3 bench/topk.py --out "$OUT/$1" --parts profile --sweep-S "$2" \
    --sweep-heads "$4" --ab-rounds "$ROUNDS" --profile-variants "$3" 2>&1 | grep -E "PROFILE|Error|error"
}
prof new "${TP_S:-65536}" "${TP_VARIANTS:-}" "${TP_HEADS:-64,32}"
i=2; for s2 in ${TP_S2:-}; do prof "new$i" "$s2" "${TP_VARIANTS2:-}" "${TP_HEADS2:-${TP_HEADS:-64,32}}"; i=$((i + 1)); done
echo "== done ($(date +%T))"
