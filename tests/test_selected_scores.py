"""selected_scores (Triton; interpreter on CPU) against selected_scores_reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hyscale_kernels.hytopk.reference import selected_scores_reference
from hyscale_kernels.hytopk import selected_scores as ss_mod
from hyscale_kernels.hytopk.selected_scores import selected_scores

HAS_CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERP), reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _nan_outputs(monkeypatch):
    """Kernel outputs start as NaN, so any element a kernel fails to write fails the test."""
    monkeypatch.setattr(ss_mod, "_alloc",
                        lambda *s, dtype, device: torch.full(s, float("nan"), dtype=dtype, device=device))


def _case(T, H, D, S, K, seed=0, dtype=torch.float32, device="cpu", pad=0.3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(device, dtype)
    w = torch.randn(T, H, generator=g).to(device)  # both signs
    k = torch.randn(S, D, generator=g).to(device, dtype)
    idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    idx = idx.masked_fill(torch.rand(T, K, generator=g) < pad, -1)
    idx[0] = -1  # a row with nothing selected
    return q, w, k, idx.to(device=device, dtype=torch.int32)


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


def test_torch_fallback_path_in_subprocess():
    """Plain CPU (no interpreter) takes the row-chunked PyTorch path and logs it once."""
    code = (
        "import logging, torch; logging.basicConfig(level=logging.INFO)\n"
        "import sys; sys.path.insert(0, %r)\n"
        "from test_selected_scores import _compare\n"
        "_compare(5, 3, 12, 41, 37, True, False); _compare(4, 2, 8, 7, 5, False, False)\n" % os.path.dirname(__file__)
    )
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr.count("row-chunked PyTorch path") == 1, r.stderr


def test_input_validation():
    q, w, k, idx = _case(3, 2, 8, 5, 4)
    with pytest.raises(ValueError, match="indices must be in"):
        selected_scores(q, w, k, idx.masked_fill(idx == idx.max(), 5))
    with pytest.raises(ValueError, match="w must be"):
        selected_scores(q, w[:, :1], k, idx)
    with pytest.raises(TypeError, match="dtype"):
        selected_scores(q, w, k.double(), idx)


@pytest.mark.gpu
@pytest.mark.parametrize("relu", [True, False])
def test_gpu_bf16(relu):
    q, w, k, idx = _case(512, 64, 128, 4096, 2048, dtype=torch.bfloat16, device="cuda", pad=0.05)
    g = torch.randn(512, 2048, device="cuda")
    ref = _run(selected_scores_reference, q.float(), w, k.float(), idx, g, relu=relu)
    for det in (False, True):
        got = _run(selected_scores, q, w, k, idx, g, relu=relu, deterministic=det)
        for a, b in zip(got, ref):
            scale = b[torch.isfinite(b)].abs().max()
            torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2 * float(scale))


@pytest.mark.skipif(HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the Triton tests above already ran in this process")
def test_interpreter_in_subprocess():
    """Triton was imported here without the interpreter: run the kernel tests in a fresh process."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                        "-k", "not subprocess and not gpu"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
