"""Shared by the kernel test files: re-run a test file's CPU kernel tests under TRITON_INTERPRET=1.

conftest.py sets the interpreter before Triton is imported when there is no GPU; a process that
imported Triton without it (e.g. a GPU-less run with TRITON_INTERPRET=0 set by the caller) runs
those tests in a fresh process instead.
"""

import os
import subprocess
import sys

import pytest
import torch


def rerun_under_interpreter(path: str, timeout: int = 600) -> None:
    """Run ``path``'s tests (except subprocess and GPU ones) in a fresh TRITON_INTERPRET=1 process."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the Triton tests of this file already ran in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", path,
                        "-k", "not subprocess and not gpu"], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def compile_sm90_in_subprocess(script: str, timeout: int = 900) -> str:
    """Run ``script`` (Python that compiles kernels for sm_90a with triton.compile, no GPU needed) in a
    fresh process without the interpreter; its stdout. Skips when Triton ships no ptxas."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("no bundled ptxas: cannot compile for sm_90")
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout
