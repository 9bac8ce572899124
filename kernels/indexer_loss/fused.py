"""Sparse-stage indexer KL loss with its target computed in the forward: target kernel + selected scores.

Same value and gradients as ``reference.sparse_indexer_loss_reference`` (the spec):

    target  = normalise_L1( sum_h P_attn[t, h, idx[t, j]] )      (no grad; Triton, one QK pass)
    predict = log_softmax_j( I[t, idx[t, j]] )                   (grad to q_idx, w, k_idx; Triton)
    loss    = coeff * sum_t KL(target_t || predict_t) / rows

Nothing larger than O(T * topk) is materialised (plus the kernels' tiles). On the kernel path
(CUDA, or CPU under TRITON_INTERPRET=1) at most two [T, topk] fp32 tensors are alive at once:
the raw target and the selected scores. The KL and its row reductions are one Triton kernel
(``kl.py``) with the normalisation fused in; the backward keeps only the score gradient.

The HyScale layer uses this path when the attention inputs it is given are not its forward's own
(the deferred loss, ``deferred.py``, needs the attention's backward); on a plain CPU it runs the
PyTorch reference.
"""

from __future__ import annotations

import torch

from .._common import use_triton
from .kl import sparse_kl
from .reference import _reduce, _row_mask, _tp_all_reduce, sparse_indexer_loss_reference
from .target import sparse_attention_target


def sparse_indexer_loss(q_idx, w, k_idx, query, kv, indices, softmax_scale: float, loss_coeff: float,
                        relu: bool = True, lse=None, query_valid_rows=None, calculate_per_token_loss: bool = False,
                        tp_group=None, v_dim: int = 512, deterministic: bool = False,
                        dq_over_q_idx: bool = False) -> torch.Tensor:
    """Scalar fp32 loss. Shapes as in the reference: q_idx [T, H_I, D_I], w [T, H_I], k_idx [S, D_I],
    query [T, N, Dqk], kv [S, Dqk], indices [T, topk], lse [T, N] fp32 (computed when None).
    ``dq_over_q_idx``: as in ``kl.sparse_kl`` (q_idx private to this loss; kernel path only)."""
    if not use_triton("sparse_indexer_loss", q_idx):
        return sparse_indexer_loss_reference(q_idx, w, k_idx, query, kv, indices, softmax_scale, loss_coeff, relu=relu,
                                             lse=lse, query_valid_rows=query_valid_rows,
                                             calculate_per_token_loss=calculate_per_token_loss, tp_group=tp_group)
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
    kl = sparse_kl(q_idx, w, k_idx, indices, target, row_mask, relu=relu, deterministic=deterministic,
                   dq_over_q_idx=dq_over_q_idx)
    return _reduce(kl.sum(), T, query_valid_rows, calculate_per_token_loss, loss_coeff)
