"""HyScale: a Megatron-Core plugin for long-context DSA training.

Main entry points (imported lazily, so ``import hyscale_megatron`` does not import Megatron):

- ``HyScaleConfig`` (settings), ``add_hyscale_args`` (Megatron flags),
- ``dsa_block_spec`` / ``hyscale_block_spec`` / ``stock_block_spec`` (layer specs),
- ``HyScaleDSAttention`` (the core attention), ``hyscale_megatron.ops`` (the kernels),
- ``replay.store_stats()`` (selection-replay memory).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "HyScaleConfig": "hyscale_megatron.config",
    "add_hyscale_args": "hyscale_megatron.arguments",
    "dsa_block_spec": "hyscale_megatron.specs",
    "hyscale_block_spec": "hyscale_megatron.specs",
    "stock_block_spec": "hyscale_megatron.specs",
    "HyScaleDSAttention": "hyscale_megatron.dsa",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hyscale_megatron' has no attribute {name!r}")
