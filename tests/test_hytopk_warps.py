"""HyTopK's per-key-group append, Config.append="warps" (the default since session 15), against the "mask"
append and the reference.

"warps" splits each key tile into KEY_GROUPS groups (one warp's MMA rows each on the GPU) that append to their
own regions of a row's candidate buffer, so its output rows come in buffer order, not ascending: every case
compares the rows sorted by key index, (1) indices and returned scores equal to "mask"'s, (2) index sets equal
to the reference's, and (3) that the path really ran (a spy on the kernel's _key_warps; where keys tied at the
k-th score must be ranked by key index, a spy on _tie_index_bound).

CPU: the interpreter at tiny fp32 shapes (tests/conftest.py sets TRITON_INTERPRET=1 when there is no CUDA; re-run
in a subprocess otherwise). Interpreter configs: block_n = 16 (4 groups of 4 keys); topk 5..12 gives CAP = 64
slots per row, i.e. regions of (64 - packed) / 4 slots, so rows with more than ~30 visible keys compact inside
the key loop; min_free_tiles = 1 compacts once a region has fewer than 4 free slots.
"""

from __future__ import annotations

import pytest
import torch

from hyscale_kernels.hytopk import _kernel, hytopk, interpreter_active, op
from hyscale_kernels.hytopk.op import Config, default_config
from hyscale_kernels.hytopk.reference import causal_bounds, packed_causal_bounds
from interp_rerun import rerun_under_interpreter
from test_hytopk import _zero_ties
from test_hytopk_warmstart import _assert_reference_sets, _inputs

INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")


def _spy(monkeypatch, name):
    """Calls of a kernel jit function: the interpreter looks them up in the module at call time."""
    calls = []
    inner = getattr(_kernel, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(_kernel, name, spy)
    return calls


@pytest.fixture
def spies(monkeypatch):
    return _spy(monkeypatch, "_key_warps"), _spy(monkeypatch, "_tie_index_bound")


@pytest.fixture
def compactions(monkeypatch):
    """Calls of _select_store that compact a buffer in the key loop (FINAL False), not the final writes."""
    calls = []
    inner = _kernel._select_store

    def spy(*args, **kwargs):
        if not args[7]:  # FINAL
            calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(_kernel, "_select_store", spy)
    return calls


def by_index(idx, val):
    """Rows sorted by key index, -1 padding last (the "mask" append's order)."""
    order = torch.where(idx < 0, torch.iinfo(torch.int32).max, idx).argsort(dim=1, stable=True)
    return idx.gather(1, order), val.gather(1, order)


def same_up_to_rounding(q, w, k, st, en, topk, relu, a, b, names=("a", "b"), max_rows=64, rel=1e-6):
    """Two launches' (indices, scores) that may round the fp32 head sum differently (different compiles): rows
    compared by key index; where the index sets differ (at most max_rows rows), both launches' rows must be the
    reference's sets up to a near-tie at the k-th key; where they agree, scores within rel (a few ulp) or, where the
    head sum cancels (signed weights: a score near zero has a large relative error), within the rounding bound of
    an fp32 sum of H terms: |a - b| <= 2 (H + 1) 2^-24 sum_h |w_h act(q_h . k)| (session 25, H100, bf16 weights:
    0.015 / 0.035 relative at H 64 / 16 on near-zero scores).
    Returns (rows whose indices differ, rows whose scores differ bit-wise) for the caller's bit-for-bit claims."""
    from test_hytopk import assert_same_selection

    (ai, av), (bi, bv) = by_index(*a), by_index(*b)
    rows_i = (ai != bi).any(1).nonzero().flatten()
    assert rows_i.numel() <= max_rows, f"{names[0]} vs {names[1]}: index sets differ in {rows_i.numel()} rows"
    for name, (i, v) in zip(names, (a, b)) if rows_i.numel() else ():
        r = rows_i
        try:
            assert_same_selection(q[r].float(), w[r].float(), k.float(), st[r], en[r], topk, relu, i[r], v[r])
        except AssertionError as exc:
            raise AssertionError(f"{name} (rows where {names[0]} and {names[1]} differ): {exc}") from exc
    same = (ai == bi) & (ai >= 0)
    diff = (av - bv).abs()
    r, j = (same & (diff > rel * bv.abs())).nonzero(as_tuple=True)  # beyond a few ulp of the score itself
    worst = 0.0
    for c in range(0, r.numel(), 4096):  # the head sum's absolute terms, per flagged (row, key)
        rc, kc = r[c:c + 4096], ai[r[c:c + 4096], j[c:c + 4096]].long()
        s = torch.einsum("nhd,nd->nh", q[rc].float(), k[kc].float())
        mag = (w[rc].float() * (s.clamp_min(0) if relu else s)).abs().sum(1)
        ratio = diff[rc, j[c:c + 4096]] / (2 * (q.shape[1] + 1) * 2.0 ** -24 * mag).clamp_min(1e-30)
        worst = max(worst, float(ratio.max()))
    assert worst <= 1, (f"{names[0]} vs {names[1]}: {r.numel()} scores beyond rel {rel}, the worst at {worst:.3g}x "
                        f"the head sum's rounding bound")
    return int(rows_i.numel()), int(((av != bv) & same).any(1).sum())


def _check(q, w, k, st, en, topk, relu, cfg, spies, ranked=None):
    """append="warps" equals append="mask" (cfg otherwise) row by row after sorting, and the reference as sets."""
    warps_calls, rank_calls = spies
    base_i, base_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=op.replace(cfg, append="mask"))
    assert not warps_calls, "append='mask' must not take the warps path"
    var_i, var_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True,
                          config=op.replace(cfg, append="warps"))
    assert warps_calls, "the 'warps' path did not run"
    if ranked is not None:  # None: ReLU zeros may tie at some k-th score (H 2-4 heads: all negative often)
        assert bool(rank_calls) == ranked, f"tie ranking by key index ran {len(rank_calls)} times, expected {ranked}"
    assert not torch.isnan(var_v).any(), "unwritten output scores"
    s_i, s_v = by_index(var_i, var_v)
    assert torch.equal(s_i, base_i), "index sets differ between the appends"
    assert torch.equal(s_v, base_v), "returned scores differ between the appends"
    again = hytopk(q, w, k, st, en, topk, relu=relu, config=op.replace(cfg, append="warps"))
    assert torch.equal(again, var_i), "two runs differ (order included)"
    _assert_reference_sets(var_i, q, w, k, st, en, topk, relu)
    return var_i


