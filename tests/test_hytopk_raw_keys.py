"""HyTopK's Config.raw_keys: candidate buffers hold the scores' raw fp32 bits and the key loop tests each score
against the segment's fp32 bound instead of converting every score to an int key. The output must be the
default's bit for bit (indices and scores) and the reference's sets: random scores with masked and short rows,
cold and warm start, near and exact ties (identity activation, negative scores), ReLU zeros with compactions,
both radix searches, 2 and 4 rows per program; and the bound's edge cases (-inf start, the warm re-run's
"append nothing" threshold, zeros of either sign)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hyscale_kernels.hytopk import hytopk, interpreter_active
from hyscale_kernels.hytopk.op import Config
from hyscale_kernels.hytopk.reference import causal_bounds
from interp_rerun import rerun_under_interpreter
from test_hytopk import _zero_ties, assert_same_selection
from test_hytopk_early_select import masked_rows_case
from test_hytopk_search2 import _near_tie_inputs

INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")


def _cfg(H, search_bits=2, warm=0, rows=2):
    return Config(block_n=16, rows_x_heads=rows * H, num_warps=1, num_stages=1, programs_per_sm=1,
                  min_free_tiles=1, sel_chunk=64, search_bits=search_bits, warm_start=warm,
                  lane_rows=rows % 4 == 0, append="mask")  # raw vs int keys: "warps" needs raw keys


def _pair(q, w, k, st, en, topk, relu, cfg):
    """(raw_keys on, off) results: indices and scores."""
    return [hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=replace(cfg, raw_keys=raw))
            for raw in (True, False)]


def _assert_identical(a, b):
    (ai, av), (bi, bv) = a, b
    assert torch.equal(ai, bi), "raw_keys changed the indices"
    assert torch.equal(av, bv) and torch.equal(torch.signbit(av), torch.signbit(bv)), "raw_keys changed the scores"


@interp
@pytest.mark.parametrize("warm", [0, 64], ids=["cold", "warm"])
@pytest.mark.parametrize("relu,rows,bits", [(False, 2, 2), (True, 2, 1), (True, 4, 2)],
                         ids=["id-2rows", "relu-2rows-1bit", "relu-4rows"])
def test_raw_keys_random_and_masked_rows(relu, rows, bits, warm):
    H, topk = 4, 12
    q, w, k, st, en = masked_rows_case(11 + warm)
    raw, ref = _pair(q, w, k, st, en, topk, relu, _cfg(H, bits, warm, rows))
    assert_same_selection(q, w, k, st, en, topk, relu, *raw)
    _assert_identical(raw, ref)
    assert torch.equal(raw[0][4], torch.full((topk,), -1, dtype=raw[0].dtype))


@interp
@pytest.mark.parametrize("spread", [2, 4, 64])
def test_raw_keys_near_and_exact_ties(spread):
    """Scores from `spread` consecutive floats (negative ones too: identity activation): the boundary falls
    inside runs of equal scores; the lowest indices must win, as in the default."""
    T, S, H, topk = 12, 160, 4, 9
    q, w, k = _near_tie_inputs(T, S, H=H, spread=spread, seed=spread + 1)
    st = torch.zeros(T, dtype=torch.int32)
    en = torch.full((T,), S, dtype=torch.int32)
    en[5] = 37
    st[7], en[7] = 20, 150
    raw, ref = _pair(q, w, k, st, en, topk, False, _cfg(H))
    assert_same_selection(q, w, k, st, en, topk, False, *raw)
    _assert_identical(raw, ref)


@interp
@pytest.mark.parametrize("warm", [0, 64], ids=["cold", "warm"])
@pytest.mark.parametrize("negative_w", [False, True], ids=["zeros+", "zeros-"])
def test_raw_keys_relu_zero_ties_with_compactions(warm, negative_w):
    """ReLU zeros tie at the boundary (negative head weights make them -0.0, which ties with +0.0 in the
    key order), with several compactions per row (64 slots for k = 12): the bound after a compaction to a
    zero k-th key must admit zeros of either sign exactly as the int test does."""
    T, S, H, topk = 16, 400, 2, 12
    g = torch.Generator().manual_seed(7)
    q, w, k = torch.randn(T, H, 32, generator=g), torch.randn(T, H, generator=g).abs(), torch.randn(S, 32, generator=g)
    q, w, k = _zero_ties(q, w, k, every=5)
    if negative_w:
        w = -w
    st = torch.zeros(T, dtype=torch.int32)
    en = torch.full((T,), S, dtype=torch.int32)
    raw, ref = _pair(q, w, k, st, en, topk, True, _cfg(H, warm=warm))
    assert_same_selection(q, w, k, st, en, topk, True, *raw)
    _assert_identical(raw, ref)


@interp
@pytest.mark.parametrize("warm", [0, 64], ids=["cold", "warm"])
def test_raw_keys_negative_scores_with_compactions(warm):
    """Every score negative and distinct (identity activation, q . k > 0, negative weights), several compactions
    per row: the kept candidates are negative, whose raw bits and int keys differ (a compaction that wrote keys
    back into a raw buffer would reorder them)."""
    T, S, H, topk = 12, 400, 2, 12
    g = torch.Generator().manual_seed(13)
    q, k = torch.randn(T, H, 32, generator=g).abs(), torch.randn(S, 32, generator=g).abs()
    w = -torch.rand(T, H, generator=g) - 0.1
    st = torch.zeros(T, dtype=torch.int32)
    en = torch.full((T,), S, dtype=torch.int32)
    raw, ref = _pair(q, w, k, st, en, topk, False, _cfg(H, warm=warm))
    assert (raw[1][raw[0] >= 0] < 0).all()
    assert_same_selection(q, w, k, st, en, topk, False, *raw)
    _assert_identical(raw, ref)


@interp
def test_raw_keys_ignored_with_tile_append():
    """raw_keys (the default) applies to the mask append only: with append="tile" the kernel runs without it
    (RAW constexpr off) and selects the reference's sets."""
    from hyscale_kernels.hytopk import op

    T, S, H, topk = 9, 60, 2, 5
    g = torch.Generator().manual_seed(2)
    q, w, k = torch.randn(T, H, 32, generator=g), torch.randn(T, H, generator=g), torch.randn(S, 32, generator=g)
    st, en = causal_bounds(T, S, offset=S - T)
    cfg = replace(_cfg(H), append="tile")
    assert cfg.raw_keys and not op.kernel_constexprs(cfg, H, 32, topk, select=True, relu=True, write_scores=True,
                                                    ieee=True, interp=True)["RAW"]
    assert op.kernel_constexprs(_cfg(H), H, 32, topk, select=True, relu=True, write_scores=True, ieee=True,
                                interp=True)["RAW"]
    idx, val = hytopk(q, w, k, st, en, topk, relu=True, return_scores=True, config=cfg)
    assert_same_selection(q, w, k, st, en, topk, True, idx, val)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,relu", [(12288, 64, True), (8192, 32, False)])
