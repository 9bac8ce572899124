"""Megatron's own pipeline schedule (forward_backward_func) with recompute + replay on CPU."""

import pytest
import torch

from hyscale_megatron import replay
from hyscale_megatron.config import HyScaleConfig
from hyscale_megatron.models import build_gpt, mla_dsa_config

pytestmark = pytest.mark.usefixtures("megatron_env")

VOCAB, SEQ, MBS, N_MB = 128, 48, 2, 3


def _run(recompute: dict, replay_on: bool):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hyscale_megatron.env import seed_all

    config = mla_dsa_config(num_layers=3, **recompute)
    seed_all(9)
    model = build_gpt(config, use_hyscale=True, vocab_size=VOCAB,
                      hyscale=HyScaleConfig(topk_impl="reference", attn_impl="reference", replay=replay_on))
    g = torch.Generator().manual_seed(21)
    batches = [torch.randint(0, VOCAB, (MBS, SEQ), generator=g) for _ in range(N_MB)]
    pos = torch.arange(SEQ).expand(MBS, SEQ)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        out = model(tokens, pos, None, labels=tokens.roll(-1, dims=1))

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model], num_microbatches=N_MB,
        seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    stats = replay.store_stats()
    return [l["lm loss"].item() for l in losses], grads, stats


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
], ids=["full-uniform", "full-block", "selective"])
def test_schedule_with_replay_matches_no_recompute(recompute):
    ref_losses, ref_grads, _ = _run({}, replay_on=False)
    before = replay.store_stats()["puts"]
    losses, grads, stats = _run(recompute, replay_on=True)
    assert stats["puts"] > before, "replay was not exercised"
    assert stats["entries"] == 0 and stats["current_bytes"] == 0, "store must be empty after the step"
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for n, g in ref_grads.items():
        assert ((grads[n] - g).norm() / g.norm().clamp_min(1e-12)) < 5e-5, n
