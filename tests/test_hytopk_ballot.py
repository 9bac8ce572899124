"""HyTopK's ballot slots, Config.group_mask="ballot" (append="warps"), against the mask sum ("sum").

"ballot" gives each candidate the slot that "sum" gives it (same region, same rank among the key group's candidates
of its row), so the buffer, and therefore the output, must be bit-identical, order included. Every case checks that,
the index sets against the reference, and that the ballot path really ran (a spy on _kernel._group_slots_ballot).

CPU: the interpreter runs the ballot's lane arithmetic on a model of the GPU layout (_kernel.BALLOT_LAYOUT: key j of
a 16-key group and row r in lane 4 (j % 8) + r, register j // 8), so the launch shape is the GPU's: block_n 64, 4 rows
per tile (rows_x_heads = 4 H). topk 8 with min_free_tiles 1 gives CAP 256, regions of ~62 slots: rows with more than
~190 visible keys compact inside the key loop. On the GPU the kernel's layout is checked against the model at the
first launch (op._check_ballot_layout), tested here on crafted TTGIR text.
"""

from __future__ import annotations

import pytest
import torch

from hyscale_kernels.hytopk import _kernel, hytopk, interpreter_active, op
from hyscale_kernels.hytopk.op import Config, default_config
from hyscale_kernels.hytopk.reference import causal_bounds
from interp_rerun import rerun_under_interpreter
from test_hytopk_warmstart import _assert_reference_sets, _inputs
from test_hytopk_warps import (_spy, gpu_causal_inputs, packed_rows_case, same_up_to_rounding, short_masked_case,
                               zero_ties_case)

INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")


def _cfg(H, **kw):
    """The GPU's launch shape at head count H (4 rows per tile), small buffers, for the interpreter."""
    return op.replace(Config(block_n=64, rows_x_heads=4 * H, num_warps=4, num_stages=1, programs_per_sm=1,
                             min_free_tiles=1, sel_chunk=64, warm_start=0, kth_search="interp"), **kw)


def _check(q, w, k, st, en, topk, relu, cfg, calls):
    """group_mask="ballot" equals "sum" exactly (indices in order, scores), deterministic, reference sets."""
    calls.clear()
    base_i, base_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True,
                            config=op.replace(cfg, group_mask="sum"))
    assert not calls, "group_mask='sum' must not take the ballot path"
    bal_i, bal_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True,
                          config=op.replace(cfg, group_mask="ballot"))
    assert calls, "the ballot path did not run"
    assert not torch.isnan(bal_v).any(), "unwritten output scores"
    assert torch.equal(bal_i, base_i), f"indices differ from the mask sum's in {int((bal_i != base_i).any(1).sum())} rows"
    assert torch.equal(bal_v, base_v), "returned scores differ from the mask sum's"
    _assert_reference_sets(bal_i, q, w, k, st, en, topk, relu)
    return bal_i


@pytest.fixture
def calls(monkeypatch):
    return _spy(monkeypatch, "_group_slots_ballot")


@interp
@pytest.mark.parametrize("T,S,H,relu,warm", [(9, 300, 2, True, 0), (7, 333, 2, False, 0), (6, 520, 2, True, 256)])
def test_causal_ragged(T, S, H, relu, warm, calls, monkeypatch):
    """T, S not multiples of the tile, CP-style offset, compactions in the key loop; identity activation with
    negative weights (negative scores); warm start on (S > CAP) and off."""
    comp = []
    inner = _kernel._select_store

    def spy(*args, **kwargs):
        if not args[7]:  # FINAL False: a compaction in the key loop
            comp.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(_kernel, "_select_store", spy)
    q, w, k = _inputs(T, S, H, seed=T)
    if not relu:
        w = -w.abs()
    st, en = causal_bounds(T, S, offset=S - T)
    _check(q, w, k, st, en, 8, relu, _cfg(H, warm_start=warm), calls)
    if not warm:
        assert comp, "no compaction in the key loop: the case does not fill a region"


@interp
def test_short_masked_rows_and_ties(calls):
    """Rows with fewer visible keys than topk (-1 padding), fully masked rows; then exact-zero ties at the k-th
    score (kept by key index)."""
    *case, topk = short_masked_case()
    idx = _check(*case, topk, True, _cfg(2), calls)
    assert (idx[4] == -1).all() and (idx[7] == -1).all()
    *case, topk = zero_ties_case(S=230)
    _check(*case, topk, True, _cfg(2), calls)


