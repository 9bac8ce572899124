"""HyTopK honours each row's bounds: packed / varlen segments, masked rows, rows with fewer visible keys than topk,
topk above S, fewer keys than a tile, odd sizes and head counts (tests/_hytopk_helpers.py says how the CPU runs)."""

from __future__ import annotations

import pytest
import torch
from _hytopk_helpers import assert_reference_sets, inputs, interp, interp_config
from _hytopk_helpers import stale_outputs  # noqa: F401  (autouse fixture)

from hyscale_kernels.hytopk import hytopk
from hyscale_kernels.hytopk.reference import packed_causal_bounds


@interp
def test_packed_segments_masked_and_short_rows():
    """Packed causal segments (one shorter than a tile, so the last tile of a row block is moved down to end at
    its range), a masked row (starts == ends, all -1), rows with fewer visible keys than topk (-1 padded), signed
    scores under the identity, odd T."""
    st, en = packed_causal_bounds([3, 20, 5, 13])
    T = st.numel()
    en = en.clone()
    en[24] = st[24]  # masked
    q, w, k = inputs(T, T, 2, seed=11)
    idx, val = hytopk(q, w, k, st, en, 6, relu=False, return_scores=True)
    assert (idx[24] == -1).all() and (val[24] == float("-inf")).all()
    assert (idx[0, 1:] == -1).all(), "a row with one visible key"
    assert_reference_sets(q, w, k, st, en, 6, False, idx, val)


@interp
@pytest.mark.parametrize("H", [1, 4])
def test_topk_above_keys_and_tiny_key_tensor(H):
    """S below one key tile (k is padded to a tile; the padding is never visible), topk above S, an odd head
    count (H 1: each score is one head's) and rows that see none of the keys."""
    T, S, topk = 5, 11, 16
    q, w, k = inputs(T, S, H, seed=H)
    st = torch.tensor([0, 0, 3, 7, 11], dtype=torch.int32)
    en = torch.tensor([11, 4, 9, 7, 11], dtype=torch.int32)
    idx, val = hytopk(q, w, k, st, en, topk, return_scores=True, config=interp_config(H, topk))
    assert (idx[:, S:] == -1).all() and (idx[3] == -1).all() and (idx[4] == -1).all()
    assert_reference_sets(q, w, k, st, en, topk, True, idx, val)


def test_no_rows():
    """T = 0: empty outputs, no launch."""
    q, w, k = inputs(0, 8, 2)
    st = torch.zeros(0, dtype=torch.int32)
    idx, val = hytopk(q, w, k, st, st, 4, return_scores=True)
    assert idx.shape == (0, 4) and val.shape == (0, 4) and idx.dtype == torch.int32
