"""Triton forward and backward of absorbed-MLA sparse attention over top-k indices.

Spec: ``reference.sparse_mla_reference``. Heads are the MMA M dimension: every head of a token
attends to the same gathered key rows (the latent key is shared in absorbed MLA), so one program
owns one token and a block of (up to 64) heads and gathers each selected key row once for all of
them. The key row is split into the value part [:V] and the rope tail [V:] so both tiles are
powers of two (512 + 64 in production).

Grids are 1-D with the head (or key) block varying fastest, so the programs of one token run
side by side and share its gathered rows through L2. Gathers clamp padding (-1) to row 0 and
load without masks (the logits of padded slots are masked to -inf instead): fewer predicates and
registers, and the loads stay eligible for cp.async pipelining.

Forward: online softmax in base 2 (exp2 with the scale folded into log2e); writes out and the
natural-log LSE.

Backward, "split" (``split=True``): two kernels, both with large MMA tiles and no cross-head atomics.
  1. dq kernel, one program per (token, head block): delta = rowsum(O * dO) - dlse computed in
     the prologue (and stored for kernel 2), then per key tile P = exp2(S - lse) from the saved
     LSE, dP = dO V^T, dS = P (dP - delta), dq += dS K. No atomics.
  2. dkv kernel, one program per (token, key block): keys are the M dimension; it loops over
     all heads of the token, accumulating dkv = dS^T Q + P^T dO for its key block in registers,
     then adds it once into the fp32 [S, Dqk] table (relaxed fp32 atomics), or, with
     ``deterministic=True``, writes it to a bounded per-slot buffer reduced in sorted order.
  The split recomputes S and dP once more (3840 instead of 2752 MACs per head-key) but keeps
  one dkv row update per (token, key) whatever the head count.
``variant="scratch"`` (the default) removes the split's recompute: per chunk of tokens the dq kernel
also stores dS and P (bf16, [chunk, 2, N, k], bounded by SCRATCH_BYTES), and a dkv kernel with keys
on M contracts them over heads, dkv = [dS^T | P^T] @ [q_v ; dO] (+ dS^T q_r): 2752 MACs per head-key
instead of 3840, for 8 B of scratch traffic per head-key. H200, T = 16K, k = 2048
(bench/results/sparse_bwd_parts.csv, session 6): N = 128 164 ms vs split 278 / fused 348; N = 64 95
vs 152 / 174; N = 16 41 vs 109 / 65.
``variant="fused"``: one program per token and block of 32 heads, dkv atomics per head block
(mma.sync: M = 32 < 64). ``variant="split"``: the two kernels above.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._split_mma import split_flag, split_mma_mark
from .scatter import deterministic_scatter_add_

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 inputs: exact fp32 products, matching the fp32 reference
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _mac(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b accumulated in place (one accumulator live, no layout conversion of it)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _load_rows(x, row, m_row, COL0: tl.constexpr, STRIDE: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr,
               EVEN: tl.constexpr):
    """x[row, COL0:COL0+W] for a block of rows as [BLOCK_ROWS, BLOCK_W]; zeros at masked rows / cols."""
    o_w = tl.arange(0, BLOCK_W)
    p = x + row.to(tl.int64)[:, None] * STRIDE + COL0 + o_w[None, :]
    if EVEN:
        return tl.load(p, mask=m_row[:, None], other=0.0)
    return tl.load(p, mask=m_row[:, None] & (o_w[None, :] < W), other=0.0)


@triton.jit
def _store_b16_pairs(p, v, m, ASM: tl.constexpr):
    """Masked store of a 16-bit tensor (bf16 / fp16). ASM: inline PTX in the value's own (MMA-derived)
    layout, two elements per call: one 32-bit store when they are adjacent, 4-byte aligned and both
    unmasked, else one 16-bit store each. A tl.store is first converted to a coalesced layout through
    shared memory and barriers (HyTopK's candidate stores lost 8 barriers per tile to this)."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred m1, m2, w, n1, n2; .reg .b64 d, a; .reg .b16 lo, hi;\n"
            "setp.ne.b32 m1, $5, 0; setp.ne.b32 m2, $6, 0;\n"
            "sub.s64 d, $3, $2; and.b64 a, $2, 3;\n"
            "setp.eq.s64 w, d, 2; @w setp.eq.and.b64 w, a, 0, w; and.pred w, w, m1; and.pred w, w, m2;\n"
            "@w st.global.b32 [$2], $4;\n"
            "mov.b32 {lo, hi}, $4; not.pred n1, w; and.pred n2, n1, m2; and.pred n1, n1, m1;\n"
            "@n1 st.global.b16 [$2], lo; @n2 st.global.b16 [$3], hi;\n"
            "mov.b32 $0, 0; mov.b32 $1, 0; }",
            "=r,=r,l,l,r,r,r", [p.to(tl.int64), v, m.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=2)
    else:
        tl.store(p, v, mask=m)


@triton.jit
def _load_idx(idx, i_t, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Slots [k0, k0+BLOCK_K) of token i_t's index row: [BLOCK_K] int32, -1 past K."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(idx + i_t.to(tl.int64) * K + o_k, mask=o_k < K, other=-1).to(tl.int32)


@triton.jit
def _gather_kv(kv, idx, i_t, k0, K: tl.constexpr, DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, EVEN: tl.constexpr,
               BIG: tl.constexpr):
    """Selected key rows [k0, k0+BLOCK_K) of token i_t: value [BLOCK_K, BLOCK_V] and rope [BLOCK_K, BLOCK_R]
    tiles, the (clamped, int32) rows, validity and slot offsets. Padded slots load row 0."""
    b_idx = _load_idx(idx, i_t, k0, K, BLOCK_K)  # [BLOCK_K]
    b_kv, b_kr, b_row, m_k = _gather_rows(kv, b_idx, DQK, V, R, BLOCK_V, BLOCK_R, EVEN, BIG)
    return b_kv, b_kr, b_row, m_k, k0 + tl.arange(0, BLOCK_K)


@triton.jit
def _gather_rows(kv, b_idx, DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_R: tl.constexpr, EVEN: tl.constexpr, BIG: tl.constexpr):
    """Key rows b_idx [BLOCK_K] (-1: padding, loads row 0): value [BLOCK_K, BLOCK_V], rope [BLOCK_K, BLOCK_R],
    the clamped rows and validity."""
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


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
@triton.jit
def _sparse_mla_fwd_kernel(
    q, kv, idx, out, lse, scale_log2, N, N_HB,
    DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr, EVEN: tl.constexpr, BIG: tl.constexpr, SPLIT_MMA: tl.constexpr = 0,
    PREFETCH_IDX: tl.constexpr = False,
):
    """PREFETCH_IDX: each key tile's index slots are loaded one tile ahead (a loop-carried value), so the
    pipelined gather of the next tile does not first wait on a synchronous index load in the loop body."""
    pid = split_mma_mark(tl.program_id(0), SPLIT_MMA)  # SPLIT_MMA: QK^T split over warpgroups (_split_mma.py)
    i_t = pid // N_HB  # query token
    i_h = pid % N_HB  # head block (fastest: the blocks of one token share its gathers in L2)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < N
    row = i_t.to(tl.int64) * N + o_h  # [BLOCK_H]
    b_qv = _load_rows(q, row, m_h, 0, DQK, V, BLOCK_V, EVEN)  # [BLOCK_H, BLOCK_V]
    b_qr = _load_rows(q, row, m_h, V, DQK, R, BLOCK_R, EVEN)  # [BLOCK_H, BLOCK_R]
    # Finite start for the running max: fully padded tiles then give p = exp2(-inf) = 0, not NaN.
    b_m = tl.full([BLOCK_H], -1e30, dtype=tl.float32)  # [BLOCK_H] running max (log2 units)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)  # [BLOCK_H] running sum
    b_acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)  # [BLOCK_H, BLOCK_V]
    b_idx_next = _load_idx(idx, i_t, 0, K, BLOCK_K)  # [BLOCK_K] (PREFETCH_IDX)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH_IDX:
            b_idx = b_idx_next
            b_idx_next = _load_idx(idx, i_t, k0 + BLOCK_K, K, BLOCK_K)  # -1 past the row: no gather
            b_kv, b_kr, b_row, m_k = _gather_rows(kv, b_idx, DQK, V, R, BLOCK_V, BLOCK_R, EVEN, BIG)
        else:
            b_kv, b_kr, b_row, m_k, o_k = _gather_kv(kv, idx, i_t, k0, K, DQK, V, R, BLOCK_K, BLOCK_V, BLOCK_R,
                                                     EVEN, BIG)
        b_s = _mac(b_qr, tl.trans(b_kr), _dot(b_qv, tl.trans(b_kv), IEEE), IEEE)  # [BLOCK_H, BLOCK_K]
        b_s = tl.where(m_k[None, :], b_s * scale_log2, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp2(b_m - b_m_new)  # [BLOCK_H]
        b_p = tl.exp2(b_s - b_m_new[:, None])  # [BLOCK_H, BLOCK_K]
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = _mac(b_p.to(b_kv.dtype), b_kv, b_acc * b_alpha[:, None], IEEE)
        b_m = b_m_new
    m_row = b_l > 0.0  # rows with at least one valid key
    b_out = b_acc / tl.where(m_row, b_l, 1.0)[:, None]
    b_lse = tl.where(m_row, (b_m + tl.log2(tl.where(m_row, b_l, 1.0))) * 0.6931471805599453, float("-inf"))
    o_v = tl.arange(0, BLOCK_V)
    tl.store(out + row[:, None] * V + o_v[None, :], b_out.to(out.dtype.element_ty),
             mask=m_h[:, None] & (o_v[None, :] < V))
    tl.store(lse + row, b_lse, mask=m_h)


# ---------------------------------------------------------------------------------------------
# backward, split: dq kernel (+ delta) and dkv kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def _sparse_mla_bwd_dq_kernel(
    q, kv, idx, o, do, lse, dlse, delta, dq, pds, row0, dq_row0, scale, scale_log2, N, N_HB,
    DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr, EVEN: tl.constexpr, BIG: tl.constexpr, HAS_DLSE: tl.constexpr, SCRATCH: tl.constexpr,
    ASM_STORES: tl.constexpr = False, SPLIT_MMA: tl.constexpr = 0, PREFETCH_IDX: tl.constexpr = False,
):
    """PREFETCH_IDX: as in the forward kernel, index slots loaded one key tile ahead of their gather."""
    pid = split_mma_mark(tl.program_id(0), SPLIT_MMA)  # SPLIT_MMA: S and dP split over warpgroups
    i_t = pid // N_HB + row0  # query token (row0: first token of the chunk in the scratch variant)
    i_h = pid % N_HB
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < N
    row = i_t.to(tl.int64) * N + o_h  # [BLOCK_H]
    b_qv = _load_rows(q, row, m_h, 0, DQK, V, BLOCK_V, EVEN)  # [BLOCK_H, BLOCK_V]
    b_qr = _load_rows(q, row, m_h, V, DQK, R, BLOCK_R, EVEN)  # [BLOCK_H, BLOCK_R]
    b_do = _load_rows(do, row, m_h, 0, V, V, BLOCK_V, EVEN)  # [BLOCK_H, BLOCK_V]
    b_o = _load_rows(o, row, m_h, 0, V, V, BLOCK_V, EVEN)  # [BLOCK_H, BLOCK_V]
    b_lse = tl.load(lse + row, mask=m_h, other=0.0)  # [BLOCK_H]
    m_fin = b_lse != float("-inf")  # rows without a valid key: p = 0 (every slot is masked anyway)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), axis=1)  # [BLOCK_H] rowsum(dO * O)
    if HAS_DLSE:  # d lse / d logits = p: folds into the same (dP - delta) term
        b_delta -= tl.load(dlse + row, mask=m_h, other=0.0)
    b_delta = tl.where(m_fin, b_delta, 0.0)
    tl.store(delta + row, b_delta, mask=m_h)
    b_lse = tl.where(m_fin, b_lse, 0.0) * 1.4426950408889634  # log2 units
    b_dqv = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)  # [BLOCK_H, BLOCK_V]
    b_dqr = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)  # [BLOCK_H, BLOCK_R]
    row_s = (i_t - row0).to(tl.int64) * 2 * N + o_h  # [BLOCK_H] dS rows of the scratch (chunk token, head)
    b_idx_next = _load_idx(idx, i_t, 0, K, BLOCK_K)  # [BLOCK_K] (PREFETCH_IDX)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH_IDX:
            b_idx = b_idx_next
            b_idx_next = _load_idx(idx, i_t, k0 + BLOCK_K, K, BLOCK_K)  # -1 past the row: no gather
            b_kv, b_kr, b_row, m_k = _gather_rows(kv, b_idx, DQK, V, R, BLOCK_V, BLOCK_R, EVEN, BIG)
            o_k = k0 + tl.arange(0, BLOCK_K)
        else:
            b_kv, b_kr, b_row, m_k, o_k = _gather_kv(kv, idx, i_t, k0, K, DQK, V, R, BLOCK_K, BLOCK_V, BLOCK_R,
                                                     EVEN, BIG)
        b_s = _mac(b_qr, tl.trans(b_kr), _dot(b_qv, tl.trans(b_kv), IEEE), IEEE)  # [BLOCK_H, BLOCK_K]
        b_p = tl.exp2(b_s * scale_log2 - b_lse[:, None])
        b_p = tl.where(m_k[None, :], b_p, 0.0)  # [BLOCK_H, BLOCK_K]
        b_dp = _dot(b_do, tl.trans(b_kv), IEEE)  # [BLOCK_H, BLOCK_K]
        b_ds = (b_p * (b_dp - b_delta[:, None]) * scale).to(b_kv.dtype)  # d(q.k)
        if SCRATCH:  # dS and P in the operand dtype, as the dkv kernel's MMA will read them
            o_s = row_s[:, None] * K + o_k[None, :]  # [BLOCK_H, BLOCK_K] into pds [chunk, 2, N, K]
            m_s = m_h[:, None] & (o_k < K)[None, :]
            _store_b16_pairs(pds + o_s, b_ds, m_s, ASM_STORES)
            _store_b16_pairs(pds + N * K + o_s, b_p.to(pds.dtype.element_ty), m_s, ASM_STORES)
        b_dqv = _mac(b_ds, b_kv, b_dqv, IEEE)
        b_dqr = _mac(b_ds, b_kr, b_dqr, IEEE)
    o_v = tl.arange(0, BLOCK_V)
    o_r = tl.arange(0, BLOCK_R)
    row_dq = (i_t - dq_row0).to(tl.int64) * N + o_h  # [BLOCK_H] dq_row0: first token of a chunk-sized dq buffer
    tl.store(dq + row_dq[:, None] * DQK + o_v[None, :], b_dqv.to(dq.dtype.element_ty),
             mask=m_h[:, None] & (o_v[None, :] < V))
    tl.store(dq + row_dq[:, None] * DQK + V + o_r[None, :], b_dqr.to(dq.dtype.element_ty),
             mask=m_h[:, None] & (o_r[None, :] < R))


