"""HyTopK with the sampled warm-start threshold (Config.warm_start) against the PyTorch reference.

CPU: the Triton kernel runs in the interpreter at tiny fp32 shapes (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no CUDA); re-run in a subprocess if this process imported the
kernel without it. Every case also checks that the warm start really ran (op.warm_stats()) and,
where cheap, that the output equals the warm_start=0 output bit for bit (same sets, and both
paths write the kept keys in ascending index order).

Geometry at topk = 8..12 with these configs: CAP = 64 slots per row, so the warm start (WARM =
min(pow2(warm_start), CAP) sample keys) is used for rows with more than 64 visible keys.
"""

from __future__ import annotations

import pytest
import torch

from hyscale_kernels.hytopk import hytopk, interpreter_active
from hyscale_kernels.hytopk import op
from hyscale_kernels.hytopk.op import Config
from hyscale_kernels.hytopk.reference import causal_bounds, hytopk_reference, packed_causal_bounds
from interp_rerun import rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")


def _cfg(H, warm=64, search_bits=1, rows=2):
    """Interpreter launch shape (R = rows query rows per program) with the warm start on."""
    return Config(block_n=16, rows_x_heads=rows * H, num_warps=1, num_stages=1, programs_per_sm=1,
                  min_free_tiles=1, sel_chunk=64, search_bits=search_bits, warm_start=warm,
                  append="mask")  # the "warps" append's warm start: tests/test_hytopk_warps.py


def _inputs(T, S, H, D=16, seed=0, w_sign=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(S, D, generator=g)
    w = torch.randn(T, H, generator=g)
    return q, (w if w_sign else w.abs()), k


def _assert_reference_sets(idx, q, w, k, st, en, topk, relu):
    """idx [T, topk] holds the reference's index set per row (exact: fp32, no near ties at these seeds),
    min(visible, topk) keys and -1 padding after them."""
    ri = hytopk_reference(q, w, k, st, en, topk, relu=relu)
    n_vis = (en.long() - st.long()).clamp(min=0, max=topk)
    assert torch.equal((idx >= 0).sum(1), n_vis), "number of selected keys per row"
    for t in range(idx.shape[0]):
        assert (idx[t, n_vis[t]:] == -1).all(), f"row {t}: padding"
        assert set(idx[t].tolist()) == set(ri[t].tolist()), f"row {t}: index set differs from the reference"


def _check(q, w, k, st, en, topk, relu, cfg, compare_off=True, repeat=False, return_idx=False):
    """Run with cfg: same sets as the reference (exact: fp32, no near ties at these seeds), counts
    and -1 padding right; optionally a second identical run and identity with the warm_start=0
    output (interpreter time is the limit here).
    Returns warm_stats() of the first run (and the indices with ``return_idx``)."""
    idx, val = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=cfg)
    stats = op.warm_stats()
    _assert_reference_sets(idx, q, w, k, st, en, topk, relu)
    if repeat:
        assert torch.equal(idx, hytopk(q, w, k, st, en, topk, relu=relu, config=cfg)), "not deterministic"
        assert op.warm_stats() == stats
    if compare_off:
        off_i, off_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True,
                              config=op.replace(cfg, warm_start=0))
        assert torch.equal(idx, off_i)
        assert torch.equal(val, off_v)
    return (stats, idx) if return_idx else stats


# ---------------------------------------------------------------------------------------------
# interpreter (CPU) tests
# ---------------------------------------------------------------------------------------------
@interp
@pytest.mark.parametrize("relu,search_bits", [(True, 1), (False, 2)])
def test_causal_ragged(relu, search_bits):
    """Causal rows (CP-style offset), T and S not multiples of the tile (16) nor of R."""
    T, S, H, topk = 13, 150, 2, 8
    q, w, k = _inputs(T, S, H, seed=1)
    st, en = causal_bounds(T, S, offset=S - T)
    stats = _check(q, w, k, st, en, topk, relu, _cfg(H, search_bits=search_bits), compare_off=relu,
                   repeat=not relu)
    assert stats["warm_rows"] == T and stats["fallback_rows"] == 0, stats


