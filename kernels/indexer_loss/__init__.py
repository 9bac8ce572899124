"""The DSA indexer's KL loss: the indexer is trained to predict where the attention looks.

Sparse stage (over the selected keys):
- ``sparse_mla_with_indexer_loss`` (``deferred.py``): attention and loss together, the loss target taken
  from the attention backward (the HyScale layer's default);
- ``sparse_indexer_loss`` (``fused.py``): the loss alone, its target computed in the forward from the
  attention's LSE (the layer's path when the attention inputs are not its forward's own);
- ``selected_scores.selected_scores``: the indexer scores at the selected keys, the loss's differentiable
  side (not re-exported here: the name is its module's).
``reference.py`` holds the PyTorch spec of both stages (stock megatron-core semantics).
"""

from .deferred import sparse_mla_with_indexer_loss
from .fused import sparse_indexer_loss
from .reference import dense_indexer_loss_reference, selected_scores_reference, sparse_indexer_loss_reference

__all__ = ["sparse_mla_with_indexer_loss", "sparse_indexer_loss", "selected_scores_reference",
           "sparse_indexer_loss_reference", "dense_indexer_loss_reference"]
