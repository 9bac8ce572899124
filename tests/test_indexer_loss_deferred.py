"""The indexer-loss target taken from the attention backward (kernels/indexer_loss/deferred.py).

Against the forward path (sparse_mla + sparse_indexer_loss, itself tested against the reference):
same attention gradients, same indexer gradients, the loss value reported once in the backward.
CPU: Triton interpreter at tiny shapes (fp32); GPU: bf16 at a real shape.
"""

import pytest
import torch

from hyscale_kernels.indexer_loss.deferred import sparse_mla_with_indexer_loss
from hyscale_kernels.indexer_loss.fused import sparse_indexer_loss
from hyscale_kernels.indexer_loss.reference import sparse_indexer_target
from hyscale_kernels.sparse_mla import sparse_mla
from hyscale_kernels.sparse_mla.kernel import sparse_mla_bwd, sparse_mla_fwd
from test_indexer_loss_fused import _inputs as _fused_inputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(T, S, N, topk, seed=0):
    """The fused-loss tests' inputs (fp32, DEV), with a one-key row, a fully masked row and padding inside a row."""
    (q_idx, w, k_idx, query, kv, idx), _ = _fused_inputs(T, S, N, topk, seed=seed, pad=False)
    idx[1, 1:] = -1  # one visible key
    idx[3, :] = -1  # fully masked row
    idx[4, ::3] = -1  # padding inside the row
    return [q_idx, w, k_idx, query, kv, idx]


@pytest.mark.parametrize("target_sum", ["mma", "reg"])
@pytest.mark.parametrize("N", [3, 16, 80])  # one head step (odd), one full step, several 16-head steps
def test_bwd_target_equals_reference_target(N, target_sum):
    """The scratch backward's head-summed P (dkv kernel; both scratch_cfg target_sum ways) equals the target
    spec (normalised); 0 at padding and on the fully masked row; every element written (NaN-filled before)."""
    *_, query, kv, idx = _inputs(T=7, S=40, N=N, topk=18, seed=N)
    v = 32
    out, lse = sparse_mla_fwd(query, kv, idx, 0.2, v)
    dout = torch.randn_like(out)
    tgt = torch.full(idx.shape, float("nan"), dtype=torch.float32, device=DEV)
    sparse_mla_bwd(query, kv, idx, out, lse, dout, None, 0.2, v, target=tgt, scratch_cfg=dict(target_sum=target_sum))
    ref = sparse_indexer_target(query, kv, idx, 0.2, lse=lse)
    assert torch.isfinite(tgt).all()
    torch.testing.assert_close(tgt / tgt.sum(-1, keepdim=True).clamp_min(1e-10), ref, rtol=1e-5, atol=1e-6)
    assert (tgt[3] == 0).all() and (tgt[idx < 0] == 0).all()
    torch.testing.assert_close(tgt[1, 0], torch.tensor(float(N), device=DEV))  # one key: P = 1 for every head


def test_bwd_target_bad_input():
    *_, query, kv, idx = _inputs(T=5, S=20, N=4, topk=8)
    out, lse = sparse_mla_fwd(query, kv, idx, 0.2, 32)
    dout = torch.randn_like(out)
    with pytest.raises(ValueError, match="target must be a contiguous fp32"):
        sparse_mla_bwd(query, kv, idx, out, lse, dout, None, 0.2, 32, target=torch.zeros(5, 7, device=DEV))
    with pytest.raises(ValueError, match=r"scratch_cfg\['target_sum'\] must be one of \('mma', 'reg'\), got 'sum'"):
        sparse_mla_bwd(query, kv, idx, out, lse, dout, None, 0.2, 32, target=torch.zeros(idx.shape, device=DEV),
                       scratch_cfg=dict(target_sum="sum"))
    for variant in ("fused", "split"):
        with pytest.raises(ValueError, match="needs variant 'scratch'"):
            sparse_mla_bwd(query, kv, idx, out, lse, dout, None, 0.2, 32, variant=variant,
                           target=torch.zeros(idx.shape, device=DEV))


