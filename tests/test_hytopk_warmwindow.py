"""HyTopK's warm-start tuning: the windowed threshold search (Config.warm_search="window", _kernel._warm_window),
the sample sized by row length (Config.warm_mu) and the margin (Config.warm_z).

The contract of _warm_window, checked directly on crafted sample buffers (a small test kernel, the interpreter on
CPU): for each searching row with window [j, j_hi = j + floor(warm_slack j)] it returns thr = x - 1 where the count c
of sample keys >= x satisfies j <= c, and c <= j_hi unless the j-th largest key is tied so widely that no x has its
count in the window (then x is that key: fewer than j keys are > x). Rows that do not search get INT32_MIN. Any such
x lies at or below the j-th largest sample key, which is all the exactness argument of the warm start needs; the
whole-kernel cases check the selection against the reference and against warm_search="kth".
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from hyscale_kernels.hytopk import _kernel, hytopk, interpreter_active, op
from hyscale_kernels.hytopk.reference import causal_bounds
from interp_rerun import rerun_under_interpreter
from test_hytopk_warmstart import _assert_reference_sets, _inputs
from test_hytopk_warps import _interp_cfg, by_index, gpu_causal_inputs, packed_rows_case

INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")
INT32_MIN = -(2**31)


@triton.jit
def _window_kernel(buf_ptr, j_ptr, on_ptr, out_ptr, m_w, R: tl.constexpr, WARM: tl.constexpr, SLACK: tl.constexpr,
                   RAW: tl.constexpr):
    o_r = tl.arange(0, R)
    key_rows = buf_ptr + o_r.to(tl.int64) * WARM  # [R] row pointers
    j = tl.load(j_ptr + o_r)
    on = tl.load(on_ptr + o_r) != 0
    tl.store(out_ptr + o_r, _kernel._warm_window(key_rows, j, on, R, WARM, SLACK, RAW, m_w))


def _keys(sc: torch.Tensor) -> torch.Tensor:
    """fp32 scores -> the kernel's order-preserving int32 keys (-0.0 folded onto +0.0)."""
    bits = torch.where(sc == 0, torch.zeros_like(sc), sc).view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _run(scores: torch.Tensor, vis: torch.Tensor, j: torch.Tensor, on: torch.Tensor, slack: float, raw: bool,
         m_w: int | None = None):
    """The window kernel on rows of sample scores [R, WARM] (vis: visible slots; slots from m_w on are not part
    of the sample): thresholds [R] int32."""
    R, W = scores.shape
    if raw:  # the buffer's RAW format: the fp32 bits, -1 (a NaN, key INT32_MIN) where not visible
        buf = torch.where(vis, scores.view(torch.int32), torch.full_like(scores, -1, dtype=torch.int32))
    else:
        buf = torch.where(vis, _keys(scores), torch.full_like(scores, INT32_MIN, dtype=torch.int32))
    out = torch.full((R,), 12345, dtype=torch.int32)
    _window_kernel[(1,)](buf.contiguous(), j.int(), on.int(), out, W if m_w is None else m_w, R=R, WARM=W,
                         SLACK=slack, RAW=raw)
    return out


def _assert_window(scores, vis, j, on, slack, thr):
    keys = _keys(scores)
    for r in range(scores.shape[0]):
        if not on[r]:
            assert thr[r] == INT32_MIN, f"row {r} is off but got threshold {int(thr[r])}"
            continue
        kv = keys[r][vis[r]]
        jr, j_hi = int(j[r]), int(j[r]) + math.floor(float(j[r]) * slack)
        x = int(thr[r]) + 1
        c = int((kv >= x).sum())
        assert c >= jr, f"row {r}: only {c} sample keys >= x, j = {jr}"
        if len(kv) <= j_hi:
            assert x == int(kv.min()), f"row {r}: a sample of {len(kv)} <= j_hi keys keeps every key"
        elif c > j_hi:
            assert int((kv > x).sum()) < jr, (f"row {r}: {c} keys >= x is above the window [{jr}, {j_hi}] although a "
                                              "higher x has a count >= j")


