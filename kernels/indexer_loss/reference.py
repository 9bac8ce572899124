"""Plain-PyTorch specification of the DSA indexer KL loss (stock megatron-core 0.19.2 semantics).

The indexer is trained to predict where the attention looks. Per query row t:

    target[t, s]  = sum_h softmax_s(scale * query[t, h] . kv[s])          (heads all-reduced over TP)
    target[t, :] /= max(sum_s target[t, s], 1e-10)                         (L1 normalisation)
    predict[t, :] = log_softmax_s(I[t, s])     I = sum_j w[t, j] act(q_idx[t, j] . k_idx[s])
    kl[t]         = sum_s target * (log(max(target, 1e-10)) - predict)

over the keys s of the stage:
- sparse stage: the selected keys ``indices[t, :]`` (-1 = padding). The attention softmax is the
  sparse attention's own (over the selected keys), so with ``lse`` from the attention forward the
  target needs no second normalisation pass: p = exp(scale * q.k - lse).
- dense (warm-up) stage: every visible key ``starts[t] <= s < ends[t]``.

Reduction (stock's ``reduce_indexer_kl_sum``): mean of kl over the valid rows (all rows when
``query_valid_rows`` is None), or the plain sum when ``calculate_per_token_loss``; times
``loss_coeff``. ``query`` / ``kv`` get no gradient (stock detaches them); q_idx, w, k_idx do.

Indices must lie inside the row's visible range (HyTopK guarantees it); stock additionally
intersects them with the mask, which is then a no-op. Duplicate indices are outside the
contract (a duplicate would count twice; stock's scatter counts it once).

Chunked over rows; each chunk's scoring is checkpointed so the backward recomputes it. Memory:
sparse O(T * topk) + one [rows, N, topk] chunk; dense one [rows, N + H_I, S] chunk, never [T, S].
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..hytopk.reference import index_scores_reference

EPS = 1e-10  # stock's INDEXER_LOSS_EPS
NEG_INF = float("-inf")


def selected_scores_reference(
    q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, indices: torch.Tensor, relu: bool = True
) -> torch.Tensor:
    """Indexer scores at given indices: out[t, j] = I[t, indices[t, j]], fp32 [T, topk], -inf at -1.

    Differentiable in q, w and k through autograd; costs O(T * topk * H * D).
    """
    valid = indices >= 0
    k_sel = k.float()[indices.long().clamp(min=0)]  # [T, topk, D]
    s = torch.einsum("thd,tjd->thj", q.float(), k_sel)
    if relu:
        s = s.relu()
    out = torch.einsum("thj,th->tj", s, w.float())
    return out.masked_fill(~valid, NEG_INF)


def _rows(per_row_elems: int, budget_elems: int = 1 << 24) -> int:
    return max(1, min(4096, budget_elems // max(1, per_row_elems)))


def _tp_all_reduce(x: torch.Tensor, tp_group) -> torch.Tensor:
    if tp_group is not None and torch.distributed.is_initialized() and tp_group.size() > 1:
        x = x.contiguous()
        torch.distributed.all_reduce(x, group=tp_group)
    return x


def _masked_probs(logits: torch.Tensor, valid: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim restricted to ``valid`` (zeros elsewhere and on empty rows)."""
    logits = logits.masked_fill(~valid, NEG_INF)
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(logits - lse[..., None])


