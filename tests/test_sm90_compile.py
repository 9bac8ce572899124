"""The kernels compile for sm_90a at the production tiles (Triton's own compiler and ptxas, no GPU needed), in one
subprocess without the interpreter:

- the sparse MLA forward, the backward's dq kernel and the loss-target kernel, with and without the warpgroup
  split (kernels/_split_mma.py): on the Triton versions the split is verified on, it halves the chained QK^T
  (and dO V^T) wgmma and leaves no [8, 1] layout; elsewhere the split kernels compile as the unsplit ones;
- the backward's dkv kernel with and without the loss target, one key block or a group of them per program (the
  target adds no MMA);
- the selected-scores backward never transposes a tile derived from an MMA result (dk = dot(trans(dS), q)
  lowers to a #linear / shared-memory transpose of the wgmma accumulator, which Triton >= 3.4 miscompiles on
  Hopper).
"""

import json
import os

import pytest

from hyscale_kernels import _split_mma as sm
from _interp import compile_sm90_in_subprocess

_SCRIPT = r"""
import collections, json, os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, %r)
import conftest  # noqa: F401  (hyscale_kernels on the path)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hyscale_kernels import _split_mma as sm
from hyscale_kernels.indexer_loss import selected_scores as ss
from hyscale_kernels.indexer_loss import target as tk
from hyscale_kernels.sparse_mla import kernel as km

sm.install()  # triton.compile directly: no launcher's split_flag installs it


def compile_(fn, sig, const, warps, stages):
    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*") or a == "N"}
    return triton.compile(ASTSource(fn, dict(sig, **{x: "constexpr" for x in const}), const, attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def emit(name, k, **kw):
    wg = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", k.asm["ptx"]))
    warps = re.findall(r"nvidia_mma<\{[^}]*warpsPerCTA = \[(\d+), (\d+)\]", k.asm["ttgir"])
    print(json.dumps(dict(name=name, wgmma=dict(wg), warps=warps, cubin=len(k.asm["cubin"]) > 0,
                          smem=k.metadata.shared, **kw)), flush=True)


common = dict(DQK=576, V=512, R=64, K=2048, BLOCK_V=512, BLOCK_R=64, IEEE=False, EVEN=True)
ptrs = dict(q="*bf16", kv="*bf16", idx="*i32")
split_kinds = dict(
    fwd=(km._sparse_mla_fwd_kernel, dict(ptrs, out="*bf16", lse="*fp32", scale_log2="fp32", N="i32", N_HB="i32"),
         dict(common, BIG=False, BLOCK_H=64, BLOCK_K=64, PREFETCH_IDX=True)),
    dq=(km._sparse_mla_bwd_dq_kernel, dict(ptrs, o="*bf16", do="*bf16", lse="*fp32", dlse="*fp32", dq="*bf16",
                                           pds="*bf16", row0="i32", dq_row0="i32", scale="fp32", scale_log2="fp32",
                                           N="i32", N_HB="i32"),
        dict(common, BIG=False, BLOCK_H=64, BLOCK_K=32, HAS_DLSE=False, PREFETCH_IDX=False)),
    target=(tk._target_kernel, dict(ptrs, lse="*fp32", tgt="*fp32", scale_log2="fp32", N="i32", N_HB="i32"),
            dict(common, BIG=False, BLOCK_H=64, BLOCK_K=64, ATOMIC=True)))
for name, (fn, sig, const) in split_kinds.items():
    for split in (0, sm.REVISION):
        emit(name, compile_(fn, sig, dict(const, SPLIT_MMA=split), 8, 2), split=split)

dkv_sig = dict(q="*bf16", idx="*i32", do="*bf16", pds="*bf16", dkv="*fp32", tgt="*fp32", row0="i32", N="i32",
               N_KB="i32")
c = km.BWD_DKV_CFG
for group, nhb in ((1, 8), (km.SCRATCH_GROUP, 1)):
    for tgt in (False, True):
        const = dict(common, BLOCK_H=c["block_h"], BLOCK_K=c["block_k"], NHB=nhb, DETERMINISTIC=False, TGT=tgt,
                     GROUP=group)
        emit("dkv", compile_(km._sparse_mla_bwd_dkv_kernel, dkv_sig, const, c["num_warps"], c["num_stages"]),
             group=group, tgt=tgt)

ss_sig = dict(q="*bf16", w="*fp32", k="*bf16", idx="*i32", g="*fp32", dq="*bf16", dw="*fp32", dk="*fp32", row0="i32",
              r_coef="*fp32")
for relu in (True, False):
    const = dict(H=64, D=128, K=2048, RELU=relu, IEEE=False, DETERMINISTIC=False, BLOCK_H=64, BLOCK_D=128,
                 BLOCK_J=ss.BWD_CFG["block_j"], ROW_COEF=True)
    k = compile_(ss._selected_scores_bwd_kernel, ss_sig, const, ss.BWD_CFG["num_warps"], ss.BWD_CFG["num_stages"])
    ir = k.asm["ttgir"]
    defs = {m.group(1): l for l in ir.splitlines() for m in [re.match(r"\s*(%%[\w#]+)(?::\d+)? = ", l)] if m}
    bad = []
    for l in ir.splitlines():
        if " tt.trans " in l and re.search(r": tensor<[^>]*#(mma|linear)", l):
            bad.append(l.strip()[:200])
        m = re.search(r"ttg.memdesc_trans (%%[\w#]+)", l)
        if m and "local_alloc" in defs.get(m.group(1), "") and "#mma" in defs[m.group(1)].split(":")[1]:
            bad.append(l.strip()[:200])
    emit("selected_scores_bwd", k, relu=relu, transposed_mma_tiles=bad)
"""


