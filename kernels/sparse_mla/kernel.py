"""Triton forward and backward of absorbed-MLA sparse attention over top-k indices.

Spec: ``reference.sparse_mla_reference``. One program owns one query token and a block of
heads; it walks the token's selected keys in tiles of BLOCK_K, gathering each key row once for
all its heads (the key is shared by every head in absorbed MLA). The key row is split into the
value part [:V] and the rope tail [V:] so both tiles are powers of two (512 + 64 in production).

Forward: online softmax in base 2 (exp2 with the scale folded into log2e); writes out and the
natural-log LSE. Backward: recomputes the probabilities from the saved LSE (no second
normalisation pass), accumulates dq in registers, and adds each tile's dkv into an fp32 [S, Dqk]
table with atomics (default) or, with ``deterministic=True``, writes per-slot contributions of a
bounded chunk of rows and reduces them in sorted order (``scatter.deterministic_scatter_add_``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .scatter import deterministic_scatter_add_

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 inputs: exact fp32 products, matching the fp32 reference
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _load_heads(x, i_t, i_h, N, STRIDE: tl.constexpr, COL0: tl.constexpr, W: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
    """x[t, heads of block i_h, COL0:COL0+W] as [BLOCK_H, BLOCK_W] (zeros outside)."""
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    o_w = tl.arange(0, BLOCK_W)
    p = x + (i_t.to(tl.int64) * N + o_h[:, None]) * STRIDE + COL0 + o_w[None, :]
    return tl.load(p, mask=(o_h[:, None] < N) & (o_w[None, :] < W), other=0.0)


@triton.jit
def _gather_kv(kv, idx, i_t, k0, K: tl.constexpr, DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """Selected key rows split into value [BLOCK_K, BLOCK_V] and rope [BLOCK_K, BLOCK_R] tiles."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    b_idx = tl.load(idx + i_t.to(tl.int64) * K + o_k, mask=o_k < K, other=-1).to(tl.int64)  # [BLOCK_K]
    m_k = b_idx >= 0
    o_v = tl.arange(0, BLOCK_V)
    o_r = tl.arange(0, BLOCK_R)
    p_row = kv + b_idx[:, None] * DQK
    b_kv = tl.load(p_row + o_v[None, :], mask=m_k[:, None] & (o_v[None, :] < V), other=0.0)  # [BLOCK_K, BLOCK_V]
    b_kr = tl.load(p_row + V + o_r[None, :], mask=m_k[:, None] & (o_r[None, :] < R), other=0.0)  # [BLOCK_K, BLOCK_R]
    return b_kv, b_kr, b_idx, m_k, o_k


@triton.jit
def _sparse_mla_fwd_kernel(
    q, kv, idx, out, lse, scale_log2, N,
    DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
):
    i_t = tl.program_id(0)  # query token
    i_h = tl.program_id(1)  # head block
    b_qv = _load_heads(q, i_t, i_h, N, DQK, 0, V, BLOCK_H, BLOCK_V)  # [BLOCK_H, BLOCK_V]
    b_qr = _load_heads(q, i_t, i_h, N, DQK, V, R, BLOCK_H, BLOCK_R)  # [BLOCK_H, BLOCK_R]
    # Finite start for the running max: fully padded tiles then give p = exp2(-inf) = 0, not NaN.
    b_m = tl.full([BLOCK_H], -1e30, dtype=tl.float32)  # [BLOCK_H] running max (log2 units)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)  # [BLOCK_H] running sum
    b_acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)  # [BLOCK_H, BLOCK_V]
    for k0 in range(0, K, BLOCK_K):
        b_kv, b_kr, b_idx, m_k, o_k = _gather_kv(kv, idx, i_t, k0, K, DQK, V, R, BLOCK_K, BLOCK_V, BLOCK_R)
        b_s = _dot(b_qv, tl.trans(b_kv), IEEE) + _dot(b_qr, tl.trans(b_kr), IEEE)  # [BLOCK_H, BLOCK_K]
        b_s = tl.where(m_k[None, :], b_s * scale_log2, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp2(b_m - b_m_new)  # [BLOCK_H]
        b_p = tl.exp2(b_s - b_m_new[:, None])  # [BLOCK_H, BLOCK_K]
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_kv.dtype), b_kv, IEEE)
        b_m = b_m_new
    m_row = b_l > 0.0  # rows with at least one valid key
    b_out = b_acc / tl.where(m_row, b_l, 1.0)[:, None]
    b_lse = tl.where(m_row, (b_m + tl.log2(tl.where(m_row, b_l, 1.0))) * 0.6931471805599453, float("-inf"))
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    o_v = tl.arange(0, BLOCK_V)
    m_h = o_h < N
    row = i_t.to(tl.int64) * N + o_h  # [BLOCK_H]
    tl.store(out + row[:, None] * V + o_v[None, :], b_out.to(out.dtype.element_ty),
             mask=m_h[:, None] & (o_v[None, :] < V))
    tl.store(lse + row, b_lse, mask=m_h)


