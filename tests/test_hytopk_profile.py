"""op.hytopk_profile: the PROFILE kernel (clock64 at phase boundaries, bench/topk.py --parts profile).

The instrument must not change the selection (same indices, order included, as the plain launch) and its counts
must be the kernel's real ones: every row block once, and the compactions the key loop ran (counted here by a spy on
_select_store under the interpreter). Cycles are 0 under the interpreter; on the GPU the phases are positive and
lie inside the programs' total.
"""

from __future__ import annotations

import pytest
import torch

from hyscale_kernels.hytopk import hytopk, interpreter_active, op
from hyscale_kernels.hytopk.reference import causal_bounds
from interp_rerun import rerun_under_interpreter
from test_hytopk_warmstart import _assert_reference_sets, _inputs
from test_hytopk_warps import _interp_cfg, gpu_causal_inputs, packed_rows_case

INTERP = interpreter_active()
interp = pytest.mark.skipif(not INTERP, reason="Triton interpreter not active in this process")
CYCLES = ("total", "setup", "warm sample", "warm select", "key loop", "compactions", "re-runs", "final select")


@pytest.fixture
def compactions(monkeypatch):
    """Calls of _select_store that compact a buffer in the key loop: not the final writes (FINAL), not the head
    warm sample's filter (FILTER)."""
    calls = []
    inner = op._kernel._select_store

    def spy(*args, **kwargs):
        if not args[7] and not kwargs.get("FILTER", False):
            calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(op._kernel, "_select_store", spy)
    return calls


def _profiled(q, w, k, st, en, topk, relu, cfg, reference=True):
    plain = hytopk(q, w, k, st, en, topk, relu=relu, config=cfg)
    idx, prof = op.hytopk_profile(q, w, k, st, en, topk, relu=relu, config=cfg)
    assert torch.equal(idx, plain), "the profiled launch selected differently"
    if reference:  # (bf16 on the GPU: the other GPU suites check the plain launch's sets)
        _assert_reference_sets(idx, q, w, k, st, en, topk, relu)
    assert set(prof) == set(op.PROFILE_PHASES)
    return prof


@interp
@pytest.mark.parametrize("warm,sample", [(0, "spread"), (64, "spread"), (64, "head")])
def test_counts_and_selection(warm, sample, compactions):
    """Causal ragged rows with compactions, warm start off / spread / head: same output as the plain launch;
    row blocks and compactions counted exactly; no cycles under the interpreter."""
    T, S, H, topk = 11, 150, 2, 8
    q, w, k = _inputs(T, S, H, seed=5)
    st, en = causal_bounds(T, S, offset=S - T)
    cfg = _interp_cfg(H, topk, warm_start=warm, warm_sample=sample)
    hytopk(q, w, k, st, en, topk, config=cfg)
    n_plain = len(compactions)
    compactions.clear()
    prof = _profiled(q, w, k, st, en, topk, True, cfg)
    R = op._rows(cfg, H)
    assert prof["row blocks"] == -(-T // R)
    assert n_plain > 0 and len(compactions) == 2 * n_plain  # _profiled: the plain launch again, then the profiled
    assert prof["n compactions"] == n_plain
    assert all(prof[c] == 0 for c in CYCLES), prof


@interp
def test_packed_segments():
    """Packed segments with short and fully masked rows (some row blocks see no key)."""
    q, w, k, st, en = packed_rows_case()
    prof = _profiled(q, w, k, st, en, 8, True, _interp_cfg(2, 8, warm_start=64))
    assert prof["row blocks"] == -(-q.shape[0] // op._rows(_interp_cfg(2, 8), 2))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(12288, 64), (8192, 32)])
def test_gpu_phases(T, H):
    """bf16 causal at real shapes: the default launch's selection unchanged; every phase that runs has cycles,
    the phases (compactions excluded: part of the key loop) sum to at most the programs' total."""
    q, w, k, st, en = gpu_causal_inputs(T, H)
    prof = _profiled(q, w, k, st, en, 2048, True, None, reference=False)
    assert prof["row blocks"] == T // op._rows(op.default_config(H, 2048), H)
    for c in ("total", "setup", "warm sample", "warm select", "key loop", "final select"):
        assert prof[c] > 0, (c, prof)
    parts = sum(prof[c] for c in CYCLES[1:] if c != "compactions")
    assert parts <= prof["total"], prof
    assert prof["compactions"] <= prof["key loop"] + prof["re-runs"], prof


def test_interpreter_in_subprocess():
    """Triton imported here without the interpreter: run this file's kernel tests in a fresh process."""
    rerun_under_interpreter(__file__)
