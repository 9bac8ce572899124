"""The memory savings of a HyScale step keep its results bit-identical and free what they claim.

- the value up-projection (``dsa._UpProjectV``) equals stock's einsum bit for bit, keeps the sparse attention's
  own output (no stacked copy) and hands back a [s, np, c]-contiguous latent gradient;
- the fused sparse KL saves one [T, topk] fp32 tensor (the score gradient), not two;
- in the layer (Triton interpreter): the attention backward writes dq over the layer's query, the indexer q is
  recomputed at the loss backward instead of kept (and that backward writes its dq over it): LM loss, indexer
  loss and every parameter gradient are bit-identical with these on and off, on both loss-target paths, with
  and without full recompute, batch 1 and 2; q is gone by the MLP backward; not in place where a reference
  indexer loss (dense warm-up stage) keeps the query;
- the recomputed indexer q equals the forward's bit for bit in bf16 (RoPE in row chunks or whole, rotate);
- bench/memory_ledger.py books a CPU training step; bench/mem_peak.py's trace replay finds the peak.
"""

import contextlib
import gc
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hyscale_megatron import indexer_recompute
from hyscale_megatron.config import HyScaleConfig
from hyscale_megatron.dsa import _UpProjectV
from hyscale_megatron.models import build_gpt, mla_dsa_config
from _sparse_cases import indexer_case, needs_triton

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


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
    ref = torch.einsum("sbhc,hdc->sbhd", torch.stack([latent], dim=1), up_v).reshape(s, 1, -1)  # stock's
    ref_grads = torch.autograd.grad(ref, (latent, up_v), g)
    out, saved = _saved_storages(lambda: _UpProjectV.apply(latent, up_v).unsqueeze(1))
    grads = torch.autograd.grad(out, (latent, up_v), g)
    assert torch.equal(out, ref)
    assert torch.equal(grads[0], ref_grads[0]) and torch.equal(grads[1], ref_grads[1])
    # only the inputs themselves are saved (no stacked / permuted copy of the latent)
    assert {p for p, _, _ in saved} == {latent.untyped_storage().data_ptr(), up_v.untyped_storage().data_ptr()}
    assert grads[0].is_contiguous() and grads[0].shape == latent.shape  # the layout the attention backward reads


@needs_triton
@pytest.mark.parametrize("masked", [False, True])
def test_sparse_kl_saves_one_topk_tensor(masked):
    from hyscale_kernels.indexer_loss.kl import sparse_kl
    from hyscale_kernels.indexer_loss.reference import _kl_rows, _masked_log_softmax, selected_scores_reference

    q, w, k, idx = indexer_case(T=6, H=4, D=16, S=30, K=10, seed=3)
    T, topk = idx.shape
    target = torch.rand(T, topk, generator=torch.Generator().manual_seed(4)) * (idx >= 0)
    row_mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0]) if masked else None
    leaves = [t.clone().requires_grad_() for t in (q, w, k)]
    kl, saved = _saved_storages(lambda: sparse_kl(*leaves, idx, target, row_mask))
    g_rows = torch.linspace(0.5, 1.5, T)
    kl.backward(g_rows)
    ref_leaves = [t.clone().requires_grad_() for t in (q, w, k)]
    tn = target / target.sum(-1, keepdim=True).clamp_min(1e-10)
    ref = _kl_rows(tn, _masked_log_softmax(selected_scores_reference(*ref_leaves, idx), idx >= 0), row_mask)
    ref.backward(g_rows)
    torch.testing.assert_close(kl.detach(), ref.detach(), rtol=1e-5, atol=1e-7)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
    big = [s for s in saved if s[1] == (T, topk) and s[2] == torch.float32]
    assert len(big) == 1, f"expected one [T, topk] fp32 saved tensor (the score gradient), got {big}"
    with pytest.raises(RuntimeError, match="twice"):
        kl2 = sparse_kl(*[t.clone().requires_grad_() for t in (q, w, k)], idx, target, row_mask)
        kl2.sum().backward(retain_graph=True)
        kl2.sum().backward()


