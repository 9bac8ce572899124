"""The indexer KL loss: the reference equals stock megatron-core 0.19.2 (value and indexer gradients); the
kernel path's target, KL rows, value and gradients equal the reference (Triton interpreter on CPU); the deferred
loss (target from the attention backward) equals the forward-target path; bad input is named."""

from __future__ import annotations

import types

import pytest
import torch

from megatron.core.transformer.experimental_attention_variant import dsa as stock_dsa

from hyscale_kernels.hytopk.reference import causal_bounds, packed_causal_bounds
from hyscale_kernels.indexer_loss.deferred import sparse_mla_with_indexer_loss
from hyscale_kernels.indexer_loss.fused import sparse_indexer_loss
from hyscale_kernels.indexer_loss.kl import kl_rows
from hyscale_kernels.indexer_loss.reference import (
    _kl_rows,
    _masked_log_softmax,
    dense_indexer_loss_reference,
    sparse_indexer_loss_reference,
    sparse_indexer_target,
)
from hyscale_kernels.indexer_loss.target import sparse_attention_target
from hyscale_kernels.sparse_mla import sparse_mla
from hyscale_kernels.sparse_mla.kernel import sparse_mla_bwd, sparse_mla_fwd
from hyscale_kernels.sparse_mla.reference import sparse_mla_reference
from _sparse_cases import DEV, loss_case, nan_outputs, needs_triton, rel_l2  # noqa: F401

PG = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))  # stock only asks tp.size()
T, N, DQK, HI, DI, TOPK = 19, 3, 24, 4, 8, 6
SCALE, COEFF = 0.3, 0.7


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HI, DI, generator=g)
    w = torch.randn(T, HI, generator=g)  # negative weights too
    k = torch.randn(T, DI, generator=g)
    query = torch.randn(T, N, DQK, generator=g)
    kv = torch.randn(T, DQK, generator=g)
    return q, w, k, query, kv


