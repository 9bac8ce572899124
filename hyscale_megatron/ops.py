"""Public ops of HyScale (the kernels of ``hyscale_kernels``, built from the repo's ``kernels/``) and their
plain-PyTorch references.

- ``hytopk``: exact top-k of the lightning-indexer scores, computed on the fly;
- ``sparse_mla``: absorbed-MLA attention over the selected keys (forward + backward);
- ``sparse_mla_with_indexer_loss``: attention plus the sparse-stage indexer KL loss, its target taken
  from the attention backward (what the HyScale layer runs); ``sparse_indexer_loss``: the loss alone,
  its target computed in the forward;
- ``selected_scores``: the indexer scores at given keys, differentiable.
Importing this module imports torch and triton.
"""

from __future__ import annotations

from hyscale_kernels.hytopk import hytopk
from hyscale_kernels.hytopk.reference import (
    causal_bounds,
    hytopk_reference,
    index_scores_reference,
    packed_causal_bounds,
)
from hyscale_kernels.indexer_loss.deferred import sparse_mla_with_indexer_loss
from hyscale_kernels.indexer_loss.fused import sparse_indexer_loss
from hyscale_kernels.indexer_loss.reference import (
    dense_indexer_loss_reference,
    selected_scores_reference,
    sparse_indexer_loss_reference,
)
from hyscale_kernels.indexer_loss.selected_scores import selected_scores
from hyscale_kernels.sparse_mla import sparse_mla
from hyscale_kernels.sparse_mla.reference import sparse_mla_reference

__all__ = [
    "causal_bounds",
    "dense_indexer_loss_reference",
    "hytopk",
    "hytopk_reference",
    "index_scores_reference",
    "packed_causal_bounds",
    "selected_scores",
    "selected_scores_reference",
    "sparse_indexer_loss",
    "sparse_indexer_loss_reference",
    "sparse_mla",
    "sparse_mla_reference",
    "sparse_mla_with_indexer_loss",
]
