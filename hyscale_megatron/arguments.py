"""HyScale's command-line flags for Megatron launch scripts.

``add_hyscale_args`` is an ``extra_args_provider`` for ``megatron.training.pretrain`` (or any
argparse parser): a stock launch script only adds ``--hyscale`` flags and a ``--spec`` choice.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from .config import HyScaleConfig


def add_hyscale_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("hyscale", "HyScale DSA: HyTopK selection, selection replay, sparse kernels")
    docs = {f.name: f.metadata["doc"] for f in fields(HyScaleConfig)}
    defaults = HyScaleConfig()
    group.add_argument("--hyscale", dest="hyscale", action="store_true", default=None, help=docs["enabled"])
    group.add_argument("--no-hyscale", dest="hyscale", action="store_false", help="Use stock DSAttention.")
    group.add_argument("--hyscale-topk-impl", choices=("auto", "triton", "reference"), default=None,
                       help=docs["topk_impl"] + f" Default {defaults.topk_impl}.")
    group.add_argument("--hyscale-attn-impl", choices=("auto", "triton", "reference"), default=None,
                       help=docs["attn_impl"] + f" Default {defaults.attn_impl}.")
    group.add_argument("--hyscale-loss-target", choices=("backward", "forward"), default=None,
                       help=docs["loss_target"] + f" Default {defaults.loss_target}.")
    for name in ("loss_tp_split", "replay", "replay_offload", "replay_prefetch", "replay_compact", "deterministic",
                 "mla_up_proj_recompute"):
        flag = name.replace("_", "-")
        group.add_argument(f"--hyscale-{flag}", dest=f"hyscale_{name}", action="store_true", default=None,
                           help=docs[name] + f" Default {getattr(defaults, name)}.")
        group.add_argument(f"--no-hyscale-{flag}", dest=f"hyscale_{name}", action="store_false")
    return parser


def hyscale_config_from_args(args) -> HyScaleConfig:
    """HyScaleConfig from parsed flags (unset flags fall back to HYSCALE_* env, then defaults)."""
    return HyScaleConfig.from_args(args)