@triton.jit
def _sparse_mla_bwd_kernel(
    q, kv, idx, do, lse, delta, dq, dkv, row0, scale, scale_log2, N,
    DQK: tl.constexpr, V: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr, DETERMINISTIC: tl.constexpr, N_HB: tl.constexpr,
):
    i_t = tl.program_id(0) + row0  # query token
    i_h = tl.program_id(1)  # head block
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    o_v = tl.arange(0, BLOCK_V)
    o_r = tl.arange(0, BLOCK_R)
    m_h = o_h < N
    row = i_t.to(tl.int64) * N + o_h  # [BLOCK_H]
    b_qv = _load_heads(q, i_t, i_h, N, DQK, 0, V, BLOCK_H, BLOCK_V)  # [BLOCK_H, BLOCK_V]
    b_qr = _load_heads(q, i_t, i_h, N, DQK, V, R, BLOCK_H, BLOCK_R)  # [BLOCK_H, BLOCK_R]
    b_do = _load_heads(do, i_t, i_h, N, V, 0, V, BLOCK_H, BLOCK_V)  # [BLOCK_H, BLOCK_V]
    b_lse = tl.load(lse + row, mask=m_h, other=0.0)  # [BLOCK_H]
    b_lse = tl.where(b_lse == float("-inf"), 0.0, b_lse) * 1.4426950408889634  # log2 units; empty rows have p = 0
    b_delta = tl.load(delta + row, mask=m_h, other=0.0)  # [BLOCK_H]
    b_dqv = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)  # [BLOCK_H, BLOCK_V]
    b_dqr = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)  # [BLOCK_H, BLOCK_R]
    for k0 in range(0, K, BLOCK_K):
        b_kv, b_kr, b_idx, m_k, o_k = _gather_kv(kv, idx, i_t, k0, K, DQK, V, R, BLOCK_K, BLOCK_V, BLOCK_R)
        b_s = _dot(b_qv, tl.trans(b_kv), IEEE) + _dot(b_qr, tl.trans(b_kr), IEEE)  # [BLOCK_H, BLOCK_K]
        b_p = tl.exp2(b_s * scale_log2 - b_lse[:, None])
        b_p = tl.where(m_k[None, :] & m_h[:, None], b_p, 0.0)  # [BLOCK_H, BLOCK_K]
        b_dp = _dot(b_do, tl.trans(b_kv), IEEE)  # [BLOCK_H, BLOCK_K]
        b_ds = (b_p * (b_dp - b_delta[:, None]) * scale).to(b_kv.dtype)  # [BLOCK_H, BLOCK_K] d(q.k)
        b_dqv += _dot(b_ds, b_kv, IEEE)
        b_dqr += _dot(b_ds, b_kr, IEEE)
        b_dkv = _dot(tl.trans(b_ds), b_qv, IEEE) + _dot(tl.trans(b_p.to(b_do.dtype)), b_do, IEEE)  # [BLOCK_K, BLOCK_V]
        b_dkr = _dot(tl.trans(b_ds), b_qr, IEEE)  # [BLOCK_K, BLOCK_R]
        if DETERMINISTIC:  # contribution rows ordered (head block, token, slot), reduced later
            e = ((i_h * (tl.num_programs(0)) + (i_t - row0)).to(tl.int64) * K + o_k)  # [BLOCK_K]
            m_e = (o_k < K)[:, None]
            tl.store(dkv + e[:, None] * DQK + o_v[None, :], b_dkv, mask=m_e & (o_v[None, :] < V))
            tl.store(dkv + e[:, None] * DQK + V + o_r[None, :], b_dkr, mask=m_e & (o_r[None, :] < R))
        else:
            p_row = dkv + b_idx[:, None] * DQK
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
def _meta(q, kv, idx, v_dim, block_h, block_k):
    T, N, DQK = q.shape
    R = DQK - v_dim
    return dict(
        N=N, DQK=DQK, V=v_dim, R=R, K=idx.shape[1],
        BLOCK_H=block_h or min(64, max(16, triton.next_power_of_2(N))),
        BLOCK_K=block_k, BLOCK_V=max(16, triton.next_power_of_2(v_dim)),
        BLOCK_R=max(16, triton.next_power_of_2(max(R, 1))), IEEE=q.dtype == torch.float32,
    )


