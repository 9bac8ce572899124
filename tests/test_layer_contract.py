"""The layer contract: wherever stock ``DSAttention`` runs, ``HyScaleDSAttention`` runs and gives the same
results -- outputs, the logged indexer loss and every gradient (inputs and parameters), fp32 to round-off
and bf16 within bf16 tolerance -- for the inputs stock's own layer tests feed it: per-head (non-absorbed)
and absorbed-MLA inputs, dense and sparse indexer loss, training and eval, packed THD sequences,
IndexShare, and impls the kernels cannot take (a stock fallback with our selection)."""

import dataclasses
import logging

import pytest
import torch

import _layer_harness as H
from hyscale_megatron.config import HyScaleConfig

pytestmark = pytest.mark.usefixtures("megatron_env")

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _compare(cfg, absorbed, train=True, hyscale=None, layers=(1,), **inp_kw):
    stock, ours = H.cores(cfg, hyscale=hyscale, layers=layers)
    inp = H.inputs(cfg, absorbed, **inp_kw)
    want = H.run(stock, inp, train=train)
    got = H.run(ours, inp, train=train)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("loss", ["sparse", "dense", "off"])
@pytest.mark.parametrize("absorbed", [False, True], ids=["per_head", "absorbed"])
def test_training_step_matches_stock(absorbed, loss, dtype):
    cfg = H.config(dtype, dsa_indexer_use_sparse_loss=loss == "sparse",
                   dsa_indexer_loss_coeff=0.0 if loss == "off" else 1.0)
    got, want = _compare(cfg, absorbed)
    if loss != "off":
        assert want["loss"] is not None and (want["loss"][0] > 0), "stock logged no indexer loss"
        assert any(".indexer." in n and g.norm() > 0 for n, g in want["grads"].items())
    H.assert_same(got, want, TOL[dtype], f"{'absorbed' if absorbed else 'per-head'} {loss} loss")


@pytest.mark.parametrize("absorbed", [False, True], ids=["per_head", "absorbed"])
def test_eval_forward_matches_stock(absorbed):
    cfg = H.config()
    got, want = _compare(cfg, absorbed, train=False)
    assert want["loss"] is None
    H.assert_same(got, want, TOL[torch.float32], "eval")


@pytest.mark.parametrize("loss", ["sparse", "dense"])
@pytest.mark.parametrize("absorbed", [False, True], ids=["per_head", "absorbed"])
def test_packed_thd_matches_stock(absorbed, loss):
    """Three packed sequences of odd lengths (one shorter than top-k, one longer)."""
    cfg = H.config(dsa_indexer_use_sparse_loss=loss == "sparse", dsa_indexer_topk=8)
    got, want = _compare(cfg, absorbed, seqlens=[5, 11, 3])
    H.assert_same(got, want, TOL[torch.float32], f"packed THD {loss}")


@pytest.mark.parametrize("loss", ["sparse", "dense"])
@pytest.mark.parametrize("absorbed", [False, True], ids=["per_head", "absorbed"])
def test_explicit_attention_mask_matches_stock(absorbed, loss):
    """An additive float mask [b, 1, s, s]: causal, and in the second sequence keys 3-5 hidden from every row
    (the general-mask selection path; the dense stage's loss then runs stock's own, with our selection)."""
    cfg = H.config(dsa_indexer_use_sparse_loss=loss == "sparse", dsa_indexer_topk=8)
    s, b = 16, 2
    mask = torch.triu(torch.full((b, 1, s, s), float("-inf")), diagonal=1)
    mask[1, :, 6:, 3:6] = float("-inf")
    stock, ours = H.cores(cfg)
    inp = H.inputs(cfg, absorbed, s=s, b=b)
    inp.attention_mask = mask
    H.assert_same(H.run(ours, inp), H.run(stock, inp), TOL[torch.float32], f"explicit mask {loss}")


