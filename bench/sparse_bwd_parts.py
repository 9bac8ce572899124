"""Where the sparse MLA backward spends its time: per-kernel CUDA time of the split backward (dq
kernel, dkv kernel) and of the fused one, for several configs, at N = 16 / 64 / 128 heads.

bench/sparse_attn.py times the whole backward; this script splits it with torch.profiler's CUDA
kernel records (no timing code inside the kernels), so a config can be judged per kernel:
  * `dq`: one program per (token, head block): S, P, dP, dS, dq (+ delta in its prologue);
  * `dkv`: one program per (token, key block): recomputes S, P, dP over all heads, dkv atomics;
    in the `scratch` variants (the default since session 6) the dq kernel also stores dS / P per
    token chunk and the dkv kernel contracts them without recomputing (one launch pair per chunk).
Each variant: warm-up call, then `--reps` profiled calls; the table gives median ms per kernel
per call, the whole call's median by CUDA events (`event_ms`, `--reps` calls after a warm-up) and its
TFLOP/s (counted as in bench/sparse_attn.py), and `err`: the larger relative L2 error of dq / dkv
against the default backward (sparse_mla_bwd without options) on the same inputs. Random bf16 data,
causal duplicate-free indices, k = 2048. Rows are appended to bench/results/sparse_bwd_parts.csv.
Variants run in the order listed (new ones first): `--budget-s` skips the rest; `--only a,b` keeps
the variants whose name contains one of the substrings (default: env SBP_ONLY, else all).

On the H200 (device tool; no Megatron needed):
  python3 bench/sparse_bwd_parts.py --out $OUT
CPU smoke (interpreter, tiny shapes, checks the plumbing only: no CUDA kernel records on CPU):
  python3 bench/sparse_bwd_parts.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _repo  # noqa: E402,F401

p = argparse.ArgumentParser()
p.add_argument("--T", type=int, default=16384)
p.add_argument("--heads", default="16,64,128")
p.add_argument("--topk", type=int, default=2048)
p.add_argument("--reps", type=int, default=3)
p.add_argument("--budget-s", type=float, default=240.0)
p.add_argument("--out", default=os.environ.get("OUT", "/tmp/sparse_bwd_parts"))
p.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                             "sparse_bwd_parts.csv"))
p.add_argument("--cpu-smoke", action="store_true")
p.add_argument("--only", default=os.environ.get("SBP_ONLY", ""))
p.add_argument("--sorted", action="store_true",
               help="ascending index rows, -1 padding last (HyTopK's order) instead of unordered ones")
args = p.parse_args()
if args.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"
    args.T, args.heads, args.topk, args.reps = 48, "16", 32, 1
    args.csv = os.path.join(args.out, "smoke.csv")

import torch  # noqa: E402

from common import append_csv, ascending_rows, causal_indices, env_info, markdown_table  # noqa: E402
from common import rel_err, time_ms  # noqa: E402
from hyscale_kernels.sparse_mla import flops  # noqa: E402
from hyscale_kernels.sparse_mla import kernel as km  # noqa: E402

DEV = "cpu" if args.cpu_smoke else "cuda"
DT = torch.float32 if args.cpu_smoke else torch.bfloat16
SCALE = (128 + 64) ** -0.5
T0 = time.time()

# name -> sparse_mla_bwd keyword arguments. Session 6 made the scratch backward the default (H200, T = 16K:
# 164 / 95 / 41 ms at N = 128 / 64 / 16 vs split 278 / 152 / 109 and fused 348 / 174 / 65) with 16 heads per
# dkv step (3 stages) and a 4-warp dq kernel at N <= 16; the rows below compare it with its neighbours.
VARIANTS = {
    "scratch (default)": {},
    "scratch dq asm stores": dict(dq_cfg=dict(asm_stores=True)),  # session 6, untimed: P / dS stores in PTX
    # session 7, untimed: the dq kernel (64 heads x 32 keys, 8 warps) spills 616 B/thread with 2 stages on the
    # sm_90a AOT compile, 136 B with 1 stage (no cp.async prefetch of the next key rows, though)
    "scratch dq 1 stage": dict(dq_cfg=dict(num_stages=1)),
    "scratch dq 1 stage + asm": dict(dq_cfg=dict(num_stages=1, asm_stores=True)),
    # S / dP split over the two warpgroups (kernels/_split_mma.py; default since session 9: dq 103.6 -> 61.2 ms
    # at N = 128, T = 16K): sm_90a, 64 x 32 tile: 136 -> 68 wgmma per key tile, spills 552 -> 220 B
    "scratch dq no split": dict(dq_cfg=dict(split_mma=False)),
    # session 10: N <= 16 (one head block): 2 / 4 / 8 key blocks per dkv program, q / dO rows loaded once
    # (8 is the default there since session 10; "group 1" is the kernel before)
    "scratch dkv group 1": dict(scratch_cfg=dict(group=1)),
    "scratch dkv group 2": dict(scratch_cfg=dict(group=2)),
    "scratch dkv group 4": dict(scratch_cfg=dict(group=4)),
    "scratch dkv group 8": dict(scratch_cfg=dict(group=8)),
    # session 10: the few-heads dq kernel (N <= 16) prefetches its index slots by default; off, and 3 stages
    "scratch dq prefetch off": dict(dq_cfg=dict(prefetch_idx=False)),
    "scratch dq prefetch 3 stages": dict(dq_cfg=dict(num_stages=3)),
    "scratch + target": dict(target=True),  # the loss target from the dkv kernel (loss_target='backward')
    # session 12: the target's head sum as P tiles added in registers, one sum per key block (no N = 16 MMA)
    "scratch + target reg": dict(target=True, scratch_cfg=dict(target_sum="reg")),
    "scratch chunk 512": dict(chunk_tokens=512),
    "scratch dkv bh32": dict(variant="scratch", scratch_cfg=dict(block_h=32, num_stages=2)),
    "scratch dkv bk32": dict(variant="scratch", scratch_cfg=dict(block_k=32)),
    "scratch dq 4 warps": dict(variant="scratch", dq_cfg=dict(num_warps=4)),
    "scratch dq 8 warps": dict(variant="scratch", dq_cfg=dict(num_warps=8)),
    "split": dict(variant="split"),
    "split dq 4 warps": dict(variant="split", dq_cfg=dict(num_warps=4)),
    "split dkv 4 warps": dict(variant="split", dkv_cfg=dict(num_warps=4)),
    "fused": dict(variant="fused"),
}
KERNEL_ROLE = {"_sparse_mla_bwd_dkv_scratch_kernel": "dkv", "_sparse_mla_bwd_dq_kernel": "dq",
               "_sparse_mla_bwd_dkv_kernel": "dkv", "_sparse_mla_bwd_kernel": "fused"}
ONLY = [x.strip() for x in args.only.split(",") if x.strip()]


def per_kernel_ms(fn, reps):
    """{role: median ms per call} from CUDA kernel records; 'other' = everything else (zeroing, delta)."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm-up (compiles)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    per_call = []
    for _ in range(reps):
        with profile(activities=acts) as prof:
            fn()
            if DEV == "cuda":
                torch.cuda.synchronize()
        times: dict[str, float] = {}
        for e in prof.events():
            # kineto lists each kernel launch as an event on the CUDA device; its total is its own duration
            if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            dev_us = e.device_time_total
            if dev_us <= 0:
                continue
            role = next((r for k, r in KERNEL_ROLE.items() if k in e.name), "other")
            times[role] = times.get(role, 0.0) + dev_us / 1e3
        per_call.append(times)
    roles = sorted({r for t in per_call for r in t})
    return {r: statistics.median(t.get(r, 0.0) for t in per_call) for r in roles}


