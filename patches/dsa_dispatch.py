"""Dispatch points inside stock ``dsa.py`` that a core-attention subclass can take over.

Stock ``DSAttention.forward`` owns all layout work (sequence/context parallel gathers, packed
THD bounds, masks) and then calls three module-level compute functions. We swap each of them
for a thin dispatcher: while an *override* object is active (a context variable set by the
HyScale layer around its ``super().forward``), the dispatcher calls the override's method of
the same role; otherwise it calls stock's original, so stock ``DSAttention`` modules in the
same process are untouched.

Roles (method names on the override object) and the stock symbols they replace:

- ``qk_topk(q, k, weights, index_topk, mask=None, varlen_starts=None, varlen_ends=None,
  key_positions=None, use_relu=True) -> (index_scores_or_None, topk_indices)``
  replaces ``dsa.fused_qk_topk_naive``;
- ``indexer_loss(*args) -> (topk_indices, loss)`` replaces ``dsa.FusedDSAIndexerLoss.apply``
  (same positional arguments, see ``dsa._FUSED_DSA_INDEXER_LOSS_INPUT_NAMES``);
- ``sparse_attention(**kwargs) -> output`` replaces ``dsa._run_sparse_attention``;
- ``use_fused_kernels(config) -> bool`` replaces ``dsa_kernels.use_fused_dsa_kernels`` (an
  override that computes everything itself returns False, so stock's optional TileLang/cuDNN
  hooks are not consulted inside it).

This module knows Megatron, not HyScale's kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

from ._base import Patch

DSA_MODULE = "megatron.core.transformer.experimental_attention_variant.dsa"

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("hyscale_dsa_override", default=None)


@contextlib.contextmanager
def active_override(override: Any) -> Iterator[None]:
    """Route stock DSA compute calls to ``override`` inside this context."""
    token = _ACTIVE.set(override)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _make_function_dispatcher(role: str):
    def make(original):
        def dispatcher(*args, **kwargs):
            ov = _ACTIVE.get()
            fn = getattr(ov, role, None) if ov is not None else None
            if fn is None:
                return original(*args, **kwargs)
            return fn(*args, **kwargs)

        dispatcher.__wrapped__ = original
        dispatcher.__name__ = getattr(original, "__name__", role)
        dispatcher.__doc__ = f"HyScale dispatcher for {role} (see hyscale_patches.dsa_dispatch)."
        return dispatcher

    return make


def _make_loss_dispatcher(original_cls):
    class FusedDSAIndexerLossDispatch(original_cls):
        """Stock ``FusedDSAIndexerLoss`` whose ``apply`` routes to an active override."""

        @classmethod
        def apply(cls, *args, **kwargs):  # type: ignore[override]
            ov = _ACTIVE.get()
            fn = getattr(ov, "indexer_loss", None) if ov is not None else None
            if fn is None:
                return original_cls.apply(*args, **kwargs)
            return fn(*args, **kwargs)

    FusedDSAIndexerLossDispatch.__name__ = original_cls.__name__
    FusedDSAIndexerLossDispatch.__qualname__ = original_cls.__qualname__
    return FusedDSAIndexerLossDispatch


KERNELS_MODULE = "megatron.core.transformer.experimental_attention_variant.dsa_kernels"

PATCHES = [
    Patch("dsa-topk-dispatch", DSA_MODULE, "fused_qk_topk_naive", _make_function_dispatcher("qk_topk")),
    Patch("dsa-loss-dispatch", DSA_MODULE, "FusedDSAIndexerLoss", _make_loss_dispatcher),
    Patch(
        "dsa-sparse-attention-dispatch",
        DSA_MODULE,
        "_run_sparse_attention",
        _make_function_dispatcher("sparse_attention"),
    ),
    Patch("dsa-fused-kernels-dispatch", KERNELS_MODULE, "use_fused_dsa_kernels",
          _make_function_dispatcher("use_fused_kernels")),
]


_ROLE_TO_PATCH = {"qk_topk": 0, "indexer_loss": 1, "sparse_attention": 2, "use_fused_kernels": 3}


def original(role: str):
    """Stock's callable for ``role`` (the ``apply`` of the loss Function for 'indexer_loss')."""
    patch = PATCHES[_ROLE_TO_PATCH[role]]
    orig = patch.original
    if role == "indexer_loss":
        return orig.apply
    return getattr(orig, "__wrapped__", orig)


def apply() -> None:
    for p in PATCHES:
        p.apply()


def revert() -> None:
    for p in PATCHES:
        p.revert()
