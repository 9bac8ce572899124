"""HyTopK's 2-bit radix select (Config.search_bits=2, `_kth_key2`: it stops rows early) against the
reference and the 1-bit full search (search_bits=1, `_kth_key`).

The 2-bit select stops a row once its prefix bucket's lower bound L has exactly k keys at or above it;
the row then keeps {keys >= L}. It also takes the count above the k-th key from its own passes and skips
the tie-ranking scan when no row has more keys equal to its k-th than fit. Cases: random scores (rows stop
early at different bits), near-ties at every low-bit pattern and exact ties straddling the boundary
(rows must run all 32 bits and rank their ties: lowest index wins), ReLU zeros, negative scores,
compactions (small buffers), rows with fewer than k visible keys, a fully masked row, the warm start.
"""

from __future__ import annotations

import pytest
import torch

from hyscale_kernels.hytopk import hytopk, interpreter_active
from hyscale_kernels.hytopk.op import Config
from hyscale_kernels.hytopk.reference import causal_bounds, hytopk_reference
from interp_rerun import compile_sm90_in_subprocess, rerun_under_interpreter
from test_hytopk import _zero_ties, assert_same_selection
from test_hytopk_search2 import _near_tie_inputs

INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")


def _cfg(H, search_bits, warm=0, append="mask", rows=2):
    return Config(block_n=16, rows_x_heads=rows * H, num_warps=1, num_stages=1, programs_per_sm=1,
                  min_free_tiles=1, sel_chunk=64, search_bits=search_bits, warm_start=warm, append=append,
                  lane_rows=rows % 4 == 0)


def _both(q, w, k, st, en, topk, relu, H, warm=0, append="mask", rows=2):
    """(2-bit, 1-bit) results: indices and scores."""
    return [hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True,
                   config=_cfg(H, b, warm, append, rows)) for b in (2, 1)]


def masked_rows_case(seed, T=21, S=300, H=4):
    """Random inputs (signed weights), causal bounds with a fully masked row (4) and a row with 7 visible keys (6)."""
    g = torch.Generator().manual_seed(seed)
    q, w, k = torch.randn(T, H, 32, generator=g), torch.randn(T, H, generator=g), torch.randn(S, 32, generator=g)
    st, en = causal_bounds(T, S, offset=S - T)
    st, en = st.clone(), en.clone()
    st[4], en[4] = 9, 9  # fully masked
    st[6], en[6] = 100, 107  # fewer than k visible keys
    return q, w, k, st, en


@interp
@pytest.mark.parametrize("warm", [0, 64], ids=["cold", "warm"])
@pytest.mark.parametrize("relu,rows", [(False, 2), (True, 2), (True, 4)], ids=["id-2rows", "relu-2rows", "relu-4rows"])
def test_search2_random_and_masked_rows(relu, rows, warm):
    """rows = 4: four rows per program with the default lane_rows column order, as compiled launches have."""
    H, topk = 4, 12
    q, w, k, st, en = masked_rows_case(3 + warm)
    (ei, ev), (fi, fv) = _both(q, w, k, st, en, topk, relu, H, warm, rows=rows)
    assert_same_selection(q, w, k, st, en, topk, relu, ei, ev)
    assert torch.equal(ei, fi) and torch.equal(ev, fv), "2-bit select differs from the 1-bit search"
    assert torch.equal(ei[4], torch.full((topk,), -1, dtype=ei.dtype))
    assert (ei[6] >= 0).sum() == 7


@interp
@pytest.mark.parametrize("spread", [2, 4, 8, 64])
def test_search2_near_and_exact_ties(spread):
    """Scores drawn from `spread` consecutive floats: with 2 or 4 values most of a row ties with its k-th key
    (rows run all bits and rank their ties), with 64 rows stop early; the lowest indices win the ties."""
    T, S, H, topk = 12, 160, 4, 9
    q, w, k = _near_tie_inputs(T, S, H=H, spread=spread, seed=spread)
    st = torch.zeros(T, dtype=torch.int32)
    en = torch.full((T,), S, dtype=torch.int32)
    en[5] = 37
    st[7], en[7] = 20, 150
    ref = hytopk_reference(q, w, k, st, en, topk, relu=False)
    (ei, ev), (fi, fv) = _both(q, w, k, st, en, topk, False, H)
    for t in range(T):
        assert sorted(ei[t].tolist()) == sorted(ref[t].tolist()), f"row {t}: 2-bit select set differs"
    assert torch.equal(ei, fi) and torch.equal(ev, fv)


