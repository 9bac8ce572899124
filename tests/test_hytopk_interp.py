"""HyTopK's Config.kth_search="interp": each select finds a row's k-th buffered key by a bracketed interpolation
search (one count per pass) instead of 2-bit radix passes (three counts per pass).

(1) The probe kernel of tests/test_hytopk_prefix.py runs _kth_key2 with KTH=2 on crafted buffers (narrow and wide
ranges, all keys equal, both signs, rows at or below k, holes, per-row k, heavy ties at the k-th key, skewed
tails): the result meets the select's contract (keys > kth, ties, rank), and where the radix's answer is the exact
k-th key (no early stop) it is the same. (2) Whole launches: the default's index sets and scores (rows compared
sorted by key index: the warps append's order follows the compaction thresholds, which may differ), the
reference's sets, both appends, warm start, compactions, ties, negative scores, packed segments; a spy checks
that the interpolation path ran. (3) Bad configs are refused.

CPU: the interpreter at tiny fp32 shapes (tests/conftest.py sets TRITON_INTERPRET=1 when there is no CUDA).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from hyscale_kernels.hytopk import _kernel, hytopk, interpreter_active, op
from hyscale_kernels.hytopk.op import default_config
from hyscale_kernels.hytopk.reference import causal_bounds
from interp_rerun import rerun_under_interpreter
from test_hytopk_prefix import I32_MIN, _check_contract, _keys, _probe, _run_probe
from test_hytopk_warmstart import _assert_reference_sets, _inputs
from test_hytopk_warps import _spy, by_index, gpu_causal_inputs, packed_rows_case, zero_ties_case

INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")


@pytest.fixture
def interp_calls(monkeypatch):
    """Calls of the kernel's _kth_interp (the interpreter looks jit functions up in the module at call time)."""
    return _spy(monkeypatch, "_kth_interp")


CASES = ["narrow", "wide", "equal", "sign", "small_rows", "holes", "per_row_k", "ties_at_k", "skewed", "dense",
         "denormal", "long"]


def _case(case):
    """Crafted buffers for the probe: (scores [R, CAP] fp32, keys [R, CAP] int32 with holes INT32_MIN, cnt, kk)."""
    g = torch.Generator().manual_seed(hash(case) % 1000)
    R, CAP = 4, 512 if case == "long" else 64  # long: 4 runs of 128 slots (the search's row layout)
    kk = torch.full((R,), 20, dtype=torch.int32)
    cnt = torch.full((R,), CAP, dtype=torch.int32)
    if case == "narrow":
        s = 3.0 + 0.01 * torch.rand(R, CAP, generator=g)
    elif case == "wide":
        s = torch.randn(R, CAP, generator=g) * torch.tensor([1.0, 100.0, 1e-3, 1e6])[:, None]
    elif case == "equal":  # all keys equal: the bracket closes on them (rank)
        s = torch.full((R, CAP), 1.5)
        s[1] = torch.rand(CAP, generator=g)
    elif case == "sign":
        s = torch.randn(R, CAP, generator=g) * 1e-3
        s[2] = -2.0 - torch.rand(CAP, generator=g)
    elif case == "small_rows":
        s = 5.0 + torch.rand(R, CAP, generator=g)
        cnt = torch.tensor([CAP, 20, 7, 0], dtype=torch.int32)
    elif case == "holes":
        s = 2.0 + torch.rand(R, CAP, generator=g)
    elif case == "per_row_k":
        s = 7.0 + torch.rand(R, CAP, generator=g)
        kk = torch.tensor([3, 40, 1, 63], dtype=torch.int32)
    elif case == "ties_at_k":  # many keys equal to the k-th: f jumps over k, the search must end on the tie
        s = torch.rand(R, CAP, generator=g)
        s[:, 10:40] = 0.25  # ranks 10..39 (below 10 larger keys at most) straddle k = 20
        s[:, :10] = 0.5 + torch.rand(R, 10, generator=g)
        s[3] = 0.0  # ReLU zeros: every key tied
    elif case == "dense":  # adjacent floats (keys 0..39 apart, repeated): every probe is on or next to a key
        s = (0x3F800000 + torch.randint(0, 40, (R, CAP), generator=g, dtype=torch.int32)).view(torch.float32)
        s[2] = -s[2]
    elif case == "denormal":  # scores around 0: denormals of both signs, +-0 (a flush to zero would tie them)
        s = (torch.randint(0, 30, (R, CAP), generator=g, dtype=torch.int32)).view(torch.float32)
        s[:, ::2] = -s[:, ::2]
        s[1, :8] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 1.2e-38, -1.2e-38])
    elif case == "long":  # holes, per-row k and counts over several 128-slot runs
        s = torch.randn(R, CAP, generator=g) * torch.tensor([1.0, 10.0, 1e-3, 1.0])[:, None]
        kk = torch.tensor([100, 250, 1, 150], dtype=torch.int32)
        cnt = torch.tensor([CAP, 300, CAP, 200], dtype=torch.int32)
    else:  # "skewed": one huge outlier stretches the bracket (interpolation alone would crawl: bisection)
        s = 1.0 + torch.rand(R, CAP, generator=g)
        s[:, 0] = 1e30
        s[1, 1] = -1e30
    keys = _keys(s.float())
    if case in ("holes", "long"):
        keys[:, ::3] = I32_MIN
    if case == "holes":
        keys[3, 10:] = I32_MIN
    if case == "per_row_k":
        keys[3, 30:] = I32_MIN
    return s.float(), keys, cnt, kk


