"""Sparse-stage indexer loss recomputes the indexer q at its backward (hyscale_megatron.indexer_recompute).

- bit-identical LM loss, indexer loss and every parameter gradient with the feature on vs off, on
  the kernel path (Triton interpreter on CPU), with and without full recompute, batch 1 and 2, replay;
- memory: with the feature on, the storage of the q that ``forward_before_topk`` returned is gone
  by the MLP backward of the layer (where a step peaks) and q was recomputed once per layer; off, it
  is still alive there (the test sees what it claims to see).
"""

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hyscale_kernels.indexer_loss.kl import mark_scratch, take_scratch
from hyscale_megatron import indexer_recompute
from hyscale_megatron.config import HyScaleConfig
from hyscale_megatron.models import build_gpt, mla_dsa_config

pytestmark = pytest.mark.usefixtures("megatron_env")

VOCAB = 128
_FINISH = indexer_recompute.finish  # the original (tests wrap it through monkeypatch)
_ORIG_BWD = None  # selected_scores._triton_bwd, unwrapped (set at the first _run)
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _tracker_values():
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper as H

    vals = H.tracker.get("values")
    out = None if vals is None else vals.detach().clone()
    H.clean_loss_in_tracker()
    return out


def _run(enabled, monkeypatch, recompute, batch, dtype, replay=True):
    global _ORIG_BWD
    from hyscale_kernels.hytopk import selected_scores as ss
    from hyscale_megatron.env import seed_all

    _ORIG_BWD = _ORIG_BWD or ss._triton_bwd

    monkeypatch.setattr(indexer_recompute, "ENABLED", enabled)
    monkeypatch.setattr(indexer_recompute, "RECOMPUTE_CHUNK_BYTES", 7000)  # RoPE in chunks of 3 / 1 rows
    cfg = mla_dsa_config(dtype=dtype, **(FULL if recompute else {}))
    seed_all(7)
    model = build_gpt(cfg, use_hyscale=True, vocab_size=VOCAB,
                      hyscale=HyScaleConfig(topk_impl="reference", attn_impl="triton", replay=replay))
    # every q the indexer hands to the loss (weak refs to its storage) and every recipe made
    qs, recipes = [], []
    orig_finish = _FINISH

    def finish(indexer, cap, q):
        r = orig_finish(indexer, cap, q)
        if q is not None and q.requires_grad:
            qs.append((StorageWeakRef(q.untyped_storage()), q.nelement() * q.element_size()))
        if r is not None:
            recipes.append(r)
        return r

    monkeypatch.setattr(indexer_recompute, "finish", finish)
    from hyscale_kernels.hytopk import selected_scores as ss

    orig_bwd, in_place = _ORIG_BWD, []

    def triton_bwd(q, *a, dq_over_q=False, **kw):  # did the KL backward write dq over a recomputed q?
        ptr = q.untyped_storage().data_ptr()
        dq, dw, dk = orig_bwd(q, *a, dq_over_q=dq_over_q, **kw)
        in_place.append((dq_over_q, dq.untyped_storage().data_ptr() == ptr))
        return dq, dw, dk

    monkeypatch.setattr(ss, "_triton_bwd", triton_bwd)
    alive_at_mlp_bwd = []

    def mlp_bwd(_mod, _grad):
        gc.collect()
        alive_at_mlp_bwd.append(sum(n for ref, n in qs if not ref.expired()))

    layers = model.decoder.layers
    hooks = [layer.mlp.register_full_backward_pre_hook(mlp_bwd) for layer in layers]
    tokens = torch.randint(0, VOCAB, (batch, 16), generator=torch.Generator().manual_seed(5))
    _tracker_values()
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    per_token = model(tokens, pos, None, labels=tokens.roll(-1, dims=1))
    per_token.float().mean().backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any(".indexer.linear_wq_b." in n for n in grads), "the indexer q up-projection got no gradient"
    return per_token.detach(), _tracker_values(), grads, alive_at_mlp_bwd, recipes, len(layers), in_place


@pytest.mark.parametrize("batch,recompute", [(1, False), (1, True), (2, True)], ids=["b1", "b1-full", "b2-full"])
def test_q_recompute_is_bit_identical_and_frees_q(monkeypatch, recompute, batch, dtype=torch.float32):
    out_off, idx_off, g_off, alive_off, rec_off, n_layers, ip_off = _run(False, monkeypatch, recompute, batch, dtype)
    out_on, idx_on, g_on, alive_on, rec_on, _, ip_on = _run(True, monkeypatch, recompute, batch, dtype)
    assert torch.equal(out_on, out_off), "LM loss differs"
    assert idx_on is not None and torch.equal(idx_on, idx_off), (idx_on, idx_off)
    assert g_on.keys() == g_off.keys()
    for name in g_off:
        assert torch.equal(g_on[name], g_off[name]), f"gradient of {name} differs"
    # memory: off, the q of every layer is kept by the loss through the MLP backward; on, none is
    # (b > 1: the kernel keeps a contiguous per-sequence copy instead, recomputed alike; b = 1 is the
    # long-context layout, where the loss saves q itself)
    assert not any(r.recomputes for r in rec_off)
    if batch == 1:
        assert len(alive_off) == n_layers and all(a > 0 for a in alive_off), alive_off
    assert alive_on == [0] * n_layers, alive_on
    used = [r for r in rec_on if r.recomputes]
    assert len(used) == n_layers and all(r.recomputes == 1 for r in used)
    if batch > 1:
        assert all(r.derived for r in used)  # the per-sequence copies went through the recipe too
    # dq: written over the recomputed q (same storage) with the feature on, a fresh buffer off; the
    # gradients above are bit-identical either way
    assert len(ip_off) == len(ip_on) == n_layers * batch, (ip_off, ip_on)
    assert ip_off == [(False, False)] * len(ip_off), ip_off
    assert ip_on == [(True, True)] * len(ip_on), ip_on
    assert all(r._q is None and r.outstanding == 0 for r in used)  # the recipe keeps no q after the backward


