"""Triton forward and backward of absorbed-MLA sparse attention over top-k indices.

Spec: ``reference.sparse_mla_reference``; design: docs/sparse_mla.md. Heads are the MMA M dimension:
every head of a token attends to the same gathered key rows (the latent key is shared in absorbed
MLA), so one program owns one token and a block of (up to 64) heads and gathers each selected key row
once for all of them. Grids are 1-D with the head (or key) block varying fastest, so the programs of
one token run side by side and share its gathered rows through L2.

Forward: online softmax in base 2 (exp2 with the scale folded into log2e); writes out and the
natural-log LSE.

Backward, per chunk of tokens (P and dS of a chunk bounded by SCRATCH_BYTES, never O(T)):
  1. dq kernel, one program per (token, head block): delta = rowsum(O * dO) - dlse, then per key
     tile P = exp2(S - lse) from the saved LSE, dP = dO V^T, dS = P (dP - delta), dq += dS K; it
     also stores dS and P in q's dtype into the chunk's scratch [chunk, 2, N, k].
  2. dkv kernel, one program per (token, key block): keys are the M dimension; it contracts the
     stored dS / P over the token's heads, dkv = [dS^T | P^T] @ [q_v ; dO] (+ dS^T q_r), without
     recomputing S or dP, and adds each key row once (fp32 atomics, or with ``deterministic`` a
     bounded per-slot buffer reduced in sorted order). With a ``target`` buffer it also writes the
     indexer-loss target, sum_h P[t, h, j].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._split_mma import split_flag, split_mma_mark
from .scatter import deterministic_scatter_add_
from .tiles import LOG2E, block_h, dot, gather_kv, gather_rows, launch_meta, load_idx, load_rows, mac

# Launch configs at the production shape (Dqk 576, V 512, k 2048, bf16; bench/sparse_attn.py).
# Forward: 64 keys per tile; QK^T split over the two warpgroups (kernels/_split_mma.py).
FWD_CFG = dict(block_k=64, num_warps=8, num_stages=2)
# dq kernel: 32 keys per tile, S and dP split over the warpgroups; with one head block of at most
# FEW_HEADS rows (one 16-row M tile) 4 warps instead of 8.
BWD_DQ_CFG = dict(block_k=32, num_warps=8, num_stages=2)
FEW_HEADS, BWD_DQ_WARPS_FEW_HEADS = 16, 4
# dkv kernel: 64 keys = one wgmma M, 16 heads of the reduction per step. Where every head fits one
# head block, a program takes SCRATCH_GROUP key blocks and loads the token's q / dO rows once for them.
BWD_DKV_CFG = dict(block_h=16, block_k=64, num_warps=8, num_stages=3)
SCRATCH_GROUP = 8
# P and dS of a chunk of tokens, 2 x [chunk, N, k] in q's dtype: 256 tokens at N = 128, k = 2048 (bf16).
SCRATCH_BYTES = 256 << 20
# The deterministic dkv reduction's per-slot contribution buffer, fp32 elements.
DET_BUF_ELEMS = 1 << 27


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
@triton.jit
def _sparse_mla_fwd_kernel(
    q, kv, idx, out, lse, scale_log2, N, N_HB,
    DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr, EVEN: tl.constexpr, BIG: tl.constexpr, SPLIT_MMA: tl.constexpr,
    PREFETCH_IDX: tl.constexpr,
):
    """PREFETCH_IDX: each key tile's index slots are loaded one tile ahead (a loop-carried value), so the
    pipelined gather of the next tile does not first wait on a synchronous index load in the loop body."""
    pid = split_mma_mark(tl.program_id(0), SPLIT_MMA)  # SPLIT_MMA: QK^T split over warpgroups (_split_mma.py)
    i_t = pid // N_HB  # query token
    i_h = pid % N_HB  # head block (fastest: the blocks of one token share its gathers in L2)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < N
    row = i_t.to(tl.int64) * N + o_h  # [BLOCK_H]
    b_qv = load_rows(q, row, m_h, 0, DQK, V, BLOCK_V, EVEN)  # [BLOCK_H, BLOCK_V]
    b_qr = load_rows(q, row, m_h, V, DQK, R, BLOCK_R, EVEN)  # [BLOCK_H, BLOCK_R]
    # Finite start for the running max: fully padded tiles then give p = exp2(-inf) = 0, not NaN.
    b_m = tl.full([BLOCK_H], -1e30, dtype=tl.float32)  # [BLOCK_H] running max (log2 units)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)  # [BLOCK_H] running sum
    b_acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)  # [BLOCK_H, BLOCK_V]
    b_idx_next = load_idx(idx, i_t, 0, K, BLOCK_K)  # [BLOCK_K] (PREFETCH_IDX)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH_IDX:
            b_idx = b_idx_next
            b_idx_next = load_idx(idx, i_t, k0 + BLOCK_K, K, BLOCK_K)  # -1 past the row: no gather
            b_kv, b_kr, b_row, m_k = gather_rows(kv, b_idx, DQK, V, R, BLOCK_V, BLOCK_R, EVEN, BIG)
        else:
            b_kv, b_kr, b_row, m_k, o_k = gather_kv(kv, idx, i_t, k0, K, DQK, V, R, BLOCK_K, BLOCK_V, BLOCK_R,
                                                    EVEN, BIG)
        b_s = mac(b_qr, tl.trans(b_kr), dot(b_qv, tl.trans(b_kv), IEEE), IEEE)  # [BLOCK_H, BLOCK_K]
        b_s = tl.where(m_k[None, :], b_s * scale_log2, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp2(b_m - b_m_new)  # [BLOCK_H]
        b_p = tl.exp2(b_s - b_m_new[:, None])  # [BLOCK_H, BLOCK_K]
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = mac(b_p.to(b_kv.dtype), b_kv, b_acc * b_alpha[:, None], IEEE)
        b_m = b_m_new
    m_row = b_l > 0.0  # rows with at least one valid key
    b_out = b_acc / tl.where(m_row, b_l, 1.0)[:, None]
    b_lse = tl.where(m_row, (b_m + tl.log2(tl.where(m_row, b_l, 1.0))) * 0.6931471805599453, float("-inf"))
    o_v = tl.arange(0, BLOCK_V)
    tl.store(out + row[:, None] * V + o_v[None, :], b_out.to(out.dtype.element_ty),
             mask=m_h[:, None] & (o_v[None, :] < V))
    tl.store(lse + row, b_lse, mask=m_h)


# ---------------------------------------------------------------------------------------------
# backward: dq kernel (stores P and dS), dkv kernel (contracts them)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _sparse_mla_bwd_dq_kernel(
    q, kv, idx, o, do, lse, dlse, dq, pds, row0, dq_row0, scale, scale_log2, N, N_HB,
    DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr, EVEN: tl.constexpr, BIG: tl.constexpr, HAS_DLSE: tl.constexpr,
    SPLIT_MMA: tl.constexpr, PREFETCH_IDX: tl.constexpr,
):
    """dq of token row0 + pid // N_HB (heads of block pid % N_HB), and its dS / P into the chunk's scratch
    pds [chunk, 2, N, K]. dq rows are relative to dq_row0 (a chunk-sized dq buffer when dq goes over q).
    PREFETCH_IDX: as in the forward kernel."""
    pid = split_mma_mark(tl.program_id(0), SPLIT_MMA)  # SPLIT_MMA: S and dP split over warpgroups
    i_t = pid // N_HB + row0  # query token
    i_h = pid % N_HB
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < N
    row = i_t.to(tl.int64) * N + o_h  # [BLOCK_H]
    b_qv = load_rows(q, row, m_h, 0, DQK, V, BLOCK_V, EVEN)  # [BLOCK_H, BLOCK_V]
    b_qr = load_rows(q, row, m_h, V, DQK, R, BLOCK_R, EVEN)  # [BLOCK_H, BLOCK_R]
    b_do = load_rows(do, row, m_h, 0, V, V, BLOCK_V, EVEN)  # [BLOCK_H, BLOCK_V]
    b_o = load_rows(o, row, m_h, 0, V, V, BLOCK_V, EVEN)  # [BLOCK_H, BLOCK_V]
    b_lse = tl.load(lse + row, mask=m_h, other=0.0)  # [BLOCK_H]
    m_fin = b_lse != float("-inf")  # rows without a valid key: p = 0 (every slot is masked anyway)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), axis=1)  # [BLOCK_H] rowsum(dO * O)
    if HAS_DLSE:  # d lse / d logits = p: folds into the same (dP - delta) term
        b_delta -= tl.load(dlse + row, mask=m_h, other=0.0)
    b_delta = tl.where(m_fin, b_delta, 0.0)
    b_lse = tl.where(m_fin, b_lse, 0.0) * 1.4426950408889634  # log2 units
    b_dqv = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)  # [BLOCK_H, BLOCK_V]
    b_dqr = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)  # [BLOCK_H, BLOCK_R]
    row_s = (i_t - row0).to(tl.int64) * 2 * N + o_h  # [BLOCK_H] dS rows of the scratch (chunk token, head)
    b_idx_next = load_idx(idx, i_t, 0, K, BLOCK_K)  # [BLOCK_K] (PREFETCH_IDX)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH_IDX:
            b_idx = b_idx_next
            b_idx_next = load_idx(idx, i_t, k0 + BLOCK_K, K, BLOCK_K)  # -1 past the row: no gather
            b_kv, b_kr, b_row, m_k = gather_rows(kv, b_idx, DQK, V, R, BLOCK_V, BLOCK_R, EVEN, BIG)
            o_k = k0 + tl.arange(0, BLOCK_K)
        else:
            b_kv, b_kr, b_row, m_k, o_k = gather_kv(kv, idx, i_t, k0, K, DQK, V, R, BLOCK_K, BLOCK_V, BLOCK_R,
                                                    EVEN, BIG)
        b_s = mac(b_qr, tl.trans(b_kr), dot(b_qv, tl.trans(b_kv), IEEE), IEEE)  # [BLOCK_H, BLOCK_K]
        b_p = tl.exp2(b_s * scale_log2 - b_lse[:, None])
        b_p = tl.where(m_k[None, :], b_p, 0.0)  # [BLOCK_H, BLOCK_K]
        b_dp = dot(b_do, tl.trans(b_kv), IEEE)  # [BLOCK_H, BLOCK_K]
        b_ds = (b_p * (b_dp - b_delta[:, None]) * scale).to(b_kv.dtype)  # d(q.k)
        # dS and P in the operand dtype, as the dkv kernel's MMA reads them
        o_s = row_s[:, None] * K + o_k[None, :]  # [BLOCK_H, BLOCK_K] into pds [chunk, 2, N, K]
        m_s = m_h[:, None] & (o_k < K)[None, :]
        tl.store(pds + o_s, b_ds, mask=m_s)
        tl.store(pds + N * K + o_s, b_p.to(pds.dtype.element_ty), mask=m_s)
        b_dqv = mac(b_ds, b_kv, b_dqv, IEEE)
        b_dqr = mac(b_ds, b_kr, b_dqr, IEEE)
    o_v = tl.arange(0, BLOCK_V)
    o_r = tl.arange(0, BLOCK_R)
    row_dq = (i_t - dq_row0).to(tl.int64) * N + o_h  # [BLOCK_H]
    tl.store(dq + row_dq[:, None] * DQK + o_v[None, :], b_dqv.to(dq.dtype.element_ty),
             mask=m_h[:, None] & (o_v[None, :] < V))
    tl.store(dq + row_dq[:, None] * DQK + V + o_r[None, :], b_dqr.to(dq.dtype.element_ty),
             mask=m_h[:, None] & (o_r[None, :] < R))


@triton.jit
def _sparse_mla_bwd_dkv_kernel(
    q, idx, do, pds, dkv, tgt, row0, N, N_KB,
    DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, K: tl.constexpr, NHB: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr, EVEN: tl.constexpr, DETERMINISTIC: tl.constexpr, TGT: tl.constexpr,
    GROUP: tl.constexpr,
):
    """dkv without recompute: contracts the dS / P the dq kernel stored for a chunk of tokens.

    One program per (chunk token, GROUP consecutive key blocks); keys are the MMA M side, heads the reduction:
    dkv[key, :V] = sum_h dS[h, key] q[h, :V] + P[h, key] dO[h, :], dkv[key, V:] = sum_h dS[h, key] q[h, V:].
    No key-row gather: only the destination rows (idx) are read. TGT: also the loss target sum_h P[h, key].
    GROUP > 1 needs one head block (NHB == 1): the token's q / dO rows are loaded once for its GROUP blocks."""
    pid = tl.program_id(0)
    n_g = (N_KB + GROUP - 1) // GROUP  # key-block groups per token
    i_c = pid // n_g  # token within the chunk (its scratch row)
    i_t = i_c + row0  # query token
    i_g = pid % n_g  # key-block group (fastest: the groups of one token share its q / dO in L2)
    if GROUP == 1:
        _dkv_block(q, do, pds, dkv, tgt, idx, i_c, i_t, i_g, N, DQK, V, R, K, NHB,
                   BLOCK_H, BLOCK_K, BLOCK_V, BLOCK_R, IEEE, EVEN, DETERMINISTIC, TGT)
    else:
        tl.static_assert(NHB == 1, "a key-block group needs all heads in one block")
        b_qdo, b_qr, o_h, o_hj, m_h, m_hj = _dkv_head_rows(q, do, i_t, 0, N, DQK, V, R, BLOCK_H, BLOCK_V, BLOCK_R,
                                                            EVEN)
        for i_j in range(GROUP):
            i_kb = i_g * GROUP + i_j  # past N_KB: every slot is masked (o_k >= K)
            o_k, m_kk, b_idx, m_k = _dkv_block_slots(idx, i_t, i_kb, K, BLOCK_K)
            b_acc_v = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)  # [BLOCK_K, BLOCK_V]
            b_acc_r = tl.zeros([BLOCK_K, BLOCK_R], dtype=tl.float32)  # [BLOCK_K, BLOCK_R]
            b_acc_t = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)  # [BLOCK_H, BLOCK_K] (TGT)
            b_acc_v, b_acc_r, b_acc_t = _dkv_contract(b_qdo, b_qr, pds, i_c, o_h, o_hj, m_h, m_hj, o_k, m_kk, N, K,
                                                      b_acc_v, b_acc_r, b_acc_t, BLOCK_H, IEEE, TGT)
            _dkv_write(dkv, tgt, i_c, i_t, o_k, m_kk, b_idx, m_k, b_acc_v, b_acc_r, b_acc_t, DQK, V, R, K,
                       BLOCK_V, BLOCK_R, DETERMINISTIC, TGT)


