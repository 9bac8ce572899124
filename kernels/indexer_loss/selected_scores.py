"""Indexer scores at given key indices, with gradients to q, w and k: the indexer side of the sparse KL loss.

    out[t, j] = I[t, indices[t, j]] = sum_h w[t, h] * act(q[t, h, :] . k[indices[t, j], :])

fp32 [T, topk], -inf where ``indices == -1``. Only the selected keys are scored, O(T * topk * H * D)
work; nothing of size [T, topk, D] is materialised: each program gathers its keys tile by tile.
Spec: ``reference.selected_scores_reference``.

Backward (per row t, over its selected keys j), one program per row:
    dS[h, j] = g[t, j] * w[t, h] * act'(s[h, j])
    dw[t, h] = sum_j g[t, j] * act(s[h, j])
    dq[t, h] = sum_j dS[h, j] * k[idx[t, j]]
    dk[idx[t, j]] += sum_h dS[h, j] * q[t, h]        (scatter-add over selected rows)

A slot block takes three MMAs: S = q k^T, dq += dS k and dk^T = q^T dS. The scatter-add to k uses fp32
atomics by default (fast, order-dependent in the last bits); ``deterministic=True`` instead writes
per-slot contributions for a bounded chunk of rows and reduces them with a sorted segmented sum (fixed
order, bit-identical run to run).

Paths: Triton on CUDA, and on CPU under ``TRITON_INTERPRET=1`` (the same kernels, interpreted);
plain CPU without the interpreter uses a row-chunked PyTorch path (logged once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import check, check_tensor, use_triton
from ..sparse_mla.scatter import deterministic_scatter_add_

NEG_INF = float("-inf")


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
    """Add one slot block's dk contributions b_dkt [BLOCK_D, BLOCK_J] (column j is slot j's row):
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
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """One program per row: the row's q / w are loaded once for all its slot blocks."""
    i_t = tl.program_id(0)  # query row
    b_q, b_w = _load_row(q, w, i_t, H, D, BLOCK_H, BLOCK_D)
    for j0 in range(0, K, BLOCK_J):
        b_k, b_idx, m_j, o_j = _gather_keys(k, idx, i_t, j0, K, D, BLOCK_J, BLOCK_D)
        b_s = _mma(b_q, tl.trans(b_k), IEEE)  # [BLOCK_H, BLOCK_J]
        if RELU:
            b_s = tl.maximum(b_s, 0.0)
        b_o = tl.sum(b_s * b_w[:, None], axis=0)  # [BLOCK_J]
        b_o = tl.where(m_j, b_o, float("-inf"))
        tl.store(out + i_t.to(tl.int64) * K + o_j, b_o, mask=o_j < K)


