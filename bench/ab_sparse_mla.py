"""A/B of sparse MLA (and the deferred indexer loss) between an old copy of ``kernels/`` and this checkout's, in
one process with interleaved rounds.

The old copy is a folder holding a ``kernels/`` tree (e.g. ``git archive <commit> kernels | tar -x -C .ab_old``);
it is imported as the package ``hyscale_kernels_old`` beside this checkout's ``hyscale_kernels``. At T tokens
(S = T keys), N heads, k selected keys per query (causal, duplicate-free, random), bf16, each round times, for
old and new in alternating order, through the public autograd ops:

  * fwd:      ``sparse_mla`` forward;
  * fwd+bwd:  ``sparse_mla`` forward and backward;
  * deferred: ``sparse_mla_with_indexer_loss`` forward and backward (attention + the indexer loss whose target
              comes from the attention backward; 64 x 128 index heads), unless ``--no-loss``.

Before timing it compares old and new outputs and gradients (forward and the deterministic backward bit for
bit, the atomic dkv within fp32 reordering; exit code 1 when they differ). Prints a table
(median, 20th / 80th percentile over all timed iterations, ratio new / old) and appends one CSV row per phase
to bench/results/ab_sparse_mla.csv with date, commit, GPU, versions and command.

    python bench/ab_sparse_mla.py --old .ab_old [--old-label cc6c9ce] [--tokens 16384 --heads 128 --topk 2048]
    python bench/ab_sparse_mla.py --old .ab_old --cpu-smoke     # tiny shapes, Triton interpreter (plumbing only)
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _repo  # noqa: E402,F401  (hyscale_kernels from this checkout)

if "--cpu-smoke" in sys.argv[1:]:  # before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402

from common import (append_csv, causal_indices, env_info, import_old_kernels, markdown_table,  # noqa: E402
                    percentile as pct, time_once)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
H_I, D_I = 64, 128  # indexer heads x dim
DEV, DT = "cuda", None  # the device and dtype of the inputs (main sets them)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="folder that holds the old kernels/ tree")
    p.add_argument("--old-label", default=None, help="name of the old version in the table / CSV (default: --old)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--iters", type=int, default=4, help="timed iterations per phase, implementation and round")
    p.add_argument("--no-loss", action="store_true", help="skip the deferred-loss phase")
    p.add_argument("--csv", default=os.path.join(RESULTS, "ab_sparse_mla.csv"))
    p.add_argument("--out", default=os.environ.get("OUT"), help="also write the rows to OUT/ab_sparse_mla.csv")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny fp32 shapes under TRITON_INTERPRET=1, rows to "
                   "/tmp (plumbing only)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.tokens, args.heads, args.topk, args.rounds, args.iters = 48, 16, 32, 2, 1
        args.csv = os.path.join("/tmp", "ab_sparse_mla_smoke.csv")
    return args


def import_old(folder: str):
    """The old kernels/ tree as the package ``hyscale_kernels_old``."""
    return import_old_kernels(folder)


class Impl:
    """One version's public ops."""

    def __init__(self, name: str, pkg: str):
        self.name = name
        self.sparse_mla = importlib.import_module(f"{pkg}.sparse_mla").sparse_mla
        self.with_loss = importlib.import_module(f"{pkg}.indexer_loss.deferred").sparse_mla_with_indexer_loss


