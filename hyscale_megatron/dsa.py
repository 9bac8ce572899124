"""HyScale's DSA core attention: a drop-in subclass of stock ``DSAttention``.

Same constructor, same forward contract, same parameters and state-dict keys (the indexer and
everything else are built by stock's ``__init__``). Stock's forward still does all layout work
(sequence/context-parallel gathers, packed-sequence bounds, masks); while it runs, the three
compute points it calls are routed here (``hyscale_patches.dsa_dispatch``):

- selection: HyTopK (exact top-k on the fly, no score table) or the chunked reference;
- indexer loss: computed over the selected tokens only (sparse stage) or chunked (dense stage);
- sparse attention: over the selected indices, O(T * k), instead of stock's dense fallback.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.experimental_attention_variant import dsa as stock_dsa
from megatron.core.transformer.experimental_attention_variant import dsa_masking

from hyscale_patches import checkpoint_hooks, dsa_dispatch

from . import indexer_recompute, replay, selection
from ._log import log_once
from .config import HyScaleConfig, HyScaleConfigError


def _tp_group(pg_collection):
    tp = getattr(pg_collection, "tp", None)
    if tp is None:
        return None
    try:
        return tp if tp.size() > 1 else None
    except Exception:  # noqa: BLE001 - stub groups in tests
        return None


def _loss_scale(rows_valid, b: int, sq: int, per_token: bool, loss_coeff: float):
    """Factor from the summed per-row KL to the layer's loss: coeff (per-token losses) or coeff / valid rows."""
    if per_token:
        return loss_coeff
    n_rows = rows_valid.sum().float().clamp_min(1.0) if rows_valid is not None else float(max(b * sq, 1))
    return loss_coeff / n_rows


def _tracker_adder(layer_number, num_layers: int, scale):
    """on_value callback of the deferred loss: adds scale * value to stock's indexer-loss tracker entry of
    this layer, as stock's forward does with the loss it gets (``save_loss_to_tracker``; its groups are
    already set by that forward call)."""
    def add(value: torch.Tensor) -> None:
        if layer_number is None:
            return
        tracker = stock_dsa.DSAIndexerLossLoggingHelper.tracker
        if "values" not in tracker:
            tracker["values"] = torch.zeros(num_layers, device=value.device)
        vals = tracker["values"]
        vals[layer_number - 1] += (value * scale).to(vals.device, vals.dtype)

    return add


