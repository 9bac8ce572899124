"""Small helpers shared by the ops: input checks with clear messages."""

from __future__ import annotations

import torch


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_tensor(name: str, t, ndim: int | None = None, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all inputs on one device)")


def row_chunk(n_cols: int, budget_elems: int = 1 << 24) -> int:
    """Rows per chunk so that a [rows, n_cols] fp32 working tile stays under ``budget_elems``."""
    return max(1, min(1 << 16, budget_elems // max(1, n_cols)))
