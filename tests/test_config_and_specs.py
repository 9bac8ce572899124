"""Configuration, flags, spec building and patch mechanics: clear errors for bad input."""

import argparse
import types

import pytest

from hyscale_megatron.config import HyScaleConfig, HyScaleConfigError, config_table_markdown


def test_config_defaults_and_validation():
    cfg = HyScaleConfig()
    assert cfg.enabled and cfg.replay and cfg.topk_impl == "auto"
    with pytest.raises(HyScaleConfigError, match="topk_impl='cuda'.*auto, triton, reference"):
        HyScaleConfig(topk_impl="cuda")
    with pytest.raises(HyScaleConfigError, match="replay_offload=True needs replay=True"):
        HyScaleConfig(replay=False, replay_offload=True)
    with pytest.raises(HyScaleConfigError, match="must be a bool"):
        HyScaleConfig(replay="yes")
    assert HyScaleConfig().loss_tp_split is False and HyScaleConfig(loss_tp_split=True).loss_tp_split
    with pytest.raises(HyScaleConfigError, match="loss_tp_split=True splits the deferred loss.*loss_target='forward'"):
        HyScaleConfig(loss_tp_split=True, loss_target="forward")


def test_config_from_env_and_flags():
    env = {"HYSCALE_REPLAY": "off", "HYSCALE_TOPK_IMPL": "reference"}
    cfg = HyScaleConfig.from_env(env)
    assert cfg.replay is False and cfg.topk_impl == "reference"
    with pytest.raises(HyScaleConfigError, match="HYSCALE_REPLAY='maybe'"):
        HyScaleConfig.from_env({"HYSCALE_REPLAY": "maybe"})
    from hyscale_megatron.arguments import add_hyscale_args, hyscale_config_from_args

    parser = add_hyscale_args(argparse.ArgumentParser())
    args = parser.parse_args(["--no-hyscale", "--hyscale-attn-impl", "reference", "--hyscale-replay-offload"])
    cfg = hyscale_config_from_args(args)
    assert cfg.enabled is False and cfg.attn_impl == "reference" and cfg.replay_offload is True
    assert cfg.replay_prefetch is True  # the default
    cfg = hyscale_config_from_args(parser.parse_args(["--hyscale-replay-offload", "--no-hyscale-replay-prefetch"]))
    assert cfg.replay_offload is True and cfg.replay_prefetch is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--hyscale-topk-impl", "fast"])
    cfg = hyscale_config_from_args(parser.parse_args(["--hyscale-loss-tp-split"]))
    assert cfg.loss_tp_split is True
    assert HyScaleConfig.from_env({"HYSCALE_LOSS_TP_SPLIT": "1"}).loss_tp_split is True
    table = config_table_markdown()
    assert "--hyscale-replay-offload" in table and "HYSCALE_TOPK_IMPL" in table and "HYSCALE_LOSS_TP_SPLIT" in table


def _ns(**kw):
    base = dict(experimental_attention_variant="dsa", multi_latent_attention=True, dsa_indexer_n_heads=4,
                dsa_indexer_head_dim=32, dsa_indexer_topk=8, transformer_impl="local")
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("field,value,match", [
    ("experimental_attention_variant", None, "experimental_attention_variant='dsa'"),
    ("multi_latent_attention", False, "MLA layers"),
    ("dsa_indexer_topk", None, "dsa_indexer_topk is missing"),
    ("dsa_indexer_topk", 0, "dsa_indexer_topk must be a positive int"),
    ("dsa_indexer_n_heads", -4, "dsa_indexer_n_heads must be a positive int"),
])
def test_dsa_config_errors_name_the_field(field, value, match):
    from hyscale_megatron.specs import validate_dsa_config

    validate_dsa_config(_ns())
    with pytest.raises(HyScaleConfigError, match=match):
        validate_dsa_config(_ns(**{field: value}))


def test_te_requested_but_absent():
    from hyscale_megatron import specs

    if specs.have_te():
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(HyScaleConfigError, match="Transformer Engine is not installed.*--transformer-impl local"):
        specs.backend_for(_ns(transformer_impl="transformer_engine"))
    assert isinstance(specs.backend_for(_ns()), specs.LocalDSASpecProvider)


@pytest.mark.usefixtures("megatron_env")
def test_specs_swap_only_the_core_attention():
    from hyscale_megatron.models import mla_dsa_config
    from hyscale_megatron.specs import count_dsa_cores, dsa_block_spec, dsa_layer_specs

    cfg = mla_dsa_config(num_layers=3)
    stock = dsa_layer_specs(cfg, use_hyscale=False)
    ours = dsa_layer_specs(cfg, hyscale=HyScaleConfig())
    assert count_dsa_cores(stock) == {"stock": 3, "hyscale": 0}
    assert count_dsa_cores(ours) == {"stock": 0, "hyscale": 3}
    off = dsa_layer_specs(cfg, hyscale=HyScaleConfig(enabled=False))
    assert count_dsa_cores(off) == {"stock": 3, "hyscale": 0}
    block = dsa_block_spec(cfg, hyscale=HyScaleConfig())
    assert len(block.layer_specs) == 3


def test_hybrid_model_dsa_layers_are_swapped():
    """HybridModel's stack spec (its 'D' layers are DSA) gets the same core swap."""
    try:
        from megatron.core.models.hybrid import hybrid_layer_specs
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"hybrid specs need Transformer Engine here: {exc}")
    from hyscale_megatron.specs import count_dsa_cores, hyscale_hybrid_stack_spec

    assert count_dsa_cores(hybrid_layer_specs.hybrid_stack_spec)["stock"] >= 1
    swapped = hyscale_hybrid_stack_spec(HyScaleConfig())
    counts = count_dsa_cores(swapped)
    assert counts["stock"] == 0 and counts["hyscale"] >= 1
    assert count_dsa_cores(hybrid_layer_specs.hybrid_stack_spec)["hyscale"] == 0, "stock spec must be untouched"


def test_patches_are_idempotent_and_reversible():
    from megatron.core.transformer.experimental_attention_variant import dsa

    from hyscale_patches import dsa_dispatch

    dsa_dispatch.apply()
    first = dsa.fused_qk_topk_naive
    dsa_dispatch.apply()
    assert dsa.fused_qk_topk_naive is first, "second apply must be a no-op"
    dsa_dispatch.revert()
    assert dsa.fused_qk_topk_naive is dsa_dispatch.PATCHES[0]._original
    dsa_dispatch.apply()
    assert dsa.fused_qk_topk_naive.__wrapped__ is dsa_dispatch.PATCHES[0]._original


def test_patch_on_missing_symbol_names_it():
    from hyscale_patches._base import MegatronPatchError, Patch

    p = Patch("probe", "megatron.core.transformer.experimental_attention_variant.dsa", "no_such_fn", lambda o: o)
    with pytest.raises(MegatronPatchError, match=r"dsa\.no_such_fn is missing.*megatron-core>=0\.19\.2,<0\.20"):
        p.apply()


def test_megatron_version_check():
    from hyscale_patches._base import check_megatron_version

    assert check_megatron_version().startswith("0.19")


def test_ops_exports():
    from hyscale_megatron import ops

    for name in ops.__all__:
        assert callable(getattr(ops, name)), name
    with pytest.raises(AttributeError, match="not_an_op"):
        ops.not_an_op  # noqa: B018


def test_package_exports():
    import hyscale_megatron

    assert hyscale_megatron.__version__
    for name in hyscale_megatron.__all__:
        assert getattr(hyscale_megatron, name) is not None, name