@pytest.mark.parametrize("absorbed", [False, True], ids=["per_head", "absorbed"])
def test_index_share_matches_stock(absorbed):
    """dsa_indexer_topk_freq 2: layer 2 reads layer 1's selection (HyScale serves it from its
    (layer, microbatch) store, stock from the attention mask / config object)."""
    from hyscale_megatron import replay

    cfg = H.config(dsa_indexer_topk_freq=2, dsa_indexer_topk=8)
    got, want = _compare(cfg, absorbed, layers=(1, 2))
    H.assert_same(got, want, TOL[torch.float32], "IndexShare")
    assert len(replay.get_store()) == 0, "a shared selection was left in the store"


def test_kernel_path_matches_stock():
    """The Triton kernels (interpreter on CPU) on absorbed inputs, sparse loss, two sequences."""
    cfg = H.config(dsa_indexer_use_sparse_loss=True, dsa_indexer_topk=8)
    hy = HyScaleConfig(topk_impl="triton", attn_impl="triton")
    got, want = _compare(cfg, True, hyscale=hy, s=12)
    H.assert_same(got, want, 1e-4, "kernel path")


@pytest.mark.parametrize("loss", ["sparse", "dense"])
def test_stock_fallback_runs_with_the_override_installed(loss, caplog):
    """Per-head inputs take stock's loss and attention while HyScale's override is active: stock must see
    stock's answers there (its loss reads the score table next to the indices), with HyScale's selection
    underneath, and the fallback is logged."""
    from hyscale_patches import dsa_dispatch

    cfg = H.config(dsa_indexer_use_sparse_loss=loss == "sparse")
    stock, ours = H.cores(cfg)
    seen = []
    orig = ours[0].hyscale
    inp = H.inputs(cfg, absorbed=False)
    with caplog.at_level(logging.INFO):
        want = H.run(stock, inp)
        # the override really is active for stock's fallback calls
        import hyscale_megatron.dsa as hdsa

        real = hdsa._Compute.qk_topk

        def spy(self, *a, **kw):
            seen.append(self.in_stock_loss)
            return real(self, *a, **kw)

        hdsa._Compute.qk_topk = spy
        try:
            got = H.run(ours, inp)
        finally:
            hdsa._Compute.qk_topk = real
    assert orig.enabled and dsa_dispatch.PATCHES[0].applied
    assert seen and all(seen), "stock's loss did not reach HyScale's selection"
    H.assert_same(got, want, TOL[torch.float32], f"fallback {loss}")