@triton.jit
def _sparse_mla_bwd_dkv_kernel(
    q, kv, idx, do, lse, delta, dkv, row0, scale, scale_log2, N, N_KB,
    DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, K: tl.constexpr, NHB: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr, EVEN: tl.constexpr, BIG: tl.constexpr, DETERMINISTIC: tl.constexpr,
):
    pid = tl.program_id(0)
    i_t = pid // N_KB + row0  # query token
    i_kb = pid % N_KB  # key block (fastest: the blocks of one token share its q / dO in L2)
    k0 = i_kb * BLOCK_K
    b_kv, b_kr, b_row, m_k, o_k = _gather_kv(kv, idx, i_t, k0, K, DQK, V, R, BLOCK_K, BLOCK_V, BLOCK_R,
                                             EVEN, BIG)
    b_acc_v = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)  # [BLOCK_K, BLOCK_V]
    b_acc_r = tl.zeros([BLOCK_K, BLOCK_R], dtype=tl.float32)  # [BLOCK_K, BLOCK_R]
    for i_h in range(NHB):  # all heads of the token (a static trip count: NHB = cdiv(N, BLOCK_H))
        o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
        m_h = o_h < N
        row = i_t.to(tl.int64) * N + o_h  # [BLOCK_H]
        b_qv = _load_rows(q, row, m_h, 0, DQK, V, BLOCK_V, EVEN)  # [BLOCK_H, BLOCK_V]
        b_qr = _load_rows(q, row, m_h, V, DQK, R, BLOCK_R, EVEN)  # [BLOCK_H, BLOCK_R]
        b_do = _load_rows(do, row, m_h, 0, V, V, BLOCK_V, EVEN)  # [BLOCK_H, BLOCK_V]
        b_lse = tl.load(lse + row, mask=m_h, other=0.0)  # [BLOCK_H]
        b_lse = tl.where(b_lse == float("-inf"), 0.0, b_lse) * 1.4426950408889634
        b_delta = tl.load(delta + row, mask=m_h, other=0.0)  # [BLOCK_H]
        b_st = _mac(b_kr, tl.trans(b_qr), _dot(b_kv, tl.trans(b_qv), IEEE), IEEE)  # [BLOCK_K, BLOCK_H]
        b_pt = tl.exp2(b_st * scale_log2 - b_lse[None, :])
        b_pt = tl.where(m_k[:, None] & m_h[None, :], b_pt, 0.0)  # [BLOCK_K, BLOCK_H]
        b_dpt = _dot(b_kv, tl.trans(b_do), IEEE)  # [BLOCK_K, BLOCK_H]
        b_dst = (b_pt * (b_dpt - b_delta[None, :]) * scale).to(b_kv.dtype)  # [BLOCK_K, BLOCK_H]
        b_acc_v = _mac(b_dst, b_qv, b_acc_v, IEEE)
        b_acc_v = _mac(b_pt.to(b_do.dtype), b_do, b_acc_v, IEEE)
        b_acc_r = _mac(b_dst, b_qr, b_acc_r, IEEE)
    o_v = tl.arange(0, BLOCK_V)
    o_r = tl.arange(0, BLOCK_R)
    if DETERMINISTIC:  # contribution rows ordered (token, slot), reduced later in sorted order
        e = (i_t - row0).to(tl.int64) * K + o_k  # [BLOCK_K]
        m_e = (o_k < K)[:, None]
        tl.store(dkv + e[:, None] * DQK + o_v[None, :], b_acc_v, mask=m_e & (o_v[None, :] < V))
        tl.store(dkv + e[:, None] * DQK + V + o_r[None, :], b_acc_r, mask=m_e & (o_r[None, :] < R))
    else:
        p_row = dkv + b_row.to(tl.int64)[:, None] * DQK
        tl.atomic_add(p_row + o_v[None, :], b_acc_v, mask=m_k[:, None] & (o_v[None, :] < V), sem="relaxed")
        tl.atomic_add(p_row + V + o_r[None, :], b_acc_r, mask=m_k[:, None] & (o_r[None, :] < R), sem="relaxed")


