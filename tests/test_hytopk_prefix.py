"""HyTopK's Config.select_prefix: the 2-bit radix select starts below the leading bits its rows' keys share.

The skipped passes' outcome is known (every key in the shared bucket, none above it), so the result must be
bit-identical to the search from the top. (1) A probe kernel runs _kth_key2 on crafted buffers (narrow and wide
key ranges, all keys equal, keys across the sign, rows at or below k, holes, per-row k as in the warm start) with
and without the prefix (KTH=1) and checks both against the contract (keys > kth, ties, rank); (2) whole HyTopK launches with
and without it give identical indices and scores (mask and warps appends, warm start, compactions, ties, negative
scores, packed segments) and the reference's sets; a spy checks that the prefix path ran with shared bits.

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
from test_hytopk_warmstart import _assert_reference_sets, _inputs
from test_hytopk_warps import gpu_causal_inputs, packed_rows_case, zero_ties_case

INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")
I32_MIN = -(2**31)


@triton.jit
def _probe(key_ptr, cnt_ptr, kk_ptr, out_ptr, R: tl.constexpr, CAP: tl.constexpr, KTH: tl.constexpr,
           RAW: tl.constexpr = False, HW: tl.constexpr = False):
    """_kth_key2 on buffers [R, CAP] of int32 keys (RAW: raw fp32 bits, holes RAW_NONE, as the default launches
    hold them; HW: the compiled count): out [3, R] = kth, n_gt, rank."""
    o_r = tl.arange(0, R)
    cnt = tl.load(cnt_ptr + o_r)
    kk = tl.load(kk_ptr + o_r)
    kth, n_gt, rank = _kernel._kth_key2(key_ptr + o_r * CAP, cnt, kk, R, CAP, RAW, KTH=KTH, HW=HW)
    tl.store(out_ptr + o_r, kth)
    tl.store(out_ptr + R + o_r, n_gt)
    tl.store(out_ptr + 2 * R + o_r, rank.to(tl.int32))


def _keys(scores):
    """fp32 scores -> the kernel's int32 keys (order-preserving; -0.0 folded onto +0.0)."""
    b = torch.where(scores == 0, torch.zeros_like(scores), scores).view(torch.int32)
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF)


def _run_probe(keys, cnt, kk, prefix):
    R, CAP = keys.shape
    out = torch.full((3, R), 12345, dtype=torch.int32)
    _probe[(1,)](keys.contiguous(), cnt, kk, out, R=R, CAP=CAP, KTH=int(prefix))
    return out


def _check_contract(keys, cnt, kk, out):
    """Rows with more than kk real keys: its top kk are the keys > kth plus kk - n_gt keys equal to kth; rank
    marks rows where some but not all keys equal to kth fit (where none fit, n_gt == kk, no key equal to kth is
    taken and the flag is not read: an early stop at x = kth + 1 may have keys equal to kth, e.g. adjacent floats)."""
    for r in range(keys.shape[0]):
        row = keys[r, : int(cnt[r])]
        row = row[row != I32_MIN].long()
        k_r = int(kk[r])
        if row.numel() <= k_r:
            continue
        kth, n_gt, rank = (int(x) for x in out[:, r])
        top = row.sort(descending=True).values[:k_r]
        assert int((row > kth).sum()) == n_gt, f"row {r}: keys > kth"
        assert n_gt <= k_r and int((row >= kth).sum()) >= k_r, f"row {r}: kth is not the k-th key's bucket"
        assert int((row > kth).sum()) + int((row == kth).sum()) >= k_r
        assert set(row[row > kth].tolist()) <= set(top.tolist()), f"row {r}: a key > kth outside the top kk"
        if n_gt < k_r:
            assert bool(rank) == (int((row == kth).sum()) > k_r - n_gt), f"row {r}: rank flag"


@interp
@pytest.mark.parametrize("case", ["narrow", "wide", "equal", "sign", "small_rows", "holes", "per_row_k"])
def test_probe_prefix_matches_top_search(case):
    """_kth_key2 with the prefix (KTH=1) equals the search from the top (kth, n_gt, rank) and meets its contract."""
    g = torch.Generator().manual_seed(hash(case) % 1000)
    R, CAP = 4, 64
    kk = torch.full((R,), 20, dtype=torch.int32)
    cnt = torch.full((R,), CAP, dtype=torch.int32)
    if case == "narrow":  # candidates above a threshold: one exponent, leading mantissa bits shared
        s = 3.0 + 0.01 * torch.rand(R, CAP, generator=g)
    elif case == "wide":
        s = torch.randn(R, CAP, generator=g) * torch.tensor([1.0, 100.0, 1e-3, 1e6])[:, None]
    elif case == "equal":  # all 32 bits shared (rank: more ties than fit)
        s = torch.full((R, CAP), 1.5)
        s[1] = torch.rand(CAP, generator=g)  # one other row
    elif case == "sign":
        s = torch.randn(R, CAP, generator=g) * 1e-3
        s[2] = -2.0 - torch.rand(CAP, generator=g)  # all negative, narrow
    elif case == "small_rows":  # some rows at or below k (done), one with 0 keys
        s = 5.0 + torch.rand(R, CAP, generator=g)
        cnt = torch.tensor([CAP, 20, 7, 0], dtype=torch.int32)
    elif case == "holes":  # INT32_MIN slots (the warps regions' holes / invisible samples) never count
        s = 2.0 + torch.rand(R, CAP, generator=g)
    else:  # the warm start's per-row k: one row's k above its real keys forces the top search
        s = 7.0 + torch.rand(R, CAP, generator=g)
        kk = torch.tensor([3, 40, 1, 63], dtype=torch.int32)
    keys = _keys(s.float())
    if case == "holes":
        keys[:, ::3] = I32_MIN
        keys[3, 10:] = I32_MIN
    if case == "per_row_k":
        keys[3, 30:] = I32_MIN  # 30 real keys < k = 63
    top = _run_probe(keys, cnt, kk, False)
    pre = _run_probe(keys, cnt, kk, True)
    assert (pre != 12345).all(), "unwritten probe output"
    open_rows = [r for r in range(R) if int(cnt[r]) > int(kk[r])]
    assert torch.equal(pre[:, open_rows], top[:, open_rows]), f"the prefix changed the result:\n{top}\n{pre}"
    _check_contract(keys, cnt, kk, pre)