class _Compute:
    """Override object for one forward of one layer (see hyscale_patches.dsa_dispatch).

    ``mb`` is the microbatch key of this forward, ``recompute`` whether this is the backward's
    re-run of a checkpointed region, ``will_recompute`` whether a re-run will follow, ``fp``
    the fingerprint of the indexer inputs.
    """

    def __init__(self, layer: "HyScaleDSAttention", mb: int = 0, recompute: bool = False,
                 will_recompute: bool = False, fp: Optional[torch.Tensor] = None, query=None, key=None):
        self.layer = layer
        self.cfg = layer.hyscale
        self.mb = mb
        self.recompute = recompute
        self.will_recompute = will_recompute
        self.fp = fp
        self.query, self.key = query, key  # the forward's own attention inputs (with grad)
        self._attn = None  # (indices, latent outputs per batch, lse per batch) computed early for the loss
        self.q_recipe = None  # set by indexer_recompute while the indexer runs (sparse loss recomputes q)
        self.query_kept = False  # something else saved the query for its backward: no dq written over it
        self.in_stock_loss = False  # stock's own indexer loss is running (a layout our loss kernels do not take)

    def _kernels(self, impl: str, t: torch.Tensor) -> bool:
        return impl == "triton" or (impl == "auto" and t.is_cuda and self.layer.attn_kernels_ok)

    @staticmethod
    def _same(a, b) -> bool:
        return a is not None and b is not None and a.data_ptr() == b.data_ptr() and a.shape[:2] == b.shape[:2]

    def use_fused_kernels(self, config):
        """Everything runs here, so stock's optional TileLang/cuDNN hooks are not consulted."""
        backend = getattr(config, "dsa_kernel_backend", None)
        if backend not in (None, "none", "hyscale"):
            log_once("declined-hooks", "hyscale: HyScaleDSAttention runs selection, sparse attention and indexer "
                     "loss itself: stock's dsa_kernel_backend=%r hooks are not used by its layers", backend)
        return False

    # --- selection -----------------------------------------------------------------------
    def qk_topk(self, q, k, weights, index_topk, mask=None, varlen_starts=None, varlen_ends=None,
                key_positions=None, use_relu=True):
        """Replaces ``dsa.fused_qk_topk_naive``; returns (None, int32 [b, sq, min(topk, sk)]).

        Inside stock's own indexer loss (``in_stock_loss``) it answers as stock does: stock's fp32 score
        table [b, sq, sk] (the loss reads it) and int64 indices -- ours, so that replay and IndexShare see
        the same selection as on every other path."""
        with torch.no_grad():
            idx = self._select_or_replay(q.detach(), k.detach(), weights.detach(), index_topk, mask,
                                         varlen_starts, varlen_ends, key_positions, use_relu)
            if not self.in_stock_loss:
                return None, idx
            # stock's own scoring and masking (its loss is the O(sq * sk) reference path anyway; its topk
            # on that table is discarded)
            scores, _ = dsa_dispatch.original("qk_topk")(q, k, weights, index_topk, mask, varlen_starts,
                                                           varlen_ends, key_positions, use_relu)
            return scores, idx.long()

    def _select_or_replay(self, q, k, w, index_topk, mask, varlen_starts, varlen_ends, key_positions, use_relu):
        """Selection with replay: the recompute reads the forward's indices instead of selecting."""
        layer, store = self.layer, replay.get_store()
        key = (layer.layer_number, self.mb)
        shape = (q.shape[1], q.shape[0], min(int(index_topk), k.shape[0]))
        if self.recompute and self.cfg.replay:
            return store.read(key, fp=self.fp, shape=shape, prefetch_next=self.cfg.replay_prefetch)
        idx = self._select(q, k, w, index_topk, mask, varlen_starts, varlen_ends, key_positions, use_relu)
        if not self.recompute:
            pending = (1 if (self.will_recompute and self.cfg.replay) else 0) + layer.n_index_share_readers
            store.put(key, idx, self.fp, pending, offload=self.cfg.replay_offload, compact=self.cfg.replay_compact,
                      sk=k.shape[0])
        return idx

    def _select(self, q, k, w, index_topk, mask, varlen_starts, varlen_ends, key_positions, use_relu):
        sq, b = q.shape[0], q.shape[1]
        sk = k.shape[0]
        kk = min(int(index_topk), sk)
        bounds = dsa_masking.build_fused_indexer_varlen_bounds(
            sq=sq, skv=sk, device=q.device, mask=mask, varlen_starts=varlen_starts,
            varlen_ends=varlen_ends, key_positions=key_positions,
        )
        if bounds is not None and b == 1:  # the common case: no [sq, k] copy
            return selection.select_rows(q[:, 0], w[:, 0], k[:, 0], bounds[0], bounds[1], kk, use_relu,
                                         self.cfg.topk_impl).unsqueeze(0)
        out = torch.empty(b, sq, kk, dtype=torch.int32, device=q.device)
        for bi in range(b):
            if bounds is not None:
                out[bi] = selection.select_rows(q[:, bi], w[:, bi], k[:, bi], bounds[0], bounds[1], kk,
                                                use_relu, self.cfg.topk_impl)
                continue
            if mask is not None:
                m = mask if mask.dim() == 2 else mask[bi]
                valid, additive = torch.isfinite(m), m.float().masked_fill(~torch.isfinite(m), 0.0)
            else:
                st, en, kp = dsa_masking.normalize_varlen_bounds(
                    mask=None, varlen_starts=varlen_starts, varlen_ends=varlen_ends,
                    key_positions=key_positions, sk=sk, device=q.device)
                valid, additive = dsa_masking.build_valid_mask_from_starts_ends(st, en, kp), None
            out[bi] = selection.select_rows_masked(q[:, bi], w[:, bi], k[:, bi], valid, additive, kk, use_relu)
        return out

    # --- indexer loss --------------------------------------------------------------------
    def indexer_loss(self, q, weights, k, query, key, softmax_scale, topk, loss_coeff, mask, sparse_loss,
                     pg_collection, varlen_starts=None, varlen_ends=None, key_positions=None,
                     query_valid_rows=None, calculate_per_token_loss=False, use_relu=True):
        """Replaces ``dsa.FusedDSAIndexerLoss.apply``; returns (topk_indices, loss)."""
        shared_kv = key.size(2) == 1 or key.stride(2) == 0
        needs_stock = not shared_kv or (not sparse_loss and (mask is not None or key_positions is not None))
        if needs_stock:
            log_once("loss-stock", "hyscale: indexer loss for this layout (non-absorbed key or explicit mask in "
                     "the dense stage) uses stock's dense reference path, with HyScale's selection")
            self.in_stock_loss = True
            try:
                return dsa_dispatch.original("indexer_loss")(
                    q, weights, k, query, key, softmax_scale, topk, loss_coeff, mask, sparse_loss, pg_collection,
                    varlen_starts, varlen_ends, key_positions, query_valid_rows, calculate_per_token_loss, use_relu)
            finally:
                self.in_stock_loss = False
        with torch.no_grad():
            idx = self._select_or_replay(q.detach(), k.detach(), weights.detach(), topk, mask, varlen_starts,
                                         varlen_ends, key_positions, use_relu)
        loss = self._loss(q, weights, k, query, key, idx, softmax_scale, loss_coeff, sparse_loss, pg_collection,
                          mask, varlen_starts, varlen_ends, query_valid_rows, calculate_per_token_loss, use_relu)
        return idx, loss

    def _loss(self, q, weights, k, query, key, idx, softmax_scale, loss_coeff, sparse_loss, pg_collection,
              mask, varlen_starts, varlen_ends, query_valid_rows, calculate_per_token_loss, use_relu):
        from hyscale_kernels.indexer_loss import reference as loss_ref  # noqa: PLC0415

        sq, b = query.shape[0], query.shape[1]
        sk = key.shape[0]
        tp_group = _tp_group(pg_collection)
        rows_valid = dsa_masking.normalize_query_valid_rows(query_valid_rows, b=b, sq=sq, device=query.device)
        if not sparse_loss:
            bounds = dsa_masking.build_fused_indexer_varlen_bounds(
                sq=sq, skv=sk, device=q.device, mask=mask, varlen_starts=varlen_starts,
                varlen_ends=varlen_ends, key_positions=None)
        kernels = self._kernels(self.cfg.attn_impl, query)
        # the reference losses (dense warm-up stage, sparse on CPU) checkpoint their row chunks and
        # re-read the query in the backward: then the attention backward must not write dq over it
        self.query_kept = self.query_kept or not (sparse_loss and kernels)
        if sparse_loss and kernels and self.cfg.loss_target == "backward" and self._early_ok(query, key):
            return self._attention_and_deferred_loss(q, weights, k, idx, softmax_scale, rows_valid, tp_group,
                                                     use_relu, calculate_per_token_loss, loss_coeff)
        lses = self._attention_early(query, key, idx, softmax_scale) if sparse_loss else None
        total = None
        for bi in range(b):
            kv = key[:, bi, 0].detach()
            qv = None if rows_valid is None else rows_valid[bi]
            common = dict(loss_coeff=1.0, relu=use_relu, query_valid_rows=qv, calculate_per_token_loss=True,
                          tp_group=tp_group)
            lse = None if lses is None else lses[bi]
            if sparse_loss and kernels:
                from hyscale_kernels.indexer_loss.fused import sparse_indexer_loss  # noqa: PLC0415

                # q is not kept for the backward: saved as a recipe, recomputed there (indexer_recompute)
                with indexer_recompute.hooks_for(self.q_recipe, q) as recomputed:
                    kl = sparse_indexer_loss(self._q_of(q, bi, b), weights[:, bi], k[:, bi], query[:, bi], kv,
                                             idx[bi], softmax_scale, lse=lse, v_dim=int(self.layer.config.kv_lora_rank),
                                             deterministic=self.cfg.deterministic, dq_over_q_idx=recomputed, **common)
            elif sparse_loss:
                kl = loss_ref.sparse_indexer_loss_reference(
                    q[:, bi], weights[:, bi], k[:, bi], query[:, bi].detach(), kv, idx[bi], softmax_scale,
                    lse=lse, **common)
            else:
                if query.is_cuda:
                    log_once("dense-loss-ref", "hyscale: dense-stage (warm-up) indexer loss uses the chunked PyTorch "
                             "reference on CUDA (O(T*S) per layer); the sparse stage uses the kernels")
                kl = loss_ref.dense_indexer_loss_reference(
                    q[:, bi], weights[:, bi], k[:, bi], query[:, bi].detach(), kv, bounds[0], bounds[1],
                    softmax_scale, **common)
            total = kl if total is None else total + kl
        return total * _loss_scale(rows_valid, b, sq, calculate_per_token_loss, loss_coeff)

    def _q_of(self, q, bi: int, b: int):
        """Sequence bi's indexer query for the kernel loss; with b > 1 the kernel's contiguous copy, registered
        with the recompute recipe so it is rebuilt alike in the backward (indexer_recompute)."""
        qb = q[:, bi]
        if self.q_recipe is not None and b > 1:
            qb = self.q_recipe.derive(qb.contiguous(), lambda full, bi=bi: full[:, bi].contiguous())
        return qb

    def _early_ok(self, query, key) -> bool:
        """The loss's (detached) query/key are views of this forward's attention inputs (shared latent key)."""
        return self._same(query, self.query) and self._same(key, self.key) and self.key.size(2) == 1

    def _attention_and_deferred_loss(self, q, weights, k, idx, softmax_scale, rows_valid, tp_group, use_relu,
                                     per_token, loss_coeff):
        """loss_target='backward': the attention runs now (kept for ``sparse_attention``, as in
        ``_attention_early``) together with the loss whose target its backward computes
        (``hyscale_kernels.indexer_loss.deferred``). The returned loss is 0 in the forward (stock adds that
        0 to its indexer-loss tracker); the backward adds the true value, scaled as the loss is, to the
        same tracker entry, so Megatron logs the same number."""
        from hyscale_kernels.indexer_loss.deferred import sparse_mla_with_indexer_loss  # noqa: PLC0415

        b = self.query.shape[1]
        v_dim = int(self.layer.config.kv_lora_rank)
        scale = _loss_scale(rows_valid, b, q.shape[0], per_token, loss_coeff)
        track = _tracker_adder(self.layer.layer_number, int(self.layer.config.num_layers), scale)
        outs, lses, total = [], [], None
        for bi in range(b):
            # q is not kept for the backward: saved as a recipe, recomputed there (indexer_recompute)
            with indexer_recompute.hooks_for(self.q_recipe, q) as recomputed:
                out, lse, kl = sparse_mla_with_indexer_loss(
                    self.query[:, bi], self.key[:, bi, 0], idx[bi], softmax_scale,
                    self._q_of(q, bi, b), weights[:, bi], k[:, bi],
                    v_dim=v_dim, relu=use_relu, row_mask=None if rows_valid is None else rows_valid[bi].float(),
                    tp_group=tp_group, on_value=track, deterministic=self.cfg.deterministic,
                    tp_split_rows=self.cfg.loss_tp_split,
                    dq_over_q=not self.query_kept, dq_over_q_idx=recomputed, check_index_range=False)
            outs.append(out)
            lses.append(lse.detach())
            total = kl if total is None else total + kl
        self._attn = (idx, outs, lses)
        log_once("loss-deferred", "hyscale: sparse indexer loss target from the attention backward "
                 "(loss_target='backward'): the loss value is added to the indexer-loss tracker in the backward")
        return total * scale

    def _attention_early(self, query, key, idx, softmax_scale):
        """Run the sparse attention now, on the forward's own query/key (with grad), and keep it.

        The sparse-stage loss target needs the attention's LSE; stock asks for the loss before
        the attention. When the loss's (detached) query/key are views of this forward's attention
        inputs, the attention is computed here once and ``sparse_attention`` returns it. Returns
        the per-batch LSEs, or None when the inputs are not this forward's (then the loss path
        computes them).
        """
        if not self._early_ok(query, key):
            return None
        v_dim = int(self.layer.config.kv_lora_rank)
        outs, lses = [], []
        for bi in range(query.shape[1]):
            out, lse = self._sparse_mla(self.query[:, bi], self.key[:, bi, 0], idx[bi], softmax_scale, v_dim)
            outs.append(out)
            lses.append(lse.detach())
        self._attn = (idx, outs, lses)
        return lses

    # --- sparse attention ----------------------------------------------------------------
    def sparse_attention(self, *, absorbed_mla, query, key, value, up_v_weight, topk_indices, softmax_scale,
                         config, mask, varlen_starts, varlen_ends, key_positions, topk_length=None):
        """Replaces ``dsa._run_sparse_attention`` for the absorbed-MLA layout."""
        if not absorbed_mla or topk_length is not None or up_v_weight is None or value is not None:
            log_once("attn-stock", "hyscale: non-absorbed MLA layout -> stock's chunked sparse attention")
            return dsa_dispatch.original("sparse_attention")(
                absorbed_mla=absorbed_mla, query=query, key=key, value=value, up_v_weight=up_v_weight,
                topk_indices=topk_indices, softmax_scale=softmax_scale, config=config, mask=mask,
                varlen_starts=varlen_starts, varlen_ends=varlen_ends, key_positions=key_positions,
                topk_length=topk_length)
        v_dim = int(config.kv_lora_rank)
        b = query.shape[1]
        if self._attn is not None and self._attn[0] is topk_indices and query is self.query and key is self.key:
            outs = self._attn[1]
            self._attn = None
        else:
            outs = [self._sparse_mla(query[:, bi], key[:, bi, 0], topk_indices[bi], softmax_scale, v_dim)[0]
                    for bi in range(b)]
        # Per sequence: the up-projection saves the attention's own latent output (no [sq, b, np, v_dim]
        # stacked copy) and its backward writes the latent gradient in the layout the sparse-attention
        # backward reads (no [np, sq, v_dim] -> [sq, np, v_dim] copy there).
        projected = [_UpProjectV.apply(o, up_v_weight) for o in outs]  # [sq, np * v_head] each
        if b == 1:
            return projected[0].unsqueeze(1)
        return torch.stack(projected, dim=1)

    def _sparse_mla(self, q, kv, idx, scale, v_dim):
        impl = self.cfg.attn_impl
        if self._kernels(impl, q):
            try:
                from hyscale_kernels.sparse_mla import sparse_mla  # noqa: PLC0415
            except ImportError:
                sparse_mla = None
            if sparse_mla is not None:
                # indices come from our own selection (or its replay): valid by construction, so no
                # per-call device sync for the range check. q is this layer's query, read by nothing
                # after the attention backward (the loss target reads it in the forward): dq is
                # written over it, one [T, N, 576] buffer less at the backward peak
                return sparse_mla(q, kv, idx, scale, v_dim=v_dim, check_index_range=False,
                                  dq_over_q=not self.query_kept)
            if impl == "triton":
                raise RuntimeError("attn_impl='triton' requested but hyscale_kernels.sparse_mla.sparse_mla is unavailable")
        from hyscale_kernels.sparse_mla.reference import sparse_mla_reference  # noqa: PLC0415

        if q.is_cuda:
            log_once("attn-ref-cuda", "hyscale: sparse attention on CUDA uses the chunked PyTorch reference")
        return sparse_mla_reference(q, kv, idx, scale, v_dim=v_dim)


