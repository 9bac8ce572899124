"""HyTopK selects exactly the reference's top-k: every launch path, ties and near ties.

Whole launches under the interpreter cover each path the product compiles: the radix and the interpolation k-th
searches, mask-sum and ballot slots (the ballot's lane arithmetic on its modelled layout), lane rows with 4 and 8
rows per tile, split selects, compactions and return_scores. The k-th searches also run alone on crafted buffers
(probe kernels), and the count of keys >= x on edge scores. tests/_hytopk_helpers.py says how the CPU runs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from _hytopk_helpers import (
    assert_canonical,
    assert_reference_sets,
    by_index,
    inputs,
    interp,
    interp_config,
    near_tie_inputs,
    needs_cuda,
    spy,
    stale_outputs,  # noqa: F401  (autouse fixture)
    zero_ties,
)

from hyscale_kernels.hytopk import Config, _kernel, hytopk
from hyscale_kernels.hytopk.reference import causal_bounds

I32_MIN = -(2**31)


def _compactions(monkeypatch):
    return spy(monkeypatch, "_compact")


@interp
@pytest.mark.parametrize("relu,kth", [(True, "radix"), (False, "interp")])
def test_launch_matches_reference(relu, kth, monkeypatch):
    """The interpreter's launch shape (16-key tiles, 2 rows, mask-sum slots) with each k-th search: causal rows
    that are the last T of S (a context-parallel offset), T and S not multiples of the tiles, signed weights,
    compactions in the key loop (no warm start: every row starts from -inf), the returned scores."""
    compactions = _compactions(monkeypatch)
    searches = spy(monkeypatch, "_kth_interp" if kth == "interp" else "_kth_radix")
    T, S, H, topk = 7, 150, 2, 8
    q, w, k = inputs(T, S, H, seed=3)
    st, en = causal_bounds(T, S, offset=S - T)
    cfg = interp_config(kth_search=kth, warm_start=0)
    idx, val = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=cfg)
    assert idx.dtype == torch.int32 and val.dtype == torch.float32
    assert compactions and searches, "the key loop did not compact with the k-th search under test"
    assert_reference_sets(q, w, k, st, en, topk, relu, idx, val)


@interp
@pytest.mark.parametrize("rows,split", [(4, 1), (8, 2)])
def test_ballot_slots_lane_rows_and_split_selects(rows, split, monkeypatch):
    """64-key tiles of 4 or 8 lane rows (H 2): ballot slots on the layout the compiled kernel is checked against,
    the interpolation search, compactions and (8 rows) selects on the even, then the odd rows; bf16 values (held
    in fp32). With 4 rows, mask-sum slots give the same output bit for bit."""
    ballots = spy(monkeypatch, "_ballot_model")
    compactions = _compactions(monkeypatch)
    T, S, H, topk = rows + 1, 300, 2, 12
    q, w, k = (x.bfloat16().float() for x in inputs(T, S, H, seed=rows))
    st, en = causal_bounds(T, S, offset=S - T)
    cfg = Config(block_n=64, rows=rows, min_free_tiles=1, sel_chunk=64, warm_start=0, kth_search="interp",
                 slots="ballot", select_split=split)
    idx, val = hytopk(q, w, k, st, en, topk, relu=True, return_scores=True, config=cfg)
    assert ballots and compactions, "the ballot slots or the compactions did not run"
    assert_reference_sets(q, w, k, st, en, topk, True, idx, val)
    if rows == 4:
        s_idx, s_val = hytopk(q, w, k, st, en, topk, relu=True, return_scores=True, config=replace(cfg, slots="sum"))
        assert torch.equal(idx, s_idx) and torch.equal(val, s_val)


@interp
@pytest.mark.parametrize("kth", ["radix", "interp"])
def test_near_ties_exact(kth, monkeypatch):
    """Scores that are exact in fp32 (k's values, one head of weight +-1): many keys tie and the rest differ in
    the last bits, with both signs. The selection and the returned scores equal the reference's exactly (ties
    to the lowest key index), through compactions."""
    ranked = spy(monkeypatch, "_tie_index_bound")
    T, S, topk = 6, 140, 12
    q, w, k = near_tie_inputs(T, S, spread=6, seed=1)
    st = torch.zeros(T, dtype=torch.int32)
    en = torch.full((T,), S, dtype=torch.int32)
    idx, val = hytopk(q, w, k, st, en, topk, relu=False, return_scores=True, config=interp_config(kth_search=kth))
    assert ranked, "no row ranked keys tied at its k-th score by key index"
    assert_canonical(q, w, k, st, en, topk, False, idx, val)


@interp
def test_relu_zero_ties():
    """ReLU zeros tie across most keys: rows whose k-th score is 0 keep the lowest key indices among the zeros."""
    T, S, H, topk = 6, 120, 2, 10
    q, w, k = zero_ties(*inputs(T, S, H, seed=5, w_sign=False), every=17)
    st, en = causal_bounds(T, S, offset=S - T)
    idx, val = hytopk(q, w, k, st, en, topk, relu=True, return_scores=True)
    assert_reference_sets(q, w, k, st, en, topk, True, idx, val)
    ref = hytopk(q, w, k, st, en, topk, relu=True, impl="reference")
    assert torch.equal(by_index(idx, val)[0], by_index(ref, ref.float())[0]), "ties broken by another rule"


# --------------------------------------------------------------------------------------- the k-th searches alone


@triton.jit
def _search_probe(buf_ptr, cnt_ptr, kk_ptr, out_ptr, R: tl.constexpr, CAP: tl.constexpr, SAMPLE: tl.constexpr,
                  KTH_INTERP: tl.constexpr):
    """_kth_search on raw fp32 buffers [R, CAP] (empty: RAW_NONE); buffers (not SAMPLE) hold cnt real entries
    anywhere, samples their first cnt slots. out [3, R] = kth, n_gt, rank."""
    o_r = tl.arange(0, R)
    cnt = tl.load(cnt_ptr + o_r)
    kk = tl.load(kk_ptr + o_r)
    kth, n_gt, rank = _kernel._kth_search(buf_ptr + o_r * CAP, cnt, tl.zeros([4, R], tl.int32), kk, CAP, SAMPLE,
                                          KTH_INTERP)
    tl.store(out_ptr + o_r, kth)
    tl.store(out_ptr + R + o_r, n_gt)
    tl.store(out_ptr + 2 * R + o_r, rank.to(tl.int32))


def _keys(scores):
    """fp32 scores -> the kernel's int32 keys (order-preserving; -0.0 folded onto +0.0)."""
    b = torch.where(scores == 0, torch.zeros_like(scores), scores).view(torch.int32)
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF)


