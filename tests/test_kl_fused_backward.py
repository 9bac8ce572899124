"""kl.kl_fused_backward (the KL rows in the selected-scores forward kernel, then the backward) against the
unfused path it replaces (selected-scores forward + kl_rows + the backward from the stored gradient) and
against autograd through the plain-PyTorch reference. CPU: Triton interpreter, tiny odd shapes (fp32);
GPU: bf16 at a real shape."""

from __future__ import annotations

import os

import pytest
import torch

from hyscale_kernels.hytopk import selected_scores as ss_mod
from hyscale_kernels.hytopk.reference import selected_scores_reference
from hyscale_kernels.indexer_loss import kl as kl_mod
from interp_rerun import rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERP), reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _nan_outputs(monkeypatch):
    """Kernel outputs start as NaN, so any element a kernel fails to write fails the test."""
    monkeypatch.setattr(ss_mod, "_alloc",
                        lambda *s, dtype, device: torch.full(s, float("nan"), dtype=dtype, device=device))


def _case(T, H, D, S, K, seed=0, dtype=torch.float32, device="cpu"):
    """Random indexer inputs, duplicate-free index rows with padding, an empty row (0), a one-key row (1), a
    target that is 0 on a whole row (2: tsum = 0) and a row mask with a masked row (3)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(device, dtype)
    w = torch.randn(T, H, generator=g).to(device)
    k = torch.randn(S, D, generator=g).to(device, dtype)
    idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    idx = idx.masked_fill(torch.rand(T, K, generator=g) < 0.25, -1)
    idx[0] = -1
    idx[1, 1:] = -1
    idx = idx.to(device=device, dtype=torch.int32)
    target = torch.rand(T, K, generator=g).to(device).masked_fill(idx < 0, 0.0)
    target[2] = 0.0
    rows = torch.ones(T, device=device)
    rows[3] = 0.0
    return q, w, k, idx, target, rows


def _unfused(q, w, k, idx, target, coef, relu, deterministic):
    """The path kl_fused_backward replaces (as the deferred loss ran it until session 11)."""
    scores = ss_mod._triton_fwd(q, w, k, idx, relu)
    kl, _, _ = kl_mod.kl_rows(target, scores, idx, None, grad_out=scores)
    dq, dw, dk = kl_mod.kl_score_backward(q, w, k, idx, scores, coef.reshape(-1, 1), relu, deterministic)
    return kl, dq, dw, dk


def _reference(q, w, k, idx, target, coef, relu):
    """Autograd through the PyTorch reference: KL_t = sum_j tn (log tn - log_softmax(scores)), its gradient
    for sum_t coef[t] * KL_t."""
    q, w, k = (t.detach().float().clone().requires_grad_() for t in (q, w, k))
    s = selected_scores_reference(q, w, k, idx, relu=relu)
    valid = idx >= 0
    logp = torch.log_softmax(s.masked_fill(~valid, float("-inf")), dim=-1).masked_fill(~valid, 0.0)
    tn = target / target.sum(-1, keepdim=True).clamp_min(kl_mod.EPS)
    kl = (tn * (torch.log(tn.clamp_min(kl_mod.EPS)) - logp)).masked_fill(~valid, 0.0).sum(-1)
    (kl * coef).sum().backward()
    return kl.detach(), q.grad, w.grad, k.grad


@needs_triton
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dk_t", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
def test_fused_matches_unfused_and_reference(relu, deterministic, dk_t, prefetch, monkeypatch):
    """Odd H / D, K = 37 over 16-slot blocks (a partial block), padding, an empty row, a one-key row, a row
    with a zero target, a masked (coef 0) row; the forward's index prefetch off / on."""
    monkeypatch.setitem(ss_mod.BWD_CFG, "dk_t", dk_t)
    monkeypatch.setitem(ss_mod.BWD_CFG, "block_j", 16)
    monkeypatch.setitem(ss_mod.FWD_CFG, "block_j", 16)
    monkeypatch.setitem(ss_mod.FWD_CFG, "prefetch_idx", prefetch)
    q, w, k, idx, target, rows = _case(T=6, H=3, D=12, S=41, K=37, seed=2)
    coef = 0.7 * rows
    got = kl_mod.kl_fused_backward(q, w, k, idx, target, coef, relu, deterministic)
    old = _unfused(q, w, k, idx, target, coef, relu, deterministic)
    ref = _reference(q, w, k, idx, target, coef, relu)
    for name, a, b, c in zip(("kl", "dq", "dw", "dk"), got, old, ref):
        assert not torch.isnan(a).any(), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} vs unfused: {m}")
        torch.testing.assert_close(a, c.to(a.dtype), rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} vs ref: {m}")
    assert got[0][0] == 0 and got[0][2] == 0  # no valid slot / zero target: KL 0
    assert (got[1][3] == 0).all() and (got[2][3] == 0).all()  # masked row: no gradient
    assert got[0][3] > 0  # but its KL value is there (the caller applies the row mask to the value)


@needs_triton
def test_fused_kl_cfg_drives_deferred_loss(monkeypatch):
    """KL_CFG['fused'] switches the deferred loss's backward to the fused kernel (and off again)."""
    from hyscale_kernels.indexer_loss import deferred

    calls = []
    orig = kl_mod.kl_fused_backward
    monkeypatch.setattr(kl_mod, "kl_fused_backward", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    q, w, k, idx, target, rows = _case(T=4, H=2, D=8, S=20, K=9, seed=4)
    query = torch.randn(4, 3, 40)
    kv = torch.randn(20, 40)
    for fused in (True, False):
        monkeypatch.setitem(kl_mod.KL_CFG, "fused", fused)
        seen = []
        ql = q.clone().requires_grad_()
        out, _, loss = deferred.sparse_mla_with_indexer_loss(query.clone().requires_grad_(), kv, idx, 0.3, ql, w, k,
                                                             v_dim=32, on_value=seen.append)
        (out.sum() + loss).backward()
        assert len(seen) == 1 and torch.isfinite(seen[0]) and torch.isfinite(ql.grad).all()
        assert len(calls) == 1  # one call from the fused run, none from the unfused one


@pytest.mark.gpu
@pytest.mark.parametrize("relu", [True, False])
def test_gpu_fused_matches_unfused_bf16(relu):
    """bf16, 64 index heads x 128, k = 2048, default launch: the fused kernel against the unfused path
    (deterministic dk: same bf16 rounding of dS, so only the fp32 lse's summation order differs)."""
    T, H, D, S, K = 700, 64, 128, 4096, 2048
    q, w, k, idx, target, rows = _case(T, H, D, S, K, seed=5, dtype=torch.bfloat16, device="cuda")
    coef = 1e-2 * rows
    got = kl_mod.kl_fused_backward(q, w, k, idx, target, coef, relu, True)
    old = _unfused(q, w, k, idx, target, coef, relu, True)
    torch.testing.assert_close(got[0], old[0], rtol=1e-4, atol=1e-5)
    for a, b in zip(got[1:], old[1:]):
        a, b = a.float(), b.float()
        assert ((a - b).norm() / b.norm()).item() < 2e-3


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)
