"""Plot bench/results/sparse_attn.csv -> bench/results/sparse_attn.png: forward / backward TFLOP/s (counted on the
k selected keys) of ours vs stock TileLang per (T, N), and the layer's sparse-stage indexer loss (target from the
attention backward) as a share of our attention's fwd+bwd time; the latest row per point, one GPU.

    python bench/plot_sparse_attn.py [CSV] [PNG] [--gpu NAME]   (default GPU: the one with the most rows)
"""

from __future__ import annotations

import argparse
import collections
import csv
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def latest(rows, gpu):
    """{(T, N, impl, phase): TFLOP/s} and {(T, N): loss %} from the last matching row of each point."""
    tflops, loss = {}, {}
    for r in rows:
        if r.get("gpu") != gpu:
            continue
        if r.get("kind") == "attn" and r.get("tflops") and r.get("phase") in ("fwd", "bwd"):
            tflops[(int(r["T"]), int(r["N"]), r["impl"], r["phase"])] = float(r["tflops"])
        if r.get("kind") == "loss" and r.get("impl") == "ours-deferred" and r.get("frac_of_attn"):
            loss[(int(r["T"]), int(r["N"]))] = 100.0 * float(r["frac_of_attn"])
    return tflops, loss


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("csv", nargs="?", default=os.path.join(HERE, "results", "sparse_attn.csv"))
    p.add_argument("png", nargs="?", default=os.path.join(HERE, "results", "sparse_attn.png"))
    p.add_argument("--gpu", default=None)
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.csv) as f:
        rows = list(csv.DictReader(f))
    gpu = args.gpu or collections.Counter(r["gpu"] for r in rows).most_common(1)[0][0]
    tflops, loss = latest(rows, gpu)
    cases = sorted({(t, n) for t, n, _, _ in tflops})
    impls = sorted({i for _, _, i, _ in tflops})
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5), gridspec_kw=dict(width_ratios=[2, 2, 1.4]))
    for ax, phase in zip(axes, ("fwd", "bwd")):
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            ys = [tflops.get((t, n, impl, phase), 0.0) for t, n in cases]
            ax.bar([i + j * width for i in range(len(cases))], ys, width, label=impl)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels([f"T={t // 1024}K\nN={n}" for t, n in cases])
        ax.set_ylabel("TFLOP/s (k selected keys)")
        ax.set_title(f"sparse MLA {phase}, k=2048, bf16, {gpu}")
        ax.legend(fontsize=8)
    ax = axes[2]
    lcases = sorted(loss)
    ax.bar(range(len(lcases)), [loss[c] for c in lcases], 0.6, color="tab:green")
    ax.set_xticks(range(len(lcases)))
    ax.set_xticklabels([f"T={t // 1024}K\nN={n}" for t, n in lcases])
    ax.set_ylabel("% of our attention fwd+bwd")
    ax.set_title("sparse indexer loss (64x128 index heads)")
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(args.png)


if __name__ == "__main__":
    main()