@interp
@pytest.mark.parametrize("case", CASES)
def test_probe_interp_contract(case, interp_calls):
    _, keys, cnt, kk = _case(case)
    radix = _run_probe(keys, cnt, kk, 0)
    interp_calls.clear()
    got = _run_probe(keys, cnt, kk, 2)
    assert interp_calls, "the interpolation path did not run"
    assert (got != 12345).all(), "unwritten probe output"
    _check_contract(keys, cnt, kk, got)
    for r in range(keys.shape[0]):
        if int(cnt[r]) > int(kk[r]) and bool(radix[2, r]):  # both ended on the exact k-th key (a tie split)
            assert torch.equal(got[:, r], radix[:, r]), f"row {r}: {got[:, r]} vs radix {radix[:, r]}"


def _raw_vs_keys(case, device):
    """The raw-score search (fp32 compares; on the GPU the FSET count) gives exactly the int-key search's result."""
    s, keys, cnt, kk = _case(case)
    if case == "signed_zero":  # -0.0 and +0.0 must tie (both key 0); a probe at key -1 is the score -0.0
        s = torch.where(torch.arange(s.shape[1]) % 2 == 0, s, -s)
        s[:, :24] = torch.where(torch.arange(24) % 2 == 0, 0.0, -0.0)
        keys = _keys(s)
    raw = s.view(torch.int32).clone()
    raw[keys == I32_MIN] = -1  # RAW_NONE: the NaN whose key is INT32_MIN
    want = torch.full((3, keys.shape[0]), 12345, dtype=torch.int32, device=device)
    _probe[(1,)](keys.to(device), cnt.to(device), kk.to(device), want, R=keys.shape[0], CAP=keys.shape[1], KTH=2)
    want = want.cpu()
    got = torch.full((3, keys.shape[0]), 12345, dtype=torch.int32, device=device)
    _probe[(1,)](raw.to(device), cnt.to(device), kk.to(device), got, R=keys.shape[0], CAP=keys.shape[1], KTH=2,
                 RAW=True, HW=device == "cuda")
    assert torch.equal(got.cpu(), want), f"{case}: raw {got.cpu().tolist()} vs keys {want.tolist()}"
    _check_contract(keys, cnt, kk, got.cpu())


@interp
@pytest.mark.parametrize("case", CASES + ["signed_zero"])
def test_probe_raw_scores_match_keys(case):
    _raw_vs_keys(case, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES + ["signed_zero"])
def test_gpu_probe_raw_scores_match_keys(case):
    """The compiled count (the sign bit of an fp32 subtraction, summed) against the int-key search."""
    _raw_vs_keys(case, "cuda")


