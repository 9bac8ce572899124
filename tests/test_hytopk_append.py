"""HyTopK's two ascending-order candidate appends against each other and the PyTorch reference: "mask"
(per-row candidate bit mask + popc; the default until session 15) and "tile" (a prefix sum over each key tile's
keys). The default "warps" append (rows in buffer order) is tested in tests/test_hytopk_warps.py.

CPU: the Triton kernel runs in the interpreter at tiny fp32 shapes (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no CUDA); re-run in a subprocess if this process imported the
kernel without it. Every case asserts (1) indices and returned scores of "mask" bit-identical to
"tile"'s, (2) index sets equal to the reference's (exact: fp32, no near ties at these seeds), and
(3) that each path really ran (a spy on the kernel's _key_mask counts calls).

Geometry with the interpreter configs: block_n = 16, so S = 45 is 3 tiles; topk = 5..10 gives
CAP = 64 slots per row, so rows with more than ~48 visible keys compact inside the key loop.
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
from test_hytopk_warps import short_masked_case

INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")


@pytest.fixture
def variant(monkeypatch):
    """Calls of the kernel's _key_mask: the interpreter runs the jit functions as Python, looked up
    in the kernel module at call time, so a wrapper there sees every call."""
    calls = []
    inner = _kernel._key_mask

    def spy(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(_kernel, "_key_mask", spy)
    return calls


def _check(q, w, k, st, en, topk, relu, cfg, variant):
    """append="mask" equals append="tile" (cfg otherwise) bit for bit and the reference as sets."""
    calls = variant
    calls.clear()
    base_i, base_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=op.replace(cfg, append="tile"))
    assert not calls, "append='tile' must not take the mask path"
    var_i, var_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=op.replace(cfg, append="mask"))
    assert calls, "the 'mask' path did not run"
    assert torch.equal(var_i, base_i), "indices differ between the appends"
    assert torch.equal(var_v, base_v), "returned scores differ between the appends"
    _assert_reference_sets(var_i, q, w, k, st, en, topk, relu)
    return var_i


def _interp_cfg(H, topk, **kw):
    return op.replace(default_config(H, topk, interpret=True), **kw)


@interp
@pytest.mark.parametrize("T,S,H,topk,relu,warm", [(11, 45, 4, 8, True, 0), (11, 50, 2, 5, False, 0),
                                                  (7, 150, 2, 8, True, 64)])
def test_causal_ragged(T, S, H, topk, relu, warm, variant):
    """T, S not multiples of the tile (odd tile counts), CP-style offset, compactions; identity
    activation with negative weights; warm start on (S = 150 > CAP) and off."""
    q, w, k = _inputs(T, S, H, seed=T)
    if not relu:
        w = -w.abs()
    st, en = causal_bounds(T, S, offset=S - T)
    _check(q, w, k, st, en, topk, relu, _interp_cfg(H, topk, warm_start=warm), variant)
    if warm:
        assert op.warm_stats()["warm_rows"] == T


@interp
def test_short_and_masked_rows(variant):
    """Rows with fewer visible keys than topk (-1 padding), fully masked rows, topk > S."""
    *case, topk = short_masked_case()
    idx = _check(*case, topk, True, _interp_cfg(2, topk), variant)
    assert (idx[4] == -1).all() and (idx[7] == -1).all()


@interp
def test_ties_exact_zeros(variant):
    """ReLU zeros: most keys score exactly 0 and the top-k boundary falls among them (lowest index
    wins); the warm start's sampled threshold sits on the zeros too (warm start off: test_causal_ragged)."""
    T, S, H, D, topk = 6, 130, 2, 16, 8
    q, w, k = _zero_ties(*_inputs(T, S, H, D=D, seed=5, w_sign=False), every=29)
    st, en = causal_bounds(T, S, offset=S - T)
    _check(q, w, k, st, en, topk, True, _interp_cfg(H, topk, warm_start=64), variant)


@interp
def test_packed_segments_warm_start(variant):
    """Packed segments (row blocks straddle segments), short and fully masked rows, warm start on."""
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
    _check(q, w, k, st, en, 8, True, _interp_cfg(2, 8, warm_start=64), variant)


