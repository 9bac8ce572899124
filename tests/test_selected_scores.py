"""selected_scores (the indexer-loss op's Triton kernels; interpreter on CPU) against selected_scores_reference:
forward and gradients at odd sizes with -1 padding and empty rows, ReLU and identity, fp32 exactness and a bf16
per-element error bound, the deterministic dk reduction, the per-row coefficient, dq over q, bad input."""

from __future__ import annotations

import pytest
import torch

from hyscale_kernels.indexer_loss import selected_scores as ss_mod
from hyscale_kernels.indexer_loss.reference import selected_scores_reference
from hyscale_kernels.indexer_loss.selected_scores import selected_scores
from _sparse_cases import HAS_CUDA, INTERP, indexer_case, nan_outputs, needs_triton  # noqa: F401

pytestmark = pytest.mark.usefixtures("nan_outputs")
_case = indexer_case


def _run(fn, q, w, k, idx, g, **kw):
    q, w, k = (t.detach().clone().requires_grad_() for t in (q, w, k))
    out = fn(q, w, k, idx, **kw)
    fin = torch.isfinite(out)
    (out[fin] * g[fin]).sum().backward()
    return out, q.grad, w.grad, k.grad


def _compare(T, H, D, S, K, relu, deterministic, seed=0):
    q, w, k, idx = _case(T, H, D, S, K, seed)
    g = torch.randn(T, K, generator=torch.Generator().manual_seed(seed + 1))
    ref = _run(selected_scores_reference, q, w, k, idx, g, relu=relu)
    got = _run(selected_scores, q, w, k, idx, g, relu=relu, deterministic=deterministic)
    assert torch.equal(torch.isinf(got[0]), idx < 0)
    for a, b in zip(got, ref):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    return got


@needs_triton
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("deterministic", [False, True])
def test_matches_reference_odd_sizes(relu, deterministic):
    _compare(T=5, H=3, D=12, S=41, K=37, relu=relu, deterministic=deterministic)


@needs_triton
def test_deterministic_is_bitwise_repeatable():
    a = _compare(T=4, H=4, D=16, S=9, K=8, relu=True, deterministic=True, seed=3)
    b = _compare(T=4, H=4, D=16, S=9, K=8, relu=True, deterministic=True, seed=3)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_input_validation():
    q, w, k, idx = _case(3, 2, 8, 5, 4)
    with pytest.raises(ValueError, match="indices must be in"):
        selected_scores(q, w, k, idx.masked_fill(idx == idx.max(), 5))
    with pytest.raises(ValueError, match="w must be"):
        selected_scores(q, w[:, :1], k, idx)
    with pytest.raises(TypeError, match="dtype"):
        selected_scores(q, w, k.double(), idx)


# ---------------------------------------------------------------------------------------------
# bf16: a per-element error bound from the kernel's precision model (instead of a flat tolerance)
# ---------------------------------------------------------------------------------------------
U_BF16 = 2.0 ** -8  # unit roundoff of bf16 (8 significand bits, round to nearest even)
U_FP32 = 2.0 ** -24
OUT_NAMES = ("scores", "dq", "dw", "dk")


