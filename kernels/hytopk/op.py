"""Public HyTopK op: input checks, configuration and dispatch (Triton kernel or reference)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

import torch

from .._common import check, check_tensor
from . import _kernel
from .reference import hytopk_reference

_log = logging.getLogger("hyscale_kernels")

MAX_TOPK = 2048
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
_IMPLS = ("auto", "triton", "reference")
_logged_reference = False
WARM_Z = 4.0  # warm start: sampled quantile this many binomial standard deviations above the k boundary
WARM_MIN = 16  # warm start: fewest visible sample keys a row needs to use it
KTH_SEARCHES = ("radix", "interp")  # Config.kth_search values
WARM_SAMPLES = ("spread", "head")  # Config.warm_sample values
WARM_SEARCHES = ("kth", "window")  # Config.warm_search values (kernel constexpr WARM_WIN)
APPENDS = ("tile", "mask", "warps")  # Config.append values (kernel constexpr APPEND = index)
KEY_GROUPS = 4  # append="warps": key groups per tile (kernel constant KEY_GROUPS: one warpgroup's 4 warps)
GROUP_MASKS = ("sum", "ballot")  # Config.group_mask values (kernel constexpr BALLOT)
HEAD_SUMS = ("pairs", "chains")  # Config.head_sum values (kernel constexpr LANE_ROWS = 1 + index; 0: lane_rows off)
_ballot_default = True  # default_config uses group_mask="ballot" (4-row tiles) until a layout check fails
_warm_stats = None  # int32 [3] of the last warm-start launch (device tensor, read without a sync)


def interpreter_active() -> bool:
    """True when the Triton kernel was defined under TRITON_INTERPRET=1 (runs on CPU tensors)."""
    return type(_kernel.hytopk_kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class Config:
    """Launch shape. rows_x_heads = R * H query-head rows per MMA (the MMA's N side)."""

    block_n: int = 64  # keys per tile (MMA M side)
    rows_x_heads: int = 256
    num_warps: int = 4
    # 3 key-tile stages: 64K H64 92.5 -> 88.2 ms, floor 64.8 -> 62.2 (H200, session 7); H32 73.9 -> 68.3
    num_stages: int = 3
    # persistent programs per SM (the grid is SMs x this). Above 2 (4 warps each), the registers per thread are capped
    # so that they fit together (register_cap): 3 -> 168 per thread; shared memory must fit too (num_stages 2)
    programs_per_sm: int = 2
    cap_mult: int = 2  # candidate slots per row = cap_mult * topk (power of two, >= topk + 2*min free)
    min_free_tiles: int = 4  # compact a row block's buffers when fewer free slots than this many tiles
    sel_chunk: int = 2048  # R * CHUNK elements per step of the select
    # radix-select bits per counting pass: 2 = the early-stopping 2-bit select (16 passes at most; a row stops
    # once its prefix bucket's lower bound has exactly topk keys at or above it; the count above the k-th key
    # comes from its own passes and the tie-ranking scan is skipped when no row has more keys equal to its
    # k-th than fit) or 1 (32 passes, a count pass, always ranks ties). Output bit-identical. The full 2-bit
    # search was 1.10x faster than 1 bit at 64K on the H200 (session 6); the early stop then took 64K causal
    # H 64 75.25 -> 74.54 ms (session 10, bench/NOTES_hytopk.md)
    search_bits: int = 2
    # sampled warm-start threshold: keys scored per row block before its key loop (rounded up to a
    # power of two, at most CAP); 0 = off. Exact: rows left with fewer than topk candidates are re-run
    # from -inf (see warm_stats()). 512 vs 0: 1.28x faster at 64K (H200, session 6). 1024 since session 10
    # (H200, 64K causal, full 2-bit search at 512 -> early 2-bit search at 1024): H 64 75.25 -> 74.45 ms
    # (74.54 at 512), H 32 50.69 -> 47.84, H 4 k 512 8.48 -> 7.97; output bit-identical (bench/NOTES_hytopk.md)
    warm_start: int = 1024
    # candidate append in the key loop. "warps" (default since session 15; block_n / 4 <= 32, raw_keys, search_bits
    # 2): the tile's keys in 4 groups of block_n / 4 (one warp's MMA rows each on the GPU), each appending to its
    # own region of the row's buffer with an int32 mask: no cross-warp reduction or barrier per tile (sm_90a key
    # loop 495 -> 463 instrs, bench/topk.py --resources). Same index sets as "mask"; the order within a row is the
    # buffer's (deterministic, not ascending) and keys tied at the k-th score are ranked by key index. H200, 64K
    # causal, 9 interleaved rounds (session 14, bench/topk.py --ab-rounds 9): H 64 71.62 -> 71.08 ms, H 32 45.19 ->
    # 43.16. "mask" (block_n <= 64): each row's candidates become an int64 bit mask by a sum in the scores'
    # MMA-derived layout, slot = count + popc(mask below the key), no scan; rows come out in ascending key index.
    # "tile": a prefix sum over the tile's keys (any block_n). "mask" was 1.07-1.12x faster than "tile" at 64K (H200,
    # session 6). ("pair", one append per two tiles, was 1.29x slower: its 133 KB of K buffers allow only one
    # program per SM; removed.)
    append: str = "warps"
    # score-tile columns ordered so that each lane of the MMA accumulator holds whole rows: the head sum
    # stays in the thread and each (key, row) score lives in one thread, not four (which all ran the
    # selection and its stores). sm_90a key loop per 64-key tile at H 64 (bench/NOTES_hytopk.md, session 8):
    # 746 -> 574 instrs, floor 529 -> 500. Needs 4 | rows per tile and an even H (ignored otherwise). Same
    # index sets; the fp32 head sum runs in another order. H200, 64K causal, k 2048 (session 9, bench/topk.py
    # --parts sweep): H 64 88.8 -> 75.2 ms (x floor 1.44 -> 1.24); H 32 68.5 -> 50.5 (1.82 -> 1.45);
    # H 4 (k 512, S/4 keys) 9.99 -> 8.54.
    lane_rows: bool = True
    # candidate buffers hold the scores' raw fp32 bits: the key loop tests each score against the segment's
    # fp32 bound (_thr_score) and skips the int-key conversion per score; the select converts the buffered
    # ones. append="mask" / "warps" (ignored with "tile"). sm_90a key loop 569 -> 555 instrs per 64-key tile (H 64).
    # H200, 64K causal, one process each (session 11, bench/topk.py --parts sweep): H 64 74.30 -> 73.94 ms, H 32
    # 47.62 -> 46.36. Same indices in the GPU tests; compiled, the head sum may round differently (FMA
    # contraction): last-bit score differences on sums near 0. Default since session 12 (the HyTopK GPU suite
    # passed with it).
    raw_keys: bool = True
    # order of the fp32 head sum (LANE_ROWS launches): "chains" sums the even and the odd heads of each
    # (key, row) as two in-thread chains (ReLU, then one FFMA per head) and adds the two; "pairs" (until
    # session 12) summed head pairs first (FMUL + FFMA per pair), then the pair sums (one more FADD per pair).
    # Same in the floor and in HyTopK (the shared scoring code). Index sets may differ only on fp32 near-ties.
    head_sum: str = "chains"
    # search_bits=2: each select's radix passes start below the leading bits that the searching rows' smallest
    # and largest keys share (one min / max reduction first). A row's candidates all lie above its running
    # threshold, so they share the sign, the exponent and some mantissa bits: the passes those bits would take
    # are skipped (their outcome is known). Output bit-identical (tests/test_hytopk_prefix.py).
    select_prefix: bool = False
    # search_bits=2: how each select finds a row's k-th buffered key. "radix": 2-bit passes from the top, 3 counts
    # of the row's buffer per pass, stopping early (with select_prefix: from the shared leading bits). "interp": a
    # bracketed interpolation search, one count per pass (_kth_interp), bisecting when a step did not halve the
    # bracket. Same index sets; the thresholds a compaction leaves may differ (both are exact bounds at or below
    # the k-th key), so with append="warps" the order within a row may too. The final select was 2.0 ms of 68.2 at
    # 64K H64 and 2.4 of 42.6 at H32 (H100, session 15, bench/topk.py --parts ablate). default_config picks
    # "interp" from topk 1024 (H100, 64K causal: H 64 70.41 -> 69.51 ms, H 32 42.56 -> 41.77; topk 512 at H 4: 7.52
    # -> 8.16, so "radix" there).
    kth_search: str = "radix"
    # the warm start's sample (warm_start > 0): "spread" scores warm_start keys spread evenly over the row block's
    # key range before the key loop (16 extra tiles at 1024); "head" takes the block's first warm_start keys as
    # the sample: the key loop appends them from -inf, each row's threshold comes from them by the same rank rule
    # and the buffer is filtered to the keys above it (_head_threshold), so nothing is scored twice. Exact either way
    # (the fallback re-run); a contiguous sample moves the threshold where scores depend on position.
    warm_sample: str = "spread"
    # append="warps": how a key group's candidates in a row get their slots. "sum": an int32 bit mask summed over the
    # group's keys (3 dependent shuffle levels across the warp's lanes, then popc). "ballot": two warp ballots
    # (vote.sync) and popc, no shuffle; the tile loop carries the next free slots repeated per key. Same slots, so
    # the same selection; the two compiles may round the fp32 head sum differently (session 24, H 16 4 rows, bf16
    # head weights: scores differ by <= 2 ulp in most rows and one near-tie at a row's k-th key swapped; with fp32
    # weights, the GPU tests' other inputs, bit-identical; the sm_90a compiles start a head-sum chain with different
    # heads' products rounded, FMUL vs fused into the first FFMA: session 25, bench/aot_sass.py): both are the
    # reference's sets up to such near-ties (tests test_hytopk_ballot.py). Used where the launch allows it (append
    # "warps", block_n 64, 4 or 8 rows per tile, i.e. rows_x_heads / H_I = 4 or 8 (8: four ballots per warp),
    # num_warps 4, lane_rows; elsewhere ignored with an info log line, as lane_rows is) and where Triton laid the
    # candidate tile out as the lane arithmetic assumes: checked on the compiled kernel at its first launch (a clear
    # error otherwise; the interpreter runs the same arithmetic on a model of that layout).
    # default_config picks "ballot" for 4-row tiles (H 8..64) on the GPU: H200, 64K causal, 7 interleaved rounds
    # (session 16, bench/topk.py --ab-rounds 7): H 64 68.95 -> 68.16 ms (x floor 1.213 -> 1.199), H 32 42.51 -> 42.39;
    # if the layout check fails there, it logs a warning, re-runs the call with "sum" and stays on "sum".
    group_mask: str = "sum"
    # warm_sample="spread": how the threshold comes from the sample. "kth": the j-th largest sample key exactly
    # (j a binomial margin above the row's expected share, see _warm_threshold), by the select Config.kth_search
    # names (~10-14 counting passes over the 1024 keys at 64K). "window": any key whose sample count lies in
    # [j, j + warm_slack j] (so at or below the j-th: the same guarantee, up to warm_slack more candidates), found by
    # an interpolation search whose first probe is the sample's mean + z sd (z the normal quantile of the window's
    # middle rank); it stops at the first count inside the window. Exact either way (the fallback re-run).
    warm_search: str = "kth"
    warm_slack: float = 0.25  # warm_search="window": the window's width, a fraction of j
    # the warm start's safety margin: the sample rank j sits this many binomial standard deviations above the
    # row's expected count (fewer: fewer candidates and compactions, more rows re-run from -inf)
    warm_z: float = WARM_Z
    # warm_sample="spread": 0 = every row block samples warm_start keys. > 0: a row block whose rows see keys in
    # [lo, hi) samples about warm_mu * (hi - lo) / topk keys (whole tiles, at least 2, at most warm_start), i.e.
    # warm_mu of them expected above each row's k-th key: the sample costs every row block the same share of its key
    # loop (a fixed 1024 is 6% of a 16K row's, 1.6% of a 64K row's) and leaves every long row the same margin, so
    # about topk (1 + warm_z / sqrt(warm_mu)) candidates (1024 keys give 64K rows mu 32, 16K rows mu 128).
    warm_mu: float = 0.0
    # the selects (compactions, the final select; append="warps") on the row block's rows at once (1) or on its even
    # rows, then its odd rows (2): a select holds [rows, CAP] keys in registers, so 8-row tiles (rows_x_heads = 8 H)
    # at topk 2048 spill unless split. Same output.
    select_split: int = 1
    # the key loop's K tiles by TMA bulk copies through a tensor descriptor of k (block [block_n, D_I]; D_I a power of
    # two) instead of one cp.async per 16 bytes per thread: sm_90a key loop at H 32 286 -> 269 instructions per tile
    # (AOT, session 20). Opt-in until timed; the floor uses it too
    k_tma: bool = False


def check_config(cfg: Config, interpret: bool) -> None:
    """Refuse launch configs that are known to be wrong or meaningless, naming the field to change."""
    check(cfg.search_bits in (1, 2), f"hytopk: Config.search_bits must be 1 or 2, got {cfg.search_bits}")
    check(cfg.warm_start >= 0, f"hytopk: Config.warm_start must be >= 0 (0 = off), got {cfg.warm_start}")
    check(cfg.append in APPENDS, f"hytopk: Config.append must be one of {APPENDS}, got {cfg.append!r}")
    check(cfg.append != "mask" or cfg.block_n <= 64,
          f"hytopk: Config.append='mask' needs block_n <= 64 (one int64 bit mask per tile), got {cfg.block_n}; "
          "use append='tile' for larger key tiles")
    if cfg.append == "warps":
        check(cfg.block_n % KEY_GROUPS == 0 and cfg.block_n // KEY_GROUPS <= 32,
              f"hytopk: Config.append='warps' needs block_n a multiple of {KEY_GROUPS} and <= {32 * KEY_GROUPS} "
              f"(one int32 mask per key group), got {cfg.block_n}")
        check(cfg.search_bits == 2 and cfg.raw_keys,
              "hytopk: Config.append='warps' needs search_bits=2 and raw_keys=True, got "
              f"search_bits={cfg.search_bits}, raw_keys={cfg.raw_keys}; set append='mask' (or 'tile') to use them")
    check(not cfg.select_prefix or cfg.search_bits == 2,
          f"hytopk: Config.select_prefix needs search_bits=2 (the 2-bit select), got search_bits={cfg.search_bits}")
    check(cfg.kth_search in KTH_SEARCHES,
          f"hytopk: Config.kth_search must be one of {KTH_SEARCHES}, got {cfg.kth_search!r}")
    check(cfg.kth_search == "radix" or (cfg.search_bits == 2 and not cfg.select_prefix),
          f"hytopk: Config.kth_search={cfg.kth_search!r} needs search_bits=2 and select_prefix=False (the prefix is a "
          f"radix-pass shortcut), got search_bits={cfg.search_bits}, select_prefix={cfg.select_prefix}")
    check(cfg.warm_sample in WARM_SAMPLES,
          f"hytopk: Config.warm_sample must be one of {WARM_SAMPLES}, got {cfg.warm_sample!r}")
    check(cfg.warm_search in WARM_SEARCHES,
          f"hytopk: Config.warm_search must be one of {WARM_SEARCHES}, got {cfg.warm_search!r}")
    check(cfg.warm_search == "kth" or cfg.warm_sample == "spread",
          f"hytopk: Config.warm_search={cfg.warm_search!r} is built for warm_sample='spread', got "
          f"warm_sample={cfg.warm_sample!r}; use warm_search='kth' with the head sample")
    check(0.0 <= cfg.warm_slack <= 4.0,
          f"hytopk: Config.warm_slack must be in [0, 4] (the window's width as a fraction of the sample rank j), "
          f"got {cfg.warm_slack}")
    check(cfg.warm_mu >= 0.0, f"hytopk: Config.warm_mu must be >= 0 (0 = a fixed warm_start sample), got {cfg.warm_mu}")
    check(cfg.warm_mu == 0.0 or cfg.warm_sample == "spread",
          f"hytopk: Config.warm_mu={cfg.warm_mu} sizes the spread sample, got warm_sample={cfg.warm_sample!r}; "
          "set warm_mu=0 with the head sample")
    check(0.0 <= cfg.warm_z <= 8.0, f"hytopk: Config.warm_z must be in [0, 8] (standard deviations of margin), "
          f"got {cfg.warm_z}")
    regs = register_cap(cfg) if cfg.programs_per_sm >= 1 else 0
    check(regs is None or regs >= 64,
          f"hytopk: Config.programs_per_sm={cfg.programs_per_sm} with num_warps={cfg.num_warps} leaves {regs} "
          "registers per thread (at least 64 needed); lower programs_per_sm or num_warps")
    check(cfg.select_split in (1, 2), f"hytopk: Config.select_split must be 1 or 2, got {cfg.select_split}")
    check(cfg.select_split == 1 or cfg.append == "warps",
          f"hytopk: Config.select_split=2 needs append='warps', got append={cfg.append!r}; set select_split=1")
    check(cfg.group_mask in GROUP_MASKS,
          f"hytopk: Config.group_mask must be one of {GROUP_MASKS}, got {cfg.group_mask!r}")
    check(cfg.head_sum in HEAD_SUMS, f"hytopk: Config.head_sum must be one of {HEAD_SUMS}, got {cfg.head_sum!r}")


def _kth_mode(cfg: Config, select: bool) -> int:
    """The kernel's KTH constexpr: 0 radix passes from the top, 1 from the shared prefix, 2 interpolation."""
    if not select or cfg.search_bits != 2:
        return 0
    if cfg.kth_search == "interp":
        return 2
    return int(bool(cfg.select_prefix))


REGS_PER_SM = 65536  # sm_80 / sm_90 register file (32-bit registers)


def register_cap(cfg: Config) -> int | None:
    """ptxas' per-thread register limit (maxnreg) for cfg.programs_per_sm programs of cfg.num_warps warps on one SM, or
    None where the default limit (255) already lets them fit: the largest multiple of 8 that fits them."""
    threads = cfg.programs_per_sm * cfg.num_warps * 32
    if threads * 255 <= REGS_PER_SM:
        return None
    return (REGS_PER_SM // threads) // 8 * 8


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def default_config(H: int, topk: int, interpret: bool = False) -> Config:
    """The launch shape for H index heads: 4 query rows per MMA tile at H 64 (rows_x_heads 256), 8 at H 32 and 16
    (rows_x_heads 8 H, split selects, ballot slots); fewer heads keep a few rows per tile instead of 256 / H: the key
    loop's per-row selection state then fits in registers; Config.kth_search "interp" from topk 1024.

    H 32 with 8 rows: each 16 KB K tile feeds an N = 256 MMA instead of 128, halving K's L2 traffic per FLOP; H100,
    5 interleaved rounds (session 22, ``bench/topk_profile_session.sh``): 64K 37.09 -> 35.18 ms, 128K 147.78 ->
    132.14. (Session 7, before split selects, 8 rows spilled 86 LDL/STL per tile: 90.5 ms vs 68.3 with 4 rows.)
    H 16 with 8 rows (N = 128 MMAs instead of 64): H100, 64K, 5 interleaved rounds (session 23): 25.22 -> 21.85 ms
    with ballot slots (21.61 with mask-sum slots, within the rounds' spread); its output equals the 4-row launch's
    bit for bit (session 24: tests/test_hytopk_split.py::test_gpu_eight_row_tiles, bench/topk.py check spec 6).
    H 4 (k 512, S/4 keys) with rows_x_heads 32: 10.2 ms vs 32.4 with 256 (H200, session 7). H 8 keeps 4 rows, not
    timed at 8."""
    if interpret:
        return Config(block_n=16, rows_x_heads=2 * H, num_warps=1, num_stages=1, programs_per_sm=1,
                      min_free_tiles=1, sel_chunk=64)
    # the interpolation k-th search from topk 1024 (CAP >= 2048 slots: the radix's 3 counts per pass cost most);
    # H100, 64K causal, 7 interleaved rounds (session 15): H 64 70.41 -> 69.51 ms, H 32 42.56 -> 41.77; at topk 512
    # (H 4 over S/4 keys, CAP 1024) it was slower: 7.52 -> 8.16
    kth = "interp" if topk >= 1024 else "radix"
    if H >= 64:
        cfg = Config(kth_search=kth)
    elif H in (16, 32):  # 8 rows: a select over [8, CAP] keys spills unless split into even / odd rows
        cfg = Config(rows_x_heads=8 * H, select_split=2, kth_search=kth)
    else:
        cfg = Config(rows_x_heads=max(32, 4 * H), kth_search=kth)
    # ballot slots where the tile has 4 rows (H 8..64); the mask sum's slots (see Config.group_mask on rounding).
    # H200, 64K causal, 7 interleaved rounds (session 16): H 64 68.95 -> 68.16 ms, H 32 42.51 -> 42.39. Off for the
    # rest of the process if a compiled kernel's layout does not match the model (_ballot_guard)
    # 8-row tiles at H 32 and 16 too (session 22's H 32 timings above are ballot to ballot); H 4's 8-row tiles only
    # with an explicit group_mask="ballot" (layout-checked, not timed there)
    R = _rows(cfg, H)
    if _ballot_default and (R == 4 or H in (16, 32)) and ballot_applies(cfg, R, H):
        cfg = replace(cfg, group_mask="ballot")
    return cfg


def warm_stats() -> dict | None:
    """Counters of the last HyTopK launch that used ``Config.warm_start`` (None before any): rows
    started from a sampled threshold, rows re-run from -inf (fewer than topk keys above it) and
    row blocks that needed that second pass. Reading them synchronizes; meant for tests/benches."""
    if _warm_stats is None:
        return None
    a = _warm_stats.tolist()
    return dict(warm_rows=a[0], fallback_rows=a[1], fallback_blocks=a[2])


def warm_sample_positions(lo: int, hi: int, warm: int, topk: int = 0, warm_mu: float = 0.0,
                          block_n: int = 64) -> list[int]:
    """Key indices the kernel samples for a row block whose rows see keys within [lo, hi) (hi - lo
    > CAP >= warm): ``lo + i * ((hi - lo) // m)``, i < m; m = warm (``warm`` after rounding, see _geometry) or,
    where warm_mu > 0 (Config.warm_mu), warm_mu * (hi - lo) / topk rounded up to whole tiles of block_n keys, at
    least 2 tiles, at most warm."""
    m = warm
    if warm_mu > 0:
        m = min(max(-(-int(warm_mu * (hi - lo) / topk) // block_n), 2), warm // block_n) * block_n
    return [lo + i * ((hi - lo) // m) for i in range(m)]


def _geometry(H: int, D: int, topk: int, cfg: Config):
    """(R, CAP, CHUNK, MIN_FREE, D_P2): rows per program, slots per row, select chunk, free floor.

    CAP >= topk + 2 * min_free_tiles * block_n, so a compaction always leaves >= 2 tiles free; the
    kernel compacts below MIN_FREE free slots."""
    min_free = cfg.min_free_tiles * cfg.block_n
    cap = _pow2_ceil(max(cfg.cap_mult * topk, topk + 2 * min_free))
    R = _rows(cfg, H)
    chunk = max(1, min(cap, cfg.sel_chunk // R))
    return R, cap, chunk, min_free, _pow2_ceil(max(D, 16))


def _rows(cfg: Config, H: int) -> int:
    """Query rows per tile: rows_x_heads // H rounded down to a power of two (at least 1)."""
    R = max(1, cfg.rows_x_heads // H)
    return 1 << (R.bit_length() - 1)


def ballot_applies(cfg: Config, R: int, H: int) -> bool:
    """Whether Config.group_mask="ballot" is used by the launch (append "warps", block_n 64, num_warps 4, 4 or 8 rows
    per tile with lane_rows: the layouts its lane arithmetic models); otherwise the mask sum gives the same slots."""
    return (cfg.append == "warps" and cfg.block_n == 64 and cfg.num_warps == 4 and R in _kernel.BALLOT_LAYOUTS
            and lane_rows(cfg, R, H))


def lane_rows(cfg: Config, R: int, H: int) -> bool:
    """Whether the launch uses Config.lane_rows' column order (4 | R and H even)."""
    return bool(cfg.lane_rows) and R % 4 == 0 and H % 2 == 0


def kernel_constexprs(cfg: Config, H: int, D: int, topk: int, *, select: bool, relu: bool, write_scores: bool,
                      ieee: bool, interp: bool, lazy_max: bool = False, ablate: int = 0,
                      profile: bool = False) -> dict:
    """hytopk_kernel's constexpr arguments for a launch (also what AOT compiles for sm_90a pass).
    ``lazy_max``: the floor (select=False) keeps a per-element running max, reduced once after the key loop."""
    R, cap, chunk, min_free, d_p2 = _geometry(H, D, topk, cfg)
    warm, chunk_w = _warm_geometry(cap, chunk, cfg) if select else (0, 1)
    return dict(H=H, D=D, D_P2=d_p2, R=R, BLOCK_N=cfg.block_n, CAP=cap, CHUNK=chunk, MIN_FREE=min_free,
                RELU=bool(relu), SELECT=bool(select), WRITE_SCORES=bool(write_scores), IEEE=bool(ieee),
                WHILE_LOOPS=bool(interp), SEARCH2=cfg.search_bits == 2, WARM=warm, CHUNK_W=chunk_w,
                WARM_Z=float(cfg.warm_z), WARM_MIN=WARM_MIN, APPEND=APPENDS.index(cfg.append),
                LANE_ROWS=(1 + HEAD_SUMS.index(cfg.head_sum)) if lane_rows(cfg, R, H) else 0,
                LAZY_MAX=bool(lazy_max) and not select,
                RAW=bool(cfg.raw_keys) and bool(select) and cfg.append in ("mask", "warps"),
                KTH=_kth_mode(cfg, select), ABLATE=int(ablate),
                WARM_HEAD=bool(select) and warm > 0 and cfg.warm_sample == "head",
                BALLOT=bool(select) and cfg.group_mask == "ballot" and ballot_applies(cfg, R, H),
                PROFILE=bool(profile), WARM_WIN=bool(select) and warm > 0 and cfg.warm_search == "window",
                WARM_SLACK=float(cfg.warm_slack), WARM_MU=float(cfg.warm_mu) if warm > 0 else 0.0,
                SELECT_SPLIT=int(cfg.select_split) if select else 1, K_TMA=bool(cfg.k_tma))


def _warm_geometry(cap: int, chunk: int, cfg: Config):
    """(WARM, CHUNK_W): warm-start sample keys per row block (0 = off) and their select chunk."""
    if cfg.warm_start <= 0:
        return 0, 1
    warm = min(_pow2_ceil(cfg.warm_start), cap)
    return warm, min(chunk, warm)


def _launch(q, w, k, starts, ends, topk, relu, return_scores, select=True, config: Config | None = None,
            lazy_max: bool = False, ablate: int = 0, prof: torch.Tensor | None = None):
    """Run the Triton kernel. select=False runs the no-selection floor (returns the row max). ``prof``: int64
    [len(PROFILE_PHASES)] that the PROFILE kernel adds its phase counters to (hytopk_profile)."""
    T, H, D = q.shape
    S = k.shape[0]
    _check_key_offsets(S, D)  # the benchmark entry points (floor, ablation, profile) skip _validate
    interp = interpreter_active()
    cfg = config or default_config(H, topk, interp)
    check_config(cfg, interp)
    if 0 < S < cfg.block_n:  # the key loop loads whole tiles of k, unmasked (_tile_scores): pad k to one tile
        k = torch.cat([k, k.new_zeros(cfg.block_n - S, D)])
    meta = kernel_constexprs(cfg, H, D, topk, select=select, relu=relu, write_scores=select and return_scores,
                             ieee=q.dtype == torch.float32, interp=interp, lazy_max=lazy_max, ablate=ablate,
                             profile=prof is not None)
    R, cap, warm, chunk = meta["R"], meta["CAP"], meta["WARM"], meta["CHUNK"]
    if select and cfg.group_mask == "ballot" and not meta["BALLOT"] and cfg not in _ballot_ignored:
        _ballot_ignored.add(cfg)
        _log.info("hytopk: Config.group_mask='ballot' does not apply to this launch (it needs append='warps', "
                  "block_n=64, num_warps=4 and 4 or 8 query rows per tile with lane_rows; got append=%r, block_n=%d, "
                  "num_warps=%d, %d rows of H_I=%d): the mask sum gives the same slots", cfg.append, cfg.block_n,
                  cfg.num_warps, R, H)
    n_blocks = triton_cdiv(T, R)
    if interp or not q.is_cuda:
        n_prog = min(n_blocks, 3)
    else:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        n_prog = min(n_blocks, sms * cfg.programs_per_sm)
    n_prog = max(1, n_prog)
    dev = q.device
    if select:
        out_idx = torch.empty((T, topk), dtype=torch.int32, device=dev)
        out_val = (torch.empty((T, topk), dtype=torch.float32, device=dev) if return_scores
                   else torch.empty((1,), dtype=torch.float32, device=dev))
        # keys then indices, [n_prog, R, cap] each, and `chunk` spare slots: the select's rewrite loads the next chunk
        # ahead, past the last row of the index half on its last step (read, never used)
        n_buf = n_prog * R * cap
        flat = torch.empty(2 * n_buf + chunk, dtype=torch.int32, device=dev)
        scratch = (flat[:n_buf].view(n_prog, R, cap), flat[n_buf:2 * n_buf].view(n_prog, R, cap))
    else:
        out_idx = torch.empty((1,), dtype=torch.int32, device=dev)
        out_val = torch.empty((T,), dtype=torch.float32, device=dev)
        scratch = torch.empty((2, 1, 1, 1), dtype=torch.int32, device=dev)
    stats = torch.zeros(3, dtype=torch.int32, device=dev) if warm else out_idx
    if T == 0:
        return (out_idx, out_val) if (return_scores or not select) else out_idx
    regs = None if interp else register_cap(cfg)
    cap = {"maxnreg": regs} if regs else {}
    if cfg.k_tma:  # Config.k_tma: the key tiles through a tensor descriptor (rows past S read as zeros)
        check(D == meta["D_P2"], f"hytopk: Config.k_tma needs D_I a power of two (a TMA block of [block_n, D_I]), "
              f"got {D}; set k_tma=False")
        from triton.tools.tensor_descriptor import TensorDescriptor

        meta["k_desc"] = TensorDescriptor.from_tensor(k, [cfg.block_n, D])
    kern = _kernel.hytopk_kernel[(n_prog,)](
        q, w, k, starts, ends, out_idx, out_val, scratch[0], scratch[1], stats, stats if prof is None else prof,
        T, S, topk, n_blocks, n_prog, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cap,
    )
    if meta["BALLOT"] and not interp and not _ballot_guard(kern, explicit=config is not None):
        return _launch(q, w, k, starts, ends, topk, relu, return_scores, select=select,  # the default, re-run
                       config=replace(cfg, group_mask="sum"), lazy_max=lazy_max, ablate=ablate,
                       prof=None if prof is None else prof.zero_())
    if warm:
        global _warm_stats
        _warm_stats = stats
    if not select:
        return out_val
    return (out_idx, out_val) if return_scores else out_idx


_ballot_checked: set = set()
_ballot_ignored: set = set()  # configs whose group_mask="ballot" did not apply (logged once each)


def _ballot_guard(kern, explicit: bool) -> bool:
    """After a launch with group_mask="ballot": True if the compiled layout is the modelled one. Otherwise an
    explicit Config raises (_check_ballot_layout's message); the default logs a warning, turns the ballot off in
    default_config for the process and returns False, and the caller re-runs the launch with group_mask="sum"."""
    global _ballot_default
    try:
        _check_ballot_layout(kern)
        return True
    except RuntimeError as exc:
        if explicit:
            raise
        _log.warning("%s -- the default config falls back to group_mask='sum' from now on (re-running this call)", exc)
        _ballot_default = False
        return False


def _check_ballot_layout(kern) -> None:
    """Config.group_mask='ballot' computes slots from lane ids: valid only if Triton laid the candidate tile out as
    _kernel.BALLOT_LAYOUTS[R] says. Checked once per compiled kernel on its TTGIR (the layout of the ballot's inline-asm
    operand); a mismatch (another Triton version, another launch shape) raises instead of returning wrong slots."""
    ttgir = kern.asm["ttgir"]
    key = ttgir  # the text itself (its hash is cached): an id() could be reused by a later kernel object
    if key in _ballot_checked:
        return
    lines = [x for x in ttgir.splitlines() if "vote.sync.ballot" in x and "elementwise_inline_asm" in x]
    found, want = [], []
    for x in lines:
        for rows, a in set(re.findall(r"tensor<4x16x(\d+)xi32, (#[\w.]+)>", x)):
            m = re.search(r"^" + re.escape(a) + r" = #ttg\.linear<\{(.*?), block = \[\]\}>", ttgir, re.M)
            found.append(m.group(1) if m else a)
            want.append(_kernel.BALLOT_LAYOUTS.get(int(rows)))
    if not found or any(f != w for f, w in zip(found, want)):
        raise RuntimeError(
            "hytopk: Config.group_mask='ballot' assumes the candidate tile layout "
            f"{{{want[0] if want and want[0] else _kernel.BALLOT_LAYOUT}}} (Triton 3.6, sm_90); this compiled kernel "
            f"has {found or 'no ballot op'}. Use Config(group_mask='sum') (the same slots, computed by a mask sum)")
    _ballot_checked.add(key)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_key_offsets(S: int, D: int) -> None:
    """The key loop addresses k with int32 element offsets (key * D_I + d): S * D_I must stay below 2**31."""
    check(S * D < 2**31, f"k has S x D_I = {S} x {D} elements: must be < 2**31 (the key loop's int32 offsets; "
          f"S up to {(2**31 - 1) // D} keys at D_I = {D})")


def _validate(q, w, k, starts, ends, topk, impl, check_bounds):
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
    check(H >= 1 and H <= 128 and (H & (H - 1)) == 0, f"H_I (q.shape[1]) must be a power of two <= 128, got {H}")
    check(D % 16 == 0 and 16 <= D <= 256, f"D_I must be a multiple of 16 in [16, 256], got {D}")
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"topk must be an int, got {type(topk).__name__}")
    check(1 <= topk <= MAX_TOPK, f"topk must be in [1, {MAX_TOPK}], got {topk}")
    check(impl in _IMPLS, f"impl must be one of {_IMPLS}, got {impl!r}")
    for name, t in (("q", q), ("w", w), ("k", k), ("starts", starts), ("ends", ends)):
        check(t.is_contiguous(), f"{name} must be contiguous (call .contiguous() first)")
    # in-kernel offsets into q / out / k are int64; S, T and T * H_I (the w and starts/ends rows) are int32
    check(S < 2**31 - 1 and T * H < 2**31, f"T * H_I ({T} x {H}) and S ({S}) must be < 2**31 (int32 row offsets)")
    _check_key_offsets(S, D)
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

    Scores: ``I[t, s] = sum_h w[t, h] * act(q[t, h, :] . k[s, :])``, act = ReLU if ``relu`` else
    identity, accumulated in fp32. Row t keeps the ``topk`` best keys among
    ``starts[t] <= s < ends[t]`` under the canonical order (score descending, then key index
    ascending); rows with fewer visible keys are padded with -1. Deterministic.

    Args:
        q: [T, H_I, D_I] bf16 / fp16 / fp32, contiguous. H_I a power of two <= 128 (4..64 in
            practice), D_I a multiple of 16 <= 256 (128 in practice).
        w: [T, H_I] head weights, bf16 / fp16 / fp32 (used in fp32), contiguous.
        k: [S, D_I] index keys, same dtype as q, contiguous.
        starts, ends: int32 [T], 0 <= starts[t] <= ends[t] <= S: causal, packed/varlen and
            context-parallel query rows are all expressed this way. starts == ends masks a row.
        topk: 1..2048. topk > S or > a row's visible keys is fine (-1 padding).
        relu: ReLU (DeepSeek) or identity (GLM-5 style; scores may be negative).
        return_scores: also return the selected scores.
        impl: "auto" (CUDA tensors -> Triton; CPU tensors -> Triton interpreter when
            TRITON_INTERPRET=1 was set before the kernel was imported, else the PyTorch
            reference), "triton" or "reference".
        check_bounds: validate starts/ends against [0, S] (one small device sync).
        config: launch-shape override (benchmarks).

    Returns:
        indices int32 [T, topk]; with ``return_scores`` also scores fp32 [T, topk] (-inf where
        padded). Order within a row: the Triton path returns the selected keys in ascending key
        index (Config.append "warps": a deterministic buffer order), then the -1 padding; the
        reference path returns canonical order (score desc). Compare as sets.
    """
    _validate(q, w, k, starts, ends, topk, impl, check_bounds)
    use_triton = impl == "triton" or (impl == "auto" and (q.is_cuda or interpreter_active()))
    if use_triton:
        if not q.is_cuda and not interpreter_active():
            raise RuntimeError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                               "hyscale_kernels.hytopk (and triton) were imported")
        return _launch(q, w, k, starts, ends, topk, relu, return_scores, config=config)
    if impl == "auto":
        global _logged_reference
        if not _logged_reference:
            _logged_reference = True
            _log.info("hytopk: CPU tensors without TRITON_INTERPRET=1, using the PyTorch reference path")
    return hytopk_reference(q, w, k, starts, ends, topk, relu=relu, return_scores=return_scores)


def hytopk_floor(q, w, k, starts, ends, relu: bool = True, config: Config | None = None, topk: int = 2048,
                 lazy_max: bool = False):
    """Benchmark floor: the same scoring tile loop with no selection; returns each row's max score.

    ``topk`` only shapes the launch as HyTopK would run it (rows per program). ``lazy_max``: keep the running
    max per element of the [keys, rows] tile and reduce it once after the key loop, instead of a cross-warp
    max per tile (sm_90a key loop: no per-tile barrier for it; a stricter floor, session 10, untimed).
    """
    return _launch(q, w, k, starts, ends, topk, relu, False, select=False, config=config, lazy_max=lazy_max)


ABLATIONS = {1: "no final select", 2: "no candidates in the key loop", 3: "no candidates, no final select",
             6: "no candidates, one segment", 7: "no candidates, no final select, one segment"}


def hytopk_ablation(q, w, k, starts, ends, topk: int, ablate: int, relu: bool = True,
                    config: Config | None = None) -> torch.Tensor:
    """Benchmark-only timing breakdown of HyTopK (bench/topk.py --parts ablate): the kernel with a part removed,
    see ABLATIONS (1: the final select and its writes; 2: every key fails the candidate test, so no appends and no
    compactions, while the key loop's instructions all run; 3: both; 6 / 7: 2 / 3 with the key loop as one segment,
    no free-space bound: the segments' pipeline restarts). Returns the (unwritten or meaningless)
    indices: NOT a selection. Never call this for results."""
    check(ablate in ABLATIONS, f"hytopk_ablation: ablate must be one of {sorted(ABLATIONS)}, got {ablate}")
    return _launch(q, w, k, starts, ends, topk, relu, False, config=config, ablate=ablate)


# hytopk_profile's counters, in the kernel's P_* order: cycles (clock64, summed over programs) then counts
PROFILE_PHASES = ("total", "setup", "warm sample", "warm select", "key loop", "compactions", "re-runs", "final select",
                  "row blocks", "n compactions", "n segments", "final search")


def hytopk_profile(q, w, k, starts, ends, topk: int, relu: bool = True,
                   config: Config | None = None) -> tuple[torch.Tensor, dict]:
    """Benchmark instrument (bench/topk.py --parts profile): HyTopK with each persistent program reading the SM's
    clock64 at its phase boundaries. Returns (indices, counters): the indices are the normal selection; counters
    maps PROFILE_PHASES to ints: cycles summed over programs ("compactions" is part of "key loop" / "re-runs"),
    then the row blocks and compactions run. Cycles are 0 under the interpreter (the counts are real). The clock
    reads and their barriers slow the kernel a little: time the plain op, use this for the split."""
    prof = torch.zeros(len(PROFILE_PHASES), dtype=torch.int64, device=q.device)
    out = _launch(q, w, k, starts, ends, topk, relu, False, config=config, prof=prof)
    return out, dict(zip(PROFILE_PHASES, prof.tolist()))


__all__ = ["hytopk", "hytopk_floor", "Config", "default_config", "interpreter_active", "MAX_TOPK", "replace",
           "warm_stats"]
