"""HyTopK: exact top-k of the lightning-indexer scores, never writing the score table.

``hytopk(q, w, k, starts, ends, topk, relu=True, return_scores=False)`` -> int32 [T, topk]
(see :func:`hyscale_kernels.hytopk.op.hytopk`). ``reference`` holds the PyTorch spec.
"""

from .op import MAX_TOPK, Config, hytopk, hytopk_floor, interpreter_active  # noqa: F401
from .reference import hytopk_reference  # noqa: F401

__all__ = ["hytopk", "hytopk_floor", "hytopk_reference", "Config", "interpreter_active", "MAX_TOPK"]
