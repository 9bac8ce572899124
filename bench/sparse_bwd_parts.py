"""Where the sparse MLA backward spends its time: per-kernel CUDA time of the split backward (dq
kernel, dkv kernel) and of the fused one, for several configs, at N = 16 / 64 / 128 heads.

bench/sparse_attn.py times the whole backward; this script splits it with torch.profiler's CUDA
kernel records (no timing code inside the kernels), so a config can be judged per kernel:
  * `dq`: one program per (token, head block): S, P, dP, dS, dq (+ delta in its prologue);
  * `dkv`: one program per (token, key block): recomputes S, P, dP over all heads, dkv atomics.
Each variant: warm-up call, then `--reps` profiled calls; the table gives median ms per kernel
per call and the whole backward's TFLOP/s (counted as in bench/sparse_attn.py). Random bf16 data,
causal duplicate-free indices, k = 2048. Rows are appended to bench/results/sparse_bwd_parts.csv.

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
args = p.parse_args()
if args.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"
    args.T, args.heads, args.topk, args.reps = 48, "16", 32, 1
    args.csv = os.path.join(args.out, "smoke.csv")

import torch  # noqa: E402

from common import append_csv, causal_indices, env_info, markdown_table  # noqa: E402
from hyscale_kernels.sparse_mla import flops  # noqa: E402
from hyscale_kernels.sparse_mla import kernel as km  # noqa: E402

DEV = "cpu" if args.cpu_smoke else "cuda"
DT = torch.float32 if args.cpu_smoke else torch.bfloat16
SCALE = (128 + 64) ** -0.5
T0 = time.time()

# name -> sparse_mla_bwd keyword arguments; `dq4`: 4 warps for the dq kernel (M = 16 rows at N = 16)
VARIANTS = {
    "split (default)": dict(split=True),
    "split dq 4 warps": dict(split=True, dq_cfg=dict(num_warps=4)),
    "split dkv bk64": dict(split=True, dkv_cfg=dict(block_k=64, num_stages=1)),
    "split dkv 4 warps": dict(split=True, dkv_cfg=dict(num_warps=4)),
    "fused": dict(split=False),
}
KERNEL_ROLE = {"_sparse_mla_bwd_dq_kernel": "dq", "_sparse_mla_bwd_dkv_kernel": "dkv",
               "_sparse_mla_bwd_kernel": "fused"}


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
    for N in [int(h) for h in args.heads.split(",")]:
        g = torch.Generator(device=DEV).manual_seed(N)
        q = torch.randn(T, N, 576, device=DEV, dtype=DT, generator=g)
        kv = torch.randn(T, 576, device=DEV, dtype=DT, generator=g)
        out, lse = km.sparse_mla_fwd(q, kv, idx, SCALE, 512)
        dout = torch.randn(T, N, 512, device=DEV, dtype=DT, generator=g)
        _, b_fl = flops(T, N, K)
        for name, kw in VARIANTS.items():
            if time.time() - T0 > args.budget_s:
                print(f"budget reached: skipping N={N} {name}", flush=True)
                continue
            try:
                ms = per_kernel_ms(lambda: km.sparse_mla_bwd(q, kv, idx, out, lse, dout, None, SCALE, 512, **kw),
                                   args.reps)
            except Exception as ex:  # noqa: BLE001 - a config that fails to compile is a result too
                print(f"N={N} {name}: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                continue
            total = sum(ms.values())
            row = dict(kind="bwd_parts", T=T, N=N, k=K, variant=name, total_ms=round(total, 3),
                       **{f"{r}_ms": round(v, 3) for r, v in ms.items()},
                       tflops=round(b_fl / total / 1e9, 1) if total > 0 else "",
                       **{**info, "command": "bench/sparse_bwd_parts.py " + " ".join(sys.argv[1:])})
            rows.append(row)
            table.append(row)
            print(f"[{time.time() - T0:6.1f}s] N={N:4d} {name:20s} " +
                  " ".join(f"{r}={v:.2f}ms" for r, v in ms.items()), flush=True)
        del q, kv, out, lse, dout
        if DEV == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    append_csv(args.csv, rows)
    if DEV == "cuda":
        append_csv(os.path.join(args.out, "sparse_bwd_parts.csv"), rows)
    print("\n" + markdown_table(table, ["N", "variant", "total_ms", "dq_ms", "dkv_ms", "fused_ms", "other_ms",
                                        "tflops"]))


if __name__ == "__main__":
    main()
