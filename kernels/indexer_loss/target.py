"""Triton kernel: the sparse-stage indexer-loss target from the attention's own LSE.

target[t, j] = sum_h exp(scale * q[t, h] . kv[idx[t, j]] - lse[t, h])   (head-summed attention
probability of each selected key; 0 at -1 padding). One QK pass over the selected keys only: the
LSE saved by the sparse attention forward normalises the probabilities, so no second softmax
pass and no [T, S] table. The caller L1-normalises (after a TP all-reduce when heads are sharded).
Spec: ``reference.sparse_indexer_target`` (which also normalises).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import check, check_tensor
from .._split_mma import split_flag, split_mma_mark
from ..sparse_mla.tiles import LOG2E, block_h, dot, gather_kv, launch_meta, load_rows, mac


@triton.jit
def _target_kernel(q, kv, idx, lse, tgt, scale_log2, N, N_HB,
                   DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                   IEEE: tl.constexpr, EVEN: tl.constexpr, BIG: tl.constexpr, ATOMIC: tl.constexpr,
                   SPLIT_MMA: tl.constexpr):
    pid = split_mma_mark(tl.program_id(0), SPLIT_MMA)  # SPLIT_MMA: QK^T split over warpgroups (_split_mma.py)
    i_t = pid // N_HB  # query token
    i_h = pid % N_HB  # head block (fastest: the head blocks of a token share its gathers in L2)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_h = o_h < N
    row = i_t.to(tl.int64) * N + o_h  # [BLOCK_H]
    b_qv = load_rows(q, row, m_h, 0, DQK, V, BLOCK_V, EVEN)  # [BLOCK_H, BLOCK_V]
    b_qr = load_rows(q, row, m_h, V, DQK, R, BLOCK_R, EVEN)  # [BLOCK_H, BLOCK_R]
    b_lse = tl.load(lse + row, mask=m_h, other=0.0)  # [BLOCK_H]
    m_row = m_h & (b_lse != float("-inf"))  # heads of rows with no valid key contribute 0
    b_lse = tl.where(m_row, b_lse, 0.0) * 1.4426950408889634
    for k0 in range(0, K, BLOCK_K):
        # the attention forward's gather: padded slots load row 0 unmasked (cp.async-friendly), masked below
        b_kv, b_kr, b_row, m_k, o_k = gather_kv(kv, idx, i_t, k0, K, DQK, V, R, BLOCK_K, BLOCK_V, BLOCK_R,
                                                 EVEN, BIG)
        b_s = mac(b_qr, tl.trans(b_kr), dot(b_qv, tl.trans(b_kv), IEEE), IEEE)  # [BLOCK_H, BLOCK_K]
        b_p = tl.exp2(b_s * scale_log2 - b_lse[:, None])
        b_p = tl.where(m_row[:, None] & m_k[None, :], b_p, 0.0)  # [BLOCK_H, BLOCK_K]
        b_t = tl.sum(b_p, axis=0)  # [BLOCK_K] head sum
        p_t = tgt + i_t.to(tl.int64) * K + o_k
        if ATOMIC:  # several head blocks add into one row; two adds commute exactly
            tl.atomic_add(p_t, b_t, mask=o_k < K, sem="relaxed")
        else:
            tl.store(p_t, b_t, mask=o_k < K)


# The attention forward's tiles (the same gathers and QK^T, without the P V product); QK^T split over the
# two warpgroups (kernels/_split_mma.py).
TARGET_CFG = dict(block_k=64, num_warps=8, num_stages=2)


def sparse_attention_target(query: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor,
                            softmax_scale: float, v_dim: int = 512) -> torch.Tensor:
    """Head-summed attention probabilities at the selected keys (unnormalised), fp32 [T, topk].

    Args:
        query: [T, N, Dqk] (bf16/fp16/fp32), kv: [S, Dqk] same dtype, indices: [T, topk] int32/int64
        (-1 padded), lse: [T, N] fp32 natural-log LSE of the sparse attention over those keys.
    """
    check_tensor("query", query, 3, (torch.bfloat16, torch.float16, torch.float32))
    T, N, DQK = query.shape
    check_tensor("kv", kv, 2, (query.dtype,), device=query.device)
    check_tensor("indices", indices, 2, (torch.int32, torch.int64), device=query.device)
    check_tensor("lse", lse, 2, (torch.float32,), device=query.device)
    check(kv.shape[1] == DQK and indices.shape[0] == T and lse.shape == (T, N),
          f"shape mismatch: query {tuple(query.shape)}, kv {tuple(kv.shape)}, indices {tuple(indices.shape)}, "
          f"lse {tuple(lse.shape)}")
    check(0 < v_dim <= DQK, f"v_dim must be in (0, {DQK}], got {v_dim}")
    K = indices.shape[1]
    interp = not query.is_cuda
    bh = block_h(N)
    n_hb = triton.cdiv(N, bh)
    tgt = (torch.zeros if n_hb > 1 else torch.empty)((T, K), dtype=torch.float32, device=query.device)
    if T == 0 or K == 0:
        return tgt.zero_()
    cfg = TARGET_CFG
    _target_kernel[(T * n_hb,)](
        query.contiguous(), kv.contiguous(), indices.contiguous(), lse.contiguous(), tgt,
        float(softmax_scale) * LOG2E, N, n_hb, BLOCK_H=bh, BLOCK_K=16 if interp else cfg["block_k"],
        **launch_meta(query, kv, indices, v_dim), ATOMIC=n_hb > 1,
        SPLIT_MMA=split_flag(interp, bh, cfg["num_warps"]),
        num_warps=4 if interp else cfg["num_warps"], num_stages=1 if interp else cfg["num_stages"],
    )
    return tgt