@interp
@pytest.mark.parametrize("append", ["mask", "tile"])
def test_search2_relu_zero_ties_with_compactions(append):
    """ReLU zeros tie at the boundary for every other row, and T x S is large enough for several
    compactions per row (buffer of 64 slots for k = 12)."""
    T, S, H, topk = 16, 400, 2, 12
    g = torch.Generator().manual_seed(5)
    q, w, k = torch.randn(T, H, 32, generator=g), torch.randn(T, H, generator=g).abs(), torch.randn(S, 32, generator=g)
    q, w, k = _zero_ties(q, w, k, every=7)
    st = torch.zeros(T, dtype=torch.int32)
    en = torch.full((T,), S, dtype=torch.int32)
    (ei, ev), (fi, fv) = _both(q, w, k, st, en, topk, True, H, append=append)
    assert_same_selection(q, w, k, st, en, topk, True, ei, ev)
    assert torch.equal(ei, fi) and torch.equal(ev, fv)


_COMPILE = r"""
import os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hyscale_kernels.hytopk import _kernel, op
from hyscale_kernels.hytopk.op import Config
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
fn = _kernel.hytopk_kernel
names = list(fn.arg_names)
sig = dict(q_ptr="*bf16", w_ptr="*bf16", k_ptr="*bf16", starts_ptr="*i32", ends_ptr="*i32", out_idx_ptr="*i32",
           out_val_ptr="*fp32", buf_key_ptr="*i32", buf_idx_ptr="*i32", stats_ptr="*i32", prof_ptr="*i64", T="i32", S="i32",
           kk="i32", n_blocks="i32", n_p="i32")
attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
H, D, kk = 64, 128, 2048
for bits in (1, 2):
    cfg = Config(search_bits=bits, append="mask")
    const = op.kernel_constexprs(cfg, H, D, kk, select=True, relu=True, write_scores=True, ieee=False,
                                 interp=False)
    k = triton.compile(ASTSource(fn, dict(sig, **{c: "constexpr" for c in const}), const, attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg.num_warps,
                                                                      num_stages=cfg.num_stages))
    d = tempfile.mkdtemp()
    open(os.path.join(d, "k.ptx"), "w").write(k.asm["ptx"])
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.cubin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    stack = int(re.search(r"(\d+) bytes stack frame", r.stderr).group(1))
    print(f"bits={bits} stack={stack}")
"""


@pytest.mark.slow
def test_search2_compiles_for_sm90():
    """The compiled path (a while loop over the passes, the buffer held in registers) is not what the
    interpreter runs: it must build for sm_90a (default launch, H 64, k 2048), its stack frame within
    64 B of the 1-bit search's (the key loop shares those registers; session 10: 376 vs 320 B, the
    replaced full 2-bit search 392) or at most the 384 B it has had since session 16 (session 17's
    cheaper warm-sample positions took the 1-bit kernel's frame to 304 B, the 2-bit one's stayed)."""
    out = compile_sm90_in_subprocess(_COMPILE)
    stack = {m[0]: int(m[1]) for m in __import__("re").findall(r"bits=(\d) stack=(\d+)", out)}
    assert set(stack) == {"1", "2"}, out
    assert stack["2"] <= max(stack["1"] + 64, 384), stack


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,S,H,topk,relu", [(12288, 12288, 64, 2048, True), (9000, 9000, 32, 2048, False),
                                             (4096, 4096, 64, 512, True)])
def test_gpu_search2_bit_identical(T, S, H, topk, relu):
    """Real shapes in bf16 (compactions and the warm start included): the same indices and scores as the
    1-bit full search, deterministic, and the reference's sets on sampled rows."""
    from dataclasses import replace

    from hyscale_kernels.hytopk.op import default_config
    from test_hytopk import _inputs

    q, w, k = _inputs(T, S, H, D=128, seed=T, dtype=torch.bfloat16, device="cuda", w_sign=not relu)
    st, en = causal_bounds(T, S, offset=S - T, device="cuda")
    # 1-bit vs 2-bit radix, "mask" append (whole-block selects: split selects need "warps")
    cfg = replace(default_config(H, topk), append="mask", select_split=1, kth_search="radix")
    assert cfg.search_bits == 2
    one = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=replace(cfg, search_bits=1))
    two = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=cfg)
    assert torch.equal(two[0], one[0]) and torch.equal(two[1], one[1])
    again = hytopk(q, w, k, st, en, topk, relu=relu, config=cfg)
    assert torch.equal(again, two[0])
    rows = torch.cat([torch.arange(0, T, max(1, T // 40)), torch.arange(T - 4, T)]).cuda()
    assert_same_selection(q[rows].float(), w[rows].float(), k.float(), st[rows], en[rows], topk, relu,
                          two[0][rows], two[1][rows], tol=1e-5)


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)
