"""Sparse-stage indexer KL loss from kernels: selected scores + the attention's own LSE.

Same value and gradients as ``reference.sparse_indexer_loss_reference`` (the spec):

    target  = normalise_L1( sum_h P_attn[t, h, idx[t, j]] )      (no grad; Triton, one QK pass)
    predict = log_softmax_j( I[t, idx[t, j]] )                   (grad to q_idx, w, k_idx; Triton)
    loss    = coeff * sum_t KL(target_t || predict_t) / rows

Nothing larger than O(T * topk) is materialised (plus the kernels' tiles). On the kernel path
(CUDA, or CPU under TRITON_INTERPRET=1) at most two [T, topk] fp32 tensors are alive at once:
the raw target and the selected scores. The KL and its row reductions are one Triton kernel
(``kl.py``), the normalisation is fused into it, and the score gradient is recomputed per slot
inside the selected-scores backward kernel instead of being stored.
"""

from __future__ import annotations

import torch

import os

from ..hytopk.selected_scores import selected_scores
from .kl import sparse_kl
from .reference import _kl_rows, _masked_log_softmax, _reduce, _row_mask, _tp_all_reduce, EPS
from .target import sparse_attention_target


def sparse_indexer_loss(q_idx, w, k_idx, query, kv, indices, softmax_scale: float, loss_coeff: float,
                        relu: bool = True, lse=None, query_valid_rows=None, calculate_per_token_loss: bool = False,
                        tp_group=None, v_dim: int = 512, deterministic: bool = False) -> torch.Tensor:
    """Scalar fp32 loss. Shapes as in the reference: q_idx [T, H_I, D_I], w [T, H_I], k_idx [S, D_I],
    query [T, N, Dqk], kv [S, Dqk], indices [T, topk], lse [T, N] fp32 (computed when None)."""
    query, kv = query.detach(), kv.detach()
    T = indices.shape[0]
    if lse is None:
        from ..sparse_mla import sparse_mla  # noqa: PLC0415

        with torch.no_grad():
            _, lse = sparse_mla(query, kv, indices, softmax_scale, v_dim=v_dim)
    with torch.no_grad():
        target = _tp_all_reduce(sparse_attention_target(query, kv, indices, lse.detach().float(), softmax_scale,
                                                        v_dim=v_dim), tp_group)  # raw (unnormalised)
    row_mask = _row_mask(query_valid_rows, T, q_idx.device)
    if q_idx.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        kl = sparse_kl(q_idx, w, k_idx, indices, target, row_mask, relu=relu, deterministic=deterministic)
        return _reduce(kl.sum(), T, query_valid_rows, calculate_per_token_loss, loss_coeff)
    with torch.no_grad():
        target = target / target.sum(dim=-1, keepdim=True).clamp_min(EPS)
    scores = selected_scores(q_idx, w, k_idx, indices, relu=relu, deterministic=deterministic)
    kl = _kl_rows(target, _masked_log_softmax(scores, indices >= 0), row_mask)
    return _reduce(kl.sum(), T, query_valid_rows, calculate_per_token_loss, loss_coeff)
