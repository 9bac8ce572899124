"""HyScale's command-line flags for Megatron launch scripts.

``add_hyscale_args`` is an ``extra_args_provider`` for ``megatron.training.pretrain`` (or any
argparse parser): a stock launch script only adds ``--hyscale`` flags and a ``--spec`` choice.
Every :class:`~hyscale_megatron.config.HyScaleConfig` field is one flag: ``enabled`` is
``--hyscale / --no-hyscale``, a bool field ``name`` is ``--hyscale-name / --no-hyscale-name``, any
other field ``--hyscale-name VALUE``, checked by ``HyScaleConfig``'s own validation (a bad value is an
argparse error naming the choices).
Unset flags stay ``None``, so ``HYSCALE_*`` environment variables and the defaults apply.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from .config import HyScaleConfig, HyScaleConfigError


def _field_value(name: str):
    """argparse ``type`` of a non-bool field: the value, if ``HyScaleConfig`` accepts it for ``name``."""
    def parse(text: str) -> str:
        try:
            HyScaleConfig(**{name: text})
        except HyScaleConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    parse.__name__ = name
    return parse


def add_hyscale_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("hyscale", "HyScale DSA: HyTopK selection, selection replay, sparse kernels")
    defaults = HyScaleConfig()
    for f in fields(HyScaleConfig):
        doc = f.metadata.get("doc", "")
        if f.name == "enabled":
            group.add_argument("--hyscale", dest="hyscale", action="store_true", default=None, help=doc)
            group.add_argument("--no-hyscale", dest="hyscale", action="store_false", help="Use stock DSAttention.")
            continue
        flag, dest = f.name.replace("_", "-"), f"hyscale_{f.name}"
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            group.add_argument(f"--hyscale-{flag}", dest=dest, action="store_true", default=None,
                               help=f"{doc} Default {default}.")
            group.add_argument(f"--no-hyscale-{flag}", dest=dest, action="store_false")
        else:
            group.add_argument(f"--hyscale-{flag}", dest=dest, default=None, type=_field_value(f.name),
                               metavar=f.name.upper(), help=f"{doc} Default {default}.")
    return parser


def hyscale_config_from_args(args) -> HyScaleConfig:
    """HyScaleConfig from parsed flags (unset flags fall back to HYSCALE_* env, then defaults)."""
    return HyScaleConfig.from_args(args)