# ---------------------------------------------------------------------------------------------
# the layer: dq over the query, indexer q recomputed (and dq over it)
# ---------------------------------------------------------------------------------------------
def _tracker_values():
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper as H

    vals = H.tracker.get("values")
    out = None if vals is None else vals.detach().clone()
    H.clean_loss_in_tracker()
    return out


def _layer_step(monkeypatch, savings: bool, batch: int, recompute: bool, loss_target="backward", **cfg_kw):
    """One forward + backward of a 1-layer HyScale GPT on the kernel path. ``savings`` off: the attention and
    loss backwards write dq into new buffers and the indexer q is kept (saved as it is).
    -> (LM loss per token, indexer loss, grads, facts) with facts: in-place flags of the attention / loss
    backwards, bytes of indexer q alive at the MLP backward, the recompute recipes made."""
    from hyscale_kernels.indexer_loss import kl as kl_mod
    from hyscale_kernels.sparse_mla import op as op_mod
    from hyscale_megatron.env import seed_all

    facts = dict(attn=[], loss=[], alive=[], recipes=[])
    if not savings:
        monkeypatch.setattr(indexer_recompute, "hooks_for", lambda recipe, q: contextlib.nullcontext(False))

    def spy(fn, key):
        def wrapped(q, *a, dq_over_q=False, **kw):
            ptr = q.untyped_storage().data_ptr()
            out = fn(q, *a, dq_over_q=dq_over_q and savings, **kw)
            facts[key].append(out[0].untyped_storage().data_ptr() == ptr)
            return out
        return wrapped

    monkeypatch.setattr(op_mod, "sparse_mla_bwd", spy(op_mod.sparse_mla_bwd, "attn"))
    monkeypatch.setattr(kl_mod, "selected_scores_bwd", spy(kl_mod.selected_scores_bwd, "loss"))
    monkeypatch.setattr(indexer_recompute, "RECOMPUTE_CHUNK_BYTES", 7000)  # RoPE in chunks of a few rows
    qs, finish = [], indexer_recompute.finish

    def record(indexer, cap, q):  # every q the indexer hands to the loss (weak refs to its storage)
        r = finish(indexer, cap, q)
        if q is not None and q.requires_grad:
            qs.append((StorageWeakRef(q.untyped_storage()), q.nelement() * q.element_size()))
        if r is not None:
            facts["recipes"].append(r)
        return r

    monkeypatch.setattr(indexer_recompute, "finish", record)
    cfg = mla_dsa_config(num_layers=1, **(FULL if recompute else {}), **cfg_kw)
    seed_all(7)
    model = build_gpt(cfg, use_hyscale=True, vocab_size=VOCAB,
                      hyscale=HyScaleConfig(topk_impl="reference", attn_impl="triton", loss_target=loss_target))

    def mlp_bwd(_mod, _grad):
        gc.collect()
        facts["alive"].append(sum(n for ref, n in qs if not ref.expired()))

    hooks = [layer.mlp.register_full_backward_pre_hook(mlp_bwd) for layer in model.decoder.layers]
    tokens = torch.randint(0, VOCAB, (batch, 16), generator=torch.Generator().manual_seed(5))
    _tracker_values()
    per_token = model(tokens, torch.arange(16).expand_as(tokens), None, labels=tokens.roll(-1, dims=1))
    per_token.float().mean().backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any(".indexer.linear_wq_b." in n for n in grads), "the indexer q up-projection got no gradient"
    return per_token.detach(), _tracker_values(), grads, facts


@needs_triton
@pytest.mark.usefixtures("megatron_env")
@pytest.mark.parametrize("batch,recompute,loss_target", [(1, True, "backward"), (2, False, "forward")],
                         ids=["b1-full-recompute-deferred-loss", "b2-forward-target-loss"])
