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


# ---------------------------------------------------------------------------------------------
# Triton kernels (interpreter on CPU at tiny fp32 shapes; bf16 at real shapes on GPU)
# ---------------------------------------------------------------------------------------------
import os  # noqa: E402

from hyscale_kernels.sparse_mla import sparse_mla  # noqa: E402
from hyscale_kernels.sparse_mla import kernel as sm_kernels  # noqa: E402
from interp_rerun import rerun_under_interpreter  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
                                  reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _nan_outputs(monkeypatch):
    """Kernel outputs start as NaN, so any element a kernel fails to write fails the test."""
    monkeypatch.setattr(sm_kernels, "_alloc",
                        lambda *s, dtype, device: torch.full(s, float("nan"), dtype=dtype, device=device))


def _fwd_bwd(fn, q, kv, idx, scale, V, go, gl, **kw):
    q, kv = q.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    out, lse = fn(q, kv, idx, scale, v_dim=V, **kw)
    fin = torch.isfinite(lse)
    ((out.float() * go).sum() + (lse[fin] * gl[fin]).sum()).backward()
    return out, lse, q.grad, kv.grad


def _kernel_vs_reference(T, N, D, V, S, K, seed=0, deterministic=False, pad_frac=0.3, rtol=1e-4, atol=1e-4):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, N, D, generator=gen)
    kv = torch.randn(S, D, generator=gen)
    idx = _causal_indices(T, K, gen, S=S, pad_frac=pad_frac).to(torch.int32)
    idx[0] = -1  # no valid key: out 0, lse -inf, no gradient
    idx[1] = -1
    idx[1, K // 2] = S - T  # exactly one visible key
    go, gl = torch.randn(T, N, V, generator=gen), torch.randn(T, N, generator=gen)
    got = _fwd_bwd(sparse_mla, q, kv, idx, 0.25, V, go, gl, deterministic=deterministic)
    ref = _fwd_bwd(sparse_mla_reference, q, kv, idx, 0.25, V, go, gl)
    assert torch.equal(got[1][0], torch.full((N,), float("-inf"))) and torch.equal(got[0][0], torch.zeros(N, V))
    torch.testing.assert_close(got[0][1], kv[S - T, :V].expand(N, V))  # one key: out = its value
    for a, b in zip(got, ref):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    return got


@needs_triton
@pytest.mark.parametrize("N,K", [(5, 37), (16, 70), (70, 9)])  # heads not a power of two; several k tiles / head blocks
def test_kernel_matches_reference(N, K):
    _kernel_vs_reference(T=6, N=N, D=48, V=32, S=80, K=K)


@needs_triton
def test_kernel_deterministic_repeatable():
    a = _kernel_vs_reference(T=5, N=3, D=40, V=32, S=12, K=9, seed=2, deterministic=True)
    b = _kernel_vs_reference(T=5, N=3, D=40, V=32, S=12, K=9, seed=2, deterministic=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@needs_triton
def test_kernel_no_rope_part_and_out_only_grad():
    """v_dim == Dqk (no rope tail) and a loss that uses only ``out`` (dlse is None)."""
    gen = torch.Generator().manual_seed(4)
    q, kv = torch.randn(4, 3, 32, generator=gen), torch.randn(9, 32, generator=gen)
    idx = _causal_indices(4, 5, gen, S=9).int()
    for fn in (sparse_mla, sparse_mla_reference):
        a, b = q.clone().requires_grad_(), kv.clone().requires_grad_()
        fn(a, b, idx, 0.5, v_dim=32)[0].square().sum().backward()
        if fn is sparse_mla:
            got = (a.grad, b.grad)
    torch.testing.assert_close(got, (a.grad, b.grad), rtol=1e-4, atol=1e-4)


def test_input_validation():
    q, kv, idx = torch.randn(3, 2, 24), torch.randn(5, 24), torch.zeros(3, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices must be in"):
        sparse_mla(q, kv, idx + 5, 0.1, v_dim=16)
    with pytest.raises(ValueError, match="indices must be in"):
        sparse_mla(q, kv, idx - 2, 0.1, v_dim=16)
    with pytest.raises(ValueError, match="kv must be"):
        sparse_mla(q, kv[:, :20], idx, 0.1, v_dim=16)
    with pytest.raises(TypeError, match="dtype"):
        sparse_mla(q, kv.double(), idx, 0.1, v_dim=16)
    with pytest.raises(TypeError, match="dtype"):
        sparse_mla(q, kv, idx.float(), 0.1, v_dim=16)
    with pytest.raises(ValueError, match="topk must be"):
        sparse_mla(q, kv, torch.zeros(3, 4096, dtype=torch.int32), 0.1, v_dim=16)
    with pytest.raises(ValueError, match="v_dim"):
        sparse_mla(q, kv, idx, 0.1, v_dim=30)
    with pytest.raises(ValueError, match=r"indices must be \[3, topk\]"):
        sparse_mla(q, kv, idx[:2], 0.1, v_dim=16)
    with pytest.raises(ValueError, match="3-D"):
        sparse_mla(q[0], kv, idx, 0.1, v_dim=16)


def _gpu_case(T, N, S, K, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, N, 576, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(S, 576, device="cuda", generator=gen).bfloat16()
    # causal duplicate-free rows: the top-k of random scores over keys <= S - T + t
    sc = torch.rand(T, S, device="cuda", generator=gen)
    vis = torch.arange(S, device="cuda")[None, :] <= (S - T + torch.arange(T, device="cuda"))[:, None]
    v, i = sc.masked_fill(~vis, -1.0).topk(K, dim=-1)
    idx = i.masked_fill(v < 0, -1).int()
    return q, kv, idx


@pytest.mark.gpu
@pytest.mark.parametrize("N", [16, 128, 24])
@pytest.mark.parametrize("K", [2048, 512, 1000])
def test_gpu_bf16_matches_reference(N, K):
    T, S = 1024, 3072
    q, kv, idx = _gpu_case(T, N, S, K)
    go = torch.randn(T, N, 512, device="cuda")
    gl = torch.randn(T, N, device="cuda")
    got = _fwd_bwd(sparse_mla, q, kv, idx, 576 ** -0.5, 512, go, gl)
    ref = _fwd_bwd(sparse_mla_reference, q.float(), kv.float(), idx, 576 ** -0.5, 512, go, gl)
    for name, a, b in zip(("out", "lse", "dq", "dkv"), got, ref):
        a = a.float()
        assert not torch.isnan(a).any(), name
        err = ((a - b).norm() / b.norm().clamp_min(1e-6)).item()
        assert err < 2e-2, f"{name}: relative L2 error {err}"


@pytest.mark.gpu
def test_gpu_deterministic_kv_grad():
    q, kv, idx = _gpu_case(512, 64, 1024, 512, seed=1)
    go, gl = torch.randn(512, 64, 512, device="cuda"), torch.zeros(512, 64, device="cuda")
    a = _fwd_bwd(sparse_mla, q, kv, idx, 0.04, 512, go, gl, deterministic=True)
    b = _fwd_bwd(sparse_mla, q, kv, idx, 0.04, 512, go, gl, deterministic=True)
    c = _fwd_bwd(sparse_mla, q, kv, idx, 0.04, 512, go, gl, deterministic=False)
    assert torch.equal(a[3], b[3]) and torch.equal(a[2], b[2])
    torch.testing.assert_close(a[3].float(), c[3].float(), rtol=2e-2, atol=2e-2)


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)


@needs_triton
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("N,R", [(70, 16), (5, 8)])  # two head blocks / heads not a power of two; rope tail
def test_backward_variants_match_reference(split, deterministic, N, R):
    """Both backward kernels (split dq + dkv, fused), atomics and sorted dkv reduction, with dlse."""
    gen = torch.Generator().manual_seed(11)
    T, S, K, V = 5, 40, 20, 32
    q, kv = torch.randn(T, N, V + R, generator=gen), torch.randn(S, V + R, generator=gen)
    idx = torch.stack([torch.randperm(S, generator=gen)[:K] for _ in range(T)]).int()
    idx[0, :7] = -1
    idx[2] = -1  # no valid key
    out, lse = sm_kernels.sparse_mla_fwd(q, kv, idx, 0.3, V)
    do, dl = torch.randn(T, N, V, generator=gen), torch.randn(T, N, generator=gen)
    dq, dkv = sm_kernels.sparse_mla_bwd(q, kv, idx, out, lse, do, dl, 0.3, V, deterministic=deterministic, split=split)
    a, b = q.clone().requires_grad_(), kv.clone().requires_grad_()
    o2, l2 = sparse_mla_reference(a, b, idx, 0.3, V)
    fin = torch.isfinite(l2)
    ((o2 * do).sum() + (l2[fin] * dl[fin]).sum()).backward()
    torch.testing.assert_close(dq, a.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dkv, b.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("N", [5, 16, 17, 70])
def test_backward_default_is_scratch(monkeypatch, N):
    """The default backward is the scratch variant at every head count (fastest at N = 16 / 64 / 128 on
    the H200); its dq kernel gets 4 warps up to FEW_HEADS heads in a block, the configured count above."""
    calls, warps = [], []
    real = sm_kernels._bwd_scratch
    monkeypatch.setattr(sm_kernels, "_bwd_scratch", lambda *a, **k: calls.append(1) or warps.append(a[13]["num_warps"])
                        or real(*a, **k))
    gen = torch.Generator().manual_seed(3)
    T, S, K, V, R = 3, 24, 8, 32, 8
    q, kv = torch.randn(T, N, V + R, generator=gen), torch.randn(S, V + R, generator=gen)
    idx = torch.stack([torch.randperm(S, generator=gen)[:K] for _ in range(T)]).int()
    out, lse = sm_kernels.sparse_mla_fwd(q, kv, idx, 0.3, V)
    do = torch.randn(T, N, V, generator=gen)
    dq, dkv = sm_kernels.sparse_mla_bwd(q, kv, idx, out, lse, do, None, 0.3, V)
    assert calls
    few = sm_kernels._block_h(N) <= sm_kernels.FEW_HEADS
    assert warps == [sm_kernels.BWD_DQ_WARPS_FEW_HEADS if few else sm_kernels.BWD_DQ_CFG["num_warps"]]
    a, b = q.clone().requires_grad_(), kv.clone().requires_grad_()
    o2, _ = sparse_mla_reference(a, b, idx, 0.3, V)
    (o2 * do).sum().backward()
    torch.testing.assert_close(dq, a.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dkv, b.grad, rtol=1e-4, atol=1e-4)
