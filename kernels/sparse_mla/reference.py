"""Plain-PyTorch specification of absorbed-MLA sparse attention over given key indices.

Absorbed MLA (DeepSeek-V3.2 DSA): every head attends with its own query to one shared latent
key row per token, and the value is the first ``v_dim`` columns of that same row:

    logit[t, h, j] = softmax_scale * q[t, h, :] . kv[indices[t, j], :]        (valid j only)
    lse[t, h]      = log sum_j exp(logit[t, h, j])
    out[t, h, :]   = sum_j exp(logit[t, h, j] - lse[t, h]) * kv[indices[t, j], :v_dim]

A slot ``indices[t, j] == -1`` is padding and contributes nothing. A row with no valid slot
gets ``out = 0`` and ``lse = -inf``. Indices are not de-duplicated: the contract is that a row
lists each key at most once (a duplicate would simply count twice).

Everything is computed in fp32 and chunked over query rows: memory is O(T * topk) plus one
bounded [rows, topk, Dqk] chunk. Under autograd each chunk is checkpointed, so the backward
recomputes it instead of keeping every chunk's gathered keys alive.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

NEG_INF = float("-inf")


def _chunk_rows(topk: int, dqk: int, n_heads: int, budget_elems: int = 1 << 24) -> int:
    """Rows per chunk so the gathered keys [rows, topk, Dqk] and logits [rows, N, topk] fit."""
    per_row = max(1, topk * (dqk + 2 * n_heads))
    return max(1, min(4096, budget_elems // per_row))


def _sparse_mla_chunk(q, kv, indices, softmax_scale: float, v_dim: int):
    """One chunk of rows: q [R, N, Dqk], kv [S, Dqk], indices [R, topk] -> fp32 out, lse."""
    valid = indices >= 0  # [R, topk]
    kv_sel = kv.float()[indices.long().clamp(min=0)]  # [R, topk, Dqk]
    logits = torch.bmm(q.float(), kv_sel.transpose(1, 2)) * softmax_scale  # [R, N, topk]
    logits = logits.masked_fill(~valid[:, None, :], NEG_INF)
    # Hand-rolled logsumexp: rows with no valid slot must give -inf without NaN gradients.
    empty = ~valid.any(dim=-1)[:, None]  # [R, 1]
    m = logits.amax(dim=-1).detach()  # [R, N]; the shift cancels, so no gradient is lost
    m = torch.where(empty, torch.zeros_like(m), m)
    sumexp = torch.exp(logits - m[..., None]).sum(dim=-1)  # >= 1 on non-empty rows
    safe_lse = m + torch.log(sumexp.clamp_min(1e-30))
    probs = torch.exp(logits - safe_lse[..., None])  # exp(-inf) = 0 at padding
    out = torch.bmm(probs, kv_sel[..., :v_dim])  # [R, N, v_dim]
    lse = safe_lse.masked_fill(empty, NEG_INF)
    return out, lse


def sparse_mla_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    v_dim: int = 512,
    chunk_rows: int | None = None,
):
    """Sparse absorbed-MLA attention, the executable spec.

    Args:
        q: [T, N, Dqk] queries (any float dtype; Dqk = 576 = 512 latent + 64 rope in production).
        kv: [S, Dqk] shared latent key; its first ``v_dim`` columns are the value.
        indices: [T, topk] int32/int64 key rows per query, -1 = padding, no duplicates.
        softmax_scale: multiplier of q . k before the softmax.
        v_dim: value width (<= Dqk).
        chunk_rows: query rows per chunk (default: a ~64 MiB working set).
    Returns:
        out [T, N, v_dim] in q's dtype, lse [T, N] fp32 (natural log; -inf for empty rows).
        Differentiable in q and kv.
    """
    T, N, dqk = q.shape
    if kv.dim() != 2 or kv.shape[1] != dqk:
        raise ValueError(f"kv must be [S, {dqk}], got {tuple(kv.shape)}")
    if indices.dim() != 2 or indices.shape[0] != T:
        raise ValueError(f"indices must be [{T}, topk], got {tuple(indices.shape)}")
    if not 0 < v_dim <= dqk:
        raise ValueError(f"v_dim must be in (0, {dqk}], got {v_dim}")
    rows = chunk_rows or _chunk_rows(indices.shape[1], dqk, N)
    track = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
    outs, lses = [], []
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        args = (q[r0:r1], kv, indices[r0:r1], softmax_scale, v_dim)
        if track:  # recompute the chunk in backward: keeps saved memory O(T * topk)
            o, l = checkpoint(_sparse_mla_chunk, *args, use_reentrant=False)
        else:
            o, l = _sparse_mla_chunk(*args)
        outs.append(o.to(q.dtype))
        lses.append(l)
    if not outs:
        return q.new_zeros(0, N, v_dim), torch.zeros(0, N, dtype=torch.float32, device=q.device)
    return torch.cat(outs), torch.cat(lses)
