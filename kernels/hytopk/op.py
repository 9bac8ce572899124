"""Public HyTopK op: input checks, the launch configuration, and the choice of Triton kernel or reference."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from .._common import check, check_tensor, use_triton
from . import _kernel
from .reference import hytopk_reference

_log = logging.getLogger("hyscale_kernels")

MAX_TOPK = 2048
KTH_SEARCHES = ("interp", "radix")
SLOTS = ("ballot", "sum")
NUM_WARPS = 4  # one warpgroup: the key groups of a 64-key tile are its 4 warps
NUM_STAGES = 3  # key tiles in flight (cp.async pipeline of the key loop)
PROGRAMS_PER_SM = 2  # persistent programs per SM: 2 x 4 warps fit the register file at the default 255 per thread
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Config:
    """HyTopK's launch shape. ``default_config(H, topk)`` picks it per head count; the defaults are H 64, topk 2048."""

    block_n: int = 64  # keys per tile (the MMA's M side); a multiple of 4, at most 128 (4 key groups of <= 32)
    rows: int = 4  # query rows per tile (a power of two): the MMA's N side is rows * H
    min_free_tiles: int = 4  # compact a row block's buffers when a region has fewer free slots than this many tiles
    sel_chunk: int = 2048  # rows * chunk elements per step of a select's rewrite
    warm_start: int = 1024  # keys sampled per row block for the starting thresholds (a power of two; 0: off)
    kth_search: str = "interp"  # how a select finds each row's k-th candidate: "interp" or "radix" (KTH_SEARCHES)
    slots: str = "ballot"  # append slots: "ballot" (warp ballots; 4 or 8 rows, block_n 64) or "sum" (mask sums)
    select_split: int = 1  # 2: selects run on the even, then the odd rows (8-row tiles at topk 2048 spill otherwise)