@triton.jit
def _sparse_mla_bwd_dkv_scratch_kernel(
    q, idx, do, pds, dkv, row0, N, N_KB,
    DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, K: tl.constexpr, NHB: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr, EVEN: tl.constexpr, DETERMINISTIC: tl.constexpr, tgt=None, TGT: tl.constexpr = False,
    GROUP: tl.constexpr = 1,
):
    """dkv without recompute: contracts the dS / P the dq kernel stored for a chunk of tokens.

    One program per (chunk token, GROUP consecutive key blocks); keys are the MMA M side, heads the reduction:
    dkv[key, :V] = sum_h dS[h, key] q[h, :V] + P[h, key] dO[h, :], dkv[key, V:] = sum_h dS[h, key] q[h, V:].
    1088 MACs per (head, key) instead of the recomputing kernel's 2176, and no key-row gather: only
    the destination rows (idx) are read. The value part is ONE dot per head block, [dS^T | P^T] @ [q_v ; dO]
    (reduction 2 * BLOCK_H): two dots chained on one accumulator make Triton give the first one
    warpsPerCTA [8, 1] and convert the [64, 512] fp32 accumulator between layouts every step (12 KB of
    spills in the AOT report). GROUP > 1 with one head block (NHB == 1): the token's q / dO rows are loaded
    once for its GROUP key blocks instead of once per block (scratch_cfg group)."""
    pid = tl.program_id(0)
    n_g = (N_KB + GROUP - 1) // GROUP  # key-block groups per token
    i_c = pid // n_g  # token within the chunk (its scratch row)
    i_t = i_c + row0  # query token
    i_g = pid % n_g  # key-block group (fastest: the groups of one token share its q / dO in L2)
    if GROUP == 1:
        _dkv_scratch_block(q, do, pds, dkv, tgt, idx, i_c, i_t, i_g, N, DQK, V, R, K, NHB,
                           BLOCK_H, BLOCK_K, BLOCK_V, BLOCK_R, IEEE, EVEN, DETERMINISTIC, TGT)
    else:
        tl.static_assert(NHB == 1, "scratch_cfg group > 1 needs all heads in one block")
        b_qdo, b_qr, o_h, o_hj, m_h, m_hj = _dkv_head_rows(q, do, i_t, 0, N, DQK, V, R, BLOCK_H, BLOCK_V, BLOCK_R,
                                                            EVEN)
        for i_j in range(GROUP):
            i_kb = i_g * GROUP + i_j  # past N_KB: every slot is masked (o_k >= K)
            o_k, m_kk, b_idx, m_k = _dkv_block_slots(idx, i_t, i_kb, K, BLOCK_K)
            b_acc_v = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)  # [BLOCK_K, BLOCK_V]
            b_acc_r = tl.zeros([BLOCK_K, BLOCK_R], dtype=tl.float32)  # [BLOCK_K, BLOCK_R]
            b_acc_t = _target_acc(BLOCK_H, BLOCK_K, TGT)
            b_acc_v, b_acc_r, b_acc_t = _dkv_contract(b_qdo, b_qr, pds, i_c, o_h, o_hj, m_h, m_hj, o_k, m_kk, N, K,
                                                      b_acc_v, b_acc_r, b_acc_t, BLOCK_H, IEEE, TGT)
            _dkv_write(dkv, tgt, i_c, i_t, o_k, m_kk, b_idx, m_k, b_acc_v, b_acc_r, b_acc_t, DQK, V, R, K,
                       BLOCK_V, BLOCK_R, DETERMINISTIC, TGT)


