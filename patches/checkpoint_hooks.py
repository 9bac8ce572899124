"""Checkpoint regions: tell code inside a recomputed region which pass it is in.

Megatron's full recompute (``megatron.core.recompute.checkpointed_forward``) and selective
``core_attn`` recompute (``AbsorbedMLASelfAttention._checkpointed_attention_forward``) both call
``megatron.core.tensor_parallel.checkpoint`` (looked up as a package attribute), and under
FP8/FP4 ``megatron.core.recompute.te_checkpoint``. We wrap those: each call gets a
:class:`Region` whose ``phase`` is ``"forward"`` during the original (no-grad) pass and
``"recompute"`` when the backward re-runs the function. ``will_recompute`` says whether a
backward will re-run it at all (grad enabled and some input requires grad). Code inside asks
:func:`current_region` and may stash per-region data in ``region.data``; a region is freed with
its autograd node after the backward.

This module knows Megatron, not HyScale.
"""

from __future__ import annotations

import contextvars
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from ._base import Patch

_CURRENT: contextvars.ContextVar[Optional["Region"]] = contextvars.ContextVar("hyscale_ckpt_region", default=None)
_IDS = itertools.count()


@dataclass
class Region:
    id: int
    will_recompute: bool
    phase: str = "forward"  # "forward" | "recompute"
    calls: int = 0
    data: dict = field(default_factory=dict)


def current_region() -> Optional[Region]:
    return _CURRENT.get()


def _requires_grad(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _graph_capture_active() -> bool:
    try:
        from megatron.core.transformer.cuda_graphs import is_graph_capturing, is_graph_warmup
    except ImportError:
        return False
    return bool(is_graph_warmup() or is_graph_capturing())


def _wrap_run_function(function, region: Region):
    def run(*inputs):
        region.calls += 1
        region.phase = "forward" if region.calls == 1 else "recompute"
        token = _CURRENT.set(region)
        try:
            return function(*inputs)
        finally:
            _CURRENT.reset(token)

    return run


def _make_tp_checkpoint(original):
    def checkpoint(function, distribute_saved_activations, *args):
        if _graph_capture_active():
            return original(function, distribute_saved_activations, *args)
        region = Region(next(_IDS), will_recompute=torch.is_grad_enabled() and _requires_grad(args))
        return original(_wrap_run_function(function, region), distribute_saved_activations, *args)

    checkpoint.__wrapped__ = original
    checkpoint.__doc__ = original.__doc__
    return checkpoint


def _make_te_checkpoint(original):
    if original is None:  # no Transformer Engine: nothing to wrap
        return None

    def te_checkpoint(function, distribute_saved_activations, get_rng_state_tracker, tp_group, *args, **kwargs):
        region = Region(next(_IDS), will_recompute=torch.is_grad_enabled() and _requires_grad(args))
        return original(_wrap_run_function(function, region), distribute_saved_activations,
                        get_rng_state_tracker, tp_group, *args, **kwargs)

    te_checkpoint.__wrapped__ = original
    return te_checkpoint


PATCHES = [
    Patch("checkpoint-region", "megatron.core.tensor_parallel", "checkpoint", _make_tp_checkpoint),
]
TE_PATCH = Patch("te-checkpoint-region", "megatron.core.recompute", "te_checkpoint", _make_te_checkpoint)


def apply() -> None:
    for p in PATCHES:
        p.apply()
    import megatron.core.recompute as rc  # noqa: PLC0415

    if getattr(rc, "te_checkpoint", None) is not None:
        TE_PATCH.apply()


def revert() -> None:
    for p in PATCHES + [TE_PATCH]:
        p.revert()

