"""HyTopK's warm start is exact and the launch deterministic: a row's sampled starting threshold changes nothing in
its output, and a row whose sample overestimates its top-k boundary is re-run from -inf (tests/_hytopk_helpers.py
says how the CPU runs)."""

from __future__ import annotations

from dataclasses import replace

import torch
from _hytopk_helpers import assert_reference_sets, by_index, inputs, interp, interp_config, warm_sample_positions
from _hytopk_helpers import stale_outputs  # noqa: F401  (autouse fixture)

from hyscale_kernels.hytopk import hytopk
from hyscale_kernels.hytopk.op import geometry, warm_stats
from hyscale_kernels.hytopk.reference import causal_bounds


@interp
def test_warm_start_changes_nothing():
    """Rows longer than the buffers start from a sampled threshold: the same indices and scores as with the warm
    start off (rows compared by key index: the buffer order follows the thresholds), twice the same output, the
    reference's sets."""
    T, S, H, topk = 6, 256, 2, 12
    q, w, k = inputs(T, S, H, seed=4)
    st, en = causal_bounds(T, S, offset=S - T)
    cfg = interp_config(H, topk)
    idx, val = hytopk(q, w, k, st, en, topk, return_scores=True, config=cfg)
    assert warm_stats() == dict(warm_rows=T, fallback_rows=0, fallback_blocks=0)
    assert torch.equal(hytopk(q, w, k, st, en, topk, config=cfg), idx), "two runs differ"
    c_idx, c_val = hytopk(q, w, k, st, en, topk, return_scores=True, config=replace(cfg, warm_start=0))
    assert warm_stats()["warm_rows"] == 0
    assert torch.equal(by_index(idx, val)[0], by_index(c_idx, c_val)[0])
    assert torch.equal(by_index(idx, val)[1], by_index(c_idx, c_val)[1])
    assert_reference_sets(q, w, k, st, en, topk, True, idx, val)


@interp
def test_overestimating_sample_falls_back():
    """The sampled keys are huge (11 of them) or score exactly 0, so the sample's quantile overestimates the rows'
    top-k boundary: rank j = 10 of 64 samples leaves 10 < topk = 12 keys above the threshold. Odd rows re-run
    from -inf (their answer needs a key the sample never saw); even rows (q negated: every sample scores 0 after the
    ReLU, so their threshold admits every key) keep their buffers while their neighbours re-run."""
    T, S, H, topk = 6, 256, 2, 12
    warm = geometry(16, topk, interp_config(H, topk)).warm
    g = torch.Generator().manual_seed(7)
    q = torch.rand(T, H, 16, generator=g) + 0.1
    w = torch.rand(T, H, generator=g) + 0.1
    k = torch.randn(S, 16, generator=g)
    pos = warm_sample_positions(0, S, warm)
    step = warm // 11
    for i, p in enumerate(pos):
        k[p] = 100.0 * (torch.rand(16, generator=g) + 0.1) if i % step == 0 and i // step < 11 else 0.0
    q[::2] = -q[::2]
    st = torch.zeros(T, dtype=torch.int32)
    en = torch.full((T,), S, dtype=torch.int32)
    idx, val = hytopk(q, w, k, st, en, topk, return_scores=True, config=interp_config(H, topk))
    assert warm_stats() == dict(warm_rows=T, fallback_rows=T // 2, fallback_blocks=T // 2)
    assert_reference_sets(q, w, k, st, en, topk, True, idx, val)
    assert all(len(set(r.tolist()) - set(pos)) == 1 for r in idx[1::2]), "one key outside the sample"
