"""kernels/_split_mma.py: the compile hook that splits a replicated chained-dot MMA tile over warpgroups.

CPU: the TTGIR rewrite rule on text, the hook's install / chaining, and an sm_90a compile (no GPU needed) of
the sparse MLA forward and dq kernels with and without the split (the QK^T / dO V^T wgmma count halves).
GPU: the split kernels against the fp32 reference and the unsplit kernels.
"""

import json
import os

import pytest
import torch

from hyscale_kernels import _split_mma as sm
from interp_rerun import compile_sm90_in_subprocess
from test_sparse_mla import _gpu_case

M = sm.MARKER


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


def test_split_flag(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", None)
    monkeypatch.setattr(sm._hook, "prev", None)
    assert sm.split_flag(False, False, 64, 8) == 0 and knobs.runtime.add_stages_inspection_hook is None
    R = sm.REVISION
    assert sm.split_flag(True, False, 64, 8) == R
    assert sm.split_flag(True, False, 64, 16) == R
    assert sm.split_flag(False, False, 64, 8) == 0
    assert sm.split_flag(True, True, 64, 8) == 0  # the interpreter: layouts do not exist
    assert sm.split_flag(True, False, 128, 8) == 0  # 8 warps cover 128 rows: nothing replicated
    assert sm.split_flag(True, False, 16, 4) == 0  # one warpgroup
    assert sm.split_flag(True, False, 32, 8) == 0  # below one wgmma M
    assert knobs.runtime.add_stages_inspection_hook is sm._hook  # installed by the first split request


def test_install_is_idempotent_and_chains(monkeypatch):
    from triton import knobs

    calls = []

    def prev(backend, stages, options, language, capability):
        calls.append(capability)

    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", prev)
    monkeypatch.setattr(sm._hook, "prev", None)
    sm.install()
    sm.install()  # twice: still one layer
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


_AOT = r"""
import collections, json, os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, %r)
import conftest  # noqa: F401  (hyscale_kernels on the path)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hyscale_kernels import _split_mma as sm
from hyscale_kernels.sparse_mla import kernel as km
from hyscale_kernels.indexer_loss import target as tk

sm.install()  # triton.compile directly: no launcher's split_flag installs it

common = dict(DQK=576, V=512, R=64, K=2048, BLOCK_V=512, BLOCK_R=64, IEEE=False, EVEN=True, BIG=False)
ptrs = dict(q="*bf16", kv="*bf16", idx="*i32")
kinds = dict(
    fwd=(km._sparse_mla_fwd_kernel, dict(ptrs, out="*bf16", lse="*fp32", scale_log2="fp32", N="i32", N_HB="i32"),
         dict(common, BLOCK_H=64, BLOCK_K=64), 2),
    dq=(km._sparse_mla_bwd_dq_kernel, dict(ptrs, o="*bf16", do="*bf16", lse="*fp32", dlse="*fp32", delta="*fp32",
                                           dq="*bf16", pds="*bf16", row0="i32", dq_row0="i32", scale="fp32",
                                           scale_log2="fp32", N="i32", N_HB="i32"),
        dict(common, BLOCK_H=64, BLOCK_K=32, HAS_DLSE=False, SCRATCH=True), 2),
    target=(tk._target_kernel, dict(ptrs, lse="*fp32", tgt="*fp32", scale_log2="fp32", N="i32", N_HB="i32"),
            dict(common, BLOCK_H=64, BLOCK_K=64, ATOMIC=True), 2))
for name, (fn, sig, const, stages) in kinds.items():
    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*") or a == "N"}
    for split in (0, sm.REVISION):
        c = dict(const, SPLIT_MMA=split)
        k = triton.compile(ASTSource(fn, dict(sig, **{x: "constexpr" for x in c}), c, attrs),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=stages))
        wg = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", k.asm["ptx"]))
        mma = re.findall(r"nvidia_mma<\{[^}]*warpsPerCTA = \[(\d+), (\d+)\]", k.asm["ttgir"])
        print(json.dumps(dict(name=name, split=split, wgmma=dict(wg), warps=mma, cubin=len(k.asm["cubin"]) > 0,
                              smem=k.metadata.shared)))
"""


def test_sm90_compile_halves_the_chained_mmas():
    """Compile the forward, the scratch dq kernel and the loss-target kernel for sm_90a at the production
    tile (64 heads, 8 warps) with and without SPLIT_MMA: the split versions issue half the QK^T (and dO V^T)
    wgmma, keep the P V / dq MMAs, have no [8, 1] layout left, and ptxas builds both (smem within the 227 KB
    limit)."""
    out = compile_sm90_in_subprocess(_AOT % os.path.dirname(__file__))
    rows = {}
    for line in out.splitlines():
        row = json.loads(line)
        assert row["cubin"] and row["smem"] <= 232448, row  # ptxas built it; within Hopper's 227 KB
        rows[row["name"], row["split"]] = row["wgmma"], [tuple(w) for w in row["warps"]]
    R = sm.REVISION
    (f0, l0), (f1, l1) = rows["fwd", 0], rows["fwd", R]
    assert f0 == {"m64n32k16": 72, "m64n256k16": 4} and f1 == {"m64n32k16": 36, "m64n256k16": 4}, (f0, f1)
    assert ("8", "1") in l0 and ("8", "1") not in l1
    (d0, l0), (d1, l1) = rows["dq", 0], rows["dq", R]
    assert d0["m64n16k16"] == 136 and d1["m64n16k16"] == 68, (d0, d1)
    assert {k: v for k, v in d0.items() if k != "m64n16k16"} == {k: v for k, v in d1.items() if k != "m64n16k16"}
    assert ("8", "1") in l0 and ("8", "1") not in l1
    (t0, l0), (t1, l1) = rows["target", 0], rows["target", R]  # the loss target's QK^T (no P V)
    assert t0 == {"m64n32k16": 68} and t1 == {"m64n32k16": 36}, (t0, t1)
    assert ("8", "1") in l0 and ("8", "1") not in l1


@pytest.mark.gpu
@pytest.mark.parametrize("N", [128, 64, 80])
@pytest.mark.parametrize("K", [2048, 1000])
def test_gpu_split_matches_reference_and_unsplit(N, K, monkeypatch):
    """bf16, real tiles: the split forward, the split scratch dq kernel and the split loss-target kernel
    (L1-normalised) against the fp32 reference
    (relative L2 < 2e-2, as the default kernels) and against the unsplit kernels (close: same sums, only
    the warps that compute them differ); no NaN where the kernels write (outputs are NaN-filled first)."""
    from hyscale_kernels.indexer_loss.reference import sparse_indexer_target
    from hyscale_kernels.indexer_loss.target import sparse_attention_target
    from hyscale_kernels.sparse_mla import sparse_mla_reference
    from hyscale_kernels.sparse_mla import kernel as km

    monkeypatch.setattr(km, "_alloc", lambda *s, dtype, device: torch.full(s, float("nan"), dtype=dtype, device=device))
    T, S, scale = 512, 2560, 576 ** -0.5
    q, kv, idx = _gpu_case(T, N, S, K)  # causal, duplicate-free, -1 padded
    idx[3] = -1  # a fully masked row
    idx[5, 1:] = -1  # a row with one key
    dout = torch.randn(T, N, 512, device="cuda").bfloat16()
    qf, kvf = q.float().requires_grad_(), kv.float().requires_grad_()
    o, lse = sparse_mla_reference(qf, kvf, idx, scale, v_dim=512)
    o.backward(dout.float())
    ref = dict(out=o.detach(), lse=lse.detach(), dq=qf.grad, dkv=kvf.grad)
    res = {}
    for split in (False, True):
        out, lse = km.sparse_mla_fwd(q, kv, idx, scale, 512, split_mma=split)
        dq, dkv = km.sparse_mla_bwd(q, kv, idx, out, lse, dout, None, scale, 512, dq_cfg=dict(split_mma=split))
        res[split] = dict(out=out, lse=lse, dq=dq, dkv=dkv)
        t = sparse_attention_target(q, kv, idx, lse, scale, config=dict(split_mma=split))  # unnormalised
        res[split]["tgt"] = t / t.sum(-1, keepdim=True).clamp_min(1e-10)
    ref["tgt"] = sparse_indexer_target(qf.detach(), kvf.detach(), idx, scale, lse=ref["lse"])  # normalised
    fin = torch.isfinite(ref["lse"])
    for name in ("out", "lse", "dq", "dkv", "tgt"):
        a, b, r = res[True][name].float(), res[False][name].float(), ref[name]
        if name == "lse":
            assert torch.equal(torch.isfinite(a), fin)
            a, b, r = a[fin], b[fin], r[fin]
        assert not torch.isnan(a).any(), name
        err = ((a - r).norm() / r.norm().clamp_min(1e-6)).item()
        assert err < 2e-2, f"{name}: split vs reference, relative L2 {err}"
        diff = ((a - b).norm() / b.norm().clamp_min(1e-6)).item()
        assert diff < 1e-2, f"{name}: split vs unsplit, relative L2 {diff}"
