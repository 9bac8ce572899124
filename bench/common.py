"""Shared benchmark plumbing: timing (medians + 20/80 percentiles), peak memory, CSV rows."""

from __future__ import annotations

import csv
import datetime as _dt
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def env_info() -> dict:
    info = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__,
                date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"), command=" ".join(sys.argv))
    for mod in ("triton", "megatron.core", "tilelang"):
        try:
            m = __import__(mod, fromlist=["_"])
            info[mod.split(".")[0]] = getattr(m, "__version__", "?")
        except Exception:  # noqa: BLE001
            info[mod.split(".")[0]] = None
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=os.path.dirname(__file__)).stdout.strip() or None
    except Exception:  # noqa: BLE001
        info["commit"] = None
    info["kernels_sha"] = kernels_sha()
    return info


def kernels_sha() -> str:
    """Short sha256 of kernels/**/*.py: names the kernel code that ran even where git metadata is stale
    (a copied checkout's git metadata may name another commit)."""
    import hashlib

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels")
    h = hashlib.sha256()
    for d, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            if f.endswith(".py"):
                with open(os.path.join(d, f), "rb") as fh:
                    h.update(f.encode() + b"\0" + fh.read())
    return h.hexdigest()[:10]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_once(fn) -> float:
    """ms of one call of fn(): CUDA events on a GPU, the wall clock on the CPU."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e)


def percentile(ts, p: float) -> float:
    """The p-quantile (0..1) of ts, nearest rank."""
    ts = sorted(ts)
    return ts[min(len(ts) - 1, int(p * (len(ts) - 1) + 0.5))]


def time_ms(fn, warmup: int = 1, min_iters: int = 3, max_iters: int = 20, target_ms: float = 1500.0) -> dict:
    """Median and 20/80 percentiles of fn() in ms (CUDA events), after warm-up."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    while len(ts) < max_iters:
        ts.append(time_once(fn))
        if len(ts) >= min_iters and sum(ts) > target_ms:
            break
    return dict(ms=round(statistics.median(ts), 3), p20=round(percentile(ts, 0.2), 3),
                p80=round(percentile(ts, 0.8), 3), iters=len(ts))


def causal_indices(T: int, K: int, device, seed: int = 0, S: int | None = None, rows: int = 2048) -> torch.Tensor:
    """[T, K] int32 duplicate-free causal rows, -1 padded: the top-k of random scores over keys
    <= S - T + t (S = T by default), in row chunks so the [rows, S] score block stays small."""
    S = T if S is None else S
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.empty(T, K, dtype=torch.int32, device=device)
    keys = torch.arange(S, device=device)
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        sc = torch.rand(r1 - r0, S, device=device, generator=g)
        lim = S - T + torch.arange(r0, r1, device=device)
        sc.masked_fill_(keys[None, :] > lim[:, None], -1.0)
        v, i = sc.topk(K, dim=-1, sorted=False)
        idx[r0:r1] = i.masked_fill(v < 0, -1).int()
    return idx


def ascending_rows(idx: torch.Tensor) -> torch.Tensor:
    """Index rows in HyTopK's output order: ascending keys, -1 padding last (same sets)."""
    big = torch.iinfo(torch.int32).max
    out = torch.where(idx < 0, big, idx).sort(dim=1).values
    return torch.where(out == big, -1, out).to(idx.dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor, rows: int = 2048) -> float:
    """||a - b|| / ||b|| over b's finite entries, in row chunks: whole-tensor fp32 copies at 64K tokens x
    128 heads (~17 GiB each, plus masks) ran a 2026-12-02 benchmark out of memory."""
    num = den = 0.0
    for r0 in range(0, b.shape[0], rows):
        x, y = a[r0:r0 + rows].float(), b[r0:r0 + rows].float()
        fin = torch.isfinite(y)
        num += float(((x - y)[fin] ** 2).sum())
        den += float((y[fin] ** 2).sum())
    return (num ** 0.5) / max(den ** 0.5, 1e-12)


def peak_extra_bytes(fn) -> int:
    if not torch.cuda.is_available():
        fn()
        return -1
    sync()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return torch.cuda.max_memory_allocated() - base


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def append_csv(path: str, rows: list[dict]) -> None:
    if not rows:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    keys = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    exists = os.path.exists(path)
    if exists:
        with open(path) as f:
            header = next(csv.reader(f), [])
        keys = header + [k for k in keys if k not in header]
        if keys != header:  # widen the file
            with open(path) as f:
                old = list(csv.DictReader(f))
            bad = [i + 2 for i, r in enumerate(old) if None in r]
            if bad:
                raise ValueError(f"{path}: lines {bad[:5]} have more fields than its header; fix the file "
                                 "(a hand merge?) before appending")
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=keys)
                w.writeheader()
                w.writerows(old)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        if not exists:
            w.writeheader()
        for r in rows:
            w.writerow({k: (json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in r.items()})


def markdown_table(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def import_old_kernels(folder: str, needs: str = "__init__.py"):
    """The ``kernels/`` tree under ``folder`` (e.g. ``git archive <commit> kernels | tar -x -C folder``) as the
    package ``hyscale_kernels_old``, its relative imports intact, beside the current ``hyscale_kernels``."""
    root = os.path.join(os.path.abspath(folder), "kernels")
    if not os.path.isfile(os.path.join(root, needs)):
        raise SystemExit(f"--old {folder}: no kernels/{needs} there (git archive <commit> kernels | tar -x -C {folder})")
    spec = importlib.util.spec_from_file_location("hyscale_kernels_old", os.path.join(root, "__init__.py"),
                                                  submodule_search_locations=[root])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["hyscale_kernels_old"] = pkg
    spec.loader.exec_module(pkg)
    return pkg
