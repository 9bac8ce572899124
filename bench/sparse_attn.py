"""Sparse MLA attention + sparse-stage indexer loss on the GPU: ours (Triton) vs stock megatron-core's
TileLang SparseMLA (and its default PyTorch path where it fits).

Per (T, N), k = 2048 selected keys per query, causal random duplicate-free indices (S = T), bf16:
  * correctness of ``sparse_mla`` vs the fp32 reference on sampled rows (out, lse, dq) and of the
    full dkv vs stock TileLang's dkv (and vs the fp32 reference at a small size);
  * forward / backward time (median, 20/80 pct; CUDA events; warm-up; random data) and TFLOP/s
    counted on the k selected keys: fwd 2*T*N*k*(576+512), bwd 2*T*N*k*(576+512+576+576+512) =
    2.53x fwd (S, dP, dq, dkv);
  * stock TileLang: fwd kernel, bwd kernels (delta + bwd, as its autograd runs them after its
    forward recompute, which is reported separately as stock's fwd time);
  * the loss path: the forward-target loss (target kernel + selected scores + fused KL, fwd+bwd) vs
    stock's TileLang loss pieces (its target kernel in 512-row chunks + its KL kernel + its indexer
    backward on the selected scores); the deferred loss (target from the attention backward, the
    layer's default) as the difference of attention fwd+bwd with and without it; both as a fraction
    of our attention fwd+bwd.
Rows are appended to bench/results/sparse_attn.csv (and $OUT/sparse_attn.csv) with date, commit, GPU,
versions and command; a markdown table is printed last. ``--budget-s`` stops starting new measurements
past that many seconds. ``python bench/plot_sparse_attn.py`` redraws bench/results/sparse_attn.png.

On a GPU machine with stock's TileLang bundle (.whl-tl) and its kernel cache prebuilt (.tlcache, see
--prebuild-tilelang):
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl-tl/site.tar.xz && cp -r .tlcache /tmp/tlcache && \
  export PYTHONPATH=/tmp/site:$PWD TILELANG_CACHE_DIR=/tmp/tlcache PYTHONUNBUFFERED=1 && \
  python3 bench/sparse_attn.py --out $OUT
Without TileLang the stock columns stay empty (``--no-stock`` skips them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _repo  # noqa: E402,F401

p = argparse.ArgumentParser()
p.add_argument("--sizes", default="16384,65536")
p.add_argument("--heads", default="128,64,16")
p.add_argument("--topk", type=int, default=2048)
p.add_argument("--budget-s", type=float, default=420.0)
p.add_argument("--no-stock", action="store_true")
p.add_argument("--no-loss", action="store_true")
p.add_argument("--emulate-tp", type=int, default=0,
               help="also time the deferred loss with tp_split_rows as one rank (the last) of this many TP ranks, "
                    "emulated in this process: collectives are no-ops (their time is not included; their bytes are "
                    "reported)")
p.add_argument("--sorted", action="store_true",
               help="ascending index rows, -1 padding last (HyTopK's order; stock gets the same rows)")
p.add_argument("--out", default=os.environ.get("OUT", "/tmp/sparse_attn_out"))
p.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "sparse_attn.csv"))
p.add_argument("--prebuild-tilelang", action="store_true",
               help="compile stock's TileLang kernels into $TILELANG_CACHE_DIR on a machine without a GPU")
p.add_argument("--precompile-worker", default=None, help=argparse.SUPPRESS)
p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 (plumbing check)")
args = p.parse_args()
T0 = time.time()
if args.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"
    args.sizes, args.heads, args.topk, args.no_stock = "64", "16", 32, True
    args.csv = os.path.join(args.out, "smoke.csv")
SCALE = (128 + 64) ** -0.5  # DeepSeek-V3.2 softmax scale (qk_head_dim + rope)
H_I, D_I = 64, 128  # indexer heads x dim

if args.prebuild_tilelang:  # pretend to be a Hopper GPU so TileLang's target auto-detection matches the device's
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.current_device = lambda: 0

import torch  # noqa: E402


def stock_ops():
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_indexer_bwd as ib
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_indexer_loss as il
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_sparse_mla_bwd as sb
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_sparse_mla_fwd as sf
    return sf, sb, il, ib


if args.prebuild_tilelang:
    sf, sb, il, ib = stock_ops()
    for n in [int(h) for h in args.heads.split(",")]:
        t = time.time()
        sf._get_sparse_mla_fwd_kernel(heads=n, dim=512, tail_dim=64, topk=args.topk, kv_group=1, sm_scale=SCALE,
                                      block_I=64, num_stages=2, threads=256)
        sb._get_bwd_kernel(n, 512, 64, args.topk, 1, SCALE, 32)
        sb._get_preprocess_kernel(n, 512)
        il._get_target_kernel(n, 576, args.topk, SCALE)
        print(f"prebuilt N={n} in {time.time() - t:.0f}s", flush=True)
    sb._get_postprocess_kernel(512, 64, 1)
    il._get_kl_kernel(args.topk)
    print("prebuilt KL / postprocess", flush=True)
    ib._get_indexer_bwd_kernel(H_I, D_I, ib._canonical_topk(args.topk), use_relu=True)
    print("prebuilt indexer bwd", flush=True)
    sys.exit(0)

from hyscale_kernels.indexer_loss.deferred import sparse_mla_with_indexer_loss  # noqa: E402
from hyscale_kernels.indexer_loss.fused import sparse_indexer_loss  # noqa: E402
from hyscale_kernels.indexer_loss.selected_scores import selected_scores  # noqa: E402
from hyscale_kernels.indexer_loss.target import sparse_attention_target  # noqa: E402
from hyscale_kernels.sparse_mla import flops, sparse_mla, sparse_mla_reference  # noqa: E402
from hyscale_kernels.sparse_mla import kernel as km  # noqa: E402

from common import append_csv, ascending_rows, env_info, is_oom, markdown_table  # noqa: E402
from common import peak_extra_bytes, time_ms  # noqa: E402
from common import causal_indices as common_causal_indices  # noqa: E402
from common import rel_err as rel  # noqa: E402

DEV = "cpu" if args.cpu_smoke else "cuda"
DT = torch.float32 if args.cpu_smoke else torch.bfloat16
SMALL_T, SMALL_N = (48, 16) if args.cpu_smoke else (2048, 128)


def causal_indices(T, K, seed=0):
    idx = common_causal_indices(T, K, DEV, seed)
    return ascending_rows(idx) if args.sorted else idx


def precompile_worker(spec):
    """Launch every kernel config once at a tiny T (same specialization as the real runs) so the
    main process finds them in Triton's on-disk cache."""
    N = int(spec.split(":")[0])
    what = spec.split(":")[1]
    T, K = 128, args.topk
    q = torch.randn(T, N, 576, device=DEV).bfloat16()
    kv = torch.randn(max(T, 4096), 576, device=DEV).bfloat16()
    idx = torch.randint(0, kv.shape[0], (T, K), device=DEV, dtype=torch.int32)
    if what == "attn":
        out, lse = km.sparse_mla_fwd(q, kv, idx, SCALE, 512)
        km.sparse_mla_bwd(q, kv, idx, out, lse, torch.randn_like(out), None, SCALE, 512)
    else:
        out, lse = km.sparse_mla_fwd(q, kv, idx, SCALE, 512)
        qi = torch.randn(T, H_I, D_I, device=DEV).bfloat16().requires_grad_()
        w = torch.randn(T, H_I, device=DEV).requires_grad_()
        ki = torch.randn(kv.shape[0], D_I, device=DEV).bfloat16().requires_grad_()
        sparse_indexer_loss(qi, w, ki, q, kv, idx, SCALE, 0.01, lse=lse).backward()
        s = selected_scores(qi, w, ki, idx)
        s.backward(torch.randn_like(s))
        qa = q.clone().requires_grad_()
        out, _, loss = sparse_mla_with_indexer_loss(qa, kv, idx, SCALE, qi, w, ki, v_dim=512)
        torch.autograd.backward([out, loss], [torch.randn_like(out), torch.ones_like(loss)])
    torch.cuda.synchronize()