def _truth_and_bounds(q, w, k, idx, g, relu, rows=32):
    """fp64 truth of (scores, dq, dw, dk) and each element's error bound for a bf16 kernel.

    Precision model (the Triton kernels on bf16 inputs): q . k products are exact and summed in
    fp32; dS = g * w * act'(s) is rounded to bf16 before the dq / dk MMAs (fp32 accumulation); dq
    and dk are stored in bf16, scores and dw in fp32. Per element, with u = 2^-8:
      bf16 store          u * |x|
      bf16 dS rounding    independent errors |d_j| <= u on the terms of a sum: Hoeffding bounds
                          |sum_j d_j term_j| by 6.5 u sqrt(sum_j term_j^2) except with
                          probability < 1e-9 per element
      fp32 accumulation   n 2^-24 sum_j |term_j| (worst case), n = the reduction depth
      ReLU kinks          terms whose |s| is within the fp32 error of q . k (2 D 2^-24 sum|q k|)
                          may be in or out: their |term| counts in full
    """
    T, H, D = q.shape
    S, K = k.shape[0], idx.shape[1]
    dev = q.device
    q64, k64, w64 = q.double(), k.double(), w.double()
    tru = [torch.full((T, K), float("-inf"), dtype=torch.float64, device=dev),
           torch.zeros(T, H, D, dtype=torch.float64, device=dev),
           torch.zeros(T, H, dtype=torch.float64, device=dev),
           torch.zeros(S, D, dtype=torch.float64, device=dev)]
    r2 = [torch.zeros_like(t.clamp(min=0)) for t in tru]  # sum of squared terms (rounded ones)
    ab = [torch.zeros_like(t.clamp(min=0)) for t in tru]  # sum of |terms| (fp32 accumulation)
    kink = [torch.zeros_like(t.clamp(min=0)) for t in tru]  # |terms| at ambiguous ReLU signs
    for r0 in range(0, T, rows):
        sl = slice(r0, r0 + rows)
        i = idx[sl].long()
        valid = i >= 0
        ks = k64[i.clamp(min=0)] * valid[..., None]  # [R, K, D]
        s = torch.einsum("thd,tjd->thj", q64[sl], ks)
        s_abs = torch.einsum("thd,tjd->thj", q64[sl].abs(), ks.abs())
        amb = (s.abs() <= 2 * D * U_FP32 * s_abs) if relu else torch.zeros_like(s, dtype=torch.bool)
        a = s.relu() if relu else s
        gm = g[sl].double() * valid
        wa = w64[sl].abs()
        sc = torch.einsum("thj,th->tj", a, w64[sl])
        tru[0][sl] = sc.masked_fill(~valid, float("-inf"))
        ab[0][sl] = torch.einsum("thj,th->tj", s_abs, wa)
        tru[2][sl] = torch.einsum("thj,tj->th", a, gm)
        ab[2][sl] = torch.einsum("thj,tj->th", s_abs, gm.abs())
        ds = gm[:, None, :] * w64[sl][:, :, None]
        if relu:
            ds = ds * (s > 0)
        ds_all = (gm[:, None, :] * w64[sl][:, :, None]).abs()
        ds_amb = ds_all * amb
        tru[1][sl] = torch.einsum("thj,tjd->thd", ds, ks)
        r2[1][sl] = torch.einsum("thj,tjd->thd", ds ** 2, ks ** 2)
        ab[1][sl] = torch.einsum("thj,tjd->thd", ds.abs(), ks.abs())
        kink[1][sl] = torch.einsum("thj,tjd->thd", ds_amb, ks.abs())
        iv = i[valid]
        for acc, dsx, qx in ((tru[3], ds, q64[sl]), (r2[3], ds ** 2, q64[sl] ** 2),
                             (ab[3], ds.abs(), q64[sl].abs()), (kink[3], ds_amb, q64[sl].abs())):
            acc.index_add_(0, iv, torch.einsum("thj,thd->tjd", dsx, qx)[valid])
    depth = (D + H, K + D, H + D + K, H + D + T)  # fp32 reduction depth per output (generous)
    u_out = (0.0, U_BF16 if q.dtype == torch.bfloat16 else 0.0, 0.0, U_BF16 if q.dtype == torch.bfloat16 else 0.0)
    u_ds = U_BF16 if q.dtype == torch.bfloat16 else 0.0
    bounds = []
    for n, x in enumerate(tru):
        fin = torch.isfinite(x)
        xa = torch.where(fin, x, torch.zeros_like(x)).abs()
        rnd = 6.5 * u_ds * r2[n].sqrt() if n in (1, 3) else 0.0
        bounds.append(u_out[n] * xa + rnd + depth[n] * U_FP32 * ab[n] + kink[n])
    return tru, bounds


def _check_bounds(got, tru, bounds, slack=1.5):
    """Every element within slack x its bound; -inf exactly where the truth is -inf."""
    for name, a, b, bd in zip(OUT_NAMES, got, tru, bounds):
        a = a.detach().double().to(b.device)
        assert torch.equal(torch.isinf(a), torch.isinf(b)), f"{name}: -inf pattern differs"
        fin = torch.isfinite(b)
        err = (a - b).abs().masked_fill(~fin, 0.0)
        ratio = err / (slack * bd + 1e-30)
        worst = ratio.max().item() if ratio.numel() else 0.0
        assert not torch.isnan(a[fin]).any() and worst <= 1.0, (
            f"{name}: error {worst:.3g} x its bf16 bound at {tuple(int(v) for v in torch.nonzero(ratio == ratio.max())[0])} "
            f"(max err {err.max().item():.4g}, max |truth| {b[fin].abs().max().item():.4g}, "
            f"rel fro {(err.norm() / b[fin].norm()).item():.3g})")


