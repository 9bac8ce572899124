"""What ``hyscale-train``, ``hyscale-compare`` and ``hyscale-longest`` share.

Argument files and one-line errors, the like-for-like checks and the command line of each run,
the subprocess runner, metrics files, step-time medians and run metadata. Nothing here imports
Megatron or torch at module level: a refused command answers before any heavy import.
"""

from __future__ import annotations

import argparse
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

SPEC_MODULE = "hyscale_megatron.specs"
HYSCALE_SPEC = "hyscale_block_spec"
STOCK_SPEC = "stock_block_spec"
TRAIN_MODULE = "hyscale_megatron.tools.train"
RUNS = ("stock", "hyscale")  # stock first
BACKENDS = ("none", "tilelang", "cudnn")
# flags the comparing tools set per run and therefore refuse among the shared flags
OWNED_FLAGS = ("--hyscale", "--no-hyscale", "--spec", "--hyscale-run-name", "--hyscale-metrics-file",
               "--dsa-kernel-backend")
# a fresh rendezvous per run: never reuse the caller's process-group settings
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "TORCHELASTIC_RUN_ID")
CPU_TIMING_NOTE = ("CPU timings are not meaningful: both runs take PyTorch reference paths (HyScale's Triton "
                   "kernels run on CUDA) and the first iterations include one-time costs; performance is "
                   "measured on the GPU.")


class UsageError(ValueError):
    """The command line cannot run; the message says how to fix it."""


