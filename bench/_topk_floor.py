"""HyTopK's scoring floor for bench/topk.py: the same persistent row blocks and key tiles as hytopk_kernel (its
_row_block and _tile_scores), with a running max per row instead of any selection. HyTopK's time over this floor
is what the selection costs. Bench-only: the output (each row's max visible score) is no product result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import _path  # noqa: F401  (repo root on sys.path)
from hyscale_kernels.hytopk import op
from hyscale_kernels.hytopk._kernel import INTERPRETED, _row_block, _tile_scores


@triton.jit
def _floor_tile(i_n, blk, b_max, D: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr, LAZY: tl.constexpr):
    """Key tile i_n into the running max: per row [R] (a cross-warp max per tile) or LAZY per element [BLOCK_N, R]
    (no reduction in the loop; reduced once after it)."""
    _, sc, m_vis = _tile_scores(i_n, blk, D, BLOCK_N, RELU)  # [BLOCK_N, R]
    if LAZY:
        return tl.maximum(b_max, tl.where(m_vis, sc, float("-inf")))
    return tl.maximum(b_max, tl.max(tl.where(m_vis, sc, float("-inf")), axis=0))


@triton.jit
def floor_kernel(q_ptr, w_ptr, k_ptr, starts_ptr, ends_ptr, out_ptr, T, S, n_blocks, n_p, H: tl.constexpr,
                 D: tl.constexpr, D_P2: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr,
                 LAZY: tl.constexpr):
    """out [T] fp32: each row's max visible score, by HyTopK's row blocks and key tiles."""
    i_w = tl.program_id(0)
    while i_w < n_blocks:
        o_t, m_t, n_tiles, blk = _row_block(n_blocks - 1 - i_w, q_ptr, w_ptr, k_ptr, starts_ptr, ends_ptr, T, S, H,
                                            D, D_P2, R, BLOCK_N)
        if LAZY:
            b_max = tl.full([BLOCK_N, R], float("-inf"), dtype=tl.float32)
        else:
            b_max = tl.full([R], float("-inf"), dtype=tl.float32)
        if INTERPRETED:  # the interpreter cannot `range` over runtime bounds
            i_n = 0
            while i_n < n_tiles:
                b_max = _floor_tile(i_n, blk, b_max, D, BLOCK_N, RELU, LAZY)
                i_n += 1
        else:
            for i_n in range(0, n_tiles):
                b_max = _floor_tile(i_n, blk, b_max, D, BLOCK_N, RELU, LAZY)
        if LAZY:
            tl.store(out_ptr + o_t, tl.max(b_max, axis=0), mask=m_t)
        else:
            tl.store(out_ptr + o_t, b_max, mask=m_t)
        i_w += n_p


def floor_constexprs(hytopk_constexprs: dict, lazy: bool) -> dict:
    """floor_kernel's compile-time arguments for the launch whose hytopk_kernel constexprs are given."""
    keep = ("H", "D", "D_P2", "R", "BLOCK_N", "RELU")
    return dict({c: hytopk_constexprs[c] for c in keep}, LAZY=bool(lazy))


def hytopk_floor(q, w, k, starts, ends, topk: int, relu: bool = True, config: op.Config | None = None,
                 lazy_max: bool = True) -> torch.Tensor:
    """The floor of ``hytopk(q, w, k, starts, ends, topk, relu, config=config)``: the same launch shape (rows per
    tile, key tiles, grid) with no selection. Returns fp32 [T], each row's max visible score (-inf: none)."""
    T, H, D = q.shape
    cfg = config or op.default_config(H, topk, interpret=not q.is_cuda)
    const = floor_constexprs(op.kernel_constexprs(cfg, H, D, topk, relu, False), lazy_max)
    n_blocks = -(-T // const["R"])
    out = torch.empty(T, dtype=torch.float32, device=q.device)
    if T:
        floor_kernel[(op.n_programs(n_blocks, q.device),)](
            q, w, op.pad_keys(k, cfg.block_n), starts, ends, out, T, k.shape[0], n_blocks,
            op.n_programs(n_blocks, q.device), **const, num_warps=op.NUM_WARPS, num_stages=op.NUM_STAGES)
    return out
