"""The sparse attention backward writes dq over the layer's query (``sparse_mla(..., dq_over_q=True)``,
``hyscale_megatron.dsa.DQ_OVER_QUERY``): one [T, N, 576] buffer less at the step's peak.

- kernel: the scratch (default) and fused backwards with dq written over q give the same dq / dkv as
  into a fresh buffer, and dq *is* q's storage (scratch: per token chunk, dq staged and copied over q's
  chunk rows after the chunk's dkv kernel read them); the split backward (its dkv kernel reads q after
  the dq kernel) ignores the request and leaves q intact;
- layer: LM loss, indexer loss and every parameter gradient are bit-identical with it on and off
  (Triton interpreter; with and without full recompute, batch 1 and 2), and it really happened;
- not in place when a reference indexer loss (dense warm-up stage) keeps the query for its
  checkpointed backward (in place there changed the indexer gradients).
"""

import pytest
import torch

from hyscale_kernels.sparse_mla import kernel as K
from hyscale_megatron import dsa
from hyscale_megatron.config import HyScaleConfig
from hyscale_megatron.models import build_gpt, mla_dsa_config

pytestmark = pytest.mark.usefixtures("megatron_env")
VOCAB = 128
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _inputs(T=7, N=4, S=11, topk=5, dqk=24, v=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, N, dqk, generator=g)
    kv = torch.randn(S, dqk, generator=g)
    idx = torch.stack([torch.randperm(S, generator=g)[:topk] for _ in range(T)]).to(torch.int32)
    idx[1, 2:] = -1  # padding
    idx[3] = -1  # a row without keys
    out, lse = K.sparse_mla_fwd(q, kv, idx, 0.3, v)
    dout = torch.randn(out.shape, generator=g)
    return q, kv, idx, out, lse, dout


@pytest.mark.parametrize("kw", [dict(variant="fused"), dict(variant="split"), {}, dict(chunk_tokens=2),
                                dict(chunk_tokens=3, deterministic=True)],
                         ids=["fused", "split", "scratch", "scratch-chunks", "scratch-chunks-det"])
def test_kernel_dq_over_q(kw):
    q, kv, idx, out, lse, dout = _inputs()
    ref_dq, ref_dkv = K.sparse_mla_bwd(q, kv, idx, out, lse, dout, None, 0.3, 16, **kw)
    q2 = q.clone()
    dq, dkv = K.sparse_mla_bwd(q2, kv, idx, out, lse, dout, None, 0.3, 16, dq_over_q=True, **kw)
    torch.testing.assert_close(dq, ref_dq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dkv, ref_dkv, rtol=1e-5, atol=1e-5)
    if kw.get("variant") == "split":
        assert dq.data_ptr() != q2.data_ptr() and torch.equal(q2, q)  # not in place: q is intact
    else:
        assert dq.data_ptr() == q2.data_ptr()
        assert not torch.equal(q2, q)  # q's storage now holds dq
        with pytest.raises(ValueError, match="contiguous"):
            K.sparse_mla_bwd(q.transpose(0, 1).contiguous().transpose(0, 1), kv, idx, out, lse, dout, None, 0.3,
                             16, dq_over_q=True, **kw)


def _run(on, monkeypatch, recompute, batch, **cfg_kw):
    from hyscale_megatron.env import seed_all

    monkeypatch.setattr(dsa, "DQ_OVER_QUERY", on)
    in_place = []
    orig = K.sparse_mla_bwd

    def bwd(q, *a, dq_over_q=False, **kw):
        dq, dkv = orig(q, *a, dq_over_q=dq_over_q, **kw)
        in_place.append(dq.untyped_storage().data_ptr() == q.untyped_storage().data_ptr())
        return dq, dkv

    import hyscale_kernels.sparse_mla as sm

    monkeypatch.setattr(sm, "sparse_mla_bwd", bwd)
    cfg = mla_dsa_config(**(FULL if recompute else {}), **cfg_kw)
    seed_all(11)
    model = build_gpt(cfg, use_hyscale=True, vocab_size=VOCAB,
                      hyscale=HyScaleConfig(topk_impl="reference", attn_impl="triton"))
    tokens = torch.randint(0, VOCAB, (batch, 16), generator=torch.Generator().manual_seed(2))
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper as H

    H.clean_loss_in_tracker()
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    per_token = model(tokens, pos, None, labels=tokens.roll(-1, dims=1))
    per_token.float().mean().backward()
    vals = H.tracker.get("values")
    idx_loss = None if vals is None else vals.detach().clone()
    H.clean_loss_in_tracker()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return per_token.detach(), idx_loss, grads, in_place


@pytest.mark.parametrize("batch,recompute", [(1, False), (1, True), (2, True)], ids=["b1", "b1-full", "b2-full"])
def test_layer_gradients_bit_identical(monkeypatch, batch, recompute):
    out_off, idx_off, g_off, ip_off = _run(False, monkeypatch, recompute, batch)
    out_on, idx_on, g_on, ip_on = _run(True, monkeypatch, recompute, batch)
    assert torch.equal(out_on, out_off)
    assert idx_on is not None and torch.equal(idx_on, idx_off)
    assert g_on.keys() == g_off.keys() and any("linear_q_up_proj" in n or "linear_q_proj" in n for n in g_on)
    for name in g_off:
        assert torch.equal(g_on[name], g_off[name]), f"gradient of {name} differs"
    assert ip_off and not any(ip_off)
    assert ip_on and all(ip_on), ip_on  # every sequence's attention backward wrote dq over its query


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full"])
def test_not_in_place_when_a_reference_loss_keeps_the_query(monkeypatch, recompute):
    """The dense (warm-up) indexer loss runs the chunked reference, whose checkpointed chunks re-read the
    query in the backward: the attention must then leave the query intact (and the gradients equal)."""
    out_off, idx_off, g_off, _ = _run(False, monkeypatch, recompute, 1, dsa_indexer_use_sparse_loss=False)
    out_on, idx_on, g_on, ip_on = _run(True, monkeypatch, recompute, 1, dsa_indexer_use_sparse_loss=False)
    assert torch.equal(out_on, out_off) and torch.equal(idx_on, idx_off)
    for name in g_off:
        assert torch.equal(g_on[name], g_off[name]), f"gradient of {name} differs"
    assert ip_on and not any(ip_on), ip_on


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["fused", "scratch"])
def test_gpu_fused_dq_over_q_bf16(variant):
    """H200, bf16, 16 heads, k 2048: dq written over q equals dq into a new buffer bit for bit (one
    program per row and head block, no atomics on dq; scratch: staged per chunk, then copied)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    T, N, S, topk = 4096, 16, 4096, 2048
    q = torch.randn(T, N, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(S, 576, device="cuda", generator=g).bfloat16()
    idx = torch.argsort(torch.rand(T, S, device="cuda", generator=g), dim=1)[:, :topk].to(torch.int32)
    out, lse = K.sparse_mla_fwd(q, kv, idx, 576 ** -0.5, 512)
    dout = torch.randn(out.shape, device="cuda", generator=g).bfloat16()
    ref_dq, ref_dkv = K.sparse_mla_bwd(q, kv, idx, out, lse, dout, None, 576 ** -0.5, 512, variant=variant)
    q2 = q.clone()
    dq, dkv = K.sparse_mla_bwd(q2, kv, idx, out, lse, dout, None, 576 ** -0.5, 512, dq_over_q=True,
                               variant=variant)
    assert dq.data_ptr() == q2.data_ptr() and torch.equal(dq, ref_dq)
    torch.testing.assert_close(dkv, ref_dkv, rtol=1e-3, atol=1e-3)