if args.precompile_worker:
    precompile_worker(args.precompile_worker)
    sys.exit(0)


def precompile(heads):
    import subprocess

    t = time.time()
    specs = [f"{n}:attn" for n in heads] + [f"{n}:loss" for n in heads]
    procs = [subprocess.Popen([sys.executable, __file__, "--precompile-worker", s, "--topk", str(args.topk)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for s in specs]
    for s, pr in zip(specs, procs):
        out, _ = pr.communicate()
        if pr.returncode:
            say(f"precompile {s} failed:\n{out[-2000:]}")
    say(f"precompiled {len(specs)} kernel sets in parallel: {time.time() - t:.0f}s")


os.makedirs(args.out, exist_ok=True)
LOG = os.path.join(args.out, "sparse_attn.log")


def say(*a):
    msg = " ".join(str(x) for x in a)
    print(msg, flush=True)
    with open(LOG, "a") as f:
        f.write(msg + "\n")


def left():
    return args.budget_s - (time.time() - T0)


INFO = dict(env_info(), sorted_idx=int(args.sorted))
ROWS = []


def emit(**r):
    row = dict(INFO, **r)
    ROWS.append(row)
    append_csv(os.path.join(args.out, "sparse_attn.csv"), [row])
    say("  " + " ".join(f"{k}={v}" for k, v in r.items()))


def timed(fn, target_ms=400.0, max_iters=10):
    return time_ms(fn, warmup=1, min_iters=3, max_iters=max_iters, target_ms=target_ms)


def main():
    sizes = [int(s) for s in args.sizes.split(",")]
    heads = [int(h) for h in args.heads.split(",")]
    K = args.topk
    say(f"device {INFO['gpu']} torch {torch.__version__} info {INFO}")
    if not args.cpu_smoke:
        precompile(heads)
    stock = None
    if not args.no_stock:
        try:
            stock = stock_ops()
            say("stock TileLang ops imported")
        except Exception as ex:  # noqa: BLE001
            say(f"stock TileLang unavailable: {type(ex).__name__}: {ex}")
    # -- small full check (dkv vs the fp32 reference), N = 128 --------------------------------------
    g = torch.Generator(device=DEV).manual_seed(1)
    T = SMALL_T
    q = torch.randn(T, SMALL_N, 576, device=DEV, generator=g).to(DT)
    kv = torch.randn(T, 576, device=DEV, generator=g).to(DT)
    idx = causal_indices(T, K, seed=2)
    go = torch.randn(T, SMALL_N, 512, device=DEV, generator=g)
    gl = torch.randn(T, SMALL_N, device=DEV, generator=g)
    res = []
    for fn, a, b in ((sparse_mla, q, kv), (sparse_mla_reference, q.float(), kv.float())):
        a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
        out, lse = fn(a, b, idx, SCALE)
        fin = torch.isfinite(lse)
        ((out.float() * go).sum() + (lse[fin] * gl[fin]).sum()).backward()
        res.append((out, lse, a.grad, b.grad))
    errs = {n: rel(x, y) for n, x, y in zip(("out", "lse", "dq", "dkv"), *res)}
    emit(kind="check", T=T, N=SMALL_N, k=K, impl="ours-vs-fp32-ref", **{f"err_{n}": f"{e:.2e}" for n, e in errs.items()},
         ok=all(e < 2e-2 for e in errs.values()))
    del q, kv, idx, go, gl, res

    table = []
    for T in sizes:
        idx = causal_indices(T, K, seed=T)
        for N in heads:
            if left() < 0:
                say(f"budget reached: skipping T={T} N={N}")
                continue
            g = torch.Generator(device=DEV).manual_seed(T + N)
            q = torch.randn(T, N, 576, device=DEV, generator=g).to(DT)
            kv = torch.randn(T, 576, device=DEV, generator=g).to(DT)
            dout = torch.randn(T, N, 512, device=DEV, generator=g).to(DT)
            f_fl, b_fl = flops(T, N, K)
            rec = dict(T=T, N=N)
            # ours
            tf = timed(lambda: km.sparse_mla_fwd(q, kv, idx, SCALE, 512))
            out, lse = km.sparse_mla_fwd(q, kv, idx, SCALE, 512)
            tb = timed(lambda: km.sparse_mla_bwd(q, kv, idx, out, lse, dout, None, SCALE, 512))
            emit(kind="attn", T=T, N=N, k=K, impl="ours", phase="fwd", **tf, tflops=round(f_fl / tf["ms"] / 1e9, 1))
            emit(kind="attn", T=T, N=N, k=K, impl="ours", phase="bwd", **tb, tflops=round(b_fl / tb["ms"] / 1e9, 1))
            rec.update(ours_fwd=tf["ms"], ours_fwd_tf=round(f_fl / tf["ms"] / 1e9), ours_bwd=tb["ms"],
                       ours_bwd_tf=round(b_fl / tb["ms"] / 1e9))
            # sampled-row correctness (out, lse, dq vs fp32 reference)
            dq, dkv = km.sparse_mla_bwd(q, kv, idx, out, lse, dout, None, SCALE, 512)
            rows = torch.randperm(T, device=DEV, generator=g)[:64]
            qr = q[rows].float().requires_grad_()
            o_r, l_r = sparse_mla_reference(qr, kv.float(), idx[rows], SCALE)
            (o_r * dout[rows].float()).sum().backward()
            errs = dict(out=rel(out[rows], o_r), lse=rel(lse[rows], l_r), dq=rel(dq[rows], qr.grad))
            # stock TileLang
            if stock is not None and left() > 0:
                sf, sb, il, ib = stock
                try:
                    kv3, idx3 = kv.unsqueeze(1).contiguous(), idx.unsqueeze(1).contiguous()
                    sfw = lambda: sf.sparse_mla_fwd_interface(q, kv3, idx3, sm_scale=SCALE)  # noqa: E731
                    t0 = time.time()
                    s_out, s_lse = sfw()
                    torch.cuda.synchronize()
                    jit_s = time.time() - t0
                    ts_f = timed(sfw)
                    dout_c = dout.contiguous()

                    def sbw():
                        delta = sb.sparse_mla_delta(s_out, dout_c)
                        return sb.sparse_mla_bwd(q, kv3, None, dout_c, idx3, s_lse, sm_scale=SCALE, delta=delta)

                    t0 = time.time()
                    s_dq, s_dkv = sbw()
                    torch.cuda.synchronize()
                    jit_s += time.time() - t0
                    ts_b = timed(sbw)
                    emit(kind="attn", T=T, N=N, k=K, impl="stock-tilelang", phase="fwd", **ts_f,
                         tflops=round(f_fl / ts_f["ms"] / 1e9, 1), first_call_s=round(jit_s, 1))
                    emit(kind="attn", T=T, N=N, k=K, impl="stock-tilelang", phase="bwd", **ts_b,
                         tflops=round(b_fl / ts_b["ms"] / 1e9, 1),
                         note="delta+bwd kernels; stock autograd also recomputes fwd first")
                    rec.update(stock_fwd=ts_f["ms"], stock_bwd=ts_b["ms"],
                               fwd_speedup=round(ts_f["ms"] / tf["ms"], 2), bwd_speedup=round(ts_b["ms"] / tb["ms"], 2))
                    # cross-checks after the timings are saved (a failure here keeps them)
                    errs["out_vs_stock"] = rel(out, s_out)
                    errs["dq_vs_stock"] = rel(dq, s_dq)
                    errs["dkv_vs_stock"] = rel(dkv, s_dkv.reshape(dkv.shape))
                    del s_out, s_lse, s_dq, s_dkv
                except Exception as ex:  # noqa: BLE001
                    say(f"stock T={T} N={N} failed: {type(ex).__name__}: {str(ex)[:300]}")
                    traceback.print_exc()
            emit(kind="check", T=T, N=N, k=K, impl="ours", **{f"err_{n}": f"{e:.2e}" for n, e in errs.items()},
                 ok=all(e < 2e-2 for e in errs.values()))
            # loss path
            if not args.no_loss and left() > 0 and (N == max(heads) or T == sizes[0]):
                try:
                    loss_path(T, N, K, q, kv, idx, lse, rec, stock)
                except Exception as ex:  # noqa: BLE001
                    say(f"loss T={T} N={N} failed: {type(ex).__name__}: {str(ex)[:300]}")
                    traceback.print_exc()
            table.append(rec)
            del q, kv, dout, out, lse, dq, dkv
            torch.cuda.empty_cache()
        del idx
    # stock default PyTorch path (dense), small size only
    if not args.no_stock and left() > 0:
        stock_default()
    append_csv(args.csv, ROWS)
    cols = ["T", "N", "ours_fwd", "ours_fwd_tf", "stock_fwd", "fwd_speedup", "ours_bwd", "ours_bwd_tf", "stock_bwd",
            "bwd_speedup", "loss_ms", "loss_frac", "deferred_loss_ms", "deferred_loss_frac", "split_rank_loss_ms",
            "split_rank_loss_frac", "stock_loss_ms",
            "loss_peak_gib"]
    say("\n" + markdown_table(table, cols))
    say(f"(ms medians, [20th-80th percentile] in the CSV; TFLOP/s on the k selected keys; total {time.time() - T0:.0f}s)")


def loss_path(T, N, K, q, kv, idx, lse, rec, stock):
    g = torch.Generator(device=DEV).manual_seed(7)
    qi = torch.randn(T, H_I, D_I, device=DEV, generator=g).to(DT)
    w = (torch.randn(T, H_I, device=DEV, generator=g) * (H_I * D_I) ** -0.5)
    ki = torch.randn(T, D_I, device=DEV, generator=g).to(DT)
    leaves = [t.clone().requires_grad_() for t in (qi, w, ki)]

    def ours():
        for t in leaves:
            t.grad = None
        sparse_indexer_loss(*leaves, q, kv, idx, SCALE, 0.01, lse=lse).backward()

    t_loss = timed(ours)
    peak = peak_extra_bytes(ours)
    t_tgt = timed(lambda: sparse_attention_target(q, kv, idx, lse, SCALE))
    attn = rec["ours_fwd"] + rec["ours_bwd"]
    emit(kind="loss", T=T, N=N, k=K, impl="ours", phase="fwd+bwd", **t_loss, frac_of_attn=round(t_loss["ms"] / attn, 3),
         target_ms=t_tgt["ms"], peak_extra_gib=round(peak / 2 ** 30, 2))
    rec.update(loss_ms=t_loss["ms"], loss_frac=round(t_loss["ms"] / attn, 3), loss_peak_gib=round(peak / 2 ** 30, 2))
    if left() > 0:
        deferred_loss_path(T, N, K, q, kv, idx, leaves, rec)
    if stock is None or left() < 0:
        return
    sf, sb, il, ib = stock
    with torch.no_grad():
        scores = selected_scores(qi, w, ki, idx)
    valid = idx >= 0
    g_sc = torch.empty_like(scores)

    def stock_loss():
        tot = 0.0
        for r0 in range(0, T, 512):  # stock's seq_chunk_size
            r1 = min(T, r0 + 512)
            tgt = il.sparse_indexer_target_interface(q[r0:r1], kv, idx[r0:r1], SCALE)
            kl, gl = il.sparse_indexer_kl_interface(tgt, scores[r0:r1], valid[r0:r1])
            g_sc[r0:r1] = gl
            tot = tot + kl
        return ib.indexer_bwd_interface(qi, w, ki, idx, g_sc, use_relu=True), tot

    t0 = time.time()
    stock_loss()
    torch.cuda.synchronize()
    jit = time.time() - t0
    t_s = timed(stock_loss)
    emit(kind="loss", T=T, N=N, k=K, impl="stock-tilelang", phase="target+kl+indexer_bwd", **t_s, first_call_s=round(jit, 1),
         note="stock gets the selected scores from its selection; excluded here")
    rec.update(stock_loss_ms=t_s["ms"])


class EmulatedTPRank:
    """Rank ``rank`` of a ``size``-rank TP group inside this single-GPU process, for timing one rank's share of
    ``tp_split_rows`` (kernels/indexer_loss/deferred.py) on one GPU. Within ``with``:
    torch.distributed reports itself initialised, get_rank answers ``rank``, all_reduce does nothing and
    all_gather copies the local part into every slot (so shapes and the local copies are real; the collectives'
    transfer time is NOT included: see comm_bytes)."""

    def __init__(self, size: int, rank: int):
        self._size, self.rank = size, rank

    def size(self) -> int:
        return self._size

    def __enter__(self):
        d = torch.distributed
        self._saved = (d.is_initialized, d.get_rank, d.all_reduce, d.all_gather)
        d.is_initialized = lambda: True
        d.get_rank = lambda group=None: self.rank
        d.all_reduce = lambda t, group=None, **kw: None

        def all_gather(parts, t, group=None, **kw):
            for part in parts:
                part.copy_(t)
        d.all_gather = all_gather
        return self

    def __exit__(self, *exc):
        d = torch.distributed
        d.is_initialized, d.get_rank, d.all_reduce, d.all_gather = self._saved
        return False


def split_comm_bytes(T, K, S, H, D, tp):
    """Bytes each collective of the split loss moves (whole tensors): the target all-reduce [T, k] fp32 (also
    without the split, whenever heads are sharded), dq all-gather [T, H, D] bf16, dw all-gather [T, H] fp32, dk
    all-reduce [S, D] fp32."""
    return dict(target_allreduce=T * K * 4, dq_allgather=T * H * D * 2, dw_allgather=T * H * 4,
                dk_allreduce=S * D * 4)


def deferred_loss_path(T, N, K, q, kv, idx, leaves, rec):
    """The loss with its target from the attention backward (indexer_loss/deferred.py, the layer's default):
    its cost is the difference between attention fwd+bwd with the loss and without it, both through the
    autograd ops, timed alternately in this process (medians of each; the difference of the medians)."""
    qa, kva = q.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    dout = torch.randn(T, N, 512, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3)).to(DT)
    one = torch.ones((), device=DEV)

    def attn_only():
        qa.grad = kva.grad = None
        out, _ = sparse_mla(qa, kva, idx, SCALE, v_dim=512, check_index_range=False)
        out.backward(dout)

    def attn_loss():
        for t in (qa, kva, *leaves):
            t.grad = None
        out, _, loss = sparse_mla_with_indexer_loss(qa, kva, idx, SCALE, *leaves, v_dim=512, check_index_range=False)
        torch.autograd.backward([out, loss], [dout, one * 0.01])

    tp = args.emulate_tp
    grp = EmulatedTPRank(tp, tp - 1) if tp > 1 else None  # the last rank: every row has k indices (causal)

    def attn_loss_split():
        for t in (qa, kva, *leaves):
            t.grad = None
        with grp:
            out, _, loss = sparse_mla_with_indexer_loss(qa, kva, idx, SCALE, *leaves, v_dim=512,
                                                        check_index_range=False, tp_group=grp, tp_split_rows=True)
            torch.autograd.backward([out, loss], [dout, one * 0.01])

    a, b, c = [], [], []
    for _ in range(3 if grp else 2):  # alternate: drift hits all alike
        a.append(timed(attn_only, target_ms=0, max_iters=3)["ms"])
        b.append(timed(attn_loss, target_ms=0, max_iters=3)["ms"])
        if grp:
            c.append(timed(attn_loss_split, target_ms=0, max_iters=3)["ms"])
    ta, tb = statistics.median(a), statistics.median(b)
    d = tb - ta
    emit(kind="loss", T=T, N=N, k=K, impl="ours-deferred", phase="attn fwd+bwd with loss - without", ms=round(d, 3),
         attn_only_ms=round(ta, 3), attn_with_loss_ms=round(tb, 3), frac_of_attn=round(d / ta, 3))
    rec.update(deferred_loss_ms=round(d, 3), deferred_loss_frac=round(d / ta, 3))
    if grp:
        tc = statistics.median(c)
        nbytes = split_comm_bytes(T, K, kv.shape[0], leaves[0].shape[1], leaves[0].shape[2], tp)
        emit(kind="loss", T=T, N=N, k=K, impl=f"ours-deferred tp_split_rows, 1 of {tp} ranks (emulated)",
             phase="attn fwd+bwd with loss - without, one rank's compute", ms=round(tc - ta, 3),
             attn_only_ms=round(ta, 3), attn_with_loss_ms=round(tc, 3), frac_of_attn=round((tc - ta) / ta, 3),
             note="collectives not run (one process): bytes "
                  + ", ".join(f"{n} {v / 2 ** 20:.1f} MiB" for n, v in nbytes.items()))
        rec.update(split_rank_loss_ms=round(tc - ta, 3), split_rank_loss_frac=round((tc - ta) / ta, 3))


def stock_default():
    """Stock's default (PyTorch) absorbed sparse attention, fwd+bwd, at sizes that fit."""
    try:
        from megatron.core.transformer.experimental_attention_variant.dsa import _unfused_absorbed_dsa_fn
    except Exception as ex:  # noqa: BLE001
        say(f"stock default path unavailable: {ex}")
        return
    for T, N in ((4096, 16), (16384, 16)):
        if left() < 0:
            return
        g = torch.Generator(device=DEV).manual_seed(3)
        idx = causal_indices(T, args.topk, seed=5)
        q = torch.randn(T, N, 576, device=DEV, generator=g).to(DT).requires_grad_()
        kv = torch.randn(T, 576, device=DEV, generator=g).to(DT).requires_grad_()

        def fb():
            o = _unfused_absorbed_dsa_fn(q[:, None], kv[:, None, None], idx[None], SCALE, 512)
            o.float().sum().backward()

        try:
            t = timed(fb, max_iters=3)
            f_fl, b_fl = flops(T, N, args.topk)
            emit(kind="attn", T=T, N=N, k=args.topk, impl="stock-default", phase="fwd+bwd", **t,
                 tflops=round((f_fl + b_fl) / t["ms"] / 1e9, 2))
        except Exception as ex:  # noqa: BLE001
            emit(kind="attn", T=T, N=N, k=args.topk, impl="stock-default", phase="fwd+bwd",
                 note=("OOM" if is_oom(ex) else f"{type(ex).__name__}: {str(ex)[:100]}"))
            torch.cuda.empty_cache()
            return


if __name__ == "__main__":
    main()
