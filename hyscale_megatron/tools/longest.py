"""``hyscale-longest``: the longest sequence stock DSA and HyScale can train, one length at a time.

Usage (docs/training.md has the details)::

    hyscale-longest --out runs/longest                                  # one GPU, DeepSeek-V3.2-like
    hyscale-longest --out runs/longest @configs/glm51_1gpu.args --seq-lengths 65536,262144
    hyscale-longest --out runs/tiny --seq-lengths 64,128 --iters 2 @configs/tiny_cpu.args   # CPU demo

Trains the config (``@configs/deepseek_v32_longest.args`` when no ``@FILE`` is given; other unknown
arguments are ``hyscale-train`` flags shared by every run) for ``--iters`` iterations at each of
``--seq-lengths``, in increasing order, under full recompute, stock then HyScale (with selection
replay, its store offloaded) at each length. Every (kind, length) is a subprocess built and run as
``hyscale-compare`` builds and runs its runs, with ``--seq-length L --max-position-embeddings L``
appended. A kind stops at its first out-of-memory (``torch.OutOfMemoryError`` / "out of memory" in
its log, or SIGKILL: exit -9 or 137), error (any other failure; the command then exits 1) or
``--run-timeout-s`` limit (``partial`` when an iteration finished, else ``timeout``).

Writes into ``--out``: ``meta.json``, ``longest.csv`` (kind, seq_len, status, median step time,
tokens/s, peak memory, replay store, iterations, error line), ``longest.md`` (both kinds side by
side and "stock's longest trainable length: X; HyScale's: Y") and ``L<seq_len>/<kind>.{log,jsonl}``.
``--kinds`` runs one kind, ``--merge`` joins sweeps. Refuses (one line, exit 2, nothing run) what
``hyscale-compare`` refuses, configs without ``--recompute-granularity full`` and
``--no-hyscale-replay``.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from .common import (CPU_TIMING_NOTE, RUNS, OneLineParser, UsageError, add_run_options, check_like_for_like, check_out_dir,
                     check_run_flags, csv_value, expand_arg_files, flag_names, flag_value, launch_prefix,
                     positive_int, read_metrics, run_flags, run_meta, run_process, split_flags, steady_medians,
                     stock_backend, tool_main)

PROG = "hyscale-longest"
LONGEST_HYSCALE_FLAGS = ("--hyscale-replay", "--hyscale-replay-offload", "--no-hyscale-replay-prefetch")
KINDS = RUNS  # ("stock", "hyscale"): stock first at each length
DEFAULT_SEQ_LENGTHS = (32768, 131072, 524288, 1048576)
DEFAULT_CONFIG = "configs/deepseek_v32_longest.args"
CSV_FIELDS = ("kind", "seq_len", "status", "median_step_ms", "tokens_per_s", "peak_mem_bytes", "replay_store_bytes",
              "iterations", "error")
OOM_PATTERNS = (re.compile(r"torch\.(cuda\.)?OutOfMemoryError"), re.compile(r"CUDA out of memory"),
                re.compile(r"out of memory", re.IGNORECASE))
# SIGKILL: what the kernel's OOM killer sends; -9 from Popen, 128 + 9 when a shell/launcher reports it
OOM_KILL_CODES = (-int(signal.SIGKILL), 128 + int(signal.SIGKILL))
# torch.distributed prefixes each line of a rank's traceback with "[rankN]: "
_ERROR_LINE = re.compile(r"^\s*(\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit))(:.*)?$")

# runner(kind, cmd, run_dir) -> exit code; writes run_dir/KIND.log and run_dir/KIND.jsonl
Runner = Callable[[str, list, Path], int]


# ----------------------------------------------------------------------------- options
def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return v


def _seq_lengths(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seq-lengths wants comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"--seq-lengths wants positive integers, got {text!r}")
    return sorted(set(vals))


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG, allow_abbrev=False,
        description="Train stock DSA and HyScale at increasing sequence lengths (full recompute + replay) "
                    "until each runs out of memory. Unknown arguments are hyscale-train / Megatron flags shared "
                    f"by every run (default config: @{DEFAULT_CONFIG}).")
    add_run_options(p, "runs/longest")
    p.add_argument("--seq-lengths", type=_seq_lengths, default=list(DEFAULT_SEQ_LENGTHS),
                   help="Comma-separated sequence lengths, tried in increasing order "
                        "(default 32768,131072,524288,1048576).")
    p.add_argument("--iters", type=positive_int, default=3, help="Training iterations per run (default 3).")
    p.add_argument("--run-timeout-s", type=_positive_seconds, default=None,
                   help="Wall-clock limit per run (coreutils timeout). A run that hits it is 'timeout' (or "
                        "'partial' when it finished at least one iteration) and its kind stops: longer lengths "
                        "would not be faster. Default: no limit.")
    p.add_argument("--merge", default="",
                   help="Do not train: merge the longest.csv (+ meta.json) of these comma-separated output "
                        "directories (e.g. a stock-only and a HyScale-only sweep) into --out.")
    p.add_argument("--kinds", default="stock,hyscale",
                   help="Which runs, comma-separated: stock, hyscale or both (default both), e.g. to split a "
                        "sweep over several calls.")
    return p


def _default_config() -> str:
    """``@configs/deepseek_v32_longest.args`` from the working directory, else from this checkout."""
    here = Path(DEFAULT_CONFIG)
    if here.is_file():
        return f"@{here}"
    return f"@{Path(__file__).resolve().parents[2] / DEFAULT_CONFIG}"


def with_default_config(rest: Sequence[str]) -> list[str]:
    rest = list(rest)
    return rest if any(t.startswith("@") and len(t) > 1 for t in rest) else [_default_config(), *rest]


def check_longest(shared: Sequence[str], hyscale_only: Sequence[str] = ()) -> None:
    """Raise :class:`UsageError` for a sweep that would not compare stock and HyScale like for like
    under full recompute + replay."""
    check_like_for_like(shared, hyscale_only)
    if flag_value(shared, "--recompute-granularity") != "full":
        raise UsageError(
            "refusing a config without full activation recompute: the longest-sequence mode trains with "
            "--recompute-granularity full (and --recompute-method uniform --recompute-num-layers 1), where "
            "stock re-runs indexer scoring + top-k in the backward and HyScale replays its selection.")
    if "--no-hyscale-replay" in flag_names([*shared, *hyscale_only]):
        raise UsageError("refusing --no-hyscale-replay: the longest-sequence mode runs HyScale with "
                             "selection replay (it adds --hyscale-replay itself).")


# ----------------------------------------------------------------------------- classifying a run
def is_oom(rc: int, log_text: str) -> bool:
    if rc == 0:
        return False
    if rc in OOM_KILL_CODES:
        return True
    return any(p.search(log_text) for p in OOM_PATTERNS)


def first_error_line(rc: int, log_text: str) -> str:
    """The line that says what went wrong: for an OOM the out-of-memory message, else the last
    exception line (``SomeError: ...``) of the log, else the exit code."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    if rc != 0 and is_oom(rc, log_text):
        for ln in reversed(lines):
            if any(p.search(ln) for p in OOM_PATTERNS):
                return ln[:300]
    for ln in reversed(lines):
        if _ERROR_LINE.match(ln) and "ChildFailedError" not in ln:  # torchrun's wrapper hides the rank's error
            return ln[:300]
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}" + (f": {lines[-1][:200]}" if lines else "")