@pytest.fixture(scope="module")
def compiled():
    out = compile_sm90_in_subprocess(_SCRIPT % os.path.dirname(__file__))
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for row in rows:
        assert row["cubin"] and row["smem"] <= 232448, row  # ptxas built it; within Hopper's 227 KB
    return rows


def _one(rows, **match):
    (row,) = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return row["wgmma"], [tuple(w) for w in row["warps"]]


def test_split_halves_the_chained_mmas(compiled):
    R = sm.REVISION
    (f0, l0), (f1, l1) = _one(compiled, name="fwd", split=0), _one(compiled, name="fwd", split=R)
    (d0, m0), (d1, m1) = _one(compiled, name="dq", split=0), _one(compiled, name="dq", split=R)
    (t0, n0), (t1, n1) = _one(compiled, name="target", split=0), _one(compiled, name="target", split=R)
    assert f0 == {"m64n32k16": 72, "m64n256k16": 4} and d0["m64n16k16"] == 136 and t0 == {"m64n32k16": 68}
    assert all(("8", "1") in lay for lay in (l0, m0, n0))
    if not sm.supported():  # the hook is not installed: the split constexpr changes nothing
        assert (f1, d1, t1) == (f0, d0, t0)
        return
    assert f1 == {"m64n32k16": 36, "m64n256k16": 4}, f1
    assert d1["m64n16k16"] == 68 and {k: v for k, v in d0.items() if k != "m64n16k16"} == {
        k: v for k, v in d1.items() if k != "m64n16k16"}, (d0, d1)
    assert t1 == {"m64n32k16": 36}, t1  # the loss target's QK^T (no P V)
    assert all(("8", "1") not in lay for lay in (l1, m1, n1))


def test_dkv_target_adds_no_mma(compiled):
    for group in (1, 8):
        (a, _), (b, _) = _one(compiled, name="dkv", group=group, tgt=False), _one(compiled, name="dkv", group=group,
                                                                                  tgt=True)
        assert a == b and sum(a.values()) > 0, (group, a, b)


def test_selected_scores_bwd_never_transposes_an_mma_tile(compiled):
    rows = [r for r in compiled if r["name"] == "selected_scores_bwd"]
    assert len(rows) == 2 and all(not r["transposed_mma_tiles"] for r in rows), rows
