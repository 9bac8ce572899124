"""The select's stable rewrite for append="warps" raw-score buffers (_kernel._rewrite_warps_raw) against a PyTorch model.

The rewrite keeps, in slot order, each row's scores whose key is > kth and, where the row keeps some keys equal to kth
(n_eq > 0), those equal to kth whose key index is <= x_tie; NaN holes never. In place (a compaction) the kept entries
move to the row's first slots; FINAL writes their indices (and, WRITE_SCORES, their scores with -0.0 folded onto
+0.0) to the output rows. Rows outside m_rows write nothing. The masks are int32 0 / 1 tensors and the next chunk is
loaded ahead (past the row's end on the last chunk: the buffer here has a chunk of padding, as op._launch allocates),
so the cases cover several chunks (and chunks of several 128-slot runs, the row layout's unit), holes, signed
zeros, ties cut by key index, rows that keep everything (kth INT32_MIN) and a masked row.

CPU: the interpreter (plain masked stores); GPU: the inline-PTX stores.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from hyscale_kernels.hytopk import _kernel, interpreter_active
from interp_rerun import rerun_under_interpreter
from test_hytopk_prefix import I32_MIN, _keys

INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")
R = 4
GEOMETRIES = [(64, 16), (512, 256)]  # (CAP, CHUNK): one run of CHUNK slots per chunk; 256: two runs of 128 (LW)


@triton.jit
def _rewrite_probe(key_ptr, idx_ptr, out_key_ptr, out_idx_ptr, rows_ptr, kth_ptr, neq_ptr, xtie_ptr, base_ptr,
                   R: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr, FINAL: tl.constexpr,
                   WRITE_SCORES: tl.constexpr, HW: tl.constexpr):
    """_rewrite_warps_raw on buffers [R, CAP] (in place unless FINAL: then into out rows [R, CAP]); base [R]."""
    o_r = tl.arange(0, R)
    key_rows = key_ptr + o_r * CAP
    idx_rows = idx_ptr + o_r * CAP
    if FINAL:
        dst_key = out_key_ptr + o_r * CAP
        dst_idx = out_idx_ptr + o_r * CAP
    else:
        dst_key = key_rows
        dst_idx = idx_rows
    kth = tl.load(kth_ptr + o_r)
    base = _kernel._rewrite_warps_raw(key_rows, idx_rows, dst_key, dst_idx, tl.load(rows_ptr + o_r) != 0,
                                      _kernel._thr_score(kth), _kernel._thr_score(kth - 1), tl.load(neq_ptr + o_r),
                                      tl.load(xtie_ptr + o_r), FINAL, WRITE_SCORES, CAP, CHUNK, HW)
    tl.store(base_ptr + o_r, base)


def _case(CAP):
    """(raw fp32 bits [R, CAP] with NaN holes, key indices [R, CAP], kth, n_eq, x_tie, m_rows) per row: 0 ties at
    the k-th key cut by key index, 1 keeps everything (kth INT32_MIN), 2 signed zeros at and above kth with holes in
    every chunk, 3 masked out."""
    g = torch.Generator().manual_seed(7)
    s = torch.randn(R, CAP, generator=g)
    s[0, ::3] = 0.25  # ties at the k-th score
    s[2, : CAP // 2] = torch.where(torch.arange(CAP // 2) % 2 == 0, 0.0, -0.0)
    raw = s.view(torch.int32).clone()
    raw[:, 5::7] = -1  # RAW_NONE holes, in every chunk
    idx = torch.stack([torch.randperm(4 * CAP, generator=g)[:CAP] for _ in range(R)]).to(torch.int32)
    keys = torch.where(raw == -1, I32_MIN, _keys(s))
    kth = torch.tensor([int(_keys(torch.tensor([0.25]))[0]), I32_MIN, 0, int(_keys(torch.tensor([0.1]))[0])],
                       dtype=torch.int32)
    n_eq = torch.tensor([3, 0, 5, 2], dtype=torch.int32)
    tied0 = idx[0][keys[0] == kth[0]].sort().values
    x_tie = torch.tensor([int(tied0[n_eq[0] - 1]), 2**31 - 1, 2**31 - 1, 2**31 - 1], dtype=torch.int32)
    m_rows = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
    return raw, idx, keys, kth, n_eq, x_tie, m_rows


def _model(raw, idx, keys, kth, n_eq, x_tie, m_rows):
    """Per row: the kept slots' (raw bits, index) in slot order."""
    out = []
    for r in range(R):
        real = keys[r] != I32_MIN
        eq = real & (keys[r] == kth[r]) & (n_eq[r] > 0) & (idx[r] <= x_tie[r])
        keep = real & ((keys[r] > kth[r]) | eq)
        out.append((raw[r][keep], idx[r][keep]))
    return out


