"""Selection replay: recompute reuses the forward's top-k, per (layer, microbatch), under any order."""

import pytest
import torch

from hyscale_megatron import replay, selection
from hyscale_megatron.config import HyScaleConfig
from hyscale_megatron.models import build_gpt, mla_dsa_config

pytestmark = pytest.mark.usefixtures("megatron_env")

VOCAB, SEQ, BATCH = 128, 40, 2
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
SELECTIVE = dict(recompute_granularity="selective", recompute_modules=["core_attn"])


def _build(use_hyscale, replay_on=True, seed=7, **cfg):
    from hyscale_megatron.env import seed_all

    config = mla_dsa_config(**cfg)
    seed_all(seed)
    hs = HyScaleConfig(topk_impl="reference", attn_impl="reference", replay=replay_on)
    return build_gpt(config, use_hyscale=use_hyscale, hyscale=hs, vocab_size=VOCAB)


def _tokens(seed):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _fwd(model, tokens):
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, pos, None, labels=tokens.roll(-1, dims=1)).float().mean()


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_rel(g1, g2):
    return max(((g1[n] - g2[n]).norm() / g2[n].norm().clamp_min(1e-12)).item() for n in g2 if g2[n].norm() > 0)


@pytest.fixture
def count_selection(monkeypatch):
    calls = {"hyscale": 0, "stock": 0}
    orig_rows = selection.select_rows

    def rows(*a, **k):
        calls["hyscale"] += 1
        return orig_rows(*a, **k)

    monkeypatch.setattr(selection, "select_rows", rows)
    from hyscale_patches import dsa_dispatch

    stock_topk = dsa_dispatch.PATCHES[0]
    dsa_dispatch.apply()
    orig_stock = stock_topk._original

    def stock(*a, **k):
        calls["stock"] += 1
        return orig_stock(*a, **k)

    monkeypatch.setattr(stock_topk, "_original", stock)
    # the dispatcher closes over the original: rebuild it around the counting wrapper
    stock_topk.revert()
    monkeypatch.setattr(stock_topk, "make", lambda _o, make=stock_topk.make: make(stock))
    stock_topk.apply()
    yield calls
    stock_topk.revert()
    monkeypatch.undo()
    dsa_dispatch.apply()


@pytest.mark.parametrize("recompute", [FULL, SELECTIVE], ids=["full", "selective"])
@pytest.mark.parametrize("loss_coeff", [0.0, 0.01], ids=["noloss", "sparse_loss"])
def test_recompute_runs_no_selection_with_replay(count_selection, recompute, loss_coeff):
    calls = count_selection
    tokens = _tokens(1)
    stock = _build(False, dsa_indexer_loss_coeff=loss_coeff, **recompute)
    _fwd(stock, tokens).backward()
    stock_calls = calls["stock"]
    assert stock_calls == 2 * 2, "stock selects in the forward and again in the recompute (2 layers)"
    for replay_on, expected in ((True, 2 * BATCH), (False, 2 * 2 * BATCH)):
        calls["hyscale"] = 0
        model = _build(True, replay_on=replay_on, dsa_indexer_loss_coeff=loss_coeff, **recompute)
        loss = _fwd(model, tokens)
        after_forward = calls["hyscale"]
        loss.backward()
        assert after_forward == 2 * BATCH
        assert calls["hyscale"] == expected, (replay_on, calls)
        assert len(replay.get_store()) == 0, "store must be empty after the backward"


@pytest.mark.parametrize("recompute", [FULL, SELECTIVE], ids=["full", "selective"])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_replay_gradients_equal_no_recompute(recompute, sparse):
    tokens = _tokens(2)
    ref = _build(True, replay_on=False, dsa_indexer_use_sparse_loss=sparse)
    _fwd(ref, tokens).backward()
    model = _build(True, replay_on=True, dsa_indexer_use_sparse_loss=sparse, **recompute)
    _fwd(model, tokens).backward()
    assert _max_rel(_grads(model), _grads(ref)) < 5e-5
    assert len(replay.get_store()) == 0


ORDERS = {"F1F2B2B1": (1, 0), "F1F2B1B2": (0, 1)}


def _interleaved(model, order, tokens):
    losses = [_fwd(model, t) for t in tokens]
    for i in order:
        losses[i].backward()
    return _grads(model)


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("index_share", [False, True], ids=["plain", "indexshare"])
@pytest.mark.parametrize("recompute", [FULL, SELECTIVE], ids=["full", "selective"])
def test_microbatches_in_flight_get_their_own_indices(order, index_share, recompute):
    share = dict(dsa_indexer_topk_freq=2) if index_share else {}
    tokens = [_tokens(3), _tokens(4)]
    ref = _build(True, replay_on=False, num_layers=4, **share)
    g_ref = _interleaved(ref, ORDERS[order], tokens)
    model = _build(True, replay_on=True, num_layers=4, **share, **recompute)
    g = _interleaved(model, ORDERS[order], tokens)
    assert _max_rel(g, g_ref) < 5e-5
    assert len(replay.get_store()) == 0


