"""A/B of two HyTopK kernels in one process: an old copy of ``kernels/`` (imported under another package name) against
this checkout's, timed in interleaved rounds at causal T = S (default 64K) for H_I 64 and 32, topk 2048, bf16
random inputs; each pair of launches must select the same index sets. Prints medians with 20/80 percentiles over
the rounds and the ratio new / old, and appends one row per head count to a CSV (date, commit, GPU, versions,
command).

    git archive <commit> kernels | tar -x -C .ab_old          # the old kernels/ folder, e.g. of cc6c9ce
    python3 bench/ab_topk.py --old .ab_old                    # < 4 minutes on an H100
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import subprocess
import sys
import time

import _path  # noqa: F401  (repo root on sys.path)
from common import import_old_kernels, percentile as pct
import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))


def load_old(folder: str):
    """The hytopk op of ``folder/kernels`` (package ``hyscale_kernels_old``)."""
    import_old_kernels(folder, needs=os.path.join("hytopk", "op.py"))
    from hyscale_kernels_old.hytopk import hytopk  # noqa: PLC0415

    return hytopk


def inputs(T: int, H: int, D: int = 128, seed: int = 0):
    """bf16 q [T, H, D], k [T, D]; bf16 head weights as the indexer gives them (positive, scaled); causal bounds."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(T, H, device="cuda", generator=g).abs() * (H**-0.5 * D**-0.5)).bfloat16()
    st = torch.zeros(T, dtype=torch.int32, device="cuda")
    en = torch.arange(1, T + 1, dtype=torch.int32, device="cuda")
    return q, w, k, st, en


def time_calls(fn, n: int) -> float:
    """Median ms of n calls, one CUDA-event pair each."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="a folder holding the old kernels/ (e.g. .ab_old)")
    p.add_argument("--tokens", type=int, default=65536, help="causal T = S")
    p.add_argument("--heads", default="64,32")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds (old, new, new, old, ...)")
    p.add_argument("--calls", type=int, default=5, help="timed calls per kernel and round (their median counts)")
    p.add_argument("--csv", default=os.path.join(HERE, "results", "topk_ab.csv"))
    a = p.parse_args()
    old_hytopk = load_old(a.old)
    from hyscale_kernels.hytopk import hytopk as new_hytopk  # noqa: PLC0415

    t0 = time.time()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    env = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit,
               gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               cmd="python3 " + " ".join(sys.argv))
    rows = []
    for H in (int(h) for h in a.heads.split(",")):
        q, w, k, st, en = inputs(a.tokens, H, seed=H)
        fns = {"old": lambda: old_hytopk(q, w, k, st, en, a.topk, check_bounds=False),
               "new": lambda: new_hytopk(q, w, k, st, en, a.topk, check_bounds=False)}
        out = {name: fn() for name, fn in fns.items()}  # compiles, warm-up, and the selections to compare
        a_s, b_s = out["old"].sort(dim=1).values, out["new"].sort(dim=1).values
        same = bool(torch.equal(a_s, b_s))
        n_diff = int((a_s != b_s).any(1).sum())
        ms = {"old": [], "new": []}
        for r in range(a.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                ms[name].append(time_calls(fns[name], a.calls))
        med = {name: statistics.median(v) for name, v in ms.items()}
        row = dict(env, H=H, topk=a.topk, T=a.tokens, rounds=a.rounds, calls=a.calls, same_index_sets=same,
                   rows_differ=n_diff, old_ms=round(med["old"], 3), old_p20=round(pct(ms["old"], 0.2), 3),
                   old_p80=round(pct(ms["old"], 0.8), 3), new_ms=round(med["new"], 3),
                   new_p20=round(pct(ms["new"], 0.2), 3), new_p80=round(pct(ms["new"], 0.8), 3),
                   ratio_new_old=round(med["new"] / med["old"], 4))
        rows.append(row)
        print(f"[{time.time() - t0:5.1f}s] H{H}: old {row['old_ms']:.2f} ms, new {row['new_ms']:.2f} ms, "
              f"same index sets {same}", flush=True)
        del q, w, k, st, en, out
        torch.cuda.empty_cache()
    print(f"\n{env['gpu']} | torch {env['torch']} | triton {env['triton']} | commit {commit} | {env['date']}")
    print(f"causal {a.tokens // 1024}K, topk {a.topk}, bf16; {a.rounds} interleaved rounds x {a.calls} calls\n")
    print("| H_I | old ms (p20-p80) | new ms (p20-p80) | new / old | same index sets |")
    print("|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['H']} | {r['old_ms']:.2f} ({r['old_p20']:.2f}-{r['old_p80']:.2f}) | {r['new_ms']:.2f} "
              f"({r['new_p20']:.2f}-{r['new_p80']:.2f}) | {r['ratio_new_old']:.4f} | "
              f"{'yes' if r['same_index_sets'] else 'NO (%d rows differ)' % r['rows_differ']} |")
    new = not os.path.exists(a.csv)
    os.makedirs(os.path.dirname(a.csv), exist_ok=True)
    with open(a.csv, "a", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            wr.writeheader()
        wr.writerows(rows)
    print(f"\nrows appended to {a.csv}")
    if not all(r["same_index_sets"] for r in rows):
        raise SystemExit("the old and the new kernel selected different index sets")


if __name__ == "__main__":
    main()