def test_unsupported_index_head_dim_falls_back_with_one_log_line(caplog):
    """An index head dim HyTopK does not take (40) with topk_impl='auto': the layer logs it once and selects
    with the reference, as stock takes any head dim; with topk_impl='triton' it refuses at construction."""
    from hyscale_megatron.config import HyScaleConfigError

    from hyscale_megatron import _log

    cfg = H.config(dsa_indexer_head_dim=40, dsa_indexer_topk=8)
    _log._seen.discard("topk-shape")
    with caplog.at_level(logging.INFO, logger="hyscale_megatron"):
        got, want = _compare(cfg, True, hyscale=HyScaleConfig(topk_impl="auto", attn_impl="reference"))
    H.assert_same(got, want, TOL[torch.float32], "D_I 4")
    assert sum("dsa_indexer_head_dim=40" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(HyScaleConfigError, match="dsa_indexer_head_dim"):
        H.cores(cfg, hyscale=HyScaleConfig(topk_impl="triton"))


def test_topk_beyond_the_kernels_is_refused_or_logged(caplog):
    """top-k 4096 (> 2048, the kernels' limit): 'triton' impls refuse at construction, naming the field."""
    from hyscale_megatron.config import HyScaleConfigError

    cfg = H.config(dsa_indexer_topk=4096)
    with pytest.raises(HyScaleConfigError, match="dsa_indexer_topk=4096"):
        H.cores(cfg, hyscale=HyScaleConfig(topk_impl="triton", attn_impl="reference"))
    with pytest.raises(HyScaleConfigError, match="attn_impl='triton'"):
        H.cores(cfg, hyscale=HyScaleConfig(topk_impl="reference", attn_impl="triton"))
    stock, ours = H.cores(cfg, hyscale=HyScaleConfig(topk_impl="auto", attn_impl="auto"))
    assert not ours[0].attn_kernels_ok


# --- tensor and context parallelism (two gloo processes) ---------------------------------------------

# (name, tp, sequence parallel, cp, absorbed, loss stage; "-kernels": HyTopK and sparse MLA in the Triton
# interpreter, else the references). Under sequence parallelism stock refuses the
# indexer loss when TP ranks own different query rows; here the query keeps the full rows (MLA gathers them).
PARALLEL_CASES = [
    ("tp2-sp-absorbed-sparse", 2, True, 1, True, "sparse"),
    ("tp2-sp-per_head-dense", 2, True, 1, False, "dense"),
    ("tp2-absorbed-dense", 2, False, 1, True, "dense"),
    ("cp2-absorbed-sparse", 1, False, 2, True, "sparse"),
    ("cp2-per_head-sparse", 1, False, 2, False, "sparse"),
    ("cp2-absorbed-dense", 1, False, 2, True, "dense"),
    ("cp2-absorbed-sparse-kernels", 1, False, 2, True, "sparse"),
]


def _parallel_worker(rank, init_file, result_file):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        from megatron.core import parallel_state

        from hyscale_patches import cpu_compat

        cpu_compat.apply()
        results = {}
        for name, tp, sp, cp, absorbed, loss in PARALLEL_CASES:
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
            cfg = H.config(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp, cp_comm_type="allgather",
                           dsa_indexer_use_sparse_loss=loss == "sparse", dsa_indexer_topk=8)
            # torch's norm (no Transformer Engine here) refuses sequence_parallel at construction; the
            # indexer's k-norm acts per row, so build without it and run with it
            hy = HyScaleConfig(topk_impl="triton", attn_impl="triton") if name.endswith("kernels") else None
            stock, ours = H.cores(dataclasses.replace(cfg, sequence_parallel=False), hyscale=hy,
                                  cp_comm_type="allgather" if cp > 1 else "p2p")
            for mod in (m for layer in stock + ours for m in layer.modules()):
                if hasattr(mod, "config"):
                    mod.config = cfg
            inp = H.shard(H.inputs(cfg, absorbed, s=16, b=2), tp=tp, tp_rank=rank if tp > 1 else 0, sp=sp, cp=cp,
                          cp_rank=rank if cp > 1 else 0)
            results[name] = (H.run(ours, inp), H.run(stock, inp))
        torch.save(results, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    import os

    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("parallel")
    mp.start_processes(_parallel_worker, args=(os.path.join(d, "init"), os.path.join(d, "res")), nprocs=2,
                       start_method="spawn")
    return [torch.load(os.path.join(d, f"res.{r}"), weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", [c[0] for c in PARALLEL_CASES])
def test_parallel_layer_matches_stock(parallel_results, case):
    for rank in range(2):
        got, want = parallel_results[rank][case]
        if "dense" in case or "sparse" in case:
            assert want["loss"] is not None, f"{case}: stock logged no indexer loss on rank {rank}"
        H.assert_same(got, want, TOL[torch.float32], f"{case} rank {rank}")


def test_stock_fused_hooks_are_declined_and_logged(caplog):
    """HyScale's layer computes everything itself: with a stock fused backend configured, stock's hooks are not
    called (one log line says so) and the result is stock's with its hooks off."""
    from megatron.core.transformer.experimental_attention_variant import dsa_kernels

    cfg = H.config(dsa_indexer_topk=8)
    stock, ours = H.cores(cfg)
    inp = H.inputs(cfg, True)
    want = H.run(stock, inp)
    ours[0].config.dsa_kernel_backend = "tilelang"
    called = []
    orig = dsa_kernels.run_fused_dsa_attention
    dsa_kernels.run_fused_dsa_attention = lambda *a, **kw: called.append(1) or orig(*a, **kw)
    try:
        with caplog.at_level(logging.INFO, logger="hyscale_megatron"):
            got = H.run(ours, inp)
    finally:
        dsa_kernels.run_fused_dsa_attention = orig
        ours[0].config.dsa_kernel_backend = "none"
    assert not called
    assert any("hooks are not used" in r.getMessage() for r in caplog.records)
    H.assert_same(got, want, TOL[torch.float32], "declined hooks")