@triton.jit
def _dkv_block_slots(idx, i_t, i_kb, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Key block i_kb of token i_t: slots [BLOCK_K], their mask, the index rows (-1 padding) and validity."""
    o_k = i_kb * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K] slots
    m_kk = o_k < K
    b_idx = tl.load(idx + i_t.to(tl.int64) * K + o_k, mask=m_kk, other=-1).to(tl.int32)  # [BLOCK_K]
    m_k = b_idx >= 0  # valid slot (padding: P = dS = 0 in the scratch, but its row must not be touched)
    return o_k, m_kk, b_idx, m_k


@triton.jit
def _dkv_head_rows(q, do, i_t, i_h, N, DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, EVEN: tl.constexpr):
    """Head block i_h of token i_t: [q_v ; dO] rows [2 * BLOCK_H, BLOCK_V] (dS's operand first, then P's),
    q's rope rows [BLOCK_H, BLOCK_R], and the heads / masks of both."""
    o_j = tl.arange(0, 2 * BLOCK_H)  # [2 * BLOCK_H] reduction rows: dS (with q) first, then P (with dO)
    m_j = o_j < BLOCK_H
    o_v = tl.arange(0, BLOCK_V)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_h = o_h < N
    o_hj = i_h * BLOCK_H + o_j % BLOCK_H  # [2 * BLOCK_H] head of each reduction row
    m_hj = o_hj < N
    row_j = i_t.to(tl.int64) * N + o_hj  # [2 * BLOCK_H]
    p_j = tl.where(m_j, q + row_j * DQK, do + row_j * V)  # [2 * BLOCK_H] q rows, then dO rows
    if EVEN:
        b_qdo = tl.load(p_j[:, None] + o_v[None, :], mask=m_hj[:, None], other=0.0)  # [2 * BLOCK_H, BLOCK_V]
    else:
        b_qdo = tl.load(p_j[:, None] + o_v[None, :], mask=m_hj[:, None] & (o_v[None, :] < V), other=0.0)
    b_qr = load_rows(q, i_t.to(tl.int64) * N + o_h, m_h, V, DQK, R, BLOCK_R, EVEN)  # [BLOCK_H, BLOCK_R]
    return b_qdo, b_qr, o_h, o_hj, m_h, m_hj


@triton.jit
def _dkv_contract(b_qdo, b_qr, pds, i_c, o_h, o_hj, m_h, m_hj, o_k, m_kk, N, K: tl.constexpr, b_acc_v, b_acc_r,
                  b_acc_t, BLOCK_H: tl.constexpr, IEEE: tl.constexpr, TGT: tl.constexpr):
    """One head block's share of a key block: the stored dS / P against [q_v ; dO] and q's rope rows, added
    to the accumulators; TGT: P added to the target's [BLOCK_H, BLOCK_K] fp32 tile.

    The value part is ONE dot over the concatenated reduction [dS^T | P^T] @ [q_v ; dO]: two dots chained on
    one accumulator would make Triton give the first warpsPerCTA [num_warps, 1] and convert the [BLOCK_K, V]
    fp32 accumulator between layouts every step."""
    o_j = tl.arange(0, 2 * BLOCK_H)
    # pds is [chunk, 2, N, K]: plane 0 = dS, plane 1 = P
    o_sj = ((i_c * 2 + (o_j >= BLOCK_H)).to(tl.int64) * N + o_hj)[:, None] * K + o_k[None, :]
    b_dsp = tl.load(pds + o_sj, mask=m_hj[:, None] & m_kk[None, :], other=0.0)  # [2 * BLOCK_H, BLOCK_K]
    o_s = (i_c.to(tl.int64) * 2 * N + o_h)[:, None] * K + o_k[None, :]
    b_ds = tl.load(pds + o_s, mask=m_h[:, None] & m_kk[None, :], other=0.0)  # [BLOCK_H, BLOCK_K] (L1 / L2 hit)
    b_acc_v = mac(tl.trans(b_dsp), b_qdo, b_acc_v, IEEE)
    b_acc_r = mac(tl.trans(b_ds), b_qr, b_acc_r, IEEE)
    if TGT:  # P tiles added elementwise in fp32; the head sum is taken once per key block in _dkv_write
        b_acc_t += tl.load(pds + o_s + N * K, mask=m_h[:, None] & m_kk[None, :], other=0.0).to(tl.float32)
    return b_acc_v, b_acc_r, b_acc_t


@triton.jit
def _dkv_write(dkv, tgt, i_c, i_t, o_k, m_kk, b_idx, m_k, b_acc_v, b_acc_r, b_acc_t, DQK: tl.constexpr,
               V: tl.constexpr, R: tl.constexpr, K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
               DETERMINISTIC: tl.constexpr, TGT: tl.constexpr):
    """A key block's result: the adds into dkv rows b_idx where m_k (or the deterministic contribution rows)
    and the loss target."""
    o_v = tl.arange(0, BLOCK_V)
    o_r = tl.arange(0, BLOCK_R)
    if TGT:  # one program per (token, key block): a plain store, deterministic
        tl.store(tgt + i_t.to(tl.int64) * K + o_k, tl.sum(b_acc_t, axis=0), mask=m_kk)
    if DETERMINISTIC:  # contribution rows ordered (chunk token, slot), reduced later in sorted order
        e = i_c.to(tl.int64) * K + o_k  # [BLOCK_K]
        m_e = m_kk[:, None]
        tl.store(dkv + e[:, None] * DQK + o_v[None, :], b_acc_v, mask=m_e & (o_v[None, :] < V))
        tl.store(dkv + e[:, None] * DQK + V + o_r[None, :], b_acc_r, mask=m_e & (o_r[None, :] < R))
    else:
        p_row = dkv + tl.where(m_k, b_idx, 0).to(tl.int64)[:, None] * DQK
        tl.atomic_add(p_row + o_v[None, :], b_acc_v, mask=m_k[:, None] & (o_v[None, :] < V), sem="relaxed")
        tl.atomic_add(p_row + V + o_r[None, :], b_acc_r, mask=m_k[:, None] & (o_r[None, :] < R), sem="relaxed")


@triton.jit
def _dkv_block(q, do, pds, dkv, tgt, idx, i_c, i_t, i_kb, N, DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr,
               K: tl.constexpr, NHB: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr, EVEN: tl.constexpr,
               DETERMINISTIC: tl.constexpr, TGT: tl.constexpr):
    """The dkv kernel's work for one (token, key block): contraction over all heads, then the adds into dkv
    rows (or the deterministic contribution rows), and the loss target."""
    o_k, m_kk, b_idx, m_k = _dkv_block_slots(idx, i_t, i_kb, K, BLOCK_K)
    b_acc_v = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)  # [BLOCK_K, BLOCK_V]
    b_acc_r = tl.zeros([BLOCK_K, BLOCK_R], dtype=tl.float32)  # [BLOCK_K, BLOCK_R]
    b_acc_t = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)  # [BLOCK_H, BLOCK_K] (TGT)
    for i_h in range(NHB):  # all heads of the token
        b_qdo, b_qr, o_h, o_hj, m_h, m_hj = _dkv_head_rows(q, do, i_t, i_h, N, DQK, V, R, BLOCK_H, BLOCK_V,
                                                            BLOCK_R, EVEN)
        b_acc_v, b_acc_r, b_acc_t = _dkv_contract(b_qdo, b_qr, pds, i_c, o_h, o_hj, m_h, m_hj, o_k, m_kk, N, K,
                                                  b_acc_v, b_acc_r, b_acc_t, BLOCK_H, IEEE, TGT)
    _dkv_write(dkv, tgt, i_c, i_t, o_k, m_kk, b_idx, m_k, b_acc_v, b_acc_r, b_acc_t, DQK, V, R, K, BLOCK_V, BLOCK_R,
               DETERMINISTIC, TGT)