def _run(device, final, write_scores, CAP, CHUNK):
    raw, idx, keys, kth, n_eq, x_tie, m_rows = _case(CAP)
    pad = torch.full((CHUNK,), 123, dtype=torch.int32)  # the prefetch's over-read past the last row
    k_buf = torch.cat([raw.flatten(), pad]).to(device)
    i_buf = torch.cat([idx.flatten(), pad]).to(device)
    o_key = torch.full((R, CAP), -7, dtype=torch.int32, device=device)
    o_idx = torch.full((R, CAP), -7, dtype=torch.int32, device=device)
    base = torch.full((R,), -7, dtype=torch.int32, device=device)
    _rewrite_probe[(1,)](k_buf, i_buf, o_key, o_idx, m_rows.to(device), kth.to(device), n_eq.to(device),
                         x_tie.to(device), base, R=R, CAP=CAP, CHUNK=CHUNK, FINAL=final, WRITE_SCORES=write_scores,
                         HW=device == "cuda")
    k_buf, i_buf = k_buf[: R * CAP].view(R, CAP).cpu(), i_buf[: R * CAP].view(R, CAP).cpu()
    o_key, o_idx, base = o_key.cpu(), o_idx.cpu(), base.cpu()
    for r, (want_raw, want_idx) in enumerate(_model(raw, idx, keys, kth, n_eq, x_tie, m_rows)):
        n = want_idx.numel()
        assert int(base[r]) == n, f"row {r}: kept {int(base[r])}, want {n}"
        if not m_rows[r]:  # nothing written
            assert (o_idx[r] == -7).all() and (o_key[r] == -7).all() and torch.equal(k_buf[r], raw[r]), f"row {r}"
            continue
        if final:
            assert torch.equal(o_idx[r, :n], want_idx), f"row {r}: indices"
            assert (o_idx[r, n:] == -7).all(), f"row {r}: written past the kept entries"
            if write_scores:
                folded = torch.where(want_raw == torch.tensor([-0.0]).view(torch.int32), 0, want_raw)
                assert torch.equal(o_key[r, :n], folded), f"row {r}: scores (-0.0 folded onto +0.0)"
            else:
                assert (o_key[r] == -7).all(), f"row {r}: scores written without WRITE_SCORES"
            assert torch.equal(k_buf[r], raw[r]) and torch.equal(i_buf[r], idx[r]), f"row {r}: buffer changed"
        else:
            assert torch.equal(k_buf[r, :n], want_raw), f"row {r}: kept keys in slot order"
            assert torch.equal(i_buf[r, :n], want_idx), f"row {r}: kept indices in slot order"


@interp
@pytest.mark.parametrize("cap,chunk", GEOMETRIES)
@pytest.mark.parametrize("final,write_scores", [(False, False), (True, False), (True, True)])
def test_rewrite_matches_model(final, write_scores, cap, chunk):
    _run("cpu", final, write_scores, cap, chunk)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cap,chunk", GEOMETRIES + [(4096, 512)])
@pytest.mark.parametrize("final,write_scores", [(False, False), (True, False), (True, True)])
def test_gpu_rewrite_matches_model(final, write_scores, cap, chunk):
    """The compiled rewrite (int32 masks, inline-PTX stores, the next chunk loaded ahead; 4096 / 512: the default
    launch's final select at H_I 32 / 64, four runs of 128 slots per chunk)."""
    _run("cuda", final, write_scores, cap, chunk)


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)
