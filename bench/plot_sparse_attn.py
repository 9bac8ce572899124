"""Plot bench/results/sparse_attn.csv -> bench/results/sparse_attn.png: fwd / bwd TFLOP/s (counted on
the k selected keys) of ours vs stock TileLang per (T, N), latest run per (T, N, impl, phase), and the
layer's sparse-stage indexer loss (target from the attention backward) as a share of our attention's
fwd+bwd time, latest run per (T, N)."""

from __future__ import annotations

import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(path=os.path.join(HERE, "results", "sparse_attn.csv"), out=os.path.join(HERE, "results", "sparse_attn.png")):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        all_rows = list(csv.DictReader(f))
    rows = [r for r in all_rows if r.get("kind") == "attn" and r.get("tflops")]
    loss = {}
    for r in all_rows:  # later rows win; only the default KL path (no kl_fused variant rows)
        if r.get("kind") == "loss" and r.get("impl") == "ours-deferred" and r.get("frac_of_attn"):
            loss[(int(r["T"]), int(r["N"]))] = 100.0 * float(r["frac_of_attn"])
    latest = {}
    for r in rows:  # later rows win
        latest[(int(r["T"]), int(r["N"]), r["impl"], r["phase"])] = float(r["tflops"])
    latest = {k: v for k, v in latest.items() if k[3] in ("fwd", "bwd")}  # stock-default is timed fwd+bwd only
    cases = sorted({(t, n) for t, n, _, _ in latest})
    impls = sorted({i for _, _, i, _ in latest})
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5), gridspec_kw=dict(width_ratios=[2, 2, 1.4]))
    for ax, phase, goal in zip(axes, ("fwd", "bwd"), (300, 150)):
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            ys = [latest.get((t, n, impl, phase), 0.0) for t, n in cases]
            ax.bar([i + j * width for i in range(len(cases))], ys, width, label=impl)
        ax.axhline(goal, color="k", ls="--", lw=1, label=f"goal {goal}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels([f"T={t // 1024}K\nN={n}" for t, n in cases])
        ax.set_ylabel("TFLOP/s (k selected keys)")
        ax.set_title(f"sparse MLA {phase}, k=2048, bf16, H200")
        ax.legend(fontsize=8)
    ax = axes[2]
    lcases = sorted(loss)
    ax.bar(range(len(lcases)), [loss[c] for c in lcases], 0.6, color="tab:green")
    ax.axhline(15, color="k", ls="--", lw=1, label="goal 15%")
    ax.set_xticks(range(len(lcases)))
    ax.set_xticklabels([f"T={t // 1024}K\nN={n}" for t, n in lcases])
    ax.set_ylabel("% of our attention fwd+bwd")
    ax.set_title("sparse indexer loss (64x128 index heads)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
