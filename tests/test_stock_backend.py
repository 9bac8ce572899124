"""HyScale kernels selected through stock Megatron's dsa_kernel_backend hook mechanism."""

import pytest
import torch

from hyscale_megatron.models import build_gpt, mla_dsa_config

pytestmark = pytest.mark.usefixtures("megatron_env")


def test_register_is_idempotent_and_accepted_by_megatron():
    from megatron.core import utils as core_utils
    from megatron.core.transformer.experimental_attention_variant import dsa_kernels

    from hyscale_megatron import stock_backend
    from hyscale_patches.dsa_backend_registry import register_backend

    stock_backend.register()
    assert register_backend("hyscale", "hyscale_megatron.stock_backend") is False
    assert "hyscale" in core_utils._VALID_DSA_KERNEL_BACKENDS
    assert dsa_kernels._BACKEND_MODULE_NAME_BY_BACKEND["hyscale"] == "hyscale_megatron.stock_backend"


def test_stock_dsattention_with_hyscale_backend_matches_default(monkeypatch):
    """Stock DSAttention, backend 'hyscale' (HyTopK + sparse MLA hooks) vs backend 'none'."""
    from hyscale_megatron import stock_backend
    from hyscale_megatron.env import seed_all

    stock_backend.register()
    calls = {"topk": 0, "attn": 0}
    topk_hook, attn_hook = stock_backend.run_fused_qk_topk, stock_backend.run_fused_absorbed_sparse_attention

    def counting_topk(**kw):
        calls["topk"] += 1
        return topk_hook(**kw)

    def counting_attn(*a, **kw):
        calls["attn"] += 1
        return attn_hook(*a, **kw)

    monkeypatch.setattr(stock_backend, "run_fused_qk_topk", counting_topk)
    monkeypatch.setattr(stock_backend, "run_fused_absorbed_sparse_attention", counting_attn)
    cfg = mla_dsa_config(num_layers=2, dsa_indexer_loss_coeff=0.0)
    tokens = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(24).expand(1, 24)
    outs = {}
    for backend in ("none", "hyscale"):
        seed_all(5)
        model = build_gpt(cfg, use_hyscale=False, vocab_size=128)
        model.config.dsa_kernel_backend = backend  # set after init: stock's check wants CUDA for non-'none'
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.config.dsa_kernel_backend = backend
        loss = model(tokens, pos, None, labels=tokens.roll(-1, 1)).float().mean()
        loss.backward()
        outs[backend] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        cfg.dsa_kernel_backend = "none"
    assert calls["topk"] == 2 and calls["attn"] == 2
    assert outs["hyscale"][0] == pytest.approx(outs["none"][0], rel=1e-5)
    for n, g in outs["none"][1].items():
        assert ((outs["hyscale"][1][n] - g).norm() / g.norm().clamp_min(1e-12)) < 1e-4, n
