"""Indexer scores at given key indices, with gradients to q, w and k.

    out[t, j] = I[t, indices[t, j]] = sum_h w[t, h] * act(q[t, h, :] . k[indices[t, j], :])

fp32 [T, topk], -inf where ``indices == -1``. This is the "predict" side of the sparse-stage
indexer loss: only the selected keys are scored, O(T * topk * H * D) work. Nothing of size
[T, topk, D] is materialised: each program gathers its keys tile by tile.

Backward (per row t, over its selected keys j):
    dS[h, j] = g[t, j] * w[t, h] * act'(s[h, j])
    dw[t, h] = sum_j g[t, j] * act(s[h, j])
    dq[t, h] = sum_j dS[h, j] * k[idx[t, j]]
    dk[idx[t, j]] += sum_h dS[h, j] * q[t, h]        (scatter-add over selected rows)

By default (``BWD_CFG dk_t``) a slot block takes three MMAs: S = q k^T, dq += dS k and dk^T = q^T dS (the
ReLU mask read from S in one orientation; the older path builds dS^T from a second, transposed S MMA).
The scatter-add to k uses fp32 atomics by default (fast, order-dependent in the last bits).
``deterministic=True`` instead writes per-slot contributions for a bounded chunk of rows and
reduces them with a sorted segmented sum (fixed order, bit-identical run to run).

Paths: Triton on CUDA, and on CPU under ``TRITON_INTERPRET=1`` (the same kernels, interpreted);
plain CPU without the interpreter uses a row-chunked PyTorch path (logged once).
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from .._common import check, check_tensor
from ..sparse_mla.scatter import deterministic_scatter_add_

_log = logging.getLogger("hyscale_kernels")
_logged_fallback = False
NEG_INF = float("-inf")


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _mma(a, b, IEEE: tl.constexpr):
    """tl.dot; IEEE (fp32 inputs): exact fp32 products (input_precision="ieee") instead of the tensor cores' tf32."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _load_row(q, w, i_t, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """q[t] as [BLOCK_H, BLOCK_D] and w[t] as fp32 [BLOCK_H] (zeros past H / D)."""
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_h = o_h < H
    row = i_t.to(tl.int64)
    b_q = tl.load(q + row * H * D + o_h[:, None] * D + o_d[None, :],
                  mask=m_h[:, None] & (o_d[None, :] < D), other=0.0)  # [BLOCK_H, BLOCK_D]
    b_w = tl.load(w + row * H + o_h, mask=m_h, other=0.0).to(tl.float32)  # [BLOCK_H]
    return b_q, b_w


@triton.jit
def _load_slots(idx, i_t, j0, K: tl.constexpr, BLOCK_J: tl.constexpr):
    """Slots [j0, j0 + BLOCK_J) of row i_t's index list: int64 [BLOCK_J], -1 past K."""
    o_j = j0 + tl.arange(0, BLOCK_J)
    return tl.load(idx + i_t.to(tl.int64) * K + o_j, mask=o_j < K, other=-1).to(tl.int64)