def _leaf(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _stock_layout(q, w, k, query, kv):
    return q[:, None], w[:, None], k[:, None], query[:, None], kv[:, None, None].expand(-1, 1, N, -1)


def _bounds(packed):
    if packed:
        return packed_causal_bounds([7, 12])
    return causal_bounds(T)


def _stock_kwargs(packed):
    if not packed:  # stock's top-k ignores the default causal mask: pass it explicitly
        return dict(mask=torch.full((T, T), float("-inf")).triu(1))
    s, e = _bounds(True)
    return dict(mask=None, varlen_starts=s.long(), varlen_ends=e.long())


def _check_grads(ours, theirs, rtol=1e-5, atol=1e-6):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("valid_rows,per_token", [(False, False), (True, False), (True, True)])
def test_matches_stock_fused(sparse, relu, packed, valid_rows, per_token):
    """Against stock's FusedDSAIndexerLoss (its own top-k, its hand-written backward)."""
    base = _inputs(0)
    qv = None
    if valid_rows:
        qv = torch.ones(T, dtype=torch.bool)
        qv[[2, 5, 11]] = False
    sq, sw, sk = _leaf(*base[:3])
    _, _, _, squery, skey = _stock_layout(sq, sw, sk, base[3], base[4])
    idx, loss_stock = stock_dsa.FusedDSAIndexerLoss.apply(
        sq[:, None], sw[:, None], sk[:, None], squery, skey, SCALE, TOPK, COEFF,
        _stock_kwargs(packed).pop("mask"), sparse, PG,
        _stock_kwargs(packed).get("varlen_starts"), _stock_kwargs(packed).get("varlen_ends"), None,
        None if qv is None else qv[None], per_token, relu)
    loss_stock.backward()

    oq, ow, ok = _leaf(*base[:3])
    common = dict(relu=relu, query_valid_rows=qv, calculate_per_token_loss=per_token, chunk_rows=5)
    if sparse:
        loss = sparse_indexer_loss_reference(oq, ow, ok, base[3], base[4], idx[0], SCALE, COEFF, **common)
    else:
        s, e = _bounds(packed)
        loss = dense_indexer_loss_reference(oq, ow, ok, base[3], base[4], s, e, SCALE, COEFF, **common)
    loss.backward()
    torch.testing.assert_close(loss, loss_stock, rtol=1e-5, atol=1e-7)
    _check_grads((oq, ow, ok), (sq, sw, sk))


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("relu", [True, False])
def test_matches_stock_compute_with_padded_indices(sparse, relu):
    """Against stock's autograd path (compute_dsa_indexer_loss) with -1-padded index lists."""
    base = _inputs(1)
    g = torch.Generator().manual_seed(5)
    idx = torch.full((T, TOPK), -1, dtype=torch.int64)
    for t in range(T):  # a random visible subset, fewer than TOPK on many rows, -1 anywhere
        n = int(torch.randint(1, min(TOPK, t + 1) + 1, (1,), generator=g))
        idx[t, torch.randperm(TOPK, generator=g)[:n]] = torch.randperm(t + 1, generator=g)[:n]
    sq, sw, sk = _leaf(*base[:3])
    a, b, c, squery, skey = _stock_layout(sq, sw, sk, base[3], base[4])
    scores = stock_dsa._compute_index_scores(a, b, c, use_relu=relu)  # [1, T, T]
    loss_stock = stock_dsa.compute_dsa_indexer_loss(scores, idx[None], squery, skey, SCALE, COEFF, sparse, PG)
    loss_stock.backward()

    oq, ow, ok = _leaf(*base[:3])
    if sparse:
        loss = sparse_indexer_loss_reference(oq, ow, ok, base[3], base[4], idx.int(), SCALE, COEFF, relu=relu)
    else:
        s, e = causal_bounds(T)
        loss = dense_indexer_loss_reference(oq, ow, ok, base[3], base[4], s, e, SCALE, COEFF, relu=relu,
                                            chunk_rows=4)
    loss.backward()
    torch.testing.assert_close(loss, loss_stock, rtol=1e-5, atol=1e-7)
    _check_grads((oq, ow, ok), (sq, sw, sk))


def test_sparse_with_attention_lse_and_no_grad():
    """Feeding the attention's LSE gives the same loss; query/kv get no gradient."""
    base = _inputs(2)
    idx = stock_dsa.fused_qk_topk_naive(base[0][:, None], base[2][:, None], base[1][:, None], TOPK)[1][0]
    query, kv = base[3].clone().requires_grad_(), base[4].clone().requires_grad_()
    _, lse = sparse_mla_reference(query.detach(), kv.detach(), idx, SCALE, v_dim=16)
    q, w, k = _leaf(*base[:3])
    a = sparse_indexer_loss_reference(q, w, k, query, kv, idx, SCALE, COEFF)
    b = sparse_indexer_loss_reference(q, w, k, query, kv, idx, SCALE, COEFF, lse=lse)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    (a + b).backward()
    assert query.grad is None and kv.grad is None and q.grad is not None
    with torch.no_grad():
        c = sparse_indexer_loss_reference(*base, idx, SCALE, COEFF)
    torch.testing.assert_close(a.detach(), c, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# the kernel path: target, KL rows, loss value and gradients
# ---------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.usefixtures("nan_outputs")
@pytest.mark.parametrize("N", [3, 16, 80])  # one head block (odd), one full block, several blocks
def test_targets_match_reference(N):
    """The forward's target kernel and the attention backward's head-summed P (both unnormalised) equal the
    target spec once normalised; 0 at padding and on the fully masked row; every element written."""
    *_, query, kv, idx = loss_case(T=7, S=40, N=N, topk=18, seed=N)
    out, lse = sparse_mla_fwd(query, kv, idx, 0.2, 32)
    ref = sparse_indexer_target(query, kv, idx, 0.2, lse=lse)
    fwd = sparse_attention_target(query, kv, idx, lse, 0.2, v_dim=32)
    bwd = torch.full(idx.shape, float("nan"), dtype=torch.float32, device=DEV)
    sparse_mla_bwd(query, kv, idx, out, lse, torch.randn_like(out), None, 0.2, 32, target=bwd)
    for tgt in (fwd, bwd):
        assert torch.isfinite(tgt).all()
        torch.testing.assert_close(tgt / tgt.sum(-1, keepdim=True).clamp_min(1e-10), ref, rtol=1e-5, atol=1e-6)
        assert (tgt[3] == 0).all() and (tgt[idx < 0] == 0).all()
        torch.testing.assert_close(tgt[1, 0], torch.tensor(float(N), device=DEV))  # one key: P = 1 for every head


def test_bad_target_buffer_is_named():
    *_, query, kv, idx = loss_case(T=5, S=20, N=4, topk=8)
    out, lse = sparse_mla_reference(query, kv, idx, 0.2, v_dim=32)
    with pytest.raises(ValueError, match=r"target must be a contiguous fp32 \[5, 8\]"):
        sparse_mla_bwd(query, kv, idx, out, lse, torch.randn_like(out), None, 0.2, 32,
                       target=torch.zeros(5, 7, device=DEV))


@needs_triton
def test_kl_rows_match_reference():
    """The per-row KL kernel: raw target (normalised inside), scores with -inf padding, a row of zero target mass."""
    *_, idx = loss_case(T=6, S=30, N=4, topk=10, seed=5)
    g = torch.Generator().manual_seed(9)
    tgt = torch.rand(6, 10, generator=g).to(DEV) * (idx >= 0)
    tgt[2] = 0.0  # valid slots but zero target mass: kl 0
    sc = torch.randn(6, 10, generator=g).to(DEV).masked_fill(idx < 0, float("-inf"))
    kl, _, _ = kl_rows(tgt, sc, idx)
    tn = tgt / tgt.sum(-1, keepdim=True).clamp_min(1e-10)
    torch.testing.assert_close(kl, _kl_rows(tn, _masked_log_softmax(sc, idx >= 0), None), rtol=1e-5, atol=1e-7)


def _loss_and_grads(fn, inputs, **kw):
    q_idx, w, k_idx, query, kv, idx = inputs
    leaves = [t.clone().requires_grad_() for t in (q_idx, w, k_idx)]
    loss = fn(*leaves, query, kv, idx, 0.3, 0.05, **kw)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


@needs_triton
@pytest.mark.usefixtures("nan_outputs")
@pytest.mark.parametrize("relu,per_token,valid_rows,deterministic", [
    (True, False, True, False), (False, True, True, False), (True, False, False, True)])
def test_forward_target_loss_matches_reference(relu, per_token, valid_rows, deterministic):
    inputs = loss_case(T=7, S=33, N=5, topk=12, seed=3)
    rows = torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.bool, device=DEV) if valid_rows else None
    kw = dict(relu=relu, query_valid_rows=rows, calculate_per_token_loss=per_token)
    l1, g1 = _loss_and_grads(sparse_indexer_loss, inputs, v_dim=32, deterministic=deterministic, **kw)
    l2, g2 = _loss_and_grads(sparse_indexer_loss_reference, inputs, **kw)
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-7)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# the deferred loss (target from the attention backward) = the forward-target path
# ---------------------------------------------------------------------------------------------
def _both(inputs, relu=True, rows=None, deterministic=False, coeff=0.05, dq_over_q=False):
    """(value, out, lse, attention grads, indexer grads) of the forward-target path and of the deferred one, on
    the same loss scalar: (out * dout).sum() + coeff * loss."""
    q_idx, w, k_idx, query, kv, idx = inputs
    scale, v = 0.25, (512 if query.shape[-1] == 576 else 32)
    torch.manual_seed(7)
    dout = torch.randn(query.shape[0], query.shape[1], v, dtype=query.dtype, device=query.device)
    res = []
    for deferred in (False, True):
        ql, wl, kl = (t.clone().requires_grad_() for t in (q_idx, w, k_idx))
        qa, kva = query.clone().requires_grad_(), kv.clone().requires_grad_()
        seen = []
        if deferred:
            out, lse, loss = sparse_mla_with_indexer_loss(
                qa * 1.0 if dq_over_q else qa, kva, idx, scale, ql, wl, kl, v_dim=v, relu=relu, row_mask=rows,
                on_value=seen.append, deterministic=deterministic, dq_over_q=dq_over_q)
            assert loss.item() == 0.0 and not seen  # no value before the backward
        else:
            out, lse = sparse_mla(qa, kva, idx, scale, v_dim=v, deterministic=deterministic)
            loss = sparse_indexer_loss(ql, wl, kl, qa, kva, idx, scale, 1.0, relu=relu, lse=lse,
                                       query_valid_rows=rows, calculate_per_token_loss=True, v_dim=v,
                                       deterministic=deterministic)
            seen.append(loss.detach())
        ((out.float() * dout.float()).sum() + coeff * loss).backward()
        assert len(seen) == 1
        res.append((seen[0], out.detach(), lse.detach(), [t.grad for t in (qa, kva)], [t.grad for t in (ql, wl, kl)]))
    return res


