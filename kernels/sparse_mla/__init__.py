"""Sparse absorbed-MLA attention over top-k key indices (forward + backward).

``sparse_mla`` is the public op; ``reference.sparse_mla_reference`` is its executable spec.
"""

from .kernel import flops
from .op import MAX_TOPK, sparse_mla
from .reference import sparse_mla_reference

__all__ = ["sparse_mla", "sparse_mla_reference", "flops", "MAX_TOPK"]
