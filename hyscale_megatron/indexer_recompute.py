"""Sparse-stage indexer loss without a saved indexer query: q is recomputed at the loss backward.

The sparse KL (``hyscale_kernels.indexer_loss.kl.SparseKLFunction``, and the deferred loss) saves the indexer query
q = rope(linear_wq_b(qr).reshape(T, B, H_I, D_I)) (+ rotate_activation) [T, H_I, D_I] bf16 for the
selected-scores backward: 16 KiB/token at H_I = 64, D_I = 128, alive from the layer's (re)forward
to its attention backward, i.e. across the MLP backward where a step peaks. Everything it is made
of is kept anyway: ``qr`` (the compressed query, saved by ``linear_wq_b`` itself -- and by the MLA
q up-projection -- as its input for the weight gradient), the ``linear_wq_b`` weight and the RoPE
table (small).

Mechanism: saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) around the loss.
The autograd graph is untouched -- q is still the output of stock's ``forward_before_topk`` and
its gradient flows q -> RoPE -> linear_wq_b -> qr through stock's own nodes -- only the *storage*
the loss saves is replaced by a recipe: the pack hook turns every saved tensor that is q (or a
view of it) into (recipe, offset, size, stride), and the unpack hook re-runs the very calls the
forward made (``linear_wq_b.forward`` on the same ``qr`` object, the same reshape, the indexer's
own ``_apply_rope`` with the same table / mscale / cu_seqlens, ``rotate_activation`` when
configured) under no_grad and returns the same view of the result: bit-identical q, hence
bit-identical gradients. A checkpoint around the loss would instead have to re-enter the graph
(q's gradient must still reach stock's RoPE / linear nodes) and keep qr as an input anyway; the
hooks need no change in stock's data flow and compose with full recompute (the re-run forward is
captured like the first) and replay (selection reads q detached; nothing is saved there).

The recipe is captured while stock's ``forward_before_topk`` runs (the indexer's
``forward_before_topk``, ``linear_wq_b.forward`` and ``_apply_rope`` are wrapped on the instance;
stock's code is not changed): the input/output of the linear, and the first ``_apply_rope`` call
whose input is that output reshaped. The recompute writes RoPE'd row chunks back over the linear
output (see :meth:`QRecipe.full`), so the loss backward holds one q-sized buffer, as a saved q would take.

The recomputed q is private to the loss backward that asked for it (every tensor the unpack hook hands
out is referenced by nobody else), so that backward writes q's gradient over it (``dq_over_q_idx`` of
the loss ops, which the layer sets from what :func:`hooks_for` yields): one [T, H_I, D_I] buffer less at
the loss backward.

Where it applies: the sparse-stage loss on the kernel path (``sparse_mla_with_indexer_loss`` and
``sparse_indexer_loss``, CUDA or the Triton interpreter), any batch size (b > 1: the per-sequence
contiguous copy is recomputed alike). Not applied: the CPU reference loss (its per-chunk ``torch.utils.checkpoint``
keeps its q slices as inputs; a debug path), the dense warm-up loss (O(T * S), not the 1M path),
stock's fallback. Context parallel: q is local, RoPE gets the same cp-local table -> exact.
Sequence parallel with TP > 1: stock slices the TP-gathered rows into a contiguous copy; that copy
is not q's storage, so the hooks stay off and q is saved as it is (one log line).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._log import log_once

# Row-chunk size (bytes of q per chunk) of the RoPE / rotate part of the recompute: ~256 chunks at 1M
# tokens x 64 heads x 128 (16 KiB per row). The memory ledger scales it with its sequence length.
RECOMPUTE_CHUNK_BYTES = 1 << 26

_SINK: contextvars.ContextVar[Optional[object]] = contextvars.ContextVar("hyscale_q_sink", default=None)
_CAPTURE: contextvars.ContextVar[Optional["_Capture"]] = contextvars.ContextVar("hyscale_q_capture", default=None)


class _Capture:
    def __init__(self):
        self.lin_in = self.lin_out = None
        self.rope = None  # (x shape, rotary_pos_emb, mscale, cu_seqlens)
        self.rope_out = None


class QRecipe:
    """Recomputes the indexer q of one forward: same calls on the same inputs as that forward."""

    def __init__(self, indexer, cap: _Capture, q: torch.Tensor, rotate: bool):
        self.indexer = indexer
        self.qr = cap.lin_in
        self.x_shape, self.rotary_pos_emb, self.mscale, self.cu_seqlens = cap.rope
        self.rotate = rotate
        self.ptr = q.untyped_storage().data_ptr()
        self.meta = (q.shape, q.stride(), q.storage_offset(), q.dtype, q.device)
        self.derived = {}  # storage ptr -> (fn(full q) -> tensor, meta, weakref) for copies of q (b > 1 slices)
        self._q = None
        self.recomputes = 0
        self.outstanding = 0  # packed saves of q not unpacked yet: the cache is dropped at the last one

    def full(self) -> torch.Tensor:
        """q, recomputed once (cached for the views saved from it).

        The q up-projection runs whole (same GEMM as the forward); RoPE (and rotate_activation) are
        row-wise, so they run on row chunks of its output, through the indexer's own ``_apply_rope``
        with the matching rows of the same table, and are written back over that output: stock's
        ``cat([rope(x_pe), x_nope])`` has the layout of the linear output itself, so q *is* that buffer
        -- one [T, H_I, D_I] buffer plus chunk-sized temporaries instead of two buffers and full-size
        RoPE temporaries. Packed (cu_seqlens) inputs or a table whose rows are not the query rows run
        as one chunk (the forward's exact call)."""
        if self._q is None:
            from megatron.core.transformer.experimental_attention_variant import dsa as stock_dsa  # noqa: PLC0415

            ix = self.indexer
            with torch.no_grad():
                out = ix.linear_wq_b._hyscale_stock_forward(self.qr)
                q = (out[0] if isinstance(out, tuple) else out).reshape(self.x_shape)
                T = q.shape[0]
                rpe = self.rotary_pos_emb
                row_bytes = max(1, q[:1].numel() * q.element_size())
                chunkable = (self.cu_seqlens is None and torch.is_tensor(rpe) and rpe.dim() >= 1
                             and rpe.shape[0] == T and q.is_contiguous())
                rows = max(1, RECOMPUTE_CHUNK_BYTES // row_bytes) if chunkable else T
                if not q.is_contiguous():
                    q = q.contiguous()
                for r0 in range(0, T, rows):
                    r1 = min(T, r0 + rows)
                    tab = rpe[r0:r1] if rows < T else rpe
                    y = ix._hyscale_stock_apply_rope(q[r0:r1] if rows < T else q, tab, self.mscale,
                                                     cu_seqlens=self.cu_seqlens)
                    if self.rotate:
                        y = stock_dsa.rotate_activation(y)
                    q[r0:r1].copy_(y)
                    del y
            shape, stride, offset, dtype, device = self.meta
            if (q.shape, q.stride(), q.storage_offset(), q.dtype, q.device) != self.meta:
                raise RuntimeError(f"hyscale: recomputed indexer q has layout {tuple(q.shape)}/{q.stride()}/"
                                   f"{q.dtype}, the forward's was {tuple(shape)}/{stride}/{dtype}")
            self._q = q
            self.recomputes += 1
        return self._q

    def derive(self, t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Register ``t = fn(q)`` (a fresh tensor, e.g. a contiguous batch slice): saved copies of it are
        recomputed as ``fn(recomputed q)``."""
        # keyed by address, valid only while that storage lives (a freed copy's address may be reused)
        self.derived[t.untyped_storage().data_ptr()] = (fn, (t.shape, t.stride(), t.storage_offset(), t.dtype),
                                                        StorageWeakRef(t.untyped_storage()))
        return t

    def pack(self, t: torch.Tensor):
        if t.numel() == 0 or t.dtype != self.meta[3] or t.device != self.meta[4] or t.layout != torch.strided:
            return t
        ptr = t.untyped_storage().data_ptr()
        if ptr == self.ptr:  # q itself: alive while the loss (and so this hook) runs
            self.outstanding += 1
            return _Packed(self, None, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        entry = self.derived.get(ptr)
        if entry is None or entry[2].expired():
            return t
        self.outstanding += 1
        return _Packed(self, entry[:2], t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    @staticmethod
    def unpack(p):
        """The saved tensor, recomputed: private to the caller (a fresh copy where it would share storage
        with another unpack), so the loss backward may write its gradient over it."""
        if not isinstance(p, _Packed):
            return p
        rec = p.recipe
        base = full = rec.full()
        rec.outstanding -= 1
        private = rec.outstanding <= 0  # nothing else will ask for this q: the caller's reference is the last
        if private:
            rec._q = None
        if p.derived is not None:
            fn, meta = p.derived
            base = fn(full)  # a fresh copy (e.g. one sequence of a batch), made for this caller alone
            if (base.shape, base.stride(), base.storage_offset(), base.dtype) != meta:
                raise RuntimeError("hyscale: recomputed derived indexer q has a different layout")
            private = base.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
        out = base.as_strided(p.size, p.stride, p.offset)
        whole = (out.is_contiguous() and base.is_contiguous() and out.numel() == base.numel()
                 and p.offset == base.storage_offset())  # e.g. q[:, 0] of a batch-1 q: all of it
        if not (private and whole):  # another unpack reads this buffer, or it is a part of it: a copy of its own
            out = out.clone()
        return out


class _Packed:
    __slots__ = ("recipe", "derived", "offset", "size", "stride")

    def __init__(self, recipe, derived, offset, size, stride):
        self.recipe, self.derived, self.offset, self.size, self.stride = recipe, derived, offset, size, stride


def install(indexer) -> None:
    """Wrap ``indexer.forward_before_topk``, ``indexer.linear_wq_b.forward`` and ``indexer._apply_rope``
    (instance attributes; stock's methods run unchanged inside) so that a forward under :func:`capturing`
    records the recipe of q. Idempotent; a pass-through outside a capture."""
    if indexer is None or getattr(indexer, "_hyscale_q_recompute", False):
        return
    lin = indexer.linear_wq_b
    lin_forward = lin.forward  # bound stock forward
    apply_rope = indexer._apply_rope
    fbt = indexer.forward_before_topk
    lin._hyscale_stock_forward = lin_forward
    indexer._hyscale_stock_apply_rope = apply_rope

    def linear_forward(*args, **kwargs):
        out = lin_forward(*args, **kwargs)
        cap = _CAPTURE.get()
        if cap is not None and cap.lin_in is None and len(args) == 1 and not kwargs:
            cap.lin_in = args[0]
            cap.lin_out = out[0] if isinstance(out, tuple) else out
        return out

    def rope(x, rotary_pos_emb, mscale, cu_seqlens=None):
        out = apply_rope(x, rotary_pos_emb, mscale, cu_seqlens=cu_seqlens)
        cap = _CAPTURE.get()
        if (cap is not None and cap.rope is None and cap.lin_out is not None and x.dim() >= 1
                and x.numel() == cap.lin_out.numel() and x.data_ptr() == cap.lin_out.data_ptr()):
            cap.rope = (x.shape, rotary_pos_emb, mscale, cu_seqlens)
            cap.rope_out = out
        return out

    def forward_before_topk(x, qr, packed_seq_params=None):
        sink = _SINK.get()
        if sink is None:
            return fbt(x, qr, packed_seq_params)
        cap = _Capture()
        token = _CAPTURE.set(cap)
        try:
            q, k, weights = fbt(x, qr, packed_seq_params)
        finally:
            _CAPTURE.reset(token)
        sink.q_recipe = finish(indexer, cap, q)
        return q, k, weights

    lin.forward = linear_forward
    indexer._apply_rope = rope
    indexer.forward_before_topk = forward_before_topk
    indexer._hyscale_q_recompute = True


@contextlib.contextmanager
def capturing(sink):
    """Around one HyScale layer forward: the indexer's ``forward_before_topk`` inside it sets
    ``sink.q_recipe`` (a :class:`QRecipe`, or None when q cannot be recomputed exactly)."""
    sink.q_recipe = None
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def finish(indexer, cap: Optional[_Capture], q: torch.Tensor) -> Optional[QRecipe]:
    """The recipe of the q that ``forward_before_topk`` returned, or None when it cannot be exact."""
    if cap is None or cap.rope is None or q is None or not q.requires_grad:
        return None
    rotate = bool(getattr(indexer.config, "dsa_indexer_rotate_activation", False))
    if not rotate and q is not cap.rope_out:
        return None
    if rotate and q.shape != cap.rope_out.shape:
        return None
    return QRecipe(indexer, cap, q, rotate)


def hooks_for(recipe: Optional[QRecipe], q: torch.Tensor):
    """Around the loss call: a context manager that saves ``q`` (and views / registered copies of it) as the
    recipe when ``q`` is the tensor the recipe describes, and yields True (the loss may then write q's
    gradient over the q it gets back: ``dq_over_q_idx``); else it yields False and q is saved as it is."""
    if recipe is None or q is None or not torch.is_grad_enabled() or not q.requires_grad:
        return contextlib.nullcontext(False)
    if q.untyped_storage().data_ptr() != recipe.ptr:
        log_once("q-recompute-off", "hyscale: indexer q reaches the loss as a copy (e.g. sequence-parallel row "
                 "slice): the sparse indexer loss keeps q for its backward (no q recompute)")
        return contextlib.nullcontext(False)
    return _recomputing(recipe)


@contextlib.contextmanager
def _recomputing(recipe: QRecipe):
    with torch.autograd.graph.saved_tensors_hooks(recipe.pack, QRecipe.unpack):
        yield True
