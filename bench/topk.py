"""HyTopK benchmark: correctness against the reference, then time against the scoring floor and stock Megatron.

One GPU, one process: (1) ``check``: HyTopK's index sets against the PyTorch reference on sampled rows of several
shapes (causal, packed, context-parallel offset, identity activation, compressed keys), determinism, and the exact
alternatives the product compiles (warm start off, the other k-th search, mask-sum slots) equal to the default bit
for bit; (2) ``main``: per shape, HyTopK, its floor (bench/_topk_floor.py: the same scoring tiles with a running
max instead of any selection; the faster of its two variants), stock Megatron's TileLang path
``fused_qk_topk_lighting`` and stock's default ``fused_qk_topk_naive`` where they fit. Appends rows to
<out>/topk.csv (``--csv bench/results/topk.csv`` adds them to the repository's results) and prints a markdown table.

On the device (stock needs the bundle that bench/device_env.sh unpacks):
  source bench/device_env.sh && python3 bench/topk.py --out $OUT --parts main --sizes 65536,131072,262144
CPU script check (Triton interpreter, tiny shapes): python bench/topk.py --smoke --out /tmp/topk
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402

_path.setup()
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

from dataclasses import replace  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from _topk_floor import hytopk_floor  # noqa: E402

from hyscale_kernels.hytopk import Config, hytopk, hytopk_reference  # noqa: E402
from hyscale_kernels.hytopk.op import default_config  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--out", default=os.environ.get("OUT", "/tmp/topk_out"))
p.add_argument("--csv", default=None, help="CSV to append to (default: <out>/topk.csv)")
p.add_argument("--budget-s", type=float, default=470.0, help="stop starting new work after this")
p.add_argument("--parts", default="check,main", help="comma list: check, main")
p.add_argument("--sizes", default="16384,32768,65536,131072,262144")
p.add_argument("--heads", default="64,32")
p.add_argument("--extra-shapes", default="qsa,csa", help="compressed-key shapes to add (comma list of qsa, csa)")
p.add_argument("--stock-max", type=int, default=131072, help="largest S for stock TileLang (2.1 s/call at 128K)")
p.add_argument("--stock-heads", default="64,32")
p.add_argument("--naive-max", type=int, default=16384)
p.add_argument("--check-specs", default=None, help="check only these spec numbers (comma list, 0-based)")
p.add_argument("--config", default=None, help="json Config fields for every HyTopK / floor call")
p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes (script check)")
args = p.parse_args()

os.makedirs(args.out, exist_ok=True)
CSV = args.csv or os.path.join(args.out, "topk.csv")
T0 = time.time()
DEV = "cpu" if args.smoke else "cuda"
GiB = 1024**3
D_I = 32 if args.smoke else 128
CFG = Config(**json.loads(args.config)) if args.config else None


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def left():
    return args.budget_s - (time.time() - T0)


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


ENV = dict(gpu="cpu" if args.smoke else torch.cuda.get_device_name(), torch=torch.__version__,
           triton=triton.__version__, megatron="",
           date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           cmd="python3 " + " ".join(sys.argv), commit=_commit())
FIELDS = ["date", "gpu", "torch", "triton", "megatron", "cmd", "shape", "impl", "H", "D", "topk", "T", "S_keys",
          "ms", "ms_p20", "ms_p80", "tflops", "x_floor", "stock_speedup", "peak_extra_GiB", "out_GiB", "config",
          "note", "commit"]


def record(**kw):
    row = {**ENV, **kw}
    new = not os.path.exists(CSV)
    with open(CSV, "a", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            wr.writeheader()
        wr.writerow(row)
    log("ROW", json.dumps(kw))


def sync():
    if not args.smoke:
        torch.cuda.synchronize()


def time_fn(fn, target_ms=800.0, min_iters=3, max_iters=50):
    """Warm-up call, then CUDA-event timing per call: (median, p20, p80) in ms."""
    fn()
    sync()
    if args.smoke:
        t = time.time()
        fn()
        ms = (time.time() - t) * 1e3
        return ms, ms, ms
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    sync()
    n = int(max(min_iters, min(max_iters, target_ms / max(s.elapsed_time(e), 1e-3))))
    ts = []
    for _ in range(n):
        s.record()
        fn()
        e.record()
        sync()
        ts.append(s.elapsed_time(e))
    ts.sort()
    q = lambda f: ts[min(len(ts) - 1, int(round(f * (len(ts) - 1))))]  # noqa: E731
    return statistics.median(ts), q(0.2), q(0.8)


def peak_extra(fn):
    if args.smoke:
        fn()
        return 0
    sync()
    empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    sync()
    pk = torch.cuda.max_memory_allocated() - base
    del out
    return pk


def empty_cache():
    if not args.smoke:
        torch.cuda.empty_cache()


def is_oom(exc):
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def make_inputs(T, S, H, seed=0, w_sign=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    dt = torch.float32 if args.smoke else torch.bfloat16  # the interpreter's bf16 dot is not bf16
    q = torch.randn(T, H, D_I, device=DEV, dtype=dt, generator=g)
    k = torch.randn(S, D_I, device=DEV, dtype=dt, generator=g)
    w = torch.randn(T, H, device=DEV, dtype=torch.float32, generator=g) * (H**-0.5 * D_I**-0.5)
    if not w_sign:
        w = w.abs()
    return q, w.to(q.dtype), k


def causal(T, ratio=1, offset=0):
    """Row t sees keys [0, (offset + t + 1) // ratio): ratio 4 = complete 4-token blocks."""
    t = torch.arange(T, device=DEV, dtype=torch.int64)
    return torch.zeros(T, dtype=torch.int32, device=DEV), ((offset + t + 1) // ratio).to(torch.int32)


def packed(seq_lens):
    st, en, base = [], [], 0
    for n in seq_lens:
        t = torch.arange(n, device=DEV, dtype=torch.int64)
        st.append(torch.full((n,), base, device=DEV, dtype=torch.int64))
        en.append(base + t + 1)
        base += n
    return torch.cat(st).to(torch.int32), torch.cat(en).to(torch.int32)


def flops(starts, ends, H):
    return float((ends.long() - starts.long()).clamp(min=0).sum().item()) * H * D_I * 2


def by_index(idx, val):
    """Rows sorted by key index, -1 padding last: launches that differ only in buffer order compare equal."""
    order = torch.where(idx < 0, torch.iinfo(torch.int32).max, idx).argsort(dim=1, stable=True)
    return idx.gather(1, order), val.gather(1, order)


# ------------------------------------------------------------------------------------------ (1) check
def check_rows(name, q, w, k, st, en, topk, relu, n_rows=192):
    """Sampled rows against the reference: exact sets, or a difference only at a near-tie with the k-th score;
    returned scores against the reference's at the same indices; two runs identical."""
    T = q.shape[0]
    idx, val = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=CFG)
    deterministic = bool(torch.equal(idx, hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True,
                                                 config=CFG)[0]))
    g = torch.Generator(device="cpu").manual_seed(1)
    rows = torch.cat([torch.arange(max(0, T - 32), T), torch.randint(0, T, (n_rows,), generator=g)]).unique().to(DEV)
    ri, rv = hytopk_reference(q[rows], w[rows], k, st[rows], en[rows], topk, relu=relu, return_scores=True,
                              chunk_rows=8)
    mi = idx[rows].long()
    n_vis = (en[rows] - st[rows]).clamp(min=0).clamp(max=topk)
    exact, worst, viol = 0, 0.0, 0
    for j in range(rows.numel()):
        a, b = set(mi[j][mi[j] >= 0].tolist()), set(ri[j][ri[j] >= 0].tolist())
        if a == b:
            exact += 1
            continue
        kth = rv[j][max(0, int(n_vis[j]) - 1)].item()
        scale = max(1e-6, rv[j][0].abs().item())
        full = _scores_at(q[rows[j]][None], w[rows[j]][None], k, torch.tensor([sorted(a - b)], device=DEV), relu)[0]
        gap = max((kth - s) / scale for s in full.tolist()) if a - b else 1.0
        worst = max(worst, gap)
        viol += int(gap > 1e-4)
    m = mi >= 0
    ref_at = _scores_at(q[rows], w[rows], k, mi, relu)
    sc_err = ((val[rows] - ref_at).abs()[m].max() / ref_at.abs()[m].max().clamp(min=1e-6)).item() if m.any() else 0.0
    res = dict(check=name, rows=int(rows.numel()), exact_rows=exact, near_tie_rows=int(rows.numel()) - exact - viol,
               violations=viol, worst_gap_rel=worst, counts_ok=bool(((mi >= 0).sum(1) == n_vis).all()),
               deterministic=deterministic, score_rel_err=sc_err)
    log("CHECK", json.dumps(res))
    return res


