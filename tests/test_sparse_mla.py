"""sparse_mla: the PyTorch reference against stock Megatron and a dense formulation; the Triton kernels (interpreter
on CPU at tiny fp32 shapes, bf16 on GPU) against the reference, forward and gradients, at odd sizes, with -1
padding anywhere in a row, rows without a valid key, one-key rows, several token chunks; deterministic dkv;
dq written over q; bad input."""

from __future__ import annotations

import pytest
import torch

from hyscale_kernels.sparse_mla import kernel as km
from hyscale_kernels.sparse_mla import sparse_mla
from hyscale_kernels.sparse_mla.reference import sparse_mla_reference
from _sparse_cases import TOL, attn_case, attn_grads, gpu_attn_case, nan_outputs, needs_triton, rel_l2  # noqa: F401


def _dense_sparse_mla(q, kv, idx, scale, v_dim):
    """Dense [T, N, S] formulation with an index mask: an independent check of the reference."""
    T, S = q.shape[0], kv.shape[0]
    mask = torch.zeros(T, S + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(idx >= 0, idx, S).long(), True)
    mask = mask[:, :S]
    logits = torch.einsum("tnd,sd->tns", q.float(), kv.float()) * scale
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(logits, -1)
    p = torch.softmax(logits, -1).nan_to_num(0.0)
    return torch.einsum("tns,sv->tnv", p, kv.float()[:, :v_dim]), lse


# ---------------------------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------------------------
def test_reference_matches_dense_and_grads():
    q, kv, idx, dout, dlse = attn_case(T=13, N=5, V=32, R=8, S=13, K=6, seed=0, device="cpu")
    got = attn_grads(lambda *a, **k: sparse_mla_reference(*a, chunk_rows=4, **k), q, kv, idx, 0.2, 32, dout, dlse)
    ref = attn_grads(lambda q_, kv_, i_, s_, v_dim: _dense_sparse_mla(q_, kv_, i_, s_, v_dim), q, kv, idx, 0.2, 32,
                     dout, dlse)
    assert torch.equal(got[1][0], torch.full((5,), float("-inf"))) and torch.equal(got[0][0], torch.zeros(5, 32))
    for a, b in zip(got, ref):
        assert torch.isfinite(a[torch.isfinite(b)]).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_reference_matches_stock_unfused():
    """Stock's unfused absorbed path (causal: row t sees keys <= t), with -1 padding anywhere in the rows."""
    from megatron.core.transformer.experimental_attention_variant.dsa import _unfused_absorbed_dsa_fn

    T, K = 17, 5
    q, kv, _, _, _ = attn_case(T=T, N=4, V=32, R=16, S=T, K=K, seed=1, device="cpu")
    gen = torch.Generator().manual_seed(1)
    idx = torch.full((T, K), -1, dtype=torch.int64)
    for t in range(T):
        n = min(K, t + 1) - (t % 3 == 2)  # some rows padded though more keys are visible
        idx[t, torch.randperm(K, generator=gen)[:max(n, 1)]] = torch.randperm(t + 1, generator=gen)[:max(n, 1)]
    out, _ = sparse_mla_reference(q, kv, idx, 0.15, v_dim=32)
    stock = _unfused_absorbed_dsa_fn(q[:, None], kv[:, None, None], idx[None], 0.15, 32)  # [T, 1, N, V]
    torch.testing.assert_close(out, stock[:, 0], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# the kernels against the reference
# ---------------------------------------------------------------------------------------------
CASES = {  # T, N, V, R, S, K, tokens per backward chunk (None: one chunk), dlse given
    "odd-heads-partial-key-tile": (6, 5, 32, 16, 40, 37, None, True),
    "70-heads-chunks": (7, 70, 32, 16, 30, 20, 3, True),  # several head blocks (last partial); T % chunk != 0
    "16-heads-one-token-chunks": (5, 16, 32, 16, 50, 40, 1, False),  # one head block: grouped dkv programs
    "no-rope-tail": (3, 3, 32, 0, 12, 9, 2, True),  # v_dim == Dqk
}


def _set_chunk(monkeypatch, chunk, N, K, elem_bytes=4):
    """Make the backward run in chunks of ``chunk`` tokens (its scratch bound, SCRATCH_BYTES)."""
    if chunk is not None:
        monkeypatch.setattr(km, "SCRATCH_BYTES", chunk * 2 * N * K * elem_bytes)
        assert km.scratch_chunk_tokens(100, N, K, elem_bytes) == chunk


@needs_triton
@pytest.mark.usefixtures("nan_outputs")
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_forward_and_gradients_match_reference(case, monkeypatch):
    T, N, V, R, S, K, chunk, with_dlse = case
    _set_chunk(monkeypatch, chunk, N, K)
    q, kv, idx, dout, dlse = attn_case(T, N, V, R, S, K, seed=N)
    dlse = dlse if with_dlse else None
    got = attn_grads(sparse_mla, q, kv, idx, 0.3, V, dout, dlse)
    ref = attn_grads(sparse_mla_reference, q, kv, idx, 0.3, V, dout, dlse)
    out, lse, dq, dkv = got
    assert torch.equal(lse[0], torch.full((N,), float("-inf"))) and torch.equal(out[0], torch.zeros(N, V))
    assert torch.equal(dq[0], torch.zeros_like(dq[0]))  # no valid key: no gradient
    torch.testing.assert_close(out[1], kv[S - 1, :V].expand(N, V), **TOL)  # one key: out = its value
    for a, b in zip(got, ref):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a, b, **TOL)