@triton.jit
def _target_acc(BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, TGT: tl.constexpr):
    """The loss target's accumulator: TGT 1 ("mma"): [BLOCK_K, 16], P^T @ e0 (only column 0 nonzero); TGT 2
    ("reg"): [BLOCK_H, BLOCK_K], P tiles added elementwise, the head sum taken once per key block."""
    if TGT == 2:  # (one return: Triton refuses returns of two shapes, even under a constexpr branch)
        b_acc = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
    else:
        b_acc = tl.zeros([BLOCK_K, 16], dtype=tl.float32)
    return b_acc


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
    b_qr = _load_rows(q, i_t.to(tl.int64) * N + o_h, m_h, V, DQK, R, BLOCK_R, EVEN)  # [BLOCK_H, BLOCK_R]
    return b_qdo, b_qr, o_h, o_hj, m_h, m_hj


@triton.jit
def _dkv_contract(b_qdo, b_qr, pds, i_c, o_h, o_hj, m_h, m_hj, o_k, m_kk, N, K: tl.constexpr, b_acc_v, b_acc_r,
                  b_acc_t, BLOCK_H: tl.constexpr, IEEE: tl.constexpr, TGT: tl.constexpr):
    """One head block's share of a key block: the stored dS / P against [q_v ; dO] and q's rope rows, added
    to the accumulators (and, TGT 1, P's head sum on the tensor cores: P^T @ e0, column 0 ones; TGT 2, P
    added to a [BLOCK_H, BLOCK_K] fp32 tile)."""
    o_j = tl.arange(0, 2 * BLOCK_H)
    # pds is [chunk, 2, N, K]: plane 0 = dS, plane 1 = P
    o_sj = ((i_c * 2 + (o_j >= BLOCK_H)).to(tl.int64) * N + o_hj)[:, None] * K + o_k[None, :]
    b_dsp = tl.load(pds + o_sj, mask=m_hj[:, None] & m_kk[None, :], other=0.0)  # [2 * BLOCK_H, BLOCK_K]
    o_s = (i_c.to(tl.int64) * 2 * N + o_h)[:, None] * K + o_k[None, :]
    b_ds = tl.load(pds + o_s, mask=m_h[:, None] & m_kk[None, :], other=0.0)  # [BLOCK_H, BLOCK_K] (L1 / L2 hit)
    b_acc_v = _mac(tl.trans(b_dsp), b_qdo, b_acc_v, IEEE)
    b_acc_r = _mac(tl.trans(b_ds), b_qr, b_acc_r, IEEE)
    if TGT == 2:  # scratch_cfg target_sum "reg": P added elementwise, summed over heads once in _dkv_write
        b_acc_t += tl.load(pds + o_s + N * K, mask=m_h[:, None] & m_kk[None, :], other=0.0).to(tl.float32)
    elif TGT:
        b_p = tl.load(pds + o_s + N * K, mask=m_h[:, None] & m_kk[None, :], other=0.0)  # [BLOCK_H, BLOCK_K] P
        b_e0 = (tl.arange(0, 16)[None, :] == 0) & (tl.arange(0, BLOCK_H)[:, None] >= 0)  # [BLOCK_H, 16]
        b_acc_t = _mac(tl.trans(b_p), b_e0.to(b_p.dtype), b_acc_t, IEEE)
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
        tl.store(tgt + i_t.to(tl.int64) * K + o_k, tl.sum(b_acc_t, axis=0 if TGT == 2 else 1), mask=m_kk)
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
def _dkv_scratch_block(q, do, pds, dkv, tgt, idx, i_c, i_t, i_kb, N, DQK: tl.constexpr, V: tl.constexpr,
                       R: tl.constexpr, K: tl.constexpr, NHB: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
                       EVEN: tl.constexpr, DETERMINISTIC: tl.constexpr, TGT: tl.constexpr):
    """The scratch dkv kernel's work for one (token, key block): contraction over all heads, then the adds
    into dkv rows (or the deterministic contribution rows), and the loss target."""
    o_k, m_kk, b_idx, m_k = _dkv_block_slots(idx, i_t, i_kb, K, BLOCK_K)
    b_acc_v = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)  # [BLOCK_K, BLOCK_V]
    b_acc_r = tl.zeros([BLOCK_K, BLOCK_R], dtype=tl.float32)  # [BLOCK_K, BLOCK_R]
    b_acc_t = _target_acc(BLOCK_H, BLOCK_K, TGT)
    for i_h in range(NHB):  # all heads of the token
        b_qdo, b_qr, o_h, o_hj, m_h, m_hj = _dkv_head_rows(q, do, i_t, i_h, N, DQK, V, R, BLOCK_H, BLOCK_V,
                                                            BLOCK_R, EVEN)
        b_acc_v, b_acc_r, b_acc_t = _dkv_contract(b_qdo, b_qr, pds, i_c, o_h, o_hj, m_h, m_hj, o_k, m_kk, N, K,
                                                  b_acc_v, b_acc_r, b_acc_t, BLOCK_H, IEEE, TGT)
    _dkv_write(dkv, tgt, i_c, i_t, o_k, m_kk, b_idx, m_k, b_acc_v, b_acc_r, b_acc_t, DQK, V, R, K, BLOCK_V, BLOCK_R,
               DETERMINISTIC, TGT)