def _scores_at(q, w, k, idx, relu):
    s = torch.einsum("nhd,njd->nhj", q.float(), k.float()[idx.clamp(min=0)])
    return ((s.relu() if relu else s) * w.float()[:, :, None]).sum(1)


def check_alternatives(name, q, w, k, st, en, topk, relu):
    """The exact alternatives of the default launch (warm start off, the other k-th search, mask-sum slots) give its
    indices and scores bit for bit (rows sorted by key index)."""
    base = default_config(q.shape[1], topk, interpret=args.smoke)
    ref_i, ref_v = by_index(*hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=base))
    other = "radix" if base.kth_search == "interp" else "interp"
    out = []
    for cfg in (replace(base, warm_start=0), replace(base, kth_search=other), replace(base, slots="sum")):
        if cfg == base:
            continue
        i1, v1 = by_index(*hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=cfg))
        res = dict(check=f"{name} {json.dumps({f: getattr(cfg, f) for f in ('warm_start', 'kth_search', 'slots')})}",
                   equal_to_default=bool(torch.equal(i1, ref_i) and torch.equal(v1, ref_v)),
                   rows_idx_differ=int((i1 != ref_i).any(1).sum()), rows_scores_differ=int((v1 != ref_v).any(1).sum()))
        log("CHECK", json.dumps(res))
        out.append(res)
    return out