TIMEOUT_RC = 124  # coreutils timeout, when the limit fired (SIGTERM)


def classify(rc: int, log_text: str, records: list[dict], timeout_s: Optional[float] = None) -> tuple[str, str]:
    """(status, error line): ``ok`` (exit 0 and at least one iteration logged), ``oom``, ``error``, or with a
    time limit ``partial`` / ``timeout`` (the limit fired after / before the first logged iteration)."""
    if timeout_s is not None and rc == TIMEOUT_RC:
        done = len(records)
        if done:
            return "partial", f"time limit {timeout_s:g} s reached after {done} iteration(s)"
        return "timeout", f"time limit {timeout_s:g} s reached before the first iteration finished"
    if rc == 0:
        if records:
            return "ok", ""
        return "error", "exit code 0 but no iteration was logged (metrics file empty or missing)"
    return ("oom" if is_oom(rc, log_text) else "error"), first_error_line(rc, log_text)


def run_metrics(records: list[dict]) -> dict:
    """Median step time / tokens/s without the warm-up iteration (as hyscale-compare), peaks over all."""
    m = steady_medians(records)
    m["tokens_per_s"] = m.pop("median_tokens_per_s")
    return m


# ----------------------------------------------------------------------------- the sweep
def default_runner(kind: str, cmd: list, run_dir: Path) -> int:
    rc, wall, _ = run_process(kind, cmd, run_dir, PROG)
    print(f"[{PROG}] {kind}: exit code {rc} after {wall:.1f} s", flush=True)
    return rc