def _search_cases(CAP=128):
    """Rows of crafted scores [8, CAP] with empty slots (-1 bits), per-row k and counts: a narrow range, a wide
    one, all keys equal, both signs with +-0 and denormals, adjacent floats, heavy ties at the k-th key, an
    outlier that stretches the bracket, and a row with no more keys than k."""
    g = torch.Generator().manual_seed(7)
    s = torch.rand(8, CAP, generator=g)
    s[0] = 3.0 + 0.01 * s[0]
    s[1] = torch.randn(CAP, generator=g) * 1e6
    s[2] = 1.5
    s[3] = torch.randn(CAP, generator=g) * 1e-3
    s[3, :8] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 1.2e-38, -1.2e-38])
    s[4] = (0x3F800000 + torch.randint(0, 40, (CAP,), generator=g, dtype=torch.int32)).view(torch.float32)
    s[5, 10:60] = 0.25
    s[5, :10] = 0.5 + s[5, :10]
    s[6, 0] = 1e30
    s[6, 1] = -1e30
    raw = s.view(torch.int32).clone()
    raw[:, 1::3] = -1  # empty slots
    raw[7, 20:] = -1  # row 7: fewer keys than k
    kk = torch.tensor([20, 40, 20, 33, 20, 20, 50, 30], dtype=torch.int32)
    return raw, kk


def _check_search(raw, kk, out):
    """Rows with more than kk keys: the top kk are the keys > kth plus kk - n_gt keys equal to kth; rank marks the
    rows where some but not all keys equal to kth fit."""
    for r in range(raw.shape[0]):
        row = raw[r][raw[r] != -1].view(torch.float32)
        row = _keys(row).long()
        k_r = int(kk[r])
        if row.numel() <= k_r:
            continue
        kth, n_gt, rank = (int(x) for x in out[:, r])
        assert int((row > kth).sum()) == n_gt, f"row {r}: keys > kth"
        assert n_gt <= k_r and int((row >= kth).sum()) >= k_r, f"row {r}: kth is not the k-th key's bucket"
        if n_gt < k_r:
            assert bool(rank) == (int((row == kth).sum()) > k_r - n_gt), f"row {r}: rank flag"


