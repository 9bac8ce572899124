"""The reference top-k is the spec: it must equal a full sort under the canonical tie rule."""

import pytest
import torch

from hyscale_megatron.ops import causal_bounds, hytopk_reference, index_scores_reference, packed_causal_bounds


def _full_sort_topk(scores, starts, ends, k):
    """Independent spec: Python sort of (−score, index) over visible keys, -1 padded."""
    out = []
    for t in range(scores.shape[0]):
        vis = [(-float(scores[t, s]), s) for s in range(int(starts[t]), int(ends[t]))]
        vis.sort()
        row = [s for _, s in vis[:k]]
        out.append(row + [-1] * (k - len(row)))
    return torch.tensor(out, dtype=torch.int32)


def _inputs(T, S, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g), torch.randn(S, D, generator=g)


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("T,S,k", [(37, 37, 8), (20, 53, 64), (64, 64, 16)])
def test_reference_equals_full_sort(T, S, k, relu):
    q, w, kk = _inputs(T, S, 4, 16, seed=T + S + k)
    starts, ends = causal_bounds(T, S, offset=S - T)
    idx, vals = hytopk_reference(q, w, kk, starts, ends, k, relu=relu, return_scores=True, chunk_rows=7)
    scores = index_scores_reference(q, w, kk, relu)
    assert torch.equal(idx, _full_sort_topk(scores, starts, ends, k))
    valid = idx >= 0
    assert torch.equal(vals[valid], scores.gather(1, idx.clamp(min=0).long())[valid])
    assert torch.isinf(vals[~valid]).all() and (vals[~valid] < 0).all()


def test_tie_heavy_rows_follow_the_canonical_rule():
    T, S, H, D, k = 30, 30, 4, 8, 6
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=g).abs()          # every head positive ...
    kk = -torch.rand(S, D, generator=g)                  # ... against negative keys: q.k < 0
    kk[::5] = torch.rand(S // 5, D, generator=g)         # every 5th key scores > 0
    w = torch.rand(T, H, generator=g)
    scores = index_scores_reference(q, w, kk, relu=True)
    assert (scores == 0).float().mean() > 0.6, "inputs should be dominated by exact zero ties"
    starts, ends = causal_bounds(T)
    idx = hytopk_reference(q, w, kk, starts, ends, k, relu=True)
    assert torch.equal(idx, _full_sort_topk(scores, starts, ends, k))
    # among tied zeros the smallest key indices win
    row = idx[T - 1].tolist()
    positives = [s for s in range(0, T, 5)][:k]
    assert row[: len(positives)] == sorted(positives, key=lambda s: (-float(scores[T - 1, s]), s))


def test_rows_with_few_visible_keys_and_fully_masked_rows():
    T, S, k = 12, 12, 5
    q, w, kk = _inputs(T, S, 4, 8, seed=3)
    starts, ends = causal_bounds(T)
    starts[4], ends[4] = 6, 6           # fully masked row
    starts[7], ends[7] = 2, 4           # two visible keys
    idx = hytopk_reference(q, w, kk, starts, ends, k)
    assert (idx[4] == -1).all()
    assert sorted(idx[7][:2].tolist()) == [2, 3] and (idx[7][2:] == -1).all()
    assert (idx[0][1:] == -1).all() and idx[0][0] == 0
    scores = index_scores_reference(q, w, kk)
    assert torch.equal(idx, _full_sort_topk(scores, starts, ends, k))


def test_packed_sequences_and_topk_larger_than_keys():
    lens = [5, 9, 3]
    T = sum(lens)
    q, w, kk = _inputs(T, T, 4, 8, seed=4)
    starts, ends = packed_causal_bounds(lens)
    k = 32  # larger than every row's visible keys and than S: valid, -1 padded
    idx = hytopk_reference(q, w, kk, starts, ends, k)
    assert idx.shape == (T, k)
    for t in range(T):
        sel = sorted(i for i in idx[t].tolist() if i >= 0)
        assert sel == list(range(int(starts[t]), int(ends[t])))


@pytest.mark.slow
def test_reference_runs_at_8k_tokens():
    T = S = 8192
    q, w, kk = _inputs(T, S, 8, 32, seed=5)
    starts, ends = causal_bounds(T)
    idx = hytopk_reference(q, w, kk, starts, ends, 64)
    assert idx.shape == (T, 64) and (idx[-1] >= 0).all() and (idx[10, 11:] == -1).all()