@interp
def test_packed_segments_short_and_masked_rows():
    """Packed segments (row blocks straddle segments: each row only counts its visible samples),
    rows with fewer visible keys than topk, fully masked rows, a last block past T."""
    lens = [70, 3, 90, 6]
    st, en = packed_causal_bounds(lens)
    T = sum(lens)
    q, w, k = _inputs(T, T, 2, seed=2)
    st, en = st.clone(), en.clone()
    rows = torch.arange(T)
    keep = (rows >= 64) & (rows < 75) | (rows >= 154)  # long rows of each segment, the short ones
    st, en = st[keep].contiguous(), en[keep].contiguous()
    q, w = q[keep].contiguous(), w[keep].contiguous()
    st[3], en[3] = 40, 40  # fully masked
    st[8], en[8] = 0, 0
    stats = _check(q, w, k, st, en, 8, True, _cfg(2))
    n_vis = en - st
    assert 0 < stats["warm_rows"] <= int((n_vis > 64).sum()), stats
    assert stats["fallback_rows"] == 0, stats


@interp
def test_ties_exact_zeros():
    """ReLU zeros: most keys score exactly 0, and for half the rows the top-k boundary (and the
    sampled threshold) is among the zeros: index-ascending tie rule, no fallback needed (the
    threshold is one below the sampled key, so keys tied with it are appended)."""
    T, S, H, D, topk = 10, 130, 2, 16, 8
    q, w, k = _inputs(T, S, H, D=D, seed=5, w_sign=False)
    k = k.abs()
    q = -q.abs()  # every q.k < 0 -> ReLU gives exact zeros ...
    q[:, :, 0] = 0.0
    k[::29, 0] = 50.0  # ... except for every 29th key (5 of them) when the row's q[:, :, 0] > 0
    q[::2, :, 0] = 1.0
    st, en = causal_bounds(T, S, offset=S - T)
    stats = _check(q, w, k, st, en, topk, True, _cfg(H))
    assert stats["warm_rows"] == T and stats["fallback_rows"] == 0, stats


@interp
def test_negative_scores_identity():
    """Identity activation and negative weights: scores negative too; 2-bit radix passes."""
    T, S, H, topk = 9, 140, 4, 10
    q, w, k = _inputs(T, S, H, seed=9)
    w = -w.abs()
    st, en = causal_bounds(T, S, offset=S - T)
    stats = _check(q, w, k, st, en, topk, False, _cfg(H, search_bits=2), compare_off=False)
    assert stats["warm_rows"] == T and stats["fallback_rows"] == 0, stats


