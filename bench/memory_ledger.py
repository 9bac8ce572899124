"""Memory ledger of one training step (CPU): what the per-token peak is made of.

Runs one step (forward, output layer + cross entropy, full-recompute backward) of a DSA GPT
built exactly as ``hyscale-train`` builds it (Megatron's flags, ``GPTModelBuilder``, the core
loop's schedule ``get_forward_backward_func``), under a ``TorchDispatchMode`` that records every
storage an op allocates (bytes, shape, dtype, op, phase, module) and notices its release
(``StorageWeakRef``). The running sum of live bytes is the "allocated" curve; its maximum is the
peak that ``torch.cuda.max_memory_allocated`` sees on the GPU (minus allocator rounding and the
kernels' register/shared-memory tiles). Storages alive before the step (parameters) and the
parameters' gradients (Megatron keeps them in a preallocated buffer) are reported as static, not
per token.

GPU-faithful kernels (default, ``--kernels emulate``): on CPU HyScale would run the PyTorch
references of its Triton kernels, which allocate differently (chunked fp32 gathers, checkpointed
chunks). The ledger swaps each Triton launch for a stand-in that allocates exactly what the
launcher allocates (HyTopK: int32 [T, k] + its scratch; sparse MLA: out, lse, and in the
backward dq, fp32 dkv, the P / dS scratch; selected scores / KL / target: their fp32 [T, k], [T] outputs),
saves exactly what the autograd Function saves, and fills the values from the reference inside
a "reference" scope whose allocations are reported apart ("cpu reference scratch") and left out
of the GPU total. ``--hyscale-replay-offload``: the replay entry is a host copy on the GPU; the
ledger books it as host memory. ``--kernels reference`` measures the CPU references as they are.
Stock (``--kind stock``) runs stock's PyTorch DSA path (CPU has no TileLang): its dense fp32
[N, S, S] attention/loss is not what the GPU runs, so its DSA core is booked separately.

Usage (from the repo root)::

    python bench/memory_ledger.py                                   # HyScale, longest config, S=4096
    python bench/memory_ledger.py --seq-length 8192 --top 40
    python bench/memory_ledger.py --kind stock --seq-length 2048
    python bench/memory_ledger.py --json /tmp/ledger.json           # machine-readable result
    python bench/memory_ledger.py --extra "--cross-entropy-loss-fusion"   # extra Megatron flags

Prints: peak allocated (GPU-equivalent) and where/when it happens, the live storages at the peak
grouped by component (bytes per token), the top storages, and the per-phase peaks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _repo  # noqa: E402,F401  (registers hyscale_kernels / hyscale_patches from the checkout)
import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

ROOT = _repo.ROOT
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "deepseek_v32_longest.args")
# What the H200 launch would use for HyTopK's scratch (kernels/hytopk/op.py: programs_per_sm x SMs).
H200_SMS = 132


# ----------------------------------------------------------------------------- the tracker
@dataclass
class Alloc:
    nbytes: int
    shape: tuple
    dtype: str
    op: str
    phase: str
    where: str
    cat: str  # "device" | "ref" (CPU reference scratch) | "host" (offloaded on the GPU)
    t: int
    ptr: int = 0
    weak: StorageWeakRef = field(repr=False, default=None)
    freed_t: int = -1
    freed_phase: str = ""


class Ledger(TorchDispatchMode):
    """Live-storage ledger. ``phase``/``where`` come from module hooks and the autograd engine."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, Alloc] = {}
        self.static: set[int] = set()
        self.cat = "device"
        self.mod_stack: list[str] = []
        self.bwd_layer = "head"
        self.t = 0
        self.cur = {"device": 0, "ref": 0, "host": 0}
        self.peak = 0
        self.peak_snapshot: list[Alloc] = []
        self.peak_info = {}
        self.phase_peaks: dict[str, int] = defaultdict(int)
        self.ref_peak = 0
        self.host_peak = 0
        self.trace: list[Alloc] = []
        self.trace_min: Optional[int] = None

    # -- context
    @contextlib.contextmanager
    def category(self, cat: str):
        saved, self.cat = self.cat, cat
        try:
            yield
        finally:
            self.cat = saved

    def phase(self) -> str:
        node = torch._C._current_autograd_node()
        if node is None:
            return "forward" if torch.is_grad_enabled() else "forward(no-grad, checkpointed)"
        if self.mod_stack and torch.is_grad_enabled():
            return "recompute"
        return f"backward[{self.bwd_layer}]"

    def where(self) -> str:
        node = torch._C._current_autograd_node()
        mod = self.mod_stack[-1] if self.mod_stack else ""
        if node is not None and not (self.mod_stack and torch.is_grad_enabled()):
            return node.name()
        return mod

    # -- bookkeeping
    def _sweep(self):
        dead = [k for k, a in self.live.items() if a.weak.expired()]
        for k in dead:
            a = self.live.pop(k)
            self.cur[a.cat] -= a.nbytes
            a.freed_t, a.freed_phase = self.t, self.phase() + " @ " + self.where()

    def _add(self, t: torch.Tensor, op: str):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        n = st.nbytes()
        ptr = st.data_ptr()
        if n == 0 or ptr in self.live or ptr in self.static:
            return
        a = Alloc(n, tuple(t.shape), str(t.dtype).replace("torch.", ""), op, self.phase(), self.where(), self.cat,
                  self.t, ptr, StorageWeakRef(st))
        self.live[ptr] = a
        self.cur[a.cat] += n
        if self.trace_min is not None and n >= self.trace_min:
            self.trace.append(a)

    def mark_static(self, tensors):
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.static.add(t.untyped_storage().data_ptr())

    def retag(self, t: torch.Tensor, cat: str):
        a = self.live.get(t.untyped_storage().data_ptr())
        if a is not None and a.cat != cat:
            self.cur[a.cat] -= a.nbytes
            a.cat = cat
            self.cur[cat] += a.nbytes

    def _check_peak(self, op: str):
        dev = self.cur["device"]
        ph = self.phase()
        self.phase_peaks[ph] = max(self.phase_peaks[ph], dev)
        self.ref_peak = max(self.ref_peak, self.cur["ref"])
        self.host_peak = max(self.host_peak, self.cur["host"])
        if dev > self.peak:
            self.peak = dev
            self.peak_snapshot = [a for a in self.live.values() if a.cat == "device"]
            self.peak_info = dict(t=self.t, op=op, phase=ph, where=self.where())

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.t += 1
        self._sweep()
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        flat, _ = tree_flatten(out)
        for t in flat:
            self._add(t, name)
        self._check_peak(name)
        return out

    def tick(self, label: str):
        """Re-check after Python-level releases (outside any op)."""
        self._sweep()
        self._check_peak(label)

    # -- module hooks
    def hook_modules(self, models):
        handles = []
        for m in models:
            for name, mod in m.named_modules():
                short = name.replace("module.", "")

                def pre(_mod, _inp, _name=short):
                    self.mod_stack.append(_name)
                    if torch._C._current_autograd_node() is not None and torch.is_grad_enabled():
                        parts = _name.split(".")
                        if "layers" in parts:
                            self.bwd_layer = "layer " + parts[parts.index("layers") + 1]

                def post(_mod, _inp, _out, _name=short):
                    if self.mod_stack and self.mod_stack[-1] == _name:
                        self.mod_stack.pop()

                handles.append(mod.register_forward_pre_hook(pre))
                handles.append(mod.register_forward_hook(post))
        return handles


