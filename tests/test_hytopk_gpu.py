"""HyTopK on the GPU at real shapes (``-m gpu``): bf16 inputs, H_I 4..128, topk up to 2048, causal / CP-offset /
compressed / packed rows, near ties; every launch deterministic run to run, and the compiles the product chooses
between (ballot or mask-sum slots, 8 or 4 rows per tile, interpolation or radix search, warm start or not) giving
the same selections. Rows are checked against the reference on a sample (the full [T, S] reference is too large).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _hytopk_helpers import (
    assert_canonical,
    assert_reference_sets,
    by_index,
    gpu_causal_inputs,
    inputs,
    near_tie_inputs,
    needs_cuda,
    same_up_to_rounding,
    sample_rows,
    stale_outputs,  # noqa: F401  (autouse fixture)
)

from hyscale_kernels.hytopk import hytopk
from hyscale_kernels.hytopk.op import default_config, warm_stats
from hyscale_kernels.hytopk.reference import causal_bounds, packed_causal_bounds

pytestmark = [pytest.mark.gpu, needs_cuda]


@pytest.mark.parametrize("T,S,H,topk,relu,ratio", [
    (4096, 4096, 64, 2048, True, 1),
    (3000, 5000, 32, 2048, False, 1),  # the last 3000 rows of 5000 keys (a context-parallel offset), identity
    (6000, 6000, 16, 2048, True, 1),
    (5000, 5000, 8, 1024, False, 1),
    (8192, 2048, 4, 512, True, 4),  # compressed keys: row t sees (t + 1) // 4 of them
    (3000, 3000, 128, 2048, True, 1),  # 2 rows per tile: the (row, head) column order
])
def test_matches_reference(T, S, H, topk, relu, ratio):
    q, w, k = inputs(T, S, H, D=128, seed=T, dtype=torch.bfloat16, device="cuda", w_sign=not relu)
    if ratio == 1:
        st, en = causal_bounds(T, S, offset=S - T, device="cuda")
    else:
        t = torch.arange(T, device="cuda")
        st, en = torch.zeros_like(t, dtype=torch.int32), ((t + 1) // ratio).to(torch.int32)
    idx, val = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True)
    assert torch.equal(idx, hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True)[0]), "two runs differ"
    rows = sample_rows(T)
    assert_reference_sets(q[rows].float(), w[rows].float(), k.float(), st[rows], en[rows], topk, relu, idx[rows],
                          val[rows])


def test_packed_segments_and_masked_rows():
    lens = [1000, 3000, 77, 2500]
    st, en = packed_causal_bounds(lens, device="cuda")
    T = sum(lens)
    en[1500] = st[1500]  # a masked row
    q, w, k = inputs(T, T, 64, D=128, seed=2, dtype=torch.bfloat16, device="cuda", w_sign=False)
    idx = hytopk(q, w, k, st, en, 2048, return_scores=True)[0]
    assert (idx[1500] == -1).all()
    rows = torch.arange(0, T, 97, device="cuda")
    assert_reference_sets(q[rows].float(), w[rows].float(), k.float(), st[rows], en[rows], 2048, True, idx[rows])


@pytest.mark.parametrize("topk", [512, 2048])
def test_near_ties_exact(topk):
    """fp32 scores that are exact (k's values, one head of weight +-1; fp32 inputs multiply in IEEE fp32): many
    ties and last-bit differences, both signs. The sampled rows equal the reference exactly, scores included."""
    T, S = 4096, 6000
    q, w, k = (x.cuda() for x in near_tie_inputs(T, S, H=4, D=128, spread=16, seed=1))
    st = torch.zeros(T, dtype=torch.int32, device="cuda")
    en = torch.full((T,), S, dtype=torch.int32, device="cuda")
    idx, val = hytopk(q, w, k, st, en, topk, relu=False, return_scores=True)
    assert torch.equal(idx, hytopk(q, w, k, st, en, topk, relu=False, return_scores=True)[0]), "two runs differ"
    rows = torch.arange(0, T, 257, device="cuda")
    assert_canonical(q[rows].cpu(), w[rows].cpu(), k.cpu(), st[rows].cpu(), en[rows].cpu(), topk, False, idx[rows],
                     val[rows])


@pytest.mark.parametrize("name,H,relu,other", [
    ("ballot vs sum slots", 64, True, dict(slots="sum")),
    ("ballot vs sum slots, 8 rows", 32, False, dict(slots="sum")),
    ("8 rows vs 4 rows", 16, True, dict(rows=4, select_split=1)),
    ("interp vs radix search", 64, True, dict(kth_search="radix")),
    ("warm start vs off", 32, True, dict(warm_start=0)),
])
def test_compiles_agree(name, H, relu, other):
    """k 2048 at 8K causal rows (warm start, compactions): the default launch and another compile the product uses
    give the same indices and scores (rows compared by key index: the buffer order may differ), each run twice."""
    q, w, k, st, en = gpu_causal_inputs(8192, H, seed=H, w_sign=not relu)
    base = default_config(H, 2048)
    out = {}
    for label, cfg in (("default", base), ("other", replace(base, **other))):
        i1, v1 = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=cfg)
        i2 = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=cfg)[0]
        assert torch.equal(i1, i2), f"{label}: two runs differ"
        out[label] = (i1, v1)
    if name == "warm start vs off":
        hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=base)
        assert warm_stats()["warm_rows"] > 0
    (ai, av), (bi, bv) = by_index(*out["default"]), by_index(*out["other"])
    assert torch.equal(ai, bi), f"{name}: index sets differ in {int((ai != bi).any(1).sum())} rows"
    assert torch.equal(av, bv), f"{name}: scores differ in {int((av != bv).any(1).sum())} rows"
    rows = sample_rows(8192, n=24)
    assert_reference_sets(q[rows].float(), w[rows].float(), k.float(), st[rows], en[rows], 2048, relu, ai[rows],
                          av[rows])


@pytest.mark.parametrize("H", [64, 16])
def test_bf16_head_weights(H):
    """Megatron's head weights are bf16: ballot and mask-sum slots compile the fp32 head sum into different FMA
    chains, so scores may differ in the last bits and a near-tie at a row's k-th score may swap; both are the
    reference's sets up to such rounding."""
    q, w, k, st, en = gpu_causal_inputs(8192, H, seed=5)
    w = w.bfloat16()
    base = default_config(H, 2048)
    a = hytopk(q, w, k, st, en, 2048, return_scores=True, config=base)
    b = hytopk(q, w, k, st, en, 2048, return_scores=True, config=replace(base, slots="sum"))
    assert torch.equal(a[0], hytopk(q, w, k, st, en, 2048, return_scores=True, config=base)[0]), "two runs differ"
    same_up_to_rounding(q, w, k, st, en, 2048, True, a, b, ("ballot", "sum"))
