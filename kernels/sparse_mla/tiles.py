"""Tile helpers shared by the sparse MLA kernels and the indexer-loss target kernel.

Both walk the same data: one program owns one query token and a block of heads, and gathers that
token's selected latent-key rows tile by tile. A key row of width Dqk is split into its value part
[:V] and its rope tail [V:], so both tiles are powers of two (512 + 64 in production).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b; IEEE (fp32 inputs): exact fp32 products, matching the fp32 reference."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def mac(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b accumulated in place (one accumulator live, no layout conversion of it)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def load_rows(x, row, m_row, COL0: tl.constexpr, STRIDE: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr,
              EVEN: tl.constexpr):
    """x[row, COL0:COL0+W] for a block of rows as [BLOCK_ROWS, BLOCK_W]; zeros at masked rows / cols."""
    o_w = tl.arange(0, BLOCK_W)
    p = x + row.to(tl.int64)[:, None] * STRIDE + COL0 + o_w[None, :]
    if EVEN:
        return tl.load(p, mask=m_row[:, None], other=0.0)
    return tl.load(p, mask=m_row[:, None] & (o_w[None, :] < W), other=0.0)


@triton.jit
def load_idx(idx, i_t, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Slots [k0, k0+BLOCK_K) of token i_t's index row: [BLOCK_K] int32, -1 past K."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(idx + i_t.to(tl.int64) * K + o_k, mask=o_k < K, other=-1).to(tl.int32)


@triton.jit
def gather_rows(kv, b_idx, DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, BLOCK_V: tl.constexpr,
                BLOCK_R: tl.constexpr, EVEN: tl.constexpr, BIG: tl.constexpr):
    """Key rows b_idx [BLOCK_K] (-1: padding, loads row 0): value [BLOCK_K, BLOCK_V], rope [BLOCK_K, BLOCK_R],
    the clamped rows and validity. Loads are unmasked in rows (padding's logits are masked to -inf by the
    caller): fewer predicates, and the loads stay eligible for cp.async pipelining."""
    m_k = b_idx >= 0
    b_row = tl.where(m_k, b_idx, 0)
    if BIG:
        off = b_row.to(tl.int64) * DQK
    else:
        off = b_row * DQK
    o_v = tl.arange(0, BLOCK_V)
    o_r = tl.arange(0, BLOCK_R)
    p_row = kv + off[:, None]
    if EVEN:
        b_kv = tl.load(p_row + o_v[None, :])  # [BLOCK_K, BLOCK_V]
        b_kr = tl.load(p_row + V + o_r[None, :])  # [BLOCK_K, BLOCK_R]
    else:
        b_kv = tl.load(p_row + o_v[None, :], mask=(o_v[None, :] < V), other=0.0)
        b_kr = tl.load(p_row + V + o_r[None, :], mask=(o_r[None, :] < R), other=0.0)
    return b_kv, b_kr, b_row, m_k


@triton.jit
def gather_kv(kv, idx, i_t, k0, K: tl.constexpr, DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, EVEN: tl.constexpr,
              BIG: tl.constexpr):
    """Selected key rows [k0, k0+BLOCK_K) of token i_t: value [BLOCK_K, BLOCK_V] and rope [BLOCK_K, BLOCK_R]
    tiles, the (clamped, int32) rows, validity and slot offsets. Padded slots load row 0."""
    b_idx = load_idx(idx, i_t, k0, K, BLOCK_K)  # [BLOCK_K]
    b_kv, b_kr, b_row, m_k = gather_rows(kv, b_idx, DQK, V, R, BLOCK_V, BLOCK_R, EVEN, BIG)
    return b_kv, b_kr, b_row, m_k, k0 + tl.arange(0, BLOCK_K)


def block_h(N: int, cap: int = 64) -> int:
    """Heads per program: N rounded up to a power of two, between 16 (the MMA's smallest M) and ``cap``."""
    return min(cap, max(16, triton.next_power_of_2(N)))


def launch_meta(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, v_dim: int) -> dict:
    """The compile-time shape constants every kernel over (q [T, N, Dqk], kv [S, Dqk], idx [T, k]) takes."""
    DQK = q.shape[2]
    R = DQK - v_dim
    BV = max(16, triton.next_power_of_2(v_dim))
    BR = max(16, triton.next_power_of_2(max(R, 1)))
    return dict(DQK=DQK, V=v_dim, R=R, K=idx.shape[1], BLOCK_V=BV, BLOCK_R=BR,
                IEEE=q.dtype == torch.float32, EVEN=(BV == v_dim and BR == R),
                BIG=kv.shape[0] * DQK >= 2 ** 31)