def _case(kind: str, R=4, W=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        sc = torch.randn(R, W, generator=g)
    elif kind == "relu_sum":  # the indexer's shape: a positive weighted sum of ReLUs, many exact zeros
        sc = torch.relu(torch.randn(R, W, 8, generator=g)).mul(torch.rand(R, 1, 8, generator=g)).sum(-1)
        sc[:, ::3] = 0.0
    elif kind == "heavy":  # a few huge values: interpolation's worst case, the bisection guard must bound it
        sc = torch.randn(R, W, generator=g).pow(3) * 10
        sc[:, 7] = 1e30
    elif kind == "negative":
        sc = -torch.rand(R, W, generator=g) * 1e-3 - 5.0
    elif kind == "ties":  # few distinct values: the window can only be hit at a tie edge
        sc = torch.randint(0, 3, (R, W), generator=g).float()
    else:  # "constant"
        sc = torch.full((R, W), 0.75)
    return sc


@interp
@pytest.mark.parametrize("kind", ["normal", "relu_sum", "heavy", "negative", "ties", "constant"])
@pytest.mark.parametrize("raw", [True, False])
def test_window_contract(kind, raw):
    """Every distribution, both buffer formats, ranks from the top tail to the middle, a row off, invisible slots."""
    sc = _case(kind)
    R, W = sc.shape
    vis = torch.ones(R, W, dtype=torch.bool)
    vis[1, W // 2:] = False  # half the sample invisible to row 1
    j = torch.tensor([14, 40, 97, 128])
    on = torch.tensor([True, True, True, False])
    for slack in (0.25, 0.0, 1.0):
        thr = _run(sc, vis, j, on, slack, raw)
        _assert_window(sc, vis, j, on, slack, thr)


@interp
def test_window_sample_prefix():
    """A sample of m_w < WARM slots (Config.warm_mu): the slots after it hold stale keys from an earlier use of the
    buffer, which must not count."""
    sc = _case("normal", seed=5)
    sc[:, 128:] = 1e6  # stale: above every sample key
    vis = torch.ones_like(sc, dtype=torch.bool)
    j = torch.tensor([10, 20, 30, 40])
    on = torch.ones(4, dtype=torch.bool)
    thr = _run(sc, vis, j, on, 0.25, True, m_w=128)
    vis[:, 128:] = False
    _assert_window(sc, vis, j, on, 0.25, thr)


@interp
def test_window_small_sample():
    """A row with no more than j_hi visible keys takes its smallest key (every sample key passes)."""
    sc = _case("normal", seed=3)
    vis = torch.zeros_like(sc, dtype=torch.bool)
    vis[:, :10] = True
    j = torch.tensor([8, 9, 10, 5])
    on = torch.ones(4, dtype=torch.bool)
    thr = _run(sc, vis, j, on, 0.25, True)
    _assert_window(sc, vis, j, on, 0.25, thr)
    assert int(thr[3]) + 1 > int(_keys(sc[3, :10]).min())  # 5 of 10 with window [5, 6]: a real search


@interp
@pytest.mark.parametrize("T,S,H,topk,relu,warm", [(7, 150, 2, 8, True, 64), (5, 200, 2, 12, False, 64),
                                                  (6, 520, 2, 8, True, 256)])
def test_selection(T, S, H, topk, relu, warm):
    """Causal ragged rows (compactions, identity activation with negative weights): the reference's sets and the
    same sets as warm_search="kth"; every long row warm-started."""
    q, w, k = _inputs(T, S, H, seed=T)
    if not relu:
        w = -w.abs()
    st, en = causal_bounds(T, S, offset=S - T)
    cfg = _interp_cfg(H, topk, warm_start=warm)
    kth_i, kth_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=cfg)
    win_i, win_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True,
                          config=op.replace(cfg, warm_search="window"))
    assert op.warm_stats()["warm_rows"] == T
    assert not torch.isnan(win_v).any(), "unwritten output scores"
    assert torch.equal(by_index(win_i, win_v)[0], by_index(kth_i, kth_v)[0]), "index sets differ from 'kth'"
    _assert_reference_sets(win_i, q, w, k, st, en, topk, relu)


@interp
def test_packed_segments():
    """Packed segments with short and fully masked rows."""
    q, w, k, st, en = packed_rows_case()
    idx = hytopk(q, w, k, st, en, 8, config=_interp_cfg(2, 8, warm_start=64, warm_search="window"))
    _assert_reference_sets(idx, q, w, k, st, en, 8, True)