def test_stock_index_share_is_wrong_with_microbatches_in_flight():
    """Stock keeps shared indices on the config: mb1's recompute reads mb2's selection."""
    tokens = [_tokens(3), _tokens(4)]
    share = dict(dsa_indexer_topk_freq=2, num_layers=4)
    ref = _build(False, **share)
    g_ref = _interleaved(ref, ORDERS["F1F2B1B2"], tokens)
    stock = _build(False, **share, **FULL)
    g_stock = _interleaved(stock, ORDERS["F1F2B1B2"], tokens)
    ours = _build(True, replay_on=True, **share, **FULL)
    g_ours = _interleaved(ours, ORDERS["F1F2B1B2"], tokens)
    assert _max_rel(g_stock, g_ref) > 1e-3, "expected stock's shared holder to give wrong gradients"
    assert _max_rel(g_ours, g_ref) < 5e-5


def test_forced_mismatch_raises():
    store = replay.ReplayStore()
    idx = torch.arange(12, dtype=torch.int32).view(1, 3, 4)
    fp = replay.fingerprint(torch.ones(3, 5))
    store.put((1, 0), idx, fp, pending=1, sk=100)
    with pytest.raises(replay.ReplayMismatchError, match="fingerprint"):
        store.read((1, 0), fp=replay.fingerprint(torch.zeros(3, 5)))
    store.put((1, 1), idx, fp, pending=1, sk=100)
    with pytest.raises(replay.ReplayMismatchError, match="shape"):
        store.read((1, 1), fp=fp, shape=(1, 4, 4))
    with pytest.raises(replay.ReplayMismatchError, match="no entry"):
        store.read((2, 0), fp=fp)
    store.put((3, 0), idx, fp, pending=2, sk=100)
    assert torch.equal(store.read((3, 0), fp=fp, shape=(1, 3, 4)), idx)
    assert len(store) == 1 and store.current_bytes == idx.numel() * 2  # int16 storage
    assert torch.equal(store.read((3, 0), fp=fp), idx)
    assert len(store) == 0 and store.current_bytes == 0 and store.peak_bytes == idx.numel() * 2


def test_tampered_recompute_inputs_raise():
    """If the recomputed indexer inputs differ from the forward's, replay refuses."""
    model = _build(True, replay_on=True, **FULL)
    loss = _fwd(model, _tokens(5))
    for p in model.parameters():
        p.data.add_(0.05)  # recompute now sees different activations (bypasses autograd's version check)
    with pytest.raises(replay.ReplayMismatchError, match="fingerprint"):
        loss.backward()
    replay.get_store().clear(warn=False)


@pytest.mark.parametrize("prefetch", [True, False])
def test_layer_passes_replay_prefetch_to_the_store(monkeypatch, prefetch):
    """--[no-]hyscale-replay-prefetch reaches every replayed read of a full-recompute backward."""
    seen = []
    orig = replay.ReplayStore.read

    def read(self, key, fp, shape=None, prefetch_next=True):
        seen.append(prefetch_next)
        return orig(self, key, fp, shape=shape, prefetch_next=prefetch_next)

    monkeypatch.setattr(replay.ReplayStore, "read", read)
    model = _build(True, **FULL)
    for layer in model.decoder.layers:
        attn = layer.self_attention.core_attention
        attn.hyscale = attn.hyscale.replace(replay_prefetch=prefetch)
    _fwd(model, _tokens(3)).backward()
    assert seen == [prefetch] * len(model.decoder.layers), seen  # one entry per (layer, microbatch)


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [True, False])
def test_offloaded_entries_round_trip_on_gpu(prefetch):
    store = replay.ReplayStore()
    idx = torch.randint(0, 70000, (1, 64, 32), device="cuda", dtype=torch.int32)
    fp = replay.fingerprint(idx.float())
    for layer in (1, 2):
        store.put((layer, 0), idx + layer, fp, pending=1, offload=True, sk=70000)
    assert store.current_bytes == 0 and store.host_bytes == 2 * idx.numel() * 4
    out2 = store.read((2, 0), fp=fp, prefetch_next=prefetch)  # prefetches (1, 0) unless told not to
    assert (store._entries[(1, 0)].prefetched is not None) == prefetch
    out1 = store.read((1, 0), fp=fp)
    assert torch.equal(out2, idx + 2) and torch.equal(out1, idx + 1) and out1.is_cuda
    assert len(store) == 0 and store.host_bytes == 0


def test_te_checkpoint_is_wrapped_with_regions(monkeypatch):
    """Under FP8/FP4 Megatron recomputes through TE's checkpoint (megatron.core.recompute.te_checkpoint);
    with TE installed our wrapper must give it the same forward/recompute regions."""
    import megatron.core.recompute as rc

    from hyscale_patches import checkpoint_hooks

    seen = []

    def fake_te_checkpoint(function, distribute_saved_activations, get_rng_state_tracker, tp_group, *args):
        out = function(*args)  # original forward
        function(*args)  # what TE's backward does: re-run
        return out

    def body(x):
        region = checkpoint_hooks.current_region()
        seen.append((region.phase, region.will_recompute, region.id))
        return x * 2

    monkeypatch.setattr(rc, "te_checkpoint", fake_te_checkpoint)
    checkpoint_hooks.TE_PATCH.revert()
    checkpoint_hooks.TE_PATCH._applied = None
    checkpoint_hooks.apply()
    try:
        x = torch.ones(3, requires_grad=True)
        y = rc.te_checkpoint(body, False, None, None, x)
        assert torch.equal(y, x * 2)
        assert [s[:2] for s in seen] == [("forward", True), ("recompute", True)]
        assert seen[0][2] == seen[1][2], "both passes share one region"
        assert rc.te_checkpoint.__wrapped__ is fake_te_checkpoint
    finally:
        checkpoint_hooks.TE_PATCH.revert()
