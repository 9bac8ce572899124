"""Make the repo importable from a plain checkout (no pip install): registers kernels/ as
``hyscale_kernels`` when that package is not installed. Benchmarks only; the product never
imports bench/."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup() -> str:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    if "hyscale_kernels" not in sys.modules:
        try:
            import hyscale_kernels  # noqa: F401  (installed, e.g. pip install -e .)
        except ImportError:
            spec = importlib.util.spec_from_file_location(
                "hyscale_kernels", os.path.join(ROOT, "kernels", "__init__.py"),
                submodule_search_locations=[os.path.join(ROOT, "kernels")])
            mod = importlib.util.module_from_spec(spec)
            sys.modules["hyscale_kernels"] = mod
            spec.loader.exec_module(mod)
    return ROOT