# ---------------------------------------------------------------------------------------------
# launchers (inputs already validated and contiguous)
# ---------------------------------------------------------------------------------------------
def _alloc(*shape, dtype, device):
    """Output allocation (tests swap in a NaN fill so unwritten elements show up)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def _interp(t: torch.Tensor) -> bool:
    """CPU tensors run under the Triton interpreter: small key tiles (it runs Python per tile)."""
    return not t.is_cuda


def sparse_mla_fwd(q, kv, idx, softmax_scale: float, v_dim: int):
    """-> out [T, N, v_dim] in q's dtype, lse fp32 [T, N]."""
    T, N, _ = q.shape
    out = _alloc(T, N, v_dim, dtype=q.dtype, device=q.device)
    lse = _alloc(T, N, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    bh = block_h(N)
    n_hb = triton.cdiv(N, bh)
    interp = _interp(q)
    nw = FWD_CFG["num_warps"]
    _sparse_mla_fwd_kernel[(T * n_hb,)](
        q, kv, idx, out, lse, softmax_scale * LOG2E, N, n_hb, BLOCK_H=bh,
        BLOCK_K=16 if interp else FWD_CFG["block_k"], **launch_meta(q, kv, idx, v_dim),
        SPLIT_MMA=split_flag(interp, bh, nw),
        PREFETCH_IDX=bh > FEW_HEADS,  # with one 16-row block the prefetch is slower
        num_warps=nw, num_stages=FWD_CFG["num_stages"])
    return out, lse


def scratch_chunk_tokens(T: int, N: int, K: int, elem_bytes: int) -> int:
    """Tokens per backward chunk: P + dS = 2 * chunk * N * K elements <= SCRATCH_BYTES."""
    return max(1, min(T, SCRATCH_BYTES // max(1, 2 * N * K * elem_bytes)))


def sparse_mla_bwd(q, kv, idx, out, lse, dout, dlse, softmax_scale: float, v_dim: int, deterministic: bool = False,
                   dq_over_q: bool = False, target=None):
    """Gradients (dq [T, N, Dqk] in q's dtype, dkv fp32 [S, Dqk]) from the saved out / lse.

    ``dq_over_q``: the caller no longer needs q: dq is written into q's storage, one [T, N, Dqk] buffer
    less. Each chunk's dq goes to a chunk-sized buffer and is copied over q's chunk rows once that
    chunk's dkv kernel (the last reader of those q rows) has run.
    ``target`` (contiguous fp32 [T, k], optional): receives the sparse-stage indexer-loss target, sum over
    heads of P[t, h, j] at each selected slot (0 at padding), unnormalised, from the P the backward
    stores anyway (bf16-rounded P in bf16 runs, summed in fp32); every element written, deterministic.
    """
    T, N, DQK = q.shape
    K = idx.shape[1]
    _check_target(target, T, K, q.device)
    if dq_over_q and not q.is_contiguous():
        raise ValueError(f"sparse_mla_bwd: dq_over_q needs a contiguous q, got stride {q.stride()}")
    dout = dout.to(q.dtype).contiguous()  # the kernels' dots need one operand dtype
    dq = q if dq_over_q else _alloc(*q.shape, dtype=q.dtype, device=q.device)
    dkv = torch.zeros(kv.shape[0], DQK, dtype=torch.float32, device=q.device)
    if T == 0:
        return dq, dkv
    meta = launch_meta(q, kv, idx, v_dim)
    interp = _interp(q)
    rows = scratch_chunk_tokens(T, N, K, q.element_size())
    if deterministic:  # one contribution buffer per chunk, within DET_BUF_ELEMS
        rows = min(rows, max(1, DET_BUF_ELEMS // max(1, K * DQK)))
        buf = torch.empty(rows * K, DQK, dtype=torch.float32, device=q.device)
    # _alloc: tests fill the scratch with NaN, so a dS / P element the dq kernel misses fails them
    pds = _alloc(rows, 2, N, K, dtype=q.dtype, device=q.device)  # [chunk, 2 (dS, P), N, K]
    dq_chunk = _alloc(rows, N, DQK, dtype=q.dtype, device=q.device) if dq_over_q else None
    dq_launch, n_hb = _dq_launch(N, interp, dlse is not None, meta)
    dkv_launch, n_kb, group = _dkv_launch(N, K, interp, deterministic, target is not None, meta)
    dlse = dlse.float().contiguous() if dlse is not None else lse  # placeholder pointer when absent
    scales = (softmax_scale, softmax_scale * LOG2E)
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        _sparse_mla_bwd_dq_kernel[((r1 - r0) * n_hb,)](
            q, kv, idx, out, dout, lse, dlse, dq_chunk if dq_over_q else dq, pds, r0, r0 if dq_over_q else 0,
            *scales, N, n_hb, **dq_launch)
        _sparse_mla_bwd_dkv_kernel[((r1 - r0) * triton.cdiv(n_kb, group),)](
            q, idx, dout, pds, buf if deterministic else dkv, target if target is not None else lse, r0, N, n_kb,
            **dkv_launch)
        if deterministic:
            deterministic_scatter_add_(dkv, idx[r0:r1].reshape(-1), buf[: (r1 - r0) * K])
        if dq_over_q:  # stream order: after the dkv kernel that read q[r0:r1]
            q[r0:r1].copy_(dq_chunk[: r1 - r0])
    return dq, dkv


def _dq_launch(N: int, interp: bool, has_dlse: bool, meta: dict):
    """The dq kernel's launch arguments and head blocks per token."""
    bh = block_h(N)
    few = bh <= FEW_HEADS
    nw = BWD_DQ_WARPS_FEW_HEADS if few else BWD_DQ_CFG["num_warps"]
    launch = dict(BLOCK_H=bh, BLOCK_K=16 if interp else BWD_DQ_CFG["block_k"], HAS_DLSE=has_dlse, **meta,
                  SPLIT_MMA=split_flag(interp, bh, nw),
                  PREFETCH_IDX=few,  # with 64-head tiles the prefetch is slower
                  num_warps=nw, num_stages=BWD_DQ_CFG["num_stages"])
    return launch, triton.cdiv(N, bh)


def _dkv_launch(N: int, K: int, interp: bool, deterministic: bool, has_target: bool, meta: dict):
    """The dkv kernel's launch arguments, key blocks per token and key blocks per program."""
    cfg = BWD_DKV_CFG
    bh = min(block_h(N), cfg["block_h"])
    bk = 16 if interp else cfg["block_k"]
    group = SCRATCH_GROUP if N <= bh else 1
    launch = dict(BLOCK_H=bh, BLOCK_K=bk, NHB=triton.cdiv(N, bh), DETERMINISTIC=deterministic, TGT=has_target,
                  GROUP=group, **{k: meta[k] for k in ("DQK", "V", "R", "K", "BLOCK_V", "BLOCK_R", "IEEE", "EVEN")},
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return launch, triton.cdiv(K, bk), group


def _check_target(target, T: int, K: int, device) -> None:
    """ValueError naming the problem with a ``target`` buffer (None: no target)."""
    if target is None:
        return
    if not (isinstance(target, torch.Tensor) and target.dtype == torch.float32 and tuple(target.shape) == (T, K)
            and target.device == device and target.is_contiguous()):
        raise ValueError(f"sparse_mla_bwd: target must be a contiguous fp32 [{T}, {K}] tensor on {device}, got "
                         f"{getattr(target, 'dtype', type(target))} {tuple(getattr(target, 'shape', ()))}")


def flops(T: int, N: int, topk: int, dqk: int = 576, v_dim: int = 512) -> tuple[float, float]:
    """(forward, backward) FLOPs counted on the selected keys (2 per multiply-add).

    Backward counts the minimal work S, dP, dq, dkv (qk + pv) = 2752 / 1088 = 2.53x the forward."""
    fwd = 2.0 * T * N * topk * (dqk + v_dim)
    bwd = 2.0 * T * N * topk * (dqk + v_dim + dqk + dqk + v_dim)  # S, dP, dq, dkv (qk + pv)
    return fwd, bwd