class RunFailed(RuntimeError):
    """A training subprocess exited with an error; the message names its log."""


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` that raises :class:`UsageError` with one line instead of printing its usage."""

    def error(self, message: str):
        raise UsageError(f"{message} ({self.prog} --help lists the options)")


def tool_main(prog: str, body, argv: Sequence[str]) -> int:
    """Run ``body(argv)``; a :class:`UsageError` or :class:`RunFailed` becomes one line on stderr."""
    try:
        return body(list(argv))
    except UsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1


# ----------------------------------------------------------------------------- flags
def expand_arg_files(argv: Sequence[str]) -> list[str]:
    """Replace every ``@FILE`` by the flags in FILE (shlex quoting, ``#`` comments, nesting)."""
    out: list[str] = []
    for tok in argv:
        if tok.startswith("@") and len(tok) > 1:
            path = Path(tok[1:])
            if not path.is_file():
                raise UsageError(f"argument file {path} (from {tok!r}) does not exist")
            out.extend(expand_arg_files(shlex.split(path.read_text(), comments=True)))
        else:
            out.append(tok)
    return out


def split_flags(text: str, what: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise UsageError(f"{what} {text!r}: {exc}") from None


def flag_present(argv: Sequence[str], flag: str) -> bool:
    return any(t == flag or t.startswith(flag + "=") for t in argv)


def flag_value(argv: Sequence[str], flag: str) -> Optional[str]:
    """The last value given to ``flag`` (``--flag V`` or ``--flag=V``), else None."""
    val = None
    for i, t in enumerate(argv):
        if t == flag and i + 1 < len(argv):
            val = argv[i + 1]
        elif t.startswith(flag + "="):
            val = t.split("=", 1)[1]
    return val


def flag_names(argv: Sequence[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in argv if t.startswith("--")]


def check_like_for_like(shared: Sequence[str], hyscale_only: Sequence[str] = ()) -> None:
    """Raise :class:`UsageError` when stock and HyScale runs of these flags would not compare like for like."""
    why = {
        "--no-hyscale": "a comparison needs HyScale in one of the two runs",
        "--hyscale": "the command sets --hyscale / --no-hyscale per run",
        "--spec": "the command chooses the layer spec of each run (stock_block_spec vs hyscale_block_spec)",
        "--dsa-kernel-backend": "the stock backend is chosen with --stock-backend",
    }
    for flag in OWNED_FLAGS:
        if flag_present(shared, flag):
            raise UsageError(f"refusing {flag} among the shared training flags: "
                             f"{why.get(flag, 'the command sets it per run')}.")
    for flag in flag_names(hyscale_only):
        if not flag.startswith(("--hyscale-", "--no-hyscale-")):
            raise UsageError(
                f"refusing {flag} in --hyscale-args: per-run flags may only be HyScale settings (--hyscale-*); "
                "seeds, data, model, parallel layout and recompute must be the same for both runs -- give them "
                "as shared flags.")
        if flag in ("--hyscale-run-name", "--hyscale-metrics-file", "--hyscale-core-loop"):
            raise UsageError(f"refusing {flag} in --hyscale-args: the command sets it.")
    if flag_value(shared, "--experimental-attention-variant") != "dsa":
        raise UsageError(
            "refusing a model without DSA layers: stock vs HyScale compares DeepSeek Sparse Attention; "
            "add --experimental-attention-variant dsa (and the --dsa-indexer-* flags), e.g. @configs/tiny_cpu.args.")
    if not flag_present(shared, "--multi-latent-attention"):
        raise UsageError("refusing a model without --multi-latent-attention: DSA layers are MLA layers.")
    for flag in ("--dsa-indexer-n-heads", "--dsa-indexer-head-dim", "--dsa-indexer-topk"):
        if not flag_present(shared, flag):
            raise UsageError(f"refusing: DSA model flag {flag} is missing.")


def topk_note(topk: Optional[int], seq_length: Optional[int]) -> Optional[str]:
    """The note for a top-k that is not smaller than the sequence (valid: every query keeps all its keys)."""
    if topk is None or seq_length is None or topk < seq_length:
        return None
    return (f"--dsa-indexer-topk {topk} is not smaller than --seq-length {seq_length}: every query selects all "
            "of its causal keys (dense attention through the sparse path)")


# ----------------------------------------------------------------------------- options of the comparing tools
def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def add_run_options(p: argparse.ArgumentParser, out_default: str) -> None:
    """The options both comparing tools take: output folder, stock backend, per-run and launcher flags."""
    p.add_argument("--out", default=out_default, help=f"Output directory (default {out_default}).")
    p.add_argument("--stock-backend", choices=("auto", *BACKENDS), default="auto",
                   help="Stock DSA kernel backend (--dsa-kernel-backend); auto: tilelang on CUDA when "
                        "importable, else none.")
    p.add_argument("--hyscale-args", default="",
                   help="Extra flags for the HyScale run(s) only; only --hyscale-* flags are allowed.")
    p.add_argument("--launcher", default="",
                   help="Command prefix for each run, e.g. 'torchrun --nproc-per-node 8'. Default: this Python.")
    p.add_argument("--core-loop", action="store_true", help="Pass --hyscale-core-loop to every run.")


def check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is an existing file; give a directory (it is created when missing).")


def stock_backend(choice: str) -> str:
    """``--stock-backend``: ``auto`` is TileLang on CUDA when it imports, else stock's PyTorch path."""
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


def run_flags(opts, shared: Sequence[str], out: Path, iters: Optional[int],
              ref_backend: Optional[str] = None) -> dict[str, list[str]]:
    """The training flags of each run: ``stock`` and ``hyscale``, plus ``stock_ref`` (the stock flags with
    the reference backend) when ``ref_backend`` is given. They differ only in spec, ``--hyscale-args``,
    run name and metrics file."""
    backend = stock_backend(opts.stock_backend)
    extra = ["--train-iters", str(iters)] if iters is not None else []
    if opts.core_loop:
        extra.append("--hyscale-core-loop")

    def stock(name: str, backend_: str) -> list[str]:
        return [*shared, "--dsa-kernel-backend", backend_, *extra, "--spec", SPEC_MODULE, STOCK_SPEC,
                "--no-hyscale", "--hyscale-run-name", name, "--hyscale-metrics-file", str(out / f"{name}.jsonl")]

    flags = {
        "stock": stock("stock", backend),
        "hyscale": [*shared, "--dsa-kernel-backend", backend, *extra, "--spec", SPEC_MODULE, HYSCALE_SPEC,
                    "--hyscale", *split_flags(opts.hyscale_args, "--hyscale-args"),
                    "--hyscale-run-name", "hyscale", "--hyscale-metrics-file", str(out / "hyscale.jsonl")],
    }
    if ref_backend is not None:
        flags["stock_ref"] = stock("stock_ref", ref_backend)
    return flags


def launch_prefix(launcher: str) -> list[str]:
    """``python -m hyscale_megatron.tools.train`` (this Python) or ``LAUNCHER -m ...`` (e.g. torchrun)."""
    return [*(split_flags(launcher, "--launcher") if launcher else [sys.executable]), "-m", TRAIN_MODULE]


def check_run_flags(flags: dict[str, list[str]]) -> list[str]:
    """Parse every run's flags with Megatron's parser before anything runs; returns the notes to print
    once (e.g. a top-k not smaller than the sequence). Raises :class:`UsageError` with one line."""
    from .train import check_flags  # noqa: PLC0415 - imports Megatron's argument parser

    notes: list[str] = []
    for run, argv in flags.items():
        try:
            args = check_flags(argv)
        except UsageError as exc:
            raise UsageError(f"the {run} run's flags: {exc}") from None
        note = topk_note(getattr(args, "dsa_indexer_topk", None), getattr(args, "seq_length", None))
        if note and note not in notes:
            notes.append(note)
    return notes


# ----------------------------------------------------------------------------- running
def _is_progress(line: str) -> bool:
    text = line.lstrip()
    return ((" iteration " in line and "|" in line) or text.startswith(("> hyscale-train", "[hyscale]", "Traceback"))
            or "Error" in line)


def run_process(name: str, cmd: list[str], out: Path, prog: str) -> tuple[int, float, list[str]]:
    """Run one training subprocess, echoing its progress lines as ``[NAME] ...``, its full log in
    ``OUT/NAME.log`` (``OUT/NAME.jsonl``, its metrics file, removed first).
    Returns (exit code, wall seconds, the last 40 log lines)."""
    log_path, metrics = out / f"{name}.log", out / f"{name}.jsonl"
    if metrics.exists():
        metrics.unlink()
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    print(f"[{prog}] {name}: {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    tail: list[str] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            tail = (tail + [line])[-40:]
            if _is_progress(line):
                print(f"[{name}] {line.rstrip()}", flush=True)
        rc = proc.wait()
    return rc, time.perf_counter() - t0, tail


def read_metrics(path: Path) -> list[dict]:
    """The per-iteration records of one run's ``--hyscale-metrics-file``."""
    if not path.exists():
        raise RunFailed(f"{path} was not written: did the run reach its first iteration?")
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except ValueError as exc:
        raise RunFailed(f"{path}: not a metrics file ({exc})") from None


def steady_medians(records: list[dict]) -> dict:
    """Median step time and tokens/s without the first (warm-up) iteration; peak memory over all."""
    steady = records[1:] if len(records) > 1 else records
    return dict(iterations=len(records), median_step_ms=statistics.median(r["step_ms"] for r in steady),
                median_tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
                peak_mem_bytes=max(int(r["peak_mem_bytes"]) for r in records),
                replay_store_bytes=max(int(r.get("replay_store_bytes") or 0) for r in records))


def csv_value(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else str(v)
    return str(v)


# ----------------------------------------------------------------------------- provenance
def run_meta(prog: str, argv: Sequence[str], shared: Sequence[str], backend: str,
             iters: Optional[int]) -> dict:
    """``meta.json``: the command as typed, the training flags both runs share, device, versions, date."""
    import torch  # noqa: PLC0415

    try:
        from megatron.core.package_info import __version__ as mver  # noqa: PLC0415
    except Exception:  # noqa: BLE001
        mver = "unknown"
    cuda = torch.cuda.is_available()
    config = [*shared, *(["--train-iters", str(iters)] if iters is not None else [])]
    return dict(command=shlex.join([prog, *argv]), config=shlex.join(config) or "(no flags)",
                device="cuda" if cuda else "cpu",
                device_name=torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)",
                torch=torch.__version__, megatron=mver, stock_backend=backend,
                date=time.strftime("%Y-%m-%d %H:%M"), argv=list(shared))