@interp
def test_warm_start_fallback(variant):
    """Adversarial sample: every row's sampled threshold is too high, the row block re-runs its key
    loop from -inf (the variant's path runs in both passes)."""
    T, S, H, topk, warm = 2, 256, 2, 12, 64
    g = torch.Generator().manual_seed(7)
    q = torch.rand(T, H, 16, generator=g) + 0.1
    w = torch.rand(T, H, generator=g) + 0.1
    k = torch.randn(S, 16, generator=g)
    for i, p in enumerate(op.warm_sample_positions(0, S, warm)):
        k[p] = 100.0 * (torch.rand(16, generator=g) + 0.1) if i % 5 == 0 and i // 5 < 11 else 0.0
    st = torch.zeros(T, dtype=torch.int32)
    en = torch.full((T,), S, dtype=torch.int32)
    _check(q, w, k, st, en, topk, True, _interp_cfg(H, topk, warm_start=warm), variant)
    assert op.warm_stats()["fallback_rows"] == T


@interp
def test_other_launch_shape(variant):
    """block_n = 32, 4 rows per program, min_free_tiles = 1, 1-bit radix passes."""
    T, S, H, topk = 11, 70, 4, 8
    q, w, k = _inputs(T, S, H, seed=13)
    w[3] = -w[3].abs()
    st, en = causal_bounds(T, S, offset=S - T)
    cfg = Config(block_n=32, rows_x_heads=16, num_warps=1, num_stages=1, programs_per_sm=1,
                 min_free_tiles=1, sel_chunk=64, search_bits=1, warm_start=0, append="mask")
    _check(q, w, k, st, en, topk, False, cfg, variant)


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)


def test_config_append_checked():
    """Config.append: "warps" (the default since session 15; tests/test_hytopk_warps.py), "mask" (block_n <= 64:
    one int64 mask per tile) or "tile"; anything else is refused naming the field, mask with larger tiles says to
    use "tile"."""
    assert Config().append == "warps" and Config().search_bits == 2 and op.APPENDS == ("tile", "mask", "warps")
    for value in op.APPENDS:
        op.check_config(Config(append=value), interpret=False)
    for bad in ("pair", "", 2, None):
        with pytest.raises(ValueError, match="Config.append must be one of"):
            op.check_config(Config(append=bad), interpret=True)
    with pytest.raises(ValueError, match="append='mask' needs block_n <= 64.*use append='tile'"):
        op.check_config(Config(append="mask", block_n=128), interpret=True)
    op.check_config(Config(append="tile", block_n=128), interpret=True)


# ---------------------------------------------------------------------------------------------
# GPU: the compiled paths the interpreter cannot run (hardware POPC for "mask"), bit for bit
# against "tile" at real shapes in bf16
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,S,H,topk,relu,ratio", [
    (12288, 12288, 64, 2048, True, 1),
    (6000, 7000, 32, 2048, False, 1),
    (8192, 2048, 4, 512, True, 4),
])
def test_gpu_append_variant_bit_identical(T, S, H, topk, relu, ratio):
    g = torch.Generator(device="cuda").manual_seed(T + H)
    q = torch.randn(T, H, 128, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(S, 128, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(T, H, generator=g, device="cuda")
    w = w.abs() if relu else w
    if ratio == 1:
        st, en = causal_bounds(T, S, offset=S - T, device="cuda")
    else:
        t = torch.arange(T, device="cuda")
        st, en = torch.zeros_like(t, dtype=torch.int32), ((t + 1) // ratio).to(torch.int32)
    ref_i, ref_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=Config(append="tile"))
    for _ in range(2):  # deterministic too
        idx, val = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True,
                          config=op.replace(default_config(H, topk), append="mask", select_split=1))
        assert torch.equal(idx, ref_i), f"{int((idx != ref_i).any(1).sum())} rows differ"
        if H > 4:  # H = 4: the head sum compiles to another order (1 ulp, measured on the H200): same sets
            assert torch.equal(val, ref_v)
