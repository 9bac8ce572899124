"""Shared helpers of the tools' tests (hyscale-train, hyscale-compare, hyscale-longest)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = f"@{ROOT / 'configs' / 'tiny_cpu.args'}"
# shorter sequence for in-process trainings: same model, same contracts, faster steps
FAST = ["--seq-length", "128", "--max-position-embeddings", "128"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# meta.json of a GPU comparison (hand-written keys as hyscale-compare writes them)
META_GPU = dict(command="hyscale-compare --out runs/x @configs/x.args", config="@configs/x.args --train-iters 3",
                device="cuda", device_name="NVIDIA H200", torch="t", megatron="m", stock_backend="tilelang",
                date="d", argv=["@configs/x.args"])
META_CPU = dict(META_GPU, device="cpu", device_name="CPU (2 cores)", stock_backend="none")


def fake_records(run: str, n: int, loss0: float = 4.0, step_ms: float = 10.0) -> list[dict]:
    """``n`` metrics records of a run whose LM loss falls by 0.1 per iteration."""
    return [dict(iteration=i + 1, lm_loss=loss0 - 0.1 * i, indexer_loss=1e-3, step_ms=step_ms,
                 tokens_per_s=1e3 / step_ms, peak_mem_bytes=2**20 * (10 if run == "stock" else 5),
                 replay_store_bytes=None if run == "stock" else 4096) for i in range(n)]


def write_metrics(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_run(out: Path, records: dict[str, list[dict]], meta: dict | None = META_GPU) -> None:
    """What a finished comparison leaves in ``out``: one metrics file per run and meta.json."""
    out.mkdir(parents=True, exist_ok=True)
    for run, recs in records.items():
        write_metrics(out / f"{run}.jsonl", recs)
    if meta is not None:
        (out / "meta.json").write_text(json.dumps(meta, indent=2))


def error_lines(err: str, prog: str) -> list[str]:
    """The lines a tool printed about the error (``PROG: ...``); import-time warnings are not counted."""
    return [ln for ln in err.splitlines() if ln.startswith(f"{prog}:")]