def _emulate_bf16(q, w, k, idx, g, relu):
    """The kernels' precision model in plain PyTorch (CPU): fp32 sums of exact bf16 products,
    dS rounded to bf16, dq / dk stored in bf16."""
    T, H, D = q.shape
    i = idx.long()
    valid = i >= 0
    ks = k.float()[i.clamp(min=0)] * valid[..., None]
    s = torch.einsum("thd,tjd->thj", q.float(), ks)
    a = s.relu() if relu else s
    out = torch.einsum("thj,th->tj", a, w.float()).masked_fill(~valid, float("-inf"))
    gm = g.float() * valid
    dw = torch.einsum("thj,tj->th", a, gm)
    ds = gm[:, None, :] * w.float()[:, :, None]
    if relu:
        ds = ds * (s > 0)
    ds = ds.bfloat16().float()
    dq = torch.einsum("thj,tjd->thd", ds, ks).to(q.dtype)
    dk = torch.zeros(k.shape, dtype=torch.float32).index_add_(
        0, i[valid], torch.einsum("thj,thd->tjd", ds, q.float())[valid]).to(k.dtype)
    return out, dq, dw, dk


@pytest.fixture
def bf16_interpreter(monkeypatch):
    """Make the interpreter's bf16 faithful to the GPU: Triton 3.6's interpreter multiplies bf16
    tl.dot operands as their raw uint16 bit patterns and rounds fp32 -> bf16 toward zero; the GPU
    takes bf16 products exactly with fp32 accumulation and rounds to nearest even."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    def to_f32(x):
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).float().numpy()

    dot, cast = interp.InterpreterBuilder.create_dot, interp.InterpreterBuilder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            return interp.TensorHandle(np.matmul(to_f32(a.data), to_f32(b.data), dtype=np.float32) + d.data,
                                       d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).bfloat16()
            return interp.TensorHandle(x.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(interp.InterpreterBuilder, "cast_impl", cast_impl)


def _bf16_case(T, S, K, device="cpu", seed=0):
    q, w, k, idx = _case(T, 64, 128, S, K, seed=seed, dtype=torch.bfloat16, device=device, pad=0.05)
    g = torch.randn(T, K, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    return q, w, k, idx, g


def test_bf16_bound_holds_for_precision_model_and_catches_bugs():
    """The bound holds for the kernels' precision model (with the test's GPU structure: H = 64,
    D = 128, many rows selecting each key) and fails on plausible bugs the flat check missed."""
    q, w, k, idx, g = _bf16_case(T=16, S=256, K=256)
    for relu in (True,):  # with ReLU: the kinks' terms are in the bound too
        tru, bd = _truth_and_bounds(q, w, k, idx, g, relu)
        # the truth is the reference's (autograd through selected_scores_reference, which is fp32)
        ref = _run(selected_scores_reference, q.float(), w, k.float(), idx, g, relu=relu)
        for a, b in zip(ref, tru):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * float(b[torch.isfinite(b)].abs().max()))
        emu = _emulate_bf16(q, w, k, idx, g, relu)
        _check_bounds(emu, tru, bd)
        t, h = 5, 7
        bad = {
            "dq row x1.1": (1, lambda x: x.index_put_((torch.tensor(t), torch.tensor(h)), x[t, h] * 1.1)),
            "dq row without ReLU mask": (1, lambda x: x.index_put_((torch.tensor(t), torch.tensor(h)),
                                                                   -x[t, h])),
            "dk row x1.1": (3, lambda x: x.index_put_((idx[t, 3].long(),), x[idx[t, 3].long()] * 1.1)),
            "dw element +5%": (2, lambda x: x.index_put_((torch.tensor(t), torch.tensor(h)), x[t, h] * 1.05)),
            "dk one row's contribution lost": (3, lambda x: x.index_add_(
                0, idx[t][idx[t] >= 0].long(),
                -torch.einsum("hj,hd->jd", (g[t][idx[t] >= 0][None, :] * w[t][:, None]
                                           * ((q[t].float() @ k[idx[t][idx[t] >= 0].long()].float().T > 0)
                                              if relu else 1)), q[t].float()).to(x.dtype))),
        }
        for what, (n, perturb) in bad.items():
            got = [x.clone() for x in emu]
            perturb(got[n])
            with pytest.raises(AssertionError, match=OUT_NAMES[n]):
                _check_bounds(got, tru, bd)
            if what == "dq row x1.1":  # a flat check (rtol 2e-2, atol 2e-2 max|ref|) lets this through
                b = tru[n].float()
                torch.testing.assert_close(got[n].float(), b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


@needs_triton
@pytest.mark.parametrize("relu,deterministic", [(True, False), (False, True)])
def test_bf16_interpreter_within_bound(relu, deterministic, request):
    """The Triton kernels on bf16 (the GPU's bf16 semantics in the interpreter) meet the bound."""
    if INTERP and not HAS_CUDA:
        request.getfixturevalue("bf16_interpreter")
    q, w, k, idx, g = _bf16_case(T=8, S=256, K=256)
    tru, bd = _truth_and_bounds(q, w, k, idx, g, relu)
    _check_bounds(_run(selected_scores, q, w, k, idx, g, relu=relu, deterministic=deterministic), tru, bd)


@needs_triton
@pytest.mark.parametrize("deterministic", [True, False])
def test_bwd_row_coef_equals_prescaled_g(deterministic):
    """row_coef (the loss's per-row d loss / d kl, applied as the kernel loads g) gives what scaling g first
    gave, bit for bit (dq, dw; dk with the deterministic scatter), and leaves g as it is; a bad row_coef
    (shape, dtype) is refused."""
    T, H, D, S, K = 5, 6, 32, 60, 45
    q, w, k, idx = _case(T, H, D, S, K, seed=7)
    g = torch.randn(T, K, generator=torch.Generator().manual_seed(8)).masked_fill(idx < 0, 0.0)
    coef = torch.tensor([0.5, -2.0, 0.0, 3.0, 1e-3])
    g0 = g.clone()
    got = ss_mod.selected_scores_bwd(q, w, k, idx, g, True, deterministic, row_coef=coef)
    assert torch.equal(g, g0)
    ref = ss_mod.selected_scores_bwd(q, w, k, idx, g * coef[:, None], True, deterministic)
    for a, b in zip(got, ref):
        assert not torch.isnan(a).any()
        if deterministic or a is not got[2]:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"row_coef must be a contiguous fp32 \[5\]"):
        ss_mod.selected_scores_bwd(q, w, k, idx, g, True, deterministic, row_coef=coef[:4])
    with pytest.raises(ValueError, match="row_coef must be a contiguous fp32"):
        ss_mod.selected_scores_bwd(q, w, k, idx, g, True, deterministic, row_coef=coef.double())


