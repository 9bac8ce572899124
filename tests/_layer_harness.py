"""Stock ``DSAttention`` and ``HyScaleDSAttention`` cores side by side, fed the inputs stock's layer takes.

Builds the DSA core-attention modules of a small ``MLATransformerConfig`` from the layer spec (local,
non-TE provider), with identical weights, then runs one forward (+ backward in training) of each on
the same inputs: per-head query/key/value (non-absorbed) or the absorbed-MLA latent layout, plain
[s, b] or packed THD sequences, causal. ``run`` returns everything a caller should see equal: the
output, the indexer loss as Megatron's tracker logs it, and every gradient (inputs and parameters).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

# Small shapes in the spirit of stock's layer tests: 16 heads, LoRA ranks 64, qk head 64 + rope 32,
# v 64, indexer 8 heads x 64, top-32 (more than a short sequence has: selection is partly dense).
SMALL = dict(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=16, q_lora_rank=64,
             kv_lora_rank=64, qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64, dsa_indexer_n_heads=8,
             dsa_indexer_head_dim=64, dsa_indexer_topk=32, dsa_indexer_loss_coeff=1.0)


def config(dtype=torch.float32, **overrides):
    from hyscale_megatron.models import mla_dsa_config

    return mla_dsa_config(dtype=dtype, **{**SMALL, **overrides})


def cores(cfg, hyscale=None, layers=(1,), pg_collection=None, seed=3, **params):
    """(stock cores, HyScale cores) for ``layers`` (1-based layer numbers), with identical weights."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from hyscale_megatron.config import HyScaleConfig
    from hyscale_megatron.env import seed_all
    from hyscale_megatron.specs import dsa_layer_specs

    hyscale = hyscale or HyScaleConfig(topk_impl="reference", attn_impl="reference")
    out = []
    for use_hyscale in (False, True):
        specs = dsa_layer_specs(cfg, hyscale=hyscale, use_hyscale=use_hyscale)
        built = []
        for n in layers:
            spec = specs[n - 1].submodules.self_attention.submodules.core_attention
            seed_all(seed + n)
            extra = {} if pg_collection is None else dict(pg_collection=pg_collection)
            built.append(build_module(spec, config=cfg, layer_number=n, attn_mask_type=AttnMaskType.causal,
                                      attention_type="self", **extra, **params))
        out.append(built)
    stock, ours = out
    for s, h in zip(stock, ours):
        h.load_state_dict(s.state_dict(), strict=True)
        h.to(cfg.params_dtype), s.to(cfg.params_dtype)
    return stock, ours


@dataclasses.dataclass
class Inputs:
    query: torch.Tensor
    key: torch.Tensor
    value: Optional[torch.Tensor]
    up_v_weight: Optional[torch.Tensor]
    x: torch.Tensor
    qr: torch.Tensor
    packed_seq_params: object = None
    position_ids: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None


def inputs(cfg, absorbed: bool, s: int = 16, b: int = 2, heads: Optional[int] = None, seqlens=None,
           seed: int = 0, x_rows: Optional[int] = None) -> Inputs:
    """Random inputs in stock's layout. ``seqlens``: packed THD sequences (b = 1, s = their sum).
    ``heads``: attention heads on this rank (tensor parallel); ``x_rows``: rows of x / qr (sequence
    parallel: the local share)."""
    g = torch.Generator().manual_seed(seed)
    dt = cfg.params_dtype
    n = heads or cfg.num_attention_heads
    packed = None
    if seqlens is not None:
        from megatron.core.packed_seq_params import PackedSeqParams

        b, s = 1, int(sum(seqlens))
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(seqlens),
                                 max_seqlen_kv=max(seqlens))

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    if absorbed:
        d = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
        query, key, value = rnd(s, b, n, d), rnd(s, b, 1, d), None
        up_v = rnd(n, cfg.v_head_dim, cfg.kv_lora_rank, scale=0.1)
    else:
        d = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
        query, key, value, up_v = rnd(s, b, n, d), rnd(s, b, n, d), rnd(s, b, n, cfg.v_head_dim), None
    rows = x_rows or s
    return Inputs(query, key, value, up_v, rnd(rows, b, cfg.hidden_size), rnd(rows, b, cfg.q_lora_rank),
                  packed_seq_params=packed)