def _masked_log_softmax(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log-softmax over ``valid`` entries, 0 elsewhere; rows with no valid entry are all 0."""
    safe = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
    safe = torch.where(valid.any(dim=-1, keepdim=True), safe, torch.zeros_like(safe))
    return torch.log_softmax(safe, dim=-1).masked_fill(~valid, 0.0)


def _target(probs_heads: torch.Tensor, tp_group) -> torch.Tensor:
    """[R, N, K] head probabilities -> L1-normalised head-sum [R, K]."""
    t = _tp_all_reduce(probs_heads.sum(dim=1), tp_group)
    return t / t.sum(dim=-1, keepdim=True).clamp_min(EPS)


def _kl_rows(target: torch.Tensor, log_predict: torch.Tensor, row_mask: torch.Tensor | None) -> torch.Tensor:
    kl = (target * (torch.log(target.clamp_min(EPS)) - log_predict)).sum(dim=-1)
    return kl if row_mask is None else kl * row_mask


def _reduce(kl_sum, T: int, query_valid_rows, calculate_per_token_loss: bool, loss_coeff: float):
    if calculate_per_token_loss:
        return kl_sum * loss_coeff
    if query_valid_rows is not None:
        n = query_valid_rows.to(torch.float32).sum().clamp_min(1.0)
    else:
        n = float(max(T, 1))
    return kl_sum / n * loss_coeff


def _row_mask(query_valid_rows, T: int, device):
    if query_valid_rows is None:
        return None
    m = query_valid_rows.reshape(-1).to(device=device, dtype=torch.float32)
    if m.numel() != T:
        raise ValueError(f"query_valid_rows must have {T} entries, got {m.numel()}")
    return m


# ---------------------------------------------------------------------------------------------
# sparse stage
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def sparse_indexer_target(query, kv, indices, softmax_scale: float, lse=None, tp_group=None) -> torch.Tensor:
    """Normalised head-summed attention probabilities over the selected keys, fp32 [R, topk]."""
    valid = indices >= 0
    kv_sel = kv.float()[indices.long().clamp(min=0)]  # [R, topk, Dqk]
    logits = torch.bmm(query.float(), kv_sel.transpose(1, 2)) * softmax_scale  # [R, N, topk]
    probs = _masked_probs(logits, valid[:, None, :], None if lse is None else lse.float())
    return _target(probs, tp_group)


def _sparse_kl_chunk(q_idx, w, k_idx, indices, target, row_mask, relu: bool):
    scores = selected_scores_reference(q_idx, w, k_idx, indices, relu)  # [R, topk], -inf at padding
    return _kl_rows(target, _masked_log_softmax(scores, indices >= 0), row_mask).sum()


def sparse_indexer_loss_reference(
    q_idx: torch.Tensor,
    w: torch.Tensor,
    k_idx: torch.Tensor,
    query: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    loss_coeff: float,
    relu: bool = True,
    lse: torch.Tensor | None = None,
    query_valid_rows: torch.Tensor | None = None,
    calculate_per_token_loss: bool = False,
    tp_group=None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Sparse-stage indexer KL loss over the selected keys; scalar fp32.

    Args:
        q_idx [T, H_I, D_I], w [T, H_I], k_idx [S, D_I]: indexer tensors (get gradients).
        query [T, N, Dqk], kv [S, Dqk]: attention query / shared latent key (detached).
        indices [T, topk] int: selected keys, -1 padded. lse [T, N] fp32: optional attention LSE
        over the selected keys (natural log); recomputed when None.
        query_valid_rows [T] bool: rows that count (None = all). tp_group: heads are sharded
        over it; the head-sum is all-reduced when its size > 1.
    """
    T, topk = indices.shape
    query, kv = query.detach(), kv.detach()
    row_mask = _row_mask(query_valid_rows, T, q_idx.device)
    rows = chunk_rows or _rows(topk * (query.shape[1] + q_idx.shape[1] + kv.shape[1] // 8))
    track = torch.is_grad_enabled() and any(t.requires_grad for t in (q_idx, w, k_idx))
    total = torch.zeros((), dtype=torch.float32, device=q_idx.device)
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        tgt = sparse_indexer_target(query[r0:r1], kv, indices[r0:r1], softmax_scale,
                                    None if lse is None else lse[r0:r1], tp_group)
        args = (q_idx[r0:r1], w[r0:r1], k_idx, indices[r0:r1], tgt,
                None if row_mask is None else row_mask[r0:r1], relu)
        total = total + (checkpoint(_sparse_kl_chunk, *args, use_reentrant=False) if track
                         else _sparse_kl_chunk(*args))
    return _reduce(total, T, query_valid_rows, calculate_per_token_loss, loss_coeff)


# ---------------------------------------------------------------------------------------------
# dense (warm-up) stage
# ---------------------------------------------------------------------------------------------
def _dense_kl_chunk(q_idx, w, k_idx, query, kv, starts, ends, row_mask, softmax_scale, relu, tp_group):
    cols = torch.arange(kv.shape[0], device=kv.device)
    valid = (cols[None, :] >= starts[:, None].long()) & (cols[None, :] < ends[:, None].long())  # [R, S]
    with torch.no_grad():  # target: recomputed here in backward rather than stored ([T, S] overall)
        logits = torch.einsum("rnd,sd->rns", query.float(), kv.float()) * softmax_scale
        target = _target(_masked_probs(logits, valid[:, None, :]), tp_group)
        del logits
    scores = index_scores_reference(q_idx, w, k_idx, relu)  # [R, S]
    return _kl_rows(target, _masked_log_softmax(scores, valid), row_mask).sum()


def dense_indexer_loss_reference(
    q_idx: torch.Tensor,
    w: torch.Tensor,
    k_idx: torch.Tensor,
    query: torch.Tensor,
    kv: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    softmax_scale: float,
    loss_coeff: float,
    relu: bool = True,
    query_valid_rows: torch.Tensor | None = None,
    calculate_per_token_loss: bool = False,
    tp_group=None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Dense-stage (warm-up) indexer KL loss over every visible key; scalar fp32.

    Same tensors as :func:`sparse_indexer_loss_reference`, with the visible keys of row t given
    by int bounds ``starts[t] <= s < ends[t]`` (causal: starts = 0, ends = t + 1).
    """
    T, S = q_idx.shape[0], kv.shape[0]
    query, kv = query.detach(), kv.detach()
    row_mask = _row_mask(query_valid_rows, T, q_idx.device)
    rows = chunk_rows or _rows(S * (query.shape[1] + 2 * q_idx.shape[1] + 6))
    track = torch.is_grad_enabled() and any(t.requires_grad for t in (q_idx, w, k_idx))
    total = torch.zeros((), dtype=torch.float32, device=q_idx.device)
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        args = (q_idx[r0:r1], w[r0:r1], k_idx, query[r0:r1], kv, starts[r0:r1], ends[r0:r1],
                None if row_mask is None else row_mask[r0:r1], softmax_scale, relu, tp_group)
        total = total + (checkpoint(_dense_kl_chunk, *args, use_reentrant=False) if track
                         else _dense_kl_chunk(*args))
    return _reduce(total, T, query_valid_rows, calculate_per_token_loss, loss_coeff)
