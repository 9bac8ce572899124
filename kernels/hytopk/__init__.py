"""HyTopK: exact top-k of the lightning-indexer scores, never writing the score table.

``hytopk(q, w, k, starts, ends, topk, relu=True, return_scores=False)`` -> int32 [T, topk] (see
:func:`hyscale_kernels.hytopk.op.hytopk`); ``hytopk_reference`` is its PyTorch specification.
"""

from .op import MAX_TOPK, Config, hytopk, shape_unsupported
from .reference import hytopk_reference

__all__ = ["hytopk", "hytopk_reference", "Config", "MAX_TOPK", "shape_unsupported"]