def _both(inputs, relu=True, rows=None, deterministic=False, coeff=0.05, variant=None, dq_over_q=False):
    """(value, loss grad, attention grads, indexer grads) of the forward path and the deferred one, on the
    same loss scalar: (out * dout).sum() + coeff * loss."""
    q_idx, w, k_idx, query, kv, idx = inputs
    scale, v = 0.25, (512 if query.shape[-1] == 576 else 32)
    torch.manual_seed(7)
    dout = torch.randn(query.shape[0], query.shape[1], v, dtype=query.dtype, device=DEV)
    res = []
    for deferred in (False, True):
        ql, wl, kl = (t.clone().requires_grad_() for t in (q_idx, w, k_idx))
        qa, kva = query.clone().requires_grad_(), kv.clone().requires_grad_()
        seen = []
        if deferred:
            out, lse, loss = sparse_mla_with_indexer_loss(
                qa, kva, idx, scale, ql, wl, kl, v_dim=v, relu=relu, row_mask=rows, on_value=seen.append,
                deterministic=deterministic, bwd_variant=variant, dq_over_q=dq_over_q)
            assert loss.item() == 0.0 and not seen  # no value before the backward
        else:
            out, lse = sparse_mla(qa, kva, idx, scale, v_dim=v, deterministic=deterministic, bwd_variant=variant)
            loss = sparse_indexer_loss(ql, wl, kl, qa, kva, idx, scale, 1.0, relu=relu, lse=lse,
                                       query_valid_rows=rows, calculate_per_token_loss=True, v_dim=v,
                                       deterministic=deterministic)
            seen.append(loss.detach())
        ((out.float() * dout.float()).sum() + coeff * loss).backward()
        assert len(seen) == 1
        res.append((seen[0], out.detach(), lse.detach(), [t.grad for t in (qa, kva)], [t.grad for t in (ql, wl, kl)]))
    return res


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_deferred_loss_matches_forward_path(relu, masked):
    inputs = _inputs(T=7, S=33, N=5, topk=12, seed=3)
    rows = torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.float32, device=DEV) if masked else None
    (v1, o1, l1, a1, i1), (v2, o2, l2, a2, i2) = _both(inputs, relu=relu, rows=rows)
    assert v1.item() > 0
    torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(o2, o1, rtol=0, atol=0)
    torch.testing.assert_close(l2, l1, rtol=0, atol=0)
    for a, b in zip(a2, a1):  # attention gradients: the same kernels
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(i2, i1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_deferred_loss_deterministic_and_dq_over_q():
    inputs = _inputs(T=6, S=30, N=20, topk=10, seed=5)
    (v1, _, _, a1, i1), (v2, _, _, a2, i2) = _both(inputs, deterministic=True)
    torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-7)
    for a, b in zip(a2 + i2, a1 + i1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    # dq over q: the deferred loss never reads the attention query again
    q_idx, w, k_idx, query, kv, idx = inputs
    qa = query.clone().requires_grad_()
    qin = qa * 1.0  # a non-leaf the backward may overwrite
    out, _, loss = sparse_mla_with_indexer_loss(qin, kv, idx, 0.25, q_idx.clone().requires_grad_(), w, k_idx,
                                                v_dim=32, dq_over_q=True)
    (out.sum() + loss).backward()
    ref_q = query.clone().requires_grad_()
    out_r, _ = sparse_mla(ref_q, kv, idx, 0.25, v_dim=32)
    out_r.sum().backward()
    torch.testing.assert_close(qa.grad, ref_q.grad, rtol=1e-6, atol=1e-7)


def test_deferred_loss_errors():
    q_idx, w, k_idx, query, kv, idx = _inputs(T=5, S=20, N=4, topk=8)
    ql = q_idx.clone().requires_grad_()
    out, _, loss = sparse_mla_with_indexer_loss(query, kv, idx, 0.2, ql, w, k_idx, v_dim=32)
    with pytest.raises(RuntimeError, match="before \\(or without\\) the attention"):
        loss.backward()  # the attention output is not part of this backward: no target
    for variant in ("fused", "split"):
        with pytest.raises(ValueError, match=f"bwd_variant='{variant}' cannot produce"):
            sparse_mla_with_indexer_loss(query, kv, idx, 0.2, ql, w, k_idx, v_dim=32, bwd_variant=variant)
    with pytest.raises(ValueError, match="k_idx must be"):
        sparse_mla_with_indexer_loss(query, kv, idx, 0.2, ql, w, k_idx[:-1], v_dim=32)
    with pytest.raises(ValueError, match="w must be"):
        sparse_mla_with_indexer_loss(query, kv, idx, 0.2, ql, w[:, :2], k_idx, v_dim=32)
    with pytest.raises(ValueError, match="row_mask must be"):
        sparse_mla_with_indexer_loss(query, kv, idx, 0.2, ql, w, k_idx, v_dim=32, row_mask=torch.ones(3, device=DEV))


@pytest.mark.gpu
def test_gpu_deferred_loss_bf16():
    """bf16 at a real shape (T 4096, N 128: two head blocks adding into the target, k 2048)."""
    T, S, N, K = 4096, 8192, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    q_idx = torch.randn(T, 64, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(T, 64, device="cuda", generator=g).bfloat16()
    k_idx = torch.randn(S, 128, device="cuda", generator=g).bfloat16()
    query = torch.randn(T, N, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(S, 576, device="cuda", generator=g).bfloat16()
    idx = torch.argsort(torch.rand(T, S, device="cuda", generator=g), dim=1)[:, :K].int()
    idx[:64, 1000:] = -1
    # the scratch backward's target sums the bf16-stored P (fp32 accumulation): vs the fp32-P target kernel
    from hyscale_kernels.indexer_loss.target import sparse_attention_target

    out, lse = sparse_mla_fwd(query, kv, idx, 0.25, 512)
    tgt = torch.full(idx.shape, float("nan"), device="cuda")
    sparse_mla_bwd(query, kv, idx, out, lse, torch.randn_like(out), None, 0.25, 512, target=tgt)
    ref = sparse_attention_target(query, kv, idx, lse, 0.25)
    assert torch.isfinite(tgt).all()
    err = ((tgt - ref).norm() / ref.norm()).item()
    assert err < 2e-3, err
    del out, lse, tgt, ref
    (v1, _, _, a1, i1), (v2, _, _, a2, i2) = _both([q_idx, w, k_idx, query, kv, idx], coeff=1.0)
    torch.testing.assert_close(v2, v1, rtol=2e-3, atol=1e-6)
    for a, b in zip(a2, a1):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-3)
    for a, b in zip(i2, i1):  # bf16 gradients: a few elements differ by one bf16 ulp (the target's bf16 P)
        a, b = a.float(), b.float()
        assert ((a - b).norm() / b.norm()).item() < 5e-3
