# One device call (session 24): HyTopK at H 16 (bench/topk.py check spec 6), the 4-row default vs 8-row tiles
# (split selects, mask-sum and ballot slots): reference sets on sampled rows, then bit for bit against the default.
# Usage on the device (carry .whl-tl): OUT=$OUT bash bench/h16_check_session.sh
source bench/device_env.sh
E='"rows_x_heads":128,"select_split":2,"kth_search":"interp"'
run() { timeout 150 python3 bench/topk.py --out $OUT/$1 --parts check --check-specs 6 "${@:2}" 2>&1 | grep -E "CHECK|Error|error" | tee -a $OUT/log.txt; }
echo "== default (4 rows ballot) + variants"; run c0
echo "== 8 rows sum"; run c1 --config "{$E}"
echo "== 8 rows ballot"; run c2 --config "{$E,\"group_mask\":\"ballot\"}"
echo "== bit-for-bit vs default"; run c3 --check-variants '{"rows_x_heads":128,"select_split":2};{"rows_x_heads":128,"select_split":2,"group_mask":"sum"};{"group_mask":"sum"}'
