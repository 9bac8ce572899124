"""Small DSA model configs and builders for the tests and the benchmarks."""

from __future__ import annotations

from typing import Optional

import torch

from .config import HyScaleConfig

TINY_DSA = dict(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=16,
    dsa_indexer_n_heads=16, dsa_indexer_head_dim=32, dsa_indexer_topk=8,
    dsa_indexer_loss_coeff=0.01, dsa_indexer_use_sparse_loss=True,
)


def mla_dsa_config(dtype: torch.dtype = torch.float32, **overrides):
    """An ``MLATransformerConfig`` with DSA, set up for the local (non-TE) spec on any device."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: PLC0415

    kw = dict(TINY_DSA)
    kw.update(
        rope_type="rope", normalization="RMSNorm", add_bias_linear=False,
        experimental_attention_variant="dsa", dsa_indexer_rotate_activation=False,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        transformer_impl="local", gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
    )
    kw.update(overrides)
    return MLATransformerConfig(**kw)


def build_gpt(config, use_hyscale: bool, hyscale: Optional[HyScaleConfig] = None, vocab_size: int = 128,
              max_seq: int = 4096, pre_process: bool = True, post_process: bool = True, vp_stage=None):
    """A ``GPTModel`` whose DSA layers are HyScale's (``use_hyscale``) or stock's."""
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415

    from .specs import dsa_block_spec  # noqa: PLC0415

    spec = dsa_block_spec(config, vp_stage=vp_stage, hyscale=hyscale, use_hyscale=use_hyscale)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                     max_sequence_length=max_seq, position_embedding_type="none",
                     pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    if config.params_dtype != torch.float32:
        model = model.to(config.params_dtype)
    return model
