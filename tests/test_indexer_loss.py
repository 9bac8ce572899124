"""Indexer KL loss reference == stock megatron-core 0.19.2 (value and indexer gradients)."""

from __future__ import annotations

import types

import pytest
import torch

from megatron.core.transformer.experimental_attention_variant import dsa as stock_dsa

from hyscale_kernels.hytopk.reference import causal_bounds, packed_causal_bounds
from hyscale_kernels.indexer_loss.reference import dense_indexer_loss_reference, sparse_indexer_loss_reference
from hyscale_kernels.sparse_mla.reference import sparse_mla_reference

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