def test_layer_memory_savings_are_exact(monkeypatch, batch, recompute, loss_target):
    with monkeypatch.context() as m:
        out_off, idx_off, g_off, off = _layer_step(m, False, batch, recompute, loss_target)
    out_on, idx_on, g_on, on = _layer_step(monkeypatch, True, batch, recompute, loss_target)
    assert torch.equal(out_on, out_off), "LM loss differs"
    assert idx_on is not None and torch.equal(idx_on, idx_off), (idx_on, idx_off)
    assert g_on.keys() == g_off.keys()
    for name in g_off:
        assert torch.equal(g_on[name], g_off[name]), f"gradient of {name} differs"
    n = batch  # one layer: one attention / loss backward per sequence
    assert off["attn"] == [False] * n and off["loss"] == [False] * n, off
    assert on["attn"] == [True] * n and on["loss"] == [True] * n, on  # dq over the query and the recomputed q
    if batch == 1:  # kept, q lives through the MLP backward (b > 1: the loss keeps per-sequence copies instead)
        assert off["alive"] and all(a > 0 for a in off["alive"]), off["alive"]
    assert on["alive"] == [0], on["alive"]  # recomputed: gone by then
    used = [r for r in on["recipes"] if r.recomputes]
    assert len(used) == 1 and used[0].recomputes == 1 and used[0]._q is None and used[0].outstanding == 0
    if batch > 1:
        assert used[0].derived  # the per-sequence copies went through the recipe too


@needs_triton
@pytest.mark.usefixtures("megatron_env")
def test_query_kept_for_a_reference_loss_is_not_overwritten(monkeypatch):
    """The dense (warm-up) indexer loss runs the chunked reference, whose checkpointed chunks re-read the
    query in the backward: the attention backward leaves the query intact there."""
    _, _, _, facts = _layer_step(monkeypatch, True, 1, False, dsa_indexer_use_sparse_loss=False)
    assert facts["attn"] == [False], facts["attn"]


@pytest.mark.usefixtures("megatron_env")
def test_recomputed_q_is_bit_identical_bf16(monkeypatch):
    """bf16 (the training dtype): the recomputed q equals the forward's q bit for bit, RoPE in row chunks or
    whole, with rotate_activation."""
    from megatron.core.transformer.experimental_attention_variant import dsa as stock_dsa

    from hyscale_megatron.env import seed_all

    seen, finish = [], indexer_recompute.finish

    def record(indexer, cap, q):
        r = finish(indexer, cap, q)
        seen.append((r, q.detach().clone()))
        return r

    monkeypatch.setattr(indexer_recompute, "finish", record)
    # fast_hadamard_transform is CUDA-only: a bf16 stand-in, called by stock and by the recipe alike
    monkeypatch.setattr(stock_dsa, "rotate_activation", lambda x: torch.flip(x, [-1]) * 0.5 + x)
    for rotate, chunk in ((False, 7000), (True, 7000), (False, 1 << 26)):  # chunks of a few rows / one chunk
        monkeypatch.setattr(indexer_recompute, "RECOMPUTE_CHUNK_BYTES", chunk)
        seen.clear()
        cfg = mla_dsa_config(dtype=torch.bfloat16, num_layers=1, dsa_indexer_rotate_activation=rotate)
        seed_all(7)
        model = build_gpt(cfg, use_hyscale=True, vocab_size=VOCAB,
                          hyscale=HyScaleConfig(topk_impl="reference", attn_impl="reference"))
        tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
        model(tokens, torch.arange(24).expand_as(tokens), None, labels=tokens)
        assert len(seen) == 1
        for r, q in seen:
            assert r is not None and q.dtype == torch.bfloat16
            assert torch.equal(r.full(), q) and r.full().stride() == q.stride()
        _tracker_values()


