"""Plot bench/results/sparse_attn.csv -> bench/results/sparse_attn.png: fwd / bwd TFLOP/s (counted on
the k selected keys) of ours vs stock TileLang per (T, N), latest run per (T, N, impl, phase)."""

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
        rows = [r for r in csv.DictReader(f) if r.get("kind") == "attn" and r.get("tflops")]
    latest = {}
    for r in rows:  # later rows win
        latest[(int(r["T"]), int(r["N"]), r["impl"], r["phase"])] = float(r["tflops"])
    latest = {k: v for k, v in latest.items() if k[3] in ("fwd", "bwd")}  # stock-default is timed fwd+bwd only
    cases = sorted({(t, n) for t, n, _, _ in latest})
    impls = sorted({i for _, _, i, _ in latest})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
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
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