def _read_records(path: Path) -> list[dict]:
    try:
        return read_metrics(path)
    except RuntimeError:
        return []


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k for k in text.replace(" ", "").split(",") if k)
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise UsageError(f"--kinds wants a comma-separated subset of {', '.join(KINDS)}, got {text!r}")
    return tuple(k for k in KINDS if k in kinds)  # stock first


def _with_timeout(cmd: list, timeout_s: Optional[float]) -> list:
    # SIGTERM first (exit code 124), SIGKILL 60 s later if the process ignores it
    return cmd if timeout_s is None else ["timeout", "--kill-after=60", f"{timeout_s:g}", *cmd]


def sweep(opts, rest: Sequence[str], out: Path, runner: Runner = default_runner) -> list[dict]:
    """Run every (length, kind) in increasing length, stock first; a kind stops at its first
    ``oom``, ``error``, ``partial`` or ``timeout``. Returns one row per run, in the order run."""
    kinds = _kinds(getattr(opts, "kinds", ",".join(KINDS)))
    timeout_s = getattr(opts, "run_timeout_s", None)
    stopped: dict[str, str] = {k: "not requested" for k in KINDS if k not in kinds}
    rows: list[dict] = []
    for seq in opts.seq_lengths:
        if len(stopped) == len(KINDS):
            break
        run_dir = out / f"L{seq}"
        run_dir.mkdir(parents=True, exist_ok=True)
        shared = [*rest, "--seq-length", str(seq), "--max-position-embeddings", str(seq)]
        prefix = launch_prefix(opts.launcher)
        cmds = {k: [*prefix, *flags] for k, flags in run_flags(opts, shared, run_dir, opts.iters).items()}
        for kind in KINDS:
            if kind in stopped:
                continue
            print(f"[{PROG}] seq_len {seq}: {kind} ...", flush=True)
            rc = runner(kind, _with_timeout(cmds[kind], timeout_s), run_dir)
            log = run_dir / f"{kind}.log"
            log_text = log.read_text(errors="replace") if log.exists() else ""
            timed_out = timeout_s is not None and rc == TIMEOUT_RC
            records = _read_records(run_dir / f"{kind}.jsonl") if rc == 0 or timed_out else []
            status, err = classify(rc, log_text, records, timeout_s)
            row = dict(kind=kind, seq_len=seq, status=status, median_step_ms=None, tokens_per_s=None,
                       peak_mem_bytes=None, replay_store_bytes=None, error=err)
            if status == "partial":  # it trained at this length: keep what it measured
                row.update(run_metrics(records))
            if status == "ok":
                row.update(run_metrics(records))
                print(f"[{PROG}] seq_len {seq}: {kind} ok -- median step {row['median_step_ms']:.1f} ms, "
                      f"{row['tokens_per_s']:.0f} tokens/s, peak memory {row['peak_mem_bytes'] / 2**20:.1f} MiB",
                      flush=True)
            else:
                stopped[kind] = status
                print(f"[{PROG}] seq_len {seq}: {kind} {status.upper()} -- {err} (log: {log}); "
                      f"no longer lengths for {kind}", flush=True)
            rows.append(row)
    return rows


def longest_ok(rows: list[dict], kind: str) -> Optional[int]:
    """Longest length where the kind trained: all iterations (ok) or at least one before the time limit."""
    ok = [r["seq_len"] for r in rows if r["kind"] == kind and r["status"] in ("ok", "partial")]
    return max(ok) if ok else None


# ----------------------------------------------------------------------------- outputs
def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in rows:
            w.writerow([csv_value(r.get(k)) for k in CSV_FIELDS])


def _verdict(rows: list[dict], kind: str, lengths: list[int]) -> str:
    best = longest_ok(rows, kind)
    mine = [r for r in rows if r["kind"] == kind]
    if not mine:
        return "not run"
    last = mine[-1] if mine else None
    if best is None:
        text = "none"
    else:
        text = str(best)
    if last is not None and last["status"] == "oom":
        text += f" (out of memory at {last['seq_len']})"
    elif last is not None and last["status"] == "error":
        text += f" (failed with an error at {last['seq_len']}, not an OOM)"
    elif last is not None and last["status"] == "partial":
        text += f" ({last['error']} at {last['seq_len']}; longer lengths not tried)"
    elif last is not None and last["status"] == "timeout":
        text += f" (no iteration within the time limit at {last['seq_len']}: not an OOM; longer lengths not tried)"
    elif best is not None and best == max(lengths):
        text += " (the longest tried; did not run out of memory)"
    return text