def default_config(H: int, topk: int, interpret: bool = False) -> Config:
    """The launch shape for H index heads. 4 query rows per tile at H 64 (an MMA of N = 256), 8 at H 32 and 16
    (N = 8 H: each K tile feeds a wider MMA; the selects split into even / odd rows so that [8, CAP] keys fit in
    registers); fewer heads keep a few rows per tile instead of 256 / H (the per-row selection state then fits in
    registers). Ballot slots where a tile has 4 rows, or 8 at H 32 / 16. The interpolation k-th search from topk
    1024 (3 counts per radix pass cost most on 2048+ slots), the radix search below. The interpreter runs small
    tiles: 16 keys, 2 rows, one tile of margin."""
    kth = "interp" if topk >= 1024 else "radix"
    if interpret:
        return Config(block_n=16, rows=2, min_free_tiles=1, sel_chunk=64, kth_search="radix", slots="sum")
    if H >= 64:
        cfg = Config(rows=max(1, 256 // H), kth_search=kth)
    elif H in (16, 32):
        cfg = Config(rows=8, select_split=2, kth_search=kth)
    else:
        cfg = Config(rows=max(32, 4 * H) // H, kth_search=kth)
    ballot = _ballot_default and (cfg.rows == 4 or H in (16, 32)) and ballot_applies(cfg, H)
    return replace(cfg, slots="ballot" if ballot else "sum")


def lane_rows(R: int, H: int) -> bool:
    """Whether each accumulator lane of the score tile holds whole rows (_kernel._block_columns): 4 | R, even H."""
    return R % 4 == 0 and H % 2 == 0


def ballot_applies(cfg: Config, H: int) -> bool:
    """Whether ballot slots can run this launch: 64-key tiles of 4 or 8 lane rows (the layouts _kernel models)."""
    return cfg.block_n == 64 and cfg.rows in _kernel.BALLOT_LAYOUTS and lane_rows(cfg.rows, H)


def check_config(cfg: Config) -> None:
    """Refuse launch shapes the kernel cannot run, naming the field to change."""
    check(cfg.block_n % 4 == 0 and 16 <= cfg.block_n <= 128 and cfg.block_n & (cfg.block_n - 1) == 0,
          f"hytopk: Config.block_n must be 16, 32, 64 or 128 (4 key groups of <= 32 keys), got {cfg.block_n}")
    check(cfg.rows >= 1 and cfg.rows & (cfg.rows - 1) == 0,
          f"hytopk: Config.rows must be a power of two, got {cfg.rows}")
    check(cfg.min_free_tiles >= 1, f"hytopk: Config.min_free_tiles must be >= 1, got {cfg.min_free_tiles}")
    check(cfg.sel_chunk >= 1 and cfg.sel_chunk & (cfg.sel_chunk - 1) == 0,
          f"hytopk: Config.sel_chunk must be a power of two, got {cfg.sel_chunk}")
    check(cfg.warm_start >= 0, f"hytopk: Config.warm_start must be >= 0 (0 = off), got {cfg.warm_start}")
    check(cfg.kth_search in KTH_SEARCHES, f"hytopk: Config.kth_search must be one of {KTH_SEARCHES}, got "
          f"{cfg.kth_search!r}")
    check(cfg.slots in SLOTS, f"hytopk: Config.slots must be one of {SLOTS}, got {cfg.slots!r}")
    check(cfg.select_split in (1, 2) and cfg.select_split <= cfg.rows,
          f"hytopk: Config.select_split must be 1 or 2 (at most Config.rows), got {cfg.select_split}")


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


class Geometry(NamedTuple):
    """A launch's sizes: rows per tile, candidate slots per row, select chunk, compaction margin (slots), warm-start
    sample keys and D_I rounded up to a power of two."""

    rows: int
    cap: int
    chunk: int
    min_free: int
    warm: int
    d_p2: int


def geometry(D: int, topk: int, cfg: Config) -> Geometry:
    """CAP >= 2 topk and >= topk + 2 min_free, so a compaction always leaves room for 2 tiles past the margin."""
    min_free = cfg.min_free_tiles * cfg.block_n
    cap = _pow2_ceil(max(2 * topk, topk + 2 * min_free))
    chunk = max(1, min(cap, cfg.sel_chunk // cfg.rows))
    warm = min(_pow2_ceil(cfg.warm_start), cap) if cfg.warm_start > 0 else 0
    return Geometry(cfg.rows, cap, chunk, min_free, warm, _pow2_ceil(max(D, 16)))


def kernel_constexprs(cfg: Config, H: int, D: int, topk: int, relu: bool, write_scores: bool) -> dict:
    """hytopk_kernel's compile-time arguments for a launch (also what bench/aot_sass.py compiles)."""
    g = geometry(D, topk, cfg)
    return dict(H=H, D=D, D_P2=g.d_p2, R=g.rows, BLOCK_N=cfg.block_n, CAP=g.cap, CHUNK=g.chunk, MIN_FREE=g.min_free,
                WARM=g.warm, RELU=bool(relu), WRITE_SCORES=bool(write_scores), KTH_INTERP=cfg.kth_search == "interp",
                BALLOT=cfg.slots == "ballot" and ballot_applies(cfg, H), SPLIT=cfg.select_split)


def n_programs(n_blocks: int, device: torch.device) -> int:
    """The persistent grid: PROGRAMS_PER_SM per SM on a GPU, 3 under the interpreter (enough to share scratch rows)."""
    if device.type != "cuda":
        return max(1, min(n_blocks, 3))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_blocks, sms * PROGRAMS_PER_SM))


def pad_keys(k: torch.Tensor, block_n: int) -> torch.Tensor:
    """k with at least one tile of rows: the key loop loads whole tiles, unmasked (zero rows are never visible)."""
    S, D = k.shape
    return torch.cat([k, k.new_zeros(block_n - S, D)]) if 0 < S < block_n else k


_warm_stats = None  # int32 [3] of the last launch (a device tensor, read without a sync)
_ballot_default = True  # default_config picks ballot slots until a compiled layout does not match the model
_ballot_checked: set = set()
_ballot_ignored: set = set()


def warm_stats() -> dict | None:
    """Counters of the last HyTopK launch (None before any): rows started from a sampled threshold, rows re-run from
    -inf (fewer than topk keys above it) and row blocks that needed that second pass. Reading them synchronizes."""
    if _warm_stats is None:
        return None
    a = _warm_stats.tolist()
    return dict(warm_rows=a[0], fallback_rows=a[1], fallback_blocks=a[2])


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The outputs' and the scratch's allocation (tests fill it with stale values to catch unwritten entries)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _launch(q, w, k, starts, ends, topk: int, relu: bool, return_scores: bool, config: Config | None):
    global _warm_stats
    T, H, D = q.shape
    S = k.shape[0]
    cfg = config or default_config(H, topk, interpret=not q.is_cuda)
    check_config(cfg)
    k = pad_keys(k, cfg.block_n)
    meta = kernel_constexprs(cfg, H, D, topk, relu, return_scores)
    if cfg.slots == "ballot" and not meta["BALLOT"] and cfg not in _ballot_ignored:
        _ballot_ignored.add(cfg)
        _log.info("hytopk: Config.slots='ballot' needs block_n=64 and 4 or 8 rows per tile with an even H_I (got "
                  "block_n=%d, rows=%d, H_I=%d): the mask sum gives the same slots", cfg.block_n, cfg.rows, H)
    R, cap, chunk = meta["R"], meta["CAP"], meta["CHUNK"]
    n_blocks = -(-T // R)
    n_prog = n_programs(n_blocks, q.device)
    dev = q.device
    out_idx = _empty((T, topk), torch.int32, dev)
    out_val = _empty((T, topk) if return_scores else (1,), torch.float32, dev)
    # candidate bits then key indices, [n_prog, R, cap] each, and `chunk` spare slots: the select's rewrite loads
    # the next chunk ahead, past the last row of the index half on its last step (read, never used)
    n_buf = n_prog * R * cap
    flat = _empty(2 * n_buf + chunk, torch.int32, dev)
    stats = torch.zeros(3, dtype=torch.int32, device=dev)
    if T == 0:
        return (out_idx, out_val) if return_scores else out_idx
    kern = _kernel.hytopk_kernel[(n_prog,)](
        q, w, k, starts, ends, out_idx, out_val, flat[:n_buf], flat[n_buf:2 * n_buf], stats, T, S, topk, n_blocks,
        n_prog, **meta, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if meta["BALLOT"] and q.is_cuda and not _ballot_guard(kern, explicit=config is not None):
        return _launch(q, w, k, starts, ends, topk, relu, return_scores, replace(cfg, slots="sum"))
    _warm_stats = stats
    return (out_idx, out_val) if return_scores else out_idx


def _ballot_guard(kern, explicit: bool) -> bool:
    """After a launch with ballot slots: True if the compiled layout is the modelled one. Otherwise an explicit
    Config raises (_check_ballot_layout's message); the default logs a warning, turns ballot slots off in
    default_config for the process and returns False, and the caller re-runs the launch with mask-sum slots."""
    global _ballot_default
    try:
        _check_ballot_layout(kern.asm["ttgir"])
        return True
    except RuntimeError as exc:
        if explicit:
            raise
        _log.warning("%s -- the default config uses slots='sum' from now on (re-running this call)", exc)
        _ballot_default = False
        return False


def _check_ballot_layout(ttgir: str) -> None:
    """Ballot slots compute offsets from lane ids: valid only if Triton laid the candidate tile out as
    _kernel.BALLOT_LAYOUTS[R] says. Checked once per compiled kernel on its TTGIR (the layout of the ballot's
    inline-asm operand); a mismatch (another Triton version, another launch shape) raises instead of returning
    wrong slots."""
    if ttgir in _ballot_checked:
        return
    found, want = [], []
    for line in (x for x in ttgir.splitlines() if "vote.sync.ballot" in x and "elementwise_inline_asm" in x):
        for rows, alias in set(re.findall(r"tensor<4x16x(\d+)xi32, (#[\w.]+)>", line)):
            m = re.search(r"^" + re.escape(alias) + r" = #ttg\.linear<\{(.*?), block = \[\]\}>", ttgir, re.M)
            found.append(m.group(1) if m else alias)
            want.append(_kernel.BALLOT_LAYOUTS.get(int(rows)))
    if not found or any(f != w for f, w in zip(found, want)):
        expected = want[0] if want and want[0] else _kernel.BALLOT_LAYOUTS[4]
        raise RuntimeError(
            f"hytopk: Config.slots='ballot' assumes the candidate tile layout {{{expected}}} (Triton 3.6, sm_90); "
            f"this compiled kernel has {found or 'no ballot op'}. Use Config(slots='sum') (the same slots, computed "
            "by a mask sum)")
    _ballot_checked.add(ttgir)


def shape_unsupported(H: int, D: int, topk: int) -> str | None:
    """Why the kernel cannot take H_I index heads of dim D_I with this top-k (None if it can)."""
    if not (1 <= H <= 128 and (H & (H - 1)) == 0):
        return f"H_I must be a power of two <= 128, got {H}"
    if not (D % 16 == 0 and 16 <= D <= 256):
        return f"D_I must be a multiple of 16 in [16, 256], got {D}"
    if not 1 <= topk <= MAX_TOPK:
        return f"topk must be in [1, {MAX_TOPK}], got {topk}"
    return None


def _validate(q, w, k, starts, ends, topk, check_bounds):
    check_tensor("q", q, ndim=3, dtypes=_FLOAT)
    dev = q.device
    check_tensor("w", w, ndim=2, dtypes=_FLOAT, device=dev)
    check_tensor("k", k, ndim=2, dtypes=_FLOAT, device=dev)
    check_tensor("starts", starts, ndim=1, dtypes=(torch.int32,), device=dev)
    check_tensor("ends", ends, ndim=1, dtypes=(torch.int32,), device=dev)
    T, H, D = q.shape
    S = k.shape[0]
    if k.dtype != q.dtype:
        raise TypeError(f"k must have the dtype of q ({q.dtype}), got {k.dtype}")
    check(tuple(w.shape) == (T, H), f"w must have shape [T, H_I] = {[T, H]}, got {list(w.shape)}")
    check(k.shape[1] == D, f"k must have shape [S, D_I] with D_I = {D} (from q), got {list(k.shape)}")
    check(tuple(starts.shape) == (T,), f"starts must have shape [T] = [{T}], got {list(starts.shape)}")
    check(tuple(ends.shape) == (T,), f"ends must have shape [T] = [{T}], got {list(ends.shape)}")
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"topk must be an int, got {type(topk).__name__}")
    why = shape_unsupported(H, D, topk)
    check(why is None, why or "")
    for name, t in (("q", q), ("w", w), ("k", k), ("starts", starts), ("ends", ends)):
        check(t.is_contiguous(), f"{name} must be contiguous (call .contiguous() first)")
    # in-kernel offsets into q / out / k are int64; S, T and T * H_I (the w and bounds rows) are int32
    check(S < 2**31 - 1 and T * H < 2**31, f"T * H_I ({T} x {H}) and S ({S}) must be < 2**31 (int32 row offsets)")
    check(S * D < 2**31, f"k has S x D_I = {S} x {D} elements: must be < 2**31 (the key loop's int32 offsets; "
          f"S up to {(2**31 - 1) // D} keys at D_I = {D})")
    if check_bounds and T > 0:
        lo = torch.stack([starts.min(), (ends - starts).min(), -ends.max()]).tolist()
        check(lo[0] >= 0, f"starts must be >= 0, got min {lo[0]}")
        check(-lo[2] <= S, f"ends must be <= S = {S}, got max {-lo[2]}")
        check(lo[1] >= 0, "starts must be <= ends for every row (found starts > ends)")


def hytopk(
    q: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    topk: int,
    relu: bool = True,
    return_scores: bool = False,
    *,
    impl: str = "auto",
    check_bounds: bool = True,
    config: Config | None = None,
):
    """Exact top-k of the lightning-indexer scores, never materializing the score table.

    Scores: ``I[t, s] = sum_h w[t, h] * act(q[t, h, :] . k[s, :])``, act = ReLU if ``relu`` else identity,
    accumulated in fp32. Row t keeps the ``topk`` best keys among ``starts[t] <= s < ends[t]`` under the canonical
    order (score descending, then key index ascending); rows with fewer visible keys are padded with -1.
    Deterministic: the same inputs give the same output, bit for bit.

    Args:
        q: [T, H_I, D_I] bf16 / fp16 / fp32, contiguous. H_I a power of two <= 128 (64, 32 or 4 in practice), D_I a
            multiple of 16 in [16, 256] (128 in practice). fp32 multiplies in IEEE fp32 (no TF32).
        w: [T, H_I] head weights, bf16 / fp16 / fp32 (used in fp32), contiguous.
        k: [S, D_I] index keys, the dtype of q, contiguous.
        starts, ends: int32 [T], 0 <= starts[t] <= ends[t] <= S: causal, packed / varlen and context-parallel rows
            are all expressed this way. starts == ends masks a row (all -1).
        topk: 1..2048. topk > S or > a row's visible keys is fine (-1 padding).
        relu: ReLU (DeepSeek) or identity (GLM-5 style; scores may be negative).
        return_scores: also return the selected scores.
        impl: "auto" (CUDA tensors -> Triton; CPU tensors -> the Triton interpreter when TRITON_INTERPRET=1 was set
            before triton was imported, else the PyTorch reference), "triton" or "reference".
        check_bounds: validate starts / ends against [0, S] (one small device sync).
        config: a launch shape instead of ``default_config(H_I, topk)`` (benchmarks, tests).

    Returns:
        indices int32 [T, topk]; with ``return_scores`` also the scores fp32 [T, topk] (-inf where padded). Order
        within a row: the Triton path returns the selected keys in a deterministic buffer order, then the -1
        padding; the reference path returns canonical order (score descending). Compare rows as sets.
    """
    _validate(q, w, k, starts, ends, topk, check_bounds)
    if use_triton("hytopk", q, impl):
        return _launch(q, w, k, starts, ends, topk, relu, return_scores, config)
    return hytopk_reference(q, w, k, starts, ends, topk, relu=relu, return_scores=return_scores)


__all__ = ["hytopk", "Config", "default_config", "MAX_TOPK", "shape_unsupported", "warm_stats"]