def _run_search(raw, kk, sample, kth_interp, device):
    R, CAP = raw.shape
    real = (raw != -1).sum(1).to(torch.int32)
    cnt = torch.full((R,), CAP, dtype=torch.int32) if sample else real
    out = torch.full((3, R), 12345, dtype=torch.int32, device=device)
    _search_probe[(1,)](raw.to(device), cnt.to(device), kk.to(device), out, R=R, CAP=CAP, SAMPLE=sample,
                        KTH_INTERP=kth_interp)
    return out.cpu()


@interp
@pytest.mark.parametrize("sample", [False, True], ids=["buffer", "sample"])
@pytest.mark.parametrize("kth_interp", [False, True], ids=["radix", "interp"])
def test_kth_search_contract(kth_interp, sample):
    raw, kk = _search_cases()
    _check_search(raw, kk, _run_search(raw, kk, sample, kth_interp, "cpu"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kth_interp", [False, True], ids=["radix", "interp"])
def test_gpu_kth_search_contract(kth_interp):
    """The compiled searches (the interpolation's count is an inline-PTX sign-bit sum) on the crafted rows."""
    raw, kk = _search_cases(CAP=512)
    for sample in (False, True):
        _check_search(raw, kk, _run_search(raw, kk, sample, kth_interp, "cuda"))


@triton.jit
def _count_probe(raw_ptr, x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr, P: tl.constexpr):
    """out [R, P]: _kernel._count_ge of the rows' raw fp32 scores [R, C] (as [R, 1, C]) at each probe key x."""
    o_r = tl.arange(0, R)
    b_s = tl.load(raw_ptr + o_r[:, None] * C + tl.arange(0, C)[None, :]).to(tl.float32, bitcast=True)
    for i_p in tl.static_range(P):
        x = tl.load(x_ptr + o_r * P + i_p)  # [R]
        tl.store(out_ptr + o_r * P + i_p, _kernel._count_ge(tl.reshape(b_s, [R, 1, C]), x))


def _count_cases():
    """Edge scores [4, 64] (+-0, denormals, the extremes, infinities, empty slots) and probe keys [4, n]: the row's
    keys, their neighbours and the keys around 0, where the searches probe (above the row's smallest key)."""
    v = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2.8e-45, -2.8e-45, 1e-40, -1e-40, 1.1754942e-38, -1.1754942e-38,
                      1.0, -1.0, 3.4028235e38, -3.4028235e38, float("inf"), float("-inf"), 0.5, -0.5, 7.0, -7.0])
    g = torch.Generator().manual_seed(19)
    s = v[torch.randint(0, v.numel(), (4, 64), generator=g)]
    raw = s.view(torch.int32).clone()
    raw[:, ::5] = -1
    keys = torch.where(raw == -1, I32_MIN, _keys(s))
    xs = []
    for r in range(4):
        kr = keys[r][keys[r] != I32_MIN].unique()
        cand = torch.cat([kr, kr + 1, kr - 1, torch.tensor([0, 1, -1, -2, 2], dtype=torch.int32)]).unique()
        xs.append(cand[(cand > kr.min()) & (cand <= kr.max())])
    n = min(x.numel() for x in xs)
    xs = torch.stack([x[:n] for x in xs])
    want = ((keys[:, None, :] >= xs[:, :, None]) & (keys != I32_MIN)[:, None, :]).sum(-1).to(torch.int32)
    return raw, xs, want


def _run_count(device):
    raw, xs, want = _count_cases()
    out = torch.full(xs.shape, -7, dtype=torch.int32, device=device)
    _count_probe[(1,)](raw.to(device), xs.contiguous().to(device), out, R=4, C=64, P=xs.shape[1])
    assert torch.equal(out.cpu(), want), "count of keys >= x"


@interp
def test_count_ge_edges():
    _run_count("cpu")


@pytest.mark.gpu
@needs_cuda
def test_gpu_count_ge_edges():
    """The compiled count (the sign bit of an fp32 subtraction): denormals, +-0, infinities, empty slots."""
    _run_count("cuda")
