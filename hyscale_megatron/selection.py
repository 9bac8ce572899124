"""Top-k selection for the HyScale DSA layer: HyTopK or the chunked reference.

Takes the indexer tensors in Megatron's [s, b, ...] layout and the row bounds stock builds,
returns int32 indices [b, sq, min(topk, sk)], -1 padded, canonical tie rule.
"""

from __future__ import annotations

from typing import Optional

import torch

from hyscale_kernels.hytopk import op as hytopk_op
from hyscale_kernels.hytopk import reference as hytopk_ref

from ._log import log_once


def _hytopk_kernel():
    try:
        from hyscale_kernels.hytopk import hytopk  # noqa: PLC0415
    except ImportError:
        return None
    return hytopk


def hytopk_unsupported(n_heads: int, head_dim: int, topk: int) -> Optional[str]:
    """Why HyTopK cannot take this indexer shape, naming the Megatron fields (None if it can)."""
    why = hytopk_op.shape_unsupported(n_heads, head_dim, topk)
    if why is None:
        return None
    return (f"dsa_indexer_n_heads={n_heads}, dsa_indexer_head_dim={head_dim}, dsa_indexer_topk={topk}: "
            f"HyTopK's {why}")


def select_rows(q, w, k, starts, ends, topk: int, relu: bool, impl: str) -> torch.Tensor:
    """One sequence: q [T, H, D], w [T, H], k [S, D], int32 bounds [T] -> int32 [T, topk]."""
    use_kernel = impl == "triton" or (impl == "auto" and q.is_cuda)
    if use_kernel and impl == "auto":
        why = hytopk_unsupported(q.shape[1], q.shape[2], topk)
        if why is not None:
            log_once("topk-shape", "hyscale: %s; top-k runs the chunked PyTorch reference", why)
            use_kernel = False
    if use_kernel:
        fn = _hytopk_kernel()
        if fn is None:
            if impl == "triton":
                raise RuntimeError("topk_impl='triton' requested but hyscale_kernels.hytopk.hytopk is unavailable")
        else:
            # bounds come from stock's own mask builder: skip the kernel's bounds check (a device sync)
            return fn(q.contiguous(), w.contiguous(), k.contiguous(), starts, ends, topk, relu=relu,
                      check_bounds=False)
    if q.is_cuda:
        log_once("topk-ref-cuda", "hyscale: top-k on CUDA uses the chunked PyTorch reference (topk_impl=%s)", impl)
    return hytopk_ref.hytopk_reference(q, w, k, starts, ends, topk, relu=relu)


def select_rows_masked(q, w, k, valid: torch.Tensor, additive: Optional[torch.Tensor], topk: int, relu: bool):
    """General-mask fallback (explicit attention masks, non-identity key positions).

    valid: bool [T, S]; additive: optional fp32 [T, S] added to the scores. Chunked over rows.
    """
    log_once("topk-masked", "hyscale: explicit attention mask -> top-k via the chunked PyTorch reference")
    T, S = q.shape[0], k.shape[0]
    out = torch.empty(T, topk, dtype=torch.int32, device=q.device)
    rows = max(1, (1 << 22) // max(1, S))
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        sc = hytopk_ref.index_scores_reference(q[r0:r1], w[r0:r1], k, relu)
        if additive is not None:
            sc = sc + additive[r0:r1]
        sc = sc.masked_fill(~valid[r0:r1], float("-inf"))
        n = r1 - r0  # the mask is already in the scores: every row "sees" [0, S)
        whole = torch.zeros(n, dtype=torch.int32, device=q.device), torch.full((n,), S, dtype=torch.int32, device=q.device)
        idx, vals = hytopk_ref.topk_from_scores(sc, *whole, topk)
        out[r0:r1] = idx.masked_fill(vals == float("-inf"), -1)
    return out
