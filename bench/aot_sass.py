"""HyTopK's sm_90a code without a GPU: compile hytopk_kernel (or the bench floor kernel) for sm_90a with Triton's
own ptxas, then print the ptxas resources and, per loop of the SASS (a backward branch and its target), its
instruction count and the instructions that matter for the key loop's cost (MMA, local-memory spills, barriers,
shuffles, shared and global memory), with the source lines that hold most of it.

    python bench/aot_sass.py --heads 32                      # the default launch at H_I 32, topk 2048
    python bench/aot_sass.py --heads 4 --topk 512 --config '{"slots": "sum"}'
    python bench/aot_sass.py --heads 64 --floor              # the no-selection floor (bench/_topk_floor.py)

--out DIR keeps k.ptx, k.cubin, k.sass (nvdisasm -c -g) and k.ttgir there. Loops are listed by their first
instruction's address; nested loops are counted in their own row and in the enclosing one's.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

import _path  # noqa: F401  (repo root on sys.path)

CLASSES = {"HGMMA": r"^HGMMA", "LDL": r"^LDL", "STL": r"^STL", "BAR": r"^BAR", "SHFL": r"^SHFL", "LDS": r"^LDS",
           "STS": r"^STS", "LDG": r"^LDG", "STG": r"^STG", "VOTE": r"^VOTE"}


def compile_sass(heads: int, topk: int, overrides: dict, floor: bool, out: str, dtype: str = "bf16",
                 w_dtype: str = "bf16", relu: bool = True, return_scores: bool = False) -> dict:
    """Compile the launch that hytopk(config=default_config(heads, topk) + overrides) runs, D_I 128; returns the
    ptxas resources, the shared memory and the SASS text."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hyscale_kernels.hytopk import op

    cfg = op.default_config(heads, topk)
    bad = [f for f in overrides if not hasattr(cfg, f)]
    if bad:
        raise SystemExit(f"--config: Config has no field {bad}")
    cfg = dataclasses.replace(cfg, **overrides)
    const = op.kernel_constexprs(cfg, heads, 128, topk, relu, return_scores)
    sig = dict(q_ptr=f"*{dtype}", w_ptr=f"*{w_dtype}", k_ptr=f"*{dtype}", starts_ptr="*i32", ends_ptr="*i32",
               out_idx_ptr="*i32", out_val_ptr="*fp32", buf_key_ptr="*i32", buf_idx_ptr="*i32", stats_ptr="*i32",
               T="i32", S="i32", kk="i32", n_blocks="i32", n_p="i32")
    if floor:
        import _topk_floor

        fn = _topk_floor.floor_kernel
        const = _topk_floor.floor_constexprs(const, lazy=True)
        sig = {a: sig[a] for a in ("q_ptr", "w_ptr", "k_ptr", "starts_ptr", "ends_ptr", "T", "S", "n_blocks", "n_p")}
        sig["out_ptr"] = "*fp32"
    else:
        from hyscale_kernels.hytopk import _kernel

        fn = _kernel.hytopk_kernel
    names = list(fn.arg_names)
    sig = {a: sig[a] for a in names if a in sig}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
    k = triton.compile(ASTSource(fn, dict(sig, **{c: "constexpr" for c in const}), const, attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=op.NUM_WARPS, num_stages=op.NUM_STAGES))
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with open(os.path.join(out, "k.ptx"), "w") as f:
        f.write(k.asm["ptx"])
    with open(os.path.join(out, "k.ttgir"), "w") as f:
        f.write(k.asm["ttgir"])
    r = subprocess.run([os.path.join(bindir, "ptxas"), "-arch=sm_90a", "-v", "-lineinfo",
                        os.path.join(out, "k.ptx"), "-o", os.path.join(out, "k.cubin")], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", "-g", os.path.join(out, "k.cubin")],
                          capture_output=True, text=True, check=True).stdout
    with open(os.path.join(out, "k.sass"), "w") as f:
        f.write(sass)
    res = {m: int(x) for m, x in [("registers", re.search(r"Used (\d+) registers", r.stderr).group(1)),
                                  ("stack", re.search(r"(\d+) bytes stack frame", r.stderr).group(1)),
                                  ("spill_st", re.search(r"(\d+) bytes spill stores", r.stderr).group(1)),
                                  ("spill_ld", re.search(r"(\d+) bytes spill loads", r.stderr).group(1))]}
    res["smem"] = k.metadata.shared
    res["sass"] = sass
    return res