def _edge_scores():
    """fp32 scores [4, 64] that stress a count of keys >= x: +-0, denormals of both signs, the extremes, infinities,
    NaN holes (RAW_NONE bits), ordinary values; and probe keys [4, n]: the distinct keys of the row, their
    neighbours, key 0 and the keys next to it, as far as they lie where the searches probe (above the row's
    smallest key, at most its largest)."""
    v = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2.8e-45, -2.8e-45, 1e-40, -1e-40, 1.1754942e-38, -1.1754942e-38,
                      1.1754944e-38, -1.1754944e-38, 1.0, -1.0, 3.4028235e38, -3.4028235e38, float("inf"),
                      float("-inf"), 0.5, -0.5, 1e-30, -1e-30, 7.0, -7.0])
    g = torch.Generator().manual_seed(19)
    s = v[torch.randint(0, v.numel(), (4, 64), generator=g)]
    raw = s.view(torch.int32).clone()
    raw[:, ::5] = -1  # NaN holes
    keys = torch.where(raw == -1, I32_MIN, _keys(s))
    xs = []
    for r in range(4):
        k = keys[r][keys[r] != I32_MIN].unique()
        cand = torch.cat([k, k + 1, k - 1, torch.tensor([0, 1, -1, -2, 2], dtype=torch.int32)]).unique()
        cand = cand[(cand > k.min()) & (cand <= k.max())]  # the searches' probes: inside (lo, hm]
        xs.append(cand[torch.randperm(cand.numel(), generator=g)][:64])
    n = min(x.numel() for x in xs)
    return raw, keys, torch.stack([x[:n] for x in xs])


def _count_keys(keys, x):
    """[R, P]: for each probe x[r, p], the real keys (not INT32_MIN) of row r that are >= it."""
    real = keys != I32_MIN
    return ((keys[:, None, :] >= x[:, :, None]) & real[:, None, :]).sum(-1).to(torch.int32)


def test_count_sign_bit_rule():
    """The compiled count's rule, emulated in PyTorch (fp32 subtraction keeps denormals on the CPU; a NaN result is
    read as the GPU's canonical NaN, sign clear): the sign bit of (score of key x - 1, or of key -2 at x = 0) - s is
    set exactly for the scores whose key is >= x."""
    raw, keys, xs = _edge_scores()
    s = raw.view(torch.float32)
    x_t = torch.where(xs == 0, -2, xs - 1)
    t = torch.where(x_t >= 0, x_t, x_t ^ 0x7FFFFFFF).view(torch.float32)  # _key_to_score
    d = t[:, :, None] - s[:, None, :]  # [R, P, C]
    d = torch.where(torch.isnan(d), torch.tensor(float("nan")).abs(), d)  # canonical NaN: sign clear
    got = ((d.view(torch.int32) >> 31) & 1).sum(-1).to(torch.int32)
    assert torch.equal(got, _count_keys(keys, xs))


@triton.jit
def _count_kernel(raw_ptr, x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr, P: tl.constexpr, HW: tl.constexpr):
    """out [R, P]: _kernel._count_ge_f32_rows of the rows' raw fp32 scores [R, C] (as [R, 1, C]) at each probe key
    x [R, P]."""
    o_r = tl.arange(0, R)
    b_s = tl.load(raw_ptr + o_r[:, None] * C + tl.arange(0, C)[None, :]).to(tl.float32, bitcast=True)
    for i_p in tl.static_range(P):
        x = tl.load(x_ptr + o_r * P + i_p)  # [R]
        tl.store(out_ptr + o_r * P + i_p, _kernel._count_ge_f32_rows(tl.reshape(b_s, [R, 1, C]), x, HW))


def _count_run(device):
    raw, keys, xs = _edge_scores()
    out = torch.full(xs.shape, -7, dtype=torch.int32, device=device)
    _count_kernel[(1,)](raw.to(device), xs.contiguous().to(device), out, R=4, C=64, P=xs.shape[1],
                        HW=device == "cuda")
    assert torch.equal(out.cpu(), _count_keys(keys, xs)), "count of keys >= x"