def sparse_mla_fwd(q, kv, idx, softmax_scale, v_dim, block_h=None, block_k=64, num_warps=8, num_stages=2):
    """Kernel launch only (inputs already validated and contiguous) -> out [T, N, V], lse fp32 [T, N]."""
    T, N, _ = q.shape
    out = _alloc(T, N, v_dim, dtype=q.dtype, device=q.device)
    lse = _alloc(T, N, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    meta = _meta(q, kv, idx, v_dim, block_h, block_k)
    grid = (T, triton.cdiv(N, meta["BLOCK_H"]))
    _sparse_mla_fwd_kernel[grid](q, kv, idx, out, lse, softmax_scale * LOG2E, **meta,
                                 num_warps=num_warps, num_stages=num_stages)
    return out, lse


def sparse_mla_bwd(q, kv, idx, out, lse, dout, dlse, softmax_scale, v_dim, deterministic=False,
                   block_h=None, block_k=16, num_warps=8, num_stages=2, buf_elems=1 << 27):
    """Gradients (dq [T, N, Dqk] in q's dtype, dkv fp32 [S, Dqk]) from the saved out / lse.

    Default tiles (32 heads x 16 keys) are the largest that fit sm_90 shared memory without
    heavy spills: q and dO serve as both MMA operands here, so each needs two smem layouts
    (64 heads x 32 keys needs 315 KB > 227 KB). ``bench/check_sparse_mla.py --resources``
    reports smem / spills per config offline.
    """
    block_h = block_h or min(32, max(16, triton.next_power_of_2(q.shape[1])))
    T, N, DQK = q.shape
    S = kv.shape[0]
    dout = dout.to(q.dtype).contiguous()  # the kernel's dots need one operand dtype
    delta = (out.float() * dout.float()).sum(-1)  # [T, N] = rowsum(dO * O)
    if dlse is not None:  # d lse / d logits = p: folds into the same (dP - delta) term
        delta = delta - dlse.float()
    delta = torch.where(torch.isfinite(lse), delta, torch.zeros_like(delta)).contiguous()
    dq = _alloc(*q.shape, dtype=q.dtype, device=q.device)
    dkv = torch.zeros(S, DQK, dtype=torch.float32, device=q.device)
    if T == 0:
        return dq, dkv
    meta = _meta(q, kv, idx, v_dim, block_h, block_k)
    n_hb = triton.cdiv(N, meta["BLOCK_H"])
    args = (softmax_scale, softmax_scale * LOG2E)
    launch = dict(num_warps=num_warps, num_stages=num_stages, N_HB=n_hb, **meta)
    if not deterministic:
        _sparse_mla_bwd_kernel[(T, n_hb)](q, kv, idx, dout, lse, delta, dq, dkv, 0, *args,
                                          DETERMINISTIC=False, **launch)
        return dq, dkv
    K = idx.shape[1]
    rows = max(1, min(T, buf_elems // max(1, n_hb * K * DQK)))  # bounded contribution buffer
    buf = torch.empty(n_hb * rows * K, DQK, dtype=torch.float32, device=q.device)
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        _sparse_mla_bwd_kernel[(r1 - r0, n_hb)](q, kv, idx, dout, lse, delta, dq, buf, r0, *args,
                                                DETERMINISTIC=True, **launch)
        keys = idx[r0:r1].reshape(1, -1).expand(n_hb, -1).reshape(-1)  # (head block, token, slot)
        deterministic_scatter_add_(dkv, keys, buf[: n_hb * (r1 - r0) * K])
    return dq, dkv


def flops(T: int, N: int, topk: int, dqk: int = 576, v_dim: int = 512) -> tuple[float, float]:
    """(forward, backward) FLOPs counted on the selected keys (2 per multiply-add)."""
    fwd = 2.0 * T * N * topk * (dqk + v_dim)
    bwd = 2.0 * T * N * topk * (dqk + v_dim + dqk + dqk + v_dim)  # S, dP, dq, dkv (qk + pv)
    return fwd, bwd

