"""Plot bench/results/topk.csv -> bench/results/topk.png (ms vs sequence length, per shape family)."""

from __future__ import annotations

import argparse
import csv
import os
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
# one color per implementation across the panels
COLORS = {"floor": "tab:blue", "floor lazy max": "tab:orange", "hytopk": "tab:green",
          "stock tilelang fused_qk_topk_lighting": "tab:purple", "stock fused_qk_topk_naive": "tab:red"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=os.path.join(HERE, "results", "topk.csv"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "topk.png"))
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in csv.DictReader(open(a.csv)) if r["ms"] and r.get("config", "default") == "default"]
    # one GPU per plot (the latest run's): points of another GPU would mix clocks and memory sizes
    gpu = rows[-1]["gpu"] if rows else ""
    rows = [r for r in rows if r["gpu"] == gpu]
    # keep the latest measurement of each (shape, impl, T)
    latest = {}
    for r in rows:
        latest[(r["shape"], r["impl"], int(r["T"]))] = r
    shapes = sorted({k[0] for k in latest})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.8), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        series = defaultdict(list)
        for (s, impl, T), r in sorted(latest.items(), key=lambda kv: kv[0][2]):
            if s == shape:
                series[impl].append((T, float(r["ms"])))
        for impl, pts in sorted(series.items()):
            xs, ys = zip(*pts)
            label = impl.replace(" fused_qk_topk_lighting", "").replace(" fused_qk_topk_naive", " naive")
            ax.plot(xs, ys, marker="o", color=COLORS.get(impl), label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(shape, fontsize=9)
        ax.set_xlabel("tokens (causal T = S)")
        ax.set_ylabel("ms (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"HyTopK vs no-selection floor vs stock Megatron DSA top-k ({gpu})", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(a.out)


if __name__ == "__main__":
    main()
