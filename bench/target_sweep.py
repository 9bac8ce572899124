"""Launch configs of the sparse-stage loss target kernel (kernels/indexer_loss/target.py), timed side by
side on the same inputs: random bf16 query [T, N, 576] / latent key [S, 576], causal duplicate-free
indices (k = 2048), LSE from our sparse attention forward.

Why: after the scratch backward (session 6) the loss path is 23% of the attention at 64K / N = 128 and
its target kernel (126.5 ms, ~156 TFLOP/s on 576 MACs per head-key) is two thirds of it. The default
(64 heads x 64 keys, 8 warps, 2 stages) holds 225 KB of shared memory: one program per SM. Variants
trade tile size for programs per SM, or take all 128 heads in one program (no atomics).

Per (T, N, config): median ms (20/80 percentiles) by CUDA events after a warm-up, TFLOP/s counted as
2 * T * N * k * 576, and the largest relative difference to the default's target (fp32 sums in
another order: ~1e-6). Rows are appended to bench/results/target_sweep.csv.

On the H200 (device tool; no Megatron needed):
  python3 bench/target_sweep.py --out $OUT
CPU smoke (interpreter, tiny shapes, plumbing only):
  python3 bench/target_sweep.py --cpu-smoke
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _repo  # noqa: E402,F401
from _cli import parser, smoke  # noqa: E402

p = parser("target_sweep", 200.0, help="stop starting new configs after this")
p.add_argument("--shapes", default="65536:128,16384:16", help="T:N pairs")
p.add_argument("--topk", type=int, default=2048)
args = p.parse_args()
if smoke(args):
    args.shapes, args.topk = "32:4", 16

import torch  # noqa: E402

from common import append_csv, causal_indices, env_info, markdown_table, time_ms  # noqa: E402
from hyscale_kernels.indexer_loss.target import TARGET_CFG, sparse_attention_target  # noqa: E402
from hyscale_kernels.sparse_mla import kernel as km  # noqa: E402

DEV = "cpu" if args.cpu_smoke else "cuda"
DT = torch.float32 if args.cpu_smoke else torch.bfloat16
SCALE = (128 + 64) ** -0.5
T0 = time.time()
# name -> config overrides (smem from `bench/check_sparse_mla.py --resources --only=target`, sm_90a)
CONFIGS = {
    "default (64h x 64k, 8w, 2st, split)": {},  # QK^T split over the two warpgroups (default since session 9)
    "64h x 64k no split": dict(split_mma=False),  # the default before session 9: 126.6 vs 91.1 ms at 64K
    "64h x 32k": dict(block_k=32),  # 152 KB
    "64h x 64k, 3st": dict(num_stages=3),  # 226 KB
    "64h x 64k, 4w": dict(num_warps=4),  # 222 KB
    "64h x 16k, 4w": dict(block_k=16, num_warps=4),  # 111 KB: two programs per SM
    "32h x 32k, 4w": dict(block_h=32, block_k=32, num_warps=4),  # 74 KB, mma.sync: three per SM, 4 head blocks at N = 128
    "128h x 32k": dict(block_h=128, block_k=32),  # 222 KB: all heads of a token, no atomics at N = 128
    "128h x 16k, 3st": dict(block_h=128, block_k=16, num_stages=3),  # 185 KB
}


def main():
    os.makedirs(args.out, exist_ok=True)
    info = env_info()
    print("device", info["gpu"], "torch", info["torch"], "info", info, flush=True)
    rows = []
    for spec in args.shapes.split(","):
        T, N = (int(x) for x in spec.split(":"))
        K = args.topk
        g = torch.Generator(device=DEV).manual_seed(T + N)
        q = torch.randn(T, N, 576, device=DEV, generator=g).to(DT)
        kv = torch.randn(T, 576, device=DEV, generator=g).to(DT)
        idx = causal_indices(T, K, DEV)
        _, lse = km.sparse_mla_fwd(q, kv, idx, SCALE, 512)
        ref = None
        fl = 2.0 * T * N * K * 576
        for name, cfg in CONFIGS.items():
            if time.time() - T0 > args.budget_s:
                print(f"budget: skipping {name}", flush=True)
                continue
            try:
                fn = lambda: sparse_attention_target(q, kv, idx, lse, SCALE, config=cfg)  # noqa: E731
                out = fn()
                if ref is None:
                    ref = out
                den = ref.abs().max().clamp_min(1e-30)
                err = float((out - ref).abs().max() / den)
                t = time_ms(fn, target_ms=600.0)
            except Exception as exc:  # noqa: BLE001
                print(f"T={T} N={N} {name}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            row = dict(info, T=T, N=N, k=K, config=name, launch=dict(TARGET_CFG, **cfg), ms=t["ms"], p20=t["p20"],
                       p80=t["p80"], iters=t["iters"], tflops=round(fl / t["ms"] / 1e9, 1), max_rel_diff=f"{err:.1e}")
            print(f"  T={T} N={N} {name:32s} ms={t['ms']:.3f} tflops={row['tflops']} diff={err:.1e}", flush=True)
            rows.append(row)
            del out
        del q, kv, idx, lse, ref
        if DEV == "cuda":
            torch.cuda.empty_cache()
    append_csv(args.csv, rows)
    print(markdown_table(rows, ["T", "N", "config", "ms", "p20", "p80", "tflops", "max_rel_diff"]))


if __name__ == "__main__":
    main()
