"""Sparse attention with the sparse-stage indexer loss whose target comes from the attention backward.

The loss target is sum_h P[t, h, idx[t, j]], the head-summed attention probabilities at the selected
keys. The forward path (``fused.sparse_indexer_loss``) recomputes them with one more QK pass over the
selected keys (``target.py``: ~2/3 of the loss path at 64K tokens, 128 heads). But the attention's
backward computes exactly these P (from the saved LSE) for its own gradient and stores them for its dkv
kernel, which here also sums them over heads into the target; the KL runs after it, inside the backward:

    forward:   loss = _DeferredSparseKL(q_idx, w, k_idx)               saves its inputs; value 0 (placeholder)
               out, lse = SparseMLAFunction(q, kv, idx, ..., dep=loss)  the loss is an input: its backward waits
    backward:  SparseMLAFunction: dq, dkv and the raw target (TargetLink.put)
               _DeferredSparseKL: target (TP all-reduced) -> selected scores -> KL rows -> value to
                                  ``on_value``; gradients to q_idx, w, k_idx as in ``kl.SparseKLFunction``

Same gradients as ``sparse_mla`` + ``sparse_indexer_loss`` up to the target's precision (fp32 head sums of
the stored P: exact in fp32 runs, bf16-rounded P in bf16 runs), one QK pass less. The price: the loss
*value* exists only in the backward. The returned ``loss`` is a 0-valued fp32 scalar that carries the gradient (its
``d loss`` scales the KL's gradient as usual); the true value, sum_t row_mask[t] * KL_t, is passed to
``on_value`` when the backward has computed it (the HyScale layer adds it to Megatron's indexer-loss
tracker there, so logged values are unchanged; see docs/sparse_mla.md).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .._common import check, check_tensor, use_triton
from ..sparse_mla.op import SparseMLAFunction, check_inputs
from .kl import kl_rows, kl_score_backward
from .reference import _tp_all_reduce
from .selected_scores import selected_scores_fwd


class TargetLink:
    """One-shot mailbox: the attention backward puts the raw target, the deferred KL backward takes it."""

    def __init__(self):
        self._target: Optional[torch.Tensor] = None

    def put(self, target: torch.Tensor) -> None:
        self._target = target

    def take(self) -> torch.Tensor:
        t, self._target = self._target, None
        if t is None:
            raise RuntimeError(
                "sparse_mla_with_indexer_loss: the loss's backward ran before (or without) the attention's: its "
                "target comes from the attention backward. Backpropagate through the attention output as well "
                "(e.g. (out.sum() + loss).backward(), or Megatron's DSAIndexerLossAutoScaler).")
        return t


class _DeferredSparseKL(torch.autograd.Function):
    """Placeholder loss in the forward; the KL value and the indexer gradients in the backward."""

    @staticmethod
    def forward(ctx, q, w, k, indices, row_mask, relu, deterministic, link, tp_group, on_value, tp_split_rows,
                dq_over_q):
        ctx.save_for_backward(q, w, k, indices, row_mask if row_mask is not None else indices.new_empty(0))
        ctx.relu, ctx.deterministic, ctx.has_mask = relu, deterministic, row_mask is not None
        ctx.link, ctx.tp_group, ctx.on_value = link, tp_group, on_value
        ctx.tp_split_rows, ctx.dq_over_q = tp_split_rows, dq_over_q
        return torch.zeros((), dtype=torch.float32, device=q.device)

    @staticmethod
    def backward(ctx, g):
        if ctx.link is None:
            raise RuntimeError("sparse_mla_with_indexer_loss: backward through the same graph twice (retain_graph) "
                               "is not supported")
        link, ctx.link = ctx.link, None
        q, w, k, indices, row_mask = ctx.saved_tensors
        target = _tp_all_reduce(link.take(), ctx.tp_group)  # heads sharded over TP: sum the partial head sums
        if ctx.tp_split_rows and _group_size(ctx.tp_group) > 1:
            dq, dw, dk = _split_rows_backward(ctx, g, q, w, k, indices, row_mask, target)
            return dq, dw, dk, None, None, None, None, None, None, None, None, None
        scores = selected_scores_fwd(q, w, k, indices, ctx.relu)  # [T, topk] fp32
        kl, _, _ = kl_rows(target, scores, indices, row_mask if ctx.has_mask else None, grad_out=scores)
        del target
        if ctx.on_value is not None:
            ctx.on_value(kl.sum().detach())  # kl rows are already row-masked
        coef = g.float().reshape(1, 1)
        if ctx.has_mask:
            coef = coef * row_mask.float().reshape(-1, 1)
        dq, dw, dk = kl_score_backward(q, w, k, indices, scores, coef, ctx.relu, ctx.deterministic,
                                       dq_over_q=ctx.dq_over_q)
        return dq, dw, dk, None, None, None, None, None, None, None, None, None


def _group_size(group) -> int:
    return group.size() if group is not None and torch.distributed.is_initialized() else 1


def _split_rows_backward(ctx, g, q, w, k, indices, row_mask, target):
    """tp_split_rows: every TP rank holds the whole (duplicated) indexer input and the all-reduced target, but
    computes the KL and the indexer backward of its own ceil(T / tp) rows only; the loss value is summed over
    the ranks, dk (fp32) all-reduced, dq / dw rows all-gathered, so every rank returns the full gradients
    (equal on all ranks, as the duplicated indexer's parameters expect). Per-rank work 1 / tp of the loss."""
    group = ctx.tp_group
    rank, size = torch.distributed.get_rank(group), group.size()
    T = q.shape[0]
    chunk = -(-T // size)
    r0, r1 = min(T, rank * chunk), min(T, (rank + 1) * chunk)
    rows = slice(r0, r1)
    q_s, w_s, idx_s = q[rows].contiguous(), w[rows].contiguous(), indices[rows].contiguous()
    mask_s = row_mask[rows] if ctx.has_mask else None
    value = torch.zeros((), dtype=torch.float32, device=q.device)
    if r1 > r0:
        scores = selected_scores_fwd(q_s, w_s, k, idx_s, ctx.relu)  # [rows, topk] fp32
        kl, _, _ = kl_rows(target[rows].contiguous(), scores, idx_s, mask_s, grad_out=scores)
        value = kl.sum().detach().float()
        coef = g.float().reshape(1, 1)
        if ctx.has_mask:
            coef = coef * mask_s.float().reshape(-1, 1)
        dq_s, dw_s, dk = kl_score_backward(q_s, w_s, k, idx_s, scores, coef, ctx.relu, ctx.deterministic,
                                               dk_fp32=True)
    else:  # fewer rows than ranks
        dq_s, dw_s = q_s.new_zeros(q_s.shape), w_s.new_zeros(w_s.shape)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    del target
    torch.distributed.all_reduce(value, group=group)
    if ctx.on_value is not None:
        ctx.on_value(value)  # kl rows are already row-masked
    torch.distributed.all_reduce(dk, group=group)  # fp32 partial sums of the ranks' rows
    return _gather_rows(dq_s, T, chunk, group), _gather_rows(dw_s, T, chunk, group), dk.to(k.dtype)


def _gather_rows(x: torch.Tensor, T: int, chunk: int, group) -> torch.Tensor:
    """The ranks' row slices (each <= chunk rows) concatenated in rank order: [T, ...]."""
    pad = x.new_zeros((chunk,) + tuple(x.shape[1:]))
    pad[: x.shape[0]] = x
    parts = [torch.empty_like(pad) for _ in range(group.size())]
    torch.distributed.all_gather(parts, pad, group=group)
    return torch.cat(parts)[:T]


def sparse_mla_with_indexer_loss(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    q_idx: torch.Tensor,
    w: torch.Tensor,
    k_idx: torch.Tensor,
    v_dim: int = 512,
    relu: bool = True,
    row_mask: Optional[torch.Tensor] = None,
    tp_group=None,
    on_value: Optional[Callable[[torch.Tensor], None]] = None,
    deterministic: bool = False,
    dq_over_q: bool = False,
    check_index_range: bool = True,
    tp_split_rows: bool = False,
    dq_over_q_idx: bool = False,
):
    """Sparse MLA attention and the sparse-stage indexer KL loss, its target taken from the attention backward.

    Args:
        q: [T, N, Dqk] bf16 / fp16 / fp32 attention queries; kv: [S, Dqk] latent key (same dtype); indices:
            [T, topk] int32 / int64, -1 padded -- as in ``sparse_mla`` (differentiable in q and kv).
        softmax_scale, v_dim, deterministic, dq_over_q, check_index_range: as in ``sparse_mla``.
        q_idx: [T, H_I, D_I], w: [T, H_I], k_idx: [S, D_I] the indexer's queries, head weights, keys
            (bf16 / fp32; differentiable), scored as in ``selected_scores`` (``relu``: ReLU activation).
        row_mask: optional [T] (bool / float) weight of each row's KL (padding rows 0).
        tp_group: process group over which heads are sharded (the target is all-reduced), or None.
        tp_split_rows: with a tp_group of more than one rank, each rank computes the KL and the indexer
            backward of 1 / tp of the rows (the indexer is duplicated over TP) and the gradients are
            gathered / summed over the group: every rank gets the full, equal gradients and loss value.
        on_value: called once in the backward with the loss value, fp32 0-d tensor
            sum_t row_mask[t] * KL(normalise(target_t) || softmax(scores_t)).
        dq_over_q_idx: the loss backward writes q_idx's gradient into the storage of the q_idx it saved:
            only when that tensor is private to this loss (hyscale_megatron.indexer_recompute recomputes it
            for this backward alone). Ignored with tp_split_rows over several ranks (row slices are copies).
    Returns:
        out [T, N, v_dim] (q's dtype), lse [T, N] fp32, as ``sparse_mla``; loss: fp32 0-d tensor, value 0 in
        the forward, whose gradient g gives the indexer the gradient of g * (the value above).
    On CPU tensors without TRITON_INTERPRET=1 it runs the PyTorch references (``sparse_mla_reference`` and
    ``sparse_indexer_loss_reference``) with the same contract, except that ``on_value`` is called in the forward.
    """
    check_inputs(q, kv, indices, softmax_scale, v_dim, check_index_range)
    T = q.shape[0]
    check_tensor("q_idx", q_idx, 3, (torch.bfloat16, torch.float16, torch.float32), device=q.device)
    check(q_idx.shape[0] == T, f"q_idx must have {T} rows (one per attention query), got {tuple(q_idx.shape)}")
    check(tuple(w.shape) == tuple(q_idx.shape[:2]), f"w must be {tuple(q_idx.shape[:2])}, got {tuple(w.shape)}")
    check(k_idx.dim() == 2 and k_idx.shape[0] == kv.shape[0] and k_idx.shape[1] == q_idx.shape[2],
          f"k_idx must be [{kv.shape[0]}, {q_idx.shape[2]}] (one indexer key per latent key), got {tuple(k_idx.shape)}")
    if row_mask is not None:
        check(tuple(row_mask.shape) == (T,) and row_mask.device == q.device,
              f"row_mask must be [{T}] on {q.device}, got {tuple(row_mask.shape)} on {row_mask.device}")
    if not use_triton("sparse_mla_with_indexer_loss", q):
        return _reference(q, kv, indices, softmax_scale, q_idx, w, k_idx, v_dim, relu, row_mask, tp_group, on_value)
    link = TargetLink()
    indices = indices.contiguous()
    loss = _DeferredSparseKL.apply(q_idx.contiguous(), w.contiguous(), k_idx.contiguous(), indices,
                                   None if row_mask is None else row_mask.contiguous(), bool(relu),
                                   bool(deterministic), link, tp_group, on_value, bool(tp_split_rows),
                                   bool(dq_over_q_idx))
    out, lse = SparseMLAFunction.apply(q.contiguous(), kv.contiguous(), indices, float(softmax_scale), v_dim,
                                       bool(deterministic), bool(dq_over_q), link, loss)
    return out, lse, loss


def _reference(q, kv, indices, softmax_scale, q_idx, w, k_idx, v_dim, relu, row_mask, tp_group, on_value):
    """The op's spec in PyTorch: the attention, then the KL against its probabilities; the returned loss is
    value - value.detach() (0 in the forward, the value's gradient in the backward), as the kernel path's."""
    from ..sparse_mla.reference import sparse_mla_reference  # noqa: PLC0415
    from .reference import sparse_indexer_loss_reference  # noqa: PLC0415

    out, lse = sparse_mla_reference(q, kv, indices, softmax_scale, v_dim=v_dim)
    value = sparse_indexer_loss_reference(q_idx, w, k_idx, q, kv, indices, softmax_scale, 1.0, relu=relu,
                                          lse=lse.detach(), query_valid_rows=row_mask, calculate_per_token_loss=True,
                                          tp_group=tp_group)
    if on_value is not None:
        on_value(value.detach())
    return out, lse, value - value.detach()
