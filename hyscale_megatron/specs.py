"""Layer and block specs for GPT (and HybridModel) with HyScale DSA layers.

Stock builds DSA layers only with Transformer Engine. We reuse stock's spec builders with a
backend provider of our own when TE is absent (``LocalDSASpecProvider``), then swap stock's
``DSAttention`` core for :class:`HyScaleDSAttention` anywhere in the spec tree, and the absorbed-MLA
attention around it for :class:`~hyscale_megatron.mla_up.HyScaleAbsorbedMLA` (the same module with
the up-projection recompute available under full recompute). Parameters and state-dict keys do not
change: the swap touches only those two classes.

For Megatron's ``--spec`` flag (``GPTModelBuilder`` takes a callable ``spec(config, vp_stage)``):

    --spec hyscale_megatron.specs hyscale_block_spec     # HyScale DSA
    --spec hyscale_megatron.specs stock_block_spec       # stock DSA, also without TE
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt import experimental_attention_variant_module_specs as stock_specs
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention
from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from .config import HyScaleConfig, HyScaleConfigError
from .dsa import HyScaleDSAttention
from .mla_up import HyScaleAbsorbedMLA

REQUIRED_DSA_FIELDS = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")


def have_te() -> bool:
    return bool(getattr(stock_specs, "HAVE_TE", False))


class LocalDSASpecProvider(LocalSpecProvider):
    """Stock's local (non-TE) provider plus the plain ``linear()`` that the DSA indexer needs."""

    def linear(self) -> type:
        from megatron.core.post_training.modelopt.layers import Linear  # noqa: PLC0415

        return Linear


def validate_dsa_config(config) -> None:
    """Fail early, naming the field, when the config cannot build DSA layers."""
    if getattr(config, "experimental_attention_variant", None) != "dsa":
        raise HyScaleConfigError(
            "DSA specs need config.experimental_attention_variant='dsa' "
            f"(got {getattr(config, 'experimental_attention_variant', None)!r}; flag --experimental-attention-variant dsa)."
        )
    if not getattr(config, "multi_latent_attention", False):
        raise HyScaleConfigError("DSA layers are MLA layers: use an MLATransformerConfig (flag --multi-latent-attention).")
    for name in REQUIRED_DSA_FIELDS:
        val = getattr(config, name, None)
        if val is None:
            raise HyScaleConfigError(f"DSA config field {name} is missing (flag --{name.replace('_', '-')}).")
        if not isinstance(val, int) or val <= 0:
            raise HyScaleConfigError(f"DSA config field {name} must be a positive int, got {val!r}.")


def backend_for(config, backend: Optional[BackendSpecProvider] = None) -> BackendSpecProvider:
    """TE provider when ``transformer_impl='transformer_engine'`` (TE must be installed), else local."""
    if backend is not None:
        return backend
    impl = getattr(config, "transformer_impl", "transformer_engine")
    if impl == "transformer_engine":
        if not have_te():
            raise HyScaleConfigError(
                "transformer_impl='transformer_engine' was requested but Transformer Engine is not installed; "
                "install it (pip install 'hyscale-megatron[te]') or use the local spec (--transformer-impl local)."
            )
        return stock_specs._get_backend_spec_provider(config)
    return LocalDSASpecProvider()


def _fix_local_down_projections(spec: ModuleSpec) -> ModuleSpec:
    """Stock's absorbed MLA accepts only TELinear/Linear(TE)/ColumnParallelLinear down-projections."""
    sub = spec.submodules
    if sub is None or not hasattr(sub, "linear_q_down_proj"):
        return spec
    sub = dataclasses.replace(sub, linear_q_down_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear)
    return dataclasses.replace(spec, submodules=sub)


def swap_dsa_core(spec, hyscale: HyScaleConfig, _memo=None):
    """Return a copy of ``spec`` where every stock ``DSAttention`` core is HyScale's (and every stock
    ``AbsorbedMLASelfAttention`` is :class:`HyScaleAbsorbedMLA`)."""
    _memo = {} if _memo is None else _memo
    if id(spec) in _memo:
        return _memo[id(spec)]
    out = spec
    if isinstance(spec, ModuleSpec):
        if spec.module is DSAttention:
            out = dataclasses.replace(spec, module=HyScaleDSAttention, params={**spec.params, "hyscale": hyscale})
        else:
            if spec.module is AbsorbedMLASelfAttention:
                out = dataclasses.replace(spec, module=HyScaleAbsorbedMLA, params={**spec.params, "hyscale": hyscale})
            if spec.submodules is not None:
                out = dataclasses.replace(out, submodules=swap_dsa_core(spec.submodules, hyscale, _memo))
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {}
        for f in dataclasses.fields(spec):
            val = getattr(spec, f.name)
            new = swap_dsa_core(val, hyscale, _memo)
            if new is not val:
                changes[f.name] = new
        out = dataclasses.replace(spec, **changes) if changes else spec
    elif isinstance(spec, list):
        new = [swap_dsa_core(s, hyscale, _memo) for s in spec]
        out = new if any(a is not b for a, b in zip(new, spec)) else spec
    _memo[id(spec)] = out
    return out


