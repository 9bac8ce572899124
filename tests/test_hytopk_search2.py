"""HyTopK's 2-bit radix select (Config.search_bits=2, `_kth_key2`) on near-tie keys.

The bug this guards against: the first `_kth_key2` (a full 16-pass search, session 4) decided bits
(31, 30) ... (3, 2) in two-bit passes and then only bit 0, never bit 1. Its k-th key was then one or
two below the true one whenever the true k-th key had bit 1 set; that only changes the result when
another buffered key sits within three ulps of the k-th (or ties with it), which random fp32 scores
almost never do (the interpreter tests passed) but which happened in 12 of 12288 rows at 12K tokens
on the H200. Too many keys were then kept: the final select wrote past its row (the next row's
output: a race, hence also a non-deterministic run).

Here every score is exactly one chosen fp32 value (q and w pick one coordinate of k, identity
activation, fp32 products), drawn from a few consecutive floats so that the k-th largest key has
neighbours and ties at every bit pattern of its two low bits. The current `_kth_key2` stops a row once
exactly k keys are at or above its prefix bucket's lower bound; with such ties most rows cannot stop
and must decide all 32 bits, bit 1 included (test_search_bits2_kth_key2_all_bits checks the search's
own outputs directly).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from hyscale_kernels.hytopk import hytopk, interpreter_active
from hyscale_kernels.hytopk._kernel import _kth_key2
from hyscale_kernels.hytopk.op import Config
from hyscale_kernels.hytopk.reference import causal_bounds, hytopk_reference
from interp_rerun import rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")


def _cfg(H, search_bits, warm=0):
    return Config(block_n=16, rows_x_heads=2 * H, num_warps=1, num_stages=1, programs_per_sm=1,
                  min_free_tiles=1, sel_chunk=64, search_bits=search_bits, warm_start=warm,
                  append="mask")  # 1-bit vs 2-bit identity: the "mask" append (ascending rows)


def _near_tie_inputs(T, S, H=4, D=16, spread=8, seed=0, base=1.0):
    """Row t's score of key s is exactly k[s, t % D]: consecutive floats base + j ulps, j < spread."""
    rng = np.random.default_rng(seed)
    ulps = np.nextafter(np.float32(base), np.float32(np.inf)) - np.float32(base)
    k = np.float32(base) + rng.integers(0, spread, size=(S, D)).astype(np.float32) * ulps
    k = torch.from_numpy(k.astype(np.float32))
    q = torch.zeros(T, H, D)
    w = torch.zeros(T, H)
    for t in range(T):
        q[t, t % H, t % D] = 1.0
        w[t, t % H] = 1.0 if t % 3 else -1.0  # negative weight: negative scores, biased keys below 0
    return q, w, k


def _low_bits_of_kth(q, w, k, st, en, topk):
    """The two low bits of each row's true k-th key (to show the cases really occur)."""
    sc = torch.einsum("thd,sd->tsh", q.double(), k.double()).mul(w.double()[:, None, :]).sum(-1).float()
    bits = set()
    for t in range(sc.shape[0]):
        row = sc[t, int(st[t]):int(en[t])]
        if row.numel() > topk:
            v = torch.sort(row, descending=True).values[topk - 1]
            b = int(np.float32(v).view(np.int32))
            key = b if b >= 0 else b ^ 0x7FFFFFFF
            bits.add(key & 3)
    return bits


@interp
@pytest.mark.parametrize("warm", [0, 64], ids=["cold", "warm"])
@pytest.mark.parametrize("spread", [4, 8, 64])
def test_search_bits2_near_ties_exact(spread, warm):
    T, S, H, topk = 12, 160, 4, 9
    q, w, k = _near_tie_inputs(T, S, H=H, spread=spread, seed=spread)
    st = torch.zeros(T, dtype=torch.int32)
    en = torch.full((T,), S, dtype=torch.int32)
    en[5] = 37  # a shorter row and a causal-style block too
    st[7], en[7] = 20, 150
    assert _low_bits_of_kth(q, w, k, st, en, topk) & {2, 3}, "no row whose k-th key has bit 1 set"
    ref = hytopk_reference(q, w, k, st, en, topk, relu=False)
    one_i, one_v = hytopk(q, w, k, st, en, topk, relu=False, return_scores=True, config=_cfg(H, 1, warm))
    two_i, two_v = hytopk(q, w, k, st, en, topk, relu=False, return_scores=True, config=_cfg(H, 2, warm))
    for t in range(T):
        assert set(two_i[t].tolist()) == set(ref[t].tolist()), f"row {t}: search_bits=2 set differs"
    assert torch.equal(two_i, one_i) and torch.equal(two_v, one_v), "search_bits 2 vs 1: not bit-identical"


@interp
def test_search_bits2_causal_near_ties():
    """Causal bounds, identity activation, ties across the whole key range."""
    T, S, H, topk = 14, 140, 4, 8
    q, w, k = _near_tie_inputs(T, S, H=H, spread=6, seed=3, base=-2.0)
    st, en = causal_bounds(T, S, offset=S - T)
    ref = hytopk_reference(q, w, k, st, en, topk, relu=False)
    idx = hytopk(q, w, k, st, en, topk, relu=False, config=_cfg(H, 2))
    for t in range(T):
        assert set(idx[t].tolist()) == set(ref[t].tolist()), f"row {t}"
    assert torch.equal(idx, hytopk(q, w, k, st, en, topk, relu=False, config=_cfg(H, 1)))