def main():
    info = env_info() if DEV == "cuda" else {}
    rows, table = [], []
    T, K = args.T, args.topk
    idx = causal_indices(T, K, DEV)
    if args.sorted:  # HyTopK's output order: ascending keys, padding last
        idx = ascending_rows(idx)
    for N in [int(h) for h in args.heads.split(",")]:
        g = torch.Generator(device=DEV).manual_seed(N)
        q = torch.randn(T, N, 576, device=DEV, dtype=DT, generator=g)
        kv = torch.randn(T, 576, device=DEV, dtype=DT, generator=g)
        out, lse = km.sparse_mla_fwd(q, kv, idx, SCALE, 512)
        dout = torch.randn(T, N, 512, device=DEV, dtype=DT, generator=g)
        _, b_fl = flops(T, N, K)
        ref = km.sparse_mla_bwd(q, kv, idx, out, lse, dout, None, SCALE, 512)  # the default's gradients
        for name, kw in VARIANTS.items():
            if ONLY and not any(o in name for o in ONLY):
                continue
            if time.time() - T0 > args.budget_s:
                print(f"budget reached: skipping N={N} {name}", flush=True)
                continue
            kw = dict(kw)
            if kw.pop("target", False):  # an fp32 [T, k] buffer for the loss target
                kw["target"] = torch.empty(T, K, device=DEV, dtype=torch.float32)
            call = lambda kw=kw: km.sparse_mla_bwd(q, kv, idx, out, lse, dout, None, SCALE, 512, **kw)  # noqa: E731
            try:
                ms = per_kernel_ms(call, args.reps)
                ev = time_ms(call, warmup=1, min_iters=args.reps, max_iters=args.reps, target_ms=0.0)["ms"]
                got = call()
                err = max(rel_err(got[0], ref[0]), rel_err(got[1], ref[1]))
                del got
            except Exception as ex:  # noqa: BLE001 - a config that fails to compile is a result too
                print(f"N={N} {name}: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                continue
            total = sum(ms.values())
            row = dict(kind="bwd_parts", T=T, N=N, k=K, variant=name, total_ms=round(total, 3),
                       **{f"{r}_ms": round(v, 3) for r, v in ms.items()}, event_ms=ev, err=f"{err:.2e}",
                       tflops=round(b_fl / total / 1e9, 1) if total > 0 else "", sorted_idx=int(args.sorted),
                       **{**info, "command": "bench/sparse_bwd_parts.py " + " ".join(sys.argv[1:])})
            rows.append(row)
            table.append(row)
            print(f"[{time.time() - T0:6.1f}s] N={N:4d} {name:20s} events={ev:.2f}ms err={err:.1e} " +
                  " ".join(f"{r}={v:.2f}ms" for r, v in ms.items()), flush=True)
        del q, kv, out, lse, dout, ref
        if DEV == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    if DEV == "cuda":  # the copy that comes back from a device call first
        append_csv(os.path.join(args.out, "sparse_bwd_parts.csv"), rows)
    append_csv(args.csv, rows)
    print("\n" + markdown_table(table, ["N", "variant", "event_ms", "total_ms", "dq_ms", "dkv_ms", "fused_ms",
                                        "other_ms", "tflops", "err"]))


if __name__ == "__main__":
    main()
