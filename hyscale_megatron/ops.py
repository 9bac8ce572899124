"""Public ops: ``from hyscale_megatron.ops import hytopk, sparse_mla, selected_scores``, and the sparse-stage
indexer loss (``sparse_indexer_loss``: target in the forward; ``sparse_mla_with_indexer_loss``: attention and
loss with the target from the attention backward, what the HyScale layer uses by default).

Re-exports the kernels (``hyscale_kernels``, built from the repo's ``kernels/`` folder) and
their plain-PyTorch references. Imported lazily so ``import hyscale_megatron.ops`` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "hytopk": ("hyscale_kernels.hytopk", "hytopk"),
    "hytopk_reference": ("hyscale_kernels.hytopk.reference", "hytopk_reference"),
    "index_scores_reference": ("hyscale_kernels.hytopk.reference", "index_scores_reference"),
    "selected_scores": ("hyscale_kernels.hytopk.selected_scores", "selected_scores"),
    "selected_scores_reference": ("hyscale_kernels.hytopk.reference", "selected_scores_reference"),
    "causal_bounds": ("hyscale_kernels.hytopk.reference", "causal_bounds"),
    "packed_causal_bounds": ("hyscale_kernels.hytopk.reference", "packed_causal_bounds"),
    "sparse_mla": ("hyscale_kernels.sparse_mla", "sparse_mla"),
    "sparse_mla_reference": ("hyscale_kernels.sparse_mla.reference", "sparse_mla_reference"),
    "sparse_indexer_loss": ("hyscale_kernels.indexer_loss.fused", "sparse_indexer_loss"),
    "sparse_mla_with_indexer_loss": ("hyscale_kernels.indexer_loss.deferred", "sparse_mla_with_indexer_loss"),
    "sparse_indexer_loss_reference": ("hyscale_kernels.indexer_loss.reference", "sparse_indexer_loss_reference"),
    "dense_indexer_loss_reference": ("hyscale_kernels.indexer_loss.reference", "dense_indexer_loss_reference"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"hyscale_megatron.ops has no attribute {name!r}; available: {', '.join(__all__)}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__():
    return __all__