@triton.jit
def _selected_scores_bwd_kernel(
    q, w, k, idx, g, dq, dw, dk, row0, r_coef,
    H: tl.constexpr, D: tl.constexpr, K: tl.constexpr, RELU: tl.constexpr, IEEE: tl.constexpr,
    DETERMINISTIC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
    ROW_COEF: tl.constexpr,
):
    """One program per query row row0 + pid, walking all its selected slots (K is constexpr: a static loop).
    Each slot block's indices are loaded one block ahead (loop-carried), so the pipelined gather of the next
    key rows does not wait on a synchronous index load. ROW_COEF: the stored g row is scaled by r_coef[t] as
    it is loaded (the loss's d loss / d kl per row; no separate pass over the [T, K] fp32 g)."""
    i_t = tl.program_id(0) + row0
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_h = o_h < H
    m_d = o_d < D
    b_q, b_w = _load_row(q, w, i_t, H, D, BLOCK_H, BLOCK_D)
    b_qt = tl.trans(b_q)  # [BLOCK_D, BLOCK_H]: a view of the loaded tile (an MMA operand in shared memory)
    b_dq = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)  # [BLOCK_H, BLOCK_D]
    b_dw = tl.zeros([BLOCK_H], dtype=tl.float32)  # [BLOCK_H]
    if ROW_COEF:
        k_coef = tl.load(r_coef + i_t)
    b_idx_next = _load_slots(idx, i_t, 0, K, BLOCK_J)  # [BLOCK_J]
    for j0 in range(0, K, BLOCK_J):
        b_idx_cur = b_idx_next
        b_idx_next = _load_slots(idx, i_t, j0 + BLOCK_J, K, BLOCK_J)  # -1 past the row: no gather
        b_k, b_idx, m_j, o_j = _gather_slots(k, b_idx_cur, j0, D, BLOCK_J, BLOCK_D)
        b_g = tl.load(g + i_t.to(tl.int64) * K + o_j, mask=m_j, other=0.0)  # [BLOCK_J]
        if ROW_COEF:
            b_g = b_g * k_coef
        # dk is computed transposed, dk^T [D, J] = q^T [D, H] @ dS [H, J]: dS is the B operand (stored to
        # shared memory as it is), q^T a transposed view of the loaded q tile. No MMA result is ever
        # transposed: on Hopper (Triton >= 3.4) tl.trans of a wgmma accumulator (dk = dot(trans(dS), q))
        # lowers through a #linear / shared-memory transpose that miscompiles into wrong gradients
        # (cf. fla-org/flash-linear-attention #640, #984). Each MMA has an M side of >= 64 (H or D).
        b_s = _mma(b_q, tl.trans(b_k), IEEE)  # [BLOCK_H, BLOCK_J]
        if RELU:
            b_dw += tl.sum(tl.maximum(b_s, 0.0) * b_g[None, :], axis=1)
            b_ds = tl.where(b_s > 0.0, b_w[:, None] * b_g[None, :], 0.0).to(b_k.dtype)  # [BLOCK_H, BLOCK_J]
        else:
            b_dw += tl.sum(b_s * b_g[None, :], axis=1)
            b_ds = (b_w[:, None] * b_g[None, :]).to(b_k.dtype)  # [BLOCK_H, BLOCK_J]
        b_dq += _mma(b_ds, b_k, IEEE)
        b_dkt = _mma(b_qt, b_ds, IEEE)  # [BLOCK_D, BLOCK_J]
        _dk_add(dk, b_dkt, b_idx, m_j, o_j, o_d, m_d, i_t - row0, K, D, DETERMINISTIC)
    row = i_t.to(tl.int64)
    tl.store(dq + row * H * D + o_h[:, None] * D + o_d[None, :], b_dq, mask=m_h[:, None] & m_d[None, :])
    tl.store(dw + row * H + o_h, b_dw, mask=m_h)