def test_gpu_raw_keys_bit_identical(T, H, relu):
    """bf16 at real shapes with the default launch: raw_keys selects the default's sets."""
    g = torch.Generator(device="cuda").manual_seed(T + H)
    q = torch.randn(T, H, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(T, H, device="cuda", generator=g) * (H * 128) ** -0.5
    k = torch.randn(T, 128, device="cuda", generator=g).bfloat16()
    st, en = causal_bounds(T, T)
    st, en = st.cuda(), en.cuda()
    from hyscale_kernels.hytopk.op import default_config

    # raw vs int keys: the "warps" default needs raw keys (and its split selects need "warps")
    cfg = replace(default_config(H, 2048), append="mask", select_split=1)
    (ri, rv), (di, dv) = _pair(q, w, k, st, en, 2048, relu, cfg)
    # compiled, the two variants may round the fp32 head sum differently (FMA contraction): session 11 saw
    # equal indices at H 32 / identity but 84 of 16.8M scores differing in their last bits, all sums near 0
    # (signed weights cancel: e.g. 1.40e-6 vs 1.46e-6, true 1.33e-6). Same sets; scores within the fp32 sum's
    # absolute rounding (terms of size ~0.1-1 here)
    assert torch.equal(ri, di), "raw_keys changed the indices"
    fin = ri >= 0
    torch.testing.assert_close(rv[fin], dv[fin], rtol=1e-5, atol=1e-5)


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)