@triton.jit
def _kth_key2_probe(keys_ptr, cnt_ptr, out_ptr, kk, R: tl.constexpr, CAP: tl.constexpr):
    """The select's `_kth_key2` on [R, CAP] int32 key buffers: out = kth [R], n_gt [R], rank [R]."""
    o_r = tl.arange(0, R)
    cnt = tl.load(cnt_ptr + o_r)
    kth, n_gt, rank = _kth_key2(keys_ptr + o_r.to(tl.int64) * CAP, cnt, kk, R, CAP)
    tl.store(out_ptr + o_r, kth)
    tl.store(out_ptr + R + o_r, n_gt)
    tl.store(out_ptr + 2 * R + o_r, rank.to(tl.int32))


@interp
@pytest.mark.parametrize("spread", [2, 4, 8, 64, 1 << 20])
def test_search_bits2_kth_key2_all_bits(spread):
    """`_kth_key2` itself on int32 key buffers drawn from `spread` consecutive keys around several bases
    (negative keys included, garbage after each row's count): per row with cnt > k, n_gt = #keys > kth,
    #keys >= kth >= k, and `rank` exactly where the keys equal to kth do not all fit (or none is
    needed). Rows that did not stop early (n_gt < k) must hold the true k-th key: these include rows
    whose k-th key has bit 1 set (the session-4 bug)."""
    R, CAP = 4, 64
    rng = np.random.default_rng(spread)
    low_bits, n_full, n_stop = set(), 0, 0
    for it in range(24):
        kk = int(rng.integers(1, 40))
        base = int(rng.choice([-(1 << 30), -5, 0, 1, 1 << 20, (1 << 31) - spread - 1]))
        keys = rng.integers(-(1 << 31), 1 << 31, size=(R, CAP), dtype=np.int64)  # garbage after cnt
        cnt = rng.integers(kk + 1, CAP + 1, size=R)
        cnt[it % R] = min(CAP, kk + 1)  # just over k
        for r in range(R):
            keys[r, :cnt[r]] = base + rng.integers(0, spread, size=cnt[r])
        keys = torch.from_numpy(keys.astype(np.int32))
        out = torch.empty(3 * R, dtype=torch.int32)
        _kth_key2_probe[(1,)](keys, torch.from_numpy(cnt.astype(np.int32)), out, kk, R=R, CAP=CAP)
        kth, n_gt, rank = out[:R].tolist(), out[R:2 * R].tolist(), out[2 * R:].tolist()
        for r in range(R):
            row = keys[r, :cnt[r]].long()
            true_kth = int(torch.sort(row, descending=True).values[kk - 1])
            gt, ge = int((row > kth[r]).sum()), int((row >= kth[r]).sum())
            msg = f"it {it} row {r}: k {kk} cnt {cnt[r]} kth {kth[r]} (true {true_kth}) n_gt {n_gt[r]} rank {rank[r]}"
            assert n_gt[r] == gt and gt <= kk <= ge, msg
            assert bool(rank[r]) == (0 < kk - gt < ge - gt), msg
            if gt < kk:  # searched all 32 bits
                assert kth[r] == true_kth, msg
                n_full += 1
                low_bits.add(true_kth & 3)
            else:  # stopped early: its top k are exactly the keys > kth
                n_stop += 1
    if spread <= 64:  # ties at the k-th key: full searches, some of whose k-th keys have bit 1 set
        assert {2, 3} <= low_bits, low_bits
    if spread >= 64:  # (nearly) distinct keys: rows stop once exactly k keys are >= their bucket's bound
        assert n_stop > 0, "no row stopped early"


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)


# ---------------------------------------------------------------------------------------------
# GPU: the shape where the H200 showed the mismatch (session 4), and near ties in bf16
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("warm", [0, 1024])
@pytest.mark.parametrize("T,H,relu", [(12288, 64, True), (8192, 32, False)])
def test_gpu_search_bits2_bit_identical(T, H, relu, warm):
    """search_bits=2 gives the search_bits=1 output bit for bit (indices and scores), twice."""
    g = torch.Generator(device="cuda").manual_seed(T + H)
    q = torch.randn(T, H, 128, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(T, 128, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(T, H, generator=g, device="cuda")
    w = w.abs() if relu else w
    st, en = causal_bounds(T, T, device="cuda")
    base = Config(warm_start=warm, search_bits=1, append="mask")
    one = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=base)
    for _ in range(2):
        two = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True,
                     config=Config(warm_start=warm, search_bits=2, append="mask"))
        assert torch.equal(two[0], one[0]), f"{int((two[0] != one[0]).any(1).sum())} rows differ"
        assert torch.equal(two[1], one[1])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_search_bits2_near_ties():
    T, S, H, topk = 4096, 6000, 4, 512
    q, w, k = _near_tie_inputs(T, S, H=H, D=128, spread=16, seed=1)
    q, w, k = q.cuda(), w.cuda(), k.cuda()
    st = torch.zeros(T, dtype=torch.int32, device="cuda")
    en = torch.full((T,), S, dtype=torch.int32, device="cuda")
    one = hytopk(q, w, k, st, en, topk, relu=False, config=Config(search_bits=1, append="mask"))
    two = hytopk(q, w, k, st, en, topk, relu=False, config=Config(search_bits=2, append="mask"))
    assert torch.equal(one, two)
    ref = hytopk_reference(q[::257].cpu(), w[::257].cpu(), k.cpu(), st[::257].cpu(), en[::257].cpu(), topk, relu=False)
    for r, t in enumerate(range(0, T, 257)):
        assert set(two[t].tolist()) == set(ref[r].tolist()), f"row {t}"
