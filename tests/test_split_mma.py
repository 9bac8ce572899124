"""kernels/_split_mma.py: the compile hook that splits a replicated chained-dot MMA tile over warpgroups.

CPU: the TTGIR rewrite rule on text, the hook's install / chaining, the Triton version gate (the hook applies
only where it is verified; elsewhere kernels compile without it). tests/test_sm90_compile.py compiles the
kernels for sm_90a with and without the split. GPU: the split kernels against the fp32 reference and the
unsplit kernels.
"""

import pytest
import torch

from hyscale_kernels import _split_mma as sm
from _sparse_cases import gpu_attn_case, nan_alloc, rel_l2

M = sm.MARKER
SUPPORTED = sm.supported  # the gate itself (fresh_hook opens it)


def _ttgir(warps, instr_n, dots, marker=True, minor=0):
    """A TTGIR-like text: one MMA-v3 alias and warp_group_dot lines producing [m, n] tiles of it."""
    lines = [f"#mma = #ttg.nvidia_mma<{{versionMajor = 3, versionMinor = {minor}, warpsPerCTA = "
             f"[{warps[0]}, {warps[1]}], instrShape = [16, {instr_n}, 16]}}>",
             "#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 2], "
             "instrShape = [16, 256, 16]}>",
             "module {", "  tt.func public @k() {"]
    if marker:
        lines.append(f'    %0 = tt.elementwise_inline_asm "mov.b32 $0, $1; // {M}"')
    for m, n in dots:
        lines.append(f"    %s = ttng.warp_group_dot %a, %b, %c : !ttg.memdesc<{m}x576xbf16> * "
                     f"!ttg.memdesc<576x{n}xbf16> -> tensor<{m}x{n}xf32, #mma> loc(#loc1)")
    lines.append("    %p = ttng.warp_group_dot %p, %v, %acc -> tensor<64x512xf32, #mma1>")
    return "\n".join(lines + ["  }", "}"])


def _alias(text, name="mma"):
    return next(l for l in text.splitlines() if l.startswith(f"#{name} ="))


def test_rewrite_splits_replicated_rows():
    new, notes = sm.rewrite(_ttgir((8, 1), 32, [(64, 64)]))
    assert "warpsPerCTA = [4, 2], instrShape = [16, 32, 16]" in _alias(new)
    assert notes == ["#mma [64x64]: warpsPerCTA [8, 1] -> [4, 2], instr N 32 -> 32"]
    assert _alias(new, "mma1") == _alias(_ttgir((8, 1), 32, [(64, 64)]), "mma1")  # [4, 2] already: kept


def test_rewrite_narrows_the_instruction_to_the_warpgroup_columns():
    new, _ = sm.rewrite(_ttgir((8, 1), 64, [(64, 64)]))  # one n64 instruction per row block -> n32 each
    assert "warpsPerCTA = [4, 2], instrShape = [16, 32, 16]" in _alias(new)
    new, _ = sm.rewrite(_ttgir((16, 1), 64, [(64, 64)]))  # 4 warpgroups over 64 columns
    assert "warpsPerCTA = [4, 4], instrShape = [16, 16, 16]" in _alias(new)
    new, _ = sm.rewrite(_ttgir((16, 1), 64, [(128, 64)]))  # 2 row blocks x 2 column blocks
    assert "warpsPerCTA = [8, 2], instrShape = [16, 32, 16]" in _alias(new)
    new, _ = sm.rewrite(_ttgir((8, 1), 32, [(64, 32)], minor=1))  # the minor version is kept
    assert "versionMinor = 1, warpsPerCTA = [4, 2], instrShape = [16, 16, 16]" in _alias(new)


@pytest.mark.parametrize("case", [
    dict(warps=(8, 1), instr_n=32, dots=[(128, 64)]),  # 8 warps x 16 rows = 128: nothing replicated
    dict(warps=(4, 2), instr_n=32, dots=[(64, 64)]),  # already split
    dict(warps=(8, 1), instr_n=8, dots=[(64, 8)]),  # 8 columns cannot split into two wgmma widths
    dict(warps=(8, 1), instr_n=32, dots=[(64, 64), (64, 32)]),  # one alias, two tile shapes: ambiguous
    dict(warps=(8, 1), instr_n=32, dots=[]),  # no dot produces the alias
    dict(warps=(8, 1), instr_n=32, dots=[(64, 64)], marker=False),  # not opted in
])
def test_rewrite_leaves_other_layouts(case):
    text = _ttgir(**case)
    new, notes = sm.rewrite(text)
    assert new == text and notes == []


@pytest.fixture
def fresh_hook(monkeypatch):
    """No stages hook installed, the version gate open, nothing logged yet."""
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", None)
    monkeypatch.setattr(sm._hook, "prev", None)
    monkeypatch.setattr(sm, "supported", lambda version=None: True)
    monkeypatch.setattr(sm, "_logged", set())
    return knobs


def test_split_flag(fresh_hook):
    knobs = fresh_hook
    assert sm.split_flag(True, 64, 8) == 0  # the interpreter: layouts do not exist
    assert sm.split_flag(False, 128, 8) == 0  # 8 warps cover 128 rows: nothing replicated
    assert sm.split_flag(False, 16, 4) == 0  # one warpgroup
    assert sm.split_flag(False, 32, 8) == 0  # below one wgmma M
    assert knobs.runtime.add_stages_inspection_hook is None  # no split asked for yet: no hook
    R = sm.REVISION
    assert sm.split_flag(False, 64, 8) == R and sm.split_flag(False, 64, 16) == R
    assert knobs.runtime.add_stages_inspection_hook is sm._hook  # installed by the first split request


