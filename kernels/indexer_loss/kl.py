"""Fused sparse-stage KL: per-row KL(target || softmax(selected scores)) and its score gradient.

Per row t over its selected slots j (valid where indices[t, j] >= 0):

    tn[t, j]  = target[t, j] / max(sum_j target[t, j], EPS)          (L1 normalisation, fused here)
    lse[t]    = logsumexp_{valid j} scores[t, j]
    kl[t]     = mask[t] * sum_{valid j} tn * (log(max(tn, EPS)) - (scores - lse))
    d kl[t] / d scores[t, j] = mask[t] * (softmax_j * sum_j tn - tn_j)            (0 at padding)

Exactly the reference's ``_kl_rows(target, _masked_log_softmax(scores, valid), row_mask)`` (a row
with no valid slot has kl = 0 and no gradient). The forward kernel reads target and scores and
writes the per-row values [T] (kl, lse, sum of tn); with ``grad_out`` it also writes the unscaled
score gradient ``G = softmax * sum(tn) - tn`` (0 at padding) in a third pass -- in place over the
scores buffer in ``SparseKLFunction``. The autograd Function then saves G alone: one [T, topk] fp32
tensor between forward and backward instead of two (target and scores, 8 KiB/token less at
topk 2048), and the selected-scores backward kernel takes it as the score gradient, scaled per row
by coef as it loads it (``selected_scores_bwd(..., g, row_coef=coef)``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import EPS
from .selected_scores import selected_scores_bwd, selected_scores_fwd


@triton.jit
def _kl_rows_kernel(target, scores, idx, mask, kl, lse_out, tsum_out, grad, eps,
                    K: tl.constexpr, BLOCK_J: tl.constexpr, HAS_MASK: tl.constexpr, WRITE_GRAD: tl.constexpr):
    i_t = tl.program_id(0)
    base = i_t.to(tl.int64) * K
    # pass 1: target sum and score max / sum-exp (online) over the valid slots
    b_ts = tl.zeros([BLOCK_J], dtype=tl.float32)
    b_m = tl.full([BLOCK_J], -float("inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_J], dtype=tl.float32)
    for j0 in range(0, K, BLOCK_J):
        o_j = j0 + tl.arange(0, BLOCK_J)
        m_j = tl.load(idx + base + o_j, mask=o_j < K, other=-1) >= 0
        b_t = tl.load(target + base + o_j, mask=m_j, other=0.0)
        b_s = tl.load(scores + base + o_j, mask=m_j, other=-float("inf"))
        b_ts += b_t
        m_new = tl.maximum(b_m, b_s)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        b_l = b_l * tl.exp(b_m - m_safe) + tl.exp(b_s - m_safe)
        b_m = m_new
    tsum = tl.sum(b_ts, axis=0)
    m = tl.max(b_m, axis=0)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    l = tl.sum(b_l * tl.exp(b_m - m_safe), axis=0)
    lse = m_safe + tl.log(tl.maximum(l, 1e-30))
    den = tl.maximum(tsum, eps)
    # pass 2: KL terms
    b_kl = tl.zeros([BLOCK_J], dtype=tl.float32)
    for j0 in range(0, K, BLOCK_J):
        o_j = j0 + tl.arange(0, BLOCK_J)
        m_j = tl.load(idx + base + o_j, mask=o_j < K, other=-1) >= 0
        b_t = tl.load(target + base + o_j, mask=m_j, other=0.0) / den
        b_s = tl.load(scores + base + o_j, mask=m_j, other=0.0)
        term = b_t * (tl.log(tl.maximum(b_t, eps)) - (b_s - lse))
        b_kl += tl.where(m_j, term, 0.0)
    r = tl.sum(b_kl, axis=0)
    if HAS_MASK:
        r = r * tl.load(mask + i_t)
    tl.store(kl + i_t, r)
    tl.store(lse_out + i_t, lse)
    tl.store(tsum_out + i_t, tsum)
    if WRITE_GRAD:  # pass 3: d kl / d scores without coef (grad may alias scores: each slot read, then written)
        tnsum = tsum / den
        for j0 in range(0, K, BLOCK_J):
            o_j = j0 + tl.arange(0, BLOCK_J)
            m_j = tl.load(idx + base + o_j, mask=o_j < K, other=-1) >= 0
            b_s = tl.load(scores + base + o_j, mask=m_j, other=0.0)
            b_t = tl.load(target + base + o_j, mask=m_j, other=0.0) / den
            b_g = tl.where(m_j, tl.exp(b_s - lse) * tnsum - b_t, 0.0)
            tl.store(grad + base + o_j, b_g, mask=o_j < K)


def kl_rows(target: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor, row_mask=None, grad_out=None):
    """-> (kl [T] masked, lse [T], tsum [T] = sum of the raw target); all fp32.

    ``grad_out`` (fp32 [T, topk], may be ``scores`` itself): also write G = softmax(scores) * sum(tn) - tn
    (0 at padding), the row's KL gradient w.r.t. the scores before the coef/row-mask scaling."""
    T, K = target.shape
    kl = torch.empty(T, dtype=torch.float32, device=target.device)
    lse = torch.empty_like(kl)
    den = torch.empty_like(kl)
    if T == 0:
        return kl, lse, den
    block = min(1024, max(16, triton.next_power_of_2(K)))
    if not target.is_cuda:
        block = min(block, 64)
    m = row_mask.contiguous().float() if row_mask is not None else kl
    _kl_rows_kernel[(T,)](target, scores, indices, m, kl, lse, den, grad_out if grad_out is not None else kl, EPS,
                          K=K, BLOCK_J=block, HAS_MASK=row_mask is not None, WRITE_GRAD=grad_out is not None,
                          num_warps=4)
    return kl, lse, den


