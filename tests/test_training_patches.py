"""The overlays the tools apply (patches/training_compat.py) and the share_storage replacement of
patches/cpu_compat.py: apply-twice safety, logging once, behaviour, clear failure on a missing symbol."""

import logging

import pytest
import torch

from hyscale_patches import cpu_compat, training_compat
from hyscale_patches._base import MegatronPatchError, Patch


@pytest.fixture
def clean_patches():
    training_compat.revert()
    yield
    training_compat.revert()


def test_apply_twice_is_safe_and_logs_once(clean_patches, caplog):
    from megatron.core.datasets import utils

    original = utils.compile_helpers
    with caplog.at_level(logging.INFO, logger="hyscale_patches"):
        assert training_compat.apply(cpu=False) == ["skip-compile-helpers", "cpu-init-to-device",
                                                    "share-storage-build"]
        first = utils.compile_helpers
        training_compat.apply()
        assert utils.compile_helpers is first, "second apply must not wrap again"
        assert first.__wrapped__ is original
    assert sum("compile_helpers" in r.getMessage() and "patched" in r.getMessage() for r in caplog.records) == 1
    training_compat.revert()
    assert utils.compile_helpers is original
    training_compat.revert()  # reverting twice is harmless too
    assert utils.compile_helpers is original


def test_skip_compile_helpers_does_not_run_make(clean_patches, monkeypatch):
    import subprocess

    from megatron.core.datasets import utils

    assert training_compat.compiled_helpers_available(), "the megatron-core wheel ships helpers_cpp"

    def no_make(*a, **k):
        raise AssertionError("compile_helpers ran make")

    monkeypatch.setattr(subprocess, "run", no_make)
    training_compat.apply()
    assert utils.compile_helpers() is None
    # what pretrain's _compile_dependencies imports at call time is the patched function
    from megatron.core.datasets.utils import compile_helpers

    assert compile_helpers is utils.compile_helpers


def test_falls_back_to_original_without_prebuilt_helpers(clean_patches, monkeypatch):
    from megatron.core.datasets import utils

    calls = []
    monkeypatch.setattr(utils, "compile_helpers", lambda: calls.append("make"))
    monkeypatch.setattr(training_compat, "compiled_helpers_available", lambda: False)
    training_compat.apply()
    utils.compile_helpers()
    assert calls == ["make"]
    training_compat.revert()


def test_missing_symbol_names_symbol_and_version():
    p = Patch("probe", training_compat.DATASET_UTILS, "compile_helpers_renamed", lambda o: o)
    with pytest.raises(MegatronPatchError) as exc:
        p.apply()
    msg = str(exc.value)
    assert "megatron.core.datasets.utils.compile_helpers_renamed" in msg
    assert "0.19.2" in msg and "installed" in msg


def test_cpu_device_arch_patch(clean_patches):
    import torch
    from megatron.training import arguments

    original = arguments.get_device_arch_version
    assert training_compat.apply(cpu=True) == ["skip-compile-helpers", "cpu-init-to-device", "cpu-device-arch"]
    training_compat.apply(cpu=True)
    assert arguments.get_device_arch_version.__wrapped__ is original
    if not torch.cuda.is_available():
        assert arguments.get_device_arch_version() == 0
    training_compat.revert()
    assert arguments.get_device_arch_version is original