def count_dsa_cores(spec) -> dict:
    """{'stock': n, 'hyscale': m} core-attention specs in a spec tree (for tests and logs)."""
    counts = {"stock": 0, "hyscale": 0}

    def walk(s, seen):
        if id(s) in seen:
            return
        seen.add(id(s))
        if isinstance(s, ModuleSpec):
            if s.module is HyScaleDSAttention:
                counts["hyscale"] += 1
            elif s.module is DSAttention:
                counts["stock"] += 1
            walk(s.submodules, seen)
        elif dataclasses.is_dataclass(s) and not isinstance(s, type):
            for f in dataclasses.fields(s):
                walk(getattr(s, f.name), seen)
        elif isinstance(s, list):
            for x in s:
                walk(x, set())

    walk(spec, set())
    return counts


def dsa_layer_specs(config, backend: Optional[BackendSpecProvider] = None, hyscale: Optional[HyScaleConfig] = None,
                    use_hyscale: bool = True) -> list:
    """Per-layer specs for all ``config.num_layers`` layers (stock builder, our provider/core)."""
    validate_dsa_config(config)
    backend = backend_for(config, backend)
    specs = stock_specs.get_transformer_layer_with_experimental_attention_variant_spec(config=config, backend=backend)
    if isinstance(backend, LocalSpecProvider):
        specs = [
            dataclasses.replace(s, submodules=dataclasses.replace(
                s.submodules, self_attention=_fix_local_down_projections(s.submodules.self_attention)))
            for s in specs
        ]
    if use_hyscale:
        hyscale = hyscale if hyscale is not None else HyScaleConfig.from_env()
        if hyscale.enabled:
            specs = [swap_dsa_core(s, hyscale) for s in specs]
    return specs


def _local_layer_ids(config, vp_stage, pp_rank):
    from megatron.core.transformer.enums import LayerType  # noqa: PLC0415

    if getattr(config, "pipeline_model_parallel_layout", None) is not None:
        return config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


def dsa_block_spec(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                   backend: Optional[BackendSpecProvider] = None, hyscale: Optional[HyScaleConfig] = None,
                   use_hyscale: bool = True) -> TransformerBlockSubmodules:
    """Decoder block spec for this pipeline stage (mirrors stock's block builder, TE optional)."""
    backend = backend_for(config, backend)
    specs = dsa_layer_specs(config, backend=backend, hyscale=hyscale, use_hyscale=use_hyscale)
    ids = list(_local_layer_ids(config, vp_stage, pp_rank))
    stock_specs._validate_dsa_index_share_pipeline_split(config, ids)
    rms = config.normalization == "RMSNorm"
    return TransformerBlockSubmodules(layer_specs=[specs[i] for i in ids],
                                      layer_norm=backend.layer_norm(rms_norm=rms, for_qk=False))


def hyscale_block_spec(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """``--spec hyscale_megatron.specs hyscale_block_spec``: HyScale DSA decoder block."""
    from . import runtime  # noqa: PLC0415

    return dsa_block_spec(config, vp_stage=vp_stage, pp_rank=pp_rank, hyscale=runtime.current_config())


def stock_block_spec(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """``--spec hyscale_megatron.specs stock_block_spec``: stock DSA decoder block (TE optional)."""
    return dsa_block_spec(config, vp_stage=vp_stage, pp_rank=pp_rank, use_hyscale=False)


def hyscale_hybrid_stack_spec(hyscale: Optional[HyScaleConfig] = None):
    """Stock ``HybridModel`` stack spec (TE) whose ``D`` (DSA) layers use HyScale's core attention."""
    from megatron.core.models.hybrid import hybrid_layer_specs  # noqa: PLC0415

    return swap_dsa_core(hybrid_layer_specs.hybrid_stack_spec, hyscale or HyScaleConfig.from_env())