class SparseKLFunction(torch.autograd.Function):
    """kl[t] (masked) from (q_idx, w, k_idx) through the selected scores; target is a constant."""

    @staticmethod
    def forward(ctx, q, w, k, indices, target, row_mask, relu, deterministic, dq_over_q):
        scores = selected_scores_fwd(q, w, k, indices, relu)  # [T, topk] fp32
        kl, _, _ = kl_rows(target, scores, indices, row_mask, grad_out=scores)  # scores now hold G
        ctx.save_for_backward(q, w, k, indices, scores, row_mask if row_mask is not None else kl.new_ones(0))
        ctx.relu, ctx.deterministic, ctx.has_mask, ctx.dq_over_q = relu, deterministic, row_mask is not None, dq_over_q
        ctx.used = False
        return kl

    @staticmethod
    def backward(ctx, g_rows):
        if ctx.used:  # one backward per graph (dq may take q's storage)
            raise RuntimeError("sparse_kl: backward through the same graph twice (retain_graph) is not supported")
        ctx.used = True
        q, w, k, indices, grad, row_mask = ctx.saved_tensors
        coef = g_rows.float() * (row_mask.float() if ctx.has_mask else 1.0)  # d loss / d kl_unmasked[t]
        dq, dw, dk = kl_score_backward(q, w, k, indices, grad, coef.reshape(-1, 1), ctx.relu, ctx.deterministic,
                                       dq_over_q=ctx.dq_over_q)
        return dq, dw, dk, None, None, None, None, None, None


def kl_score_backward(q, w, k, indices, grad, coef, relu: bool, deterministic: bool, dq_over_q: bool = False,
                      dk_fp32: bool = False):
    """(dq, dw, dk) of the indexer from G = d kl / d scores (fp32 [T, topk]) times ``coef`` (fp32 [T, 1] or
    [1, 1], d loss / d kl per row), through the selected-scores backward kernel, which scales each G row as it
    loads it (no pass over G; G is left as it is). ``dq_over_q``: dq is written over q (q is private to this
    backward). ``dk_fp32``: dk stays fp32 (a partial sum still to be reduced across ranks), else in k's dtype."""
    dq_dtype = q.dtype
    T = grad.shape[0]
    row_coef = coef.float().reshape(-1).expand(T).contiguous()  # [T]
    dq, dw, dk = selected_scores_bwd(q, w, k, indices, grad, relu, deterministic, dq_over_q=dq_over_q,
                                     row_coef=row_coef)
    del q
    return dq.to(dq_dtype), dw.to(w.dtype), dk if dk_fp32 else dk.to(k.dtype)


def sparse_kl(q_idx, w, k_idx, indices, target, row_mask=None, relu: bool = True, deterministic: bool = False,
              dq_over_q_idx: bool = False):
    """Per-row masked KL [T] of the indexer's selected-score softmax against ``target`` (raw head-summed
    attention probabilities, normalised here); differentiable in q_idx, w, k_idx. ``dq_over_q_idx``: the
    backward writes q_idx's gradient into the storage of the q_idx it saved (only when that tensor is private
    to this loss, e.g. recomputed for its backward alone: hyscale_megatron.indexer_recompute)."""
    return SparseKLFunction.apply(q_idx.contiguous(), w.contiguous(), k_idx.contiguous(), indices.contiguous(),
                                  target.contiguous(), row_mask, relu, deterministic, bool(dq_over_q_idx))
