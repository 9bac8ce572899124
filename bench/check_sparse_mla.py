"""GPU check of the sparse_mla Triton kernels (and selected_scores): bf16 correctness against
the fp32 reference, then forward / backward time and TFLOP/s at T = 16K, N = 128, topk = 2048.

Runs from a bare checkout: puts the repo root on sys.path and registers ``kernels/`` as the
package ``hyscale_kernels`` when it is not installed.

    python bench/check_sparse_mla.py [--quick]
    python bench/check_sparse_mla.py --resources   # no GPU needed: smem / registers / spills
                                                   # of each swept config, compiled for sm_90a
    python bench/check_sparse_mla.py --resources --only=bwd_dq_scratch,bwd_dkv_scratch
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _register_kernels():
    try:
        import hyscale_kernels  # noqa: F401
        return
    except ImportError:
        pass
    sys.path.insert(0, ROOT)
    init = os.path.join(ROOT, "kernels", "__init__.py")
    spec = importlib.util.spec_from_file_location("hyscale_kernels", init,
                                                  submodule_search_locations=[os.path.dirname(init)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["hyscale_kernels"] = mod
    spec.loader.exec_module(mod)


_register_kernels()

import torch  # noqa: E402

from hyscale_kernels.hytopk.reference import selected_scores_reference  # noqa: E402
from hyscale_kernels.hytopk.selected_scores import selected_scores  # noqa: E402
from hyscale_kernels.sparse_mla import flops, sparse_mla, sparse_mla_reference  # noqa: E402
from hyscale_kernels.sparse_mla.kernel import sparse_mla_bwd, sparse_mla_fwd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import rel_err as rel  # noqa: E402


def say(*a):
    msg = " ".join(str(x) for x in a)
    print(msg, flush=True)
    if os.environ.get("OUT"):  # written as we go: a timeout still returns what was measured
        with open(os.path.join(os.environ["OUT"], "check_sparse_mla.txt"), "a") as f:
            f.write(msg + "\n")


def causal_indices(T, S, K, seed=0):
    return common.causal_indices(T, K, "cuda", seed, S=S, rows=4096)


def check_sparse_mla(T, S, N, K, deterministic=False):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(T, N, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(S, 576, device="cuda", generator=g).bfloat16()
    idx = causal_indices(T, S, K)
    go = torch.randn(T, N, 512, device="cuda", generator=g)
    gl = torch.randn(T, N, device="cuda", generator=g)
    res = []
    for fn, a, b in ((sparse_mla, q, kv), (sparse_mla_reference, q.float(), kv.float())):
        a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
        kw = dict(deterministic=deterministic) if fn is sparse_mla else {}
        out, lse = fn(a, b, idx, 576 ** -0.5, v_dim=512, **kw)
        fin = torch.isfinite(lse)
        ((out.float() * go).sum() + (lse[fin] * gl[fin]).sum()).backward()
        res.append((out, lse, a.grad, b.grad))
    errs = {n: rel(x, y) for n, x, y in zip(("out", "lse", "dq", "dkv"), *res)}
    nan = any(torch.isnan(x.float()).any().item() for x in res[0])
    ok = all(e < 1e-2 for e in errs.values()) and not nan
    say(f"sparse_mla check T={T} S={S} N={N} K={K} det={deterministic}: "
        + " ".join(f"{n}={e:.2e}" for n, e in errs.items()) + f" nan={nan} -> {'OK' if ok else 'FAIL'}")
    return ok


def check_selected_scores(T=2048, S=4096, H=64, D=128, K=2048):
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(T, H, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(T, H, device="cuda", generator=g) * (H * D) ** -0.5
    k = torch.randn(S, D, device="cuda", generator=g).bfloat16()
    idx = causal_indices(T, S, K, seed=3)
    gg = torch.randn(T, K, device="cuda", generator=g)
    for relu in (True, False):
        res = []
        for fn, a, b in ((selected_scores, q, k), (selected_scores_reference, q.float(), k.float())):
            a, wv, b = a.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
            out = fn(a, wv, b, idx, relu=relu)
            fin = torch.isfinite(out)
            (out[fin] * gg[fin]).sum().backward()
            res.append((out, a.grad, wv.grad, b.grad))
        errs = {n: rel(x, y) for n, x, y in zip(("out", "dq", "dw", "dk"), *res)}
        say(f"selected_scores check relu={relu}: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    t_f = bench(lambda: selected_scores(q, w, k, idx), 10)
    qq, ww, kk = q.clone().requires_grad_(), w.clone().requires_grad_(), k.clone().requires_grad_()
    out = selected_scores(qq, ww, kk, idx)
    t_b = bench(lambda: torch.autograd.grad(out, (qq, ww, kk), gg, retain_graph=True), 10)
    fl = 2.0 * T * K * H * D
    say(f"selected_scores T={T} H={H} K={K}: fwd {t_f:.3f} ms ({fl / t_f / 1e9:.0f} TFLOP/s) "
        f"bwd {t_b:.3f} ms ({2 * fl / t_b / 1e9:.0f} TFLOP/s)")


def bench(fn, reps=5):
    """Median ms of `reps` timed calls after one warm-up (CUDA events)."""
    return common.time_ms(fn, min_iters=reps, max_iters=reps, target_ms=0.0)["ms"]


def perf(T, S, N, K, fwd_cfgs, bwd_cfgs):
    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(T, N, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(S, 576, device="cuda", generator=g).bfloat16()
    idx = causal_indices(T, S, K, seed=5)
    dout = torch.randn(T, N, 512, device="cuda", generator=g).bfloat16()
    f_fl, b_fl = flops(T, N, K)
    scale = 576 ** -0.5
    best = {}
    for cfg in fwd_cfgs:
        try:
            t0 = time.time()
            ms = bench(lambda: sparse_mla_fwd(q, kv, idx, scale, 512, **cfg))
            say(f"  fwd T={T} N={N} K={K} {cfg}: {ms:.2f} ms {f_fl / ms / 1e9:.0f} TFLOP/s (wall {time.time() - t0:.0f}s)")
            best["fwd"] = min(best.get("fwd", 1e9), ms)
        except Exception as ex:  # noqa: BLE001
            say(f"  fwd {cfg}: failed {type(ex).__name__}: {str(ex)[:200]}")
    out, lse = sparse_mla_fwd(q, kv, idx, scale, 512)
    for cfg in bwd_cfgs:
        try:
            t0 = time.time()
            ms = bench(lambda: sparse_mla_bwd(q, kv, idx, out, lse, dout, None, scale, 512, **cfg), 3)
            say(f"  bwd T={T} N={N} K={K} {cfg}: {ms:.2f} ms {b_fl / ms / 1e9:.0f} TFLOP/s (wall {time.time() - t0:.0f}s)")
            best["bwd"] = min(best.get("bwd", 1e9), ms)
        except Exception as ex:  # noqa: BLE001
            say(f"  bwd {cfg}: failed {type(ex).__name__}: {str(ex)[:200]}")
    return best


FWD_CFGS = [dict(block_h=64, block_k=64, num_warps=8, num_stages=2),
            dict(block_h=64, block_k=32, num_warps=8, num_stages=2),
            dict(block_h=64, block_k=32, num_warps=8, num_stages=3),
            dict(block_h=64, block_k=64, num_warps=16, num_stages=2)]
DQ_CFGS = [dict(block_h=64, block_k=32, num_warps=8, num_stages=2),
           dict(block_h=64, block_k=16, num_warps=8, num_stages=2),
           dict(block_h=64, block_k=64, num_warps=16, num_stages=2),
           dict(block_h=64, block_k=32, num_warps=16, num_stages=2)]
DKV_CFGS = [dict(block_h=32, block_k=64, num_warps=8, num_stages=1),
            dict(block_h=64, block_k=64, num_warps=8, num_stages=1),
            dict(block_h=32, block_k=64, num_warps=8, num_stages=2),
            dict(block_h=32, block_k=32, num_warps=8, num_stages=1),
            dict(block_h=16, block_k=64, num_warps=8, num_stages=2)]
FUSED_CFGS = [dict(block_h=32, block_k=16, num_warps=8, num_stages=2)]
# variant="scratch": dkv contraction of the stored P / dS (BLOCK_K keys on M, BLOCK_H heads per step)
# (64x64 with 2 stages needs 320 KB of smem: not listed)
SCRATCH_CFGS = [dict(block_h=32, block_k=64, num_warps=8, num_stages=2),
                dict(block_h=16, block_k=64, num_warps=8, num_stages=3),
                dict(block_h=16, block_k=64, num_warps=8, num_stages=2),
                dict(block_h=64, block_k=64, num_warps=8, num_stages=1),
                dict(block_h=32, block_k=32, num_warps=8, num_stages=2),
                dict(block_h=32, block_k=32, num_warps=4, num_stages=2),
                dict(block_h=32, block_k=64, num_warps=4, num_stages=2),
                dict(block_h=32, block_k=128, num_warps=8, num_stages=1)]
TARGET_CFGS = [dict(block_h=64, block_k=64, num_warps=8, num_stages=2),
               dict(block_h=64, block_k=32, num_warps=8, num_stages=2),
               dict(block_h=64, block_k=64, num_warps=8, num_stages=3),
               dict(block_h=64, block_k=64, num_warps=4, num_stages=2),
               dict(block_h=64, block_k=16, num_warps=4, num_stages=2),
               dict(block_h=32, block_k=32, num_warps=4, num_stages=2),
               dict(block_h=128, block_k=32, num_warps=8, num_stages=2),
               dict(block_h=128, block_k=16, num_warps=8, num_stages=3)]
BWD_CFGS = [dict(split=True, dq_cfg=c) for c in DQ_CFGS]  # sparse_mla_bwd kwargs: the split backward per dq config


def _compile_report(fn, sig, const, cfg):
    """Compile one kernel config for sm_90a (no GPU needed) -> one report line."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    # runtime specialization: 16-byte aligned pointers (torch allocations) and ints divisible by 16
    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
             if t.startswith("*") or a in ("N",)}
    k = triton.compile(ASTSource(fn, dict(sig, **{c: "constexpr" for c in const}), const, attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    info = "; ".join(l.split(":", 1)[-1].strip() for l in r.stderr.splitlines() if "Used" in l or "spill" in l)
    ptx = k.asm["ptx"]
    mma = "wgmma" if "wgmma" in ptx else "mma.sync"
    if "wgmma" in ptx:  # instructions per tile shape, e.g. 36 x m64n32k16: replicated tiles show as doubled counts
        import collections
        import re
        mma += " " + ",".join(f"{n}x{s}" for s, n in collections.Counter(
            re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx)).items())
    red = "red.v4" if ("red.global.v4" in ptx or ".v4.f32" in ptx and "red." in ptx) else ("red" if "red." in ptx else "-")
    return f"smem {k.metadata.shared} B ({mma}, atomics {red}, cp.async {'cp.async' in ptx}); {info}"


def resources(N=128, K=2048):
    """Compile every swept config for sm_90a without a GPU; print smem, registers, spills."""
    from hyscale_kernels._split_mma import REVISION as SPLIT_REV
    from hyscale_kernels._split_mma import install as install_split_hook
    from hyscale_kernels.indexer_loss import target as tk
    from hyscale_kernels.sparse_mla import kernel as km

    common = dict(DQK=576, V=512, R=64, K=K, BLOCK_V=512, BLOCK_R=64, IEEE=False, EVEN=True, BIG=False)
    ptrs = dict(q="*bf16", kv="*bf16", idx="*i32")
    dq_sig = dict(ptrs, o="*bf16", do="*bf16", lse="*fp32", dlse="*fp32", delta="*fp32", dq="*bf16",
                  pds="*bf16", row0="i32", dq_row0="i32", scale="fp32", scale_log2="fp32", N="i32", N_HB="i32")
    kinds = (
        ("fwd", km._sparse_mla_fwd_kernel, FWD_CFGS,
         dict(ptrs, out="*bf16", lse="*fp32", scale_log2="fp32", N="i32", N_HB="i32"), {}),
        # split_mma: the chained QK^T (and dO V^T) tiles split over the two warpgroups (kernels/_split_mma.py)
        ("fwd_split", km._sparse_mla_fwd_kernel, FWD_CFGS,
         dict(ptrs, out="*bf16", lse="*fp32", scale_log2="fp32", N="i32", N_HB="i32"), dict(SPLIT_MMA=SPLIT_REV)),
        ("bwd_dq", km._sparse_mla_bwd_dq_kernel, DQ_CFGS, dq_sig, dict(HAS_DLSE=False, SCRATCH=False)),
        ("bwd_dq_scratch_split", km._sparse_mla_bwd_dq_kernel, DQ_CFGS + [dict(DQ_CFGS[0], num_stages=1)], dq_sig,
         dict(HAS_DLSE=False, SCRATCH=True, SPLIT_MMA=SPLIT_REV)),
        # the scratch variant's dq kernel: the same plus bf16 P / dS stores per key tile
        ("bwd_dq_scratch", km._sparse_mla_bwd_dq_kernel, DQ_CFGS[:1], dq_sig, dict(HAS_DLSE=False, SCRATCH=True)),
        ("bwd_dkv_scratch", km._sparse_mla_bwd_dkv_scratch_kernel, SCRATCH_CFGS,
         dict(q="*bf16", idx="*i32", do="*bf16", pds="*bf16", dkv="*fp32", row0="i32",
              N="i32", N_KB="i32"), dict(DETERMINISTIC=False, GROUP=1)),
        # with the loss target (scratch_cfg target_sum "mma": TGT 1, "reg": TGT 2)
        ("bwd_dkv_scratch_target_mma", km._sparse_mla_bwd_dkv_scratch_kernel, SCRATCH_CFGS[:1],
         dict(q="*bf16", idx="*i32", do="*bf16", pds="*bf16", dkv="*fp32", row0="i32", N="i32", N_KB="i32",
              tgt="*fp32"), dict(DETERMINISTIC=False, GROUP=1, TGT=1)),
        ("bwd_dkv_scratch_target_reg", km._sparse_mla_bwd_dkv_scratch_kernel, SCRATCH_CFGS[:1],
         dict(q="*bf16", idx="*i32", do="*bf16", pds="*bf16", dkv="*fp32", row0="i32", N="i32", N_KB="i32",
              tgt="*fp32"), dict(DETERMINISTIC=False, GROUP=1, TGT=2)),
        # scratch_cfg group (N <= 16: one head block): 4 key blocks per program, q / dO rows loaded once
        ("bwd_dkv_scratch_group4", km._sparse_mla_bwd_dkv_scratch_kernel, SCRATCH_CFGS[1:3],
         dict(q="*bf16", idx="*i32", do="*bf16", pds="*bf16", dkv="*fp32", row0="i32",
              N="i32", N_KB="i32"), dict(DETERMINISTIC=False, GROUP=4)),
        ("bwd_dkv", km._sparse_mla_bwd_dkv_kernel, DKV_CFGS,
         dict(ptrs, do="*bf16", lse="*fp32", delta="*fp32", dkv="*fp32", row0="i32",
              scale="fp32", scale_log2="fp32", N="i32", N_KB="i32"), dict(DETERMINISTIC=False)),
        ("target", tk._target_kernel, TARGET_CFGS,
         dict(ptrs, lse="*fp32", tgt="*fp32", scale_log2="fp32", N="i32", N_HB="i32"), dict(ATOMIC=True)),
        ("target_split", tk._target_kernel, TARGET_CFGS[:1],
         dict(ptrs, lse="*fp32", tgt="*fp32", scale_log2="fp32", N="i32", N_HB="i32"),
         dict(ATOMIC=True, SPLIT_MMA=SPLIT_REV)),
        ("bwd_fused", km._sparse_mla_bwd_kernel, FUSED_CFGS,
         dict(ptrs, do="*bf16", lse="*fp32", delta="*fp32", dq="*bf16", dkv="*fp32", row0="i32",
              scale="fp32", scale_log2="fp32", N="i32", N_HB="i32"), dict(DETERMINISTIC=False)),
    )
    install_split_hook()  # compiled here directly, not through a launcher's split_flag
    only = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")]
    for name, fn, cfgs, sig, extra in kinds:
        if only and name not in only[0].split(","):
            continue
        for cfg in cfgs:
            const = dict(common, BLOCK_H=cfg["block_h"], BLOCK_K=cfg["block_k"], **extra)
            if name.startswith("bwd_dkv"):
                const["NHB"] = 1 if "GROUP" in extra else -(-N // cfg["block_h"])  # GROUP: N <= block_h
            if name.startswith("bwd_dkv_scratch"):  # no key-row gather: no BIG
                const.pop("BIG")
            try:
                say(f"{name} {cfg}: " + _compile_report(fn, sig, const, cfg))
            except Exception as ex:  # noqa: BLE001
                msg = str(ex).strip().splitlines()
                tail = " | ".join(msg[-3:])[:400]
                say(f"{name} {cfg}: compile failed {type(ex).__name__}: {msg[0] if msg else ''} ... {tail}")


def main():
    if "--resources" in sys.argv:
        return resources()
    quick = "--quick" in sys.argv
    say("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
    ok = check_sparse_mla(2048, 4096, 128, 2048)
    ok &= check_sparse_mla(1024, 2048, 24, 1000, deterministic=True)
    check_selected_scores()
    fwd_cfgs, bwd_cfgs = FWD_CFGS, BWD_CFGS
    if quick:
        fwd_cfgs, bwd_cfgs = fwd_cfgs[:1], bwd_cfgs[:1]
    say("perf (FLOPs counted on all topk slots, 2 per MAC):")
    perf(16384, 16384, 128, 2048, fwd_cfgs, bwd_cfgs)
    perf(16384, 16384, 16, 2048, [{}], [{}])
    say("ALL CHECKS OK" if ok else "SOME CHECKS FAILED")


if __name__ == "__main__":
    main()
