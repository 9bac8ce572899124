"""Shared by the sparse attention and indexer-loss tests: input cases, NaN-filled kernel outputs, reference
gradients, error measures."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if HAS_CUDA else "cpu"
TOL = dict(rtol=1e-4, atol=1e-4)
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERP), reason="needs CUDA or TRITON_INTERPRET=1")


def nan_alloc(*shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.fixture
def nan_outputs(monkeypatch):
    """Kernel outputs and scratch start as NaN, so any element a kernel fails to write fails the test."""
    from hyscale_kernels.indexer_loss import selected_scores
    from hyscale_kernels.sparse_mla import kernel

    for mod in (kernel, selected_scores):
        monkeypatch.setattr(mod, "_alloc", nan_alloc)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-6)).item()


# ---------------------------------------------------------------------------------------------
# sparse attention
# ---------------------------------------------------------------------------------------------
def attn_case(T, N, V, R, S, K, seed=0, device=DEV):
    """fp32 q [T, N, V + R], kv [S, V + R], duplicate-free int32 idx [T, K] with -1 padding spread over the rows
    (every third slot), row 0 without a valid key, row 1 with exactly one (key S - 1); dout, dlse."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, N, V + R, generator=gen)
    kv = torch.randn(S, V + R, generator=gen)
    idx = torch.stack([torch.randperm(S, generator=gen)[:K] for _ in range(T)]).int()
    idx[:, ::3] = -1
    idx[0] = -1
    idx[1] = -1
    idx[1, K // 2] = S - 1
    dout = torch.randn(T, N, V, generator=gen)
    dlse = torch.randn(T, N, generator=gen)
    return [t.to(device) for t in (q, kv, idx, dout, dlse)]


def attn_grads(fn, q, kv, idx, scale, V, dout, dlse=None, **kw):
    """(out, lse, dq, dkv) of fn (sparse_mla or its reference) for the loss sum(out * dout) + sum(lse * dlse)
    over finite lse."""
    q, kv = q.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    out, lse = fn(q, kv, idx, scale, v_dim=V, **kw)
    loss = (out.float() * dout.float()).sum()
    if dlse is not None:
        fin = torch.isfinite(lse)
        loss = loss + (lse[fin] * dlse[fin]).sum()
    loss.backward()
    return out.detach(), lse.detach(), q.grad, kv.grad


def gpu_attn_case(T, N, S, K, seed=0):
    """bf16 q [T, N, 576], kv [S, 576] on CUDA; causal duplicate-free idx (the top-k of random scores over
    keys <= S - T + t), -1 where a row sees fewer than K keys."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, N, 576, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(S, 576, device="cuda", generator=gen).bfloat16()
    sc = torch.rand(T, S, device="cuda", generator=gen)
    vis = torch.arange(S, device="cuda")[None, :] <= (S - T + torch.arange(T, device="cuda"))[:, None]
    v, i = sc.masked_fill(~vis, -1.0).topk(K, dim=-1)
    return q, kv, i.masked_fill(v < 0, -1).int()


# ---------------------------------------------------------------------------------------------
# indexer
# ---------------------------------------------------------------------------------------------
def indexer_case(T, H, D, S, K, seed=0, dtype=torch.float32, device="cpu", pad=0.3):
    """Indexer q [T, H, D], w [T, H] (both signs), k [S, D], duplicate-free int32 idx [T, K] with random -1
    padding and row 0 empty."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(device, dtype)
    w = torch.randn(T, H, generator=g).to(device)
    k = torch.randn(S, D, generator=g).to(device, dtype)
    idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    idx = idx.masked_fill(torch.rand(T, K, generator=g) < pad, -1)
    idx[0] = -1
    return q, w, k, idx.to(device=device, dtype=torch.int32)


def loss_case(T, S, N, topk, H=4, D=16, dqk=48, seed=0, pad=True):
    """Indexer (q_idx, w, k_idx) and attention (query, kv) fp32 inputs on DEV with duplicate-free idx; ``pad``:
    row 1 with one key, row 3 fully masked, padding inside row 4 (needs T >= 5). Value width: 32."""
    g = torch.Generator().manual_seed(seed)
    q_idx = torch.randn(T, H, D, generator=g)
    w = torch.randn(T, H, generator=g)
    k_idx = torch.randn(S, D, generator=g)
    query = torch.randn(T, N, dqk, generator=g)
    kv = torch.randn(S, dqk, generator=g)
    idx = torch.stack([torch.randperm(S, generator=g)[:topk] for _ in range(T)]).to(torch.int32)
    if pad:
        idx[1, 1:] = -1
        idx[3, :] = -1
        idx[4, ::3] = -1
    return [t.to(DEV) for t in (q_idx, w, k_idx, query, kv, idx)]
