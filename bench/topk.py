"""HyTopK benchmark: correctness vs the reference, then time vs the no-selection floor and stock.

Runs on one GPU. In one process: (1) checks HyTopK's index sets against the PyTorch reference on
sampled rows of several shapes (causal, packed, CP offsets, identity activation, compressed
keys); (2) optionally sweeps launch configs at one shape; (3) times, per shape, HyTopK, the floor
(the same scoring tile loop, head sum fused, a running max instead of any selection), stock
Megatron's TileLang path ``fused_qk_topk_lighting`` and stock's default ``fused_qk_topk_naive``
where they fit. Appends rows to bench/results/topk.csv (or --csv) and prints a markdown table.

On the device (stock needs the bundle from ../shared/tools/stock-tilelang-bundle.sh):
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl-tl/site.tar.xz && \
  export PYTHONPATH=/tmp/site:$PWD TILELANG_CACHE_DIR=/tmp/tlcache PYTHONUNBUFFERED=1 && \
  python3 bench/topk.py --out $OUT
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402

ROOT = _path.setup()
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

from dataclasses import replace  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from hyscale_kernels.hytopk import Config, hytopk, hytopk_floor  # noqa: E402
from hyscale_kernels.hytopk.op import default_config, warm_stats  # noqa: E402
from hyscale_kernels.hytopk.reference import hytopk_reference  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", default=os.environ.get("OUT", "/tmp/topk_out"))
p.add_argument("--csv", default=None, help="CSV to append to (default: <out>/topk.csv)")
p.add_argument("--budget-s", type=float, default=470.0, help="stop starting new work after this")
p.add_argument("--parts", default="check,sweep,main",
               help="comma list: check, sweep, ablate (where the time over the floor goes: --sweep-S, --sweep-heads 64/32, "
                    "--ab-rounds rounds), profile (the same split from clock64 at the kernel's phase boundaries: "
                    "op.hytopk_profile; --profile-variants), main")
p.add_argument("--sizes", default="16384,32768,65536,131072,262144")
p.add_argument("--heads", default="64,32")
p.add_argument("--stock-max", type=int, default=131072, help="largest S for stock TileLang (2.1 s/call at 128K)")
p.add_argument("--extra-shapes", default="qsa,csa",
               help="with --parts main: the compressed-key shapes to add (comma list of qsa, csa; '' for none)")
p.add_argument("--stock-heads", default="64,32")
p.add_argument("--naive-max", type=int, default=16384)
p.add_argument("--sweep-S", type=int, default=65536)
p.add_argument("--sweep-cfgs", default=None, help="time only these sweep configs (comma list of cfg numbers)")
p.add_argument("--ab-rounds", type=int, default=0,
               help="with --parts sweep: time the --sweep-cfgs interleaved this many rounds (A B C A B C ...; the "
                    "lazy floor of each launch shape in every round) and report medians over the rounds, for "
                    "differences smaller than the drift between configs timed one after another")
p.add_argument("--sweep-heads", default="64,4",
               help="sweep shapes: 64 (DeepSeek, k 2048), 32 (GLM, k 2048) and/or 4 (QSA-like, k 512 over S/4 keys)")
p.add_argument("--check-specs", default=None, help="check only these spec numbers (comma list, 0-based)")
p.add_argument("--check-variants", default=None,
               help="';'-separated json Config overrides compared bit for bit to the default in the check "
                    "(default: warm start off / 512, append tile, search_bits 1); skips the reference row check")
p.add_argument("--config", default=None, help="json Config fields for every HyTopK/floor call")
p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes (script check)")
p.add_argument("--resources", action="store_true",
               help="no GPU needed: compile the sweep configs (H 64, D 128, k 2048, bf16) for sm_90a and print "
                    "smem / registers / spills / local-memory ops in the key loop, then exit")
p.add_argument("--ablate-variants", default=None,
               help="with --parts ablate: ';'-separated json Config overrides; each adds a part timing ablation 7 (no "
                    "candidates, no final select, one segment) with that config, replacing the built-in ablations (the full "
                    "kernel, ablation 7 without a warm start and the floor stay): the warm start's own cost under each (e.g. {\"warm_start\":512};{\"kth_search\":\"radix\"})")
p.add_argument("--profile-variants", default=None,
               help="with --parts profile: ';'-separated json Config overrides of the default, each profiled and timed "
                    "beside it (interleaved rounds: --ab-rounds); the pseudo-field \"kernel\": \"path/_kernel.py\" times "
                    "another copy of the kernel file (e.g. the last commit's) instead of the checkout's")
p.add_argument("--resource-variants", default=None,
               help="with --resources: ';'-separated json Config overrides of the default to compile instead of the "
                    "built-in list (the default and its lazy floor come first)")
args = p.parse_args()
if args.smoke:
    os.environ["TRITON_INTERPRET"] = "1"


def resources(cfgs, H=64, D=128, kk=2048):
    """AOT-compile HyTopK for sm_90a (no GPU): one line per config (a ("floor", cfg) entry compiles the
    no-selection floor, SELECT=False). 'key loop' is the innermost SASS loop holding the main loop's
    HGMMA: its instructions, local-memory (spill) LDL/STL, BAR.SYNC, LDS and STS (shared-memory round
    trips of layout conversions, scans and cross-warp reductions) per 64-key tile."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hyscale_kernels.hytopk import _kernel, op

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    fn = _kernel.hytopk_kernel
    names = list(fn.arg_names)
    sig = dict(q_ptr="*bf16", w_ptr="*bf16", k_ptr="*bf16", starts_ptr="*i32", ends_ptr="*i32", out_idx_ptr="*i32",
               out_val_ptr="*fp32", buf_key_ptr="*i32", buf_idx_ptr="*i32", stats_ptr="*i32", prof_ptr="*i64", T="i32", S="i32",
               kk="i32", n_blocks="i32", n_p="i32")
    sig = {a: sig[a] for a in names if a in sig}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
    for i, cfg in enumerate(cfgs):
        select = not (isinstance(cfg, tuple) and cfg[0] in ("floor", "floor lazy max"))
        lazy = not select and cfg[0] == "floor lazy max"
        cfg = cfg if select else cfg[1]
        const = op.kernel_constexprs(cfg, H, D, kk, select=select, relu=True, write_scores=False, ieee=False,
                                     interp=False, lazy_max=lazy)
        try:
            t0 = time.time()
            kern = triton.compile(ASTSource(fn, dict(sig, **{c: "constexpr" for c in const}), const, attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
            d = tempfile.mkdtemp()
            with open(os.path.join(d, "k.ptx"), "w") as f:
                f.write(kern.asm["ptx"])
            r = subprocess.run([os.path.join(bindir, "ptxas"), "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"),
                                "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
            info = "; ".join(x.split(":", 1)[-1].strip() for x in r.stderr.splitlines()
                             if "Used" in x or "spill" in x)
            sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", os.path.join(d, "k.cubin")],
                                  capture_output=True, text=True).stdout
            lines, labels = [], {}
            for x in sass.splitlines():
                m = re.match(r"^\s*(\.L_x_\d+):", x)
                if m:
                    labels[m.group(1)] = len(lines)
                elif re.search(r"/\*[0-9a-f]{4,}\*/", x):
                    lines.append(x)
            loops = []  # (start, end) of backward branches whose body holds an HGMMA
            for j, x in enumerate(lines):
                m = re.search(r"BRA\s.*?\((\.L_x_\d+)\)", x)
                t = labels.get(m.group(1), 1 << 30) if m else 1 << 30
                if t < j and any("HGMMA" in y for y in lines[t:j]):
                    loops.append((t, j))
            inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
            a, b = max(inner, key=lambda lp: lp[0]) if inner else (0, -1)  # the last innermost one: the key loop
            loop = [re.sub(r"^.*?\*/\s*(@!?U?P\w+\s+)?", "", x) for x in lines[a:b + 1]]  # opcode first
            n = {op_: sum(x.startswith(op_) for x in loop) for op_ in ("LDL", "STL", "BAR.SYNC", "LDS", "STS")}
            name = f"{'floor lazy max' if lazy else 'floor'} {cfg}" if not select else str(cfg)
            print(f"#{i} {name}: {time.time() - t0:.0f}s smem {kern.metadata.shared} B, cp.async "
                  f"{'cp.async' in kern.asm['ptx']}; {info}; key loop {len(loop)} instrs, LDL/STL "
                  f"{n['LDL'] + n['STL']}, BAR.SYNC {n['BAR.SYNC']}, LDS {n['LDS']}, STS {n['STS']}", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"#{i} {cfg}: compile failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if args.resources:  # the default launch (append warps, 2-bit select, warm start 1024, raw keys, chain head sum),
    # the interpolation k-th search, the mask append (the default until session 15), the prefix-started select
    # (both appends), the session-11 parts (int keys, pair head sum), warm start off / 512, the prefix-sum append,
    # 1-bit select, the floors
    _base = Config()
    _mask = replace(_base, append="mask")
    if args.resource_variants:
        resources([_base, ("floor lazy max", _base)]
                  + [replace(_base, **json.loads(v)) for v in args.resource_variants.split(";") if v.strip()])
        sys.exit(0)
    resources([_base, replace(_base, kth_search="interp"), _mask, replace(_mask, select_prefix=True),
               replace(_base, select_prefix=True), replace(_mask, raw_keys=False),
               replace(_base, head_sum="pairs"),
               replace(_mask, raw_keys=False, head_sum="pairs"), replace(_base, warm_start=0),
               replace(_base, warm_start=512),
               replace(_base, append="tile"),
               replace(_mask, search_bits=1), replace(_base, append="tile", search_bits=1), ("floor", _base),
               ("floor lazy max", _base), ("floor lazy max", replace(_base, head_sum="pairs"))])
    sys.exit(0)

os.makedirs(args.out, exist_ok=True)
CSV = args.csv or os.path.join(args.out, "topk.csv")
T0 = time.time()
DEV = "cpu" if args.smoke else "cuda"
GiB = 1024**3
D_I = 32 if args.smoke else 128


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def left():
    return args.budget_s - (time.time() - T0)


ENV = dict(
    gpu="cpu" if args.smoke else torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, megatron="",
    date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    cmd="python3 " + " ".join(sys.argv),
)
ROWS = []
FIELDS = ["date", "gpu", "torch", "triton", "megatron", "cmd", "shape", "impl", "H", "D", "topk", "T", "S_keys",
          "ms", "ms_p20", "ms_p80", "tflops", "x_floor", "stock_speedup", "peak_extra_GiB", "out_GiB", "config",
          "note"]


def record(**kw):
    row = {**ENV, **kw}
    ROWS.append(row)
    new = not os.path.exists(CSV)
    with open(CSV, "a", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            wr.writeheader()
        wr.writerow(row)
    log("ROW", json.dumps({k: v for k, v in kw.items()}))


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
    est = s.elapsed_time(e)
    n = int(max(min_iters, min(max_iters, target_ms / max(est, 1e-3))))
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


# ------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------
def make_inputs(T, S, H, seed=0, w_sign=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    dt = torch.float32 if args.smoke else torch.bfloat16  # the interpreter's bf16 dot is wrong
    q = torch.randn(T, H, D_I, device=DEV, dtype=dt, generator=g)
    k = torch.randn(S, D_I, device=DEV, dtype=dt, generator=g)
    w = torch.randn(T, H, device=DEV, dtype=torch.float32, generator=g) * (H**-0.5 * D_I**-0.5)
    if not w_sign:
        w = w.abs()
    return q, w.to(q.dtype), k


def causal(T, ratio=1, offset=0):
    """Row t sees keys [0, (offset + t + 1) // ratio): ratio 4 = complete 4-token blocks."""
    t = torch.arange(T, device=DEV, dtype=torch.int64)
    ends = ((offset + t + 1) // ratio).to(torch.int32)
    return torch.zeros(T, dtype=torch.int32, device=DEV), ends


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


CFG = Config(**json.loads(args.config)) if args.config else None


# ------------------------------------------------------------------------------------------
# (1) correctness on sampled rows
# ------------------------------------------------------------------------------------------
def check_rows(name, q, w, k, st, en, topk, relu, n_rows=192, cfg=None):
    T = q.shape[0]
    idx, val = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=cfg)
    idx2 = hytopk(q, w, k, st, en, topk, relu=relu, config=cfg)
    deterministic = bool(torch.equal(idx, idx2))
    g = torch.Generator(device="cpu").manual_seed(1)
    rows = torch.cat([torch.arange(max(0, T - 32), T), torch.randint(0, T, (n_rows,), generator=g)]).unique().to(DEV)
    ri, rv = hytopk_reference(q[rows], w[rows], k, st[rows], en[rows], topk, relu=relu, return_scores=True,
                              chunk_rows=8)
    mi = idx[rows].long()
    n_vis = (en[rows] - st[rows]).clamp(min=0).clamp(max=topk)
    cnt_ok = bool(((mi >= 0).sum(1) == n_vis).all())
    exact = 0
    worst = 0.0
    viol = 0
    for j in range(rows.numel()):
        a = set(mi[j][mi[j] >= 0].tolist())
        b = set(ri[j][ri[j] >= 0].tolist())
        if a == b:
            exact += 1
            continue
        # allowed only at a near-tie on the boundary: our extra picks score within tol of the kth
        kth = rv[j][max(0, int(n_vis[j]) - 1)].item()
        scale = max(1e-6, rv[j][0].abs().item())
        extra = a - b
        full = _row_scores(q[rows[j]], w[rows[j]], k, relu)
        gap = max((kth - full[i].item()) / scale for i in extra) if extra else 1.0
        worst = max(worst, gap)
        viol += int(gap > 1e-4)
    # scores returned must match the reference scores at those indices (fp32 accumulation order)
    ours = val[rows]
    ref_at = _scores_at(q[rows], w[rows], k, mi, relu)
    m = mi >= 0
    sc_err = ((ours - ref_at).abs()[m].max() / ref_at.abs()[m].max().clamp(min=1e-6)).item() if m.any() else 0.0
    res = dict(check=name, rows=int(rows.numel()), exact_rows=exact, near_tie_rows=int(rows.numel()) - exact - viol,
               violations=viol, worst_gap_rel=worst, counts_ok=cnt_ok, deterministic=deterministic,
               score_rel_err=sc_err)
    log("CHECK", json.dumps(res))
    return res


def _row_scores(qr, wr, k, relu):
    s = torch.einsum("hd,sd->hs", qr.float(), k.float())
    if relu:
        s = s.relu()
    return (s * wr.float()[:, None]).sum(0)


def _scores_at(q, w, k, idx, relu):
    ks = k.float()[idx.clamp(min=0)]  # [n, topk, D]
    s = torch.einsum("nhd,njd->nhj", q.float(), ks)
    if relu:
        s = s.relu()
    return (s * w.float()[:, :, None]).sum(1)


def by_index(idx, val):
    """Rows sorted by key index, -1 padding last (the order of every append but "warps")."""
    order = torch.where(idx < 0, torch.iinfo(torch.int32).max, idx).argsort(dim=1, stable=True)
    return idx.gather(1, order), val.gather(1, order)


def variant_cfgs(base):
    """Exact variants the check compares to the default (rows sorted by key index): warm start off / 512 (the
    default before session 10), the "mask" append (the default until session 15), the prefix-sum append and the
    1-bit select (the defaults before session 6), the select starting below the shared leading bits."""
    rdx = replace(base, kth_search="radix")  # default_config: "interp" from topk 1024 (session 15)
    one = dict(select_split=1)  # the other appends: whole-block selects (split selects need "warps"; H 16 / 32)
    return [replace(base, warm_start=0), replace(base, warm_start=512), replace(base, append="mask", **one),
            replace(base, append="tile", **one), replace(rdx, append="mask", search_bits=1, **one), rdx,
            replace(rdx, select_prefix=True), replace(rdx, append="mask", select_prefix=True, **one)]


WARM_CHECK_SPECS = (0, 1, 2, 4, 6)  # causal relu, identity w+-, packed, QSA H4, H16


def check_warm(name, q, w, k, st, en, kk, relu):
    """Config.warm_start (and search_bits=2) are exact: the output must equal the default's bit for bit
    after sorting each row by key index (the "warps" append, the default since session 15, returns rows in its
    buffer's order; the others ascending); also how many rows used the sampled threshold / fell back
    to -inf. Where it differs, the rows are classified: indices differ (a different selection), or only
    the returned fp32 scores differ (same selection; the variant's compiled head sum rounds differently)."""
    base = default_config(q.shape[1], kk, interpret=args.smoke)
    ref_i, ref_v = by_index(*hytopk(q, w, k, st, en, kk, relu=relu, return_scores=True, config=base))
    out = []
    variants = variant_cfgs(base)
    if args.check_variants:
        variants = [replace(base, **json.loads(v)) for v in args.check_variants.split(";")]
    for cfg in variants:
        i1, v1 = hytopk(q, w, k, st, en, kk, relu=relu, return_scores=True, config=cfg)
        ws = warm_stats() if cfg.warm_start else None
        i2, v2 = hytopk(q, w, k, st, en, kk, relu=relu, return_scores=True, config=cfg)
        det = bool(torch.equal(i1, i2) and torch.equal(v1, v2))  # as returned (order included)
        n_nondet = int((i1 != i2).any(1).sum())
        i1, v1 = by_index(i1, v1)  # "warps": buffer order; the other appends: already ascending
        idx_rows = (i1 != ref_i).any(1)
        val_rows = ~(torch.isclose(v1, ref_v, rtol=0, atol=0) | (torch.isinf(v1) & torch.isinf(ref_v))).all(1)
        # scores of the variant vs the default where both picked the same slot index: rounding only?
        same = (i1 == ref_i) & (i1 >= 0)
        max_rel = float(((v1 - ref_v).abs() / ref_v.abs().clamp_min(1e-30))[same].max()) if same.any() else 0.0
        res = dict(check=f"{name} warm_start={cfg.warm_start} search_bits={cfg.search_bits} append={cfg.append}"
                         f" prefix={int(cfg.select_prefix)} kth={cfg.kth_search}",
                   equal_to_default=bool(torch.equal(i1, ref_i) and torch.equal(v1, ref_v)),
                   rows_idx_differ=int(idx_rows.sum()), rows_scores_differ=int(val_rows.sum()),
                   same_slot_score_max_rel=max_rel,
                   deterministic=det, rows_nondeterministic=n_nondet, **(ws or {}))
        if idx_rows.any():  # first differing row: are the two selections both valid top-k sets?
            r = int(idx_rows.nonzero()[0, 0])
            a, b = set(i1[r].tolist()) - {-1}, set(ref_i[r].tolist()) - {-1}
            res.update(first_row=r, row_visible=int(en[r] - st[r]), n_variant=len(a), n_default=len(b),
                       only_variant=len(a - b), only_default=len(b - a))
        log("CHECK", json.dumps(res))
        out.append(res)
    return out


CHECKS = []
if "check" in args.parts:
    try:
        specs = [] if args.smoke else [
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
            if not args.check_variants:
                CHECKS.append(check_rows(name, q, w, k, st, en, kk, relu, cfg=CFG))
            if CFG is None and (i_spec in WARM_CHECK_SPECS or args.check_variants):
                CHECKS.extend(check_warm(name, q, w, k, st, en, kk, relu))
            del q, w, k
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        CHECKS.append(dict(check="error", error=f"{type(exc).__name__}: {str(exc)[:300]}"))
    empty_cache()


# ------------------------------------------------------------------------------------------
# (2) config sweep
# ------------------------------------------------------------------------------------------
_D = replace(Config(), append="mask")  # the default launch until session 15 (session 6: append "mask", search_bits
# 2, warm start 512; s. 7: 3 stages; s. 9: lane_rows; s. 10: the early-stopping 2-bit select replaced the full one,
# warm start 1024). Session 15 made append="warps" the default (cfg23 here); the cfg numbers keep their meaning.
SWEEP = [
    _D,
    replace(_D, num_warps=8, num_stages=3, programs_per_sm=1),
    replace(_D, rows_x_heads=128, num_stages=3),
    replace(_D, block_n=128, rows_x_heads=128, num_warps=8, programs_per_sm=1, append="tile"),
    replace(_D, num_stages=2),  # cfg4: the default before session 7
    replace(_D, warm_start=0),
    replace(_D, warm_start=512),  # cfg6: the warm start before session 10 (until then: 1024, a larger sample)
    replace(_D, append="tile"),  # cfg7: the prefix-sum append
    replace(_D, search_bits=1),  # cfg8: the 1-bit select
    replace(_D, append="tile", search_bits=1),  # cfg9: the default before session 6
    replace(_D, cap_mult=4),  # cfg10: twice the candidate slots, fewer compactions
    replace(_D, lane_rows=False),  # cfg11: the default before session 9 (lane_rows: whole rows per accumulator
    # lane; 64K H64 88.8 -> 75.2 ms on the H200)
    replace(_D, rows_x_heads=512, num_warps=8, programs_per_sm=1),  # cfg12: 8 rows per tile (lane_rows frees
    # registers), one wider MMA per tile
    replace(_D, min_free_tiles=2),  # cfg13: compact later (fewer, fuller compactions)
    replace(_D, warm_start=256),  # cfg14: a cheaper warm-start sample
    replace(_D, num_stages=4),  # cfg15
    replace(_D, warm_start=512),  # cfg16 (= cfg6): session 10 timed the early-stopping 2-bit select here (then
    # opt-in; ~11 of 17 passes on simulated 64K candidate sets): H 64 75.25 -> 74.54 ms vs the full 2-bit search
    replace(_D, warm_start=2048),  # cfg17: a still larger sample (1024, the default since session 10, keeps
    # ~3.1K candidates per 64K row instead of ~4.2K at 512: no compaction before the final select)
    replace(_D, search_bits=1, warm_start=512),  # cfg18: the 1-bit full search at the session-9 warm start
    replace(_D, raw_keys=True),  # cfg19: session 11, the candidate test on fp32 scores, raw-bit buffers (= cfg0
    # since session 12)
    replace(_D, raw_keys=False),  # cfg20: int keys in the key loop (the default until session 12)
    replace(_D, head_sum="pairs"),  # cfg21: the head sum's order until session 12 (FMUL + FFMA per head pair)
    replace(_D, raw_keys=False, head_sum="pairs"),  # cfg22: the session-11 default
    replace(_D, append="warps"),  # cfg23: session 13, per-warp candidate regions (no cross-warp exchange per tile)
    replace(_D, append="warps", num_stages=4),  # cfg24
    replace(_D, append="warps", warm_start=512),  # cfg25
    replace(_D, append="warps", min_free_tiles=2),  # cfg26
    replace(_D, append="warps", num_stages=2),  # cfg27
    replace(_D, select_prefix=True),  # cfg28: session 14, radix passes start below the keys' shared leading bits
    replace(_D, append="warps", select_prefix=True),  # cfg29
    replace(_D, append="warps", warm_start=512, select_prefix=True),  # cfg30
    replace(_D, append="warps", kth_search="interp"),  # cfg31: session 15, the interpolation k-th search
    replace(_D, append="warps", kth_search="interp", warm_start=512),  # cfg32
    replace(_D, append="warps", kth_search="interp", warm_sample="head"),  # cfg33: session 15, the first keys as the
    # warm sample (no extra scored tiles); cfg31 = the session-15 default
    replace(_D, append="warps", kth_search="interp", warm_sample="head", warm_start=2048),  # cfg34
    replace(_D, append="warps", kth_search="interp", group_mask="ballot"),  # cfg35: session 16, ballot slots
    replace(_D, append="warps", kth_search="interp", group_mask="ballot", warm_sample="head"),  # cfg36
]
BEST = {}


def launch_shape(c):
    """The Config fields that change the floor's code or grid (block_n, rows, warps, stages, head sum order, lane rows,
    programs per SM)."""
    return (c.block_n, c.rows_x_heads, c.num_warps, c.num_stages, c.head_sum, c.lane_rows, c.programs_per_sm)


def ab_rounds(H, kk, S, sweep, keep, q, w, k, st, en, fl):
    """Interleaved timing of sweep configs `keep` (cfg numbers): args.ab_rounds rounds, each timing every config's
    HyTopK and the lazy floor of each distinct launch shape; per config the median over rounds and x floor
    against the median floor of its launch shape (warm_start / append / raw_keys / search_bits do not change
    the floor's code)."""
    cfgs = [(i, sweep[i] or default_config(H, kk, interpret=args.smoke)) for i in sorted(keep) if i < len(sweep)]
    h_ms = {i: [] for i, _ in cfgs}
    f_ms = {}
    for r in range(args.ab_rounds):
        for i, cfg in cfgs:
            if launch_shape(cfg) not in f_ms or len(f_ms[launch_shape(cfg)]) <= r:
                f_ms.setdefault(launch_shape(cfg), []).append(time_fn(lambda: hytopk_floor(
                    q, w, k, st, en, config=cfg, topk=kk, lazy_max=True), target_ms=300)[0])
            h_ms[i].append(time_fn(lambda: hytopk(q, w, k, st, en, kk, check_bounds=False, config=cfg),
                                   target_ms=300)[0])
        log(f"AB round {r}: " + ", ".join(f"cfg{i} {h_ms[i][-1]:.2f}" for i, _ in cfgs))
    for i, cfg in cfgs:
        h = statistics.median(h_ms[i])
        f = statistics.median(f_ms[launch_shape(cfg)])
        hs = sorted(h_ms[i])
        log(f"AB H{H} S{S} cfg{i} {cfg}: hytopk {h:.2f} ms (rounds {hs[0]:.2f}-{hs[-1]:.2f}) floor {f:.2f} ms "
            f"x{h / f:.3f}")
        record(shape=f"ab cfg{i}", impl="hytopk", H=H, D=D_I, topk=kk, T=S, S_keys=S, ms=round(h, 3),
               ms_p20=round(hs[int(0.2 * (len(hs) - 1))], 3), ms_p80=round(hs[int(round(0.8 * (len(hs) - 1)))], 3),
               tflops=round(fl / h / 1e9, 1), x_floor=round(h / f, 3), config=json.dumps(cfg.__dict__),
               note=f"{args.ab_rounds} interleaved rounds (p20/p80 over rounds); lazy floor {f:.3f} ms")


if "sweep" in args.parts:
    S = 64 if args.smoke else args.sweep_S
    shapes = [sh for sh in ((64, 2048, 1), (32, 2048, 1), (4, 512, 4)) if str(sh[0]) in args.sweep_heads.split(",")]
    for H, kk, ratio in ((4, 8, 1),) if args.smoke else shapes:
        best = None
        T = S
        Sk = S // ratio
        q, w, k = make_inputs(T, Sk, H)
        st, en = causal(T, ratio)
        fl = flops(st, en, H)
        if H == 64:
            sweep = SWEEP
        elif H == 32:  # rows_x_heads 256 = 8 rows per tile: the key loop spills (sm_90a: 86 LDL/STL per tile,
            # 1216 instrs); 128 = 4 rows as at H64: 598 instrs, no spills in the loop (bench/NOTES_hytopk.md)
            sweep = [SWEEP[0], replace(SWEEP[0], rows_x_heads=128), SWEEP[2], SWEEP[1],
                     replace(SWEEP[0], rows_x_heads=128, num_stages=4),  # cfg2 (128, 3 stages): default since s. 7
                     replace(SWEEP[0], rows_x_heads=128, lane_rows=False),  # cfg5: before session 9
                     replace(SWEEP[0], rows_x_heads=128, warm_start=512),  # cfg6: warm start before s. 10
                     replace(SWEEP[0], rows_x_heads=128, warm_start=2048),  # cfg7
                     replace(SWEEP[0], rows_x_heads=128, raw_keys=True),  # cfg8: session 11 (= cfg2 since s. 12)
                     replace(SWEEP[0], rows_x_heads=128, raw_keys=False),  # cfg9
                     replace(SWEEP[0], rows_x_heads=128, head_sum="pairs"),  # cfg10
                     replace(SWEEP[0], rows_x_heads=128, raw_keys=False, head_sum="pairs"),  # cfg11: s. 11 default
                     replace(SWEEP[0], rows_x_heads=128, append="warps"),  # cfg12: session 13
                     replace(SWEEP[0], rows_x_heads=128, append="warps", warm_start=512),  # cfg13
                     replace(SWEEP[0], rows_x_heads=128, select_prefix=True),  # cfg14: session 14
                     replace(SWEEP[0], rows_x_heads=128, append="warps", select_prefix=True),  # cfg15
                     replace(SWEEP[0], rows_x_heads=128, append="warps", warm_start=512, select_prefix=True),  # 16
                     replace(SWEEP[0], rows_x_heads=128, append="warps", kth_search="interp"),  # cfg17: session 15
                     replace(SWEEP[0], rows_x_heads=128, append="warps", kth_search="interp", warm_sample="head"),  # 18
                     replace(SWEEP[0], rows_x_heads=128, append="warps", kth_search="interp", group_mask="ballot"),  # 19
                     replace(SWEEP[0], rows_x_heads=128, append="warps", kth_search="interp", group_mask="ballot",
                             warm_sample="head")]  # cfg20
        else:  # QSA-like H4: rows_x_heads 256 = 64 rows per tile spills 227 LDL/STL per tile (sm_90a); 64 / 32 rows
            # x heads: 39 / 2 (bench/NOTES_hytopk.md)
            sweep = [SWEEP[0], replace(SWEEP[0], rows_x_heads=64), replace(SWEEP[0], rows_x_heads=32), SWEEP[2],
                     SWEEP[5], SWEEP[7], SWEEP[8],  # cfg2 (32): default since s. 7
                     replace(SWEEP[0], rows_x_heads=32, num_stages=3), replace(SWEEP[0], rows_x_heads=16),
                     replace(SWEEP[0], rows_x_heads=32, lane_rows=False),  # cfg9: before session 9
                     replace(SWEEP[0], rows_x_heads=32, warm_start=512),  # cfg10: warm start before s. 10
                     replace(SWEEP[0], rows_x_heads=32, warm_start=2048),  # cfg11 (k 512: capped at CAP 1024)
                     replace(SWEEP[0], rows_x_heads=32, raw_keys=False, head_sum="pairs"),  # cfg12: s. 11 default
                     replace(SWEEP[0], rows_x_heads=32, append="warps"),  # cfg13: the default since session 15
                     replace(SWEEP[0], rows_x_heads=32, append="warps", warm_start=512),  # cfg14
                     replace(SWEEP[0], rows_x_heads=32, append="warps", kth_search="interp"),  # cfg15: session 15
                     replace(SWEEP[0], rows_x_heads=32, append="warps", warm_sample="head")]  # cfg16
        if args.smoke:
            sweep = [None, replace(default_config(H, kk, interpret=True), warm_start=0),
                     replace(default_config(H, kk, interpret=True), append="tile")]
        keep = None if args.sweep_cfgs is None else {int(x) for x in args.sweep_cfgs.split(",")}
        if args.ab_rounds and keep:
            ab_rounds(H, kk, S, sweep, keep, q, w, k, st, en, fl)
            keep = set()  # the interleaved rounds replace the one-after-another sweep
        for i, cfg in enumerate(sweep):
            if keep is not None and i not in keep:
                continue
            if left() < (200 if "main" in args.parts else 30):  # keep time for the main table
                log("sweep: time budget, stopping")
                break
            try:
                # two floors: the per-tile cross-warp row max and the lazy (per-element) max; x floor against the faster
                f_tile = time_fn(lambda: hytopk_floor(q, w, k, st, en, config=cfg, topk=kk), target_ms=400)[0]
                f_lazy = time_fn(lambda: hytopk_floor(q, w, k, st, en, config=cfg, topk=kk, lazy_max=True),
                                 target_ms=400)[0]
                f_ms = min(f_tile, f_lazy)
                h_ms = time_fn(lambda: hytopk(q, w, k, st, en, kk, check_bounds=False, config=cfg), target_ms=400)[0]
                ws = warm_stats() if cfg is not None and cfg.warm_start else None  # of the last call
                log(f"SWEEP H{H} S{S} cfg{i} {cfg}: floor {f_ms:.2f} ms ({fl / f_ms / 1e9:.0f} TF; per-tile max "
                    f"{f_tile:.2f}, lazy max {f_lazy:.2f}) "
                    f"hytopk {h_ms:.2f} ms ({fl / h_ms / 1e9:.0f} TF) x{h_ms / f_ms:.3f}"
                    + (f" warm {ws}" if ws else ""))
                record(shape=f"sweep cfg{i}", impl="hytopk", H=H, D=D_I, topk=kk, T=T, S_keys=Sk, ms=round(h_ms, 3),
                       tflops=round(fl / h_ms / 1e9, 1), x_floor=round(h_ms / f_ms, 3),
                       config=json.dumps(cfg.__dict__) if cfg else "default",
                       note=f"floor {f_ms:.3f} ms (per-tile max {f_tile:.3f}, lazy max {f_lazy:.3f})"
                       + (f"; warm {json.dumps(ws)}" if ws else ""))
                if best is None or h_ms < best[0]:
                    best = (h_ms, cfg)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                log(f"SWEEP cfg{i} failed: {exc}")
        if best and best[1] is not None:
            BEST[H] = best[1]
        del q, w, k
        empty_cache()
    log("BEST", {h: c.__dict__ for h, c in BEST.items()})


def causal_shapes():
    """The ablate / profile parts' inputs: causal T = S = --sweep-S (64 with --smoke, H 4, k 8) for each of --sweep-heads
    from 8 (even; 64 / 32 or e.g. 16 to time its launch shapes; k 2048). Yields (S, H, topk, q, w, k, starts, ends,
    flops, default config), dropping its own references to the inputs after each shape."""
    S = 64 if args.smoke else args.sweep_S
    given = [int(h) for h in args.sweep_heads.split(",") if h.strip()]
    heads = [h for h in given if h >= 8 and h % 2 == 0]
    if not args.smoke and len(heads) < len(given):  # e.g. the default's 4: the sweep part's QSA-like shape only
        log(f"ablate / profile: skipping --sweep-heads {sorted(set(given) - set(heads))} (they need an even H >= 8)")
    for H, kk in ((4, 8),) if args.smoke else [(h, 2048) for h in heads]:
        q, w, k = make_inputs(S, S, H)
        st, en = causal(S)
        yield S, H, kk, q, w, k, st, en, flops(st, en, H), default_config(H, kk, interpret=args.smoke)
        del q, w, k
        empty_cache()


class kernel_from:
    """Context: HyTopK's launches use the hytopk_kernel of another copy of kernels/hytopk/_kernel.py (path; None: the
    checkout's), e.g. the last commit's, so that a code change no Config field selects is timed interleaved with the
    current code in one process (--profile-variants '{"kernel": "ab_base/_kernel.py"}'). The profile times each
    file's own floor (its scoring loop) too. op.py must be compatible with the file (same arguments); constexprs the
    older kernel lacks are dropped where they hold their off value (so a new Config field, left at its default, does not break the A/B), and refused
    otherwise."""

    _mods: dict = {}

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        import importlib.util

        from hyscale_kernels.hytopk import op as _op

        self.saved = _op._kernel
        if self.path:
            if self.path not in self._mods:
                spec = importlib.util.spec_from_file_location(f"_hytopk_kernel_ab{len(self._mods)}", self.path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                self._mods[self.path] = mod
            _op._kernel = self._mods[self.path]
            known = set(_op._kernel.hytopk_kernel.arg_names)
            orig = self.saved_cx = _op.kernel_constexprs

            def cx(*a, **kw):
                const = orig(*a, **kw)
                extra = {c: v for c, v in const.items() if c not in known}
                if any(v for v in extra.values()):
                    raise ValueError(f"kernel_from({self.path}): its kernel lacks the constexprs {extra}")
                return {c: v for c, v in const.items() if c in known}

            _op.kernel_constexprs = cx
        return self

    def __exit__(self, *exc):
        from hyscale_kernels.hytopk import op as _op

        _op._kernel = self.saved
        if self.path:
            _op.kernel_constexprs = self.saved_cx
        return False


def split_variant(v):
    """A --profile-variants entry -> (Config overrides, kernel path or None): the pseudo-field "kernel" names a
    _kernel.py to time instead of the checkout's (kernel_from)."""
    o = json.loads(v)
    return o, o.pop("kernel", None)


def round_stats(xs):
    """(median, p20, p80) of per-round medians, rounded for the CSV."""
    hs = sorted(xs)
    return (round(statistics.median(hs), 3), round(hs[int(0.2 * (len(hs) - 1))], 3),
            round(hs[int(round(0.8 * (len(hs) - 1)))], 3))


# ------------------------------------------------------------------------------------------
# (2b) ablation: where HyTopK's time over the floor goes (benchmark-only kernel variants, not selections)
# ------------------------------------------------------------------------------------------
if "ablate" in args.parts:
    from hyscale_kernels.hytopk.op import ABLATIONS, hytopk_ablation

    rounds = max(1, args.ab_rounds or 5)
    for S, H, kk, q, w, k, st, en, fl, base in causal_shapes():
        parts = [("hytopk", lambda: hytopk(q, w, k, st, en, kk, check_bounds=False, config=base)),
                 ("warm_start 0", lambda: hytopk(q, w, k, st, en, kk, check_bounds=False,
                                                 config=replace(base, warm_start=0)))]
        parts += [(ABLATIONS[a], (lambda a=a: hytopk_ablation(q, w, k, st, en, kk, a, config=base)))
                  for a in (1, 2, 3, 6, 7)]
        if args.ablate_variants:  # ablation 7 under config variants: what the warm start itself costs in each
            parts = parts[:1] + [(f"{ABLATIONS[7]}, {v.strip()}", (lambda c=replace(base, **json.loads(v)):
                                  hytopk_ablation(q, w, k, st, en, kk, 7, config=c)))
                                 for v in args.ablate_variants.split(";") if v.strip()]
        parts += [(ABLATIONS[7] + ", warm_start 0",  # the key loop's own code: no warm sample either
                   lambda: hytopk_ablation(q, w, k, st, en, kk, 7, config=replace(base, warm_start=0)))]
        parts += [("floor (lazy max)", lambda: hytopk_floor(q, w, k, st, en, config=base, topk=kk, lazy_max=True))]
        ms = {n: [] for n, _ in parts}
        for r in range(rounds):  # interleaved: drift hits every part alike
            for n, fn in parts:
                ms[n].append(time_fn(fn, target_ms=300)[0])
        f = statistics.median(ms["floor (lazy max)"])
        for n, _ in parts:
            h, p20, p80 = round_stats(ms[n])
            log(f"ABLATE H{H} S{S} {n}: {h:.2f} ms (rounds {min(ms[n]):.2f}-{max(ms[n]):.2f}) x floor {h / f:.3f}")
            record(shape=f"ablate {n}", impl="hytopk" if "floor" not in n else "floor", H=H, D=D_I, topk=kk, T=S,
                   S_keys=S, ms=h, ms_p20=p20, ms_p80=p80, tflops=round(fl / h / 1e9, 1),
                   x_floor=round(h / f, 3), config=json.dumps(base.__dict__),
                   note=f"{rounds} interleaved rounds; ablations are timing variants, not selections")


# ------------------------------------------------------------------------------------------
# (2c) profile: each phase's share of the programs' cycles (clock64, op.hytopk_profile) times the plain launch's ms
# ------------------------------------------------------------------------------------------
if "profile" in args.parts:
    from hyscale_kernels.hytopk.op import PROFILE_PHASES, hytopk_profile

    rounds = max(1, args.ab_rounds or 5)
    for S, H, kk, q, w, k, st, en, fl, base in causal_shapes():
        cfgs = [("default", base, None)] + [(v.strip(), replace(base, **o), kp) for v in
                                            (args.profile_variants or "").split(";") if v.strip()
                                            for o, kp in [split_variant(v)]]
        ms = {n: [] for n, _, _ in cfgs}
        # a variant that changes the launch shape or the kernel file gets its own floor (the floor is that file's
        # scoring loop: an A/B of kernel files compares each against its own)
        shapes = {(launch_shape(c), kp): (c, kp) for _, c, kp in cfgs}
        f_ms = {sh: [] for sh in shapes}
        for r in range(rounds):  # interleaved: drift hits every config alike
            for n, c, kp in cfgs:
                with kernel_from(kp):
                    ms[n].append(time_fn(lambda c=c: hytopk(q, w, k, st, en, kk, check_bounds=False, config=c),
                                         target_ms=300)[0])
            for sh, (c, kp) in shapes.items():
                with kernel_from(kp):
                    f_ms[sh].append(time_fn(lambda c=c: hytopk_floor(q, w, k, st, en, config=c, topk=kk,
                                                                     lazy_max=True), target_ms=300)[0])
        fl_med = {sh: statistics.median(v) for sh, v in f_ms.items()}
        base_sh = (launch_shape(base), None)
        log(f"PROFILE H{H} S{S} floor {fl_med[base_sh]:.2f} ms"
            + "".join(f"; floor {sh[0]}{' ' + sh[1] if sh[1] else ''}: {v:.2f} ms" for sh, v in fl_med.items()
                      if sh != base_sh))
        for n, c, kp in cfgs:
            f = fl_med[(launch_shape(c), kp)]
            h, p20, p80 = round_stats(ms[n])
            with kernel_from(kp):
                _, pr = hytopk_profile(q, w, k, st, en, kk, config=c)
            tot = max(pr["total"], 1)
            split = {ph: round(h * pr[ph] / tot, 3) for ph in PROFILE_PHASES[1:8] + ("final search",)}
            log(f"PROFILE H{H} S{S} {n}: {h:.2f} ms (rounds {min(ms[n]):.2f}-{max(ms[n]):.2f}) x floor {h / f:.3f}; "
                + ", ".join(f"{ph} {v:.2f}" for ph, v in split.items())
                + f"; {pr['row blocks']} row blocks, {pr['n compactions']} compactions, {pr['n segments']} segments"
                + (f"; warm {json.dumps(warm_stats())}" if c.warm_start else ""))
            record(shape=f"profile {n}", impl="hytopk", H=H, D=D_I, topk=kk, T=S, S_keys=S, ms=h, ms_p20=p20, ms_p80=p80,
                   tflops=round(fl / h / 1e9, 1), x_floor=round(h / f, 3), config=json.dumps(c.__dict__),
                   note=f"{rounds} interleaved rounds, floor {f:.3f} ms; ms per phase (cycle share x ms): "
                   + json.dumps(split) + f"; counters {json.dumps(pr)}")


def cfg_for(H):
    if CFG is not None:
        return CFG
    if H in BEST:
        return BEST[H]
    if H >= 16 and 64 in BEST:
        return BEST[64]
    if H < 16 and 4 in BEST:
        return BEST[4]
    return None


# ------------------------------------------------------------------------------------------
# (3) main table: HyTopK, floor, stock TileLang, stock naive
# ------------------------------------------------------------------------------------------
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
    sizes = [64, 96] if args.smoke else [int(x) for x in args.sizes.split(",")]
    for H in [int(h) for h in args.heads.split(",")]:
        for S in sizes:
            SHAPES.append((f"DSA H{H}", H, 2048, S, 1))
    extra = set(filter(None, args.extra_shapes.split(",")))
    if extra - {"qsa", "csa"}:
        sys.exit(f"--extra-shapes: unknown {sorted(extra - {'qsa', 'csa'})}; use a comma list of qsa, csa (or '')")
    if "qsa" in extra:
        for S in sizes:
            SHAPES.append(("QSA-like H4 S/4", 4, 512, S, 4))
    if "csa" in extra:
        for S in sizes:
            SHAPES.append(("CSA-like H64 k512 S/4", 64, 512, S, 4))


def run_shape(name, H, kk, T, ratio):
    Sk = T // ratio
    q, w, k = make_inputs(T, Sk, H)
    st, en = causal(T, ratio)
    fl = flops(st, en, H)
    cfg = cfg_for(H)
    base = dict(shape=name, H=H, D=D_I, topk=kk, T=T, S_keys=Sk, config=json.dumps(cfg.__dict__) if cfg else "default")
    out_bytes = T * kk * 4
    res = {}
    # the floor: the faster of the per-tile cross-warp row max and the lazy (per-element) max (session 10)
    floors = {}
    for impl, lazy in (("floor", False), ("floor lazy max", True)):
        t_f = time_fn(lambda: hytopk_floor(q, w, k, st, en, config=cfg, topk=kk, lazy_max=lazy))
        record(**base, impl=impl, ms=round(t_f[0], 3), ms_p20=round(t_f[1], 3), ms_p80=round(t_f[2], 3),
               tflops=round(fl / t_f[0] / 1e9, 1))
        floors[impl] = t_f
    f_ms = min(floors.values())
    h_ms = time_fn(lambda: hytopk(q, w, k, st, en, kk, check_bounds=False, config=cfg))
    pk = peak_extra(lambda: hytopk(q, w, k, st, en, kk, check_bounds=False, config=cfg))
    res.update(floor=f_ms[0], hytopk=h_ms[0], mem=pk / GiB, out=out_bytes / GiB, tf=fl / h_ms[0] / 1e9,
               tf_floor=fl / f_ms[0] / 1e9)
    row_h = dict(**base, impl="hytopk", ms=round(h_ms[0], 3), ms_p20=round(h_ms[1], 3), ms_p80=round(h_ms[2], 3),
                 tflops=round(fl / h_ms[0] / 1e9, 1), x_floor=round(h_ms[0] / f_ms[0], 3),
                 peak_extra_GiB=round(pk / GiB, 4), out_GiB=round(out_bytes / GiB, 4))
    # stock TileLang: bf16 [S, 1, H, D] layout, fp32 [8192 x S] logits per block, torch.topk
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
            t = time.time()
            fn()
            sync()
            log(f"stock tilelang first call {time.time() - t:.1f}s")
            s_ms = time_fn(fn, target_ms=1500)
            s_pk = peak_extra(fn)
            res["stock"] = s_ms[0]
            record(**base, impl="stock tilelang fused_qk_topk_lighting", ms=round(s_ms[0], 3),
                   ms_p20=round(s_ms[1], 3), ms_p80=round(s_ms[2], 3), tflops=round(fl / s_ms[0] / 1e9, 1),
                   x_floor=round(s_ms[0] / f_ms[0], 3), peak_extra_GiB=round(s_pk / GiB, 3))
            row_h["stock_speedup"] = round(s_ms[0] / h_ms[0], 2)
        except Exception as exc:  # noqa: BLE001
            res["stock"] = "OOM" if is_oom(exc) else f"error {type(exc).__name__}"
            traceback.print_exc()
    # stock default path (materializes fp32 [S, H, S])
    if dsa_mod is not None and ratio == 1 and T <= args.naive_max and left() > 60:
        try:
            st64, en64 = st.long(), en.long()

            def fn():
                with torch.no_grad():
                    return dsa_mod.fused_qk_topk_naive(q[:, None], k[:, None], w[:, None], kk,
                                                       varlen_starts=st64, varlen_ends=en64)

            n_pk = peak_extra(fn)
            n_ms = time_fn(fn, target_ms=1000)
            res["naive"] = n_ms[0]
            record(**base, impl="stock fused_qk_topk_naive", ms=round(n_ms[0], 3), ms_p20=round(n_ms[1], 3),
                   ms_p80=round(n_ms[2], 3), tflops=round(fl / n_ms[0] / 1e9, 1), peak_extra_GiB=round(n_pk / GiB, 3))
        except Exception as exc:  # noqa: BLE001
            res["naive"] = "OOM" if is_oom(exc) else f"error {type(exc).__name__}"
        empty_cache()
    record(**row_h, note=str(res.get("stock", "")) if not isinstance(res.get("stock"), float) else "")
    del q, w, k
    empty_cache()
    return res


TABLE = []
for name, H, kk, T, ratio in SHAPES:
    est = 3 * 6 * (T / 262144) ** 2 * H / 64 + 5
    if left() < est:
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


lines = ["", f"GPU {ENV['gpu']} | torch {ENV['torch']} | triton {ENV['triton']} | megatron {ENV['megatron']}"]
for c in CHECKS:
    lines.append("check " + json.dumps(c))
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
