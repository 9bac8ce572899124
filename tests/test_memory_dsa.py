"""Per-token memory of the HyScale DSA core: same results, fewer bytes kept between forward and backward.

- the value up-projection (``dsa._UpProjectV``) equals stock's einsum bit for bit, keeps the sparse
  attention's own output (no stacked copy) and hands back a [s, np, c]-contiguous latent gradient
  (no copy in the sparse-attention backward);
- the fused sparse KL (``indexer_loss.kl``) saves one [T, topk] fp32 tensor (the score gradient)
  instead of two (target and scores) and gives the same gradients as the per-slot recompute;
- the memory ledger (bench/memory_ledger.py) runs a whole training step on CPU and books it.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from hyscale_megatron.dsa import _UpProjectV

ROOT = Path(__file__).resolve().parents[1]


def _saved_storages(fn):
    """Run fn() under saved-tensor hooks; -> (result, [(data_ptr, shape, dtype) of each saved tensor])."""
    saved = []

    def pack(t):
        saved.append((t.untyped_storage().data_ptr(), tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_up_projection_matches_stock_einsum_without_copies(dtype):
    torch.manual_seed(0)
    s, h, c, d = 37, 4, 64, 16
    latent = torch.randn(s, h, c, dtype=dtype, requires_grad=True)
    up_v = torch.randn(h, d, c, dtype=dtype, requires_grad=True)
    g = torch.randn(s, 1, h * d, dtype=dtype)
    # stock (and HyScale before): stacked latent, einsum, reshape
    ref = torch.einsum("sbhc,hdc->sbhd", torch.stack([latent], dim=1), up_v).reshape(s, 1, -1)
    ref_grads = torch.autograd.grad(ref, (latent, up_v), g)
    out, saved = _saved_storages(lambda: _UpProjectV.apply(latent, up_v).unsqueeze(1))
    grads = torch.autograd.grad(out, (latent, up_v), g)
    assert torch.equal(out, ref)
    assert torch.equal(grads[0], ref_grads[0]) and torch.equal(grads[1], ref_grads[1])
    # memory: only the inputs themselves are saved (no stacked / permuted copy of the latent)
    assert {p for p, _, _ in saved} == {latent.untyped_storage().data_ptr(), up_v.untyped_storage().data_ptr()}
    # the latent gradient is already in the layout the sparse-attention backward reads
    assert grads[0].is_contiguous() and grads[0].shape == latent.shape


def _kl_inputs(T=6, S=30, H=4, D=16, topk=10, seed=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    w = torch.randn(T, H, generator=g)
    k = torch.randn(S, D, generator=g)
    idx = torch.stack([torch.randperm(S, generator=g)[:topk] for _ in range(T)]).to(torch.int32)
    idx[1, 7:] = -1  # padded row
    idx[4] = -1  # row with no valid slot
    target = torch.rand(T, topk, generator=g) * (idx >= 0)
    return q, w, k, idx, target


@pytest.mark.parametrize("masked", [False, True])
def test_sparse_kl_saves_one_topk_tensor_and_keeps_gradients(masked):
    """Triton kernels under TRITON_INTERPRET=1 (conftest) on CPU."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs CUDA or the Triton interpreter")
    from hyscale_kernels.hytopk.selected_scores import _triton_bwd, _triton_fwd
    from hyscale_kernels.indexer_loss.kl import kl_rows, sparse_kl

    q, w, k, idx, target = _kl_inputs()
    T, topk = idx.shape
    row_mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0]) if masked else None
    leaves = [t.clone().requires_grad_() for t in (q, w, k)]
    kl, saved = _saved_storages(lambda: sparse_kl(*leaves, idx, target, row_mask))
    g_rows = torch.linspace(0.5, 1.5, T)
    kl.backward(g_rows)

    # the previous design: scores and target kept, gradient recomputed per slot in the backward kernel
    scores = _triton_fwd(q, w, k, idx, True)
    kl_ref, lse, den = kl_rows(target, scores, idx, row_mask)
    coef = g_rows * (row_mask if masked else 1.0)
    dq, dw, dk = _triton_bwd(q, w, k, idx, None, True, False, kl=(scores, target, lse, den, coef.contiguous()))
    assert torch.equal(kl.detach(), kl_ref)
    for got, want in zip((t.grad for t in leaves), (dq, dw, dk)):
        assert torch.equal(got, want.to(got.dtype))

    big = [s for s in saved if s[1] == (T, topk) and s[2] == torch.float32]
    assert len(big) == 1, f"expected one [T, topk] fp32 saved tensor (the score gradient), got {big}"
    with pytest.raises(RuntimeError, match="twice"):
        leaves2 = [t.clone().requires_grad_() for t in (q, w, k)]
        kl2 = sparse_kl(*leaves2, idx, target, row_mask)
        kl2.sum().backward(retain_graph=True)
        kl2.sum().backward()


def _ledger_module():
    spec = importlib.util.spec_from_file_location("memory_ledger", ROOT / "bench" / "memory_ledger.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["memory_ledger"] = mod  # dataclasses look their module up
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return mod


@pytest.mark.usefixtures("megatron_env")
def test_memory_ledger_books_a_training_step():
    """The ledger on the tiny CPU config: the per-token table adds
    up, HyScale's kernel stand-ins are restored afterwards, and the DSA core keeps no stacked latent
    copy nor a second [T, topk] fp32 tensor alive at the peak."""
    from megatron.training import global_vars

    import hyscale_kernels.hytopk as hytopk_pkg

    ledger = _ledger_module()
    before = (hytopk_pkg.hytopk, torch.nn.RMSNorm.forward)
    try:
        opts = ledger.parse_args(["--config", str(ROOT / "configs" / "tiny_cpu.args"), "--seq-length", "256",
                                  "--top", "400"])
        res = ledger.run(opts)
    finally:
        global_vars.unset_global_variables()
    assert (hytopk_pkg.hytopk, torch.nn.RMSNorm.forward) == before, "ledger patches must be undone"
    S, topk = res["seq_length"], res["topk"]
    assert res["peak_bytes"] > 0 and res["per_token_bytes"] > 0
    assert res["peak_at"]["phase"].startswith(("forward", "backward", "recompute"))
    assert sum(c["bytes"] for c in res["components"].values()) == res["activation_bytes_at_peak"]
    assert res["host_peak_bytes"] > 0, "replay entries are booked as host memory (offload)"
    top = res["top"]
    assert not [a for a in top if a["op"].startswith("stack")], "no stacked latent copy at the peak"
    topk_fp32 = [a for a in top if a["shape"] == [S, topk] and a["dtype"] == "float32"]
    assert len(topk_fp32) <= 1, topk_fp32