CHECKS = []
if "check" in args.parts:
    try:
        specs = [
            ("causal H64 k2048 relu 12K", 12288, 12288, 64, 2048, True, causal(12288), False),
            ("causal H32 k2048 identity w+- 9000", 9000, 9000, 32, 2048, False, causal(9000), True),
            ("packed 3 seqs H64 k512", 7000, 7000, 64, 512, True, packed([3000, 2500, 1500]), False),
            ("CP offset 4096 H64 k2048", 4096, 8192, 64, 2048, True, causal(4096, offset=4096), False),
            ("QSA H4 k512 S/4 keys", 16384, 4096, 4, 512, True, causal(16384, ratio=4), False),
            ("CSA H64 k512 S/4 keys", 16384, 4096, 64, 512, True, causal(16384, ratio=4), False),
            ("causal H16 k2048 relu 10K", 10240, 10240, 16, 2048, True, causal(10240), False),
        ]
        if args.smoke:
            specs = [("smoke causal", 40, 96, 4, 8, True, causal(40, offset=56), False),
                     ("smoke identity", 30, 30, 2, 8, False, causal(30), True)]
        only = None if not args.check_specs else {int(x) for x in args.check_specs.split(",")}
        for i_spec, (name, T, S, H, kk, relu, (st, en), wsign) in enumerate(specs):
            if only is not None and i_spec not in only:
                continue
            q, w, k = make_inputs(T, S, H, seed=T + H, w_sign=wsign)
            CHECKS.append(check_rows(name, q, w, k, st, en, kk, relu))
            if CFG is None:
                CHECKS.extend(check_alternatives(name, q, w, k, st, en, kk, relu))
            del q, w, k
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        CHECKS.append(dict(check="error", error=f"{type(exc).__name__}: {str(exc)[:300]}"))
    empty_cache()