def _interp_cfg(H, topk, **kw):
    return op.replace(default_config(H, topk, interpret=True), **kw)


@interp
@pytest.mark.parametrize("T,S,H,topk,relu,warm", [(11, 45, 4, 8, True, 0), (11, 50, 2, 5, False, 0),
                                                  (7, 150, 2, 8, True, 64), (5, 200, 2, 12, False, 64)])
def test_causal_ragged(T, S, H, topk, relu, warm, spies, compactions):
    """T, S not multiples of the tile, CP-style offset, compactions inside the key loop (regions filling up; not
    at S <= 64: a region's first segment takes 4 tiles, 16 keys); identity activation with negative weights;
    warm start on (S > CAP) and off."""
    q, w, k = _inputs(T, S, H, seed=T)
    if not relu:
        w = -w.abs()
    st, en = causal_bounds(T, S, offset=S - T)
    _check(q, w, k, st, en, topk, relu, _interp_cfg(H, topk, warm_start=warm), spies, ranked=None if relu else False)
    assert bool(compactions) == (S > 64), f"{len(compactions)} compactions in the key loop"
    if warm:
        assert op.warm_stats()["warm_rows"] == T


@interp
def test_short_and_masked_rows(spies):
    """Rows with fewer visible keys than topk (-1 padding), fully masked rows, topk > S."""
    *case, topk = short_masked_case()
    idx = _check(*case, topk, True, _interp_cfg(2, topk), spies)
    assert (idx[4] == -1).all() and (idx[7] == -1).all()


@interp
@pytest.mark.parametrize("warm", [0, 64])
def test_ties_exact_zeros_ranked_by_index(warm, spies):
    """ReLU zeros: most keys score exactly 0 and the top-k boundary falls among them, with more zeros than fit:
    the kept ones are the lowest key indices although the regions hold them out of index order."""
    *case, topk = zero_ties_case()
    _check(*case, topk, True, _interp_cfg(2, topk, warm_start=warm), spies, ranked=True)


