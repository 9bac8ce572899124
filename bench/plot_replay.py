"""Plot bench/results/replay.csv -> bench/results/replay.png (latest row per (kind, S, variant))."""

import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results", "replay.csv")
rows = {}
for r in csv.DictReader(open(path)):
    if r.get("ms"):
        rows[(r["kind"], int(r["S"]), r["variant"])] = r
kinds = sorted({k[0] for k in rows})
fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.2), squeeze=False)
colors = {"stock-tilelang": "#777777", "hyscale-noreplay": "#f4a582", "hyscale-replay": "#d6262b"}
for ax, kind in zip(axes[0], kinds):
    sizes = sorted({k[1] for k in rows if k[0] == kind})
    variants = [v for v in colors if any((kind, s, v) in rows or (kind, s, "model-" + v) in rows for s in sizes)]
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        xs, ys = [], []
        for j, s in enumerate(sizes):
            r = rows.get((kind, s, v)) or rows.get((kind, s, "model-" + v))
            if r:
                xs.append(j + i * width)
                ys.append(float(r["ms"]))
        bars = ax.bar(xs, ys, width, label=v, color=colors[v])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(sizes))], [f"{s // 1024}K" for s in sizes])
    ax.set_ylabel("fwd+bwd ms (median)")
    ax.set_title(kind.replace("_", " "))
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
any_row = next(iter(rows.values()))
fig.suptitle(f"DSA with activation recompute: stock TileLang vs HyScale -- {any_row['gpu']}, {any_row['date']}", fontsize=10)
fig.tight_layout()
out = os.path.join(os.path.dirname(path), "replay.png")
fig.savefig(out, dpi=110)
print("wrote", out)
