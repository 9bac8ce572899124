"""HyTopK's API: bad input and bad launch shapes get a clear error, the kernel-or-reference choice, the launch shape
chosen per head count, and the ballot slots' layout check. No kernel runs here except one sm_90a compile."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from _hytopk_helpers import HAS_CUDA, inputs
from _interp import compile_sm90_in_subprocess

from hyscale_kernels import _common
from hyscale_kernels.hytopk import MAX_TOPK, Config, _kernel, hytopk, hytopk_reference, op
from hyscale_kernels.hytopk.op import check_config, default_config, geometry, kernel_constexprs
from hyscale_kernels.hytopk.reference import causal_bounds


def test_bad_inputs():
    T, S, H, D = 6, 8, 2, 32
    q, w, k = inputs(T, S, H, D=D)
    st, en = causal_bounds(T, S)
    cases = [
        (TypeError, "q must be a torch.Tensor", (q.numpy(), w, k, st, en, 4)),
        (ValueError, "q must be 3-D", (q[0], w, k, st, en, 4)),
        (ValueError, "w must have shape", (q, w[:, :1], k, st, en, 4)),
        (ValueError, "k must have shape", (q, w, k[:, :16], st, en, 4)),
        (TypeError, "k must have the dtype of q", (q, w, k.half(), st, en, 4)),
        (TypeError, "starts must have dtype", (q, w, k, st.long(), en, 4)),
        (TypeError, "q must have dtype", (q.to(torch.int32), w, k, st, en, 4)),
        (ValueError, "ends must have shape", (q, w, k, st, en[:-1], 4)),
        (ValueError, "topk must be in", (q, w, k, st, en, 0)),
        (ValueError, "topk must be in", (q, w, k, st, en, MAX_TOPK + 1)),
        (TypeError, "topk must be an int", (q, w, k, st, en, 4.0)),
        (ValueError, "ends must be <= S", (q, w, k, st, en + S, 4)),
        (ValueError, "starts must be >= 0", (q, w, k, st - 1, en, 4)),
        (ValueError, "starts must be <= ends", (q, w, k, en, st, 4)),
        (ValueError, "contiguous", (q.transpose(0, 1).contiguous().transpose(0, 1), w, k, st, en, 4)),
        (ValueError, "power of two", (q[:, :1].expand(T, 3, D).contiguous(), w[:, :1].expand(T, 3).contiguous(), k,
                                      st, en, 4)),
        (ValueError, "multiple of 16", (q[:, :, :24].contiguous(), w, k[:, :24].contiguous(), st, en, 4)),
    ]
    for exc, msg, args in cases:
        with pytest.raises(exc, match=msg):
            hytopk(*args)
    with pytest.raises(ValueError, match="impl must be"):
        hytopk(q, w, k, st, en, 4, impl="cuda")
    if HAS_CUDA:
        with pytest.raises(ValueError, match="expected"):
            hytopk(q, w, k.cuda(), st, en, 4)


def test_sizes_at_the_int32_limits():
    """1M tokens x top-2048 (2**31 output slots) is valid: output offsets are int64 in the kernel. T * H_I or S at
    2**31, or S x D_I at 2**31 (the key loop's int32 offsets: 16M keys at D_I 128) is refused. Meta tensors."""

    def case(T, H, S):
        m = dict(device="meta")
        return (torch.empty(T, H, 128, dtype=torch.bfloat16, **m), torch.empty(T, H, dtype=torch.bfloat16, **m),
                torch.empty(S, 128, dtype=torch.bfloat16, **m), torch.empty(T, dtype=torch.int32, **m),
                torch.empty(T, dtype=torch.int32, **m))

    op._validate(*case(1 << 20, 64, 1 << 20), 2048, check_bounds=False)
    op._validate(*case(16, 64, (1 << 24) - 1), 2048, check_bounds=False)
    with pytest.raises(ValueError, match="must be < 2\\*\\*31"):
        op._validate(*case(1 << 25, 64, 16), 2048, check_bounds=False)
    with pytest.raises(ValueError, match="S x D_I = 16777216 x 128 elements: must be < 2\\*\\*31"):
        op._validate(*case(16, 64, 1 << 24), 2048, check_bounds=False)


def test_reference_path_and_log(caplog, monkeypatch):
    """impl='reference' is the spec (topk > S: -1 padded); 'auto' on CPU tensors without the interpreter runs the
    reference with one log line; 'triton' there is a clear error."""
    T, S, H = 10, 12, 2
    q, w, k = inputs(T, S, H)
    st, en = causal_bounds(T, S)
    idx = hytopk(q, w, k, st, en, 20, impl="reference")
    assert idx.shape == (T, 20) and (idx[:, S:] == -1).all()
    monkeypatch.setattr(_common, "interpreter_on", lambda: False)
    monkeypatch.setattr(_common, "_logged", set())
    with caplog.at_level(logging.INFO, logger="hyscale_kernels"):
        a = hytopk(q, w, k, st, en, 5)
        hytopk(q, w, k, st, en, 5)
    assert len([r for r in caplog.records if "reference" in r.getMessage()]) == 1
    assert torch.equal(a, hytopk_reference(q, w, k, st, en, 5))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        hytopk(q, w, k, st, en, 5, impl="triton")


@pytest.mark.parametrize("field,value,msg", [
    ("block_n", 48, "block_n must be 16, 32, 64 or 128"), ("block_n", 256, "block_n must be"),
    ("rows", 3, "rows must be a power of two"), ("min_free_tiles", 0, "min_free_tiles must be >= 1"),
    ("sel_chunk", 100, "sel_chunk must be a power of two"), ("warm_start", -1, "warm_start must be >= 0"),
    ("kth_search", "bisect", "kth_search must be one of"), ("slots", "vote", "slots must be one of"),
    ("select_split", 3, "select_split must be 1 or 2"),
])
def test_bad_config_names_the_field(field, value, msg):
    check_config(Config())
    with pytest.raises(ValueError, match=msg):
        check_config(replace(Config(), **{field: value}))


def test_launch_shape_per_head_count(monkeypatch):
    """Rows per tile, split selects and slots by H (topk 2048), the k-th search by topk, the interpreter's shape;
    lane rows where 4 | rows and H is even; ballot slots only where they apply."""
    monkeypatch.setattr(op, "_ballot_default", True)
    got = {H: (c.rows, c.select_split, c.slots) for H in (1, 2, 4, 8, 16, 32, 64, 128)
           for c in [default_config(H, 2048)]}
    assert got == {1: (32, 1, "sum"), 2: (16, 1, "sum"), 4: (8, 1, "sum"), 8: (4, 1, "ballot"),
                   16: (8, 2, "ballot"), 32: (8, 2, "ballot"), 64: (4, 1, "ballot"), 128: (2, 1, "sum")}
    assert default_config(64, 2048) == Config()
    assert default_config(64, 1024).kth_search == "interp" and default_config(4, 512).kth_search == "radix"
    assert default_config(64, 2048, interpret=True) == Config(block_n=16, rows=2, min_free_tiles=1, sel_chunk=64,
                                                              kth_search="radix", slots="sum")
    assert [op.lane_rows(R, H) for R, H in ((4, 64), (8, 4), (2, 128), (32, 1), (4, 3))] == [1, 1, 0, 0, 0]
    for cfg, H, want in ((Config(), 64, True), (Config(rows=8), 32, True), (Config(rows=16), 4, False),
                         (Config(rows=2), 128, False), (Config(block_n=32), 64, False), (Config(rows=4), 1, False)):
        assert kernel_constexprs(cfg, H, 128, 2048, True, False)["BALLOT"] == want, (cfg, H)


def test_geometry():
    """CAP holds 2 topk and topk plus two margins (a power of two); the select chunk is sel_chunk / rows; the warm
    sample is rounded up to a power of two, at most CAP."""
    g = geometry(128, 2048, Config())
    assert (g.cap, g.chunk, g.min_free, g.warm, g.d_p2) == (4096, 512, 256, 1024, 128)
    assert geometry(128, 512, Config(rows=8)).cap == 1024 and geometry(128, 512, Config(rows=8)).chunk == 256
    assert geometry(80, 8, default_config(2, 8, interpret=True)) == (2, 64, 32, 16, 64, 128)
    assert geometry(32, 8, Config(warm_start=40)).warm == 64 and geometry(32, 8, Config(warm_start=0)).warm == 0


class _Kern:
    def __init__(self, ttgir):
        self.asm = {"ttgir": ttgir}


def _ttgir(layout, rows=4):
    t = f"tensor<4x16x{rows}xi32, #linear3>"
    return (f"#linear3 = #ttg.linear<{{{layout}, block = []}}>\n"
            "  %a:2 = tt.elementwise_inline_asm \"{ vote.sync.ballot.b32 b0, p0, 0xffffffff; }\" "
            f"{{constraints = \"=r,=r,=r,=r,r,r\", packed_element = 2 : i32, pure = true}} %m : {t} -> {t}, {t}\n")


def test_ballot_layout_check(monkeypatch, caplog):
    """The modelled layouts pass; a permuted lane basis, a layout of the other row count, or no ballot op raise
    with the fix. After a mismatch an explicit Config raises; the default logs a warning, returns False (the caller
    re-runs with mask-sum slots) and default_config stays on mask sums for the process."""
    layout4, layout8 = _kernel.BALLOT_LAYOUTS[4], _kernel.BALLOT_LAYOUTS[8]
    op._check_ballot_layout(_ttgir(layout4))
    op._check_ballot_layout(_ttgir(layout8, rows=8))
    swapped = layout4.replace("lane = [[0, 0, 1], [0, 0, 2]", "lane = [[0, 0, 2], [0, 0, 1]")
    for bad in (_ttgir(swapped), _ttgir(layout4, rows=8), _ttgir(layout8, rows=4)):
        with pytest.raises(RuntimeError, match="slots='sum'"):
            op._check_ballot_layout(bad)
    with pytest.raises(RuntimeError, match="no ballot op"):
        op._check_ballot_layout("#linear = #ttg.linear<{register = [], block = []}>\n")
    monkeypatch.setattr(op, "_ballot_default", True)
    assert op._ballot_guard(_Kern(_ttgir(layout4)), explicit=True)
    with pytest.raises(RuntimeError, match="assumes the candidate tile layout"):
        op._ballot_guard(_Kern(_ttgir(swapped)), explicit=True)
    assert op._ballot_default, "an explicit config's failure must not change the default"
    with caplog.at_level("WARNING", logger="hyscale_kernels"):
        assert op._ballot_guard(_Kern(_ttgir(swapped)), explicit=False) is False
    assert "uses slots='sum' from now on" in caplog.text
    assert default_config(64, 2048).slots == "sum"


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hyscale_kernels.hytopk import _kernel, op
cfg = op.default_config(32, 2048)
const = op.kernel_constexprs(cfg, 32, 128, 2048, True, False)
sig = dict(q_ptr="*bf16", w_ptr="*bf16", k_ptr="*bf16", starts_ptr="*i32", ends_ptr="*i32", out_idx_ptr="*i32",
           out_val_ptr="*fp32", buf_key_ptr="*i32", buf_idx_ptr="*i32", stats_ptr="*i32", T="i32", S="i32", kk="i32",
           n_blocks="i32", n_p="i32")
names = list(_kernel.hytopk_kernel.arg_names)
attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
k = triton.compile(ASTSource(_kernel.hytopk_kernel, dict(sig, **{c: "constexpr" for c in const}), const, attrs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=op.NUM_WARPS, num_stages=op.NUM_STAGES))
op._check_ballot_layout(k.asm["ttgir"])
print("ok", const["BALLOT"], const["SPLIT"], const["KTH_INTERP"], k.metadata.shared)
"""


@pytest.mark.slow
def test_default_launch_compiles_for_sm90():
    """H 32's default launch (8 lane rows, ballot slots, split selects, the interpolation search; the interpreter
    runs none of their compiled code) builds for sm_90a with this Triton, and its candidate tile has the layout the
    ballot slots model."""
    out = compile_sm90_in_subprocess(_COMPILE)
    assert "ok True 2 True" in out, out