@interp
def test_packed_segments_warm_head(calls):
    """Packed segments (row blocks straddle segments), short and fully masked rows, head warm sample."""
    _check(*packed_rows_case(), 8, True, _cfg(2, warm_start=64, warm_sample="head"), calls)


@interp
@pytest.mark.parametrize("split", [1, 2])
def test_eight_rows(split, calls):
    """8 rows per tile (rows_x_heads = 8 H, the 4 ballots of the two-register layout): ragged causal with compactions,
    identity activation with negative weights, short / masked rows and zero ties, with and without split selects."""
    q, w, k = _inputs(11, 301, 2, seed=5)
    st, en = causal_bounds(11, 301, offset=290)
    _check(q, w, k, st, en, 8, True, _cfg(2, rows_x_heads=16, select_split=split), calls)
    _check(q, -w.abs(), k, st, en, 8, False, _cfg(2, rows_x_heads=16, select_split=split), calls)
    *case, topk = short_masked_case()
    _check(*case, topk, True, _cfg(2, rows_x_heads=16, select_split=split), calls)
    *case, topk = zero_ties_case(S=230)
    _check(*case, topk, True, _cfg(2, rows_x_heads=16, select_split=split, warm_start=64), calls)


def test_config_values():
    with pytest.raises(ValueError, match="group_mask must be one of"):
        op.check_config(Config(group_mask="vote"), False)
    op.check_config(Config(group_mask="ballot"), False)
    for bad in (dict(append="mask"), dict(block_n=32), dict(num_warps=8), dict(lane_rows=False)):
        cfg = Config(group_mask="ballot", **bad)
        op.check_config(cfg, False)  # valid: the ballot is ignored where it does not apply (as lane_rows is)
        assert not op.kernel_constexprs(cfg, 64, 128, 2048, select=True, relu=True, write_scores=False, ieee=False,
                                        interp=False)["BALLOT"], bad
    assert not op.kernel_constexprs(Config(group_mask="ballot", rows_x_heads=1024), 64, 128, 2048, select=True,
                                    relu=True, write_scores=False, ieee=False, interp=False)["BALLOT"], "16 rows"
    assert op.kernel_constexprs(Config(group_mask="ballot", rows_x_heads=256), 32, 128, 2048, select=True,
                                relu=True, write_scores=False, ieee=False, interp=False)["BALLOT"], "8 rows"
    assert op.kernel_constexprs(Config(group_mask="ballot"), 64, 128, 2048, select=True, relu=True,
                                write_scores=False, ieee=False, interp=False)["BALLOT"]


@interp
def test_ignored_where_inapplicable(calls, caplog):
    """2 rows per tile: the mask sum runs (the same output as "sum"), with one info line naming why."""
    *case, topk = short_masked_case()
    cfg = _cfg(2, rows_x_heads=4)
    base = hytopk(*case, topk, config=op.replace(cfg, group_mask="sum"))
    with caplog.at_level("INFO", logger="hyscale_kernels"):
        out = hytopk(*case, topk, config=op.replace(cfg, group_mask="ballot"))
    assert not calls, "the ballot ran on a 2-row tile"
    assert torch.equal(out, base)
    assert "group_mask='ballot' does not apply to this launch" in caplog.text and "2 rows" in caplog.text


class _Kern:
    def __init__(self, ttgir):
        self.asm = {"ttgir": ttgir}


def _ttgir(layout, rows=4):
    t = f"tensor<4x16x{rows}xi32, #linear3>"
    return (f"#linear3 = #ttg.linear<{{{layout}, block = []}}>\n"
            "  %a:2 = tt.elementwise_inline_asm \"{ vote.sync.ballot.b32 b0, p0, 0xffffffff; }\" "
            f"{{constraints = \"=r,=r,=r,=r,r,r\", packed_element = 2 : i32, pure = true}} %m : {t} -> {t}, {t}\n")


def test_layout_check():
    """The first launch's TTGIR check: the modelled layout passes; a permuted lane basis, or no ballot op at all,
    raises with the fix."""
    op._check_ballot_layout(_Kern(_ttgir(_kernel.BALLOT_LAYOUT)))
    swapped = _kernel.BALLOT_LAYOUT.replace("lane = [[0, 0, 1], [0, 0, 2]", "lane = [[0, 0, 2], [0, 0, 1]")
    assert swapped != _kernel.BALLOT_LAYOUT
    with pytest.raises(RuntimeError, match="group_mask='sum'"):
        op._check_ballot_layout(_Kern(_ttgir(swapped)))
    with pytest.raises(RuntimeError, match="no ballot op"):
        op._check_ballot_layout(_Kern("#linear = #ttg.linear<{register = [], block = []}>\n"))
    # 8 rows: the two-register layout on a [4, 16, 8] tile passes; the 4-row layout there (or the 8-row one on a
    # [4, 16, 4] tile) raises
    op._check_ballot_layout(_Kern(_ttgir(_kernel.BALLOT_LAYOUTS[8], rows=8)))
    with pytest.raises(RuntimeError, match="group_mask='sum'"):
        op._check_ballot_layout(_Kern(_ttgir(_kernel.BALLOT_LAYOUTS[4], rows=8)))
    with pytest.raises(RuntimeError, match="group_mask='sum'"):
        op._check_ballot_layout(_Kern(_ttgir(_kernel.BALLOT_LAYOUTS[8], rows=4)))


