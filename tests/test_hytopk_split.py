"""HyTopK's Config.select_split: the selects (compactions, the head sample's filter, the final select) run on a row
block's even rows, then its odd rows, so each holds [rows / 2, CAP] keys in registers (8-row tiles at topk 2048 spill
otherwise). The output must equal the unsplit launch's bit for bit (order included: each row's select is the same)
and the reference's sets; a spy checks that the split path ran.

CPU: the interpreter at tiny fp32 shapes with 8 query rows per program (rows_x_heads = 8 H), append="warps", small
buffers (compactions in the key loop), warm start on and off, the head warm sample. GPU: 8-row tiles at H 32 and 16
(the defaults), k 2048.
"""

from __future__ import annotations

import pytest
import torch

from hyscale_kernels.hytopk import hytopk, interpreter_active, op
from hyscale_kernels.hytopk.op import Config, default_config
from hyscale_kernels.hytopk.reference import causal_bounds
from interp_rerun import rerun_under_interpreter
from test_hytopk_warmstart import _assert_reference_sets, _inputs
from test_hytopk_warps import (_spy, by_index, gpu_causal_inputs, packed_rows_case, same_up_to_rounding,
                               zero_ties_case)

INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")


def _cfg(H, **kw):
    """8 query rows per program (rows_x_heads = 8 H), the "warps" append, small buffers, for the interpreter."""
    return op.replace(Config(block_n=16, rows_x_heads=8 * H, num_warps=1, num_stages=1, programs_per_sm=1,
                             min_free_tiles=1, sel_chunk=64, warm_start=0, kth_search="interp", append="warps"), **kw)


def _check(q, w, k, st, en, topk, relu, cfg, halves):
    """select_split 2 equals select_split 1 exactly (indices in order, scores) and gives the reference's sets."""
    base_i, base_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=op.replace(cfg, select_split=1))
    assert not halves, "select_split=1 must not split the rows"
    got_i, got_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=op.replace(cfg, select_split=2))
    assert halves, "the split path did not run"
    assert not torch.isnan(got_v).any(), "unwritten output scores"
    assert torch.equal(got_i, base_i), f"indices differ from the unsplit select in {int((got_i != base_i).any(1).sum())} rows"
    assert torch.equal(got_v, base_v), "scores differ from the unsplit select"
    _assert_reference_sets(got_i, q, w, k, st, en, topk, relu)


@pytest.fixture
def halves(monkeypatch):
    return _spy(monkeypatch, "_halves")


@interp
@pytest.mark.parametrize("T,S,H,relu,warm,sample", [(19, 400, 2, True, 64, "spread"), (13, 300, 2, False, 0, "spread"),
                                                     (17, 350, 2, True, 64, "head")])
def test_causal_ragged(T, S, H, relu, warm, sample, halves):
    """T not a multiple of the 8-row block, CP offset, compactions; ReLU with the warm start (spread sample, and the
    head sample whose filter is a split select too), identity with negative weights."""
    q, w, k = _inputs(T, S, H, seed=T)
    if not relu:
        w = -w.abs()
    st, en = causal_bounds(T, S, offset=S - T)
    _check(q, w, k, st, en, 8, relu, _cfg(H, warm_start=warm, warm_sample=sample), halves)


@interp
def test_ties_and_packed(halves):
    """Exact-zero ties at the k-th score (ranked by key index), packed segments with short and fully masked rows."""
    q, w, k, st, en, topk = zero_ties_case()
    _check(q, w, k, st, en, topk, True, _cfg(2), halves)
    halves.clear()
    q, w, k, st, en = packed_rows_case()
    _check(q, w, k, st, en, 8, True, _cfg(2, warm_start=64), halves)


@pytest.mark.parametrize("kw,msg", [(dict(select_split=3), "select_split must be 1 or 2"),
                                    (dict(select_split=2, append="mask"), "select_split=2 needs append='warps'")])
def test_bad_config(kw, msg):
    with pytest.raises(ValueError, match=msg):
        op.check_config(op.replace(Config(), **kw), interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("w_bf16", [False, True])
@pytest.mark.parametrize("H", [32, 16])
def test_gpu_eight_row_tiles(H, w_bf16):
    """bf16 q / k, fp32 or bf16 head weights, H 32 / 16, k 2048, warm start, compactions: the default's 8-row tiles
    (split selects, ballot slots) give the 4-row launch's output bit for bit (rows compared by key index: the launch
    shapes differ); mask-sum slots the same selection up to the head sum's rounding (session 24: a different compile
    may round it differently; a near-tie at the k-th key may swap). Every launch's sampled rows are the reference's
    sets and two runs agree."""
    from test_hytopk import assert_same_selection

    q, w, k, st, en = gpu_causal_inputs(8192, H)
    if w_bf16:  # Megatron's indexer weights come from a bf16 linear
        w = w.bfloat16()
    eight = default_config(H, 2048)
    assert (op._rows(eight, H), eight.select_split, eight.group_mask) == (8, 2, "ballot"), f"H {H}'s default"
    launches = {"4 rows": op.replace(eight, rows_x_heads=4 * H, select_split=1), "8 rows ballot": eight,
                "8 rows sum": op.replace(eight, group_mask="sum")}
    rows = torch.cat([torch.arange(0, 8192, 167), torch.arange(8192 - 8, 8192)]).cuda()
    out = {}
    for name, cfg in launches.items():
        i1, v1 = hytopk(q, w, k, st, en, 2048, relu=True, return_scores=True, config=cfg)
        try:
            assert_same_selection(q[rows].float(), w[rows].float(), k.float(), st[rows], en[rows], 2048, True,
                                  i1[rows], v1[rows])
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc
        i2 = hytopk(q, w, k, st, en, 2048, relu=True, config=cfg)
        assert torch.equal(i1, i2), f"{name}: two runs differ in {int((i1 != i2).any(1).sum())} rows"
        out[name] = (i1, v1)
    base, got = by_index(*out["4 rows"]), by_index(*out["8 rows ballot"])
    n_idx, n_val = int((got[0] != base[0]).any(1).sum()), int((got[1] != base[1]).any(1).sum())
    assert n_idx == 0 and n_val == 0, f"8 rows ballot vs 4 rows: index sets differ in {n_idx} rows, scores in {n_val}"
    same_up_to_rounding(q, w, k, st, en, 2048, True, out["8 rows sum"], out["4 rows"], ("8 rows sum", "4 rows"))


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)