# ------------------------------------------------------------------------------------------ (2) main table
tl_dsa = dsa_mod = None
if "main" in args.parts:
    try:
        import megatron.core

        ENV["megatron"] = getattr(megatron.core, "__version__", "?")
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo" if args.smoke else "nccl", rank=0, world_size=1)
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(1, 1)
        from megatron.core.transformer.experimental_attention_variant import dsa as dsa_mod
        try:
            import tilelang  # noqa: F401
            from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa as tl_dsa

            if tl_dsa.lighting_indexer_indices is None:
                tl_dsa = None
        except Exception as exc:  # noqa: BLE001
            log(f"stock tilelang unavailable: {exc}")
    except Exception as exc:  # noqa: BLE001
        log(f"megatron unavailable: {type(exc).__name__}: {exc}")

SHAPES = []
if "main" in args.parts and args.smoke:
    SHAPES = [("smoke DSA", 4, 8, 64, 1), ("smoke QSA", 2, 4, 64, 4)]
elif "main" in args.parts:
    sizes = [int(x) for x in args.sizes.split(",")]
    for H in [int(h) for h in args.heads.split(",")]:
        SHAPES += [(f"DSA H{H}", H, 2048, S, 1) for S in sizes]
    extra = set(filter(None, args.extra_shapes.split(",")))
    if extra - {"qsa", "csa"}:
        sys.exit(f"--extra-shapes: unknown {sorted(extra - {'qsa', 'csa'})}; use a comma list of qsa, csa (or '')")
    if "qsa" in extra:
        SHAPES += [("QSA-like H4 S/4", 4, 512, S, 4) for S in sizes]
    if "csa" in extra:
        SHAPES += [("CSA-like H64 k512 S/4", 64, 512, S, 4) for S in sizes]


def run_stock(res, base, fl, f_ms, h_ms, q, w, k, st, en, H, kk, T, ratio):
    """Stock TileLang: bf16 [S, 1, H, D] layout, fp32 [8192 x S] logits per block, torch.topk."""
    if tl_dsa is None:
        res["stock"] = "n/a"
    elif ratio != 1 or str(H) not in args.stock_heads.split(",") or T > args.stock_max:
        res["stock"] = "skipped"
    elif left() < 4 * 2.2 * (T / 131072) ** 2 + 90:
        res["stock"] = "skipped (time)"
    else:
        try:
            q4, k3, w3 = q[:, None], k[:, None], w[:, None]
            fn = lambda: tl_dsa.fused_qk_topk_lighting(q4, k3, w3, kk, st, en, block_size=8192)  # noqa: E731
            s_ms = time_fn(fn, target_ms=1500)
            res["stock"] = s_ms[0]
            record(**base, impl="stock tilelang fused_qk_topk_lighting", ms=round(s_ms[0], 3),
                   ms_p20=round(s_ms[1], 3), ms_p80=round(s_ms[2], 3), tflops=round(fl / s_ms[0] / 1e9, 1),
                   x_floor=round(s_ms[0] / f_ms, 3), peak_extra_GiB=round(peak_extra(fn) / GiB, 3))
        except Exception as exc:  # noqa: BLE001
            res["stock"] = "OOM" if is_oom(exc) else f"error {type(exc).__name__}"
            traceback.print_exc()
    if dsa_mod is not None and ratio == 1 and T <= args.naive_max and left() > 60:  # materializes fp32 [S, H, S]
        try:
            st64, en64 = st.long(), en.long()

            def fn():
                with torch.no_grad():
                    return dsa_mod.fused_qk_topk_naive(q[:, None], k[:, None], w[:, None], kk, varlen_starts=st64,
                                                       varlen_ends=en64)

            n_pk = peak_extra(fn)
            n_ms = time_fn(fn, target_ms=1000)
            res["naive"] = n_ms[0]
            record(**base, impl="stock fused_qk_topk_naive", ms=round(n_ms[0], 3), ms_p20=round(n_ms[1], 3),
                   ms_p80=round(n_ms[2], 3), tflops=round(fl / n_ms[0] / 1e9, 1), peak_extra_GiB=round(n_pk / GiB, 3))
        except Exception as exc:  # noqa: BLE001
            res["naive"] = "OOM" if is_oom(exc) else f"error {type(exc).__name__}"
        empty_cache()


