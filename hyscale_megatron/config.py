"""Typed HyScale configuration: one dataclass, every field documented and validated.

The same fields are exposed as Megatron command-line flags (see ``hyscale_megatron.arguments``)
and as environment variables (``HYSCALE_<FIELD>``, uppercase), flags taking precedence.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any

_IMPLS = ("auto", "triton", "reference")
_LOSS_TARGETS = ("backward", "forward")


class HyScaleConfigError(ValueError):
    """A HyScale setting is invalid; the message says how to fix it."""


@dataclass
class HyScaleConfig:
    """Settings of the HyScale DSA layer."""

    enabled: bool = field(default=True, metadata={"doc": "Use HyScale's DSA core attention (--hyscale / --no-hyscale)."})
    topk_impl: str = field(
        default="auto",
        metadata={"doc": "Top-k selection: 'triton' (HyTopK kernel), 'reference' (chunked PyTorch), "
                          "'auto' (HyTopK on CUDA, reference on CPU)."},
    )
    attn_impl: str = field(
        default="auto",
        metadata={"doc": "Sparse attention + indexer loss: 'triton', 'reference', or 'auto' (Triton on CUDA)."},
    )
    loss_target: str = field(
        default="backward",
        metadata={"doc": "Where the sparse-stage indexer-loss target (head-summed attention probabilities) comes "
                          "from on the kernel path: 'backward' (the attention backward's own P, no extra QK pass; "
                          "the loss value is then known in the backward and added to Megatron's indexer-loss "
                          "tracker there: logged values unchanged, the forward's loss tensor is 0) or 'forward' "
                          "(a target kernel re-runs QK over the selected keys in the forward)."},
    )
    loss_tp_split: bool = field(
        default=False,
        metadata={"doc": "With tensor parallelism and loss_target='backward': each TP rank computes the sparse-stage "
                          "indexer loss's KL and indexer backward for 1/TP of the query rows (the indexer is "
                          "duplicated on every rank, so otherwise every rank computes all of it) and the indexer "
                          "gradients are gathered / summed over the TP group (dq rows all-gathered, dk all-reduced): "
                          "same loss value and gradients on every rank."},
    )
    replay: bool = field(
        default=True,
        metadata={"doc": "Selection replay: recompute reuses the forward's top-k (keyed by layer, microbatch)."},
    )
    replay_offload: bool = field(
        default=False,
        metadata={"doc": "Keep replayed indices in pinned host memory between forward and recompute."},
    )
    replay_prefetch: bool = field(
        default=True,
        metadata={"doc": "With replay_offload: while a layer's recompute runs, copy the next layer's indices back on "
                          "a side stream (hides the copy, holds one more [T, topk] entry on the GPU: 8 KiB/token "
                          "at topk 2048). --no-hyscale-replay-prefetch copies each entry back when its recompute "
                          "reads it (the 1M-token setting)."},
    )
    replay_compact: bool = field(
        default=True,
        metadata={"doc": "Store replayed indices as int16 when every key position fits (S <= 32768), else int32."},
    )
    deterministic: bool = field(
        default=False,
        metadata={"doc": "Deterministic gradient reductions in the sparse kernels (slower)."},
    )
    mla_up_proj_recompute: bool = field(
        default=True,
        metadata={"doc": "Under full recompute, also discard the absorbed-MLA up-projection outputs (absorbed "
                          "query, latent key) inside the recomputed layer and rebuild them when the attention "
                          "backward starts (Megatron's mla_up_proj mechanism, which stock gates to selective "
                          "recompute): ~25 KB/token less at the layer's backward peak for two small GEMMs."},
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "HyScaleConfig":
        for name in ("topk_impl", "attn_impl"):
            val = getattr(self, name)
            if val not in _IMPLS:
                raise HyScaleConfigError(
                    f"HyScaleConfig.{name}={val!r} is invalid; choose one of {', '.join(_IMPLS)} "
                    f"(flag --hyscale-{name.replace('_', '-')}, env HYSCALE_{name.upper()})."
                )
        if self.loss_target not in _LOSS_TARGETS:
            raise HyScaleConfigError(
                f"HyScaleConfig.loss_target={self.loss_target!r} is invalid; choose one of {', '.join(_LOSS_TARGETS)} "
                "(flag --hyscale-loss-target, env HYSCALE_LOSS_TARGET).")
        for name in ("enabled", "replay", "replay_offload", "replay_prefetch", "replay_compact", "deterministic",
                     "mla_up_proj_recompute", "loss_tp_split"):
            if not isinstance(getattr(self, name), bool):
                raise HyScaleConfigError(f"HyScaleConfig.{name} must be a bool, got {getattr(self, name)!r}.")
        if self.loss_tp_split and self.loss_target != "backward":
            raise HyScaleConfigError(
                "HyScaleConfig.loss_tp_split=True splits the deferred loss (loss_target='backward') over the TP ranks; "
                f"loss_target={self.loss_target!r} has no such split (drop --hyscale-loss-tp-split or use "
                "--hyscale-loss-target backward).")
        if self.replay_offload and not self.replay:
            raise HyScaleConfigError(
                "HyScaleConfig.replay_offload=True needs replay=True: offloading applies to replayed "
                "indices (drop --hyscale-replay-offload or add --hyscale-replay)."
            )
        return self

    def replace(self, **changes: Any) -> "HyScaleConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ=None, **overrides: Any) -> "HyScaleConfig":
        """Defaults, then ``HYSCALE_<FIELD>`` environment variables, then ``overrides``."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(f"HYSCALE_{f.name.upper()}")
            if raw is None:
                continue
            if f.type in (bool, "bool"):
                low = raw.strip().lower()
                if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise HyScaleConfigError(f"HYSCALE_{f.name.upper()}={raw!r}: use 1/0, true/false, on/off.")
                values[f.name] = low in ("1", "true", "yes", "on")
            else:
                values[f.name] = raw.strip()
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def from_args(cls, args) -> "HyScaleConfig":
        """Build from a Megatron ``args`` namespace carrying the ``--hyscale-*`` flags."""
        overrides = {}
        for f in fields(cls):
            attr = "hyscale" if f.name == "enabled" else f"hyscale_{f.name}"
            if hasattr(args, attr):
                overrides[f.name] = getattr(args, attr)
        return cls.from_env(**overrides)


def config_table_markdown() -> str:
    """Markdown table of every field, its flag, env variable and default (used by the README)."""
    rows = ["| field | flag | env | default | meaning |", "|---|---|---|---|---|"]
    for f in fields(HyScaleConfig):
        flag = "--hyscale / --no-hyscale" if f.name == "enabled" else f"--hyscale-{f.name.replace('_', '-')}"
        rows.append(f"| {f.name} | `{flag}` | `HYSCALE_{f.name.upper()}` | `{f.default}` | {f.metadata['doc']} |")
    return "\n".join(rows)
