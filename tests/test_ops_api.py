"""The public ops: ``hyscale_megatron.ops`` re-exports them by name (no lazy lookup), and each op chooses between
its Triton kernel and its PyTorch reference in one place (``hyscale_kernels._common.use_triton``): on a plain CPU
(no interpreter) the references run, each op logs that once, and the op without a reference path says what it
needs."""

import inspect
import os
import subprocess
import sys

import pytest
import torch

from hyscale_kernels import _common


def test_ops_are_explicit_reexports():
    from hyscale_megatron import ops

    assert not hasattr(ops, "__getattr__"), "re-exports are plain imports, visible to IDEs and type checkers"
    for name in ops.__all__:
        obj = getattr(ops, name)
        assert callable(obj) and obj.__module__.startswith("hyscale_kernels."), name
    src = inspect.getsource(ops)
    assert all(f"    {name},\n" in src or f" import {name}\n" in src for name in ops.__all__)


def test_use_triton_choices(monkeypatch, caplog):
    cpu = torch.zeros(1)
    monkeypatch.setattr(_common, "_logged", set())
    monkeypatch.setattr(_common, "interpreter_on", lambda: False)
    assert not _common.use_triton("op_a", cpu, "reference")
    with caplog.at_level("INFO", logger="hyscale_kernels"):
        assert not _common.use_triton("op_a", cpu) and not _common.use_triton("op_a", cpu)
        assert not _common.use_triton("op_b", cpu)
    assert caplog.text.count("op_a on CPU tensors") == 1 and caplog.text.count("op_b on CPU tensors") == 1
    with pytest.raises(RuntimeError, match="op_a: impl='triton' on CPU tensors needs TRITON_INTERPRET=1"):
        _common.use_triton("op_a", cpu, "triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        _common.use_triton("op_a", cpu, "cuda")
    monkeypatch.setattr(_common, "interpreter_on", lambda: True)
    assert _common.use_triton("op_a", cpu) and _common.use_triton("op_a", cpu, "triton")


_PLAIN_CPU = r"""
import logging, sys
import torch
logging.basicConfig(level=logging.INFO, format="%%(message)s")
sys.path.insert(0, %r)
import conftest  # noqa: F401  (hyscale_kernels on the path)
from hyscale_megatron import ops
from _sparse_cases import attn_case, loss_case

for _ in range(2):  # twice: one log line per op
    q, kv, idx, dout, _ = attn_case(T=5, N=3, V=32, R=16, S=20, K=8, device="cpu")
    a, b = q.requires_grad_(), kv.requires_grad_()
    out, lse = ops.sparse_mla(a, b, idx, 0.3, v_dim=32)
    (out * dout).sum().backward()
    ref_out, _ = ops.sparse_mla_reference(q, kv, idx, 0.3, v_dim=32)
    assert torch.equal(out, ref_out) and a.grad is not None
    q_idx, w, k_idx, query, kv, idx = loss_case(T=6, S=20, N=3, topk=8)
    qi = q_idx.requires_grad_()
    s = ops.selected_scores(qi, w, k_idx, idx)
    assert torch.equal(s, ops.selected_scores_reference(q_idx, w, k_idx, idx))
    loss = ops.sparse_indexer_loss(qi, w, k_idx, query, kv, idx, 0.3, 0.1, v_dim=32)
    ref = ops.sparse_indexer_loss_reference(q_idx, w, k_idx, query, kv, idx, 0.3, 0.1)
    torch.testing.assert_close(loss, ref)
    (loss + s[torch.isfinite(s)].sum()).backward()
    seen = []
    out, lse, loss = ops.sparse_mla_with_indexer_loss(query, kv, idx, 0.3, q_idx, w, k_idx, v_dim=32,
                                                      on_value=seen.append)
    assert loss.item() == 0.0 and len(seen) == 1 and seen[0] > 0
"""


def test_plain_cpu_runs_the_references_and_says_so_once():
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", _PLAIN_CPU % os.path.dirname(__file__)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for op in ("sparse_mla", "selected_scores", "sparse_indexer_loss", "sparse_mla_with_indexer_loss"):
        assert r.stderr.count(f"hyscale_kernels: {op} on CPU tensors without TRITON_INTERPRET=1 uses its PyTorch "
                              "reference") == 1, r.stderr[-3000:]
