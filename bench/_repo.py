"""Import the product from a plain checkout (the GPU machine has no pip install of it).

Registers ``kernels/`` as ``hyscale_kernels`` and ``patches/`` as ``hyscale_patches`` and puts the
repo root on ``sys.path`` (for ``hyscale_megatron``). No-op when the package is installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _register(name: str, folder: str) -> None:
    if name in sys.modules:
        return
    try:
        if importlib.util.find_spec(name) is not None:
            return
    except (ImportError, ValueError):
        pass
    path = os.path.join(ROOT, folder)
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def setup() -> str:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    _register("hyscale_kernels", "kernels")
    _register("hyscale_patches", "patches")
    return ROOT


setup()
