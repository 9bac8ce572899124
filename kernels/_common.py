"""Small helpers shared by the ops: input checks with clear messages, and the kernel-or-reference choice."""

from __future__ import annotations

import logging
import os

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


IMPLS = ("auto", "triton", "reference")
_log = logging.getLogger("hyscale_kernels")
_logged: set[str] = set()


def interpreter_on() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``, set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(op: str, t: torch.Tensor, impl: str = "auto") -> bool:
    """Whether ``op`` runs its Triton kernel on tensors like ``t`` (else its PyTorch reference).

    impl "triton": the kernel (on CPU tensors only under the interpreter, else a clear error);
    "reference": the reference; "auto": the kernel on CUDA tensors and under the interpreter, the
    reference on plain CPU tensors -- logged once per op, so a slow path is never silent.
    """
    check(impl in IMPLS, f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return False
    kernel_ok = t.is_cuda or interpreter_on()
    if impl == "triton":
        if not kernel_ok:
            raise RuntimeError(f"{op}: impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton "
                               "is imported (or CUDA tensors)")
        return True
    if not kernel_ok and op not in _logged:
        _logged.add(op)
        _log.info("hyscale_kernels: %s on CPU tensors without TRITON_INTERPRET=1 uses its PyTorch reference", op)
    return kernel_ok