class _UpProjectV(torch.autograd.Function):
    """Absorbed-MLA value up-projection of one sequence: latent [s, np, c] x up_v [np, d, c] -> [s, np * d].

    Same values as stock's ``einsum("sbhc,hdc->sbhd")`` + reshape (the same batched GEMM over heads,
    forward and both gradients). Memory: saves ``latent`` itself (the sparse attention's output, which
    that backward saves anyway) instead of a stacked copy, and writes d latent straight into a
    [s, np, c]-contiguous buffer (``bmm`` into a head-major view of it) -- the layout the sparse
    attention backward needs -- instead of a head-major [np, s, c] result plus a contiguous copy.
    """

    @staticmethod
    def forward(ctx, latent, up_v):
        ctx.save_for_backward(latent, up_v)
        out = torch.einsum("sbhc,hdc->sbhd", latent.unsqueeze(1), up_v)  # stock's op, b = 1
        return out.reshape(latent.shape[0], -1)

    @staticmethod
    def backward(ctx, grad):
        latent, up_v = ctx.saved_tensors
        s, h, c = latent.shape
        g = grad.reshape(s, h, -1).transpose(0, 1)  # [np, s, d], a view
        d_latent = d_up_v = None
        if ctx.needs_input_grad[0]:
            d_latent = torch.empty(s, h, c, dtype=latent.dtype, device=latent.device)
            torch.bmm(g, up_v, out=d_latent.transpose(0, 1))  # [np, s, c] view of [s, np, c]
        if ctx.needs_input_grad[1]:
            d_up_v = torch.bmm(latent.permute(1, 2, 0), g).transpose(1, 2)  # [np, c, d] -> [np, d, c] view
        return d_latent, d_up_v