def test_q_recompute_without_replay(monkeypatch):
    """Full recompute without replay (the re-run selects again): still bit-identical."""
    a = _run(False, monkeypatch, True, 1, torch.float32, replay=False)
    b = _run(True, monkeypatch, True, 1, torch.float32, replay=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for name in a[2]:
        assert torch.equal(a[2][name], b[2][name]), name
    assert b[3] == [0] * b[5]
    assert all(over and same for over, same in b[6]) and len(b[6]) == b[5]


def test_recomputed_q_is_bit_identical_bf16(monkeypatch):
    """bf16 (the training dtype; the Triton interpreter's bf16 loss is not meaningful on CPU, so the
    recipe is checked directly): the recomputed q equals the forward's q bit for bit, RoPE in row
    chunks or whole, with rotate_activation."""
    from hyscale_megatron.env import seed_all

    monkeypatch.setattr(indexer_recompute, "ENABLED", True)
    seen = []
    orig_finish = _FINISH

    def finish(indexer, cap, q):
        r = orig_finish(indexer, cap, q)
        seen.append((r, q.detach().clone()))
        return r

    monkeypatch.setattr(indexer_recompute, "finish", finish)
    from megatron.core.transformer.experimental_attention_variant import dsa as stock_dsa

    # fast_hadamard_transform is CUDA-only: a bf16 stand-in, called by stock and by the recipe alike
    monkeypatch.setattr(stock_dsa, "rotate_activation", lambda x: torch.flip(x, [-1]) * 0.5 + x)
    for rotate, chunk in ((False, 7000), (True, 7000), (False, 1 << 26)):  # 3-row chunks / one chunk
        monkeypatch.setattr(indexer_recompute, "RECOMPUTE_CHUNK_BYTES", chunk)
        seen.clear()
        cfg = mla_dsa_config(dtype=torch.bfloat16, dsa_indexer_rotate_activation=rotate)
        seed_all(7)
        model = build_gpt(cfg, use_hyscale=True, vocab_size=VOCAB,
                          hyscale=HyScaleConfig(topk_impl="reference", attn_impl="reference"))
        tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        model(tokens, pos, None, labels=tokens)
        assert len(seen) == len(model.decoder.layers)
        for r, q in seen:
            assert r is not None and q.dtype == torch.bfloat16
            assert torch.equal(r.full(), q) and r.full().stride() == q.stride()
        _tracker_values()


def test_saved_q_is_a_recipe_and_view_layout_is_kept():
    """Unit level: the hooks pack q and its views as recipes and hand back the same values/layout."""
    rec = indexer_recompute.QRecipe.__new__(indexer_recompute.QRecipe)
    q = torch.randn(5, 1, 3, 4, requires_grad=True) * 1.0
    rec.ptr = q.untyped_storage().data_ptr()
    rec.meta = (q.shape, q.stride(), q.storage_offset(), q.dtype, q.device)
    rec.derived, rec._q, rec.recomputes, rec.outstanding = {}, None, 0, 0
    val = q.detach().clone()
    rec.full = lambda: val
    other = torch.randn(5, 3, 4)
    assert rec.pack(other) is other
    p = rec.pack(q[:, 0])
    p_full = rec.pack(q)
    assert isinstance(p, indexer_recompute._Packed) and rec.outstanding == 2
    got = indexer_recompute.QRecipe.unpack(p)
    assert torch.equal(got, q[:, 0].detach()) and got.stride() == q[:, 0].stride()
    # a view, and not the last unpack: never scratch; the last unpack of the whole q is
    assert not take_scratch(got) and rec.outstanding == 1
    rec._q = val
    got_full = indexer_recompute.QRecipe.unpack(p_full)
    assert torch.equal(got_full, q.detach()) and rec.outstanding == 0 and rec._q is None  # cache dropped
    assert take_scratch(got_full) and not take_scratch(got_full)  # private to one consumer, once
    # a storage declared scratch and then freed never matches a later tensor
    t = torch.empty(64)
    mark_scratch(t)
    del t
    assert not any(take_scratch(torch.empty(64)) for _ in range(8))


def test_dq_over_q_matches_a_fresh_dq():
    """selected_scores' backward writing dq over q (interpreter): same dq, dw, dk as into a new buffer."""
    from hyscale_kernels.hytopk import selected_scores as ss

    g = torch.Generator().manual_seed(3)
    T, H, D, S, K = 9, 4, 16, 13, 5
    q = torch.randn(T, H, D, generator=g)
    w = torch.randn(T, H, generator=g)
    k = torch.randn(S, D, generator=g)
    idx = torch.randint(0, S, (T, K), generator=g, dtype=torch.int32)
    idx[2, 3:] = -1
    gr = torch.randn(T, K, generator=g)
    ref = ss._triton_bwd(q, w, k, idx, gr, True, False)
    q2 = q.clone()
    got = ss._triton_bwd(q2, w, k, idx, gr, True, False, dq_over_q=True)
    assert got[0].data_ptr() == q2.data_ptr()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        ss._triton_bwd(q.transpose(0, 1).contiguous().transpose(0, 1), w, k, idx, gr, True, False, dq_over_q=True)