def _alloc(*shape, dtype, device):
    """Output allocation (tests swap in a NaN fill so unwritten elements show up)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def _blocks(H: int, D: int):
    return max(16, triton.next_power_of_2(H)), max(16, triton.next_power_of_2(D))


# One program per row (q / w loaded once), 64-slot blocks.
FWD_CFG = dict(block_j=64, num_warps=4, num_stages=2)
# 64-slot blocks; the deterministic path (contribution stores instead of atomics) is faster with 32.
BWD_CFG = dict(block_j=64, block_j_det=32, num_warps=4, num_stages=3)
# The deterministic dk reduction's per-slot contribution buffer, fp32 elements.
DET_BUF_ELEMS = 1 << 26


def selected_scores_fwd(q, w, k, idx, relu: bool) -> torch.Tensor:
    """Kernel launch (inputs validated and contiguous) -> fp32 [T, topk] scores, -inf at padding."""
    T, H, D = q.shape
    K = idx.shape[1]
    out = _alloc(T, K, dtype=torch.float32, device=q.device)
    if T == 0 or K == 0:
        return out
    BLOCK_H, BLOCK_D = _blocks(H, D)
    _selected_scores_fwd_kernel[(T,)](q, w, k, idx, out, H, D, K, RELU=relu, IEEE=q.dtype == torch.float32,
                                      BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, BLOCK_J=FWD_CFG["block_j"],
                                      num_warps=FWD_CFG["num_warps"], num_stages=FWD_CFG["num_stages"])
    return out


def selected_scores_bwd(q, w, k, idx, g, relu: bool, deterministic: bool, dq_over_q: bool = False, row_coef=None):
    """(dq in q's dtype, dw, dk fp32) from the score gradient g (fp32 [T, topk], contiguous).

    ``row_coef`` (fp32 [T], contiguous): g's row t is taken times row_coef[t] (the same fp32 product as
    scaling g first; g is left as it is). ``dq_over_q``: dq is written into q's own storage (the caller owns
    q and no longer needs it, e.g. a q recomputed for this backward alone; one [T, H, D] buffer less).
    Safe because each program loads its query row once, before the slot loop, and is the only one to read
    or write that row."""
    T, H, D = q.shape
    S, K = k.shape[0], idx.shape[1]
    if dq_over_q and not q.is_contiguous():
        raise ValueError(f"selected_scores: dq_over_q needs a contiguous q, got stride {q.stride()}")
    if row_coef is not None and not (row_coef.dtype == torch.float32 and tuple(row_coef.shape) == (T,)
                                     and row_coef.is_contiguous() and row_coef.device == q.device):
        raise ValueError(f"selected_scores backward: row_coef must be a contiguous fp32 [{T}] tensor on "
                         f"{q.device}, got {row_coef.dtype} {tuple(row_coef.shape)}")
    # Each row's dq / dw is written once by one program: stored straight in the input dtypes.
    dq = q if dq_over_q else _alloc(T, H, D, dtype=q.dtype, device=q.device)
    dw = _alloc(T, H, dtype=w.dtype if w.dtype.is_floating_point else torch.float32, device=q.device)
    dk = torch.zeros(S, D, dtype=torch.float32, device=q.device)
    if T == 0:
        return dq, dw, dk
    BLOCK_H, BLOCK_D = _blocks(H, D)
    meta = dict(RELU=relu, IEEE=q.dtype == torch.float32, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
                BLOCK_J=BWD_CFG["block_j_det" if deterministic else "block_j"], ROW_COEF=row_coef is not None,
                num_warps=BWD_CFG["num_warps"], num_stages=BWD_CFG["num_stages"])
    coef = row_coef if row_coef is not None else dw  # placeholder pointer when absent
    if not deterministic:
        _selected_scores_bwd_kernel[(T,)](q, w, k, idx, g, dq, dw, dk, 0, coef, H, D, K, DETERMINISTIC=False, **meta)
        return dq, dw, dk
    rows = max(1, min(T, DET_BUF_ELEMS // max(1, K * D)))  # bounded [rows, K, D] contribution buffer
    buf = torch.empty(rows * K, D, dtype=torch.float32, device=q.device)
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        _selected_scores_bwd_kernel[(r1 - r0,)](q, w, k, idx, g, dq, dw, buf, r0, coef, H, D, K, DETERMINISTIC=True,
                                                **meta)
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


def torch_fwd(q, w, k, idx, relu):
    T, H, D = q.shape
    K = idx.shape[1]
    out = torch.empty(T, K, dtype=torch.float32, device=q.device)
    step = _torch_rows(K, D, H)
    for r0 in range(0, T, step):
        i = idx[r0:r0 + step].long()
        _, _, o = _torch_scores(q[r0:r0 + step], w[r0:r0 + step], k.float()[i.clamp(min=0)], relu)
        out[r0:r0 + step] = o.masked_fill(i < 0, NEG_INF)
    return out


def torch_bwd(q, w, k, idx, g, relu):
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
class SelectedScoresFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, w, k, indices, relu, deterministic, kernels):
        out = selected_scores_fwd(q, w, k, indices, relu) if kernels else torch_fwd(q, w, k, indices, relu)
        ctx.save_for_backward(q, w, k, indices)
        ctx.relu, ctx.deterministic, ctx.kernels = relu, deterministic, kernels
        return out

    @staticmethod
    def backward(ctx, g):
        q, w, k, indices = ctx.saved_tensors
        g = g.contiguous().float()
        if ctx.kernels:
            dq, dw, dk = selected_scores_bwd(q, w, k, indices, g, ctx.relu, ctx.deterministic)
        else:
            dq, dw, dk = torch_bwd(q, w, k, indices, g, ctx.relu)
        return dq.to(q.dtype), dw.to(w.dtype), dk.to(k.dtype), None, None, None, None


def check_inputs(q, w, k, indices) -> None:
    """TypeError / ValueError naming the problem with the indexer tensors (q [T, H, D], w [T, H], k [S, D],
    indices [T, topk])."""
    check_tensor("q", q, 3, (torch.float32, torch.bfloat16, torch.float16))
    T, H, D = q.shape
    check_tensor("w", w, 2, device=q.device)
    check_tensor("k", k, 2, (q.dtype,), device=q.device)
    check_tensor("indices", indices, 2, (torch.int32, torch.int64), device=q.device)
    check(w.shape == (T, H), f"w must be [{T}, {H}], got {tuple(w.shape)}")
    check(k.shape[1] == D, f"k must be [S, {D}], got {tuple(k.shape)}")
    check(indices.shape[0] == T, f"indices must be [{T}, topk], got {tuple(indices.shape)}")


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
    check_inputs(q, w, k, indices)
    if indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        check(lo >= -1 and hi < k.shape[0], f"indices must be in [-1, {k.shape[0]}), got [{lo}, {hi}]")
    return SelectedScoresFunction.apply(q.contiguous(), w.contiguous(), k.contiguous(), indices.contiguous(),
                                        relu, deterministic, use_triton("selected_scores", q))