def loops(sass: str):
    """(instructions, loops): every instruction as (address, opcode, source line, text), and [(start, end, [instrs])]
    for each backward branch in the SASS (labels resolved by position)."""
    rows, pending, line = [], [], None
    label_at = {}
    for ln in sass.splitlines():
        s = ln.strip()
        m = re.match(r"\.L_x_(\d+):", s)
        if m:
            pending.append(m.group(1))
            continue
        m = re.search(r"//## File \"([^\"]+)\", line (\d+)", s)
        if m:
            line = f"{os.path.basename(m.group(1))}:{m.group(2)}"
            continue
        m = re.match(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", s)
        if not m:
            continue
        addr = int(m.group(1), 16)
        for lb in pending:
            label_at[lb] = addr
        pending = []
        text = re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(2).strip())
        rows.append((addr, text.split()[0] if text else "", line, text))
    out = []
    for addr, op, _, text in rows:
        m = re.search(r"\.L_x_(\d+)", text)
        if op.startswith("BRA") and m and label_at.get(m.group(1), addr + 1) <= addr:
            start = label_at[m.group(1)]
            out.append((start, addr, [r for r in rows if start <= r[0] <= addr]))
    return rows, out


def summary(rows) -> str:
    cnt = collections.Counter()
    for _, op, _, _ in rows:
        for c, pat in CLASSES.items():
            if re.match(pat, op):
                cnt[c] += 1
    return " ".join(f"{c} {cnt[c]}" for c in CLASSES if cnt[c])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--config", default="{}", help="json Config overrides of default_config(heads, topk)")
    p.add_argument("--floor", action="store_true", help="the no-selection floor (bench/_topk_floor.py, lazy max)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="q and k")
    p.add_argument("--w-dtype", default="bf16", choices=["bf16", "fp32"], help="the head weights (Megatron's are bf16)")
    p.add_argument("--identity", action="store_true", help="identity activation instead of ReLU")
    p.add_argument("--return-scores", action="store_true", help="the launch that also writes the scores")
    p.add_argument("--out", default=None, help="keep k.ptx / k.cubin / k.sass / k.ttgir here")
    p.add_argument("--min-loop", type=int, default=40, help="list loops of at least this many instructions")
    p.add_argument("--top-lines", type=int, default=4, help="source lines listed per loop")
    a = p.parse_args()
    out = a.out or tempfile.mkdtemp()
    os.makedirs(out, exist_ok=True)
    res = compile_sass(a.heads, a.topk, json.loads(a.config), a.floor, out, a.dtype, a.w_dtype, not a.identity,
                       a.return_scores)
    rows, lps = loops(res.pop("sass"))
    print(f"H{a.heads} k{a.topk} {a.config}{' floor' if a.floor else ''}: {len(rows)} instrs, {res['registers']} regs, "
          f"stack {res['stack']} B, spill st/ld {res['spill_st']}/{res['spill_ld']} B, smem {res['smem']} B; "
          f"{summary(rows)}")
    for start, end, body in sorted(lps):
        if len(body) < a.min_loop:
            continue
        lines = collections.Counter(r[2] for r in body).most_common(a.top_lines)
        print(f"  loop {start:#07x}-{end:#07x}: {len(body):5d} instrs; {summary(body)}; "
              + ", ".join(f"{ln} {n}" for ln, n in lines))
    print(f"(files in {out})", file=sys.stderr)


if __name__ == "__main__":
    main()
