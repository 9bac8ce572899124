"""Shared by the HyTopK tests: inputs, launch configs, the reference-set check and interpreter spies.

CPU: the Triton kernel runs in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported
when there is no CUDA) at tiny fp32 shapes; the interpreter's bf16 dot is not bf16, so "bf16" CPU inputs are bf16
values held in fp32. GPU tests (``-m gpu``) run real shapes in bf16.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from hyscale_kernels.hytopk import _kernel, op
from hyscale_kernels.hytopk.op import default_config
from hyscale_kernels.hytopk.reference import causal_bounds, hytopk_reference, index_scores_reference

HAS_CUDA = torch.cuda.is_available()
INTERPRETED = bool(_kernel.INTERPRETED)
interp = pytest.mark.skipif(not INTERPRETED, reason="the Triton interpreter is not active in this process")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@pytest.fixture(autouse=True)
def stale_outputs(monkeypatch):
    """HyTopK's outputs and scratch start as NaN scores and stale candidates (the fp32 bits of 1.0, an index far out
    of range), so an entry the kernel does not write fails the checks."""

    def empty(shape, dtype, device):
        shape = (shape,) if isinstance(shape, int) else shape
        return torch.full(shape, float("nan") if dtype.is_floating_point else 0x3F800000, dtype=dtype, device=device)

    monkeypatch.setattr(op, "_empty", empty)


def inputs(T, S, H, D=32, seed=0, dtype=torch.float32, device="cpu", w_sign=True):
    """Random q [T, H, D], w [T, H] (signed unless w_sign is False) and k [S, D]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(S, D, generator=g)
    w = torch.randn(T, H, generator=g)
    if not w_sign:
        w = w.abs()
    return q.to(device, dtype), w.to(device, dtype), k.to(device, dtype)


def zero_ties(q, w, k, every):
    """Tie-heavy scores under ReLU: every q.k <= 0 (exact zeros after the activation) except, for every second
    row, the keys at multiples of ``every``, which score high. Modifies and returns (q, w, k)."""
    k = k.abs()
    q = -q.abs()
    q[:, :, 0] = 0.0
    k[::every, 0] = 50.0
    q[::2, :, 0] = 1.0
    return q, w, k


def near_tie_inputs(T, S, H=2, D=16, spread=8, seed=0, base=1.0):
    """Row t's score of key s is exactly k[s, t % D] (one head of weight +-1): consecutive floats base + j ulps,
    j < spread, so many keys tie and the rest differ in the last bits; negative weights give negative scores."""
    rng = np.random.default_rng(seed)
    ulp = np.nextafter(np.float32(base), np.float32(np.inf)) - np.float32(base)
    k = torch.from_numpy((np.float32(base) + rng.integers(0, spread, size=(S, D)) * ulp).astype(np.float32))
    q = torch.zeros(T, H, D)
    w = torch.zeros(T, H)
    for t in range(T):
        q[t, t % H, t % D] = 1.0
        w[t, t % H] = 1.0 if t % 3 else -1.0
    return q, w, k


def interp_config(H=2, topk=8, **kw):
    """The interpreter's default launch shape with overrides."""
    return replace(default_config(H, topk, interpret=True), **kw)


def by_index(idx, val):
    """Rows sorted by key index, -1 padding last: launches that differ only in buffer order compare equal."""
    order = torch.where(idx < 0, torch.iinfo(torch.int32).max, idx).argsort(dim=1, stable=True)
    return idx.gather(1, order), val.gather(1, order)


def assert_reference_sets(q, w, k, st, en, topk, relu, idx, val=None, tol=1e-5):
    """Each row's selection is the reference's set; a differing row only at a near-tie with its k-th score (fp32
    sums in another order). Also: the count per row, -1 padding after the keys, no duplicates, all in bounds and,
    with val, the returned scores (sorted) equal to the reference's."""
    ri, rv = hytopk_reference(q, w, k, st, en, topk, relu=relu, return_scores=True)
    idx, ri, rv = idx.cpu().long(), ri.cpu().long(), rv.cpu()
    assert idx.shape == ri.shape
    n_vis = (en.long() - st.long()).clamp(min=0).clamp(max=topk).cpu()
    assert torch.equal((idx >= 0).sum(1), n_vis), "number of selected keys per row"
    scores = None
    for t in range(idx.shape[0]):
        sel = idx[t, : n_vis[t]]
        assert (idx[t, n_vis[t]:] == -1).all(), f"row {t}: -1 padding must follow the selected keys"
        assert sel.unique().numel() == sel.numel(), f"row {t}: duplicate indices"
        assert ((sel >= st[t].item()) & (sel < en[t].item())).all(), f"row {t}: index out of bounds"
        a, b = set(sel.tolist()), set(ri[t][ri[t] >= 0].tolist())
        if a != b:
            scores = index_scores_reference(q[t:t + 1], w[t:t + 1], k, relu).cpu()[0]
            kth = rv[t, n_vis[t] - 1].item()
            scale = max(1.0, rv[t, 0].abs().item())
            gap = max(abs(scores[i].item() - kth) / scale for i in a ^ b)
            assert gap < tol, f"row {t}: sets differ beyond a near-tie (gap {gap:.3g})"
    if val is not None:
        val = val.cpu()
        assert not torch.isnan(val).any(), "unwritten output scores"
        got = torch.where(idx >= 0, val, torch.full_like(val, float("-inf"))).sort(1, descending=True).values
        ref = rv.sort(1, descending=True).values
        fin = torch.isfinite(ref)
        assert torch.equal(fin, torch.isfinite(got))
        torch.testing.assert_close(got[fin], ref[fin], rtol=1e-4, atol=1e-4)


