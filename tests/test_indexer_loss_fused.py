"""Kernel path of the sparse-stage indexer loss vs its reference (Triton interpreter on CPU)."""

import pytest
import torch

from hyscale_kernels.indexer_loss.fused import sparse_indexer_loss
from hyscale_kernels.indexer_loss.reference import sparse_indexer_loss_reference, sparse_indexer_target
from hyscale_kernels.indexer_loss.target import sparse_attention_target
from hyscale_kernels.sparse_mla.reference import sparse_mla_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(T, S, N, topk, H=4, D=16, dqk=48, v=32, seed=0, pad=True):
    g = torch.Generator().manual_seed(seed)
    q_idx = torch.randn(T, H, D, generator=g)
    w = torch.randn(T, H, generator=g)
    k_idx = torch.randn(S, D, generator=g)
    query = torch.randn(T, N, dqk, generator=g)
    kv = torch.randn(S, dqk, generator=g)
    idx = torch.stack([torch.randperm(S, generator=g)[:topk] for _ in range(T)]).to(torch.int32)
    if pad:
        idx[1, 2:] = -1          # row with two keys
        idx[3, :] = -1           # fully masked row
    return [t.to(DEV) for t in (q_idx, w, k_idx, query, kv, idx)], v


@pytest.mark.parametrize("N", [3, 16, 80])  # one head block, odd heads, two head blocks (atomics)
def test_target_kernel_matches_reference(N):
    (q_idx, w, k_idx, query, kv, idx), v = _inputs(T=6, S=40, N=N, topk=20)
    _, lse = sparse_mla_reference(query, kv, idx, 0.2, v_dim=v)
    out = sparse_attention_target(query, kv, idx, lse, 0.2, v_dim=v)
    ref = sparse_indexer_target(query, kv, idx, 0.2, lse=lse)
    out_n = out / out.sum(-1, keepdim=True).clamp_min(1e-10)
    torch.testing.assert_close(out_n, ref, rtol=1e-5, atol=1e-6)
    assert (out[3] == 0).all() and (out[1, 2:] == 0).all()


def test_target_kernel_launch_config():
    """config overrides the launch (bench/target_sweep.py): 16 heads per program at N = 80 (five head
    blocks adding into one row) gives the default's target; unknown keys and bad block_h are refused."""
    (q_idx, w, k_idx, query, kv, idx), v = _inputs(T=6, S=40, N=80, topk=20, seed=4)
    _, lse = sparse_mla_reference(query, kv, idx, 0.2, v_dim=v)
    base = sparse_attention_target(query, kv, idx, lse, 0.2, v_dim=v)
    small = sparse_attention_target(query, kv, idx, lse, 0.2, v_dim=v, config=dict(block_h=16, num_warps=4))
    torch.testing.assert_close(small, base, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="unknown config keys"):
        sparse_attention_target(query, kv, idx, lse, 0.2, v_dim=v, config=dict(block_n=64))
    with pytest.raises(ValueError, match="block_h must be a power of two"):
        sparse_attention_target(query, kv, idx, lse, 0.2, v_dim=v, config=dict(block_h=24))


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("per_token", [False, True])
def test_fused_loss_value_and_grads_match_reference(relu, per_token):
    (q_idx, w, k_idx, query, kv, idx), v = _inputs(T=7, S=33, N=5, topk=12, seed=3)
    rows = torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.bool, device=DEV)
    outs = []
    for fn in (sparse_indexer_loss, sparse_indexer_loss_reference):
        leaves = [t.clone().requires_grad_() for t in (q_idx, w, k_idx)]
        kw = dict(relu=relu, query_valid_rows=rows, calculate_per_token_loss=per_token)
        if fn is sparse_indexer_loss:
            kw["v_dim"] = v
        loss = fn(*leaves, query, kv, idx, 0.3, 0.05, **kw)
        loss.backward()
        outs.append((loss.detach(), [t.grad for t in leaves]))
    (l1, g1), (l2, g2) = outs
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-7)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("deterministic", [False, True])
def test_fused_kl_no_valid_rows_mask_and_deterministic(deterministic):
    """No query_valid_rows (mean over all rows), padded + fully masked rows, both dk reductions,
    and the per-row KL op against the reference's row formula."""
    from hyscale_kernels.indexer_loss.kl import kl_rows
    from hyscale_kernels.indexer_loss.reference import _kl_rows, _masked_log_softmax

    (q_idx, w, k_idx, query, kv, idx), v = _inputs(T=6, S=30, N=4, topk=10, seed=5)
    outs = []
    for fn in (sparse_indexer_loss, sparse_indexer_loss_reference):
        leaves = [t.clone().requires_grad_() for t in (q_idx, w, k_idx)]
        kw = dict(v_dim=v, deterministic=deterministic) if fn is sparse_indexer_loss else {}
        loss = fn(*leaves, query, kv, idx, 0.3, 1.0, **kw)
        loss.backward()
        outs.append((loss.detach(), [t.grad for t in leaves]))
    (l1, g1), (l2, g2) = outs
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-7)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    # the row kernel alone: raw target (normalised inside), scores with -inf padding
    g = torch.Generator().manual_seed(9)
    tgt = torch.rand(6, 10, generator=g).to(DEV) * (idx >= 0)
    tgt[2] = 0.0  # valid slots but zero target mass: kl 0
    sc = torch.randn(6, 10, generator=g).to(DEV).masked_fill(idx < 0, float("-inf"))
    kl, _, _ = kl_rows(tgt, sc, idx)
    tn = tgt / tgt.sum(-1, keepdim=True).clamp_min(1e-10)
    ref = _kl_rows(tn, _masked_log_softmax(sc, idx >= 0), None)
    torch.testing.assert_close(kl, ref, rtol=1e-5, atol=1e-7)