@needs_triton
@pytest.mark.usefixtures("nan_outputs")
@pytest.mark.parametrize("N,relu,masked,deterministic,dq_over_q", [
    (5, True, False, False, False), (5, False, True, False, False), (20, True, False, True, True)],
    ids=["relu", "identity-row-mask", "20-heads-deterministic-dq-over-q"])
def test_deferred_loss_equals_forward_target_path(N, relu, masked, deterministic, dq_over_q):
    inputs = loss_case(T=7, S=33, N=N, topk=12, seed=3)
    rows = torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.float32, device=DEV) if masked else None
    (v1, o1, l1, a1, i1), (v2, o2, l2, a2, i2) = _both(inputs, relu=relu, rows=rows, deterministic=deterministic,
                                                         dq_over_q=dq_over_q)
    assert v1.item() > 0
    torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-7)
    assert torch.equal(o2, o1) and torch.equal(l2, l1)
    for a, b in zip(a2, a1):  # attention gradients: the same kernels
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(i2, i1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@needs_triton
def test_deferred_loss_reference_path_equals_kernel_path():
    """On plain CPU tensors the op runs its PyTorch spec (deferred._reference): same output, LSE, reported value
    and gradients as the kernel path; the returned loss is 0-valued on both."""
    from hyscale_kernels.indexer_loss import deferred

    q_idx, w, k_idx, query, kv, idx = loss_case(T=7, S=33, N=5, topk=12, seed=4)
    dout = torch.randn(7, 5, 32, generator=torch.Generator().manual_seed(2))
    res = []
    for fn in (sparse_mla_with_indexer_loss, lambda *a, **kw: deferred._reference(
            *a, 32, True, None, None, kw["on_value"])):
        ql, wl, kl = (t.clone().requires_grad_() for t in (q_idx, w, k_idx))
        qa, kva = query.clone().requires_grad_(), kv.clone().requires_grad_()
        seen = []
        out, lse, loss = fn(qa, kva, idx, 0.25, ql, wl, kl, v_dim=32, on_value=seen.append)
        assert loss.item() == 0.0
        ((out.float() * dout).sum() + 0.05 * loss).backward()
        res.append((seen[0], out.detach(), lse.detach(), [t.grad for t in (qa, kva, ql, wl, kl)]))
    (v1, o1, l1, g1), (v2, o2, l2, g2) = res
    assert v1.item() > 0
    torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@needs_triton
def test_deferred_loss_errors():
    q_idx, w, k_idx, query, kv, idx = loss_case(T=5, S=20, N=4, topk=8)
    ql = q_idx.clone().requires_grad_()
    out, _, loss = sparse_mla_with_indexer_loss(query, kv, idx, 0.2, ql, w, k_idx, v_dim=32)
    with pytest.raises(RuntimeError, match="before \\(or without\\) the attention"):
        loss.backward()  # the attention output is not part of this backward: no target
    with pytest.raises(ValueError, match="k_idx must be"):
        sparse_mla_with_indexer_loss(query, kv, idx, 0.2, ql, w, k_idx[:-1], v_dim=32)
    with pytest.raises(ValueError, match="w must be"):
        sparse_mla_with_indexer_loss(query, kv, idx, 0.2, ql, w[:, :2], k_idx, v_dim=32)
    with pytest.raises(ValueError, match="row_mask must be"):
        sparse_mla_with_indexer_loss(query, kv, idx, 0.2, ql, w, k_idx, v_dim=32, row_mask=torch.ones(3, device=DEV))
    with pytest.raises(ValueError, match="indices must be in"):
        sparse_mla_with_indexer_loss(query, kv, idx + 100, 0.2, ql, w, k_idx, v_dim=32)


@pytest.mark.gpu
def test_gpu_deferred_loss_bf16():
    """bf16 at a real shape (T 4096, N 128: two head blocks adding into the target, k 2048): the backward's
    target (bf16-stored P summed in fp32) against the target kernel's (fp32 P), then the deferred loss
    against the forward-target path."""
    T, S, N, K = 4096, 8192, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    q_idx = torch.randn(T, 64, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(T, 64, device="cuda", generator=g).bfloat16()
    k_idx = torch.randn(S, 128, device="cuda", generator=g).bfloat16()
    query = torch.randn(T, N, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(S, 576, device="cuda", generator=g).bfloat16()
    idx = torch.argsort(torch.rand(T, S, device="cuda", generator=g), dim=1)[:, :K].int()
    idx[:64, 1000:] = -1
    out, lse = sparse_mla_fwd(query, kv, idx, 0.25, 512)
    tgt = torch.full(idx.shape, float("nan"), device="cuda")
    sparse_mla_bwd(query, kv, idx, out, lse, torch.randn_like(out), None, 0.25, 512, target=tgt)
    ref = sparse_attention_target(query, kv, idx, lse, 0.25)
    assert torch.isfinite(tgt).all() and rel_l2(tgt, ref) < 2e-3, rel_l2(tgt, ref)
    del out, lse, tgt, ref
    (v1, _, _, a1, i1), (v2, _, _, a2, i2) = _both([q_idx, w, k_idx, query, kv, idx], coeff=1.0)
    torch.testing.assert_close(v2, v1, rtol=2e-3, atol=1e-6)
    for a, b in zip(a2, a1):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-3)
    for a, b in zip(i2, i1):  # bf16 gradients: a few elements differ by one bf16 ulp (the target's bf16 P)
        assert rel_l2(a, b) < 5e-3
