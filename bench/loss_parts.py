"""Where the sparse-stage indexer loss spends its time: the selected-scores kernels it runs, timed alone.

The loss (bench/sparse_attn.py; whatever the attention's head count, ~18-19 ms at T = 16K in session 10, ~12-13
ms since session 11) is the indexer's scores at the k selected keys (`selected_scores` forward), the KL rows,
and the backward to the indexer's q, w, k (`_triton_bwd`: per query row, S, dq, dk, fp32 atomics into dk). With
few attention heads it is a large part of the attention (40% at N = 16 in session 10), so its kernels are
timed here, one row per variant:
  * `fwd`: the selected-scores forward, [T, k] fp32 (`1 block/prog`: one 64-slot block per program; `row/prog`,
    the default since session 11: a whole row per program, its q / w loaded once), launch variants;
  * `kl rows`: the KL row kernel (lse, KL value, the score gradient);
  * `bwd`: the backward kernel from a given score gradient; `dk_t`: dk^T = q^T dS (3 MMAs, all wgmma) instead
    of a 4th, transposed score MMA; `prefetch idx`: slot indices loaded one block ahead of their gather (as the
    sparse MLA forward); j64 / warps: launch; `deterministic`: the sorted-order dk reduction;
  * `loss`: the three as the deferred loss's backward runs them; `TP4 rank`: the same on one tensor-parallel
    rank's quarter of the rows (`tp_split_rows`: one rank's kernels, without the gradient all-gather).
Median ms (CUDA events, after a warm-up), 20/80 percentiles, TFLOP/s (fwd 2·T·k·H·D, bwd 3x that; the ReLU
variant's second score MMA not counted), and for the backward variants the largest relative L2 difference of
dq / dw / dk against the default backward launch. Random bf16 data, causal duplicate-free indices, signed head weights, ReLU.
Rows are appended to bench/results/loss_parts.csv.

On the H200 (device tool; no Megatron needed):
  python3 bench/loss_parts.py --out $OUT
CPU smoke (interpreter, tiny shapes, plumbing only):
  python3 bench/loss_parts.py --cpu-smoke
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _repo  # noqa: E402,F401
from _cli import parser, smoke  # noqa: E402

p = parser("loss_parts", 120.0)
p.add_argument("--T", type=int, default=16384)
p.add_argument("--index-heads", type=int, default=64)
p.add_argument("--index-dim", type=int, default=128)
p.add_argument("--topk", type=int, default=2048)
args = p.parse_args()
if smoke(args):
    args.T, args.index_heads, args.index_dim, args.topk = 40, 4, 32, 24

import torch  # noqa: E402

from common import append_csv, causal_indices, env_info, markdown_table, rel_err, time_ms  # noqa: E402
from hyscale_kernels.hytopk import selected_scores as ss  # noqa: E402
from hyscale_kernels.indexer_loss import kl as klm  # noqa: E402


def main():
    dev = "cpu" if args.cpu_smoke else "cuda"
    dt = torch.float32 if args.cpu_smoke else torch.bfloat16
    T, H, D, K = args.T, args.index_heads, args.index_dim, args.topk
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(T, H, D, device=dev, generator=g).to(dt)
    w = torch.randn(T, H, device=dev, generator=g)
    k = torch.randn(T, D, device=dev, generator=g).to(dt)
    idx = causal_indices(T, K, dev, seed=1)
    grad = torch.randn(T, K, device=dev, generator=g).masked_fill(idx < 0, 0.0)
    fl = 2.0 * T * K * H * D
    info = env_info()
    t0 = time.time()
    ref = ss._triton_bwd(q, w, k, idx, grad, True, False)  # the default launch
    target = torch.rand(T, K, device=dev, generator=g).masked_fill(idx < 0, 0.0)
    scores = ss._triton_fwd(q, w, k, idx, True)
    fwd = ss._triton_fwd
    bwd = ss._triton_bwd
    coef = torch.full((T, 1), 0.01, device=dev)

    def loss(rows=slice(None)):  # what the deferred loss's backward runs: forward, KL rows, backward
        sc = fwd(q[rows], w[rows], k, idx[rows], True)
        klm.kl_rows(target[rows], sc, idx[rows], None, grad_out=sc)
        return klm.kl_score_backward(q[rows], w[rows], k, idx[rows], sc, coef[rows], True, False)

    tp4 = slice(T - T // 4, T)  # one TP-4 rank's rows under tp_split_rows (the last quarter: every row full)
    variants = [
        ("fwd 1 block/prog (session 10)", lambda: fwd(q, w, k, idx, True, blocks_per_prog=1), fl, False),
        ("fwd row/prog", lambda: fwd(q, w, k, idx, True), fl, False),
        ("fwd row/prog 8 warps", lambda: fwd(q, w, k, idx, True, num_warps=8), fl, False),
        ("fwd row/prog 2 stages", lambda: fwd(q, w, k, idx, True, num_stages=2), fl, False),
        ("fwd row/prog j32 4 stages", lambda: fwd(q, w, k, idx, True, block_j=32, num_stages=4), fl, False),
        ("fwd row/prog j128 8 warps", lambda: fwd(q, w, k, idx, True, block_j=128, num_warps=8), fl, False),
        ("kl rows", lambda: klm.kl_rows(target, scores, idx, None, grad_out=scores.clone()), 0.0, False),
        ("bwd j32 4 MMAs (session 10)", lambda: bwd(q, w, k, idx, grad, True, False, block_j=32, dk_t=False,
                                                    prefetch_idx=False), 3 * fl, True),
        ("bwd dk_t j64", lambda: bwd(q, w, k, idx, grad, True, False, block_j=64, dk_t=True, prefetch_idx=False),
         3 * fl, True),
        ("bwd dk_t j64 prefetch idx", lambda: bwd(q, w, k, idx, grad, True, False, block_j=64, dk_t=True,
                                                  prefetch_idx=True), 3 * fl, True),
        ("bwd dk_t j64 prefetch idx 8 warps", lambda: bwd(q, w, k, idx, grad, True, False, block_j=64, dk_t=True,
                                                          prefetch_idx=True, num_warps=8), 3 * fl, True),
        ("bwd dk_t j128 prefetch idx 8 warps", lambda: bwd(q, w, k, idx, grad, True, False, block_j=128, dk_t=True,
                                                           prefetch_idx=True, num_warps=8), 3 * fl, True),
        ("bwd deterministic (default: j32)", lambda: bwd(q, w, k, idx, grad, True, True), 3 * fl, True),
        ("loss (fwd + kl rows + bwd)", lambda: loss(), 4 * fl, False),
        ("TP4 rank: loss", lambda: loss(tp4), fl, False),
    ]
    rows = []
    for name, fn, flops, is_bwd in variants:
        if time.time() - t0 > args.budget_s:
            print(f"budget reached: skipping {name}", flush=True)
            continue
        t = time_ms(fn, warmup=1, min_iters=3, max_iters=10 if not args.cpu_smoke else 3, target_ms=500.0)
        err = ""
        if is_bwd:
            got = fn()
            err = f"{max(rel_err(a.float(), b.float()) for a, b in zip(got, ref)):.2e}"
        row = dict(kind="loss_parts", T=T, H_I=H, D_I=D, k=K, variant=name, **t,
                   tflops=round(flops / t["ms"] / 1e9, 1), err=err, **info)
        print(f"  {name}: {t['ms']:.3f} ms ({row['tflops']} TFLOP/s) err {err}", flush=True)
        rows.append(row)
    append_csv(args.csv, rows)
    os.makedirs(args.out, exist_ok=True)
    append_csv(os.path.join(args.out, "loss_parts.csv"), rows)
    print(markdown_table(rows, ["T", "H_I", "k", "variant", "ms", "p20", "p80", "tflops", "err"]))


if __name__ == "__main__":
    main()
