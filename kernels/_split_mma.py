"""Triton compile hook: split a replicated chained-dot MMA tile over the warpgroups (Hopper, opt-in).

Why. Triton's AccelerateMatmul gives every dot whose result feeds another dot (attention: S -> P -> P @ V)
warpsPerCTA = [num_warps, 1], all warps along M, so that row reductions stay inside a warp. One wgmma
warpgroup (4 warps) already covers 64 rows; with M = 64 heads and 8 warps the second warpgroup gets the same
64 rows again and the QK^T MMAs run twice. Compiled for sm_90a: 72 instead of 36 wgmma per key tile in the
sparse MLA forward, 136 instead of 68 in the backward's dq kernel (S and dP).

What. For kernels that opt in, after Triton's own TTGIR passes, every MMA-v3 layout with warpsPerCTA
[W, 1] whose dots have fewer than 16 * W rows becomes [M / 16, W * 16 / M]: the warpgroups split N
instead (stock's TileLang SparseMLA does the same). Row reductions and the conversion of P to the next
dot's operand then cross warpgroups through shared memory: Triton's generic lowering of those ops, chosen
when the module is lowered to LLVM, after this rewrite.

Opt-in. The kernel passes a value through ``split_mma_mark(x, SPLIT_MMA)``: with ``SPLIT_MMA`` = REVISION a
one-instruction PTX ``mov`` whose text carries MARKER; with 0 it is ``x`` itself. ``SPLIT_MMA`` is a
constexpr, so the split and unsplit kernels are distinct Triton cache entries (Triton's cache key does not
include compile hooks), and bumping REVISION retires binaries compiled by an older rule. The hook is
installed by the first launch that asks for a split (``split_flag`` -> ``install()``; AOT scripts call
``install()`` themselves), chains any hook already set, and touches only modules that carry the marker.
The interpreter (CPU) ignores layouts: launchers pass 0 there.

Triton versions. The hook reaches into Triton's compile stages (``knobs.runtime.add_stages_inspection_hook``,
its TTGIR text, ``ir.parse_mlir_module``), internals that change between releases. It applies only on the
versions in VERIFIED (Triton 3.6.x); on any other, ``split_flag`` logs once and returns 0, so the kernels
compile without the split: the same results, the chained dots computed by both warpgroups.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile

import triton
import triton.language as tl

log = logging.getLogger("hyscale_kernels")

REVISION = 1  # bump when the rewrite rule changes (a new constexpr value = a new cache entry)
MARKER = f"hyscale.split_mma.r{REVISION}"
_MARK_ASM = tl.constexpr(f"mov.b32 $0, $1; // {MARKER}")

_ALIAS = re.compile(r"^#(mma\d*) = #ttg\.nvidia_mma<\{versionMajor = 3, versionMinor = (\d+), "
                    r"warpsPerCTA = \[(\d+), (\d+)\], instrShape = \[(\d+), (\d+), (\d+)\]\}>$", re.M)
_DOT = re.compile(r"ttng\.warp_group_dot .*-> tensor<(\d+)x(\d+)x\w+, #(mma\d*)>")
_logged: set[str] = set()
VERIFIED = ((3, 6),)  # (major, minor) releases whose compile stages this hook is tested against


def supported(version: str | None = None) -> bool:
    """Whether the hook applies on Triton ``version`` (default: the installed one)."""
    m = re.match(r"(\d+)\.(\d+)", version or triton.__version__)
    return bool(m) and (int(m.group(1)), int(m.group(2))) in VERIFIED


@triton.jit
def split_mma_mark(x, SPLIT_MMA: tl.constexpr):
    """x unchanged; with SPLIT_MMA != 0 through a PTX mov whose comment marks the module for the hook."""
    if SPLIT_MMA:
        return tl.inline_asm_elementwise(_MARK_ASM, "=r,r", [x], dtype=tl.int32,
                                         is_pure=True, pack=1)
    return x


def split_flag(interpret: bool, rows: int, num_warps: int) -> int:
    """The SPLIT_MMA constexpr a launcher passes: REVISION when compiled (not interpreted), the chained dots'
    ``rows`` (a multiple of one warpgroup's 64) are fewer than ``num_warps`` warps cover, and the installed
    Triton is one the hook is verified on; else 0 (the kernel compiles as Triton lays it out)."""
    if interpret or rows % 64 or 16 * num_warps <= rows:
        return 0
    if not install():  # only processes that ask for a split kernel get the hook
        return 0
    return REVISION


def rewrite(ttgir: str) -> tuple[str, list[str]]:
    """TTGIR text -> (text with replicated chained-dot layouts split over warpgroups, one note per change).

    Only modules carrying MARKER change. An MMA-v3 alias changes when every warp_group_dot producing it has
    the same [M, N], warpsPerCTA is [W, 1] with 16 * W > M (rows replicated), and N splits into W * 16 / M
    column blocks of a valid wgmma width (a multiple of 8, at most the old instruction N).
    """
    if MARKER not in ttgir:
        return ttgir, []
    shapes: dict[str, set[tuple[int, int]]] = {}
    for m, n, alias in _DOT.findall(ttgir):
        shapes.setdefault(alias, set()).add((int(m), int(n)))
    notes = []

    def fix(match: re.Match) -> str:
        alias, minor, wm, wn, im, inn, ik = match.groups()
        wm, wn, inn = int(wm), int(wn), int(inn)
        dims = shapes.get(alias, set())
        if wn != 1 or len(dims) != 1:
            return match.group(0)
        (M, N), = dims
        if M % 64 or 16 * wm <= M:
            return match.group(0)  # not replicated
        warps_m = M // 16
        warps_n = wm // warps_m
        instr_n = min(inn, N // warps_n)
        if N % (instr_n * warps_n) or instr_n % 8:
            return match.group(0)
        notes.append(f"#{alias} [{M}x{N}]: warpsPerCTA [{wm}, 1] -> [{warps_m}, {warps_n}], instr N {inn} -> {instr_n}")
        return (f"#{alias} = #ttg.nvidia_mma<{{versionMajor = 3, versionMinor = {minor}, warpsPerCTA = "
                f"[{warps_m}, {warps_n}], instrShape = [{im}, {instr_n}, {ik}]}}>")

    return _ALIAS.sub(fix, ttgir), notes


def _kernel_name(text: str) -> str:
    m = re.search(r"tt\.func public @(\w+)", text)
    return m.group(1) if m else "?"


def _split_module(mod):
    """The TTGIR stage's module, re-parsed with split layouts when it carries the marker."""
    text = str(mod)
    if MARKER not in text:
        return mod
    new, notes = rewrite(text)
    name = _kernel_name(text)
    if not notes:
        if name not in _logged:
            _logged.add(name)
            log.warning("split_mma: %s asked for the warpgroup split but has no replicated MMA layout; "
                        "compiled unchanged", name)
        return mod
    from triton._C.libtriton import ir

    try:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.ttgir")
            with open(path, "w") as f:
                f.write(new)
            out = ir.parse_mlir_module(path, mod.context)
    except Exception as exc:  # noqa: BLE001  (a Triton whose IR this rule does not fit: keep its own module)
        if name + ":error" not in _logged:
            _logged.add(name + ":error")
            log.warning("split_mma: %s: the rewritten TTGIR does not parse (%s: %s); compiled unchanged",
                        name, type(exc).__name__, str(exc)[:200])
        return mod
    out.context = mod.context  # what triton.compiler.parse does for modules read back from text
    if name not in _logged:
        _logged.add(name)
        log.info("split_mma: %s: %s", name, "; ".join(notes))
    return out


def _hook(backend, stages, options, language, capability):
    prev = _hook.prev
    if prev is not None:
        prev(backend, stages, options, language, capability)
    if capability is None or capability // 10 != 9 or "ttgir" not in stages:
        return  # Hopper's wgmma layouts only (AMD passes capability None)
    stage = stages["ttgir"]

    def ttgir(src, metadata):
        return _split_module(stage(src, metadata))

    stages["ttgir"] = ttgir


_hook.prev = None


def install() -> bool:
    """Register the hook once per process (apply-twice-safe), keeping any hook set before it. False (logged
    once) on a Triton version the hook is not verified on: nothing is installed."""
    if not supported():
        if "version" not in _logged:
            _logged.add("version")
            log.warning("split_mma: Triton %s is not a version the warpgroup split is verified on (%s): kernels "
                        "compile without it (same results, possibly slower)", triton.__version__,
                        ", ".join(f"{a}.{b}.x" for a, b in VERIFIED))
        return False
    from triton import knobs

    cur = knobs.runtime.add_stages_inspection_hook
    if cur is not _hook:
        _hook.prev = cur
        knobs.runtime.add_stages_inspection_hook = _hook
    return True