@pytest.fixture
def clz_calls(monkeypatch):
    """Shared leading bits computed by the prefix path, per call (the interpreter looks jit functions up in the
    module at call time)."""
    calls = []
    inner = _kernel._clz32

    def spy(x):
        out = inner(x)
        calls.append(out.handle.data.copy())  # the interpreter tensor's numpy array
        return out

    monkeypatch.setattr(_kernel, "_clz32", spy)
    return calls


def _interp_cfg(H, topk, **kw):
    return op.replace(default_config(H, topk, interpret=True), **kw)


def _same_with_prefix(q, w, k, st, en, topk, relu, cfg, clz_calls):
    """cfg with select_prefix on gives cfg's indices and scores exactly (order included) and the reference sets."""
    clz_calls.clear()
    base_i, base_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=cfg)
    assert not clz_calls, "select_prefix off must not take the prefix path"
    var_i, var_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True,
                          config=op.replace(cfg, select_prefix=True))
    assert clz_calls, "the prefix path did not run"
    assert not torch.isnan(var_v).any(), "unwritten output scores"
    assert torch.equal(var_i, base_i), "indices differ with select_prefix"
    assert torch.equal(var_v, base_v), "scores differ with select_prefix"
    _assert_reference_sets(var_i, q, w, k, st, en, topk, relu)
    return var_i


@interp
@pytest.mark.parametrize("append", ["mask", "warps"])
@pytest.mark.parametrize("T,S,H,topk,relu,warm", [(9, 150, 2, 8, True, 64), (7, 140, 2, 12, False, 64),
                                                  (11, 60, 4, 5, False, 0)])
def test_prefix_bit_identical(T, S, H, topk, relu, warm, append, clz_calls):
    """Causal with a CP offset, T / S not tile multiples, warm start (its sample select too) and compactions in
    the key loop; identity activation with signed weights (negative scores)."""
    q, w, k = _inputs(T, S, H, seed=T + S)
    st, en = causal_bounds(T, S, offset=S - T)
    _same_with_prefix(q, w, k, st, en, topk, relu, _interp_cfg(H, topk, warm_start=warm, append=append), clz_calls)
    if warm:  # the candidates above a sampled threshold share leading bits (at S 60 without it: keys of both signs)
        shared = max(int(c.min()) for c in clz_calls)
        assert shared >= 2, f"no select saw shared leading bits (max {shared}): nothing was skipped"


@interp
@pytest.mark.parametrize("append", ["mask", "warps"])
def test_prefix_ties_and_packed(append, clz_calls):
    """ReLU exact zeros tied at the k-th score (ranking), packed segments with short and fully masked rows."""
    *case, topk = zero_ties_case()
    _same_with_prefix(*case, topk, True, _interp_cfg(2, topk, warm_start=64, append=append), clz_calls)
    _same_with_prefix(*packed_rows_case(), 8, True, _interp_cfg(2, 8, warm_start=64, append=append), clz_calls)


def test_config_error():
    with pytest.raises(ValueError, match="select_prefix needs search_bits=2"):
        op.check_config(op.Config(select_prefix=True, search_bits=1, append="mask"), False)
    op.check_config(op.Config(select_prefix=True), False)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,relu,append", [(12288, 64, True, "mask"), (8192, 32, False, "warps")])
def test_gpu_prefix_bit_identical(T, H, relu, append):
    """bf16 at real shapes (k 2048, warm start, compactions): identical indices and scores with select_prefix."""
    q, w, k, st, en = gpu_causal_inputs(T, H)
    cfg = op.replace(default_config(H, 2048), append=append, kth_search="radix")  # the prefix: a radix shortcut
    bi, bv = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=cfg)
    pi, pv = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=op.replace(cfg, select_prefix=True))
    assert torch.equal(pi, bi), f"indices differ in {int((pi != bi).any(1).sum())} rows"
    assert torch.equal(pv, bv), "scores differ"


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)
