"""Full recompute + HyScale: the absorbed-MLA up-projection outputs are discarded after the core
attention of the recomputed forward and rebuilt when the attention backward starts
(``hyscale_megatron.mla_up.HyScaleAbsorbedMLA``, flag ``--[no-]hyscale-mla-up-proj-recompute``).
The first step is bit-identical with and without it (later steps up to gradient summation order);
the discarded storages are really released."""

import math

import pytest
import torch
from megatron.core.tensor_parallel import random as tp_random

from hyscale_megatron.tools import train
from hyscale_megatron.config import HyScaleConfig, HyScaleConfigError
from hyscale_megatron.mla_up import HyScaleAbsorbedMLA
from hyscale_megatron.specs import swap_dsa_core

from test_train import FAST, TINY, _unset_megatron_globals  # noqa: F401  (fixture)


def _run(tmp_path, name, flags):
    args = train.parse_train_args([TINY, *FAST, "--train-iters", "3", "--hyscale", *flags,
                                   "--hyscale-metrics-file", str(tmp_path / f"{name}.jsonl")])
    return train.run_core_loop(args)


def test_up_projection_recompute_is_exact_and_frees_storage(tmp_path, monkeypatch):
    events = []
    real = tp_random.CheckpointWithoutOutput.discard_output_and_register_recompute

    def spy(self, hook_tensor):
        outs = self.outputs
        real(self, hook_tensor)
        events.append([o.untyped_storage().size() for o in outs])

    monkeypatch.setattr(tp_random.CheckpointWithoutOutput, "discard_output_and_register_recompute", spy)
    on = _run(tmp_path, "on", [])
    n_on = len(events)
    off = _run(tmp_path, "off", ["--no-hyscale-mla-up-proj-recompute"])
    assert len(events) == n_on, "the flag must switch the recompute off"
    # tiny config: 2 layers x 3 iterations, full recompute -> one discard per recomputed layer forward
    assert n_on == 2 * 3, n_on
    assert all(size == 0 for ev in events for size in ev), "discarded outputs must release their storage"
    # iteration 1 is bit-identical; later ones may differ in the last bits: the compressed query's
    # gradient sums the up-projection and indexer contributions in another order
    assert on[0]["lm_loss"] == off[0]["lm_loss"] and on[0]["indexer_loss"] == off[0]["indexer_loss"]
    assert [r["lm_loss"] for r in on] == pytest.approx([r["lm_loss"] for r in off], rel=1e-6)
    # the KL is ~2e-6 here (a small difference of O(1) terms): relative noise is amplified
    assert [r["indexer_loss"] for r in on] == pytest.approx([r["indexer_loss"] for r in off], rel=1e-3)
    assert all(math.isfinite(r["lm_loss"]) for r in on)


def test_spec_swap_and_config():
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    cfg = HyScaleConfig(mla_up_proj_recompute=False)
    spec = ModuleSpec(module=AbsorbedMLASelfAttention, params={"x": 1})
    out = swap_dsa_core(spec, cfg)
    assert out.module is HyScaleAbsorbedMLA and out.params == {"x": 1, "hyscale": cfg}
    assert spec.module is AbsorbedMLASelfAttention, "the input spec is not modified"
    with pytest.raises(HyScaleConfigError, match="mla_up_proj_recompute must be a bool"):
        HyScaleConfig(mla_up_proj_recompute="yes")
    assert HyScaleConfig.from_env({"HYSCALE_MLA_UP_PROJ_RECOMPUTE": "0"}).mla_up_proj_recompute is False
    assert torch.is_grad_enabled()
