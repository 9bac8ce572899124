"""Heads sharded over two tensor-parallel ranks (gloo, CPU, Triton interpreter): the sparse-stage loss target is
all-reduced, so every rank sees the loss value and indexer gradients of the unsharded layer, for the forward
path (target kernel in the forward) and the deferred one (target from the attention backward), also with the
deferred loss's rows split over the ranks (tp_split_rows: each rank the KL and indexer backward of its share of
the rows, gradients gathered). One pair of rank processes runs every configuration."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU processes running the Triton interpreter")

T, S, N, K, V = 6, 24, 8, 8, 32
# (name, deferred, tp_split_rows, query rows): T + 1 = 7 rows split 4 / 3 (the gather pads); 1 row: rank 1 has none
CONFIGS = [("forward", False, False, T), ("deferred", True, False, T), ("deferred-split-odd-rows", True, True, T + 1),
           ("deferred-split-one-row", True, True, 1)]


def _inputs(rows):
    g = torch.Generator().manual_seed(0)
    q_idx, w = torch.randn(rows, 4, 16, generator=g), torch.randn(rows, 4, generator=g)
    k_idx = torch.randn(S, 16, generator=g)
    query, kv = torch.randn(rows, N, 48, generator=g), torch.randn(S, 48, generator=g)
    idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(rows)]).int()
    idx[min(2, rows - 1), 3:] = -1  # padding in a row
    dout = torch.randn(rows, N, V, generator=g)
    return q_idx, w, k_idx, query, kv, idx, dout


def _run(deferred, heads, group, split, rows):
    """(value, indexer grads, dq of these heads, dkv) for the attention over ``heads``."""
    from hyscale_kernels.indexer_loss.deferred import sparse_mla_with_indexer_loss
    from hyscale_kernels.indexer_loss.fused import sparse_indexer_loss
    from hyscale_kernels.sparse_mla import sparse_mla

    q_idx, w, k_idx, query, kv, idx, dout = _inputs(rows)
    leaves = [t.clone().requires_grad_() for t in (q_idx, w, k_idx)]
    qa, kva = query[:, heads].clone().requires_grad_(), kv.clone().requires_grad_()
    seen = []
    if deferred:
        out, _, loss = sparse_mla_with_indexer_loss(qa, kva, idx, 0.3, *leaves, v_dim=V, tp_group=group,
                                                    on_value=seen.append, tp_split_rows=split)
    else:
        out, lse = sparse_mla(qa, kva, idx, 0.3, v_dim=V)
        loss = sparse_indexer_loss(*leaves, qa, kva, idx, 0.3, 1.0, lse=lse, calculate_per_token_loss=True,
                                   tp_group=group, v_dim=V)
        seen.append(loss.detach())
    ((out * dout[:, heads]).sum() + loss).backward()
    return dict(value=seen[0], grads=[t.grad for t in leaves], dq=qa.grad, dkv=kva.grad)


def _worker(rank, path, result_path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        from hyscale_kernels.indexer_loss import deferred as deferred_mod

        calls = []  # the split path really ran (the results alone would also match without it)
        orig = deferred_mod._split_rows_backward
        deferred_mod._split_rows_backward = lambda *a: calls.append(1) or orig(*a)
        heads = list(range(rank * N // 2, (rank + 1) * N // 2))
        group = dist.new_group([0, 1])
        res = {}
        for name, deferred, split, rows in CONFIGS:
            n = len(calls)
            res[name] = dict(_run(deferred, heads, group, split, rows), split_calls=len(calls) - n)
        torch.save(res, f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_tp_sharded_heads_match_unsharded():
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(os.path.join(d, "init"), os.path.join(d, "res")), nprocs=2,
                           start_method="spawn")
        res = [torch.load(os.path.join(d, f"res.{r}")) for r in range(2)]
    for name, deferred, split, rows in CONFIGS:
        want = _run(deferred, list(range(N)), None, False, rows)
        for r in range(2):
            got = res[r][name]
            assert got["split_calls"] == int(split), name
            torch.testing.assert_close(got["value"], want["value"], rtol=1e-5, atol=1e-7, msg=name)
            for a, b in zip(got["grads"], want["grads"]):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7, msg=name)
            torch.testing.assert_close(got["dq"], want["dq"][:, r * N // 2:(r + 1) * N // 2], rtol=1e-5, atol=1e-6,
                                       msg=name)
        torch.testing.assert_close(res[0][name]["dkv"] + res[1][name]["dkv"], want["dkv"], rtol=1e-5, atol=1e-6,
                                   msg=name)
