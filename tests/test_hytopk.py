"""HyTopK against the PyTorch reference.

CPU: the Triton kernel runs in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
triton is imported when there is no CUDA) at tiny fp32 shapes. If the kernel was imported without
the interpreter in this process, the interpreter tests re-run themselves in a subprocess.
GPU (``-m gpu``): real shapes in bf16.
"""

from __future__ import annotations

import logging

import pytest
import torch

from hyscale_kernels.hytopk import MAX_TOPK, hytopk, interpreter_active
from hyscale_kernels.hytopk.op import Config, hytopk_floor
from hyscale_kernels.hytopk.reference import (
    causal_bounds,
    hytopk_reference,
    index_scores_reference,
    packed_causal_bounds,
)
from interp_rerun import rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")


def _zero_ties(q, w, k, every):
    """Tie-heavy scores under ReLU: every q.k <= 0 (exact zeros after the activation) except, for every
    second row, the keys at multiples of ``every``, which score high. Modifies and returns (q, w, k)."""
    k = k.abs()
    q = -q.abs()
    q[:, :, 0] = 0.0
    k[::every, 0] = 50.0
    q[::2, :, 0] = 1.0
    return q, w, k


def _inputs(T, S, H, D=32, seed=0, dtype=torch.float32, device="cpu", w_sign=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(S, D, generator=g)
    w = torch.randn(T, H, generator=g)
    if not w_sign:
        w = w.abs()
    return q.to(device, dtype), w.to(device, dtype), k.to(device, dtype)


def assert_same_selection(q, w, k, st, en, topk, relu, idx, val=None, tol=1e-5):
    """Sets equal to the reference's; a differing row is allowed only at a near-tie on the boundary."""
    ri, rv = hytopk_reference(q, w, k, st, en, topk, relu=relu, return_scores=True)
    idx, ri = idx.cpu().long(), ri.cpu().long()
    rv = rv.cpu()
    assert idx.shape == ri.shape and idx.dtype == torch.long
    n_vis = (en.long() - st.long()).clamp(min=0).clamp(max=topk).cpu()
    assert torch.equal((idx >= 0).sum(1), n_vis), "number of selected keys per row"
    # -1 padding only after the selected keys; no duplicates; all inside the row's bounds
    for t in range(idx.shape[0]):
        sel = idx[t, : n_vis[t]]
        assert (idx[t, n_vis[t]:] == -1).all()
        assert sel.unique().numel() == sel.numel(), f"row {t}: duplicate indices"
        assert ((sel >= st[t].item()) & (sel < en[t].item())).all(), f"row {t}: index out of bounds"
    scores = index_scores_reference(q, w, k, relu).cpu()
    for t in range(idx.shape[0]):
        a, b = set(idx[t][idx[t] >= 0].tolist()), set(ri[t][ri[t] >= 0].tolist())
        if a != b:
            kth = rv[t, n_vis[t] - 1].item()
            scale = max(1.0, rv[t, 0].abs().item())
            gaps = [abs(scores[t, i].item() - kth) / scale for i in a ^ b]
            assert max(gaps) < tol, f"row {t}: sets differ beyond a near-tie (gap {max(gaps):.3g})"
    if val is not None:
        val = val.cpu()
        got = torch.where(idx >= 0, val, torch.full_like(val, float("-inf"))).sort(1, descending=True).values
        ref = rv.sort(1, descending=True).values
        fin = torch.isfinite(ref)
        assert torch.equal(fin, torch.isfinite(got))
        torch.testing.assert_close(got[fin], ref[fin], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# interpreter (CPU) tests of the Triton kernel
# ---------------------------------------------------------------------------------------------
@interp
@pytest.mark.parametrize("T,S,H,topk,relu", [(37, 45, 4, 8, True), (21, 50, 2, 5, False)])
def test_causal_ragged(T, S, H, topk, relu):
    """T, S not multiples of the tile; CP-style offset (rows are the last T of S); compactions."""
    q, w, k = _inputs(T, S, H, seed=T)
    st, en = causal_bounds(T, S, offset=S - T)
    idx, val = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True)
    assert idx.dtype == torch.int32 and val.dtype == torch.float32
    assert_same_selection(q, w, k, st, en, topk, relu, idx, val)


@interp
@pytest.mark.parametrize("relu", [True, False])
def test_short_segments_last_tile_moved(relu):
    """The key loop's last tile of a row block ends at the block's range (_tile_start): with packed segments shorter
    than a tile in the middle of k, the loaded tile starts below the block's first key (keys of the segment before,
    never visible); with S below a tile, k is padded to one. Same sets and scores as the reference."""

    lens = [21, 3, 7, 1, 18, 2, 5]  # the interpreter's tile: 16 keys
    st, en = packed_causal_bounds(lens)
    T = sum(lens)
    q, w, k = _inputs(T, T, 2, seed=11, w_sign=not relu)
    idx, val = hytopk(q, w, k, st, en, 4, relu=relu, return_scores=True)
    assert_same_selection(q, w, k, st, en, 4, relu, idx, val)
    q, w, k = _inputs(6, 7, 2, seed=12)  # S = 7 < one tile
    st, en = causal_bounds(6, 7, offset=1)
    idx, val = hytopk(q, w, k, st, en, 3, relu=relu, return_scores=True)
    assert_same_selection(q, w, k, st, en, 3, relu, idx, val)


@interp
@pytest.mark.parametrize("relu", [True, False])
def test_k_tma_same_selection(relu):
    """Config.k_tma (the key tiles through a tensor descriptor of k): the reference's sets and scores on causal rows
    with a CP offset, packed segments shorter than a tile and S below a tile; the same output as the pointer loads."""
    from dataclasses import replace

    from hyscale_kernels.hytopk.op import default_config

    lens = [21, 3, 7, 1, 18, 2, 5]
    cases = [(37, 45, causal_bounds(37, 45, offset=8)), (sum(lens), sum(lens), packed_causal_bounds(lens)),
             (6, 7, causal_bounds(6, 7, offset=1))]
    for T, S, (st, en) in cases:
        q, w, k = _inputs(T, S, 2, seed=T, w_sign=not relu)
        cfg = replace(default_config(2, 5, interpret=True), k_tma=True)
        idx, val = hytopk(q, w, k, st, en, 5, relu=relu, return_scores=True, config=cfg)
        assert_same_selection(q, w, k, st, en, 5, relu, idx, val)
        base_i, base_v = hytopk(q, w, k, st, en, 5, relu=relu, return_scores=True)
        assert torch.equal(idx, base_i) and torch.equal(val, base_v)


def test_k_tma_needs_power_of_two_head_dim():
    from hyscale_kernels.hytopk.op import _launch

    q, w, k = _inputs(4, 8, 2, D=48, seed=1)
    st, en = causal_bounds(4, 8, offset=4)
    with pytest.raises(ValueError, match="Config.k_tma needs D_I a power of two"):
        _launch(q, w, k, st, en, 2, True, False, config=Config(k_tma=True, block_n=16, rows_x_heads=4, num_warps=1,
                                                               num_stages=1, programs_per_sm=1, min_free_tiles=1,
                                                               sel_chunk=64))


@interp
def test_short_and_masked_rows():
    """Rows with fewer visible keys than topk (-1 padding), fully masked rows, topk > S."""
    T, S, H, topk = 12, 10, 2, 16
    q, w, k = _inputs(T, S, H, seed=3)
    st, en = causal_bounds(T, S)
    st, en = st.clone(), en.clone()
    st[4], en[4] = 5, 5  # fully masked
    st[7], en[7] = 0, 0
    idx, val = hytopk(q, w, k, st, en, topk, return_scores=True)
    assert (idx[4] == -1).all() and (idx[7] == -1).all() and torch.isinf(val[4]).all()
    assert_same_selection(q, w, k, st, en, topk, True, idx, val)


@interp
def test_ties_exact_zeros():
    """ReLU zeros: most keys score exactly 0; the boundary falls among the zeros (index asc)."""
    T, S, H, D, topk = 16, 48, 2, 16, 8
    q, w, k = _zero_ties(*_inputs(T, S, H, D=D, seed=5, w_sign=False), every=7)
    st, en = causal_bounds(T, S, offset=S - T)
    idx = hytopk(q, w, k, st, en, topk)
    ri = hytopk_reference(q, w, k, st, en, topk)
    for t in range(T):  # exact set equality: the zeros must be the lowest indices
        assert set(idx[t].tolist()) == set(ri[t].tolist()), t


@interp
def test_negative_scores_identity():
    """Identity activation and negative weights: all scores may be negative."""
    T, S, H, topk = 20, 40, 4, 24  # most rows must also pick negative scores
    q, w, k = _inputs(T, S, H, seed=9)
    w = -w.abs()
    st, en = causal_bounds(T, S, offset=S - T)
    idx, val = hytopk(q, w, k, st, en, topk, relu=False, return_scores=True)
    assert (val[idx >= 0] < 0).any()
    assert_same_selection(q, w, k, st, en, topk, False, idx, val)


@interp
def test_packed_segments_and_determinism():
    """Packed sequences (several segments), topk > some segment lengths; two runs identical."""
    lens = [9, 17, 4, 14]
    st, en = packed_causal_bounds(lens)
    T = sum(lens)
    q, w, k = _inputs(T, T, 2, seed=11)
    idx1 = hytopk(q, w, k, st, en, 6)
    idx2 = hytopk(q, w, k, st, en, 6)
    assert torch.equal(idx1, idx2)
    assert_same_selection(q, w, k, st, en, 6, True, idx1)


@interp
@pytest.mark.parametrize("search_bits", [1, 2])
def test_block_rows_config(search_bits):
    """Other launch shapes (more rows per program, bigger tiles, 1-bit radix passes with the "mask" append, which
    they need; 2-bit passes with the default "warps" append): same sets."""
    T, S, H, topk = 19, 70, 4, 8
    q, w, k = _inputs(T, S, H, seed=13)
    w[3] = -w[3].abs()
    st, en = causal_bounds(T, S, offset=S - T)
    cfg = Config(block_n=32, rows_x_heads=16, num_warps=1, num_stages=1, programs_per_sm=1,
                 min_free_tiles=1, sel_chunk=64, search_bits=search_bits,
                 append="warps" if search_bits == 2 else "mask")
    idx, val = hytopk(q, w, k, st, en, topk, relu=False, return_scores=True, config=cfg)
    assert_same_selection(q, w, k, st, en, topk, False, idx, val)


@interp
@pytest.mark.parametrize("H,rows_x_heads,append,warm", [(4, 16, "mask", 0), (4, 16, "tile", 32), (2, 16, "mask", 32),
                                                         (2, 16, "tile", 0)])
def test_lane_rows_column_order(H, rows_x_heads, append, warm):
    """Config.lane_rows (score-tile columns ordered so that each accumulator lane holds whole rows) at 4 and
    8 rows per tile, both appends, with and without the warm start: the reference's sets, and the same sets
    and scores (to fp32 rounding: another head-sum order) as the (row, head) order."""
    from hyscale_kernels.hytopk import op

    T, S, topk = 23, 90, 12
    q, w, k = _inputs(T, S, H, seed=17)
    w[5] = -w[5].abs()
    st, en = causal_bounds(T, S, offset=S - T)
    st, en = st.clone(), en.clone()
    st[2], en[2] = 4, 4  # a fully masked row
    base = Config(block_n=16, rows_x_heads=rows_x_heads, num_warps=1, num_stages=1, programs_per_sm=1,
                  min_free_tiles=1, sel_chunk=64, append=append, warm_start=warm)
    R = rows_x_heads // H
    base = Config(**dict(base.__dict__, lane_rows=True))
    assert op.lane_rows(base, R, H) and not op.lane_rows(Config(lane_rows=False), R, H)
    res = {}
    for lane, head_sum in ((True, "chains"), (True, "pairs"), (False, "chains")):  # Config.head_sum: both orders
        cfg = Config(**dict(base.__dict__, lane_rows=lane, head_sum=head_sum))
        assert op.kernel_constexprs(cfg, H, 32, topk, select=True, relu=False, write_scores=True, ieee=True,
                                    interp=True)["LANE_ROWS"] == (op.HEAD_SUMS.index(head_sum) + 1 if lane else 0)
        res[lane, head_sum] = hytopk(q, w, k, st, en, topk, relu=False, return_scores=True, config=cfg)
        assert_same_selection(q, w, k, st, en, topk, False, *res[lane, head_sum])
    for key in ((True, "pairs"), (False, "chains")):
        assert torch.equal(res[True, "chains"][0], res[key][0])
        torch.testing.assert_close(res[True, "chains"][1], res[key][1], rtol=1e-6, atol=1e-6)


@interp
def test_head_sum_config_error():
    q, w, k = _inputs(8, 16, 4, seed=1)
    st, en = causal_bounds(8, 16, offset=8)
    with pytest.raises(ValueError, match="Config.head_sum must be one of"):
        hytopk(q, w, k, st, en, 4, config=Config(head_sum="tree"))


def test_register_cap_fits_programs_per_sm():
    """programs_per_sm above what 255 registers per thread allow caps ptxas' registers so the programs fit one SM's
    65536; a count that leaves fewer than 64 registers is refused, naming the fields."""
    from hyscale_kernels.hytopk import op

    assert op.register_cap(Config()) is None and op.register_cap(Config(programs_per_sm=1)) is None
    assert op.register_cap(Config(programs_per_sm=3)) == 168  # 3 x 4 warps: 65536 / 384 = 170.7 -> 168
    assert op.register_cap(Config(programs_per_sm=4)) == 128
    assert op.register_cap(Config(programs_per_sm=2, num_warps=8)) == 128
    for p in (3, 4):
        assert p * 4 * 32 * op.register_cap(Config(programs_per_sm=p)) <= op.REGS_PER_SM
        op.check_config(Config(programs_per_sm=p), interpret=False)
    with pytest.raises(ValueError, match="programs_per_sm=9 with num_warps=4 leaves 56 registers"):
        op.check_config(Config(programs_per_sm=9), interpret=False)
    with pytest.raises(ValueError, match="programs_per_sm=0"):
        op.check_config(Config(programs_per_sm=0), interpret=False)


def test_lane_rows_needs_four_rows_and_even_heads():
    from hyscale_kernels.hytopk import op

    assert Config().lane_rows  # default since the H200 timing (session 9)
    cfg = Config(lane_rows=True)
    assert op.lane_rows(cfg, 4, 64) and op.lane_rows(cfg, 8, 4)
    assert not op.lane_rows(cfg, 2, 8) and not op.lane_rows(cfg, 1, 64)  # fewer than 4 rows: (row, head) order
    assert not op.lane_rows(cfg, 4, 3)  # odd head count


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)


