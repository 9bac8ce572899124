"""Process setup for single-process runs (tests, benchmarks): process group, Megatron model-parallel state, seeds."""

from __future__ import annotations

import os
import socket

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(tp: int = 1, pp: int = 1, seed: int = 1234) -> None:
    """World size 1 (gloo on CPU, NCCL on CUDA), Megatron model-parallel state, seeds.

    Safe to call repeatedly in one process (tests): re-initialises model-parallel state only.
    """
    from hyscale_patches import cpu_compat  # noqa: PLC0415

    cpu_compat.apply()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
    from megatron.core import parallel_state  # noqa: PLC0415

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    seed_all(seed)


def seed_all(seed: int) -> None:
    from megatron.core.tensor_parallel import random as tp_random  # noqa: PLC0415

    torch.manual_seed(seed)
    tracker = tp_random.get_cuda_rng_tracker()
    tracker.reset()
    if torch.cuda.is_available():
        tp_random.model_parallel_cuda_manual_seed(seed)
    else:
        # CPU: the tracker's named states are CPU generator states.
        _cpu_tracker_seed(tracker, seed)


def _cpu_tracker_seed(tracker, seed: int) -> None:
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME  # noqa: PLC0415

    g = torch.get_rng_state()
    torch.manual_seed(seed + 2718)
    tracker.states_[_MODEL_PARALLEL_RNG_TRACKER_NAME] = torch.get_rng_state()
    tracker.seeds_.add(seed + 2718)
    torch.set_rng_state(g)