def make_inputs(T, N, K, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(T, N, 576, device=DEV, generator=g).to(DT)
    kv = torch.randn(T, 576, device=DEV, generator=g).to(DT)
    dout = torch.randn(T, N, 512, device=DEV, generator=g).to(DT)
    idx = causal_indices(T, K, DEV, seed)
    qi = (torch.randn(T, H_I, D_I, device=DEV, generator=g) * 0.1).to(DT)
    w = torch.randn(T, H_I, device=DEV, generator=g) * (H_I * D_I) ** -0.5
    ki = (torch.randn(T, D_I, device=DEV, generator=g) * 0.1).to(DT)
    return q, kv, idx, dout, qi, w, ki


SCALE = (128 + 64) ** -0.5  # DeepSeek-V3.2's softmax scale


def phases(impl: Impl, inputs, with_loss: bool, deterministic=False):
    """{phase: callable running it once} for one implementation; leaves re-created per call."""
    q, kv, idx, dout, qi, w, ki = inputs
    one = torch.ones((), device=DEV)

    def fwd():
        with torch.no_grad():
            return impl.sparse_mla(q, kv, idx, SCALE, v_dim=512, check_index_range=False)

    def fwd_bwd():
        a, b = q.detach().requires_grad_(), kv.detach().requires_grad_()
        out, lse = impl.sparse_mla(a, b, idx, SCALE, v_dim=512, check_index_range=False, deterministic=deterministic)
        out.backward(dout)
        return out, lse, a.grad, b.grad

    def deferred():
        a, b = q.detach().requires_grad_(), kv.detach().requires_grad_()
        leaves = [t.detach().requires_grad_() for t in (qi, w, ki)]
        out, lse, loss = impl.with_loss(a, b, idx, SCALE, *leaves, v_dim=512, check_index_range=False,
                                        deterministic=deterministic)
        torch.autograd.backward([out, loss], [dout, one * 0.01])
        return (out, lse, a.grad, b.grad, *[t.grad for t in leaves])

    p = {"fwd": fwd, "fwd+bwd": fwd_bwd}
    if with_loss:
        p["deferred"] = deferred
    return p


def compare(old: Impl, new: Impl, inputs, with_loss: bool) -> tuple[dict, bool]:
    """(max abs difference old vs new per phase and tensor, whether they agree): the forward and the
    deterministic backward bit for bit (the same kernels and summation order), the atomic dkv within fp32
    reordering (relative L2 <= 1e-5)."""
    res, same = {}, True
    names = ("out", "lse", "dq", "dkv", "dq_idx", "dw", "dk_idx")
    a, b = phases(old, inputs, False)["fwd"](), phases(new, inputs, False)["fwd"]()
    for n, x, y in zip(names, a, b):
        res[f"fwd {n}"] = float((x.float() - y.float()).abs().nan_to_num(0.0).max())
        same &= torch.equal(x, y)
    for phase in ("fwd+bwd",) + (("deferred",) if with_loss else ()):
        a = phases(old, inputs, with_loss, deterministic=True)[phase]()
        b = phases(new, inputs, with_loss, deterministic=True)[phase]()
        for n, x, y in zip(names, a, b):
            res[f"{phase} det {n}"] = float((x.float() - y.float()).abs().nan_to_num(0.0).max())
            same &= torch.equal(x, y)
        del a, b
    a, b = phases(old, inputs, False)["fwd+bwd"](), phases(new, inputs, False)["fwd+bwd"]()
    x, y = a[3].float(), b[3].float()
    rel = float((x - y).norm() / y.norm().clamp_min(1e-6))
    res["fwd+bwd atomic dkv rel"] = rel
    same &= rel <= 1e-5
    sync()
    return res, bool(same)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def time_iters(fn, iters: int) -> list[float]:
    """ms per call (CUDA events; wall clock on the CPU)."""
    return [time_once(fn) for _ in range(iters)]


def main(argv=None) -> int:
    global DEV, DT
    args = parse_args(argv)
    DEV, DT = ("cpu", torch.float32) if args.cpu_smoke else ("cuda", torch.bfloat16)
    if DEV == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ab_sparse_mla.py needs a CUDA GPU (or --cpu-smoke)")
    t0 = time.time()
    label = args.old_label or os.path.basename(os.path.abspath(args.old))
    import_old(args.old)
    old, new = Impl(label, "hyscale_kernels_old"), Impl("new", "hyscale_kernels")
    T, N, K = args.tokens, args.heads, args.topk
    inputs = make_inputs(T, N, K)
    with_loss = not args.no_loss
    diffs, same = compare(old, new, inputs, with_loss)
    print(f"{'same' if same else 'DIFFERENT'} results ({time.time() - t0:.0f}s incl. compiles): "
          + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()), flush=True)
    runs = {impl.name: phases(impl, inputs, with_loss) for impl in (old, new)}
    for impl in runs.values():  # warm-up
        for fn in impl.values():
            fn()
    sync()
    times = {(i, p): [] for i in runs for p in runs[i]}
    for r in range(args.rounds):
        order = [old.name, new.name] if r % 2 == 0 else [new.name, old.name]
        for phase in runs[old.name]:
            for name in order:
                times[(name, phase)] += time_iters(runs[name][phase], args.iters)
    info = env_info()
    rows, table = [], []
    for phase in runs[old.name]:
        a, b = times[(old.name, phase)], times[(new.name, phase)]
        ma, mb = statistics.median(a), statistics.median(b)
        rec = dict(phase=phase, T=T, N=N, k=K, old=label, old_ms=round(ma, 3), old_p20=round(pct(a, 0.2), 3),
                   old_p80=round(pct(a, 0.8), 3), new_ms=round(mb, 3), new_p20=round(pct(b, 0.2), 3),
                   new_p80=round(pct(b, 0.8), 3), ratio=round(mb / ma, 4), iters=len(a), same_results=same)
        table.append(rec)
        rows.append(dict(info, **rec))
    print(markdown_table(table, list(table[0])))
    print(f"(ms, CUDA events; {args.rounds} interleaved rounds x {args.iters} iterations; ratio = new / old; "
          f"{info['gpu']}; total {time.time() - t0:.0f}s)")
    append_csv(args.csv, rows)
    if args.out:
        append_csv(os.path.join(args.out, "ab_sparse_mla.csv"), rows)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