# ---------------------------------------------------------------------------------------------
# API: validation and dispatch (no kernel run needed)
# ---------------------------------------------------------------------------------------------
def test_bad_inputs():
    T, S, H, D = 6, 8, 2, 32
    q, w, k = _inputs(T, S, H, D=D)
    st, en = causal_bounds(T, S)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        hytopk(q.numpy(), w, k, st, en, 4)
    with pytest.raises(ValueError, match="q must be 3-D"):
        hytopk(q[0], w, k, st, en, 4)
    with pytest.raises(ValueError, match="w must have shape"):
        hytopk(q, w[:, :1], k, st, en, 4)
    with pytest.raises(ValueError, match="k must have shape"):
        hytopk(q, w, k[:, :16], st, en, 4)
    with pytest.raises(TypeError, match="k must have the dtype of q"):
        hytopk(q, w, k.half(), st, en, 4)
    with pytest.raises(TypeError, match="starts must have dtype"):
        hytopk(q, w, k, st.long(), en, 4)
    with pytest.raises(TypeError, match="q must have dtype"):
        hytopk(q.to(torch.int32), w, k, st, en, 4)
    with pytest.raises(ValueError, match="ends must have shape"):
        hytopk(q, w, k, st, en[:-1], 4)
    with pytest.raises(ValueError, match="topk must be in"):
        hytopk(q, w, k, st, en, 0)
    with pytest.raises(ValueError, match="topk must be in"):
        hytopk(q, w, k, st, en, MAX_TOPK + 1)
    with pytest.raises(TypeError, match="topk must be an int"):
        hytopk(q, w, k, st, en, 4.0)
    with pytest.raises(ValueError, match="ends must be <= S"):
        hytopk(q, w, k, st, en + S, 4)
    with pytest.raises(ValueError, match="starts must be >= 0"):
        hytopk(q, w, k, st - 1, en, 4)
    with pytest.raises(ValueError, match="starts must be <= ends"):
        hytopk(q, w, k, en, st, 4)
    with pytest.raises(ValueError, match="contiguous"):
        hytopk(q.transpose(0, 1).contiguous().transpose(0, 1), w, k, st, en, 4)
    with pytest.raises(ValueError, match="power of two"):
        hytopk(q[:, :1].expand(T, 3, D).contiguous(), w[:, :1].expand(T, 3).contiguous(), k, st, en, 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        hytopk(q[:, :, :24].contiguous(), w, k[:, :24].contiguous(), st, en, 4)
    with pytest.raises(ValueError, match="impl must be"):
        hytopk(q, w, k, st, en, 4, impl="cuda")
    if HAS_CUDA:
        with pytest.raises(ValueError, match="expected"):
            hytopk(q, w, k.cuda(), st, en, 4)


def test_reference_path_and_log(caplog, monkeypatch):
    """impl='reference' is the spec; 'auto' on CPU without the interpreter logs one line."""
    T, S, H = 10, 12, 2
    q, w, k = _inputs(T, S, H)
    st, en = causal_bounds(T, S)
    idx = hytopk(q, w, k, st, en, 20, impl="reference")  # topk > S: -1 padded
    assert idx.shape == (T, 20) and (idx[:, S:] == -1).all()
    from hyscale_kernels.hytopk import op

    monkeypatch.setattr(op, "interpreter_active", lambda: False)
    monkeypatch.setattr(op, "_logged_reference", False)
    with caplog.at_level(logging.INFO, logger="hyscale_kernels"):
        a = hytopk(q, w, k, st, en, 5)
        hytopk(q, w, k, st, en, 5)
    msgs = [r for r in caplog.records if "reference" in r.getMessage()]
    assert len(msgs) == 1
    assert torch.equal(a, hytopk_reference(q, w, k, st, en, 5))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        hytopk(q, w, k, st, en, 5, impl="triton")


# ---------------------------------------------------------------------------------------------
# GPU: real shapes in bf16
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T,S,H,topk,relu,ratio", [
    (4096, 4096, 64, 2048, True, 1),
    (3000, 5000, 32, 2048, False, 1),
    (8192, 2048, 4, 512, True, 4),
    (6000, 6000, 16, 2048, True, 1),  # H 16 (8 rows per tile since session 24): first GPU-checked in session 23
    (5000, 5000, 8, 1024, False, 1),  # H 8 (4 rows per tile), topk 1024: first GPU-checked in session 24
])
@pytest.mark.parametrize("lane_rows", [False, True])
def test_gpu_matches_reference(T, S, H, topk, relu, ratio, lane_rows):
    from dataclasses import replace

    from hyscale_kernels.hytopk.op import default_config

    q, w, k = _inputs(T, S, H, D=128, seed=T, dtype=torch.bfloat16, device="cuda", w_sign=not relu)
    if ratio == 1:
        st, en = causal_bounds(T, S, offset=S - T, device="cuda")
    else:
        t = torch.arange(T, device="cuda")
        st, en = torch.zeros_like(t, dtype=torch.int32), ((t + 1) // ratio).to(torch.int32)
    cfg = replace(default_config(H, topk), lane_rows=lane_rows)
    idx, val = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=cfg)
    assert torch.equal(idx, hytopk(q, w, k, st, en, topk, relu=relu, config=cfg))
    rows = torch.cat([torch.arange(0, T, max(1, T // 48)), torch.arange(T - 8, T)]).cuda()
    assert_same_selection(q[rows].float(), w[rows].float(), k.float(), st[rows], en[rows], topk, relu,
                          idx[rows], val[rows], tol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_packed_segments():
    lens = [1000, 3000, 77, 2500]
    st, en = packed_causal_bounds(lens, device="cuda")
    T = sum(lens)
    q, w, k = _inputs(T, T, 64, D=128, seed=2, dtype=torch.bfloat16, device="cuda", w_sign=False)
    idx = hytopk(q, w, k, st, en, 2048)
    rows = torch.arange(0, T, 97, device="cuda")
    assert_same_selection(q[rows].float(), w[rows].float(), k.float(), st[rows], en[rows], 2048, True, idx[rows])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T,S,H,relu,packed", [(9000, 9000, 32, False, False), (6000, 6100, 64, True, False),
                                               (6577, 6577, 64, True, True)])
def test_gpu_k_tma_bit_identical(T, S, H, relu, packed):
    """Config.k_tma (TMA bulk copies of the key tiles) gives the default launch's indices and scores bit for bit
    (only the load path differs), on causal rows with a CP offset and on packed segments (one shorter than a tile)."""
    from dataclasses import replace

    from hyscale_kernels.hytopk.op import default_config

    q, w, k = _inputs(T, S, H, D=128, seed=T, dtype=torch.bfloat16, device="cuda", w_sign=not relu)
    if packed:
        st, en = packed_causal_bounds([1000, 3000, 40, 2537], device="cuda")
    else:
        st, en = causal_bounds(T, S, offset=S - T, device="cuda")
    base_i, base_v = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True)
    cfg = replace(default_config(H, 2048), k_tma=True)
    idx, val = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=cfg)
    assert torch.equal(idx, base_i) and torch.equal(val, base_v)


def test_validate_accepts_1m_tokens_and_rejects_int32_overflow():
    """1M tokens x top-2048 (2**31 output slots) is valid: output offsets are int64 in the kernel.
    Only T * H_I (int32 row offsets of w and q rows) or S at 2**31 is refused, and S x D_I at 2**31 (the key loop's
    int32 offsets into k: 16M keys at D_I 128). Meta tensors: no memory."""
    from hyscale_kernels.hytopk.op import _validate

    def case(T, H, S):
        m = dict(device="meta")
        return (torch.empty(T, H, 128, dtype=torch.bfloat16, **m), torch.empty(T, H, **m),
                torch.empty(S, 128, dtype=torch.bfloat16, **m), torch.empty(T, dtype=torch.int32, **m),
                torch.empty(T, dtype=torch.int32, **m))

    q, w, k, st, en = case(1 << 20, 64, 1 << 20)
    _validate(q, w.bfloat16(), k, st, en, 2048, "auto", check_bounds=False)
    q, w, k, st, en = case(1 << 25, 64, 16)
    with pytest.raises(ValueError, match="must be < 2\\*\\*31"):
        _validate(q, w.bfloat16(), k, st, en, 2048, "auto", check_bounds=False)
    q, w, k, st, en = case(16, 64, (1 << 24) - 1)  # the largest key count at D_I 128 (int32 key offsets)
    _validate(q, w.bfloat16(), k, st, en, 2048, "auto", check_bounds=False)
    q, w, k, st, en = case(16, 64, 1 << 24)
    with pytest.raises(ValueError, match="S x D_I = 16777216 x 128 elements: must be < 2\\*\\*31"):
        _validate(q, w.bfloat16(), k, st, en, 2048, "auto", check_bounds=False)


@interp
@pytest.mark.parametrize("lazy_max", [False, True])
def test_floor_row_max(lazy_max):
    """The benchmark floor (no selection) returns each row's max visible score, with the per-tile cross-warp
    max or (lazy_max) the per-element max reduced after the key loop; -inf for a row with no visible key.
    T, S not multiples of the tile; causal bounds plus one empty row; signed weights, identity and ReLU."""
    T, S, H = 37, 45, 4
    q, w, k = _inputs(T, S, H, seed=7)
    st, en = causal_bounds(T, S)
    en = en.clone()
    en[3] = st[3]  # no visible key
    for relu in (True, False):
        got = hytopk_floor(q, w, k, st, en, relu=relu, topk=8, lazy_max=lazy_max)
        sc = index_scores_reference(q, w, k, relu=relu)
        cols = torch.arange(S)
        vis = (cols[None, :] >= st[:, None].long()) & (cols[None, :] < en[:, None].long())
        ref = sc.masked_fill(~vis, float("-inf")).amax(dim=1)
        assert got.shape == (T,) and got[3] == float("-inf")
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@interp
def test_ablation_entry_point():
    """op.hytopk_ablation (bench/topk.py --parts ablate: timing variants, not selections) refuses unknown modes;
    mode 2 really lets no key become a candidate: every output slot is -1 padding (and its fail-safe re-run from
    -inf is off, so the key loop runs once)."""
    from hyscale_kernels.hytopk.op import hytopk_ablation

    T, S, H, topk = 9, 40, 4, 4
    q, w, k = _inputs(T, S, H, seed=3)
    st, en = causal_bounds(T, S, offset=S - T)
    with pytest.raises(ValueError, match="ablate must be one of"):
        hytopk_ablation(q, w, k, st, en, topk, 0)
    for mode in (4, 5):  # "one segment" only with no candidates (else a region could overflow)
        with pytest.raises(ValueError, match="ablate must be one of"):
            hytopk_ablation(q, w, k, st, en, topk, mode)
    for mode in (1, 3, 7):
        assert hytopk_ablation(q, w, k, st, en, topk, mode).shape == (T, topk)
    for mode in (2, 6):
        assert (hytopk_ablation(q, w, k, st, en, topk, mode) == -1).all()