LEDGER: Optional[Ledger] = None
_PATCHED: list = []


def _set(obj, name, value):
    """Monkeypatch ``obj.name`` for the ledger run; ``restore_patches`` undoes it."""
    _PATCHED.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)


def restore_patches():
    while _PATCHED:
        obj, name, old = _PATCHED.pop()
        setattr(obj, name, old)


def _ref():
    return LEDGER.category("ref") if LEDGER is not None else contextlib.nullcontext()


# ----------------------------------------------------------------------------- GPU-faithful kernel stand-ins
def install_kernel_standins():
    """Replace each Triton launch by a stand-in with the launcher's allocations (values from the references)."""
    import hyscale_kernels.hytopk as hytopk_pkg
    import hyscale_kernels.sparse_mla as smla_pkg
    from hyscale_kernels.hytopk import op as hytopk_op
    from hyscale_kernels.hytopk import reference as hytopk_ref
    from hyscale_kernels.indexer_loss import deferred, fused, kl
    from hyscale_kernels.indexer_loss import selected_scores as ss
    from hyscale_kernels.indexer_loss import reference as loss_ref
    from hyscale_kernels.sparse_mla import kernel as smla_kernel
    from hyscale_kernels.sparse_mla.reference import sparse_mla_reference

    # HyTopK: int32 [T, k] output + per-program scratch, as op._launch allocates on an H200
    def hytopk(q, w, k, starts, ends, topk, relu=True, return_scores=False, *, impl="auto", check_bounds=True,
               config=None):
        T, H, D = q.shape
        cfg = config or hytopk_op.default_config(H, topk)
        R, cap = hytopk_op.geometry(D, topk, cfg)[:2]
        n_prog = max(1, min(-(-T // R), H200_SMS * hytopk_op.PROGRAMS_PER_SM))
        out_idx = torch.empty((T, topk), dtype=torch.int32, device=q.device)
        out_val = torch.empty((T, topk) if return_scores else (1,), dtype=torch.float32, device=q.device)
        scratch = torch.empty((2, n_prog, R, cap), dtype=torch.int32, device=q.device)
        with _ref():
            res = hytopk_ref.hytopk_reference(q, w, k, starts, ends, topk, relu=relu, return_scores=return_scores)
            idx = res[0] if return_scores else res
            out_idx.copy_(idx)
            if return_scores:
                out_val.copy_(res[1])
            del res, idx
        del scratch
        return (out_idx, out_val) if return_scores else out_idx

    _set(hytopk_pkg, "hytopk", hytopk)

    # sparse MLA: SparseMLAFunction saves (q, kv, indices, out, lse); backward allocates dq, fp32 dkv, scratch
    class _SparseMLAEmu(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, kv, indices, softmax_scale, v_dim, deterministic, dq_over_q=False, target_link=None,
                    dep=None):
            # target_link / dep: the deferred indexer loss (indexer_loss/deferred.py), as in SparseMLAFunction
            ctx.target_link = target_link
            T, N, _ = q.shape
            out = torch.empty(T, N, v_dim, dtype=q.dtype, device=q.device)
            lse = torch.empty(T, N, dtype=torch.float32, device=q.device)
            with _ref(), torch.no_grad():
                o, l = sparse_mla_reference(q, kv, indices, softmax_scale, v_dim=v_dim)
                out.copy_(o)
                lse.copy_(l)
                del o, l
            ctx.save_for_backward(q, kv, indices, out, lse)
            ctx.softmax_scale, ctx.v_dim = softmax_scale, v_dim
            # the backward writes dq over q when asked
            ctx.over = bool(dq_over_q)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q, kv, indices, out, lse = ctx.saved_tensors
            dout = torch.zeros_like(out) if dout is None else dout.contiguous()
            dout = dout.to(q.dtype).contiguous()
            dq = q if ctx.over else torch.empty_like(q)
            dkv = torch.zeros(kv.shape[0], kv.shape[1], dtype=torch.float32, device=q.device)
            # P + dS for a chunk of tokens (+ the chunk's staged dq when over q)
            T, N, DQK = q.shape
            K = indices.shape[1]
            rows = smla_kernel.scratch_chunk_tokens(T, N, K, q.element_size())
            pds = torch.empty(rows, 2, N, K, dtype=q.dtype, device=q.device)
            dq_chunk = torch.empty(rows, N, DQK, dtype=q.dtype, device=q.device) if ctx.over else None
            with _ref(), torch.enable_grad():
                qq, kk = q.detach().requires_grad_(), kv.detach().requires_grad_()
                o, l = sparse_mla_reference(qq, kk, indices, ctx.softmax_scale, v_dim=ctx.v_dim)
                outs, grads = [o], [dout]
                if dlse is not None:
                    outs.append(l)
                    grads.append(dlse)
                gq, gk = torch.autograd.grad(outs, (qq, kk), grads)
                dq.copy_(gq)
                dkv.copy_(gk)
                del o, l, gq, gk, qq, kk, outs, grads
            if ctx.target_link is not None:  # the dkv kernel's fp32 [T, k] target, handed to the loss backward
                ctx.target_link.put(sparse_attention_target(q, kv, indices, lse, ctx.softmax_scale, ctx.v_dim))
                ctx.target_link = None
            del pds, dq_chunk
            n_in = len(ctx.needs_input_grad)
            d_dep = torch.zeros((), device=q.device) if n_in > 8 and ctx.needs_input_grad[8] else None
            return (dq, dkv.to(kv.dtype), None, None, None, None, None, None, d_dep)[:n_in]

    def sparse_mla(q, kv, indices, softmax_scale, v_dim=512, deterministic=False, check_index_range=True,
                   dq_over_q=False):
        return _SparseMLAEmu.apply(q.contiguous(), kv.contiguous(), indices.contiguous(), float(softmax_scale),
                                   v_dim, deterministic, dq_over_q)

    _set(smla_pkg, "sparse_mla", sparse_mla)
    _set(deferred, "SparseMLAFunction", _SparseMLAEmu)  # what the deferred loss (loss_target='backward') applies

    # sparse-stage loss: the GPU branch of fused.sparse_indexer_loss (target kernel + fused KL)
    def sparse_attention_target(query, kv, indices, lse, softmax_scale, v_dim=512):
        T, K = indices.shape
        tgt = torch.empty((T, K), dtype=torch.float32, device=query.device)
        with _ref(), torch.no_grad():
            valid = indices >= 0
            rows = loss_ref._rows(K * (query.shape[1] + kv.shape[1] // 8))
            for r0 in range(0, T, rows):
                r1 = min(T, r0 + rows)
                kv_sel = kv.float()[indices[r0:r1].long().clamp(min=0)]
                logits = torch.bmm(query[r0:r1].float(), kv_sel.transpose(1, 2)) * softmax_scale
                p = loss_ref._masked_probs(logits, valid[r0:r1, None, :], lse[r0:r1].float())
                tgt[r0:r1] = p.sum(dim=1)
                del kv_sel, logits, p
        return tgt

    _set(fused, "sparse_attention_target", sparse_attention_target)
    # the loss ops take their kernel path (whose kernels are the stand-ins here)
    _set(fused, "use_triton", lambda *a: True)
    _set(deferred, "use_triton", lambda *a: True)

    def selected_scores_fwd(q, w, k, idx, relu):
        out = torch.empty(idx.shape[0], idx.shape[1], dtype=torch.float32, device=q.device)
        with _ref(), torch.no_grad():
            out.copy_(ss.torch_fwd(q, w, k, idx, relu))
        return out

    def kl_rows(target, scores, indices, row_mask=None, grad_out=None):
        T = target.shape[0]
        kl_ = torch.empty(T, dtype=torch.float32, device=target.device)
        lse, den = torch.empty_like(kl_), torch.empty_like(kl_)
        with _ref(), torch.no_grad():
            valid = indices >= 0
            tsum = (target * valid).sum(-1)
            tn = target / tsum.clamp_min(kl.EPS)[:, None]
            s = scores.masked_fill(~valid, float("-inf"))
            l = torch.logsumexp(s, -1)
            ls = torch.where(torch.isfinite(l), l, torch.zeros_like(l))
            term = torch.where(valid, tn * (torch.log(tn.clamp_min(kl.EPS)) - (scores - ls[:, None])), 0.0)
            r = term.sum(-1)
            if row_mask is not None:
                r = r * row_mask
            kl_.copy_(r)
            lse.copy_(ls)
            den.copy_(tsum)
            if grad_out is not None:  # G = softmax * sum(tn) - tn, written over scores (kl.py)
                tnsum = tsum / tsum.clamp_min(kl.EPS)
                grad_out.copy_(torch.where(valid, torch.exp(scores - ls[:, None]) * tnsum[:, None] - tn, 0.0))
            del valid, tn, s, l, ls, term, r, tsum
        return kl_, lse, den

    def selected_scores_bwd(q, w, k, idx, g, relu, deterministic, dq_over_q=False, row_coef=None):
        T, H, D = q.shape
        dq = torch.empty(T, H, D, dtype=q.dtype, device=q.device) if not dq_over_q else None
        dw = torch.empty(T, H, dtype=w.dtype if w.dtype.is_floating_point else torch.float32, device=q.device)
        dk = torch.zeros(k.shape[0], D, dtype=torch.float32, device=q.device)
        with _ref(), torch.no_grad():
            if row_coef is not None:  # the kernel scales g's rows as it loads them: no buffer (in place here)
                g = g.mul_(row_coef[:, None])
            a, b, c = ss.torch_bwd(q, w, k, idx, g, relu)
            if dq is None:  # written over the recomputed q, as the kernel does
                q.copy_(a)
                dq = q
            else:
                dq.copy_(a)
            dw.copy_(b)
            dk.copy_(c)
            del a, b, c, g
        return dq, dw, dk

    for mod in (kl, deferred):  # the loss modules' own names of the kernels
        _set(mod, "selected_scores_fwd", selected_scores_fwd)
        _set(mod, "kl_rows", kl_rows)
    _set(kl, "selected_scores_bwd", selected_scores_bwd)


def install_fused_rms_norm_standin():
    """torch.nn.RMSNorm: on CUDA ``torch.rms_norm`` runs the fused kernel (``_fused_rms_norm``: saves the
    input and an fp32 rstd per row); on CPU it decomposes into fp32 ops whose intermediates autograd
    saves (~5 fp32 copies of the input). Mirror the CUDA kernel's allocations."""

    class _FusedRMSNormEmu(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps, n_dims):
            dims = tuple(range(-n_dims, 0))
            y = torch.empty_like(x)
            rstd = torch.empty(*x.shape[:-n_dims], *([1] * n_dims), dtype=torch.float32, device=x.device)
            with _ref(), torch.no_grad():
                r = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + eps)
                rstd.copy_(r)
                o = x.float() * r
                if weight is not None:
                    o = o * weight.float()
                y.copy_(o)
                del r, o
            ctx.save_for_backward(x, weight, rstd)
            ctx.dims = dims
            return y

        @staticmethod
        def backward(ctx, g):
            x, weight, rstd = ctx.saved_tensors
            dx = torch.empty_like(x)
            dw = torch.empty_like(weight) if weight is not None else None
            with _ref(), torch.no_grad():
                xhat = x.float() * rstd
                gw = g.float() * (weight.float() if weight is not None else 1.0)
                d = rstd * (gw - xhat * (gw * xhat).mean(ctx.dims, keepdim=True))
                dx.copy_(d)
                if dw is not None:
                    dw.copy_((g.float() * xhat).reshape(-1, *weight.shape).sum(0))
                del xhat, gw, d
            return dx, dw, None, None

    def forward(self, x):
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _FusedRMSNormEmu.apply(x, self.weight, eps, len(self.normalized_shape))

    _set(torch.nn.RMSNorm, "forward", forward)


def install_replay_offload_booking():
    """On the GPU an offloaded replay entry lives in pinned host memory and read() copies it back."""
    from hyscale_megatron import replay

    store_cls = replay.ReplayStore
    orig_put, orig_read = store_cls.put, store_cls.read
    host_keys = set()

    def put(self, key, indices, fp, pending, offload=False, compact=True, sk=None):
        orig_put(self, key, indices, fp, pending, offload=offload, compact=compact, sk=sk)
        e = self._entries.get(key)
        if e is not None and offload and not e.data.is_cuda and LEDGER is not None:
            with LEDGER.category("host"):
                e.data = e.data.clone()
            host_keys.add(key)

    prefetched = {}  # key -> the device copy a GPU prefetch made (alive until that key's read)

    def read(self, key, fp, shape=None, prefetch_next=True):
        out = orig_read(self, key, fp, shape, prefetch_next=prefetch_next)
        if key in host_keys and LEDGER is not None:
            a = LEDGER.live.get(out.untyped_storage().data_ptr())
            if a is not None and a.cat == "host":
                # the device copy the GPU read makes (or made ahead, as the previous read's prefetch)
                pre = prefetched.pop(key, None)
                out = pre if pre is not None else out.clone()
            nxt = (key[0] - 1, key[1])
            if prefetch_next and nxt in host_keys and nxt in self._entries and nxt not in prefetched:
                prefetched[nxt] = self._entries[nxt].data.clone()  # GPU: copied back on a side stream now
            if key not in self._entries:
                host_keys.discard(key)
        return out

    _set(store_cls, "put", put)
    _set(store_cls, "read", read)


def install_discard_booking():
    """Megatron's ``CheckpointWithoutOutput`` (the MLA up-projection recompute) frees its outputs with
    ``untyped_storage().resize_(0)`` -- no op the dispatch mode sees -- and later points the same
    StorageImpl at the recomputed data. Book the discard as a free; from the recompute on, the
    recomputed outputs' own allocations carry the bytes."""
    from megatron.core.tensor_parallel import random as mrandom

    cls = mrandom.CheckpointWithoutOutput
    orig = cls.discard_output_and_register_recompute

    def discard(self, hook_tensor):
        outs = [o for o in (self.outputs or ()) if isinstance(o, torch.Tensor)]
        ptrs = [o.untyped_storage().data_ptr() for o in outs]
        orig(self, hook_tensor)
        if LEDGER is None:
            return
        for o, ptr in zip(outs, ptrs):
            if o.untyped_storage().nbytes() == 0:
                a = LEDGER.live.pop(ptr, None)
                if a is not None:
                    LEDGER.cur[a.cat] -= a.nbytes
                    a.freed_t, a.freed_phase = LEDGER.t, "discarded (CheckpointWithoutOutput)"
        LEDGER.tick("discard_output")

    _set(cls, "discard_output_and_register_recompute", discard)


# ----------------------------------------------------------------------------- components
def component(a: Alloc) -> str:
    """Coarse bucket of a live storage, from its shape/dtype/op and where it was made."""
    w, s, ph = a.where, a.shape, a.phase
    if a.cat != "device":
        return a.cat
    if "output_layer" in w or "CrossEntropy" in w or "vocab" in w.lower():
        return "output layer / CE (logits)"
    if ph.startswith("forward(no-grad") or (ph == "forward" and "layers" not in w):
        if "embedding" in w:
            return "embedding / layer inputs (forward)"
        return "checkpointed layer inputs (forward)"
    if "indexer" in w:
        return "indexer (q_I, k_I, w) activations"
    if "core_attention" in w or "SparseMLA" in w or "Sparse" in w or "Hy" in w:
        return "DSA core (attention/selection/loss)"
    if "mlp" in w:
        return "MLP activations"
    if "self_attention" in w:
        return "MLA projections / absorbed q, kv"
    if "layernorm" in w or "norm" in w:
        return "norms"
    return "other: " + (w.split(".")[-1] if w else a.op)


VOCAB = [0]


# ----------------------------------------------------------------------------- running one step
def build_argv(opts) -> list[str]:
    S = str(opts.seq_length)
    argv = [f"@{opts.config}", "--seq-length", S, "--max-position-embeddings", S, "--train-iters", "1",
            "--use-cpu-initialization", "--hyscale-core-loop", "--eval-iters", "0"]
    if opts.kind == "hyscale":
        argv += ["--spec", "hyscale_megatron.specs", "hyscale_block_spec", "--hyscale", "--hyscale-replay",
                 "--hyscale-replay-offload"]
        if opts.kernels == "emulate":
            argv += ["--hyscale-topk-impl", "triton", "--hyscale-attn-impl", "triton"]
        else:
            argv += ["--hyscale-topk-impl", "reference", "--hyscale-attn-impl", "reference"]
    else:
        argv += ["--spec", "hyscale_megatron.specs", "stock_block_spec", "--no-hyscale",
                 "--dsa-kernel-backend", "none"]
    if opts.topk:
        argv += ["--dsa-indexer-topk", str(opts.topk)]
    return argv + shlex.split(opts.extra)


def run(opts) -> dict:
    from hyscale_megatron import indexer_recompute

    if getattr(opts, "no_indexer_q_recompute", False):  # q saved as it is: no recipe, no dq over it
        _set(indexer_recompute, "hooks_for", lambda recipe, q: contextlib.nullcontext(False))
    # the q recompute's RoPE chunks are a fixed size (a 1/256 of q at 1M tokens): book them at that fraction
    chunk = indexer_recompute.RECOMPUTE_CHUNK_BYTES
    _set(indexer_recompute, "RECOMPUTE_CHUNK_BYTES", max(1, chunk * opts.seq_length // (1 << 20)))
    try:
        return _run(opts)
    finally:
        restore_patches()


def _run(opts) -> dict:
    global LEDGER
    from hyscale_megatron import replay
    from hyscale_megatron.tools import train

    if opts.kernels == "emulate":
        install_fused_rms_norm_standin()
        if opts.kind == "hyscale":
            install_kernel_standins()
    if opts.kind == "hyscale":
        install_replay_offload_booking()
    install_discard_booking()
    args = train.parse_train_args(build_argv(opts))
    VOCAB[0] = args.padded_vocab_size if getattr(args, "padded_vocab_size", None) else args.vocab_size
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    train._init_distributed(args)
    train._seed(args)
    train.install_hyscale_config(args)
    models = train.build_models(args)
    VOCAB[0] = models[0].output_layer.weight.shape[0] if hasattr(models[0], "output_layer") else VOCAB[0]
    config = get_model_config(models[0])
    config.grad_scale_func = None
    config.batch_p2p_sync = False
    data_iter = train._data_iterators(args, models)
    fwd_bwd = get_forward_backward_func()
    params = [p for m in models for p in m.parameters()]

    LEDGER = ledger = Ledger()
    if opts.trace:
        ledger.trace_min = int(opts.trace_min_per_token * opts.seq_length)
    ledger.mark_static(params)
    handles = ledger.hook_modules(models)
    t0 = time.perf_counter()
    try:
        with ledger:
            losses = fwd_bwd(forward_step_func=train.forward_step, data_iterator=data_iter, model=models[0],
                             num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
                             micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                             forward_only=False)
            ledger.tick("end of step")
    finally:
        LEDGER = None
        for h in handles:
            h.remove()
    wall = time.perf_counter() - t0
    grad_ptrs = {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
    grads = {id(ledger.live[k]) for k in grad_ptrs if k in ledger.live}
    lm = float(losses[0]["lm loss"][0] / losses[0]["lm loss"][1]) if losses else float("nan")
    replay.get_store().clear(warn=False)

    S = args.seq_length * args.micro_batch_size
    snap = ledger.peak_snapshot
    grad_bytes = sum(a.nbytes for a in snap if id(a) in grads)
    per_token = [a for a in snap if id(a) not in grads]
    by_comp: dict[str, int] = defaultdict(int)
    for a in per_token:
        by_comp[component(a)] += a.nbytes
    act = sum(by_comp.values())
    top = sorted(per_token, key=lambda a: -a.nbytes)[: opts.top]
    res = dict(
        kind=opts.kind, kernels=opts.kernels if opts.kind == "hyscale" else "stock-pytorch", seq_length=S,
        topk=args.dsa_indexer_topk, lm_loss=lm, wall_s=wall, argv=build_argv(opts),
        peak_bytes=ledger.peak, param_grad_bytes_at_peak=grad_bytes, activation_bytes_at_peak=act,
        per_token_bytes=act / S, peak_at=ledger.peak_info,
        components={k: dict(bytes=v, per_token=v / S) for k, v in sorted(by_comp.items(), key=lambda kv: -kv[1])},
        phase_peaks_per_token={k: v / S for k, v in ledger.phase_peaks.items()},
        cpu_reference_scratch_peak_bytes=ledger.ref_peak, host_peak_bytes=ledger.host_peak,
        top=[dict(bytes=a.nbytes, per_token=a.nbytes / S, shape=list(a.shape), dtype=a.dtype, op=a.op,
                  phase=a.phase, where=a.where, component=component(a)) for a in top],
    )
    if opts.trace:
        with open(opts.trace, "w") as f:
            for a in ledger.trace:
                f.write(f"{a.t}\t{a.freed_t}\t{a.nbytes / S:.0f}\t{list(a.shape)}\t{a.dtype}\t{a.op}\t{a.cat}\t"
                        f"{a.phase} @ {a.where}\t-> {a.freed_phase}\n")
    return res


def report(res: dict) -> str:
    S = res["seq_length"]
    lines = [
        f"# memory ledger: {res['kind']} ({res['kernels']}), S = {S}, topk = {res['topk']}, "
        f"lm loss {res['lm_loss']:.4f}, {res['wall_s']:.0f} s",
        f"peak allocated (GPU-equivalent): {res['peak_bytes'] / 2**20:.1f} MiB = "
        f"{res['activation_bytes_at_peak'] / S / 1024:.1f} KiB/token activations "
        f"+ {res['param_grad_bytes_at_peak'] / 2**20:.1f} MiB parameter gradients",
        f"peak at op #{res['peak_at'].get('t')} {res['peak_at'].get('op')} | phase {res['peak_at'].get('phase')} | "
        f"{res['peak_at'].get('where')}",
        f"cpu reference scratch (not on the GPU): peak {res['cpu_reference_scratch_peak_bytes'] / 2**20:.1f} MiB; "
        f"host (offloaded replay) peak {res['host_peak_bytes'] / 2**20:.2f} MiB",
        "",
        "| component (live at the peak) | bytes/token | KiB/token |",
        "|---|---:|---:|",
    ]
    for k, v in res["components"].items():
        lines.append(f"| {k} | {v['per_token']:.0f} | {v['per_token'] / 1024:.1f} |")
    lines.append(f"| **total** | {res['per_token_bytes']:.0f} | {res['per_token_bytes'] / 1024:.1f} |")
    lines += ["", "| bytes/token | shape | dtype | op | phase | made in |", "|---:|---|---|---|---|---|"]
    for a in res["top"]:
        lines.append(f"| {a['per_token']:.0f} | {a['shape']} | {a['dtype']} | {a['op']} | {a['phase']} | {a['where']} |")
    lines += ["", "phase peaks (live device bytes / token incl. static grads): " +
              ", ".join(f"{k} {v:.0f}" for k, v in res["phase_peaks_per_token"].items())]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=("hyscale", "stock"), default="hyscale")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="Megatron args file (default: the longest config).")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--topk", type=int, default=None, help="Override --dsa-indexer-topk (default: the config's).")
    p.add_argument("--kernels", choices=("emulate", "reference"), default="emulate",
                   help="GPU-faithful stand-ins of HyScale's Triton kernels and of CUDA's fused RMSNorm (default), "
                        "or the CPU code paths as they are.")
    p.add_argument("--no-indexer-q-recompute", action="store_true",
                   help="Keep the indexer q for the sparse loss backward instead of recomputing it there "
                        "(hyscale_megatron.indexer_recompute off).")
    p.add_argument("--extra", default="", help="Extra Megatron/HyScale flags (one shell-quoted string).")
    p.add_argument("--top", type=int, default=25, help="How many of the largest live storages to list.")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="Also write the result as JSON here.")
    p.add_argument("--trace", default=None, help="Write every allocation >= --trace-min-per-token bytes/token "
                   "(alloc op #, free op #, bytes/token, shape, dtype, op, category, where made -> where freed).")
    p.add_argument("--trace-min-per-token", type=float, default=256.0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    res = run(opts)
    print(report(res), flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