# ---------------------------------------------------------------------------------------------
# backward, fused (one program per token and head block; dkv atomics per head block)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _sparse_mla_bwd_kernel(
    q, kv, idx, do, lse, delta, dq, dkv, row0, scale, scale_log2, N, N_HB,
    DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr, EVEN: tl.constexpr, BIG: tl.constexpr, DETERMINISTIC: tl.constexpr,
):
    pid = tl.program_id(0)
    i_t = pid // N_HB + row0
    i_h = pid % N_HB
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    o_v = tl.arange(0, BLOCK_V)
    o_r = tl.arange(0, BLOCK_R)
    m_h = o_h < N
    row = i_t.to(tl.int64) * N + o_h  # [BLOCK_H]
    b_qv = _load_rows(q, row, m_h, 0, DQK, V, BLOCK_V, EVEN)
    b_qr = _load_rows(q, row, m_h, V, DQK, R, BLOCK_R, EVEN)
    b_do = _load_rows(do, row, m_h, 0, V, V, BLOCK_V, EVEN)
    b_lse = tl.load(lse + row, mask=m_h, other=0.0)
    b_lse = tl.where(b_lse == float("-inf"), 0.0, b_lse) * 1.4426950408889634
    b_delta = tl.load(delta + row, mask=m_h, other=0.0)
    b_dqv = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    b_dqr = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        b_kv, b_kr, b_row, m_k, o_k = _gather_kv(kv, idx, i_t, k0, K, DQK, V, R, BLOCK_K, BLOCK_V, BLOCK_R,
                                                 EVEN, BIG)
        b_s = _mac(b_qr, tl.trans(b_kr), _dot(b_qv, tl.trans(b_kv), IEEE), IEEE)  # [BLOCK_H, BLOCK_K]
        b_p = tl.exp2(b_s * scale_log2 - b_lse[:, None])
        b_p = tl.where(m_k[None, :] & m_h[:, None], b_p, 0.0)
        b_dp = _dot(b_do, tl.trans(b_kv), IEEE)
        b_ds = (b_p * (b_dp - b_delta[:, None]) * scale).to(b_kv.dtype)
        b_dqv = _mac(b_ds, b_kv, b_dqv, IEEE)
        b_dqr = _mac(b_ds, b_kr, b_dqr, IEEE)
        b_dkv = _dot(tl.trans(b_ds), b_qv, IEEE) + _dot(tl.trans(b_p.to(b_do.dtype)), b_do, IEEE)  # [BLOCK_K, BLOCK_V]
        b_dkr = _dot(tl.trans(b_ds), b_qr, IEEE)  # [BLOCK_K, BLOCK_R]
        if DETERMINISTIC:  # contribution rows ordered (head block, token, slot), reduced later
            e = ((i_h * (tl.num_programs(0) // N_HB) + (i_t - row0)).to(tl.int64) * K + o_k)
            m_e = (o_k < K)[:, None]
            tl.store(dkv + e[:, None] * DQK + o_v[None, :], b_dkv, mask=m_e & (o_v[None, :] < V))
            tl.store(dkv + e[:, None] * DQK + V + o_r[None, :], b_dkr, mask=m_e & (o_r[None, :] < R))
        else:
            p_row = dkv + b_row.to(tl.int64)[:, None] * DQK
            tl.atomic_add(p_row + o_v[None, :], b_dkv, mask=m_k[:, None] & (o_v[None, :] < V), sem="relaxed")
            tl.atomic_add(p_row + V + o_r[None, :], b_dkr, mask=m_k[:, None] & (o_r[None, :] < R), sem="relaxed")
    tl.store(dq + row[:, None] * DQK + o_v[None, :], b_dqv.to(dq.dtype.element_ty),
             mask=m_h[:, None] & (o_v[None, :] < V))
    tl.store(dq + row[:, None] * DQK + V + o_r[None, :], b_dqr.to(dq.dtype.element_ty),
             mask=m_h[:, None] & (o_r[None, :] < R))


def _alloc(*shape, dtype, device):
    """Output allocation (tests swap in a NaN fill so unwritten elements show up)."""
    return torch.empty(*shape, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------
# launchers (configs are arguments so benchmarks can sweep them)
# ---------------------------------------------------------------------------------------------
def _interp(t: torch.Tensor) -> bool:
    return not t.is_cuda


def _meta(q, kv, idx, v_dim):
    T, N, DQK = q.shape
    R = DQK - v_dim
    BV = max(16, triton.next_power_of_2(v_dim))
    BR = max(16, triton.next_power_of_2(max(R, 1)))
    return dict(DQK=DQK, V=v_dim, R=R, K=idx.shape[1], BLOCK_V=BV, BLOCK_R=BR,
                IEEE=q.dtype == torch.float32, EVEN=(BV == v_dim and BR == R),
                BIG=kv.shape[0] * DQK >= 2 ** 31)


def _block_h(N: int, block_h=None, cap: int = 64) -> int:
    return block_h or min(cap, max(16, triton.next_power_of_2(N)))


# Defaults (BLOCK_H, BLOCK_K, num_warps, num_stages) from the bench/sparse_attn.py sweep on the H200
# (2026-12-02, T = 16K, N = 128, k = 2048; bench/results/sparse_attn.csv, bench/NOTES_sparse_mla.md):
# fwd BLOCK_K 64: 36.0 ms (260 TFLOP/s) vs 32: 50.4 ms (185), although ptxas reports 20 B of spills
# for 64x64; bwd split dq32 + dkv32x32: 276 ms vs fused 32x16: 346 ms, dkv32x64: 1286 ms, dq16: 346 ms.
FWD_CFG = dict(block_k=64, num_warps=8, num_stages=2, split_mma=True, prefetch_idx=None)
# prefetch_idx: the index slots of key tile i + 1 are loaded during tile i (loop-carried), so the pipelined
# gather of the next tile is issued without first waiting on a synchronous index load (sm_90a TTGIR: before,
# a tt.load of the indices sat in front of the async copies every iteration). H200, T = 64K (session 10,
# bench/sparse_attn.py --sweep-only, one process): N = 64 62.2 -> 52.2 ms (300 -> 358 TFLOP/s), N = 128
# 110.4 -> 108.9 ms; bit-identical output. None: on for head blocks of more than FEW_HEADS rows only; with
# one 16-row block (N <= 16) the prefetching forward measured 46.9 ms at 64K (11.5 at 16K) against 34.8
# (9.2) without it (session 9 vs 10 tables).
BWD_DQ_CFG = dict(block_k=32, num_warps=8, num_stages=2, split_mma=True, prefetch_idx=None)
# split_mma: the chained QK^T / dO V^T tiles split over the two warpgroups instead of both computing all
# of them (kernels/_split_mma.py); sm_90a compile, 64 heads x 64 keys fwd: 72 -> 36 QK^T wgmma per key tile,
# smem 221 -> 226 KB, spills 20 -> 32 B; dq (64 x 32, scratch stores): 136 -> 68 wgmma, spills 552 -> 220 B.
# H200, T = 64K, N = 128, k = 2048 (session 9, bench/sparse_attn.py --sweep-only): fwd 147.2 -> 111.1 ms
# (254 -> 336 TFLOP/s), bwd 662.8 -> 493.8 ms (143 -> 192); dq kernel alone 103.6 -> 61.2 ms (N = 64: 51.3 ->
# 30.4; N = 16 has one 16-row tile, unchanged). 16 warps split: 140.6 ms; block_k 32 split: 183.2.
BWD_DKV_CFG = dict(block_h=32, block_k=32, num_warps=8, num_stages=1)
BWD_FUSED_CFG = dict(block_h=32, block_k=16, num_warps=8, num_stages=2)
# variant="scratch" (default): the dkv kernel that contracts the dq kernel's stored P / dS. BLOCK_K 64
# keys = one wgmma M; 16 heads per step, 3 stages: 45.5 ms vs 50.1 for 32 heads / 2 stages at N = 128
# (T = 16K; 34.5 vs 37.5 at N = 64; equal at N = 16); 32 keys: 76.6 (H200, session 6).
# (Tried, session 10: one dkv launch per key range ("key slices") so that the fp32 dkv rows being added to fit
# in L2; at 64K / N = 16 with ascending rows the dkv kernel took 163.9 ms with 4 slices, 216.6 with 8, vs 164.2
# with one launch: the atomics' L2 misses are not what bounds it. Removed.)
# group: key blocks per dkv program when all heads fit one head block (N <= 16), the token's q / dO rows loaded
# once for all of them (None: 8 there, else 1). H200, N = 16 (session 10, bench/sparse_bwd_parts.py): dkv kernel
# 64K 167.1 -> 142.5 / 141.4 / 140.6 ms with 2 / 4 / 8, 16K 29.1 -> 23.8 with 8.
# target_sum: how the dkv kernel sums the loss target over heads: "mma" (P^T @ e0, one N = 16 MMA per head block)
# or "reg" (P tiles added elementwise in fp32, one cross-thread sum per key block; default since session 12).
# H200, T = 16K, k 2048 (bench/sparse_bwd_parts.py, dkv kernel without / with the target): N = 64 "mma" 34.52 ->
# 37.36 ms (+2.84), "reg" 34.46 -> 36.54 (+2.08); N = 16 23.85 -> 27.68 (+3.83) vs 23.77 -> 27.40 (+3.63).
BWD_SCRATCH_CFG = dict(block_h=16, block_k=64, num_warps=8, num_stages=3, group=None, target_sum="reg")
TARGET_SUMS = ("mma", "reg")
SCRATCH_GROUP_ONE_BLOCK = 8
# its dq kernel with at most 16 heads (one 16-row M tile): 4 warps, 12.1 ms vs 23.8 with 8 at N = 16;
# 8 warps above (N = 128: 117.6 vs 138.5 ms with 4)
FEW_HEADS, BWD_DQ_WARPS_FEW_HEADS = 16, 4
# dq_cfg prefetch_idx (None: on for the few-heads dq kernel only): index slots a key tile ahead of their
# gather, as in the forward. With 64-head tiles (8 warps, split) it was slower on the H200 (session 10,
# T = 16K: N = 64 30.4 -> 33.1 ms, N = 128 61.0 -> 69.2)
# Scratch budget of the "scratch" variant: P and dS for a chunk of tokens, 2 x [chunk, N, k] in q's dtype.
# 256 MiB = 256 tokens at N = 128, k = 2048 (bf16); never O(T).
SCRATCH_BYTES = 256 << 20
BWD_VARIANTS = (None, "scratch", "split", "fused")  # None = "scratch"


def sparse_mla_fwd(q, kv, idx, softmax_scale, v_dim, block_h=None, block_k=None, num_warps=None, num_stages=None,
                   split_mma=None, prefetch_idx=None):
    """Kernel launch only (inputs already validated and contiguous) -> out [T, N, V], lse fp32 [T, N].
    ``split_mma`` (None: FWD_CFG's): QK^T split over the warpgroups (Hopper; see kernels/_split_mma.py).
    ``prefetch_idx`` (None: FWD_CFG's): index slots loaded one key tile ahead of their gather."""
    T, N, _ = q.shape
    out = _alloc(T, N, v_dim, dtype=q.dtype, device=q.device)
    lse = _alloc(T, N, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    meta = _meta(q, kv, idx, v_dim)
    bh = _block_h(N, block_h)
    n_hb = triton.cdiv(N, bh)
    interp = _interp(q)
    nw = num_warps or FWD_CFG["num_warps"]
    _sparse_mla_fwd_kernel[(T * n_hb,)](
        q, kv, idx, out, lse, softmax_scale * LOG2E, N, n_hb, BLOCK_H=bh,
        BLOCK_K=16 if interp else (block_k or FWD_CFG["block_k"]), **meta,
        SPLIT_MMA=split_flag(FWD_CFG["split_mma"] if split_mma is None else split_mma, interp, bh, nw),
        PREFETCH_IDX=prefetch_flag(FWD_CFG["prefetch_idx"] if prefetch_idx is None else prefetch_idx,
                                   bh > FEW_HEADS),
        num_warps=nw, num_stages=num_stages or FWD_CFG["num_stages"])
    return out, lse


_LAUNCH_KEYS = ("block_h", "block_k", "num_warps", "num_stages")
CFG_KEYS = dict(dq=_LAUNCH_KEYS + ("split_mma", "asm_stores", "prefetch_idx"), dkv=_LAUNCH_KEYS,
                fused=_LAUNCH_KEYS, scratch=_LAUNCH_KEYS + ("group", "target_sum"))


def check_cfg_keys(name: str, cfg, allowed) -> None:
    """ValueError naming any key of a ``*_cfg`` dict the kernels do not read (a typo or a removed option
    would otherwise be ignored silently)."""
    if cfg is None:
        return
    if not isinstance(cfg, dict):
        raise ValueError(f"sparse_mla_bwd: {name} must be a dict or None, got {type(cfg).__name__}")
    bad = sorted(set(cfg) - set(allowed))
    if bad:
        raise ValueError(f"sparse_mla_bwd: {name} has unknown key(s) {bad}; known: {list(allowed)}")


def prefetch_flag(prefetch_idx, default: bool) -> bool:
    """A kernel's PREFETCH_IDX: as given, or (None) the measured default for its head block: the forward
    prefetches with more than FEW_HEADS rows per block, the dq kernel with at most FEW_HEADS."""
    return bool(default) if prefetch_idx is None else bool(prefetch_idx)


def check_bwd_variant(variant, chunk_tokens, split=None, where="sparse_mla_bwd", names=("variant", "chunk_tokens")):
    """The backward to run, "scratch" / "split" / "fused"; ValueError naming the bad argument (the public
    op calls this at forward time with its own names). ``split`` (True: "split", False: "fused") is the
    older spelling and may not be combined with ``variant``."""
    v_name, c_name = names
    if variant not in BWD_VARIANTS:
        raise ValueError(f"{where}: unknown {v_name} {variant!r}; expected one of {BWD_VARIANTS}")
    if split is not None:
        if variant is not None:
            raise ValueError(f"{where}: pass either {v_name}={variant!r} or split={split!r}, not both")
        variant = "split" if split else "fused"
    variant = variant or "scratch"
    if chunk_tokens is not None:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"{where}: {c_name} must be a positive int or None, got {chunk_tokens!r}")
        if variant != "scratch":
            raise ValueError(f"{where}: {c_name} only applies to {v_name}='scratch', got {v_name}={variant!r}")
    return variant


def scratch_chunk_tokens(T: int, N: int, K: int, elem_bytes: int, chunk_tokens=None) -> int:
    """Tokens per chunk of the scratch variant: P + dS = 2 * chunk * N * K elements <= SCRATCH_BYTES."""
    return max(1, min(T, chunk_tokens or SCRATCH_BYTES // max(1, 2 * N * K * elem_bytes)))


def sparse_mla_bwd(q, kv, idx, out, lse, dout, dlse, softmax_scale, v_dim, deterministic=False, split=None,
                   dq_cfg=None, dkv_cfg=None, fused_cfg=None, buf_elems=1 << 27, dq_over_q=False,
                   variant=None, chunk_tokens=None, scratch_cfg=None, target=None):
    """Gradients (dq [T, N, Dqk] in q's dtype, dkv fp32 [S, Dqk]) from the saved out / lse.

    ``target`` (fp32 [T, k], optional; "scratch" only): receives the sparse-stage indexer-loss target, sum
    over heads of the attention probabilities P[t, h, j] at each selected slot (0 at padding),
    unnormalised, from the P the backward stores anyway: the dkv kernel sums them (q's dtype: bf16-rounded
    P in bf16 runs, summed in fp32) with one small MMA per head block, one plain store per (token, key
    block); deterministic, every element written. (Summing the fp32 P in the dq kernel instead doubled
    that kernel's time on the H200, 157 -> 309 ms at 16K tokens, N = 128: removed.)

    ``variant`` (see the module docstring): None / "scratch" (default, fastest at every measured N):
    per chunk of ``chunk_tokens`` tokens (default: P + dS within SCRATCH_BYTES) the dq kernel also stores
    dS and P ([chunk, 2, N, k], q's dtype) and a dkv kernel contracts them over heads without recomputing
    S and dP; ``scratch_cfg`` overrides BWD_SCRATCH_CFG for that dkv kernel. "split": dq kernel + a dkv
    kernel that recomputes S and dP (``dkv_cfg``); "fused": one kernel (``fused_cfg``). ``split=True`` /
    ``False`` is the older spelling of "split" / "fused". ``dq_cfg`` applies to the dq kernel of scratch
    and split. ``*_cfg``: dicts of block_h / block_k / num_warps / num_stages overriding the defaults, plus
    dq_cfg split_mma / asm_stores / prefetch_idx and scratch_cfg group (see BWD_DQ_CFG, BWD_SCRATCH_CFG);
    an unknown key is a ValueError. ``bench/check_sparse_mla.py --resources`` reports smem / spills per
    config offline.
    ``dq_over_q``: the caller no longer needs q: dq is written into q's storage, one [T, N, Dqk] buffer
    less. Fused: each program loads its q rows once, before its key loop, and is their only user.
    Scratch: each chunk's dq goes to a chunk-sized buffer and is copied over q's chunk rows once that
    chunk's dkv kernel (the last reader of those q rows) has run. Split: ignored (its dkv kernel reads
    all of q after the dq kernel).
    """
    T, N, DQK = q.shape
    S = kv.shape[0]
    K = idx.shape[1]
    variant = check_bwd_variant(variant, chunk_tokens, split)
    for name, given, allowed in (("dq_cfg", dq_cfg, CFG_KEYS["dq"]), ("dkv_cfg", dkv_cfg, CFG_KEYS["dkv"]),
                                 ("fused_cfg", fused_cfg, CFG_KEYS["fused"]),
                                 ("scratch_cfg", scratch_cfg, CFG_KEYS["scratch"])):
        check_cfg_keys(name, given, allowed)
    _check_target(target, T, K, variant, q.device)
    dout = dout.to(q.dtype).contiguous()  # the kernel's dots need one operand dtype
    over = dq_over_q and variant != "split"
    if over and not q.is_contiguous():
        raise ValueError(f"sparse_mla_bwd: dq_over_q needs a contiguous q, got stride {q.stride()}")
    dq = q if over else _alloc(*q.shape, dtype=q.dtype, device=q.device)
    dkv = torch.zeros(S, DQK, dtype=torch.float32, device=q.device)
    if T == 0:
        return dq, dkv
    meta = _meta(q, kv, idx, v_dim)
    interp = _interp(q)
    args = (softmax_scale, softmax_scale * LOG2E)
    delta = torch.empty(T, N, dtype=torch.float32, device=q.device)
    if variant == "fused":
        return _bwd_fused(q, kv, idx, out, lse, dout, dlse, delta, dq, dkv, args, meta, deterministic,
                          dict(BWD_FUSED_CFG, **(fused_cfg or {})), interp, buf_elems)
    c1 = dict(BWD_DQ_CFG, **(dq_cfg or {}))
    bh = _block_h(N, c1.get("block_h"))
    n_hb = triton.cdiv(N, bh)
    if variant == "scratch" and bh <= FEW_HEADS and "num_warps" not in (dq_cfg or {}):
        c1["num_warps"] = BWD_DQ_WARPS_FEW_HEADS
    dlse_c = dlse.float().contiguous() if dlse is not None else lse  # placeholder pointer when absent
    # asm_stores (opt-in, not yet timed): the scratch dq kernel's P / dS stores as inline PTX in the MMA
    # layout (sm_90a compile: 3 fewer barriers per key tile, 4 KB less smem, +200 instrs); GPU only
    dq_launch = dict(BLOCK_H=bh, BLOCK_K=16 if interp else c1["block_k"], HAS_DLSE=dlse is not None, **meta,
                     ASM_STORES=bool(c1.get("asm_stores")) and not interp,
                     SPLIT_MMA=split_flag(bool(c1.get("split_mma")), interp, bh, c1["num_warps"]),
                     PREFETCH_IDX=prefetch_flag(c1["prefetch_idx"], bh <= FEW_HEADS),
                     num_warps=c1["num_warps"], num_stages=c1["num_stages"])
    if variant == "scratch":
        return _bwd_scratch(q, kv, idx, out, lse, dout, dlse_c, delta, dq, dkv, args, meta, deterministic,
                            dq_launch, n_hb, dict(BWD_SCRATCH_CFG, **(scratch_cfg or {})), interp,
                            chunk_tokens, buf_elems, over, target)
    _sparse_mla_bwd_dq_kernel[(T * n_hb,)](
        q, kv, idx, out, dout, lse, dlse_c, delta, dq, delta, 0, 0, *args, N, n_hb, SCRATCH=False,
        **dq_launch)  # pds: a placeholder pointer (SCRATCH=False never touches it)
    c2 = dict(BWD_DKV_CFG, **(dkv_cfg or {}))
    bh2 = min(_block_h(N), c2.get("block_h") or 64)  # never more head rows than N needs (N = 16: 16, not 32)
    bk2 = 16 if interp else c2["block_k"]
    n_kb = triton.cdiv(K, bk2)
    launch = dict(BLOCK_H=bh2, BLOCK_K=bk2, NHB=triton.cdiv(N, bh2), **meta, num_warps=c2["num_warps"], num_stages=c2["num_stages"])
    if not deterministic:
        _sparse_mla_bwd_dkv_kernel[(T * n_kb,)](q, kv, idx, dout, lse, delta, dkv, 0, *args, N, n_kb,
                                                DETERMINISTIC=False, **launch)
        return dq, dkv
    rows = max(1, min(T, buf_elems // max(1, K * DQK)))  # bounded contribution buffer
    buf = torch.empty(rows * K, DQK, dtype=torch.float32, device=q.device)
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        _sparse_mla_bwd_dkv_kernel[((r1 - r0) * n_kb,)](q, kv, idx, dout, lse, delta, buf, r0, *args, N, n_kb,
                                                        DETERMINISTIC=True, **launch)
        deterministic_scatter_add_(dkv, idx[r0:r1].reshape(-1), buf[: (r1 - r0) * K])
    return dq, dkv


def _bwd_scratch(q, kv, idx, out, lse, dout, dlse_c, delta, dq, dkv, args, meta, deterministic, dq_launch, n_hb,
                 cfg, interp, chunk_tokens, buf_elems, over, target=None):
    """variant="scratch": per token chunk, dq kernel (+ P / dS stores) then the dkv contraction kernel.
    ``over`` (dq is q's storage): the dq kernel writes a chunk buffer, copied over q's chunk rows after
    the chunk's dkv kernel has read them."""
    T, N, DQK = q.shape
    K = idx.shape[1]
    rows = scratch_chunk_tokens(T, N, K, q.element_size(), chunk_tokens)
    if deterministic:  # one contribution buffer per chunk, within buf_elems
        rows = min(rows, max(1, buf_elems // max(1, K * DQK)))
        buf = torch.empty(rows * K, DQK, dtype=torch.float32, device=q.device)
    # _alloc: tests fill the scratch with NaN, so a dS / P element the dq kernel misses fails them
    pds = _alloc(rows, 2, N, K, dtype=q.dtype, device=q.device)  # [chunk, 2 (dS, P), N, K]
    dq_chunk = _alloc(rows, N, DQK, dtype=q.dtype, device=q.device) if over else None
    bh = min(_block_h(N), cfg.get("block_h") or 64)
    bk = 16 if interp else cfg["block_k"]
    n_kb = triton.cdiv(K, bk)
    group = scratch_group(cfg.get("group"), N, bh)
    launch = dict(BLOCK_H=bh, BLOCK_K=bk, NHB=triton.cdiv(N, bh), DQK=DQK, V=meta["V"], R=meta["R"], K=K,
                  BLOCK_V=meta["BLOCK_V"], BLOCK_R=meta["BLOCK_R"], IEEE=meta["IEEE"], EVEN=meta["EVEN"],
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        _sparse_mla_bwd_dq_kernel[((r1 - r0) * n_hb,)](
            q, kv, idx, out, dout, lse, dlse_c, delta, dq_chunk if over else dq, pds, r0, r0 if over else 0,
            *args, N, n_hb, SCRATCH=True, **dq_launch)
        _sparse_mla_bwd_dkv_scratch_kernel[((r1 - r0) * triton.cdiv(n_kb, group),)](
            q, idx, dout, pds, buf if deterministic else dkv, r0, N, n_kb, DETERMINISTIC=deterministic,
            tgt=target if target is not None else delta, TGT=target_mode(cfg.get("target_sum"), target), GROUP=group,
            **launch)
        if deterministic:
            deterministic_scatter_add_(dkv, idx[r0:r1].reshape(-1), buf[: (r1 - r0) * K])
        if over:  # stream order: after the dkv kernel that read q[r0:r1]
            q[r0:r1].copy_(dq_chunk[: r1 - r0])
    return dq, dkv


def target_mode(target_sum, target) -> int:
    """The scratch dkv kernel's TGT: 0 without a target buffer, else 1 + TARGET_SUMS.index(scratch_cfg target_sum)
    (ValueError naming a bad value)."""
    if target_sum not in TARGET_SUMS:
        raise ValueError(f"sparse_mla_bwd: scratch_cfg['target_sum'] must be one of {TARGET_SUMS}, got {target_sum!r}")
    return 0 if target is None else 1 + TARGET_SUMS.index(target_sum)


def scratch_group(group, N: int, block_h: int) -> int:
    """scratch_cfg["group"]: key blocks per program of the scratch dkv kernel (the token's q / dO rows loaded
    once for all of them). None: SCRATCH_GROUP_ONE_BLOCK where every head fits one block (N <= block_h), else
    1. An explicit group > 1 needs that too; ValueError otherwise."""
    if group is None:
        return SCRATCH_GROUP_ONE_BLOCK if N <= block_h else 1
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"sparse_mla_bwd: scratch_cfg['group'] must be an int >= 1, got {group!r}")
    if group > 1 and N > block_h:
        raise ValueError(f"sparse_mla_bwd: scratch_cfg['group'] = {group} needs all {N} heads in one head block "
                         f"(block_h {block_h}); use group=1 or block_h >= {N}")
    return group


def _check_target(target, T, K, variant, device) -> None:
    """ValueError naming the problem with a ``target`` buffer (None: no target)."""
    if target is None:
        return
    if variant != "scratch":
        raise ValueError(f"sparse_mla_bwd: the indexer-loss target (target=) needs variant 'scratch', not {variant!r}")
    if not (isinstance(target, torch.Tensor) and target.dtype == torch.float32 and tuple(target.shape) == (T, K)
            and target.device == device and target.is_contiguous()):
        raise ValueError(f"sparse_mla_bwd: target must be a contiguous fp32 [{T}, {K}] tensor on {device}, got "
                         f"{getattr(target, 'dtype', type(target))} {tuple(getattr(target, 'shape', ()))}")


def _delta_(delta, out, dout, lse, dlse, rows: int = 4096):
    """delta[t, h] = sum_v out * dout (- dlse), in row chunks: fp32 copies of out/dout for all rows
    would be 2 x [T, N, V] fp32 (2 GiB at 32K tokens, 16 heads)."""
    for r0 in range(0, delta.shape[0], rows):
        r1 = min(delta.shape[0], r0 + rows)
        d = (out[r0:r1].float() * dout[r0:r1].float()).sum(-1)
        if dlse is not None:
            d = d - dlse[r0:r1].float()
        delta[r0:r1] = torch.where(torch.isfinite(lse[r0:r1]), d, torch.zeros_like(d))


def _bwd_fused(q, kv, idx, out, lse, dout, dlse, delta, dq, dkv, args, meta, deterministic, cfg, interp,
               buf_elems):
    T, N, DQK = q.shape
    K = idx.shape[1]
    _delta_(delta, out, dout, lse, dlse)
    bh = min(cfg.get("block_h") or 32, _block_h(N, None, 32))
    n_hb = triton.cdiv(N, bh)
    launch = dict(BLOCK_H=bh, BLOCK_K=16 if interp else cfg["block_k"], **meta,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if not deterministic:
        _sparse_mla_bwd_kernel[(T * n_hb,)](q, kv, idx, dout, lse, delta, dq, dkv, 0, *args, N, n_hb,
                                            DETERMINISTIC=False, **launch)
        return dq, dkv
    rows = max(1, min(T, buf_elems // max(1, n_hb * K * DQK)))
    buf = torch.empty(n_hb * rows * K, DQK, dtype=torch.float32, device=q.device)
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        _sparse_mla_bwd_kernel[((r1 - r0) * n_hb,)](q, kv, idx, dout, lse, delta, dq, buf, r0, *args, N, n_hb,
                                                    DETERMINISTIC=True, **launch)
        keys = idx[r0:r1].reshape(1, -1).expand(n_hb, -1).reshape(-1)  # (head block, token, slot)
        deterministic_scatter_add_(dkv, keys, buf[: n_hb * (r1 - r0) * K])
    return dq, dkv


def flops(T: int, N: int, topk: int, dqk: int = 576, v_dim: int = 512) -> tuple[float, float]:
    """(forward, backward) FLOPs counted on the selected keys (2 per multiply-add).

    Backward counts the minimal work S, dP, dq, dkv (qk + pv) = 2752 / 1088 = 2.53x the forward;
    recomputation inside the kernels (the split backward recomputes S and dP once more) is not
    counted."""
    fwd = 2.0 * T * N * topk * (dqk + v_dim)
    bwd = 2.0 * T * N * topk * (dqk + v_dim + dqk + dqk + v_dim)  # S, dP, dq, dkv (qk + pv)
    return fwd, bwd
