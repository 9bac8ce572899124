"""Overlays onto ``megatron.training`` used by ``hyscale-train`` (Megatron's ``pretrain`` path).

Each is a :class:`~hyscale_patches._base.Patch` (idempotent, logged once, reversible, failing
with a message that names the Megatron symbol and the supported version). Needed on every
machine, GPU included:

* ``skip-compile-helpers``: megatron-core 0.19.2's ``pretrain`` -> ``initialize_megatron`` ->
  ``_compile_dependencies`` calls ``megatron.core.datasets.utils.compile_helpers()``, which runs
  ``make`` in the installed package folder. The wheel ships the compiled extension
  (``helpers_cpp*.so``) but no Makefile, so ``make`` fails and the job ``sys.exit(1)``s. The patch
  skips the compile when ``megatron.core.datasets.helpers_cpp`` imports and otherwise calls the
  original (a source checkout with a Makefile still compiles).
* ``cpu-init-to-device``: with ``--use-cpu-initialization`` (weights initialised on the host, as
  the CPU config does), megatron-core 0.19.2's builder path (``pretrain`` with a config
  container -> ``prepare_existing_model_chunks_for_distributed_training``) leaves the model on
  the CPU, unlike ``get_model``, which moves it to the GPU; the first forward then fails with a
  cuda/cpu device mismatch in the embedding. With CUDA present the patch moves the chunks to the
  current GPU first (as ``get_model`` does), logged once; without CUDA it calls the original.

Only with CUDA (``GPU``):

* ``share-storage-build``: ``CheckpointWithoutOutput`` (the MLA up-projection recompute, on by
  default in HyScale under full recompute) hands its recomputed outputs over with Megatron's
  ``share_storage`` C++ extension, compiled on first use (``load_inline``: tens of seconds, a C++
  compiler and ninja, a lock file in the extensions folder). The patch prints one line before
  that build (and one naming the lock file when another process holds it), and when the build
  fails (no compiler or ninja) warns once and copies the recomputed bytes instead
  (``hyscale_patches.cpu_compat.copy_storage``: same values, one more copy of those outputs in
  memory until the layer's backward ends).

Only without CUDA (``CPU``, applied by the core loop of ``hyscale-train`` on CPU):

* ``cpu-device-arch``: ``validate_args`` asks ``get_device_arch_version()`` (CUDA device
  properties) when TP or CP > 1; without CUDA it answers 0 (pre-Blackwell rules apply).

The other CPU shims (current device, CPU RNG, the schedules' ``device="cuda"`` token counter,
``share_storage`` by copy) live in ``hyscale_patches.cpu_compat``.
"""

from __future__ import annotations

import importlib
import logging
import os

from ._base import Patch

logger = logging.getLogger("hyscale_patches")

DATASET_UTILS = "megatron.core.datasets.utils"


def compiled_helpers_available() -> bool:
    """True when the wheel's compiled dataset helper extension imports."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    return True


def _skip_compile_helpers(original):
    def compile_helpers():
        if compiled_helpers_available():
            logger.info("hyscale: megatron.core.datasets.helpers_cpp is prebuilt; skipping compile_helpers() (make)")
            return None
        return original()

    compile_helpers.__wrapped__ = original
    return compile_helpers


def _cpu_device_arch(original):
    def get_device_arch_version():
        import torch  # noqa: PLC0415

        return original() if torch.cuda.is_available() else 0

    get_device_arch_version.__wrapped__ = original
    return get_device_arch_version


def _cpu_init_to_device(original):
    state = {"logged": False}

    def prepare_existing_model_chunks_for_distributed_training(model_list, transformer_config, *a, **kw):
        import torch  # noqa: PLC0415

        fsdp2 = kw.get("use_torch_fsdp2", a[4] if len(a) > 4 else False)
        if (torch.cuda.is_available() and getattr(transformer_config, "use_cpu_initialization", False)
                and not fsdp2 and not getattr(transformer_config, "init_model_with_meta_device", False)):
            if not state["logged"]:
                logger.info("hyscale: --use-cpu-initialization: moving the CPU-initialised model to "
                            "cuda:%d before Megatron's distributed wrapping (as get_model does)",
                            torch.cuda.current_device())
                state["logged"] = True
            for chunk in model_list:
                chunk.cuda(torch.cuda.current_device())
        return original(model_list, transformer_config, *a, **kw)

    prepare_existing_model_chunks_for_distributed_training.__wrapped__ = original
    return prepare_existing_model_chunks_for_distributed_training


SHARE_STORAGE_EXT = "share_storage_ext"


def extension_build_dir(name: str) -> str:
    """The folder where torch builds and caches the C++ extension ``name`` (``TORCH_EXTENSIONS_DIR``)."""
    from torch.utils import cpp_extension  # noqa: PLC0415

    return cpp_extension._get_build_directory(name, verbose=False)


def _share_storage_build(original):
    state: dict = {"fn": None}

    def _get_share_storage():
        if state["fn"] is not None:
            return state["fn"]
        folder = extension_build_dir(SHARE_STORAGE_EXT)
        if not os.path.exists(os.path.join(folder, SHARE_STORAGE_EXT + ".so")):
            print(f"[hyscale] building Megatron's {SHARE_STORAGE_EXT} C++ extension (first MLA up-projection "
                  f"recompute; once per extensions folder, tens of seconds) in {folder}", flush=True)
        lock = os.path.join(folder, "lock")
        if os.path.exists(lock):
            print(f"[hyscale] waiting for {lock}: another process is building {SHARE_STORAGE_EXT} (delete the "
                  "file if none is)", flush=True)
        try:
            state["fn"] = original()
        except (RuntimeError, OSError) as exc:  # no compiler / ninja: the build raises
            from .cpu_compat import copy_storage  # noqa: PLC0415

            first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
            logger.warning("hyscale: could not build %s (%s); copying the recomputed MLA up-projection outputs "
                           "instead (same values, one more copy of them in memory during each layer's backward). "
                           "Install a C++ compiler and ninja to share them without a copy, or turn the recompute "
                           "off with --no-hyscale-mla-up-proj-recompute.", SHARE_STORAGE_EXT, first)
            state["fn"] = copy_storage
        return state["fn"]

    _get_share_storage.__wrapped__ = original
    return _get_share_storage


ALWAYS = [
    Patch("skip-compile-helpers", DATASET_UTILS, "compile_helpers", _skip_compile_helpers),
    Patch("cpu-init-to-device", "megatron.training.models.dist_utils",
          "prepare_existing_model_chunks_for_distributed_training", _cpu_init_to_device),
]
GPU = [
    Patch("share-storage-build", "megatron.core.tensor_parallel.random", "_get_share_storage", _share_storage_build),
]
CPU = [
    Patch("cpu-device-arch", "megatron.training.arguments", "get_device_arch_version", _cpu_device_arch),
]
PATCHES = ALWAYS + GPU + CPU


def apply(cpu: bool | None = None) -> list[str]:
    """Apply ``ALWAYS`` and ``GPU`` with CUDA, or ``ALWAYS`` and ``CPU`` without it (or with ``cpu=True``);
    safe to call again. Returns the names of the patches applied by this call or before.
    """
    if cpu is None:
        import torch  # noqa: PLC0415

        cpu = not torch.cuda.is_available()
    chosen = ALWAYS + (CPU if cpu else GPU)
    for p in chosen:
        p.apply()
    return [p.name for p in chosen]


def revert() -> None:
    for p in reversed(PATCHES):
        p.revert()