def _warmup_only(r: Optional[dict]) -> Optional[dict]:
    """The row with ``warmup`` set when its step time comes from the first (warm-up) iteration alone."""
    if r is None:
        return None
    n = r.get("iterations")
    return dict(r, warmup=r.get("median_step_ms") is not None and n is not None and int(n) <= 1)


def read_csv(path: Path) -> list[dict]:
    """Rows of a longest.csv, numbers parsed (the inverse of write_csv)."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = {k: (r.get(k) or None) for k in CSV_FIELDS}
            row["seq_len"] = int(row["seq_len"])
            row["error"] = row["error"] or ""
            for k, conv in (("median_step_ms", float), ("tokens_per_s", float), ("peak_mem_bytes", int),
                            ("replay_store_bytes", int), ("iterations", int)):
                if row[k] is not None:
                    row[k] = conv(float(row[k]))
            rows.append(row)
    return rows


_MERGE_SAME = ("config", "device", "device_name", "torch", "megatron", "stock_backend")


def merge(dirs: Sequence[str]) -> tuple[list[dict], list[int], dict, int]:
    """Rows of several sweeps (one row per (kind, length); a later directory wins), their meta and iters."""
    by, meta, dates, flags = {}, None, [], []
    for d in dirs:
        path = Path(d) / "longest.csv"
        if not path.exists():
            raise UsageError(f"--merge: {path} does not exist")
        for r in read_csv(path):
            by[(r["kind"], r["seq_len"])] = r
        if not (Path(d) / "meta.json").exists():
            continue
        m = json.loads((Path(d) / "meta.json").read_text())
        if meta is None:
            meta = m
        else:  # rows of one table must come from the same model, GPU and software
            for key in _MERGE_SAME:
                if m.get(key) != meta.get(key):
                    raise UsageError(
                        f"--merge: {d} ran with {key}={m.get(key)!r}, an earlier directory with "
                        f"{meta.get(key)!r}; merge only sweeps of one config, device and version set")
        if m.get("date") and m["date"] not in dates:
            dates.append(m["date"])
        if m.get("hyscale_args") is not None and m["hyscale_args"] not in flags:
            flags.append(m["hyscale_args"])
    if meta is None:
        raise UsageError(f"--merge: none of {list(dirs)} has a meta.json (device, versions, date, config)")
    meta = dict(meta, date=", ".join(dates) or meta.get("date", "?"), merged_from=[str(d) for d in dirs])
    if flags:
        meta["hyscale_args"] = " | ".join(flags)
    rows = sorted(by.values(), key=lambda r: (r["seq_len"], KINDS.index(r["kind"])))
    return rows, sorted({r["seq_len"] for r in rows}), meta, int(meta.get("iters", 0))


def markdown(rows: list[dict], lengths: list[int], meta: dict, iters: int) -> str:
    by = {(r["kind"], r["seq_len"]): r for r in rows}
    mem_kind = "peak allocated, CUDA" if meta.get("device") == "cuda" else "peak RSS of the process, CPU"

    def cell(r, key, fmt):
        return "" if r is None or r.get(key) is None else fmt.format(r[key])

    def step(r):
        return cell(r, "median_step_ms", "{:.1f}") + (" (warm-up)" if r is not None and r["warmup"] else "")

    def mib(r):
        return "" if r is None or r.get("peak_mem_bytes") is None else f"{r['peak_mem_bytes'] / 2**20:.1f}"

    lines = [
        "# Longest trainable sequence: stock DSA vs HyScale",
        "",
        *([f"- command: `{meta['command']}`"] if meta.get("command") else []),
        f"- training flags: `{meta['config']}`; {iters} iterations per run; full recompute; HyScale with "
        "selection replay",
        f"- device: {meta['device_name']}; torch {meta['torch']}; megatron-core {meta['megatron']}; {meta['date']}",
        f"- stock backend: `--dsa-kernel-backend {meta['stock_backend']}`; each (kind, length) a separate process",
        *([f"- HyScale flags added by hyscale-longest: `{meta['hyscale_args']}`"] if meta.get("hyscale_args") else []),
        "",
        "| seq len | stock | stock step (ms) | stock tokens/s | stock peak (MiB) | HyScale | HyScale step (ms) "
        "| HyScale tokens/s | HyScale peak (MiB) | replay store (bytes) | speedup |",
        "|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for seq in lengths:
        st, hs = by.get(("stock", seq)), by.get(("hyscale", seq))
        status = {k: ("not run" if r is None else r["status"].upper() if r["status"] != "ok" else "ok")
                  for k, r in (("stock", st), ("hyscale", hs))}
        speed = ""
        st, hs = (_warmup_only(r) for r in (st, hs))
        if st and hs and st.get("median_step_ms") and hs.get("median_step_ms") and not (st["warmup"] or hs["warmup"]):
            speed = f"{st['median_step_ms'] / hs['median_step_ms']:.2f}x"
        lines.append(
            f"| {seq} | {status['stock']} | {step(st)} | {cell(st, 'tokens_per_s', '{:.0f}')} "
            f"| {mib(st)} "
            f"| {status['hyscale']} | {step(hs)} | {cell(hs, 'tokens_per_s', '{:.0f}')} "
            f"| {mib(hs)} "
            f"| {cell(hs, 'replay_store_bytes', '{}')} | {speed} |")
    lines += [
        "",
        f"**stock's longest trainable length: {_verdict(rows, 'stock', lengths)}; "
        f"HyScale's: {_verdict(rows, 'hyscale', lengths)}**",
        "",
        f"Step time: median without the warm-up iteration. Peak memory: {mem_kind}. \"not run\": the kind had "
        "already stopped (OOM, error or time limit) at a shorter length, or was not requested (`--kinds`). "
        "PARTIAL: the per-run time limit fired after at least one iteration (it trained at that length; "
        "step time from the iterations logged). (warm-up): only the first iteration finished, so the step time "
        "includes one-time costs (kernel JIT, allocator warm-up) and no speedup is computed from it.",
    ]
    errs = [r for r in rows if r["status"] != "ok"]
    if errs:
        lines += ["", "Stopped runs:", ""]
        lines += [f"- {r['kind']} at {r['seq_len']}: {r['status'].upper()} -- `{r['error']}`" for r in errs]
    if meta.get("device") != "cuda":
        lines += ["", "CPU run: it shows the mechanics only; the lengths that matter are measured on the GPU. "
                  + CPU_TIMING_NOTE]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- entry point
def _main(argv: list[str], runner: Runner) -> int:
    opts, rest = _parser().parse_known_args(argv)
    out = Path(opts.out)
    check_out_dir(out)
    if opts.merge:
        rows, lengths, meta, iters = merge([d for d in opts.merge.split(",") if d])
        out.mkdir(parents=True, exist_ok=True)
        (out / "meta.json").write_text(json.dumps(meta, indent=1))
        return _write_outputs(out, rows, lengths, meta, iters)
    rest = with_default_config(rest)
    hyscale_only = split_flags(opts.hyscale_args, "--hyscale-args")
    check_longest(expand_arg_files(rest), hyscale_only)
    _kinds(opts.kinds)
    # replay, its store in pinned host memory, each entry copied back only when its recompute reads
    # it (no prefetch: one [T, topk] int32 entry less on the GPU, 8 GiB at 1M); given flags come later
    # and win
    opts.hyscale_args = shlex.join([*LONGEST_HYSCALE_FLAGS, *hyscale_only])
    seq = opts.seq_lengths[0]
    check_run_flags(run_flags(opts, [*rest, "--seq-length", str(seq), "--max-position-embeddings", str(seq)],
                              out, opts.iters))
    meta = run_meta(PROG, argv, rest, stock_backend(opts.stock_backend), opts.iters)
    t0 = time.perf_counter()
    print(f"[{PROG}] {' '.join(t for t in rest if t.startswith('@'))}: seq lengths {opts.seq_lengths}, "
          f"{opts.iters} iterations each, stock backend {meta['stock_backend']}", flush=True)
    meta = dict(meta, iters=opts.iters, hyscale_args=opts.hyscale_args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    rows = sweep(opts, rest, out, runner)
    rc = _write_outputs(out, rows, opts.seq_lengths, meta, opts.iters)
    print(f"[{PROG}] {time.perf_counter() - t0:.1f} s total", flush=True)
    return rc


def main(argv: Optional[Sequence[str]] = None, runner: Runner = default_runner) -> int:
    return tool_main(PROG, lambda a: _main(a, runner), sys.argv[1:] if argv is None else argv)


def _write_outputs(out: Path, rows: list[dict], lengths: list[int], meta: dict, iters: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "longest.csv", rows)
    md = markdown(rows, lengths, meta, iters)
    (out / "longest.md").write_text(md)
    print(md, flush=True)
    print(f"[{PROG}] wrote {out}/longest.csv, longest.md", flush=True)
    return 1 if any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
