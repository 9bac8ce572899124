"""Sparse absorbed-MLA attention over top-k key indices (forward + backward).

``sparse_mla`` is the public op; ``reference.sparse_mla_reference`` is its executable spec.
"""

from __future__ import annotations

import logging
import os

import torch

from .._common import check, check_tensor
from .reference import sparse_mla_reference
from .kernel import check_bwd_variant, flops, sparse_mla_bwd, sparse_mla_fwd

__all__ = ["sparse_mla", "sparse_mla_reference", "flops"]

_log = logging.getLogger("hyscale_kernels")
_logged_fallback = False
MAX_TOPK = 2048
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class _SparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, softmax_scale, v_dim, deterministic, dq_over_q, bwd_variant, bwd_chunk_tokens,
                target_link=None, dep=None):
        # target_link / dep: see hyscale_kernels.indexer_loss.deferred (the backward also hands the loss target
        # to target_link.put; dep, the deferred loss, makes that loss's backward wait for this one)
        out, lse = sparse_mla_fwd(q, kv, indices, softmax_scale, v_dim)
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.softmax_scale, ctx.v_dim, ctx.deterministic = softmax_scale, v_dim, deterministic
        ctx.dq_over_q = dq_over_q
        ctx.bwd = dict(variant=bwd_variant, chunk_tokens=bwd_chunk_tokens) if bwd_variant is not None else {}
        ctx.target_link = target_link
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, kv, indices, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        link, ctx.target_link = ctx.target_link, None
        target = None if link is None else torch.empty(indices.shape, dtype=torch.float32, device=q.device)
        dq, dkv = sparse_mla_bwd(q, kv, indices, out, lse, dout, dlse, ctx.softmax_scale, ctx.v_dim,
                                 deterministic=ctx.deterministic, dq_over_q=ctx.dq_over_q, target=target, **ctx.bwd)
        if link is not None:
            link.put(target)
        n_in = len(ctx.needs_input_grad)  # 9 from sparse_mla, 11 with target_link / dep
        d_dep = torch.zeros((), dtype=torch.float32, device=q.device) if n_in > 10 and ctx.needs_input_grad[10] else None
        return (dq, dkv.to(kv.dtype), None, None, None, None, None, None, None, None, d_dep)[:n_in]


def _validate(q, kv, indices, softmax_scale, v_dim, check_index_range):
    check_tensor("q", q, 3, _FLOATS)
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
    bwd_variant: str | None = None,
    bwd_chunk_tokens: int | None = None,
):
    """Absorbed-MLA sparse attention over selected keys; differentiable in ``q`` and ``kv``.

    Args:
        q: [T, N, Dqk] bf16 / fp16 / fp32 queries (Dqk = 576 = 512 latent + 64 rope in
            production; N = heads on this rank, 8..128 typical, any count works).
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
        dq_over_q: the backward may write dq into q's storage (q's values are then lost): only for a
            caller that reads q nowhere after this op's backward (the HyScale layer's own query). Saves
            one [T, N, Dqk] buffer on the scratch (default) and fused backwards; ignored by "split".
        bwd_variant: None / "scratch" (default): the dq kernel also stores P and dS for a chunk of
            tokens and a dkv kernel contracts them over heads without recomputing the logits; "split"
            (dkv kernel recomputes them) or "fused" (one kernel, dkv atomics per head block), slower on
            the H200 at N = 16 / 64 / 128 (``kernel.sparse_mla_bwd``, bench/results/sparse_bwd_parts.csv).
        bwd_chunk_tokens: tokens per chunk of the "scratch" backward (default: P + dS within
            ``kernel.SCRATCH_BYTES`` = 256 MiB, i.e. 256 tokens at N = 128, k = 2048, bf16).
    Returns:
        out: [T, N, v_dim] in q's dtype (fp32 accumulation); zeros for rows without a valid key.
        lse: [T, N] fp32 natural-log sum-exp of the scaled logits over the valid selected keys;
            -inf for rows without a valid key.

    On CUDA (and on CPU under TRITON_INTERPRET=1) this runs the Triton kernels; on a plain CPU
    it runs the chunked PyTorch reference (logged once).
    """
    _validate(q, kv, indices, softmax_scale, v_dim, check_index_range)
    check_bwd_variant(bwd_variant, bwd_chunk_tokens, where="sparse_mla", names=("bwd_variant", "bwd_chunk_tokens"))
    softmax_scale = float(softmax_scale)
    if not (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        global _logged_fallback
        if not _logged_fallback:
            _logged_fallback = True
            _log.info("hyscale_kernels: sparse_mla on CPU without TRITON_INTERPRET uses the PyTorch reference")
        return sparse_mla_reference(q, kv, indices, softmax_scale, v_dim=v_dim)
    return _SparseMLA.apply(q.contiguous(), kv.contiguous(), indices.contiguous(), softmax_scale, v_dim,
                            deterministic, bool(dq_over_q), bwd_variant, bwd_chunk_tokens)