def test_default_and_guard(monkeypatch, caplog):
    """default_config uses the ballot for 4-row tiles on the GPU (H 8..64) and H 32's and 16's 8-row tiles (with split
    selects), not at H 4 / 128 or in the interpreter.
    A layout mismatch: an explicit Config raises; the default logs a warning, returns False (the caller re-runs
    with "sum") and default_config stays on "sum" for the process."""
    monkeypatch.setattr(op, "_ballot_default", True)
    for H, want in ((64, "ballot"), (32, "ballot"), (16, "ballot"), (8, "ballot"), (4, "sum"), (128, "sum")):
        assert default_config(H, 2048).group_mask == want, H
    rows = {H: (op._rows(default_config(H, 2048), H), default_config(H, 2048).select_split) for H in (64, 32, 16, 4)}
    assert rows == {64: (4, 1), 32: (8, 2), 16: (8, 2), 4: (8, 1)}, rows
    assert default_config(64, 2048, interpret=True).group_mask == "sum"
    good = _Kern(_ttgir(_kernel.BALLOT_LAYOUT))
    bad = _Kern(_ttgir(_kernel.BALLOT_LAYOUT.replace("register = [[0, 8, 0]]", "register = [[0, 0, 2]]")))
    assert op._ballot_guard(good, explicit=False) and op._ballot_guard(good, explicit=True)
    with pytest.raises(RuntimeError, match="assumes the candidate tile layout"):
        op._ballot_guard(bad, explicit=True)
    assert op._ballot_default, "an explicit config's failure must not change the default"
    with caplog.at_level("WARNING", logger="hyscale_kernels"):
        assert op._ballot_guard(bad, explicit=False) is False
    assert "falls back to group_mask='sum'" in caplog.text
    assert default_config(64, 2048).group_mask == "sum"


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,relu,rows8,w_bf16",
                         [(12288, 64, True, False, False), (8192, 32, False, False, False),
                          (9000, 32, True, True, False), (9000, 16, False, True, False), (10240, 16, True, False, True),
                          (10240, 64, True, False, True)])
def test_gpu_ballot_equals_sum(T, H, relu, rows8, w_bf16):
    """bf16 q / k at real shapes (k 2048, warm start, compactions): the ballot slots give the mask sum's selection,
    deterministically, and the compiled layout passed the first-launch check. The two compiles may round the fp32
    head sum differently (session 24: H 16, 4 rows, bf16 head weights, bench/topk.py check spec 6: <= 2 ulp, one
    near-tie swapped), so rows are compared up to that rounding; bit for bit where w is fp32 (measured so far).
    rows8: 8 rows per tile (rows_x_heads 8 H, split selects: the default at H 32 / 16), else 4 (rows_x_heads 4 H)."""
    q, w, k, st, en = gpu_causal_inputs(T, H)
    if w_bf16:
        w = w.bfloat16()
    cfg = op.replace(default_config(H, 2048), group_mask="ballot")  # the default at H 16..64
    cfg = op.replace(cfg, rows_x_heads=8 * H, select_split=2) if rows8 else op.replace(cfg, rows_x_heads=4 * H,
                                                                                       select_split=1)
    si, sv = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=op.replace(cfg, group_mask="sum"))
    bi, bv = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=op.replace(cfg, group_mask="ballot"))
    bi2 = hytopk(q, w, k, st, en, 2048, relu=relu, config=op.replace(cfg, group_mask="ballot"))
    assert torch.equal(bi, bi2), "two runs differ"
    n_idx, n_val = same_up_to_rounding(q, w, k, st, en, 2048, relu, (bi, bv), (si, sv), ("ballot", "sum"))
    if not w_bf16:
        assert n_idx == 0 and n_val == 0, f"ballot vs sum: indices differ in {n_idx} rows, scores in {n_val}"
    print(f"ballot vs sum: indices differ in {n_idx} rows, scores in {n_val}")


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)