def _adversarial(T, S, H, warm, n_huge, mixed):
    """Keys at the sampled positions are either huge (n_huge of them) or score exactly 0, so the
    sample's quantile overestimates the row's: fewer than topk keys are >= it. With ``mixed``,
    even rows have q negated: every sample key scores 0 for them, so their threshold admits every
    key >= 0 (all of them) and they need no fallback: one row of each block re-runs, its
    neighbour keeps its buffer."""
    g = torch.Generator().manual_seed(7)
    q = torch.rand(T, H, 16, generator=g) + 0.1
    w = torch.rand(T, H, generator=g) + 0.1
    k = torch.randn(S, 16, generator=g)
    pos = op.warm_sample_positions(0, S, warm)
    assert len(set(pos)) == warm
    for i, p in enumerate(pos):
        huge = i % (warm // n_huge) == 0 and i // (warm // n_huge) < n_huge
        k[p] = 100.0 * (torch.rand(16, generator=g) + 0.1) if huge else 0.0
    if mixed:
        q[::2] = -q[::2]
    st = torch.zeros(T, dtype=torch.int32)
    en = torch.full((T,), S, dtype=torch.int32)
    return q, w, k, st, en


@interp
@pytest.mark.parametrize("mixed,search_bits", [(False, 1), (True, 2)])
def test_adversarial_sample_forces_fallback(mixed, search_bits):
    """The sample overestimates the row's top-k boundary: the row is re-run from -inf (counted in
    warm_stats), and the result is still exact (it needs keys the sample never saw)."""
    T, S, H, topk, warm = 6, 256, 2, 12, 64
    q, w, k, st, en = _adversarial(T, S, H, warm, n_huge=11, mixed=mixed)
    # row r: j = floor(mu + 4 sd) + 1 = 10 with mu = 64 * 12 / 256; 10 keys are >= the 10th largest
    # sample (the huge ones) < topk = 12. The answer: 11 huge sampled keys + 1 ordinary key.
    stats, idx = _check(q, w, k, st, en, topk, True, _cfg(H, warm=warm, search_bits=search_bits),
                        compare_off=mixed, repeat=not mixed, return_idx=True)
    assert stats["warm_rows"] == T, stats
    if mixed:
        assert stats["fallback_rows"] == T // 2 and stats["fallback_blocks"] == T // 2, stats
    else:
        assert stats["fallback_rows"] == T and stats["fallback_blocks"] == T // 2, stats
    pos = set(op.warm_sample_positions(0, S, warm))
    odd = idx[1::2]
    assert all(len(set(r.tolist()) - pos) == 1 for r in odd)  # one key outside the sample


@interp
def test_sample_size_rounding_and_small_rows_off():
    """warm_start is rounded to a power of two and capped at CAP; a row block whose rows all see
    <= CAP keys never samples (warm_rows 0); warm_start=0 leaves no stats behind."""
    assert op._warm_geometry(64, 32, Config(warm_start=40)) == (64, 32)
    assert op._warm_geometry(64, 32, Config(warm_start=4096)) == (64, 32)
    assert op._warm_geometry(4096, 512, Config(warm_start=1000)) == (1024, 512)
    assert op._warm_geometry(4096, 512, Config()) == (1024, 512)  # the default: 1024 samples (k 2048)
    assert op._warm_geometry(1024, 256, Config()) == (1024, 256)  # k 512: CAP = 1024 samples
    assert op._warm_geometry(4096, 512, Config(warm_start=0)) == (0, 1)
    T, S, H = 7, 60, 2
    q, w, k = _inputs(T, S, H, seed=4)
    st, en = causal_bounds(T, S, offset=S - T)
    stats = _check(q, w, k, st, en, 8, True, _cfg(H, warm=40), compare_off=False)
    assert stats == dict(warm_rows=0, fallback_rows=0, fallback_blocks=0), stats


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)


# ---------------------------------------------------------------------------------------------
# GPU: real shapes in bf16
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("warm", [512, 1024])
def test_gpu_warm_start_matches_default(warm):
    """Causal 8K, H 64, k 2048: the warm_start=0 output's sets (the default "warps" append returns rows in its
    buffer's order, which depends on the compaction history: compared sorted); the fallback is rare."""
    T = S = 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, 64, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(S, 128, device="cuda", generator=g).bfloat16()
    w = (torch.randn(T, 64, device="cuda", generator=g) * 0.01).bfloat16()
    st, en = causal_bounds(T, S, device="cuda")
    ref = hytopk(q, w, k, st, en, 2048, config=Config(warm_start=0))
    got = hytopk(q, w, k, st, en, 2048, config=Config(warm_start=warm))
    stats = op.warm_stats()
    assert torch.equal(got.sort(dim=1).values, ref.sort(dim=1).values)
    assert stats["warm_rows"] > 0 and stats["fallback_rows"] <= stats["warm_rows"] // 100, stats


def test_config_checks_name_the_field():
    """Out-of-range values are refused, naming the field (search_bits=2 is allowed again since its
    bit-1 bug was fixed: tests/test_hytopk_search2.py)."""
    op.check_config(Config(search_bits=2), interpret=True)
    op.check_config(Config(search_bits=2), interpret=False)
    op.check_config(Config(), interpret=False)
    with pytest.raises(ValueError, match="search_bits must be 1 or 2"):
        op.check_config(Config(search_bits=3), interpret=True)
    with pytest.raises(ValueError, match="warm_start must be >= 0"):
        op.check_config(Config(warm_start=-1), interpret=True)
    assert Config().warm_start == 1024  # the measured default (session 10)
