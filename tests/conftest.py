"""Test setup shared by every test module.

TRITON_INTERPRET must be set before triton is first imported (megatron imports it), so on a
machine without CUDA the Triton kernels run in the interpreter at tiny shapes.
"""

import os

try:  # decide before anything imports triton
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # noqa: BLE001
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest_plugins = ["_instafail"]  # HYSCALE_TEST_INSTAFAIL=1: failures reported when they happen (device calls)

try:  # an uninstalled checkout (e.g. the GPU machine): import kernels/ and patches/ from the repo
    import hyscale_kernels  # noqa: F401
except ImportError:
    import importlib.util
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, _root)
    for _name, _folder in (("hyscale_kernels", "kernels"), ("hyscale_patches", "patches")):
        _path = os.path.join(_root, _folder)
        _spec = importlib.util.spec_from_file_location(_name, os.path.join(_path, "__init__.py"),
                                                       submodule_search_locations=[_path])
        _mod = importlib.util.module_from_spec(_spec)
        sys.modules[_name] = _mod
        _spec.loader.exec_module(_mod)


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def megatron_env():
    """Single-process gloo/NCCL group + Megatron model-parallel state (TP=PP=1)."""
    from hyscale_megatron.env import init_single_process

    init_single_process()
    yield


@pytest.fixture(autouse=True)
def _fresh_global_state():
    """Stock keeps the indexer-loss tracker (sized by num_layers) and we keep the replay store
    process-wide: reset both around every test so one test's leftovers cannot leak."""
    yield
    try:
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexerLossAutoScaler,
            DSAIndexerLossLoggingHelper,
        )

        DSAIndexerLossLoggingHelper.tracker.clear()
        # A bare backward creates this scale as a 0-d tensor; the schedules later copy a [1]-shaped
        # one into it. Real training always sets it through the schedule first.
        DSAIndexerLossAutoScaler.main_loss_backward_scale = None
    except ImportError:
        pass
    try:
        from hyscale_megatron import replay

        replay.get_store().clear(warn=False)
    except ImportError:
        pass
