"""The public sparse MLA op: input checks, the autograd Function, and the kernel-or-reference choice."""

from __future__ import annotations

import torch

from .._common import check, check_tensor, use_triton
from .kernel import sparse_mla_bwd, sparse_mla_fwd
from .reference import sparse_mla_reference

MAX_TOPK = 2048
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class SparseMLAFunction(torch.autograd.Function):
    """out, lse = f(q, kv); gradients to q and kv.

    ``target_link`` / ``dep`` serve the deferred indexer loss (``indexer_loss.deferred``): the backward
    hands the loss target to ``target_link.put``, and ``dep`` (the deferred loss) is an input so that
    autograd runs the loss's backward after this one.
    """

    @staticmethod
    def forward(ctx, q, kv, indices, softmax_scale, v_dim, deterministic, dq_over_q, target_link=None, dep=None):
        out, lse = sparse_mla_fwd(q, kv, indices, softmax_scale, v_dim)
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.softmax_scale, ctx.v_dim, ctx.deterministic, ctx.dq_over_q = softmax_scale, v_dim, deterministic, dq_over_q
        ctx.target_link = target_link
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, kv, indices, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        link, ctx.target_link = ctx.target_link, None
        target = None if link is None else torch.empty(indices.shape, dtype=torch.float32, device=q.device)
        dq, dkv = sparse_mla_bwd(q, kv, indices, out, lse, dout, dlse, ctx.softmax_scale, ctx.v_dim,
                                 deterministic=ctx.deterministic, dq_over_q=ctx.dq_over_q, target=target)
        if link is not None:
            link.put(target)
        n_in = len(ctx.needs_input_grad)  # 7 from sparse_mla, 9 with target_link / dep
        d_dep = torch.zeros((), dtype=torch.float32, device=q.device) if n_in > 8 and ctx.needs_input_grad[8] else None
        return (dq, dkv.to(kv.dtype), None, None, None, None, None, None, d_dep)[:n_in]


def check_inputs(q, kv, indices, softmax_scale, v_dim, check_index_range: bool) -> None:
    """TypeError / ValueError naming the problem with sparse_mla's inputs."""
    check_tensor("q", q, 3, FLOATS)
    T, N, dqk = q.shape
    check_tensor("kv", kv, 2, (q.dtype,), device=q.device)
    check_tensor("indices", indices, 2, (torch.int32, torch.int64), device=q.device)
    check(kv.shape[1] == dqk, f"kv must be [S, {dqk}] (the shared latent key), got {tuple(kv.shape)}")
    check(indices.shape[0] == T, f"indices must be [{T}, topk], got {tuple(indices.shape)}")
    topk = indices.shape[1]
    check(1 <= topk <= MAX_TOPK, f"topk must be in [1, {MAX_TOPK}], got {topk}")
    check(N >= 1, "q needs at least one head")
    check(0 < v_dim <= dqk, f"v_dim must be in (0, {dqk}], got {v_dim}")
    check(isinstance(softmax_scale, (int, float)) and softmax_scale > 0,
          f"softmax_scale must be a positive float, got {softmax_scale!r}")
    if check_index_range and indices.numel():
        lo, hi = (int(x) for x in torch.aminmax(indices))
        check(lo >= -1 and hi < kv.shape[0],
              f"indices must be in [-1, {kv.shape[0]}) (-1 = padding), got [{lo}, {hi}]")


def sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    v_dim: int = 512,
    deterministic: bool = False,
    check_index_range: bool = True,
    dq_over_q: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA sparse attention over selected keys; differentiable in ``q`` and ``kv``.

    Args:
        q: [T, N, Dqk] bf16 / fp16 / fp32 queries (Dqk = 576 = 512 latent + 64 rope in
            production; N = heads on this rank, any count).
        kv: [S, Dqk] shared latent key, same dtype/device as q; its first ``v_dim`` columns are
            the value.
        indices: [T, topk] int32 / int64, 1 <= topk <= 2048: the key rows each token attends to,
            -1 = padding (anywhere in the row). Each row lists a key at most once.
        softmax_scale: multiplier of q . k inside the softmax (python float).
        v_dim: value width (default 512).
        deterministic: reduce the kv gradient in a fixed order (sorted segmented sum over a
            bounded buffer) instead of fp32 atomics (default: atomics, faster).
        check_index_range: verify -1 <= indices < S (one device sync); disable in hot loops
            once the producer is trusted.
        dq_over_q: the backward writes dq into q's storage (q's values are then lost): only for a
            caller that reads q nowhere after this op's backward (the HyScale layer's own query).
            Saves one [T, N, Dqk] buffer.
    Returns:
        out: [T, N, v_dim] in q's dtype (fp32 accumulation); zeros for rows without a valid key.
        lse: [T, N] fp32 natural-log sum-exp of the scaled logits over the valid selected keys;
            -inf for rows without a valid key.

    On CUDA (and on CPU under TRITON_INTERPRET=1) this runs the Triton kernels; on a plain CPU
    it runs the chunked PyTorch reference (logged once).
    """
    check_inputs(q, kv, indices, softmax_scale, v_dim, check_index_range)
    if not use_triton("sparse_mla", q):
        return sparse_mla_reference(q, kv, indices, float(softmax_scale), v_dim=v_dim)
    return SparseMLAFunction.apply(q.contiguous(), kv.contiguous(), indices.contiguous(), float(softmax_scale), v_dim,
                                   bool(deterministic), bool(dq_over_q))