@needs_triton
def test_dq_over_q_matches_a_fresh_dq():
    """The backward writing dq over q: same dq, dw, dk as into a new buffer; a non-contiguous q is refused."""
    T, H, D, S, K = 9, 4, 16, 13, 5
    q, w, k, idx = _case(T, H, D, S, K, seed=3)
    g = torch.randn(T, K, generator=torch.Generator().manual_seed(4))
    ref = ss_mod.selected_scores_bwd(q, w, k, idx, g, True, False)
    q2 = q.clone()
    got = ss_mod.selected_scores_bwd(q2, w, k, idx, g, True, False, dq_over_q=True)
    assert got[0].data_ptr() == q2.data_ptr()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="dq_over_q needs a contiguous q"):
        ss_mod.selected_scores_bwd(q.transpose(0, 1).contiguous().transpose(0, 1), w, k, idx, g, True, False,
                                   dq_over_q=True)


@pytest.mark.gpu
@pytest.mark.parametrize("relu", [True, False])
def test_gpu_bf16(relu):
    q, w, k, idx, g = _bf16_case(T=512, S=4096, K=2048, device="cuda")
    tru, bd = _truth_and_bounds(q, w, k, idx, g, relu, rows=64)
    for det in (False, True):
        _check_bounds(_run(selected_scores, q, w, k, idx, g, relu=relu, deterministic=det), tru, bd)
