"""``hyscale-compare``: stock Megatron DSA vs HyScale, same model / data / seed / recompute, back to back.

Usage (docs/training.md has the details)::

    hyscale-compare --out runs/tiny_cpu --iters 10 @configs/tiny_cpu.args
    hyscale-compare --out runs/v32 --launcher "torchrun --nproc-per-node 1" @configs/deepseek_v32_1gpu.args
    hyscale-compare --out runs/v32 --noise-ref none --require-parity @configs/deepseek_v32_1gpu.args  # bf16 bound
    hyscale-compare --out runs/v32 --summarize-only      # rebuild the outputs of a run that was cut short

Every argument that is not an option below is a ``hyscale-train`` (= Megatron) flag and goes,
unchanged, to both runs; their command lines differ only in the layer spec (``stock_block_spec
--no-hyscale`` vs ``hyscale_block_spec --hyscale``), the ``--hyscale-args`` of the HyScale run, run
name and metrics file. Stock runs at its best backend (TileLang on CUDA when it imports, else its
PyTorch path; ``--stock-backend``). Comparisons that would not be like for like are refused, and
every run's flags are parsed before anything runs: a bad command gets one line and exit code 2.

Each run is a subprocess (``python -m hyscale_megatron.tools.train`` or ``--launcher``), stock
first; progress lines are echoed, full logs go to ``OUT/<run>.log``. Outputs: ``meta.json``
(written first), ``iterations.csv``, ``summary.md`` / ``summary.json`` and ``comparison.png``.
On GPU the summary leads with the speedup; on CPU with the loss agreement, its timings marked as
not meaningful. ``--noise-ref BACKEND`` adds ``stock_ref`` (stock with another backend) whose
divergence from stock is the bf16 noise floor HyScale is judged against (windowed LM-loss
divergence <= ``--noise-slack`` x the reference's). Exit codes: 0 done, 1 a run failed, 2 refused,
3 a ``--max-loss-rtol`` or ``--require-parity`` check failed.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional, Sequence

from .common import (RUNS, BACKENDS, CPU_TIMING_NOTE, OneLineParser, RunFailed, UsageError, add_run_options,
                     check_like_for_like, check_out_dir, check_run_flags, csv_value, expand_arg_files,
                     launch_prefix, positive_float, positive_int, read_metrics, run_flags, run_meta, run_process,
                     split_flags, steady_medians, stock_backend, tool_main)

PROG = "hyscale-compare"
# the optional bf16-noise reference run (--noise-ref): stock again, with another stock DSA kernel backend
REF_RUN = "stock_ref"
ALL_RUNS = (*RUNS, REF_RUN)
# a per-iteration relative LM-loss difference above this marks the first divergent iteration
DIVERGENCE_RTOL = 1e-2
# fp32 runs that select the same top-k sets give LM losses this close (relative): "same losses"
SAME_LOSS_RTOL = 1e-4
DEFAULT_NOISE_SLACK = 1.5
CSV_FIELDS = ("run", "iteration", "lm_loss", "indexer_loss", "step_ms", "tokens_per_s", "peak_mem_bytes",
              "replay_store_bytes")
# keys of meta.json; a hand-written one may leave some out ("unknown")
META_KEYS = ("config", "device", "device_name", "torch", "megatron", "stock_backend", "date")


# ----------------------------------------------------------------------------- options
def _nonnegative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG, allow_abbrev=False,
        description="Train stock DSA and HyScale back to back on one config; write CSV, summary and plot. "
                    "Unknown arguments are hyscale-train / Megatron flags shared by both runs "
                    "(e.g. @configs/tiny_cpu.args).")
    add_run_options(p, "runs/compare")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="Iterations per run (sets --train-iters for both).")
    p.add_argument("--max-loss-rtol", type=_nonnegative_float, default=None,
                   help="Fail (exit 3) when the max relative LM-loss difference exceeds this.")
    p.add_argument("--noise-ref", choices=BACKENDS, default=None, metavar="BACKEND",
                   help="Also run stock a third time (run stock_ref, after stock and HyScale) with this "
                        "--dsa-kernel-backend ({%s}; must differ from the stock backend): its divergence from "
                        "stock measures the bf16 noise floor that HyScale's divergence is judged against."
                        % ",".join(BACKENDS))
    p.add_argument("--noise-slack", type=positive_float, default=DEFAULT_NOISE_SLACK, metavar="SLACK",
                   help="HyScale is within bf16 noise when its windowed LM-loss divergence from stock is <= "
                        "SLACK x the reference run's (default %g)." % DEFAULT_NOISE_SLACK)
    p.add_argument("--require-parity", action="store_true",
                   help="Fail (exit 3) when HyScale is not within bf16 noise; needs --noise-ref.")
    p.add_argument("--runs", default=None, metavar="LIST",
                   help="Train only these runs now (comma-separated of stock, hyscale and, with --noise-ref, "
                        "stock_ref; default: all), then summarize from every run's metrics file in --out when "
                        "all are there: splits one comparison over several calls (e.g. a slow noise "
                        "reference on its own).")
    p.add_argument("--summarize-only", action="store_true",
                   help="Do not train: rebuild iterations.csv, summary.md/json and comparison.png from "
                        "OUT/stock.jsonl, OUT/hyscale.jsonl and OUT/meta.json (e.g. after a run was cut short).")
    return p


def check_noise_ref(opts) -> None:
    """Raise :class:`UsageError` for a ``--noise-ref`` that cannot measure anything (or ``--require-parity``
    without one)."""
    ref = opts.noise_ref
    if ref is not None:
        main_backend = stock_backend(opts.stock_backend)
        if ref == main_backend:
            raise UsageError(
                f"refusing --noise-ref {ref}: the stock run already uses --dsa-kernel-backend {main_backend}"
                + (" (--stock-backend auto)" if opts.stock_backend == "auto" else "")
                + "; the reference run must be stock with a DIFFERENT backend (same function, different rounding) "
                  f"to measure bf16 noise -- choose one of {', '.join(b for b in BACKENDS if b != main_backend)}.")
    elif opts.require_parity:
        raise UsageError("refusing --require-parity without --noise-ref: the bf16-noise bound is measured by "
                         "the reference run (e.g. --noise-ref none when stock runs tilelang).")


def _chosen_runs(opts) -> list[str]:
    """The runs of this call, in run order (stock, hyscale[, stock_ref]); ``--runs`` picks a subset."""
    runs = [*RUNS, *([REF_RUN] if opts.noise_ref else [])]
    if opts.runs is None:
        return runs
    chosen = [r.strip() for r in opts.runs.split(",") if r.strip()]
    bad = [r for r in chosen if r not in runs]
    if not chosen or bad:
        raise UsageError(f"--runs {opts.runs!r}: choose from {', '.join(runs)}"
                         + (" (stock_ref needs --noise-ref BACKEND)" if REF_RUN in bad else ""))
    return [r for r in runs if r in chosen]


def run_commands(opts, shared: list[str], out: Path) -> dict[str, list[str]]:
    """The command line of each run: ``stock`` and ``hyscale``, plus ``stock_ref`` with ``--noise-ref``."""
    prefix = launch_prefix(opts.launcher)
    return {run: [*prefix, *flags] for run, flags in run_flags(opts, shared, out, opts.iters, opts.noise_ref).items()}


# ----------------------------------------------------------------------------- running
def run_one(name: str, cmd: list[str], out: Path) -> float:
    """Run one training subprocess, echoing its progress lines; returns wall seconds."""
    rc, wall, tail = run_process(name, cmd, out, PROG)
    if rc != 0:
        sys.stderr.write("".join(tail))
        raise RunFailed(f"the {name} run failed with exit code {rc}; full log: {out / f'{name}.log'}")
    print(f"[{PROG}] {name}: done in {wall:.1f} s", flush=True)
    return wall


# ----------------------------------------------------------------------------- outputs
def write_csv(path: Path, records: dict[str, list[dict]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for run in ALL_RUNS:
            for rec in records.get(run, []):
                row = {**rec, "run": run}
                if row.get("replay_store_bytes") is None and run != "hyscale":  # stock keeps no replay store
                    row["replay_store_bytes"] = 0
                w.writerow([csv_value(row.get(k)) for k in CSV_FIELDS])


def _rel(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(b), 1e-30)


def _max(vals: Sequence[float]) -> Optional[float]:
    """max, but NaN when any value is NaN (a NaN loss must not hide behind a finite maximum)."""
    if not vals:
        return None
    return float("nan") if any(math.isnan(v) for v in vals) else max(vals)


def loss_window(n: int) -> int:
    """Window of the smoothed divergence: ``max(1, n // 10)`` iterations."""
    return max(1, n // 10)


def max_windowed_rel(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    """Smoothed divergence of ``a`` from ``b``: the relative difference of the trailing-window means,
    ``|mean(a[e-W+1..e]) - mean(b[e-W+1..e])| / |mean(b[e-W+1..e])|`` with ``W = loss_window(len)``,
    at every window end ``e`` (every iteration from the W-th on), max over the run."""
    n = min(len(a), len(b))
    if n == 0:
        return None
    w = loss_window(n)
    return _max([_rel(sum(a[e - w:e]) / w, sum(b[e - w:e]) / w) for e in range(w, n + 1)])


def divergence(run: list[dict], ref: list[dict]) -> dict:
    """How far ``run``'s losses are from ``ref``'s (stock), iteration by iteration and in windowed means."""
    n = min(len(run), len(ref))
    lm = [_rel(run[i]["lm_loss"], ref[i]["lm_loss"]) for i in range(n)]
    idx_pairs = [(run[i].get("indexer_loss"), ref[i].get("indexer_loss")) for i in range(n)]
    idx_pairs = [(a, b) for a, b in idx_pairs if a is not None and b is not None]
    first = next((ref[i].get("iteration", i + 1) for i, v in enumerate(lm) if not v <= DIVERGENCE_RTOL), None)
    return dict(
        iterations=n,
        window=loss_window(n),
        max_rel_lm_loss_diff=_max(lm),
        max_abs_lm_loss_diff=_max([abs(run[i]["lm_loss"] - ref[i]["lm_loss"]) for i in range(n)]),
        max_rel_indexer_loss_diff=_max([_rel(a, b) for a, b in idx_pairs]),
        max_rel_windowed_lm_diff=max_windowed_rel([r["lm_loss"] for r in run[:n]], [r["lm_loss"] for r in ref[:n]]),
        max_rel_windowed_indexer_diff=max_windowed_rel([a for a, _ in idx_pairs], [b for _, b in idx_pairs]),
        first_divergence_iter=first,
    )


def parity_verdict(hs_vs_stock: dict, ref_vs_stock: dict, slack: float) -> dict:
    """HyScale is within bf16 noise when its windowed LM-loss divergence from stock is no larger than
    ``slack`` x the reference run's (stock with another backend)."""
    x, y = hs_vs_stock["max_rel_windowed_lm_diff"], ref_vs_stock["max_rel_windowed_lm_diff"]
    bound = None if y is None else slack * y
    within = x is not None and bound is not None and x <= bound  # NaN compares False: not within
    return dict(hyscale_windowed_lm_diff=x, reference_windowed_lm_diff=y, slack=slack, bound=bound,
                within_noise=bool(within))


def summarize(records: dict[str, list[dict]], walls: dict[str, Optional[float]], meta: dict,
              noise_slack: float = DEFAULT_NOISE_SLACK) -> dict:
    """Per-run numbers and loss divergences; with a ``stock_ref`` run in ``records`` also the bf16-noise
    reference (``s["noise_ref"]``) and the parity verdict (``s["parity"]``)."""
    s: dict = {"meta": meta, "runs": {}}
    for run in (r for r in ALL_RUNS if records.get(r)):
        recs = records[run]
        st = steady_medians(recs)
        s["runs"][run] = dict(
            iterations=st["iterations"], median_step_ms=st["median_step_ms"],
            median_tokens_per_s=st["median_tokens_per_s"], peak_mem_bytes=st["peak_mem_bytes"],
            replay_store_peak_bytes=st["replay_store_bytes"], final_lm_loss=recs[-1]["lm_loss"],
            wall_s=walls.get(run))
    hs_div = divergence(records["hyscale"], records["stock"])
    for key in ("max_rel_lm_loss_diff", "max_abs_lm_loss_diff", "max_rel_indexer_loss_diff",
                "max_rel_windowed_lm_diff", "max_rel_windowed_indexer_diff", "first_divergence_iter"):
        s[key] = hs_div[key]
    s["loss_window"] = hs_div["window"]
    if records.get(REF_RUN):
        ref_div = divergence(records[REF_RUN], records["stock"])
        s["noise_ref"] = dict(run=REF_RUN, backend=meta.get("noise_ref") or "unknown",
                              stock_backend=meta.get("stock_backend"), vs_stock=ref_div)
        # the third side of the triangle: information only (the verdict compares the two pairs above)
        hs_ref_div = divergence(records["hyscale"], records[REF_RUN])
        s["parity"] = dict(hyscale_vs_stock=hs_div, stock_ref_vs_stock=ref_div, hyscale_vs_stock_ref=hs_ref_div,
                           window=hs_div["window"], divergence_rtol=DIVERGENCE_RTOL,
                           **parity_verdict(hs_div, ref_div, noise_slack))
    s["speedup"] = s["runs"]["stock"]["median_step_ms"] / s["runs"]["hyscale"]["median_step_ms"]
    s["memory_ratio"] = s["runs"]["hyscale"]["peak_mem_bytes"] / s["runs"]["stock"]["peak_mem_bytes"]
    return s


def _g(v, f="{:.3g}") -> str:
    return "n/a" if v is None else f.format(v)


def loss_headline(s: dict) -> str:
    """What a CPU comparison shows: whether HyScale's LM losses are stock's, with the largest difference."""
    n = s["runs"]["stock"]["iterations"]
    rel, diff = s["max_rel_lm_loss_diff"], s.get("max_abs_lm_loss_diff")
    same = rel is not None and rel <= SAME_LOSS_RTOL
    verdict = "Same losses" if same else "Different losses"
    return (f"{verdict}: over {n} iterations the LM losses of HyScale and stock differ by at most "
            f"{_g(diff)} (relative {_g(rel)}; same means <= {SAME_LOSS_RTOL:g} relative); indexer loss: max "
            f"relative difference {_g(s['max_rel_indexer_loss_diff'])}.")


def summary_markdown(s: dict) -> str:
    m = s["meta"]
    st = s["runs"]["stock"]
    cuda = m.get("device") == "cuda"
    mem_kind = "peak allocated (CUDA)" if cuda else "peak RSS of the process (CPU)"
    lines = ["# Stock DSA vs HyScale", ""]
    if not cuda:
        lines += [f"**{loss_headline(s)}**", "", CPU_TIMING_NOTE, ""]
    lines += [
        *([f"- command: `{m['command']}`"] if m.get("command") else []),
        f"- training flags of both runs: `{m['config']}`",
        f"- device: {m['device_name']}; torch {m['torch']}; megatron-core {m['megatron']}; {m['date']}",
        f"- stock backend: `--dsa-kernel-backend {m['stock_backend']}`; same seed, data, recompute and "
        f"layout for both runs; {st['iterations']} iterations each, run back to back (stock first)"
        + (f"; bf16-noise reference run `{REF_RUN}`: stock again with `--dsa-kernel-backend "
           f"{s['noise_ref']['backend']}` (run last)" if "noise_ref" in s else ""),
        "",
        f"| run | median step (ms{'' if cuda else ', CPU: not meaningful'}) | tokens/s | peak memory (MiB) "
        "| replay store peak (bytes) | final LM loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run in (r for r in ALL_RUNS if r in s["runs"]):
        r = s["runs"][run]
        lines.append(f"| {run} | {r['median_step_ms']:.1f} | {r['median_tokens_per_s']:.0f} | "
                     f"{r['peak_mem_bytes'] / 2**20:.1f} | {r['replay_store_peak_bytes']} | {r['final_lm_loss']:.6f} |")
    lines.append("")
    if cuda:
        lines.append(f"- **speedup (stock / HyScale median step time): {s['speedup']:.2f}x**")
    else:
        lines.append(f"- step time stock / HyScale: {s['speedup']:.2f}x (CPU: not a speedup measurement)")
    lines += [
        f"- peak memory HyScale / stock: {s['memory_ratio']:.3f} ({mem_kind})",
        f"- max relative LM-loss difference over all iterations: {_g(s['max_rel_lm_loss_diff'])} "
        f"(max |difference| {_g(s.get('max_abs_lm_loss_diff'))})",
        f"- max relative indexer-loss difference: {_g(s['max_rel_indexer_loss_diff'])}",
        "",
        "Median step time excludes the first (warm-up) iteration. Step time covers forward, backward and "
        "optimizer step; tokens/s = global batch x sequence length / step time. Stock and HyScale compute "
        f"the same function: in fp32 the LM losses agree to ~{SAME_LOSS_RTOL:g} relative while both select the "
        "same top-k sets (exact score ties may resolve differently); in bf16 expect bf16 noise (~1e-2).",
    ]
    if "parity" in s:
        lines += ["", *_parity_markdown(s)]
    if s.get("truncated"):
        lines += ["", f"Note: {s['truncated']['note']}"]
    return "\n".join(lines) + "\n"


def _parity_markdown(s: dict) -> list[str]:
    """The bf16-noise section of summary.md: divergence table of both pairs and the verdict line."""
    par, ref = s["parity"], s["noise_ref"]

    def g(v):
        return "n/a" if v is None else f"{v:.3g}"

    def row(name, d):
        first = "never" if d["first_divergence_iter"] is None else str(d["first_divergence_iter"])
        return (f"| {name} | {g(d['max_rel_lm_loss_diff'])} | {g(d['max_rel_windowed_lm_diff'])} | "
                f"{g(d['max_rel_windowed_indexer_diff'])} | {first} |")

    x, y, slack = par["hyscale_windowed_lm_diff"], par["reference_windowed_lm_diff"], par["slack"]
    verdict = "yes" if par["within_noise"] else "no"
    rel = "<=" if par["within_noise"] else ">"
    return [
        f"## bf16 noise: reference `{REF_RUN}` = stock with `--dsa-kernel-backend {ref['backend']}`",
        "",
        f"| pair | max per-iter LM diff | max windowed LM diff | max windowed indexer diff | "
        f"first iteration > {DIVERGENCE_RTOL:g} |",
        "|---|---:|---:|---:|---:|",
        row("hyscale vs stock", par["hyscale_vs_stock"]),
        row(f"{REF_RUN} ({ref['backend']}) vs stock", par["stock_ref_vs_stock"]),
        *([row(f"hyscale vs {REF_RUN} ({ref['backend']}) (information)", par["hyscale_vs_stock_ref"])]
          if "hyscale_vs_stock_ref" in par else []),
        "",
        f"**HyScale within bf16 noise: {verdict}** (windowed LM-loss divergence {g(x)} {rel} {slack:g} x "
        f"reference's {g(y)})",
        "",
        f"Windowed: relative difference of the trailing {par['window']}-iteration means (window = max(1, n // 10)), "
        "at every window end, max over the run. Two correct bf16 implementations of the same function diverge "
        "after a few steps; the reference pair (stock vs stock with another kernel backend) measures that "
        "divergence for this config and schedule, and HyScale must not diverge more than "
        f"{slack:g}x it.",
    ]


def plot_title(s: dict) -> str:
    """The figure's title: what ran where, the effective command (wrapped), and the bf16-noise verdict."""
    m = s["meta"]
    title = [f"stock DSA ({m['stock_backend']}) vs HyScale -- {m['device_name']}",
             *textwrap.wrap(m.get("command") or m["config"], 130)]
    if "parity" in s:
        par = s["parity"]
        title.append(f"within bf16 noise: {'yes' if par['within_noise'] else 'no'} (windowed LM divergence "
                     f"{par['hyscale_windowed_lm_diff']:.3g} vs {par['slack']:g} x reference "
                     f"{par['reference_windowed_lm_diff']:.3g})")
    return "\n".join(title)


def step_panel_title(s: dict) -> str:
    if s["meta"].get("device") == "cuda":
        return f"median step time (ms), speedup {s['speedup']:.2f}x"
    return "median step time (ms), CPU: not meaningful"


def plot(path: Path, records: dict[str, list[dict]], s: dict) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    colors = {"stock": "#7f7f7f", "hyscale": "#d62728", REF_RUN: "#1f77b4"}
    runs = [r for r in ALL_RUNS if records.get(r) and r in s["runs"]]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    for run in runs:
        it = [r["iteration"] for r in records[run]]
        style = dict(marker="o", ms=3, color=colors[run], ls="-" if run == "stock" else "--")
        if run == REF_RUN:  # the noise reference: thin, behind the two compared runs
            style = dict(marker=None, lw=0.9, color=colors[run], ls="-", zorder=1)
        label = run if run != REF_RUN else f"{run} ({s.get('noise_ref', {}).get('backend', '?')})"
        ax[0, 0].plot(it, [r["lm_loss"] for r in records[run]], label=label, **style)
        idx = [r.get("indexer_loss") for r in records[run]]
        if any(v is not None for v in idx):
            ax[0, 1].plot(it, [float("nan") if v is None else v for v in idx], label=label, **style)
    ax[0, 0].set(title=f"LM loss (max |HyScale - stock| {_g(s.get('max_abs_lm_loss_diff'))})", xlabel="iteration")
    ax[0, 1].set(title="indexer loss", xlabel="iteration")
    for a in ax[0]:
        a.legend()
        a.grid(alpha=0.3)
    st = [s["runs"][r]["median_step_ms"] for r in runs]
    b = ax[1, 0].bar(runs, st, color=[colors[r] for r in runs])
    ax[1, 0].bar_label(b, fmt="%.1f")
    ax[1, 0].set(title=step_panel_title(s), ylabel="ms")
    mem = [s["runs"][r]["peak_mem_bytes"] / 2**20 for r in runs]
    b = ax[1, 1].bar(runs, mem, color=[colors[r] for r in runs])
    ax[1, 1].bar_label(b, fmt="%.0f")
    ax[1, 1].set(title="peak memory (MiB)", ylabel="MiB")
    fig.suptitle(plot_title(s), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out: Path, records: dict[str, list[dict]], walls: dict[str, Optional[float]], meta: dict,
                  truncate: bool = False, noise_slack: float = DEFAULT_NOISE_SLACK) -> dict:
    """Write iterations.csv, summary.json, summary.md and comparison.png; returns the summary.

    ``records`` holds ``stock`` and ``hyscale``, and ``stock_ref`` when there was a noise-reference run.
    Different iteration counts are an error, unless ``truncate``: then all runs are cut to the
    shortest count, a note is printed and recorded (``summary["truncated"]``)."""
    runs = [run for run in ALL_RUNS if run in RUNS or run in records]
    for run in runs:
        if not records.get(run):
            raise RunFailed(f"the {run} run logged no iterations")
    n = {run: len(records[run]) for run in runs}
    truncated = None
    if len(set(n.values())) > 1:
        if not truncate:
            raise RunFailed(f"the runs logged different iteration counts: {n}")
        keep = min(n.values())
        counts = ", ".join(f"{run} {n[run]}" for run in runs)
        truncated = dict(n, used=keep, note=f"the runs logged different iteration counts ({counts}); "
                                             f"{'both' if len(runs) == 2 else 'all'} cut to the first {keep}.")
        print(f"[{PROG}] note: {truncated['note']}", flush=True)
        records = {run: records[run][:keep] for run in runs}
    write_csv(out / "iterations.csv", records)
    s = summarize(records, walls, meta, noise_slack)
    if truncated:
        s["truncated"] = truncated
    (out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    (out / "summary.md").write_text(summary_markdown(s))
    plot(out / "comparison.png", records, s)
    return s


def _report(opts, out: Path, s: dict, t0: float) -> int:
    print(summary_markdown(s), flush=True)
    print(f"[{PROG}] wrote {out}/iterations.csv, summary.md, comparison.png "
          f"({time.perf_counter() - t0:.1f} s total)", flush=True)
    rc = 0
    if opts.max_loss_rtol is not None and (s["max_rel_lm_loss_diff"] or 0.0) > opts.max_loss_rtol:
        print(f"{PROG}: max relative LM-loss difference {s['max_rel_lm_loss_diff']:.3g} exceeds "
              f"--max-loss-rtol {opts.max_loss_rtol}", file=sys.stderr)
        rc = 3
    if opts.require_parity and not s["parity"]["within_noise"]:
        par = s["parity"]
        print(f"{PROG}: HyScale is not within bf16 noise: windowed LM-loss divergence "
              f"{par['hyscale_windowed_lm_diff']:.3g} > {par['slack']:g} x the reference's "
              f"{par['reference_windowed_lm_diff']:.3g} (--require-parity)", file=sys.stderr)
        rc = 3
    return rc


# ----------------------------------------------------------------------------- --summarize-only
def _load_meta(meta_path: Path) -> dict:
    if not meta_path.is_file():
        example = json.dumps(dict(config="@configs/deepseek_v32_1gpu.args --train-iters 20", device="cuda",
                                  device_name="NVIDIA H200", stock_backend="tilelang"))
        raise UsageError(f"--summarize-only needs {meta_path}, which is missing. hyscale-compare writes it "
                         f"before the runs start; for a comparison without one, write it by hand, e.g. {example} "
                         f"(keys {', '.join(META_KEYS)}; missing ones read 'unknown').")
    try:
        loaded = json.loads(meta_path.read_text())
    except ValueError as exc:
        raise UsageError(f"--summarize-only: {meta_path} is not JSON ({exc})") from None
    if not isinstance(loaded, dict):
        raise UsageError(f"--summarize-only: {meta_path} must hold a JSON object")
    return {**dict.fromkeys(META_KEYS, "unknown"), **loaded}


def _load_records(opts, out: Path, meta: dict) -> dict[str, list[dict]]:
    """The runs' metrics files in ``out``; ``stock_ref`` when meta.json and ``--noise-ref`` say it belongs here."""
    records = {run: read_metrics(out / f"{run}.jsonl") for run in RUNS}
    ref_path, meta_path = out / f"{REF_RUN}.jsonl", out / "meta.json"
    if "noise_ref" in meta and meta["noise_ref"] is None and opts.noise_ref is None:
        # meta.json says this comparison had no reference run: a stock_ref.jsonl belongs to another one
        if ref_path.exists():
            print(f"[{PROG}] note: ignoring {ref_path}: {meta_path} records no --noise-ref for this "
                  "comparison (give --noise-ref BACKEND to use it).", flush=True)
    elif ref_path.exists():
        if opts.noise_ref is not None and meta.get("noise_ref") not in (None, opts.noise_ref):
            raise UsageError(f"--noise-ref {opts.noise_ref} contradicts {meta_path}, which records "
                             f"noise_ref {meta['noise_ref']}.")
        meta["noise_ref"] = meta.get("noise_ref") or opts.noise_ref or "unknown"
        if meta["noise_ref"] == meta.get("stock_backend"):
            raise UsageError(f"the reference run's backend ({meta['noise_ref']}) equals the stock backend: "
                             "it cannot measure bf16 noise.")
        records[REF_RUN] = read_metrics(ref_path)
    elif opts.noise_ref is not None or opts.require_parity:
        raise UsageError(f"{ref_path} (the --noise-ref run's metrics) is missing; "
                         + ("--require-parity needs it." if opts.require_parity else "run without --noise-ref."))
    elif meta.get("noise_ref") is not None:
        print(f"[{PROG}] note: {meta_path} records --noise-ref {meta['noise_ref']} but {ref_path} is "
              "missing: summarizing stock vs HyScale only.", flush=True)
    if opts.require_parity and REF_RUN not in records:
        raise UsageError(f"--require-parity needs the reference run: give --noise-ref BACKEND with its {ref_path}.")
    return records


def summarize_only(opts, rest: list[str]) -> int:
    """``--summarize-only``: rebuild the outputs in ``opts.out`` from the runs' metrics files and meta.json."""
    if rest or opts.hyscale_args:  # flags given: they must still describe a like-for-like comparison
        check_like_for_like(expand_arg_files(rest), split_flags(opts.hyscale_args, "--hyscale-args"))
    out = Path(opts.out)
    t0 = time.perf_counter()
    meta = _load_meta(out / "meta.json")
    try:
        records = _load_records(opts, out, meta)
        s = write_outputs(out, records, {}, meta, truncate=True, noise_slack=opts.noise_slack)
    except RunFailed as exc:  # a missing or malformed metrics file
        raise UsageError(f"--summarize-only: {exc}") from None
    return _report(opts, out, s, t0)


# ----------------------------------------------------------------------------- entry point
def _continue_meta(out: Path, meta: dict) -> dict:
    """``--runs`` into an ``--out`` that holds an earlier call's meta.json: same flags required."""
    try:
        old = json.loads((out / "meta.json").read_text())
    except ValueError:
        old = {}
    diff = [k for k in ("argv", "stock_backend", "noise_ref", "config") if old.get(k) != meta.get(k)]
    if diff:
        raise UsageError(f"--runs: {out}/meta.json is from a comparison with other settings "
                         f"({', '.join(f'{k}: {old.get(k)!r} vs {meta.get(k)!r}' for k in diff)}); use a fresh "
                         "--out or the same flags.")
    return {**old, **meta, "command": old.get("command", meta["command"])}  # keep notes added by hand


def _main(argv: list[str]) -> int:
    opts, rest = _parser().parse_known_args(argv)
    out = Path(opts.out)
    check_out_dir(out)
    if opts.summarize_only:
        return summarize_only(opts, rest)
    shared = expand_arg_files(rest)
    check_like_for_like(shared, split_flags(opts.hyscale_args, "--hyscale-args"))
    check_noise_ref(opts)
    runs = _chosen_runs(opts)
    # keep @files in the command lines: shorter, and each run expands them itself
    flags = run_flags(opts, rest, out, opts.iters, opts.noise_ref)
    for note in check_run_flags(flags):
        print(f"{PROG}: note: {note}", flush=True)
    cmds = run_commands(opts, rest, out)
    meta = dict(run_meta(PROG, argv, rest, stock_backend(opts.stock_backend), opts.iters), noise_ref=opts.noise_ref)
    out.mkdir(parents=True, exist_ok=True)
    if opts.runs is not None and (out / "meta.json").is_file():
        meta = _continue_meta(out, meta)
    (out / "meta.json").write_text(json.dumps(meta, indent=2))  # first: a cut-short comparison keeps it
    t0 = time.perf_counter()
    walls = {run: run_one(run, cmds[run], out) for run in runs}
    if opts.runs is not None:
        missing = [r for r in cmds if not (out / f"{r}.jsonl").is_file()]
        if missing:
            print(f"[{PROG}] ran {', '.join(runs)}; {', '.join(missing)} still to run (--runs "
                  f"{','.join(missing)} with the same flags and --out), then the summary is written", flush=True)
            return 0
        return summarize_only(opts, rest)
    records = {run: read_metrics(out / f"{run}.jsonl") for run in runs}
    s = write_outputs(out, records, walls, meta, noise_slack=opts.noise_slack)
    return _report(opts, out, s, t0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return tool_main(PROG, _main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