def test_install_is_idempotent_and_chains(fresh_hook):
    knobs = fresh_hook
    calls = []

    def prev(backend, stages, options, language, capability):
        calls.append(capability)

    knobs.runtime.add_stages_inspection_hook = prev
    assert sm.install() and sm.install()  # twice: still one layer
    assert knobs.runtime.add_stages_inspection_hook is sm._hook and sm._hook.prev is prev

    def stage(src, metadata):
        return src

    stages = {"ttgir": stage}
    sm._hook(None, stages, None, None, 90)
    assert calls == [90] and stages["ttgir"] is not stage  # wrapped on Hopper
    stages = {"ttgir": stage}
    sm._hook(None, stages, None, None, 100)
    sm._hook(None, stages, None, None, None)  # Blackwell, AMD: untouched
    assert calls == [90, 100, None] and stages["ttgir"] is stage


def test_version_gate(fresh_hook, monkeypatch, caplog):
    """Verified: Triton 3.6.x. Any other version: no hook, SPLIT_MMA 0 (the kernels compile as Triton lays them
    out), one warning for the process."""
    import triton

    assert SUPPORTED("3.6.0") and SUPPORTED("3.6.1+git1234")
    assert not any(SUPPORTED(v) for v in ("3.5.1", "3.7.0", "3.8.0", "4.0.0", "nightly"))
    assert SUPPORTED() == (tuple(map(int, triton.__version__.split(".")[:2])) in sm.VERIFIED)
    monkeypatch.setattr(sm, "supported", lambda version=None: False)
    with caplog.at_level("WARNING", logger="hyscale_kernels"):
        assert sm.split_flag(False, 64, 8) == 0 and sm.split_flag(False, 64, 8) == 0 and not sm.install()
    assert fresh_hook.runtime.add_stages_inspection_hook is None
    assert caplog.text.count("not a version the warpgroup split is verified on") == 1


def test_unmarked_module_passes_through():
    class Mod:
        def __str__(self):
            return _ttgir((8, 1), 32, [(64, 64)], marker=False)

    mod = Mod()
    assert sm._split_module(mod) is mod


def test_unparsable_rewrite_keeps_the_module(caplog):
    """A rewrite Triton cannot read back (here: not even MLIR) leaves the module as Triton made it, with a
    warning naming the kernel, instead of failing the compile."""
    class Mod:
        context = None

        def __str__(self):
            return _ttgir((8, 1), 32, [(64, 64)])  # marked and rewritable, but not a real module

    mod = Mod()
    sm._logged.discard("k:error")
    with caplog.at_level("WARNING", logger="hyscale_kernels"):
        assert sm._split_module(mod) is mod
    assert "split_mma: k: the rewritten TTGIR does not parse" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("N", [128, 64, 80])
@pytest.mark.parametrize("K", [2048, 1000])
def test_gpu_split_matches_reference_and_unsplit(N, K, monkeypatch):
    """bf16, real tiles: the split forward, the split dq kernel and the split loss-target kernel (L1-normalised)
    against the fp32 reference (relative L2 < 2e-2, as the default kernels) and against the unsplit kernels
    (close: same sums, only the warps that compute them differ); no NaN where the kernels write (outputs are
    NaN-filled first)."""
    from hyscale_kernels.indexer_loss import target as tk
    from hyscale_kernels.indexer_loss.reference import sparse_indexer_target
    from hyscale_kernels.sparse_mla import kernel as km
    from hyscale_kernels.sparse_mla import sparse_mla_reference

    if not sm.supported():
        pytest.skip(f"the split does not apply on Triton {__import__('triton').__version__}")
    monkeypatch.setattr(km, "_alloc", nan_alloc)
    T, S, scale = 512, 2560, 576 ** -0.5
    q, kv, idx = gpu_attn_case(T, N, S, K)  # causal, duplicate-free, -1 padded
    idx[3] = -1  # a fully masked row
    idx[5, 1:] = -1  # a row with one key
    dout = torch.randn(T, N, 512, device="cuda").bfloat16()
    qf, kvf = q.float().requires_grad_(), kv.float().requires_grad_()
    o, lse = sparse_mla_reference(qf, kvf, idx, scale, v_dim=512)
    o.backward(dout.float())
    ref = dict(out=o.detach(), lse=lse.detach(), dq=qf.grad, dkv=kvf.grad)
    ref["tgt"] = sparse_indexer_target(qf.detach(), kvf.detach(), idx, scale, lse=ref["lse"])  # normalised
    res = {}
    for split in (False, True):
        with monkeypatch.context() as m:
            if not split:
                for mod in (km, tk):
                    m.setattr(mod, "split_flag", lambda *a: 0)
            out, lse = km.sparse_mla_fwd(q, kv, idx, scale, 512)
            dq, dkv = km.sparse_mla_bwd(q, kv, idx, out, lse, dout, None, scale, 512)
            t = tk.sparse_attention_target(q, kv, idx, lse, scale)  # unnormalised
        res[split] = dict(out=out, lse=lse, dq=dq, dkv=dkv, tgt=t / t.sum(-1, keepdim=True).clamp_min(1e-10))
    fin = torch.isfinite(ref["lse"])
    for name in ("out", "lse", "dq", "dkv", "tgt"):
        a, b, r = res[True][name].float(), res[False][name].float(), ref[name]
        if name == "lse":
            assert torch.equal(torch.isfinite(a), fin)
            a, b, r = a[fin], b[fin], r[fin]
        assert not torch.isnan(a).any(), name
        assert rel_l2(a, r) < 2e-2, f"{name}: split vs reference, relative L2 {rel_l2(a, r)}"
        assert rel_l2(a, b) < 1e-2, f"{name}: split vs unsplit, relative L2 {rel_l2(a, b)}"
