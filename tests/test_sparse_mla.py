"""Sparse absorbed-MLA attention: the PyTorch reference against stock Megatron and a dense
formulation, then the Triton kernels against the reference (interpreter on CPU, bf16 on GPU)."""

from __future__ import annotations

import pytest
import torch

from hyscale_kernels.sparse_mla.reference import sparse_mla_reference


def _causal_indices(T, topk, gen, S=None, pad_frac=0.0):
    """Random duplicate-free causal indices [T, topk] (row t picks from keys <= t), -1 padded."""
    S = T if S is None else S
    idx = torch.full((T, topk), -1, dtype=torch.int64)
    for t in range(T):
        n = min(topk, t + 1 + (S - T))
        pick = torch.randperm(t + 1 + (S - T), generator=gen)[:n]
        keep = max(1, int(round(n * (1 - pad_frac)))) if n else 0
        idx[t, :keep] = pick[:keep]
        idx[t] = idx[t][torch.randperm(topk, generator=gen)]  # padding anywhere in the row
    return idx


def _dense_sparse_mla(q, kv, idx, scale, v_dim):
    """Dense [T, N, S] formulation with an index mask: an independent check of the reference."""
    T, S = q.shape[0], kv.shape[0]
    mask = torch.zeros(T, S + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(idx >= 0, idx, S), True)
    mask = mask[:, :S]
    logits = torch.einsum("tnd,sd->tns", q.float(), kv.float()) * scale
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(logits, -1)
    p = torch.softmax(logits, -1).nan_to_num(0.0)
    return torch.einsum("tns,sv->tnv", p, kv.float()[:, :v_dim]), lse


def test_reference_matches_dense_and_grads():
    gen = torch.Generator().manual_seed(0)
    T, N, D, V, K = 13, 5, 40, 32, 6
    q = torch.randn(T, N, D, generator=gen, requires_grad=True)
    kv = torch.randn(T, D, generator=gen, requires_grad=True)
    idx = _causal_indices(T, K, gen, pad_frac=0.3)
    idx[4] = -1  # a row with no valid key
    out, lse = sparse_mla_reference(q, kv, idx, 0.2, v_dim=V, chunk_rows=4)
    q2, kv2 = q.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    out2, lse2 = _dense_sparse_mla(q2, kv2, idx, 0.2, V)
    assert torch.equal(lse[4], torch.full((N,), float("-inf")))
    assert torch.equal(out[4], torch.zeros(N, V))
    torch.testing.assert_close(out, out2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, lse2, rtol=1e-5, atol=1e-6)
    go, gl = torch.randn_like(out), torch.randn_like(lse)
    fin = torch.isfinite(lse)
    ((out * go).sum() + (lse[fin] * gl[fin]).sum()).backward()
    ((out2 * go).sum() + (lse2[fin] * gl[fin]).sum()).backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
    torch.testing.assert_close(q.grad, q2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv.grad, kv2.grad, rtol=1e-5, atol=1e-5)


def test_reference_matches_stock_unfused():
    from megatron.core.transformer.experimental_attention_variant.dsa import _unfused_absorbed_dsa_fn

    gen = torch.Generator().manual_seed(1)
    T, N, D, V, K = 17, 4, 48, 32, 5
    q = torch.randn(T, N, D, generator=gen)
    kv = torch.randn(T, D, generator=gen)
    idx = _causal_indices(T, K, gen, pad_frac=0.2)
    out, _ = sparse_mla_reference(q, kv, idx, 0.15, v_dim=V)
    stock = _unfused_absorbed_dsa_fn(q[:, None], kv[:, None, None], idx[None], 0.15, V)  # [T, 1, N, V]
    torch.testing.assert_close(out, stock[:, 0], rtol=1e-5, atol=1e-6)
