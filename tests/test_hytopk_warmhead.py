"""HyTopK's Config.warm_sample="head": the warm start's sample is the row block's first warm_start keys, scored
once by the key loop (appended from -inf), then each row's threshold comes from them by the same rank rule as the
spread sample and the buffer is filtered to the keys above it (kernel._head_threshold); the loop goes on from the
next tile.

Every case asserts (1) the spread sample's index sets and scores (rows sorted by key index: thresholds differ, so
the "warps" order may), (2) the reference's sets, (3) that the head path ran (a spy on _head_threshold) and the
spread sample did not (_warm_threshold), and (4) the warm-start counters: rows started from the sampled threshold,
and, where the first keys were crafted to score above everything else, every such row re-run from -inf (exact all
the same).

CPU: the interpreter at tiny fp32 shapes (tests/conftest.py sets TRITON_INTERPRET=1 when there is no CUDA).
Interpreter geometry: block_n 16, warm_start 64 = the first 4 tiles; topk 5..12 gives CAP 64, so only rows with
more than 64 visible keys use the warm start.
"""

from __future__ import annotations

import pytest
import torch

from hyscale_kernels.hytopk import _kernel, hytopk, interpreter_active, op
from hyscale_kernels.hytopk.op import default_config
from hyscale_kernels.hytopk.reference import causal_bounds
from interp_rerun import rerun_under_interpreter
from test_hytopk_warmstart import _assert_reference_sets, _inputs
from test_hytopk_warps import by_index, gpu_causal_inputs, packed_rows_case, zero_ties_case

INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")


@pytest.fixture
def spies(monkeypatch):
    """Calls of _head_threshold and _warm_threshold (the interpreter looks jit functions up at call time)."""
    calls = {"head": 0, "spread": 0}
    for name, key in (("_head_threshold", "head"), ("_warm_threshold", "spread")):
        inner = getattr(_kernel, name)

        def spy(*args, _inner=inner, _key=key, **kwargs):
            calls[_key] += 1
            return _inner(*args, **kwargs)

        monkeypatch.setattr(_kernel, name, spy)
    return calls


def _cfg(H, topk, **kw):
    return op.replace(default_config(H, topk, interpret=True), warm_start=64, **kw)


def _check(q, w, k, st, en, topk, relu, cfg, spies, fallback_all=False):
    base_i, base_v = by_index(*hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=cfg))
    spread_stats = op.warm_stats()
    spies["head"] = spies["spread"] = 0
    head = op.replace(cfg, warm_sample="head")
    got_i, got_v = hytopk(q, w, k, st, en, topk, relu=relu, return_scores=True, config=head)
    stats = op.warm_stats()
    assert spies["head"] > 0 and spies["spread"] == 0, f"head path not taken: {spies}"
    assert not torch.isnan(got_v).any(), "unwritten output scores"
    assert torch.equal(hytopk(q, w, k, st, en, topk, relu=relu, config=head), got_i), "two runs differ"
    s_i, s_v = by_index(got_i, got_v)
    assert torch.equal(s_i, base_i), "index sets differ from the spread sample's"
    assert torch.equal(s_v, base_v), "scores differ from the spread sample's"
    _assert_reference_sets(got_i, q, w, k, st, en, topk, relu)
    assert stats["warm_rows"] > 0, stats
    if fallback_all:
        assert stats["fallback_rows"] == stats["warm_rows"], stats
    return stats, spread_stats


@interp
@pytest.mark.parametrize("append,kth", [("warps", "radix"), ("warps", "interp"), ("mask", "radix"),
                                        ("mask", "interp")])
@pytest.mark.parametrize("T,S,H,topk,relu", [(9, 150, 2, 8, True), (7, 140, 2, 12, False), (13, 203, 4, 5, True)])
def test_head_same_sets(T, S, H, topk, relu, append, kth, spies):
    """CP offset (rows see S - T + t + 1 keys), T / S not tile multiples, ReLU and identity with signed weights."""
    q, w, k = _inputs(T, S, H, seed=T + S)
    st, en = causal_bounds(T, S, offset=S - T)
    _check(q, w, k, st, en, topk, relu, _cfg(H, topk, append=append, kth_search=kth), spies)


@interp
@pytest.mark.parametrize("append", ["warps", "mask"])
def test_head_ties_and_packed(append, spies):
    """ReLU exact zeros tied at the k-th score; packed segments (row blocks straddle them), short and masked rows."""
    *case, topk = zero_ties_case()
    _check(*case, topk, True, _cfg(2, topk, append=append), spies)
    _check(*packed_rows_case(), 8, True, _cfg(2, 8, append=append), spies)


@interp
@pytest.mark.parametrize("append", ["warps", "mask"])
def test_head_biased_first_keys_fall_back(append, spies):
    """The first 64 keys score far above the rest (a position-dependent score): with 400 visible keys the rank rule
    takes the 8th largest of them (j = mu + 4 sd + 1, mu = 64 * 12 / 400), which leaves 8 < topk keys above the
    threshold, so every warm row is re-run from -inf, and the result is still exact."""
    T, S, H, topk = 4, 400, 2, 12
    q, w, k = _inputs(T, S, H, seed=11, w_sign=False)
    q, k = q.abs(), k.abs() * 0.01
    k[:64] = k[:64] * 0.0 + 10.0 + torch.arange(64, dtype=torch.float32)[:, None] * 0.01
    st = torch.zeros(T, dtype=torch.int32)
    en = torch.full((T,), S, dtype=torch.int32)
    _check(q, w, k, st, en, topk, True, _cfg(H, topk, append=append), spies, fallback_all=True)


def test_config_error():
    with pytest.raises(ValueError, match="warm_sample must be one of"):
        op.check_config(op.Config(warm_sample="first"), False)
    op.check_config(op.Config(warm_sample="head"), False)
    assert op.kernel_constexprs(op.Config(warm_sample="head"), 64, 128, 2048, select=True, relu=True,
                                write_scores=False, ieee=False, interp=False)["WARM_HEAD"]
    assert not op.kernel_constexprs(op.Config(warm_sample="head", warm_start=0), 64, 128, 2048, select=True,
                                    relu=True, write_scores=False, ieee=False, interp=False)["WARM_HEAD"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,H,relu", [(12288, 64, True), (8192, 32, False)])
def test_gpu_head_same_sets(T, H, relu):
    """bf16 at real shapes (k 2048, compactions): the default's sets and scores, twice; fallbacks rare."""
    q, w, k, st, en = gpu_causal_inputs(T, H)
    cfg = default_config(H, 2048)
    bi, bv = by_index(*hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=cfg))
    head = op.replace(cfg, warm_sample="head")
    gi, gv = hytopk(q, w, k, st, en, 2048, relu=relu, return_scores=True, config=head)
    stats = op.warm_stats()
    assert torch.equal(hytopk(q, w, k, st, en, 2048, relu=relu, config=head), gi), "two runs differ"
    si, sv = by_index(gi, gv)
    assert torch.equal(si, bi), f"index sets differ in {int((si != bi).any(1).sum())} rows"
    assert torch.equal(sv, bv), "scores differ"
    assert stats["warm_rows"] > 0 and stats["fallback_rows"] <= stats["warm_rows"] // 100, stats


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)