def run_shape(name, H, kk, T, ratio):
    Sk = T // ratio
    q, w, k = make_inputs(T, Sk, H)
    st, en = causal(T, ratio)
    fl = flops(st, en, H)
    base = dict(shape=name, H=H, D=D_I, topk=kk, T=T, S_keys=Sk, config=json.dumps(CFG.__dict__) if CFG else "default")
    floors = []
    for impl, lazy in (("floor", False), ("floor lazy max", True)):  # a cross-warp max per tile, or one at the end
        t_f = time_fn(lambda: hytopk_floor(q, w, k, st, en, kk, config=CFG, lazy_max=lazy))
        record(**base, impl=impl, ms=round(t_f[0], 3), ms_p20=round(t_f[1], 3), ms_p80=round(t_f[2], 3),
               tflops=round(fl / t_f[0] / 1e9, 1))
        floors.append(t_f[0])
    f_ms = min(floors)
    h_ms = time_fn(lambda: hytopk(q, w, k, st, en, kk, check_bounds=False, config=CFG))
    pk = peak_extra(lambda: hytopk(q, w, k, st, en, kk, check_bounds=False, config=CFG))
    res = dict(floor=f_ms, hytopk=h_ms[0], mem=pk / GiB, out=T * kk * 4 / GiB, tf=fl / h_ms[0] / 1e9,
               tf_floor=fl / f_ms / 1e9)
    run_stock(res, base, fl, f_ms, h_ms, q, w, k, st, en, H, kk, T, ratio)
    record(**base, impl="hytopk", ms=round(h_ms[0], 3), ms_p20=round(h_ms[1], 3), ms_p80=round(h_ms[2], 3),
           tflops=round(fl / h_ms[0] / 1e9, 1), x_floor=round(h_ms[0] / f_ms, 3), peak_extra_GiB=round(pk / GiB, 4),
           out_GiB=round(res["out"], 4),
           stock_speedup=round(res["stock"] / h_ms[0], 2) if isinstance(res.get("stock"), float) else "",
           note="" if isinstance(res.get("stock"), float) else str(res.get("stock", "")))
    del q, w, k
    empty_cache()
    return res


TABLE = []
for name, H, kk, T, ratio in SHAPES:
    if left() < 3 * 6 * (T / 262144) ** 2 * H / 64 + 5:
        TABLE.append((name, H, kk, T, ratio, {"skipped": "time budget"}))
        continue
    try:
        TABLE.append((name, H, kk, T, ratio, run_shape(name, H, kk, T, ratio)))
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        TABLE.append((name, H, kk, T, ratio, {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}))
        empty_cache()


def fmt(x, nd=2):
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


lines = ["", f"GPU {ENV['gpu']} | torch {ENV['torch']} | triton {ENV['triton']} | megatron {ENV['megatron']} | "
         f"commit {ENV['commit']} | {ENV['date']}", f"`{ENV['cmd']}`"]
lines += ["check " + json.dumps(c) for c in CHECKS]
lines += ["", "| shape | H | k | tokens | keys | floor ms (TF/s) | HyTopK ms (TF/s) | x floor | stock TileLang ms | "
              "speedup | stock naive ms | HyTopK peak extra GiB (outputs GiB) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
for name, H, kk, T, ratio, r in TABLE:
    if "hytopk" not in r:
        lines.append(f"| {name} | {H} | {kk} | {T} | {T // ratio} | {r} |||||||")
        continue
    st_ms = r.get("stock", "")
    sp = f"{st_ms / r['hytopk']:.1f}x" if isinstance(st_ms, float) else ""
    lines.append(
        f"| {name} | {H} | {kk} | {T // 1024}K | {T // ratio // 1024}K | {r['floor']:.2f} ({r['tf_floor']:.0f}) | "
        f"{r['hytopk']:.2f} ({r['tf']:.0f}) | {r['hytopk'] / r['floor']:.3f} | {fmt(st_ms, 1)} | {sp} | "
        f"{fmt(r.get('naive', ''), 1)} | {r['mem']:.3f} ({r['out']:.3f}) |")
tbl = "\n".join(lines)
with open(os.path.join(args.out, "topk_table.md"), "w") as f:
    f.write(tbl + "\n")
print(tbl, flush=True)
log("done")
