"""Deterministic row scatter-add: ``dst[keys[e]] += src[e]`` with a fixed summation order.

Used for gradients to a shared key table (``kv`` of sparse attention, ``k`` of the indexer)
when ``deterministic=True``: contributions are sorted by key (stable), and one program owns
each distinct key and adds its contributions in order, so no two programs touch one row and
no float atomics are used. Costs a sort of O(E) keys plus one pass over ``src``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _segment_sum_kernel(
    src, order, seg_start, seg_key, dst,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_u = tl.program_id(0)  # one distinct key
    i_d = tl.program_id(1)  # one column block
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_d = o_d < D
    e0 = tl.load(seg_start + i_u)
    e1 = tl.load(seg_start + i_u + 1)
    b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # [BLOCK_D]
    # ascending source order: deterministic. (A while loop: the interpreter with numpy >= 2.5
    # cannot run `range` over runtime bounds.)
    e = e0
    while e < e1:
        row = tl.load(order + e).to(tl.int64)
        b_acc += tl.load(src + row * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        e += 1
    key = tl.load(seg_key + i_u).to(tl.int64)
    p_dst = dst + key * D + o_d
    tl.store(p_dst, tl.load(p_dst, mask=m_d, other=0.0) + b_acc, mask=m_d)


def deterministic_scatter_add_(dst: torch.Tensor, keys: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst[keys[e]] += src[e]`` for keys >= 0 (negative keys are skipped), in a fixed order.

    dst: fp32 [S, D] contiguous (updated in place); keys: int [E]; src: [E, D] contiguous.
    """
    S, D = dst.shape
    keys = keys.reshape(-1).long()
    sort_key = torch.where(keys >= 0, keys, torch.full_like(keys, S))  # padding sorts last
    sorted_keys, order = torch.sort(sort_key, stable=True)
    uniq, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    starts = torch.zeros(uniq.numel() + 1, dtype=torch.int64, device=keys.device)
    starts[1:] = torch.cumsum(counts, 0)
    n_seg = int(uniq.numel()) - int(bool(uniq.numel()) and int(uniq[-1]) == S)
    if n_seg == 0:
        return dst
    BLOCK_D = min(256, triton.next_power_of_2(D))
    grid = (n_seg, triton.cdiv(D, BLOCK_D))
    _segment_sum_kernel[grid](src, order, starts, uniq, dst, D=D, BLOCK_D=BLOCK_D)
    return dst