class HyScaleDSAttention(stock_dsa.DSAttention):
    """Stock ``DSAttention`` with HyScale selection, indexer loss and sparse attention.

    Accepts every constructor argument of stock ``DSAttention`` plus ``hyscale`` (a
    :class:`HyScaleConfig`; defaults from the environment). The forward contract is stock's.
    """

    _FORWARD_ARGS = ("query", "key", "value", "attention_mask", "x", "qr", "position_ids", "attn_mask_type",
                     "attention_bias", "packed_seq_params", "up_v_weight")

    def __init__(self, *args, hyscale: Optional[HyScaleConfig] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.hyscale = hyscale if hyscale is not None else HyScaleConfig.from_env()
        self._forward_count = 0
        # Layers that reuse this layer's top-k (IndexShare): each reads it once per forward.
        self.n_index_share_readers = 0
        if self.index_share and not self.skip_topk:
            self.n_index_share_readers = sum(
                1 for s in range(self.layer_number + 1, self.config.num_layers + 1)
                if stock_dsa.is_dsa_skip_topk_layer(s, self.index_skip_topk_offset, self.index_topk_freq)
                and stock_dsa.source_dsa_compute_layer(s, self.index_skip_topk_offset, self.index_topk_freq)
                == self.layer_number)
        self._check_kernel_shapes()
        dsa_dispatch.apply()
        checkpoint_hooks.apply()
        indexer_recompute.install(self.indexer)

    def _check_kernel_shapes(self) -> None:
        """Shapes the kernels cannot take (stock takes any): refused here when 'triton' was asked for; with
        'auto' that part of the layer runs its chunked reference (one log line). HyTopK: index heads, head
        dim and top-k (``selection.hytopk_unsupported``); sparse attention and indexer loss: top-k."""
        from hyscale_kernels.sparse_mla import MAX_TOPK as ATTN_MAX_TOPK  # noqa: PLC0415

        self.attn_kernels_ok = int(self.index_topk) <= ATTN_MAX_TOPK
        if not self.attn_kernels_ok:
            why = f"dsa_indexer_topk={self.index_topk}: the sparse attention kernel reads at most {ATTN_MAX_TOPK} keys"
            if self.hyscale.attn_impl == "triton":
                raise HyScaleConfigError(f"HyScaleConfig.attn_impl='triton' cannot run {why}; use attn_impl='auto' "
                                         "(the chunked reference for this shape) or a smaller top-k")
            log_once("attn-shape", "hyscale: %s; sparse attention and indexer loss run the chunked PyTorch "
                     "reference", why)
        if self.skip_topk or not self.hyscale.enabled:
            return
        why = selection.hytopk_unsupported(int(self.config.dsa_indexer_n_heads),
                                           int(self.config.dsa_indexer_head_dim), int(self.index_topk))
        if why is None:
            return
        if self.hyscale.topk_impl == "triton":
            raise HyScaleConfigError(f"HyScaleConfig.topk_impl='triton' cannot run {why}; use topk_impl='auto' "
                                     "(the chunked reference for this shape) or change the indexer shape")
        if self.hyscale.topk_impl == "auto":  # the same key as selection.select_rows: one line per process
            log_once("topk-shape", "hyscale: %s; top-k runs the chunked PyTorch reference", why)

    def _microbatch(self):
        """(microbatch key, is_recompute, will_recompute) of the current forward."""
        region = checkpoint_hooks.current_region()
        slot = ("hyscale_mb", id(self))
        if region is not None and region.phase == "recompute":
            if slot not in region.data:
                raise replay.ReplayMismatchError(
                    f"layer {self.layer_number}: recompute of a region whose forward this layer did not run")
            return region.data[slot], True, False
        mb = self._forward_count
        self._forward_count += 1
        if region is not None:
            region.data[slot] = mb
        return mb, False, bool(region is not None and region.will_recompute)

    def forward(self, *args, **kwargs):
        if not self.hyscale.enabled:
            return super().forward(*args, **kwargs)
        bound = dict(zip(self._FORWARD_ARGS, args), **kwargs)
        mb, recompute, will_recompute = self._microbatch()
        needs_fp = self.hyscale.replay and not self.skip_topk and (recompute or will_recompute)
        fp = replay.fingerprint(bound["x"], bound["qr"]) if needs_fp else None
        if self.skip_topk:
            self._load_shared_topk(bound, mb, recompute, will_recompute)
        compute = _Compute(self, mb, recompute, will_recompute, fp, query=bound["query"], key=bound["key"])
        with dsa_dispatch.active_override(compute), indexer_recompute.capturing(compute):
            return super().forward(*args, **kwargs)

    def _load_shared_topk(self, bound, mb, recompute, will_recompute):
        """IndexShare: put the source layer's indices *of this microbatch* where stock reads them.

        Stock keeps shared indices on the packed_seq_params / attention_mask / config object,
        which is shared by microbatches in flight; we serve them from the (layer, microbatch)
        store instead.
        """
        store, key = replay.get_store(), (self.source_layer, mb)
        if not recompute and will_recompute:
            store.add_pending(key, 1)
        query = bound["query"]
        idx = store.read(key, fp=None)
        if query.dim() == 4 and idx.shape[:2] != (query.shape[1], query.shape[0]):
            raise replay.ReplayMismatchError(
                f"IndexShare layer {self.layer_number}: source layer {self.source_layer} indices have shape "
                f"{tuple(idx.shape)}, this layer's query has [s={query.shape[0]}, b={query.shape[1]}]")
        holder = self._get_index_share_topk_holder(bound.get("packed_seq_params"), bound.get("attention_mask"))
        holder[self.source_layer] = idx
