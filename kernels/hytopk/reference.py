"""Plain-PyTorch specification of the lightning-indexer scores and exact top-k selection.

Scores (DeepSeek Sparse Attention "lightning indexer"):

    I[t, s] = sum_h w[t, h] * act(q[t, h, :] . k[s, :])      act = ReLU or identity

Selection for query row t: the ``topk`` largest I[t, s] over the visible keys
``starts[t] <= s < ends[t]`` under the canonical tie rule (score descending, then key index
ascending). Rows with fewer than ``topk`` visible keys are padded with -1 (score -inf).

Everything is computed in fp32 and chunked over query rows, so memory stays O(T * topk) plus
one bounded [rows, S] chunk: these functions run at 8K+ tokens on a CPU.
"""

from __future__ import annotations

import torch

from .._common import row_chunk

NEG_INF = float("-inf")


def index_scores_reference(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, relu: bool = True) -> torch.Tensor:
    """Full score table, fp32 [T, S]. Only for small shapes and tests.

    q: [T, H, D], w: [T, H], k: [S, D] (any float dtype; computed in fp32).
    """
    s = torch.einsum("thd,sd->ths", q.float(), k.float())
    if relu:
        s = s.relu()
    return torch.einsum("ths,th->ts", s, w.float())


def _visible_mask(starts: torch.Tensor, ends: torch.Tensor, S: int) -> torch.Tensor:
    cols = torch.arange(S, device=starts.device)
    return (cols[None, :] >= starts[:, None].long()) & (cols[None, :] < ends[:, None].long())


def topk_from_scores(scores: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, topk: int):
    """Canonical top-k of an fp32 score table [T, S] restricted to [starts, ends).

    Returns (indices int32 [T, topk], scores fp32 [T, topk]), ordered by (score desc, index asc),
    -1 / -inf padded.
    """
    T, S = scores.shape
    masked = scores.float().masked_fill(~_visible_mask(starts, ends, S), NEG_INF)
    # A stable descending sort keeps equal scores in ascending key order: the canonical tie rule.
    vals, idx = torch.sort(masked, dim=-1, descending=True, stable=True)
    kk = min(topk, S)
    vals, idx = vals[:, :kk], idx[:, :kk]
    n_visible = (ends.long() - starts.long()).clamp(min=0, max=S)
    pad = torch.arange(kk, device=scores.device)[None, :] >= n_visible[:, None]
    idx = idx.masked_fill(pad, -1).to(torch.int32)
    vals = vals.masked_fill(pad, NEG_INF)
    if kk < topk:
        idx = torch.cat([idx, idx.new_full((T, topk - kk), -1)], dim=1)
        vals = torch.cat([vals, vals.new_full((T, topk - kk), NEG_INF)], dim=1)
    return idx, vals


def hytopk_reference(
    q: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    topk: int,
    relu: bool = True,
    return_scores: bool = False,
    chunk_rows: int | None = None,
):
    """Exact top-k of the indexer scores, chunked over query rows.

    Args:
        q: [T, H, D] index queries. w: [T, H] head weights. k: [S, D] index keys.
        starts, ends: int [T], visible keys of row t are ``starts[t] <= s < ends[t]``.
        topk: number of keys per row (rows with fewer visible keys are -1 padded).
    Returns:
        indices int32 [T, topk] in canonical order, and with ``return_scores`` also the
        selected scores fp32 [T, topk] (-inf where padded).
    """
    T, S = q.shape[0], k.shape[0]
    rows = chunk_rows or row_chunk(S * max(1, q.shape[1]) // 4 + S)
    out_i = torch.empty(T, topk, dtype=torch.int32, device=q.device)
    out_s = torch.empty(T, topk, dtype=torch.float32, device=q.device)
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        sc = index_scores_reference(q[r0:r1], w[r0:r1], k, relu)
        out_i[r0:r1], out_s[r0:r1] = topk_from_scores(sc, starts[r0:r1], ends[r0:r1], topk)
    return (out_i, out_s) if return_scores else out_i


def causal_bounds(T: int, S: int | None = None, device=None, offset: int = 0):
    """int32 bounds for causal rows: row t sees keys [0, offset + t + 1) (clamped to S)."""
    S = T + offset if S is None else S
    t = torch.arange(T, device=device, dtype=torch.int64)
    starts = torch.zeros(T, dtype=torch.int32, device=device)
    ends = (t + offset + 1).clamp(max=S).to(torch.int32)
    return starts, ends


def packed_causal_bounds(seq_lens, device=None):
    """int32 bounds for packed causal sequences laid end to end (THD / varlen)."""
    starts, ends, base = [], [], 0
    for n in seq_lens:
        t = torch.arange(n, dtype=torch.int64)
        starts.append(torch.full((n,), base, dtype=torch.int64))
        ends.append(base + t + 1)
        base += n
    return (torch.cat(starts).to(device=device, dtype=torch.int32),
            torch.cat(ends).to(device=device, dtype=torch.int32))
