"""HyScale kernels as stock Megatron DSA kernel-backend hooks (``dsa_kernel_backend='hyscale'``).

For users who keep stock ``DSAttention`` (no HyScale layer spec) but want HyTopK selection and
the sparse MLA kernel: call :func:`register` once (``hyscale-train`` does it), then set
``--dsa-kernel-backend hyscale``. Stock calls the hooks below; hooks it finds missing
(``run_fused_dsa_attention``, ``run_fused_qk_topk_with_loss``) fall back to stock's PyTorch path.
Selection replay needs the HyScale layer spec; this backend only swaps kernels.
"""

from __future__ import annotations

from typing import Optional

import torch

BACKEND_NAME = "hyscale"


def register() -> None:
    from hyscale_patches.dsa_backend_registry import register_backend  # noqa: PLC0415

    register_backend(BACKEND_NAME, __name__)


def run_fused_qk_topk(*, q, k, weights, index_topk, starts, ends, block_size=None, use_relu=True,
                      use_local_indexer_varlen=False, single_packed_thd_sequence=False, local_packed_cp_rank=0,
                      local_packed_cp_query_start=0, local_packed_cp_query_len=None, packed_seq_params=None,
                      cp_size=1):
    """Stock hook: q [sq, b, H, D], k [sk, b, D], weights [sq, b, H], int32 bounds [sq] ->
    (int32 [b, sq, min(topk, sk)] -1 padded, None). Declines (None) layouts it does not own."""
    if use_local_indexer_varlen:
        return None  # local-CP packed varlen bounds are rank-local: leave to stock
    from hyscale_kernels.hytopk import hytopk  # noqa: PLC0415

    sq, b = q.shape[0], q.shape[1]
    kk = min(int(index_topk), k.shape[0])
    out = torch.empty(b, sq, kk, dtype=torch.int32, device=q.device)
    st, en = starts.to(torch.int32).contiguous(), ends.to(torch.int32).contiguous()
    for bi in range(b):
        out[bi] = hytopk(q[:, bi].contiguous(), weights[:, bi].contiguous(), k[:, bi].contiguous(), st, en, kk,
                         relu=use_relu)
    return out, None


def run_fused_absorbed_sparse_attention(query, key, topk_indices, softmax_scale, v_channels,
                                        topk_length: Optional[torch.Tensor] = None):
    """Stock hook: query [sq, b, N, Dqk], key [sk, b, 1, Dqk], indices [b, sq, k] -> [sq, b, N, v]."""
    if topk_length is not None or key.dim() != 4 or key.size(2) != 1:
        return None
    from hyscale_kernels.sparse_mla import sparse_mla  # noqa: PLC0415

    outs = [sparse_mla(query[:, bi], key[:, bi, 0], topk_indices[bi], softmax_scale, v_dim=v_channels)[0]
            for bi in range(query.shape[1])]
    return torch.stack(outs, dim=1)
