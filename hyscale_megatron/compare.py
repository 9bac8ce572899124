"""``hyscale-compare``: stock Megatron DSA vs HyScale, same model / data / seed / recompute, back to back.

Usage::

    hyscale-compare --out runs/tiny_cpu @configs/tiny_cpu.args --train-iters 10
    hyscale-compare --out runs/v32 --launcher "torchrun --nproc-per-node 1" @configs/deepseek_v32_1gpu.args
    hyscale-compare --out runs/v32 --summarize-only      # rebuild the outputs of a run that was cut short

Every argument that is not one of the options below is a ``hyscale-train`` (= Megatron) flag and
goes, unchanged, to BOTH runs. The two command lines differ only in

* the layer spec: ``--spec hyscale_megatron.specs stock_block_spec --no-hyscale`` (stock
  ``DSAttention``) vs ``--spec hyscale_megatron.specs hyscale_block_spec --hyscale``;
* ``--hyscale-*`` flags given with ``--hyscale-args`` (HyScale run only);
* the run name and metrics file.

Stock runs at its best available backend: ``--dsa-kernel-backend tilelang`` when CUDA is present
and ``tilelang`` imports, else its default PyTorch path (``none``); ``--stock-backend`` overrides.
The backend flag is passed to both runs (HyScale replaces selection, sparse attention and the
indexer loss itself; anything it does not replace runs the same stock code in both runs).

Runs are separate subprocesses (``python -m hyscale_megatron.train`` or ``--launcher``), stock
first, so each has a clean process (and its own peak memory). Their per-iteration log lines are
echoed as they come; full logs go to ``OUT/stock.log`` and ``OUT/hyscale.log``.

Writes into ``--out``: ``iterations.csv`` (run, iteration, lm_loss, indexer_loss, step_ms,
tokens_per_s, peak_mem_bytes, replay_store_bytes), ``summary.md`` (median step time, speedup,
tokens/s, peak memory, max relative LM / indexer loss difference), ``summary.json``,
``comparison.png`` (loss curves overlaid; step-time and memory bars) and the two logs. ``meta.json``
(config, device, versions, stock backend, date) is written before the runs start.

``--summarize-only`` trains nothing: it rebuilds ``iterations.csv``, ``summary.md``/``.json`` and
``comparison.png`` from ``OUT/stock.jsonl``, ``OUT/hyscale.jsonl`` and ``OUT/meta.json`` (e.g. after an
outer timeout killed the command once both runs had finished). Wall times are then unknown (``null``);
runs with different iteration counts are cut to the shorter one (with a note). Shared flags, when
given, are still checked like for like; ``--max-loss-rtol`` applies.

Refuses (exit code 2, before running anything) comparisons that would not be like for like:
``--no-hyscale``/``--hyscale``/``--spec``/``--hyscale-run-name``/``--hyscale-metrics-file``
among the shared flags (the command sets them), per-run flags other than ``--hyscale-*``
(different seeds, data or recompute for the two runs), and models without DSA layers
(``--experimental-attention-variant dsa`` missing). ``--max-loss-rtol`` turns the loss
comparison into a check (exit code 3 when exceeded).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from .train import HYSCALE_SPEC, SPEC_MODULE, STOCK_SPEC, TrainConfigError, expand_arg_files

RUNS = ("stock", "hyscale")
CSV_FIELDS = ("run", "iteration", "lm_loss", "indexer_loss", "step_ms", "tokens_per_s", "peak_mem_bytes",
              "replay_store_bytes")
# flags the command sets itself (per run) and therefore refuses among the shared flags
OWNED_FLAGS = ("--hyscale", "--no-hyscale", "--spec", "--hyscale-run-name", "--hyscale-metrics-file",
               "--dsa-kernel-backend")


_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "TORCHELASTIC_RUN_ID")


class CompareRefused(ValueError):
    """The requested comparison would not be like for like; the message says why."""


# ----------------------------------------------------------------------------- options
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hyscale-compare", allow_abbrev=False,
        description="Train stock DSA and HyScale back to back on one config; write CSV, summary and plot. "
                    "Unknown arguments are hyscale-train / Megatron flags shared by both runs "
                    "(e.g. @configs/tiny_cpu.args).")
    p.add_argument("--out", default="runs/compare", help="Output directory (default runs/compare).")
    p.add_argument("--iters", type=int, default=None, help="Iterations per run (sets --train-iters for both).")
    p.add_argument("--stock-backend", choices=("auto", "none", "tilelang", "cudnn"), default="auto",
                   help="Stock DSA kernel backend (--dsa-kernel-backend); auto: tilelang on CUDA when "
                        "importable, else none.")
    p.add_argument("--hyscale-args", default="",
                   help="Extra flags for the HyScale run only; only --hyscale-* flags are allowed.")
    p.add_argument("--launcher", default="",
                   help="Command prefix for each run, e.g. 'torchrun --nproc-per-node 8'. Default: this Python.")
    p.add_argument("--core-loop", action="store_true", help="Pass --hyscale-core-loop to both runs.")
    p.add_argument("--max-loss-rtol", type=float, default=None,
                   help="Fail (exit 3) when the max relative LM-loss difference exceeds this.")
    p.add_argument("--summarize-only", action="store_true",
                   help="Do not train: rebuild iterations.csv, summary.md/json and comparison.png from "
                        "OUT/stock.jsonl, OUT/hyscale.jsonl and OUT/meta.json (e.g. after a run was cut short).")
    return p


def _flag_present(argv: Sequence[str], flag: str) -> bool:
    return any(t == flag or t.startswith(flag + "=") for t in argv)


def _flag_value(argv: Sequence[str], flag: str) -> Optional[str]:
    val = None
    for i, t in enumerate(argv):
        if t == flag and i + 1 < len(argv):
            val = argv[i + 1]
        elif t.startswith(flag + "="):
            val = t.split("=", 1)[1]
    return val


def _flags(argv: Sequence[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in argv if t.startswith("--")]


def check_like_for_like(shared: Sequence[str], hyscale_only: Sequence[str] = ()) -> None:
    """Raise :class:`CompareRefused` when the two runs would not compare like for like."""
    for flag in OWNED_FLAGS:
        if _flag_present(shared, flag):
            why = {
                "--no-hyscale": "a comparison needs HyScale in one of the two runs",
                "--hyscale": "the command sets --hyscale / --no-hyscale per run",
                "--spec": "the command chooses the layer spec of each run (stock_block_spec vs hyscale_block_spec)",
                "--dsa-kernel-backend": "the stock backend is chosen with --stock-backend",
            }.get(flag, "the command sets it per run")
            raise CompareRefused(f"refusing {flag} among the shared training flags: {why}.")
    for flag in _flags(hyscale_only):
        if not flag.startswith("--hyscale-") and not flag.startswith("--no-hyscale-"):
            raise CompareRefused(
                f"refusing {flag} in --hyscale-args: per-run flags may only be HyScale settings (--hyscale-*); "
                "seeds, data, model, parallel layout and recompute must be the same for both runs -- give them "
                "as shared flags.")
        if flag in ("--hyscale-run-name", "--hyscale-metrics-file", "--hyscale-core-loop"):
            raise CompareRefused(f"refusing {flag} in --hyscale-args: the command sets it.")
    if _flag_value(shared, "--experimental-attention-variant") != "dsa":
        raise CompareRefused(
            "refusing a model without DSA layers: stock vs HyScale compares DeepSeek Sparse Attention; "
            "add --experimental-attention-variant dsa (and the --dsa-indexer-* flags), e.g. @configs/tiny_cpu.args.")
    if not _flag_present(shared, "--multi-latent-attention"):
        raise CompareRefused("refusing a model without --multi-latent-attention: DSA layers are MLA layers.")
    for flag in ("--dsa-indexer-n-heads", "--dsa-indexer-head-dim", "--dsa-indexer-topk"):
        if not _flag_present(shared, flag):
            raise CompareRefused(f"refusing: DSA model flag {flag} is missing.")


def stock_backend(choice: str) -> str:
    if choice != "auto":
        return choice
    try:
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            return "none"
        import tilelang  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return "none"
    return "tilelang"


def run_commands(opts, shared: list[str], out: Path) -> dict[str, list[str]]:
    launcher = shlex.split(opts.launcher) if opts.launcher else [sys.executable]
    base = [*launcher, "-m", "hyscale_megatron.train"]  # python -m / torchrun -m
    common = [*shared, "--dsa-kernel-backend", stock_backend(opts.stock_backend)]
    if opts.iters is not None:
        common += ["--train-iters", str(opts.iters)]
    if opts.core_loop:
        common.append("--hyscale-core-loop")
    cmds = {
        "stock": [*base, *common, "--spec", SPEC_MODULE, STOCK_SPEC, "--no-hyscale",
                  "--hyscale-run-name", "stock", "--hyscale-metrics-file", str(out / "stock.jsonl")],
        "hyscale": [*base, *common, "--spec", SPEC_MODULE, HYSCALE_SPEC, "--hyscale",
                    *shlex.split(opts.hyscale_args),
                    "--hyscale-run-name", "hyscale", "--hyscale-metrics-file", str(out / "hyscale.jsonl")],
    }
    return cmds


# ----------------------------------------------------------------------------- running
def _is_progress(line: str) -> bool:
    return (" iteration " in line and "|" in line) or line.startswith("> hyscale-train") or "Error" in line \
        or line.startswith("Traceback")


def run_process(name: str, cmd: list[str], out: Path, prog: str = "hyscale-compare") -> tuple[int, float, list[str]]:
    """Run one training subprocess, echoing its progress lines, its full log in ``OUT/NAME.log``
    (``OUT/NAME.jsonl``, its metrics file, removed first); returns (exit code, wall seconds, last log lines)."""
    log_path = out / f"{name}.log"
    metrics = out / f"{name}.jsonl"
    if metrics.exists():
        metrics.unlink()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key in _DIST_ENV:  # a fresh rendezvous per run; never reuse the caller's process-group port
        env.pop(key, None)
    print(f"[{prog}] {name}: {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            tail = (tail + [line])[-40:]
            if _is_progress(line):
                print(f"[{name}] {line.rstrip()}", flush=True)
        rc = proc.wait()
    return rc, time.perf_counter() - t0, tail


def run_one(name: str, cmd: list[str], out: Path) -> float:
    """Run one training subprocess, echoing its progress lines; returns wall seconds."""
    rc, wall, tail = run_process(name, cmd, out)
    if rc != 0:
        sys.stderr.write("".join(tail))
        raise RuntimeError(f"the {name} run failed with exit code {rc}; full log: {out / f'{name}.log'}")
    print(f"[hyscale-compare] {name}: done in {wall:.1f} s", flush=True)
    return wall


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        raise RuntimeError(f"{path} was not written: did the run reach its first iteration?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- outputs
def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else str(v)
    return str(v)


def write_csv(path: Path, records: dict[str, list[dict]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for run in RUNS:
            for rec in records.get(run, []):
                row = {**rec, "run": run}
                if row.get("replay_store_bytes") is None and run == "stock":
                    row["replay_store_bytes"] = 0
                w.writerow([_fmt(row.get(k)) for k in CSV_FIELDS])


def _rel(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(b), 1e-30)


def summarize(records: dict[str, list[dict]], walls: dict[str, Optional[float]], meta: dict) -> dict:
    s: dict = {"meta": meta, "runs": {}}
    for run in RUNS:
        recs = records[run]
        steady = recs[1:] if len(recs) > 1 else recs  # first iteration is warm-up
        s["runs"][run] = dict(
            iterations=len(recs),
            median_step_ms=statistics.median(r["step_ms"] for r in steady),
            median_tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
            peak_mem_bytes=max(r["peak_mem_bytes"] for r in recs),
            replay_store_peak_bytes=max((r.get("replay_store_bytes") or 0) for r in recs),
            final_lm_loss=recs[-1]["lm_loss"],
            wall_s=walls.get(run),
        )
    st, hs = records["stock"], records["hyscale"]
    n = min(len(st), len(hs))
    lm = [_rel(hs[i]["lm_loss"], st[i]["lm_loss"]) for i in range(n)]
    idx = [_rel(hs[i].get("indexer_loss"), st[i].get("indexer_loss")) for i in range(n)]
    idx = [v for v in idx if v is not None]
    s["max_rel_lm_loss_diff"] = max(lm) if lm else None
    s["max_rel_indexer_loss_diff"] = max(idx) if idx else None
    s["speedup"] = s["runs"]["stock"]["median_step_ms"] / s["runs"]["hyscale"]["median_step_ms"]
    s["memory_ratio"] = s["runs"]["hyscale"]["peak_mem_bytes"] / s["runs"]["stock"]["peak_mem_bytes"]
    return s


def summary_markdown(s: dict) -> str:
    m = s["meta"]
    st, hs = s["runs"]["stock"], s["runs"]["hyscale"]
    mem_kind = "peak allocated (CUDA)" if m.get("device") == "cuda" else "peak RSS of the process (CPU)"

    def mib(b):
        return f"{b / 2**20:.1f}"

    def g(v, f="{:.3g}"):
        return "n/a" if v is None else f.format(v)

    lines = [
        "# Stock DSA vs HyScale",
        "",
        f"- config: `{m['config']}`",
        f"- device: {m['device_name']}; torch {m['torch']}; megatron-core {m['megatron']}; {m['date']}",
        f"- stock backend: `--dsa-kernel-backend {m['stock_backend']}`; same seed, data, recompute and "
        f"layout for both runs; {st['iterations']} iterations each, run back to back (stock first)",
        "",
        "| run | median step (ms) | tokens/s | peak memory (MiB) | replay store peak (bytes) | final LM loss |",
        "|---|---:|---:|---:|---:|---:|",
        f"| stock | {st['median_step_ms']:.1f} | {st['median_tokens_per_s']:.0f} | {mib(st['peak_mem_bytes'])} | "
        f"{st['replay_store_peak_bytes']} | {st['final_lm_loss']:.6f} |",
        f"| hyscale | {hs['median_step_ms']:.1f} | {hs['median_tokens_per_s']:.0f} | {mib(hs['peak_mem_bytes'])} | "
        f"{hs['replay_store_peak_bytes']} | {hs['final_lm_loss']:.6f} |",
        "",
        f"- **speedup (stock / HyScale median step time): {s['speedup']:.2f}x**",
        f"- peak memory HyScale / stock: {s['memory_ratio']:.3f} ({mem_kind})",
        f"- max relative LM-loss difference over all iterations: {g(s['max_rel_lm_loss_diff'])}",
        f"- max relative indexer-loss difference: {g(s['max_rel_indexer_loss_diff'])}",
        "",
        "Median step time excludes the first (warm-up) iteration. Step time covers forward, backward and "
        "optimizer step; tokens/s = global batch x sequence length / step time. Stock and HyScale compute "
        "the same function: in fp32 the LM losses agree to ~1e-4 relative while both select the same top-k "
        "sets (exact score ties may resolve differently); in bf16 expect bf16 noise (~1e-2).",
    ]
    if s.get("truncated"):
        lines += ["", f"Note: {s['truncated']['note']}"]
    if m.get("device") != "cuda":
        lines += ["", "CPU numbers show the mechanics, not GPU performance: HyScale's kernels are measured on the GPU."]
    return "\n".join(lines) + "\n"


def plot(path: Path, records: dict[str, list[dict]], s: dict) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    colors = {"stock": "#7f7f7f", "hyscale": "#d62728"}
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    for run in RUNS:
        it = [r["iteration"] for r in records[run]]
        ax[0, 0].plot(it, [r["lm_loss"] for r in records[run]], marker="o", ms=3, label=run, color=colors[run],
                      ls="-" if run == "stock" else "--")
        idx = [r.get("indexer_loss") for r in records[run]]
        if any(v is not None for v in idx):
            ax[0, 1].plot(it, [float("nan") if v is None else v for v in idx], marker="o", ms=3, label=run,
                          color=colors[run], ls="-" if run == "stock" else "--")
    ax[0, 0].set(title="LM loss", xlabel="iteration")
    ax[0, 1].set(title="indexer loss", xlabel="iteration")
    for a in ax[0]:
        a.legend()
        a.grid(alpha=0.3)
    st = [s["runs"][r]["median_step_ms"] for r in RUNS]
    b = ax[1, 0].bar(RUNS, st, color=[colors[r] for r in RUNS])
    ax[1, 0].bar_label(b, fmt="%.1f")
    ax[1, 0].set(title=f"median step time (ms), speedup {s['speedup']:.2f}x", ylabel="ms")
    mem = [s["runs"][r]["peak_mem_bytes"] / 2**20 for r in RUNS]
    b = ax[1, 1].bar(RUNS, mem, color=[colors[r] for r in RUNS])
    ax[1, 1].bar_label(b, fmt="%.0f")
    ax[1, 1].set(title="peak memory (MiB)", ylabel="MiB")
    m = s["meta"]
    fig.suptitle(f"stock DSA ({m['stock_backend']}) vs HyScale -- {m['config']} -- {m['device_name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _meta(opts, shared: list[str], backend: str) -> dict:
    import torch  # noqa: PLC0415

    try:
        from megatron.core.package_info import __version__ as mver  # noqa: PLC0415
    except Exception:  # noqa: BLE001
        mver = "unknown"
    cuda = torch.cuda.is_available()
    cfg = " ".join(t for t in shared if t.startswith("@")) or "(flags)"
    return dict(config=cfg + (f" --train-iters {opts.iters}" if opts.iters else ""),
                device="cuda" if cuda else "cpu",
                device_name=torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)",
                torch=torch.__version__, megatron=mver, stock_backend=backend,
                date=time.strftime("%Y-%m-%d %H:%M"), argv=shared)


def write_outputs(out: Path, records: dict[str, list[dict]], walls: dict[str, Optional[float]], meta: dict,
                  truncate: bool = False) -> dict:
    """Write iterations.csv, summary.json, summary.md and comparison.png; returns the summary.

    Different iteration counts are an error, unless ``truncate``: then both runs are cut to the
    shorter count, a note is printed and recorded (``summary["truncated"]``)."""
    for run in RUNS:
        if not records.get(run):
            raise RuntimeError(f"the {run} run logged no iterations")
    n = {run: len(records[run]) for run in RUNS}
    truncated = None
    if n["stock"] != n["hyscale"]:
        if not truncate:
            raise RuntimeError(f"the runs logged different iteration counts: {n}")
        keep = min(n.values())
        truncated = dict(n, used=keep, note=f"the runs logged different iteration counts (stock {n['stock']}, "
                                             f"hyscale {n['hyscale']}); both cut to the first {keep}.")
        print(f"[hyscale-compare] note: {truncated['note']}", flush=True)
        records = {run: records[run][:keep] for run in RUNS}
    write_csv(out / "iterations.csv", records)
    s = summarize(records, walls, meta)
    if truncated:
        s["truncated"] = truncated
    (out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    (out / "summary.md").write_text(summary_markdown(s))
    plot(out / "comparison.png", records, s)
    return s


# keys of meta.json; a hand-written one may leave some out ("unknown")
META_KEYS = ("config", "device", "device_name", "torch", "megatron", "stock_backend", "date")


def _report(opts, out: Path, s: dict, t0: float) -> int:
    print(summary_markdown(s), flush=True)
    print(f"[hyscale-compare] wrote {out}/iterations.csv, summary.md, comparison.png "
          f"({time.perf_counter() - t0:.1f} s total)", flush=True)
    if opts.max_loss_rtol is not None and (s["max_rel_lm_loss_diff"] or 0.0) > opts.max_loss_rtol:
        print(f"hyscale-compare: max relative LM-loss difference {s['max_rel_lm_loss_diff']:.3g} exceeds "
              f"--max-loss-rtol {opts.max_loss_rtol}", file=sys.stderr)
        return 3
    return 0


def summarize_only(opts, rest: list[str]) -> int:
    """``--summarize-only``: rebuild the outputs in ``opts.out`` from the runs' metrics files and meta.json."""
    if rest or opts.hyscale_args:  # flags given: they must still describe a like-for-like comparison
        try:
            check_like_for_like(expand_arg_files(rest), shlex.split(opts.hyscale_args))
        except (CompareRefused, TrainConfigError) as exc:
            print(f"hyscale-compare: {exc}", file=sys.stderr)
            return 2
    out = Path(opts.out)
    meta_path = out / "meta.json"
    if not meta_path.is_file():
        example = json.dumps(dict(config="@configs/deepseek_v32_1gpu.args --train-iters 20", device="cuda",
                                  device_name="NVIDIA H200", stock_backend="tilelang"))
        print(f"hyscale-compare: --summarize-only needs {meta_path}, which is missing. hyscale-compare writes it "
              f"before the runs start; for a comparison without one, write it by hand, e.g. {example} "
              f"(keys {', '.join(META_KEYS)}; missing ones read 'unknown').", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        loaded = json.loads(meta_path.read_text())
        if not isinstance(loaded, dict):
            raise ValueError(f"{meta_path} must hold a JSON object")
        meta = {**dict.fromkeys(META_KEYS, "unknown"), **loaded}
        records = {run: read_metrics(out / f"{run}.jsonl") for run in RUNS}
        s = write_outputs(out, records, {}, meta, truncate=True)
    except (RuntimeError, ValueError) as exc:  # ValueError: a malformed meta.json / jsonl line
        print(f"hyscale-compare: --summarize-only: {exc}", file=sys.stderr)
        return 2
    return _report(opts, out, s, t0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, rest = _parser().parse_known_args(argv)
    if opts.summarize_only:
        return summarize_only(opts, rest)
    try:
        shared = expand_arg_files(rest)
        check_like_for_like(shared, shlex.split(opts.hyscale_args))
    except (CompareRefused, TrainConfigError) as exc:
        print(f"hyscale-compare: {exc}", file=sys.stderr)
        return 2
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    backend = stock_backend(opts.stock_backend)
    cmds = run_commands(opts, rest, out)  # keep @files in the command lines: shorter, and they are expanded there
    meta = _meta(opts, rest, backend)
    (out / "meta.json").write_text(json.dumps(meta, indent=2))  # first: a cut-short comparison keeps it
    walls = {}
    t0 = time.perf_counter()
    for run in RUNS:
        walls[run] = run_one(run, cmds[run], out)
    records = {run: read_metrics(out / f"{run}.jsonl") for run in RUNS}
    s = write_outputs(out, records, walls, meta)
    return _report(opts, out, s, t0)


if __name__ == "__main__":
    sys.exit(main())
