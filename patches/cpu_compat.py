"""Make megatron-core 0.19.x's model code run on a machine without CUDA.

Applied only when ``torch.cuda.is_available()`` is False. Stock calls
``torch.cuda.current_device()`` as a device (rotary embeddings, the indexer-loss tracker) and
saves/restores the CUDA RNG around checkpointed regions; on CPU those become the CPU device and
the CPU RNG. Context-parallel RoPE picks its position chunks with a CUDA index; here it indexes on the
embedding's device. The pipeline schedules create a token counter with ``device="cuda"``; inside that
module only, such factories create CPU tensors.

``CheckpointWithoutOutput`` (the MLA up-projection recompute) hands its recomputed outputs to the
discarded ones with ``share_storage``, a C++ extension Megatron compiles on first use (tens of
seconds, a C++ compiler and ninja). On CPU the recomputed bytes are copied into the discarded
storage instead (:func:`copy_storage`): same values, no compiler, one more copy of those outputs
in host memory until the layer's backward ends. Nothing changes on a GPU machine.
"""

from __future__ import annotations

import torch

from ._base import Patch

RANDOM = "megatron.core.tensor_parallel.random"


def _current_device(_orig):
    def current_device():
        return "cpu"

    return current_device


def _get_rng(_orig):
    from megatron.core.tensor_parallel import random as tp_random

    def _get_all_rng_states():
        return torch.get_rng_state(), None, tp_random.get_cuda_rng_tracker().get_states()

    return _get_all_rng_states


def _set_rng(_orig):
    from megatron.core.tensor_parallel import random as tp_random

    def _set_all_rng_states(cpu_rng_state, cuda_rng_state, cuda_rng_state_tracker):
        torch.set_rng_state(cpu_rng_state)
        tp_random.get_cuda_rng_tracker().set_states(cuda_rng_state_tracker)

    return _set_all_rng_states


def _cp_pos_emb(_orig):
    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        """Stock's zigzag pick of this CP rank's two position chunks, indexed on pos_emb's device (stock
        builds the index in pinned memory and moves it to CUDA)."""
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
        picked = chunks.index_select(seq_dim, idx)
        return picked.view(*picked.shape[:seq_dim], -1, *picked.shape[seq_dim + 2:])

    return get_pos_emb_on_this_cp_rank


class _CpuTorchProxy:
    """``torch`` as seen by the pipeline schedules: ``device="cuda"`` tensor factories land on CPU."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor")

    def __init__(self, torch_module):
        self._torch = torch_module

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name in self._FACTORIES:
            def factory(*args, **kwargs):
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return attr(*args, **kwargs)

            return factory
        return attr


def _schedules_torch(orig):
    return _CpuTorchProxy(orig)


def copy_storage(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``share_storage(dst, src)`` by copying: ``dst``'s storage (resized to 0 when its output was
    discarded) gets ``src``'s bytes. Storage-level, so every view of ``dst`` sees them and no
    autograd version counter changes."""
    storage = dst.untyped_storage()
    storage.resize_(src.untyped_storage().nbytes())
    storage.copy_(src.untyped_storage())


def _share_storage_by_copy(_orig):
    def _get_share_storage():
        return copy_storage

    return _get_share_storage


PATCHES = [
    Patch("cpu-current-device", "torch.cuda", "current_device", _current_device),
    Patch("cpu-rng-get", RANDOM, "_get_all_rng_states", _get_rng),
    Patch("cpu-rng-set", RANDOM, "_set_all_rng_states", _set_rng),
    Patch("cpu-cp-rope", "megatron.core.models.common.embeddings.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank",
          _cp_pos_emb),
    Patch("cpu-cp-yarn", "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
          "get_pos_emb_on_this_cp_rank", _cp_pos_emb),
    Patch("cpu-schedules-device", "megatron.core.pipeline_parallel.schedules", "torch", _schedules_torch),
    Patch("cpu-share-storage-copy", RANDOM, "_get_share_storage", _share_storage_by_copy),
]


def needed() -> bool:
    return not torch.cuda.is_available()


def apply(force: bool = False) -> bool:
    """Apply when there is no CUDA (or ``force``). Returns whether the patches are active."""
    if not (force or needed()):
        return False
    for p in PATCHES:
        p.apply()
    return True


def revert() -> None:
    for p in PATCHES:
        p.revert()