def short_masked_case():
    """(q, w, k, starts, ends, topk) at H 2, fp32, T 12, S 10, topk 16 > S: rows with fewer visible keys than topk
    (-1 padding); rows 4 and 7 fully masked."""
    T, S, H, topk = 12, 10, 2, 16
    q, w, k = _inputs(T, S, H, seed=3)
    st, en = causal_bounds(T, S)
    st, en = st.clone(), en.clone()
    st[4], en[4] = 5, 5
    st[7], en[7] = 0, 0
    return q, w, k, st, en, topk


def zero_ties_case(S=130):
    """(q, w, k, starts, ends, topk) at H 2, D 16, fp32, T 6, topk 8: ReLU exact zeros tied at the k-th score (more
    zeros than fit), CP offset."""
    T, H, D, topk = 6, 2, 16, 8
    q, w, k = _zero_ties(*_inputs(T, S, H, D=D, seed=5, w_sign=False), every=29)
    st, en = causal_bounds(T, S, offset=S - T)
    return q, w, k, st, en, topk


def packed_rows_case():
    """(q, w, k, starts, ends) at H 2, fp32: rows of packed segments (row blocks straddle segments), a short row
    and a fully masked one."""
    lens = [70, 3, 90, 6]
    st, en = packed_causal_bounds(lens)
    T = sum(lens)
    q, w, k = _inputs(T, T, 2, seed=2)
    rows = torch.arange(T)
    keep = (rows >= 66) & (rows < 75) | (rows >= 160)
    st, en = st[keep].contiguous(), en[keep].contiguous()
    q, w = q[keep].contiguous(), w[keep].contiguous()
    st[3], en[3] = 40, 40
    st[8], en[8] = 0, 0
    return q, w, k, st, en