@interp
def test_warm_mu_sample_size():
    """Config.warm_mu: the kernel samples warm_mu * span / topk keys (whole tiles; op.warm_sample_positions says
    which): 8 huge keys planted among its 32 sampled positions (the rest 0) put every row's threshold among the
    huge ones (j = 7 with mu 1.5), so every row re-runs from -inf; the fixed 64-key sample (j 10: past the huge
    ones) needs no re-run on the same data. Both exact."""
    T, S, H, topk, warm, mu = 6, 256, 2, 12, 64, 1.5
    cfg = _interp_cfg(H, topk, warm_start=warm, warm_mu=mu)
    pos = op.warm_sample_positions(0, S, warm, topk, mu, cfg.block_n)
    assert len(set(pos)) == len(pos) == 32
    g = torch.Generator().manual_seed(11)
    q = torch.rand(T, H, 16, generator=g) + 0.1
    w = torch.rand(T, H, generator=g) + 0.1
    k = torch.randn(S, 16, generator=g)
    for i, p in enumerate(pos):
        k[p] = 100.0 * (torch.rand(16, generator=g) + 0.1) if i % 4 == 0 else 0.0
    st = torch.zeros(T, dtype=torch.int32)
    en = torch.full((T,), S, dtype=torch.int32)
    for search in ("kth", "window"):
        idx = hytopk(q, w, k, st, en, topk, config=op.replace(cfg, warm_search=search))
        assert op.warm_stats() == dict(warm_rows=T, fallback_rows=T, fallback_blocks=-(-T // op._rows(cfg, H)))
        _assert_reference_sets(idx, q, w, k, st, en, topk, True)
    idx = hytopk(q, w, k, st, en, topk, config=op.replace(cfg, warm_mu=0.0))
    assert op.warm_stats()["fallback_rows"] == 0, op.warm_stats()
    _assert_reference_sets(idx, q, w, k, st, en, topk, True)


@interp
@pytest.mark.parametrize("T,S,topk", [(7, 150, 8), (5, 700, 12)])
def test_warm_mu_selection(T, S, topk):
    """Causal ragged rows, warm_mu sizing samples between 2 tiles and warm_start: the reference's sets."""
    q, w, k = _inputs(T, S, 2, seed=T + 1)
    st, en = causal_bounds(T, S, offset=S - T)
    idx = hytopk(q, w, k, st, en, topk, config=_interp_cfg(2, topk, warm_start=256, warm_mu=4.0))
    assert op.warm_stats()["warm_rows"] == T
    _assert_reference_sets(idx, q, w, k, st, en, topk, True)


def test_config_errors():
    with pytest.raises(ValueError, match="warm_search must be one of"):
        op.check_config(op.Config(warm_search="approx"), False)
    with pytest.raises(ValueError, match="built for warm_sample='spread'"):
        op.check_config(op.Config(warm_search="window", warm_sample="head"), False)
    with pytest.raises(ValueError, match="warm_slack must be in"):
        op.check_config(op.Config(warm_search="window", warm_slack=-0.1), False)
    with pytest.raises(ValueError, match="warm_mu must be >= 0"):
        op.check_config(op.Config(warm_mu=-1.0), False)
    with pytest.raises(ValueError, match="sizes the spread sample"):
        op.check_config(op.Config(warm_mu=32.0, warm_sample="head"), False)
    with pytest.raises(ValueError, match="warm_z must be in"):
        op.check_config(op.Config(warm_z=-0.5), False)
    op.check_config(op.Config(warm_search="window"), False)


@interp
@pytest.mark.parametrize("search", ["kth", "window"])
def test_thin_margin_falls_back(search):
    """warm_z 0 (the threshold at the expected rank: often above the row's k-th key): rows re-run from -inf, the selection stays exact."""
    T, S, H, topk = 9, 300, 2, 12
    q, w, k = _inputs(T, S, H, seed=21)
    st, en = causal_bounds(T, S, offset=S - T)
    idx = hytopk(q, w, k, st, en, topk, config=_interp_cfg(H, topk, warm_start=64, warm_z=0.0, warm_search=search))
    stats = op.warm_stats()
    assert stats["warm_rows"] == T and stats["fallback_rows"] > 0, stats
    _assert_reference_sets(idx, q, w, k, st, en, topk, True)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,relu", [(12288, 64, True), (8192, 32, False)])
def test_gpu_same_sets(T, H, relu):
    """bf16 at real shapes: warm_search="window" selects the default's sets with the same scores,
    deterministically, and every row it warm-starts stays exact (fallbacks allowed, counted)."""
    q, w, k, st, en = gpu_causal_inputs(T, H)
    cfg = op.default_config(H, 2048)
    di, dv = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=cfg)
    win = op.replace(cfg, warm_search="window")
    wi, wv = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=win)
    assert op.warm_stats()["warm_rows"] > 0
    assert torch.equal(wi, hytopk(q, w, k, st, en, 2048, relu=relu, config=win)), "two runs differ"
    s_i, s_v = by_index(wi, wv)
    d_i, d_v = by_index(di, dv)
    assert torch.equal(s_i, d_i), f"index sets differ in {int((s_i != d_i).any(1).sum())} rows"
    assert torch.equal(s_v, d_v), "scores differ"


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)