@interp
def test_count_interpreter():
    """The interpreter's count (fp32 compares with the score of key x) on the edge values."""
    _count_run("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_count_edges():
    """The compiled sign-bit count (inline PTX sub.f32) on the edge values: denormals, +-0, infinities, NaN holes."""
    _count_run("cuda")


def _interp_cfg(H, topk, **kw):
    return op.replace(default_config(H, topk, interpret=True), **kw)


def _same_sets(q, w, k, st, en, topk, relu, cfg, interp_calls):
    """kth_search="interp" gives cfg's sets and scores (rows sorted by key index), deterministically, and the
    reference's sets."""
    base_i, base_v = by_index(*hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=cfg))
    interp_calls.clear()
    var = op.replace(cfg, kth_search="interp")
    got_i, got_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=var)
    assert interp_calls, "the interpolation path did not run"
    assert not torch.isnan(got_v).any(), "unwritten output scores"
    again = hytopk(q, w, k, st, en, topk, relu=relu, config=var)
    assert torch.equal(again, got_i), "two runs differ (order included)"
    s_i, s_v = by_index(got_i, got_v)
    assert torch.equal(s_i, base_i), "index sets differ with kth_search='interp'"
    assert torch.equal(s_v, base_v), "scores differ with kth_search='interp'"
    if cfg.append == "mask":  # ascending rows: the output itself is identical
        assert torch.equal(got_i, base_i)
    _assert_reference_sets(got_i, q, w, k, st, en, topk, relu)


@interp
@pytest.mark.parametrize("append", ["mask", "warps"])
@pytest.mark.parametrize("T,S,H,topk,relu,warm", [(9, 150, 2, 8, True, 64), (7, 140, 2, 12, False, 64),
                                                  (11, 60, 4, 5, False, 0)])
def test_interp_same_sets(T, S, H, topk, relu, warm, append, interp_calls):
    """CP offset, T / S not tile multiples, warm start (its sample select too), compactions in the key loop,
    identity activation with signed weights (negative scores)."""
    q, w, k = _inputs(T, S, H, seed=T + S)
    st, en = causal_bounds(T, S, offset=S - T)
    _same_sets(q, w, k, st, en, topk, relu, _interp_cfg(H, topk, warm_start=warm, append=append), interp_calls)


@interp
@pytest.mark.parametrize("append", ["mask", "warps"])
def test_interp_ties_and_packed(append, interp_calls):
    """ReLU exact zeros tied at the k-th score (ranking), packed segments with short and fully masked rows."""
    *case, topk = zero_ties_case()
    _same_sets(*case, topk, True, _interp_cfg(2, topk, warm_start=64, append=append), interp_calls)
    _same_sets(*packed_rows_case(), 8, True, _interp_cfg(2, 8, warm_start=64, append=append), interp_calls)


def test_config_errors():
    with pytest.raises(ValueError, match="kth_search must be one of"):
        op.check_config(op.Config(kth_search="bisect"), False)
    with pytest.raises(ValueError, match="needs search_bits=2 and select_prefix=False"):
        op.check_config(op.Config(kth_search="interp", select_prefix=True), False)
    with pytest.raises(ValueError, match="needs search_bits=2 and select_prefix=False"):
        op.check_config(op.Config(kth_search="interp", search_bits=1, append="mask"), False)
    op.check_config(op.Config(kth_search="interp"), False)
    assert op._kth_mode(op.Config(kth_search="interp"), True) == 2
    assert op._kth_mode(op.Config(select_prefix=True), True) == 1 and op._kth_mode(op.Config(), True) == 0
    # the default launch: interpolation from topk 1024 (measured faster at k 2048, slower at k 512)
    assert default_config(64, 2048).kth_search == "interp" and default_config(32, 1024).kth_search == "interp"
    assert default_config(4, 512).kth_search == "radix" and default_config(8, 2048, interpret=True).kth_search == "radix"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,H,relu,append", [(12288, 64, True, "warps"), (8192, 32, False, "warps"),
                                             (8192, 64, True, "mask")])
def test_gpu_interp_same_sets(T, H, relu, append):
    """bf16 at real shapes (k 2048, warm start, compactions): the radix select's sets and scores, twice."""
    q, w, k, st, en = gpu_causal_inputs(T, H)
    cfg = op.replace(default_config(H, 2048), append=append)
    bi, bv = by_index(*hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=cfg))
    var = op.replace(cfg, kth_search="interp")
    gi, gv = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=var)
    assert torch.equal(hytopk(q, w, k, st, en, 2048, relu=relu, config=var), gi), "two runs differ"
    si, sv = by_index(gi, gv)
    assert torch.equal(si, bi), f"index sets differ in {int((si != bi).any(1).sum())} rows"
    assert torch.equal(sv, bv), "scores differ"


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)
