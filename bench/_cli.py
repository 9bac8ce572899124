"""Command line shared by the per-kernel bench scripts (no torch import: a --cpu-smoke run must set
TRITON_INTERPRET before torch / triton load)."""

from __future__ import annotations

import argparse
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parser(name: str, budget_s: float, **budget_help) -> argparse.ArgumentParser:
    """--budget-s, --out (default $OUT or /tmp/<name>), --csv (bench/results/<name>.csv), --cpu-smoke."""
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=budget_s, **budget_help)
    p.add_argument("--out", default=os.environ.get("OUT", f"/tmp/{name}"))
    p.add_argument("--csv", default=os.path.join(RESULTS, f"{name}.csv"))
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 (plumbing only)")
    return p


def smoke(args) -> bool:
    """For --cpu-smoke: the interpreter on, rows to <out>/smoke.csv. Returns args.cpu_smoke."""
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.csv = os.path.join(args.out, "smoke.csv")
    return args.cpu_smoke