@triton.jit
def _gather_keys(k, idx, i_t, j0, K: tl.constexpr, D: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    """Selected key rows [BLOCK_J, BLOCK_D] (zeros at padding), their indices and validity."""
    return _gather_slots(k, _load_slots(idx, i_t, j0, K, BLOCK_J), j0, D, BLOCK_J, BLOCK_D)


@triton.jit
def _gather_slots(k, b_idx, j0, D: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    """_gather_keys from already loaded slots b_idx [BLOCK_J] (int64, -1 = padding)."""
    o_j = j0 + tl.arange(0, BLOCK_J)
    o_d = tl.arange(0, BLOCK_D)
    m_j = b_idx >= 0
    b_k = tl.load(k + b_idx[:, None] * D + o_d[None, :],
                  mask=m_j[:, None] & (o_d[None, :] < D), other=0.0)  # [BLOCK_J, BLOCK_D]
    return b_k, b_idx, m_j, o_j


@triton.jit
def _dk_add(dk, b_dkt, b_idx, m_j, o_j, o_d, m_d, i_r, K: tl.constexpr, D: tl.constexpr, DETERMINISTIC: tl.constexpr):
    """DK_T: add one slot block's dk contributions b_dkt [BLOCK_D, BLOCK_J] (column j is slot j's row):
    fp32 atomics into dk [S, D] at the slots' key rows, or (DETERMINISTIC) plain stores into row i_r's
    [K, D] block of the per-slot contribution buffer (reduced in sorted order afterwards)."""
    if DETERMINISTIC:
        p_buf = dk + (i_r.to(tl.int64) * K + o_j)[None, :] * D + o_d[:, None]
        tl.store(p_buf, b_dkt, mask=(o_j < K)[None, :] & m_d[:, None])
    else:
        tl.atomic_add(dk + b_idx[None, :] * D + o_d[:, None], b_dkt, mask=m_j[None, :] & m_d[:, None], sem="relaxed")


@triton.jit
def _selected_scores_fwd_kernel(
    q, w, k, idx, out,
    H: tl.constexpr, D: tl.constexpr, K: tl.constexpr, RELU: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr, N_BLK: tl.constexpr = 1,
):
    """One program per (row, N_BLK consecutive slot blocks): the row's q / w are loaded once for all of them."""
    i_t = tl.program_id(0)  # query row
    i_j = tl.program_id(1)  # group of N_BLK slot blocks
    b_q, b_w = _load_row(q, w, i_t, H, D, BLOCK_H, BLOCK_D)
    for i_b in range(N_BLK):
        j0 = (i_j * N_BLK + i_b) * BLOCK_J
        b_k, b_idx, m_j, o_j = _gather_keys(k, idx, i_t, j0, K, D, BLOCK_J, BLOCK_D)
        b_s = _mma(b_q, tl.trans(b_k), IEEE)  # [BLOCK_H, BLOCK_J]
        if RELU:
            b_s = tl.maximum(b_s, 0.0)
        b_o = tl.sum(b_s * b_w[:, None], axis=0)  # [BLOCK_J]
        b_o = tl.where(m_j, b_o, float("-inf"))
        tl.store(out + i_t.to(tl.int64) * K + o_j, b_o, mask=o_j < K)


@triton.jit
def _selected_scores_bwd_kernel(
    q, w, k, idx, g, dq, dw, dk, row0, sc, tg, r_lse, r_tsum, r_coef, eps,
    H: tl.constexpr, D: tl.constexpr, K: tl.constexpr, RELU: tl.constexpr, IEEE: tl.constexpr, DETERMINISTIC: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr, KL: tl.constexpr,
    PREFETCH_IDX: tl.constexpr = False, DK_T: tl.constexpr = False, ROW_COEF: tl.constexpr = False,
):
    """PREFETCH_IDX: each slot block's indices are loaded one block ahead (loop-carried), so the pipelined
    gather of the next key rows does not wait on a synchronous index load (as the sparse MLA forward).
    DK_T: dk from 3 MMAs instead of 4 (see below). ROW_COEF (not KL): the stored g row is scaled by r_coef[t]
    as it is loaded (the loss's d loss / d kl per row; no separate pass over the [T, K] fp32 g)."""
    # query row; the program walks all its selected slots (K is constexpr: a static loop, which
    # the interpreter with numpy >= 2.5 needs; topk takes few values per model anyway)
    i_t = tl.program_id(0) + row0
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_h = o_h < H
    m_d = o_d < D
    b_q, b_w = _load_row(q, w, i_t, H, D, BLOCK_H, BLOCK_D)
    if DK_T:
        b_qt = tl.trans(b_q)  # [BLOCK_D, BLOCK_H]: a view of the loaded tile (an MMA operand in shared memory)
    b_dq = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)  # [BLOCK_H, BLOCK_D]
    b_dw = tl.zeros([BLOCK_H], dtype=tl.float32)  # [BLOCK_H]
    if KL:  # the KL gradient is recomputed per slot, never stored: coef * (softmax * sum(tn) - tn)
        k_lse = tl.load(r_lse + i_t)
        k_tsum = tl.load(r_tsum + i_t)
        k_den = tl.maximum(k_tsum, eps)
        k_tnsum = k_tsum / k_den
        k_coef = tl.load(r_coef + i_t)
    elif ROW_COEF:
        k_coef = tl.load(r_coef + i_t)
    b_idx_next = _load_slots(idx, i_t, 0, K, BLOCK_J)  # [BLOCK_J] (PREFETCH_IDX)
    for j0 in range(0, K, BLOCK_J):
        if PREFETCH_IDX:
            b_idx_cur = b_idx_next
            b_idx_next = _load_slots(idx, i_t, j0 + BLOCK_J, K, BLOCK_J)  # -1 past the row: no gather
            b_k, b_idx, m_j, o_j = _gather_slots(k, b_idx_cur, j0, D, BLOCK_J, BLOCK_D)
        else:
            b_k, b_idx, m_j, o_j = _gather_keys(k, idx, i_t, j0, K, D, BLOCK_J, BLOCK_D)
        if KL:
            b_sc = tl.load(sc + i_t.to(tl.int64) * K + o_j, mask=m_j, other=0.0)
            b_tn = tl.load(tg + i_t.to(tl.int64) * K + o_j, mask=m_j, other=0.0) / k_den
            b_g = tl.where(m_j, k_coef * (tl.exp(b_sc - k_lse) * k_tnsum - b_tn), 0.0)  # [BLOCK_J]
        else:
            b_g = tl.load(g + i_t.to(tl.int64) * K + o_j, mask=m_j, other=0.0)  # [BLOCK_J]
            if ROW_COEF:
                b_g = b_g * k_coef
        # dq takes dS [H, J] and dk takes dS^T [J, H], each built in its own orientation and fed to
        # the MMA as the A operand straight from registers (with ReLU, from a second score MMA in the
        # transposed orientation). Never tl.trans a dS tile (dk = dot(trans(dS), q) did): on Hopper
        # (Triton >= 3.4) that lowers through a #linear / shared-memory transpose of the wgmma
        # accumulator layout, which miscompiled into wrong gradients (cf. fla-org/flash-linear-attention
        # #640, #984). ReLU pays a 4th small MMA per tile. DK_T instead computes dk transposed,
        # dk^T [D, J] = q^T [D, H] @ dS [H, J]: dS is the B operand (stored to shared memory as it is),
        # q^T a transposed view of the loaded q tile (no MMA result is transposed): 3 MMAs, each with
        # an M side of >= 64 (H or D), so all can be wgmma on Hopper.
        b_s = _mma(b_q, tl.trans(b_k), IEEE)  # [BLOCK_H, BLOCK_J]
        if DK_T:
            if RELU:
                b_dw += tl.sum(tl.maximum(b_s, 0.0) * b_g[None, :], axis=1)
                b_ds = tl.where(b_s > 0.0, b_w[:, None] * b_g[None, :], 0.0).to(b_k.dtype)  # [BLOCK_H, BLOCK_J]
            else:
                b_dw += tl.sum(b_s * b_g[None, :], axis=1)
                b_ds = (b_w[:, None] * b_g[None, :]).to(b_k.dtype)  # [BLOCK_H, BLOCK_J]
            b_dq += _mma(b_ds, b_k, IEEE)
            b_dkt = _mma(b_qt, b_ds, IEEE)  # [BLOCK_D, BLOCK_J]
            _dk_add(dk, b_dkt, b_idx, m_j, o_j, o_d, m_d, i_t - row0, K, D, DETERMINISTIC)
        elif RELU:
            b_st = _mma(b_k, tl.trans(b_q), IEEE)  # [BLOCK_J, BLOCK_H]
            b_dw += tl.sum(tl.maximum(b_s, 0.0) * b_g[None, :], axis=1)
            b_ds = tl.where(b_s > 0.0, b_w[:, None] * b_g[None, :], 0.0)  # [BLOCK_H, BLOCK_J]
            b_dst = tl.where(b_st > 0.0, b_g[:, None] * b_w[None, :], 0.0)  # [BLOCK_J, BLOCK_H]
        else:
            b_dw += tl.sum(b_s * b_g[None, :], axis=1)
            b_ds = b_w[:, None] * b_g[None, :]  # [BLOCK_H, BLOCK_J]
            b_dst = b_g[:, None] * b_w[None, :]  # [BLOCK_J, BLOCK_H]
        if not DK_T:
            b_ds = b_ds.to(b_k.dtype)
            b_dst = b_dst.to(b_k.dtype)
            b_dq += _mma(b_ds, b_k, IEEE)
            b_dk = _mma(b_dst, b_q, IEEE)  # [BLOCK_J, BLOCK_D]
            if DETERMINISTIC:  # per-slot contributions of this row chunk, reduced in sorted order later
                p_buf = dk + ((i_t - row0).to(tl.int64) * K + o_j)[:, None] * D + o_d[None, :]
                tl.store(p_buf, b_dk, mask=(o_j < K)[:, None] & m_d[None, :])
            else:
                tl.atomic_add(dk + b_idx[:, None] * D + o_d[None, :], b_dk, mask=m_j[:, None] & m_d[None, :],
                              sem="relaxed")
    row = i_t.to(tl.int64)
    tl.store(dq + row * H * D + o_h[:, None] * D + o_d[None, :], b_dq, mask=m_h[:, None] & m_d[None, :])
    tl.store(dw + row * H + o_h, b_dw, mask=m_h)


def _alloc(*shape, dtype, device):
    """Output allocation (tests swap in a NaN fill so unwritten elements show up)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def _blocks(H: int, D: int):
    return max(16, triton.next_power_of_2(H)), max(16, triton.next_power_of_2(D))


# blocks_per_prog 0 (a whole row per program, q / w loaded once): H200 16K, 64 x 128, k 2048: 3.58 -> 2.50 ms (s. 11)
# + 2 stages (smem for more programs per SM): 2.54 -> 2.37 ms (session 11; 8 warps 2.88, 32 slots 2.90, 128 2.69)
FWD_CFG = dict(block_j=64, blocks_per_prog=0, num_warps=4, num_stages=2)


def _triton_fwd(q, w, k, idx, relu: bool, block_j: int | None = None, blocks_per_prog: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None):
    """blocks_per_prog: slot blocks of block_j per program (q / w loaded once per program); 0 = a whole row."""
    T, H, D = q.shape
    K = idx.shape[1]
    out = _alloc(T, K, dtype=torch.float32, device=q.device)
    if T == 0 or K == 0:
        return out
    BLOCK_H, BLOCK_D = _blocks(H, D)
    block_j = block_j or FWD_CFG["block_j"]
    n_blk = FWD_CFG["blocks_per_prog"] if blocks_per_prog is None else blocks_per_prog
    n_blk = min(n_blk, triton.cdiv(K, block_j)) if n_blk > 0 else triton.cdiv(K, block_j)
    grid = (T, triton.cdiv(K, block_j * n_blk))
    _selected_scores_fwd_kernel[grid](q, w, k, idx, out, H, D, K, RELU=relu, IEEE=q.dtype == torch.float32,
                                      BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, BLOCK_J=block_j, N_BLK=n_blk,
                                      num_warps=num_warps or FWD_CFG["num_warps"],
                                      num_stages=num_stages or FWD_CFG["num_stages"])
    return out


# H200 16K, 64 x 128 index heads, k 2048 (session 11, bench/loss_parts.py): dk_t + 64-slot blocks 11.89 -> 7.33 ms,
# + prefetch_idx 6.69 ms; deterministic: 32-slot blocks (dk_t: 33.8 ms vs 45.8 with 64)
BWD_CFG = dict(block_j=64, block_j_det=32, prefetch_idx=True, num_warps=4, num_stages=3, dk_t=True)


def _triton_bwd(q, w, k, idx, g, relu: bool, deterministic: bool, block_j: int | None = None,
                buf_elems: int = 1 << 26, kl=None, dq_over_q: bool = False, prefetch_idx: bool | None = None,
                num_warps: int | None = None, num_stages: int | None = None, dk_t: bool | None = None,
                row_coef=None):
    """``kl=(scores, target, lse, tsum, coef)``: take g from the fused KL (``indexer_loss.kl``) instead of
    a stored gradient tensor (``g`` is then None). ``row_coef`` (fp32 [T], contiguous; not with ``kl``): g's row t
    is taken times row_coef[t] (the same fp32 product as scaling g first). ``dq_over_q``: write dq into q's own storage (the
    caller owns q and no longer needs it: a recomputed q; saves a [T, H, D] buffer, 16 GiB at 1M x 64
    x 128). Safe because each program loads its query row once, before the slot loop, and is the only
    one to read or write that row."""
    T, H, D = q.shape
    S, K = k.shape[0], idx.shape[1]
    # Each row's dq/dw is written once by one program: store straight into the input dtypes
    # (an fp32 [T, H, D] buffer plus its cast would cost 1.5 GiB at 32K tokens, 64 x 128 heads).
    if dq_over_q and not q.is_contiguous():
        raise ValueError(f"selected_scores: dq_over_q needs a contiguous q, got stride {q.stride()}")
    dq = q if dq_over_q else _alloc(T, H, D, dtype=q.dtype, device=q.device)
    dw = _alloc(T, H, dtype=w.dtype if w.dtype.is_floating_point else torch.float32, device=q.device)
    dk = torch.zeros(S, D, dtype=torch.float32, device=q.device)
    if T == 0:
        return dq, dw, dk
    BLOCK_H, BLOCK_D = _blocks(H, D)
    meta = dict(RELU=relu, IEEE=q.dtype == torch.float32, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
                BLOCK_J=block_j or BWD_CFG["block_j_det" if deterministic else "block_j"], KL=kl is not None,
                PREFETCH_IDX=bool(BWD_CFG["prefetch_idx"] if prefetch_idx is None else prefetch_idx),
                DK_T=bool(BWD_CFG["dk_t"] if dk_t is None else dk_t),
                num_warps=num_warps or BWD_CFG["num_warps"], num_stages=num_stages or BWD_CFG["num_stages"])
    if row_coef is not None:
        if kl is not None:
            raise ValueError("selected_scores backward: row_coef and kl are exclusive (kl carries its own coef)")
        if not (row_coef.dtype == torch.float32 and tuple(row_coef.shape) == (T,) and row_coef.is_contiguous()
                and row_coef.device == q.device):
            raise ValueError(f"selected_scores backward: row_coef must be a contiguous fp32 [{T}] tensor on "
                             f"{q.device}, got {row_coef.dtype} {tuple(row_coef.shape)}")
    meta["ROW_COEF"] = row_coef is not None
    if kl is None:
        z = dq
        kl_args = (z, z, z, z, row_coef if row_coef is not None else z, 0.0)
    else:
        from ..indexer_loss.kl import EPS  # noqa: PLC0415

        g = kl[0]
        kl_args = (*kl, EPS)
    if not deterministic:
        _selected_scores_bwd_kernel[(T,)](q, w, k, idx, g, dq, dw, dk, 0, *kl_args, H, D, K, DETERMINISTIC=False,
                                          **meta)
        return dq, dw, dk
    rows = max(1, min(T, buf_elems // max(1, K * D)))  # bounded [rows, K, D] contribution buffer
    buf = torch.empty(rows * K, D, dtype=torch.float32, device=q.device)
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        _selected_scores_bwd_kernel[(r1 - r0,)](q, w, k, idx, g, dq, dw, buf, r0, *kl_args, H, D, K,
                                                DETERMINISTIC=True, **meta)
        deterministic_scatter_add_(dk, idx[r0:r1].reshape(-1), buf[: (r1 - r0) * K])
    return dq, dw, dk


# ---------------------------------------------------------------------------------------------
# PyTorch fallback (CPU without the interpreter): row-chunked, O(rows * topk * D) working set
# ---------------------------------------------------------------------------------------------
def _torch_rows(K, D, H):
    return max(1, (1 << 22) // max(1, K * (D + H)))


def _torch_scores(q, w, k_sel, relu):
    s = torch.einsum("thd,tjd->thj", q.float(), k_sel)  # [R, H, K]
    a = s.relu() if relu else s
    return s, a, torch.einsum("thj,th->tj", a, w.float())


def _torch_fwd(q, w, k, idx, relu):
    T, H, D = q.shape
    K = idx.shape[1]
    out = torch.empty(T, K, dtype=torch.float32, device=q.device)
    step = _torch_rows(K, D, H)
    for r0 in range(0, T, step):
        i = idx[r0:r0 + step].long()
        _, _, o = _torch_scores(q[r0:r0 + step], w[r0:r0 + step], k.float()[i.clamp(min=0)], relu)
        out[r0:r0 + step] = o.masked_fill(i < 0, NEG_INF)
    return out


def _torch_bwd(q, w, k, idx, g, relu):
    T, H, D = q.shape
    K = idx.shape[1]
    dq = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
    dw = torch.empty(T, H, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    step = _torch_rows(K, D, H)
    for r0 in range(0, T, step):
        sl = slice(r0, r0 + step)
        i = idx[sl].long()
        valid = i >= 0
        k_sel = k.float()[i.clamp(min=0)]  # [R, K, D]
        s, a, _ = _torch_scores(q[sl], w[sl], k_sel, relu)
        gc = g[sl].float().masked_fill(~valid, 0.0)  # [R, K]
        dw[sl] = torch.einsum("thj,tj->th", a, gc)
        ds = gc[:, None, :] * w[sl].float()[:, :, None]
        if relu:
            ds = ds * (s > 0)
        dq[sl] = torch.einsum("thj,tjd->thd", ds, k_sel)
        dk_sel = torch.einsum("thj,thd->tjd", ds, q[sl].float())
        dk.index_add_(0, i[valid], dk_sel[valid])  # sequential on CPU: deterministic
    return dq, dw, dk


# ---------------------------------------------------------------------------------------------
# autograd + public op
# ---------------------------------------------------------------------------------------------
class _SelectedScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, w, k, indices, relu, deterministic):
        use_triton = _use_triton(q)
        out = _triton_fwd(q, w, k, indices, relu) if use_triton else _torch_fwd(q, w, k, indices, relu)
        ctx.save_for_backward(q, w, k, indices)
        ctx.relu, ctx.deterministic, ctx.use_triton = relu, deterministic, use_triton
        return out

    @staticmethod
    def backward(ctx, g):
        q, w, k, indices = ctx.saved_tensors
        g = g.contiguous().float()
        if ctx.use_triton:
            dq, dw, dk = _triton_bwd(q, w, k, indices, g, ctx.relu, ctx.deterministic)
        else:
            dq, dw, dk = _torch_bwd(q, w, k, indices, g, ctx.relu)
        return dq.to(q.dtype), dw.to(w.dtype), dk.to(k.dtype), None, None, None


def selected_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    indices: torch.Tensor,
    relu: bool = True,
    deterministic: bool = False,
) -> torch.Tensor:
    """Indexer scores at the selected keys, differentiable in q, w and k.

    Args:
        q: [T, H, D] index queries (fp32 / bf16 / fp16).
        w: [T, H] head weights (float; may be negative).
        k: [S, D] index keys, same dtype as q.
        indices: [T, topk] int32/int64 key rows, -1 = padding (gets -inf and no gradient).
        relu: apply ReLU to q . k before the head weights (DeepSeek); False = identity (GLM-5).
        deterministic: reduce the gradient to k in a fixed order (sorted segmented sum) instead
            of fp32 atomics (the default, faster, not bit-reproducible).
    Returns:
        fp32 [T, topk] scores, -inf where indices == -1.
    """
    check_tensor("q", q, 3, (torch.float32, torch.bfloat16, torch.float16))
    T, H, D = q.shape
    check_tensor("w", w, 2, device=q.device)
    check_tensor("k", k, 2, (q.dtype,), device=q.device)
    check_tensor("indices", indices, 2, (torch.int32, torch.int64), device=q.device)
    check(w.shape == (T, H), f"w must be [{T}, {H}], got {tuple(w.shape)}")
    check(k.shape[1] == D, f"k must be [S, {D}], got {tuple(k.shape)}")
    check(indices.shape[0] == T, f"indices must be [{T}, topk], got {tuple(indices.shape)}")
    if indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        check(lo >= -1 and hi < k.shape[0], f"indices must be in [-1, {k.shape[0]}), got [{lo}, {hi}]")
    if not _use_triton(q):
        global _logged_fallback
        if not _logged_fallback:
            _logged_fallback = True
            _log.info("hyscale_kernels: selected_scores on CPU without TRITON_INTERPRET uses the "
                      "row-chunked PyTorch path")
    return _SelectedScores.apply(q.contiguous(), w.contiguous(), k.contiguous(), indices.contiguous(),
                                 relu, deterministic)