@needs_triton
@pytest.mark.usefixtures("nan_outputs")
def test_deterministic_dkv_is_repeatable_and_matches_atomics(monkeypatch):
    """The sorted dkv reduction gives the same bits run to run and whatever its buffer size (here smaller than
    a chunk's contributions: more chunks, same order), and the atomic reduction's values."""
    T, N, V, R, S, K = 5, 20, 32, 16, 24, 18
    q, kv, idx, dout, dlse = attn_case(T, N, V, R, S, K, seed=2)
    out, lse = km.sparse_mla_fwd(q, kv, idx, 0.3, V)
    a = km.sparse_mla_bwd(q, kv, idx, out, lse, dout, dlse, 0.3, V, deterministic=True)
    b = km.sparse_mla_bwd(q, kv, idx, out, lse, dout, dlse, 0.3, V, deterministic=True)
    monkeypatch.setattr(km, "DET_BUF_ELEMS", 2 * K * (V + R))
    c = km.sparse_mla_bwd(q, kv, idx, out, lse, dout, dlse, 0.3, V, deterministic=True)
    d = km.sparse_mla_bwd(q, kv, idx, out, lse, dout, dlse, 0.3, V)
    for x in (b, c):
        assert torch.equal(x[0], a[0]) and torch.equal(x[1], a[1])
    torch.testing.assert_close(d[1], a[1], **TOL)


@needs_triton
@pytest.mark.usefixtures("nan_outputs")
@pytest.mark.parametrize("chunk,deterministic", [(None, False), (2, True)], ids=["one-chunk", "chunks-det"])
def test_dq_over_q(chunk, deterministic, monkeypatch):
    """dq written into q's storage (per chunk, after that chunk's dkv kernel read q) equals dq into a new buffer;
    a non-contiguous q is refused."""
    T, N, V, R, S, K = 7, 4, 16, 8, 11, 5
    _set_chunk(monkeypatch, chunk, N, K)
    q, kv, idx, dout, _ = attn_case(T, N, V, R, S, K, seed=3)
    out, lse = km.sparse_mla_fwd(q, kv, idx, 0.3, V)
    ref_dq, ref_dkv = km.sparse_mla_bwd(q, kv, idx, out, lse, dout, None, 0.3, V, deterministic=deterministic)
    q2 = q.clone()
    dq, dkv = km.sparse_mla_bwd(q2, kv, idx, out, lse, dout, None, 0.3, V, deterministic=deterministic,
                                dq_over_q=True)
    assert dq.data_ptr() == q2.data_ptr() and not torch.equal(q2, q)
    assert torch.equal(dq, ref_dq)
    torch.testing.assert_close(dkv, ref_dkv, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="dq_over_q needs a contiguous q"):
        km.sparse_mla_bwd(q.transpose(0, 1).contiguous().transpose(0, 1), kv, idx, out, lse, dout, None, 0.3, V,
                          dq_over_q=True)


