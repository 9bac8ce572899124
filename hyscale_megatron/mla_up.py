"""Absorbed MLA whose up-projection outputs are discarded and recomputed under full recompute.

Megatron's ``mla_up_proj`` recompute (``tensor_parallel.CheckpointWithoutOutput``) frees the absorbed
query [s, b, np, 576] and latent key [s, b, 1, 576] right after the core attention and rebuilds them
from the compressed query / latent when the attention output's gradient arrives. Stock enables it only
for ``--recompute-granularity selective``. Under full recompute the whole layer is re-run before its
backward, so the recomputed attention's inputs stay alive through the MLP backward, where the layer's
peak is (docs/memory.md): 18 KB/token of absorbed query alone at 16 heads. This subclass turns
the same mechanism on inside the recomputed (grad-enabled) forward only; the first, no-grad forward of
full recompute saves nothing anyway (and a grad hook could not be registered there).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention

from ._log import log_once
from .config import HyScaleConfig

logger = logging.getLogger(__name__)


class HyScaleAbsorbedMLA(AbsorbedMLASelfAttention):
    """Stock ``AbsorbedMLASelfAttention`` plus ``hyscale`` (a :class:`HyScaleConfig`); with
    ``hyscale.mla_up_proj_recompute`` and full recompute, the up-projection outputs are recomputed."""

    def __init__(self, *args, hyscale: Optional[HyScaleConfig] = None, **kwargs):
        super().__init__(*args, **kwargs)
        hyscale = hyscale if hyscale is not None else HyScaleConfig.from_env()
        cfg = self.config
        quant = bool(getattr(cfg, "fp8", None) or getattr(cfg, "fp4", None))
        self._up_recompute_full = (hyscale.mla_up_proj_recompute and cfg.recompute_granularity == "full"
                                   and not quant and not self.cache_mla_latents)
        if hyscale.mla_up_proj_recompute and cfg.recompute_granularity == "full" and not self._up_recompute_full:
            log_once("mla-up-off", "hyscale: MLA up-projection recompute is off for this layer (FP8/FP4 or "
                     "cache_mla_latents, which Megatron's mla_up_proj recompute does not support)")
        elif self._up_recompute_full:
            log_once("mla-up-on", "hyscale: full recompute also discards and recomputes the MLA up-projection "
                     "outputs (--no-hyscale-mla-up-proj-recompute to keep them)")

    def forward(self, *args, **kwargs):
        if self._up_recompute_full:
            # only the grad-enabled (recomputing) forward keeps activations worth discarding
            self.recompute_up_proj = torch.is_grad_enabled()
        return super().forward(*args, **kwargs)