def test_cpu_init_to_device_moves_chunks_before_wrapping(clean_patches, monkeypatch, caplog):
    """Builder path + --use-cpu-initialization on a GPU: chunks go to the GPU before the original runs."""
    import torch
    from types import SimpleNamespace

    from megatron.training.models import dist_utils

    seen = []

    def original(model_list, transformer_config, pg_collection, **kw):
        seen.append([m.moved for m in model_list])
        return model_list

    class Chunk:
        moved = None

        def cuda(self, dev):
            self.moved = dev
            return self

    monkeypatch.setattr(dist_utils, "prepare_existing_model_chunks_for_distributed_training", original)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    training_compat.apply(cpu=False)
    fn = dist_utils.prepare_existing_model_chunks_for_distributed_training
    assert fn.__wrapped__ is original
    cfg = SimpleNamespace(use_cpu_initialization=True, init_model_with_meta_device=False)
    with caplog.at_level(logging.INFO, logger="hyscale_patches"):
        fn([Chunk(), Chunk()], cfg, None, use_torch_fsdp2=False)
        fn([Chunk()], cfg, None, use_torch_fsdp2=False)
    assert seen == [[3, 3], [3]], "chunks must be on the GPU when Megatron's wrapping starts"
    assert sum("moving the CPU-initialised model" in r.getMessage() for r in caplog.records) == 1
    # left alone: GPU initialisation, FSDP2 (it places the shards itself), meta-device init, no CUDA
    fn([Chunk()], SimpleNamespace(use_cpu_initialization=False, init_model_with_meta_device=False), None)
    fn([Chunk()], cfg, None, use_torch_fsdp2=True)
    fn([Chunk()], SimpleNamespace(use_cpu_initialization=True, init_model_with_meta_device=True), None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fn([Chunk()], cfg, None)
    assert seen[2:] == [[None]] * 4


# ----------------------------------------------------------------------------- share_storage without a C++ build
def test_copy_storage_acts_like_share_storage():
    """After the discard (storage resized to 0), every view of the output sees the recomputed values
    and no autograd version counter moves."""
    out = torch.arange(12.0).reshape(3, 4)
    view = out.view(4, 3)[1:]
    version = out._version
    out.untyped_storage().resize_(0)
    recomputed = torch.arange(12.0).reshape(3, 4) * 2
    cpu_compat.copy_storage(out, recomputed)
    assert torch.equal(out, recomputed) and torch.equal(view, recomputed.view(4, 3)[1:])
    assert out._version == version
    recomputed.zero_()
    assert out.abs().sum() > 0, "a copy: the recomputed tensor may be freed"


def test_cpu_share_storage_never_builds(monkeypatch):
    from megatron.core.tensor_parallel import random as tp_random

    monkeypatch.setattr(tp_random, "load_inline", lambda **kw: pytest.fail("no C++ build on CPU"))
    patch = next(p for p in cpu_compat.PATCHES if p.name == "cpu-share-storage-copy")
    was_applied = patch.applied  # the other CPU shims stay as they are
    patch.apply()
    try:
        assert tp_random._get_share_storage() is cpu_compat.copy_storage
    finally:
        if not was_applied:
            patch.revert()


def test_gpu_share_storage_build_says_so_and_falls_back(clean_patches, monkeypatch, tmp_path, capsys, caplog):
    from megatron.core.tensor_parallel import random as tp_random

    calls = []

    def failing_build():
        calls.append(1)
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    monkeypatch.setattr(tp_random, "_get_share_storage", failing_build)
    monkeypatch.setattr(training_compat, "extension_build_dir", lambda name: str(tmp_path))
    (tmp_path / "lock").write_text("")
    training_compat.apply(cpu=False)
    with caplog.at_level(logging.WARNING, logger="hyscale_patches"):
        assert tp_random._get_share_storage() is cpu_compat.copy_storage
        assert tp_random._get_share_storage() is cpu_compat.copy_storage
    assert len(calls) == 1, "one build attempt per process"
    out = capsys.readouterr().out.splitlines()
    assert out == [f"[hyscale] building Megatron's share_storage_ext C++ extension (first MLA up-projection "
                   f"recompute; once per extensions folder, tens of seconds) in {tmp_path}",
                   f"[hyscale] waiting for {tmp_path / 'lock'}: another process is building share_storage_ext "
                   "(delete the file if none is)"]
    warned = [r.getMessage() for r in caplog.records if "could not build" in r.getMessage()]
    assert len(warned) == 1 and "(Ninja is required to load C++ extensions);" in warned[0]
    training_compat.revert()
    # already built: silent, Megatron's own function
    (tmp_path / "lock").unlink()
    (tmp_path / "share_storage_ext.so").write_text("")
    built = object()
    monkeypatch.setattr(tp_random, "_get_share_storage", lambda: built)
    training_compat.apply(cpu=False)
    assert tp_random._get_share_storage() is built
    assert capsys.readouterr().out == ""