def gpu_causal_inputs(T, H):
    """(q, w, k, starts, ends) on the GPU: bf16 q / k, signed fp32 head weights, causal T = S."""
    g = torch.Generator(device="cuda").manual_seed(T + H)
    q = torch.randn(T, H, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(T, H, device="cuda", generator=g) * (H * 128) ** -0.5
    k = torch.randn(T, 128, device="cuda", generator=g).bfloat16()
    st, en = causal_bounds(T, T)
    return q, w, k, st.cuda(), en.cuda()


@interp
def test_packed_segments_warm_start(spies):
    """Packed segments (row blocks straddle segments), short and fully masked rows, warm start on."""
    _check(*packed_rows_case(), 8, True, _interp_cfg(2, 8, warm_start=64), spies)


@interp
def test_warm_start_fallback(spies):
    """Adversarial sample: every row's sampled threshold is too high, the row block re-runs its key loop from
    -inf with the regions' state carried over (the rows that succeeded keep theirs)."""
    T, S, H, topk, warm = 2, 256, 2, 12, 64
    g = torch.Generator().manual_seed(7)
    q = torch.rand(T, H, 16, generator=g) + 0.1
    w = torch.rand(T, H, generator=g) + 0.1
    k = torch.randn(S, 16, generator=g)
    for i, p in enumerate(op.warm_sample_positions(0, S, warm)):
        k[p] = 100.0 * (torch.rand(16, generator=g) + 0.1) if i % 5 == 0 and i // 5 < 11 else 0.0
    st = torch.zeros(T, dtype=torch.int32)
    en = torch.full((T,), S, dtype=torch.int32)
    _check(q, w, k, st, en, topk, True, _interp_cfg(H, topk, warm_start=warm), spies)
    assert op.warm_stats()["fallback_rows"] == T


@interp
def test_other_launch_shape(spies):
    """block_n = 32 (groups of 8 keys), 4 rows per program, 2 free tiles."""
    T, S, H, topk = 11, 90, 4, 8
    q, w, k = _inputs(T, S, H, seed=13)
    w[3] = -w[3].abs()
    st, en = causal_bounds(T, S, offset=S - T)
    cfg = Config(block_n=32, rows_x_heads=16, num_warps=1, num_stages=1, programs_per_sm=1,
                 min_free_tiles=2, sel_chunk=64, warm_start=0)
    _check(q, w, k, st, en, topk, False, cfg, spies, ranked=False)


def test_config_errors():
    """append="warps" refuses what it cannot run, naming the field."""
    with pytest.raises(ValueError, match="block_n a multiple of 4"):
        op.check_config(Config(append="warps", block_n=18), False)
    with pytest.raises(ValueError, match="block_n a multiple of 4"):
        op.check_config(Config(append="warps", block_n=256), False)
    with pytest.raises(ValueError, match="search_bits=2 and raw_keys=True"):
        op.check_config(Config(append="warps", search_bits=1), False)
    with pytest.raises(ValueError, match="search_bits=2 and raw_keys=True"):
        op.check_config(Config(append="warps", raw_keys=False), False)
    op.check_config(Config(append="warps"), False)


def test_same_up_to_rounding_bound():
    """The GPU tests' two-compile comparison: a cancelling score (signed weights) may differ by far more than its
    own few ulp but not beyond the head sum's rounding bound; a real error fails; bit-for-bit counts are returned."""
    from hyscale_kernels.hytopk.reference import hytopk_reference

    g = torch.Generator().manual_seed(5)
    T, H, D, topk = 12, 8, 16, 6
    q, k = torch.randn(T, H, D, generator=g), torch.randn(20, D, generator=g)
    w = torch.randn(T, H, generator=g)
    st, en = causal_bounds(T, 20, offset=8)
    i, v = hytopk_reference(q, w, k, st, en, topk, relu=False, return_scores=True)
    assert same_up_to_rounding(q, w, k, st, en, topk, False, (i, v), (i, v.clone())) == (0, 0)
    s = torch.einsum("thd,tjd->thj", q, k[i.clamp_min(0)])  # [T, H, topk]
    mag = (w[:, :, None] * s).abs().sum(1)  # [T, topk]: the head sum's absolute terms
    bound = 2 * (H + 1) * 2.0 ** -24 * mag
    t, j = 3, 2
    near_zero = v.clone()
    near_zero[t, j] = 1e-7  # a cancelling sum: relative error huge, absolute error inside the bound
    shifted = near_zero.clone()
    shifted[t, j] += 0.5 * float(bound[t, j])
    assert same_up_to_rounding(q, w, k, st, en, topk, False, (i, near_zero), (i, shifted)) == (0, 1)
    shifted[t, j] = 1e-7 + 3 * float(bound[t, j])
    with pytest.raises(AssertionError, match="rounding bound"):
        same_up_to_rounding(q, w, k, st, en, topk, False, (i, near_zero), (i, shifted), ("x", "y"))
    wrong = v.clone()
    wrong[5, 0] *= 1.01
    with pytest.raises(AssertionError, match="rounding bound"):
        same_up_to_rounding(q, w, k, st, en, topk, False, (i, v), (i, wrong))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,relu", [(12288, 64, True), (8192, 32, False)])
def test_gpu_warps_same_sets(T, H, relu):
    """bf16 at real shapes (k 2048, warm start, compactions): "warps" (the default) selects the "mask" append's
    sets with the same scores (the scoring code is shared: bit-identical after sorting by key index),
    deterministically; the output order is the buffer's, so it is checked against the index-sorted "mask" rows."""
    q, w, k, st, en = gpu_causal_inputs(T, H)
    cfg = default_config(H, 2048)
    assert cfg.append == "warps"
    mask_cfg = op.replace(cfg, append="mask", select_split=1)  # split selects (H 32's default) need "warps"
    di, dv = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=mask_cfg)
    wi, wv = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=op.replace(cfg, append="warps"))
    wi2 = hytopk(q, w, k, st, en, 2048, relu=relu, config=op.replace(cfg, append="warps"))
    assert torch.equal(wi, wi2), "two runs differ"
    s_i, s_v = by_index(wi, wv)
    assert torch.equal(s_i, di), f"index sets differ in {int((s_i != di).any(1).sum())} rows"
    assert torch.equal(s_v, dv), "scores differ"


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)