def zigzag_rows(s: int, cp: int, rank: int) -> torch.Tensor:
    """Rows of a length-s sequence that context-parallel rank ``rank`` holds (Megatron's zigzag split:
    chunks rank and 2 cp - 1 - rank of 2 cp)."""
    c = s // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def shard(inp: Inputs, *, tp: int = 1, tp_rank: int = 0, sp: bool = False, cp: int = 1, cp_rank: int = 0) -> Inputs:
    """This rank's share of global inputs: attention heads split over TP; x / qr rows split over TP under
    sequence parallelism; every sequence tensor's rows in the zigzag CP split."""
    def heads(t):
        if t is None or tp == 1 or t.shape[2] == 1:
            return t
        n = t.shape[2] // tp
        return t[:, :, tp_rank * n:(tp_rank + 1) * n].contiguous()

    def rows(t):
        return t if cp == 1 else t[zigzag_rows(t.shape[0], cp, cp_rank)].contiguous()

    def sp_rows(t):
        if not sp or tp == 1:
            return t
        n = t.shape[0] // tp
        return t[tp_rank * n:(tp_rank + 1) * n].contiguous()

    up_v = inp.up_v_weight
    if up_v is not None and tp > 1:
        n = up_v.shape[0] // tp
        up_v = up_v[tp_rank * n:(tp_rank + 1) * n].contiguous()
    return Inputs(heads(rows(inp.query)), heads(rows(inp.key)), heads(rows(inp.value)) if inp.value is not None
                  else None, up_v, sp_rows(rows(inp.x)), sp_rows(rows(inp.qr)), inp.packed_seq_params)


def tracker_values(reset: bool = True):
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper as H

    vals = H.tracker.get("values")
    out = None if vals is None else vals.detach().float().clone()
    if reset:
        H.clean_loss_in_tracker()
    return out


def run(layers, inp: Inputs, train: bool = True, grad_seed: int = 1) -> dict:
    """One forward (and in training a backward of a fixed random projection of the outputs) through
    ``layers`` in order, all fed ``inp`` (IndexShare layers read their source's selection).

    Returns {"out": [outputs], "loss": tracker values or None, "grads": {name: gradient}}."""
    from megatron.core.transformer.enums import AttnMaskType

    tracker_values()
    leaves = {k: getattr(inp, k) for k in ("query", "key", "value", "up_v_weight")
              if getattr(inp, k) is not None}
    leaves = {k: v.detach().clone().requires_grad_(train) for k, v in leaves.items()}
    outs = []
    ctx = torch.enable_grad() if train else torch.no_grad()
    with ctx:
        for layer in layers:
            layer.train(train)
            layer.zero_grad(set_to_none=True)
            outs.append(layer(leaves["query"], leaves["key"], leaves.get("value"), inp.attention_mask, inp.x, inp.qr,
                              position_ids=inp.position_ids, attn_mask_type=AttnMaskType.causal,
                              packed_seq_params=inp.packed_seq_params, up_v_weight=leaves.get("up_v_weight")))
    grads = {}
    if train:
        g = torch.Generator().manual_seed(grad_seed)
        total = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
        total.backward()
        grads = {f"input.{k}": v.grad.detach().float().clone() for k, v in leaves.items()}
        for i, layer in enumerate(layers):
            for name, p in layer.named_parameters():
                if p.grad is not None:
                    grads[f"layer{i}.{name}"] = p.grad.detach().float().clone()
    return {"out": [o.detach().float() for o in outs], "loss": tracker_values(), "grads": grads}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def assert_same(got: dict, want: dict, tol: float, what: str = "") -> None:
    """HyScale's results equal stock's: outputs, logged indexer loss and every gradient within ``tol``
    (relative L2 norm; indexer gradients, which flow through a KL of small terms, within 10 tol)."""
    assert len(got["out"]) == len(want["out"])
    for i, (a, b) in enumerate(zip(got["out"], want["out"])):
        assert a.shape == b.shape, f"{what}: output {i} shape {tuple(a.shape)} != stock's {tuple(b.shape)}"
        assert rel(a, b) <= tol, f"{what}: output {i} differs from stock's (rel {rel(a, b):.2e} > {tol})"
    if want["loss"] is None:
        assert got["loss"] is None or not got["loss"].any(), f"{what}: HyScale logged an indexer loss, stock none"
    else:
        assert got["loss"] is not None, f"{what}: HyScale logged no indexer loss"
        assert rel(got["loss"], want["loss"]) <= tol, f"{what}: indexer loss {got['loss']} != stock's {want['loss']}"
    assert got["grads"].keys() == want["grads"].keys(), (
        f"{what}: gradients of {sorted(got['grads'].keys() ^ want['grads'].keys())} on one side only")
    for name, b in want["grads"].items():
        a = got["grads"][name]
        t = tol * (10 if ".indexer." in name else 1)
        if b.norm() == 0:
            assert a.norm() == 0, f"{what}: {name} has a gradient, stock's is 0"
        else:
            assert rel(a, b) <= t, f"{what}: gradient of {name} differs (rel {rel(a, b):.2e} > {t})"