def test_bad_input_is_named():
    q, kv, idx = torch.randn(3, 2, 24), torch.randn(5, 24), torch.zeros(3, 4, dtype=torch.int32)
    for args, err, msg in [
        ((q, kv, idx + 5), ValueError, "indices must be in"),
        ((q, kv, idx - 2), ValueError, "indices must be in"),
        ((q, kv[:, :20], idx), ValueError, "kv must be"),
        ((q, kv.double(), idx), TypeError, "kv must have dtype"),
        ((q, kv, idx.float()), TypeError, "indices must have dtype"),
        ((q, kv, torch.zeros(3, 4096, dtype=torch.int32)), ValueError, "topk must be"),
        ((q, kv, idx[:2]), ValueError, r"indices must be \[3, topk\]"),
        ((q[0], kv, idx), ValueError, "q must be 3-D"),
    ]:
        with pytest.raises(err, match=msg):
            sparse_mla(*args, 0.1, v_dim=16)
    with pytest.raises(ValueError, match="v_dim"):
        sparse_mla(q, kv, idx, 0.1, v_dim=30)
    with pytest.raises(ValueError, match="softmax_scale must be a positive float"):
        sparse_mla(q, kv, idx, -1.0, v_dim=16)


def test_scratch_chunk_bounds_the_scratch():
    """256 MiB of bf16 P + dS: 256 tokens at N = 128, k = 2048; never more tokens than T."""
    assert km.scratch_chunk_tokens(65536, 128, 2048, 2) == 256
    assert km.scratch_chunk_tokens(65536, 16, 2048, 2) == 2048
    assert km.scratch_chunk_tokens(100, 16, 2048, 2) == 100
    assert 2 * 256 * 128 * 2048 * 2 <= km.SCRATCH_BYTES


# ---------------------------------------------------------------------------------------------
# GPU: bf16 at real shapes
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.usefixtures("nan_outputs")
@pytest.mark.parametrize("N", [16, 128, 24])
@pytest.mark.parametrize("K", [2048, 512, 1000])
def test_gpu_bf16_matches_reference(N, K):
    T, S = 1024, 3072
    q, kv, idx = gpu_attn_case(T, N, S, K)
    idx[3] = -1  # no valid key
    idx[5, 1:] = -1  # one key
    dout = torch.randn(T, N, 512, device="cuda")
    dlse = torch.randn(T, N, device="cuda")
    got = attn_grads(sparse_mla, q, kv, idx, 576 ** -0.5, 512, dout, dlse)
    ref = attn_grads(sparse_mla_reference, q.float(), kv.float(), idx, 576 ** -0.5, 512, dout, dlse)
    for name, a, b in zip(("out", "lse", "dq", "dkv"), got, ref):
        fin = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), fin), name
        assert not torch.isnan(a).any(), name
        assert rel_l2(a[fin], b[fin]) < 2e-2, f"{name}: relative L2 error {rel_l2(a[fin], b[fin])}"


@pytest.mark.gpu
def test_gpu_deterministic_dkv():
    q, kv, idx = gpu_attn_case(512, 64, 1024, 512, seed=1)
    dout = torch.randn(512, 64, 512, device="cuda")
    a, b, c = (attn_grads(sparse_mla, q, kv, idx, 0.04, 512, dout, deterministic=d) for d in (True, True, False))
    assert torch.equal(a[3], b[3]) and torch.equal(a[2], b[2])
    torch.testing.assert_close(a[3].float(), c[3].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [16, 128])
def test_gpu_dq_over_q_bit_identical(N):
    """bf16, k 2048: dq written over q (staged per chunk, then copied) equals dq into a new buffer bit for bit."""
    T, S = 4096, 4096
    q, kv, idx = gpu_attn_case(T, N, S, 2048, seed=2)
    out, lse = km.sparse_mla_fwd(q, kv, idx, 576 ** -0.5, 512)
    dout = torch.randn(out.shape, device="cuda").bfloat16()
    ref_dq, ref_dkv = km.sparse_mla_bwd(q, kv, idx, out, lse, dout, None, 576 ** -0.5, 512, deterministic=True)
    q2 = q.clone()
    dq, dkv = km.sparse_mla_bwd(q2, kv, idx, out, lse, dout, None, 576 ** -0.5, 512, deterministic=True,
                                dq_over_q=True)
    assert dq.data_ptr() == q2.data_ptr() and torch.equal(dq, ref_dq) and torch.equal(dkv, ref_dkv)