def test_unpacked_q_is_private_to_its_consumer():
    """Unit level: the hooks pack q and its views as recipes and hand back the same values / layout; a view
    unpacked while the cache is shared, or a part of q, comes back as a copy of its own; the last unpack of the
    whole q gets the recomputed buffer itself and drops the cache."""
    rec = indexer_recompute.QRecipe.__new__(indexer_recompute.QRecipe)
    q = torch.randn(5, 1, 3, 4, requires_grad=True) * 1.0
    rec.ptr = q.untyped_storage().data_ptr()
    rec.meta = (q.shape, q.stride(), q.storage_offset(), q.dtype, q.device)
    rec.derived, rec._q, rec.recomputes, rec.outstanding = {}, None, 0, 0
    val = q.detach().clone()
    rec.full = lambda: val
    other = torch.randn(5, 3, 4)
    assert rec.pack(other) is other
    p_part, p_full = rec.pack(q[:2, 0]), rec.pack(q)
    assert isinstance(p_part, indexer_recompute._Packed) and rec.outstanding == 2
    part = indexer_recompute.QRecipe.unpack(p_part)
    assert torch.equal(part, q[:2, 0].detach()) and rec.outstanding == 1
    assert part.untyped_storage().data_ptr() != val.untyped_storage().data_ptr()  # its own copy
    rec._q = val
    whole = indexer_recompute.QRecipe.unpack(p_full)
    assert torch.equal(whole, q.detach()) and rec.outstanding == 0 and rec._q is None
    assert whole.untyped_storage().data_ptr() == val.untyped_storage().data_ptr()  # the buffer itself


# ---------------------------------------------------------------------------------------------
# the memory tools
# ---------------------------------------------------------------------------------------------
def _bench_module(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return mod


@pytest.mark.usefixtures("megatron_env")
def test_memory_ledger_books_a_training_step():
    """The ledger on the tiny CPU config: the per-token table adds up, HyScale's kernel stand-ins are restored
    afterwards, and the DSA core keeps no stacked latent copy nor a second [T, topk] fp32 tensor at the peak."""
    from megatron.training import global_vars

    import hyscale_kernels.hytopk as hytopk_pkg

    ledger = _bench_module("memory_ledger")
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


def _ev(action, addr, size, *sites):
    frames = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"}] + [
        {"filename": f"/tmp/site/{f}", "line": ln, "name": fn} for f, ln, fn in sites]
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_mem_peak_replay_finds_the_peak_live_set_and_the_oom():
    mem_peak = _bench_module("mem_peak")
    a = ("megatron/core/a.py", 10, "fwd")
    b = ("hyscale_kernels/k.py", 20, "bwd")
    events = [
        _ev("alloc", 1, 100, a), _ev("alloc", 2, 300, b), _ev("free_requested", 1, 100, a),
        _ev("free_completed", 1, 100, a),  # a second free of the same block must not count twice
        _ev("alloc", 3, 250, a),  # total 550: the peak
        _ev("free_requested", 2, 300, b), _ev("alloc", 4, 50, b),
        dict(_ev("oom", 0, 1000, b)),
    ]
    local = {}
    peak, live, peak_i, oom = mem_peak.replay(events, local)
    assert peak == 550 and peak_i == 4 and set(live) == {2, 3}
    assert local == {"megatron/core/a.py:10 fwd": 550, "hyscale_kernels/k.py:20 bwd": 400}
    assert oom is not None and oom["live_total"] == 300 and set(oom["live"]) == {3, 4}
    groups = dict(mem_peak.group(live, depth=1))
    assert groups == {"hyscale_kernels/k.py:20 bwd": [300, 1, 300], "megatron/core/a.py:10 fwd": [250, 1, 250]}
    text = mem_peak.report({"device_traces": [[], events]}, tokens=10)
    assert "device 1" in text and "= 55 B/token" in text and "OOM event" in text and "local peaks" in text
    assert "torch/nn" not in text  # torch-internal frames are skipped
    assert "no allocator trace" in mem_peak.report({"device_traces": []}, tokens=None)