def assert_canonical(q, w, k, st, en, topk, relu, idx, val=None):
    """Exact equality with the reference (inputs whose scores are exact in fp32: no near-tie allowance), as sets,
    and the returned scores bit for bit."""
    ri, rv = hytopk_reference(q, w, k, st, en, topk, relu=relu, return_scores=True)
    gi, gv = by_index(idx.cpu(), val.cpu() if val is not None else torch.zeros(idx.shape))
    ri, rv = by_index(ri, rv)
    assert torch.equal(gi, ri), f"selections differ in {int((gi != ri).any(1).sum())} rows"
    if val is not None:
        assert torch.equal(gv, rv), "returned scores differ"


def spy(monkeypatch, name, when=None):
    """Calls of the kernel's jit function ``name`` (the interpreter looks it up in the module at call time); with
    ``when(args)``, only the calls it accepts."""
    calls = []
    inner = getattr(_kernel, name)

    def wrapper(*args, **kwargs):
        if when is None or when(args):
            calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(_kernel, name, wrapper)
    return calls


def gpu_causal_inputs(T, H, seed=0, w_sign=True):
    """bf16 q, k, fp32 w (signed unless w_sign is False) on the GPU, causal bounds over T keys."""
    q, w, k = inputs(T, T, H, D=128, seed=seed, w_sign=w_sign)
    st, en = causal_bounds(T, T, device="cuda")
    return q.cuda().bfloat16(), w.cuda(), k.cuda().bfloat16(), st, en


def sample_rows(T, n=48, tail=8, device="cuda"):
    """Rows spread over [0, T) plus the last ``tail`` (the longest causal rows)."""
    return torch.cat([torch.arange(0, T, max(1, T // n)), torch.arange(T - tail, T)]).unique().to(device)


def warm_sample_positions(lo, hi, warm):
    """The key indices the warm start samples for a row block whose rows see keys within [lo, hi) (hi - lo > CAP):
    lo + i * ((hi - lo) // warm), i < warm (_kernel._sample_tile)."""
    return [lo + i * ((hi - lo) // warm) for i in range(warm)]


def same_up_to_rounding(q, w, k, st, en, topk, relu, a, b, names=("a", "b"), max_rows=64, rel=1e-6):
    """Two launches' (indices, scores) whose compiles may round the fp32 head sum differently: rows compared by key
    index; where the index sets differ (at most max_rows rows), both launches' rows must be the reference's sets up
    to a near-tie at the k-th key; where they agree, scores within rel or, where the head sum cancels, within the
    rounding bound of an fp32 sum of H terms: |a - b| <= 2 (H + 1) 2^-24 sum_h |w_h act(q_h . k)|.
    Returns (rows whose indices differ, rows whose scores differ bit-wise)."""
    (ai, av), (bi, bv) = by_index(*a), by_index(*b)
    rows_i = (ai != bi).any(1).nonzero().flatten()
    assert rows_i.numel() <= max_rows, f"{names[0]} vs {names[1]}: index sets differ in {rows_i.numel()} rows"
    for name, (i, v) in zip(names, (a, b)) if rows_i.numel() else ():
        r = rows_i
        try:
            assert_reference_sets(q[r].float(), w[r].float(), k.float(), st[r], en[r], topk, relu, i[r], v[r])
        except AssertionError as exc:
            raise AssertionError(f"{name} (rows where {names[0]} and {names[1]} differ): {exc}") from exc
    same = (ai == bi) & (ai >= 0)
    diff = (av - bv).abs()
    r, j = (same & (diff > rel * bv.abs())).nonzero(as_tuple=True)
    worst = 0.0
    for c in range(0, r.numel(), 4096):  # the head sum's absolute terms, per flagged (row, key)
        rc, kc = r[c:c + 4096], ai[r[c:c + 4096], j[c:c + 4096]].long()
        s = torch.einsum("nhd,nd->nh", q[rc].float(), k[kc].float())
        mag = (w[rc].float() * (s.clamp_min(0) if relu else s)).abs().sum(1)
        ratio = diff[rc, j[c:c + 4096]] / (2 * (q.shape[1] + 1) * 2.0 ** -24 * mag).clamp_min(1e-30)
        worst = max(worst, float(ratio.max()))
    assert worst <= 1, (f"{names[0]} vs {names[1]}: {r.numel()} scores beyond rel {rel}, the worst at {worst:.3g}x "
                        f"the head sum's rounding bound")
    return int(rows_i.numel()), int(((av != bv) & same).any(1).sum())
