"""Register an extra ``dsa_kernel_backend`` name with stock Megatron's DSA hook mechanism.

Stock chooses optional fused DSA kernels by ``config.dsa_kernel_backend`` ('none' | 'tilelang' |
'cudnn'): ``dsa_kernels._BACKEND_MODULE_NAME_BY_BACKEND`` maps the name to a module whose
``run_fused_qk_topk`` / ``run_fused_absorbed_sparse_attention`` / ... functions are called, and
``megatron.core.utils._VALID_DSA_KERNEL_BACKENDS`` lists the accepted names. Adding a name to both
lets a stock ``DSAttention`` user select another implementation of those hooks.
"""

from __future__ import annotations

import logging

from ._base import MegatronPatchError, SUPPORTED_MEGATRON, megatron_version

logger = logging.getLogger("hyscale_patches")
KERNELS = "megatron.core.transformer.experimental_attention_variant.dsa_kernels"


def register_backend(name: str, module_name: str) -> bool:
    """Make ``dsa_kernel_backend=name`` load ``module_name``. Idempotent; True if newly added."""
    import importlib

    try:
        dsa_kernels = importlib.import_module(KERNELS)
        core_utils = importlib.import_module("megatron.core.utils")
        table = dsa_kernels._BACKEND_MODULE_NAME_BY_BACKEND
        valid = core_utils._VALID_DSA_KERNEL_BACKENDS
    except (ImportError, AttributeError) as exc:
        raise MegatronPatchError(
            f"register_backend({name!r}): expected {KERNELS}._BACKEND_MODULE_NAME_BY_BACKEND and "
            f"megatron.core.utils._VALID_DSA_KERNEL_BACKENDS in megatron-core{SUPPORTED_MEGATRON} "
            f"(installed: {megatron_version()}): {exc}") from exc
    if table.get(name) == module_name and name in valid:
        return False
    table[name] = module_name
    if name not in valid:
        core_utils._VALID_DSA_KERNEL_BACKENDS = tuple(valid) + (name,) if isinstance(valid, tuple) else valid | {name}
    logger.info("hyscale: registered dsa_kernel_backend=%r -> %s", name, module_name)
    return True
