"""HyTopK's Triton kernel: the indexer scores tile by tile, each query row's exact top-k kept on the fly.

A persistent program owns ``R`` query rows at a time (a row block) for their whole key range:

* scoring (``_tile_scores``): per tile of ``BLOCK_N`` keys, ``K_tile @ Q_block^T`` on the tensor cores, then the
  activation, the head weights and the head sum give ``sc [BLOCK_N, R]`` in fp32;
* append (``_append_tile``): a score that beats its row's running threshold is written, as raw fp32 bits with its
  key index, to the row's candidate buffer (scratch ``[R, CAP]``); the tile's keys form ``KEY_GROUPS`` groups (one
  warp's MMA rows each), each appending to its own region of the buffer, so no count crosses warps;
* compaction (``_select``): before a tile could overflow a region, each row's exact ``kk``-th candidate is found
  (``_kth_radix`` or ``_kth_interp``), the row keeps exactly its top ``kk`` and the threshold rises to that key;
* output: the same select writes the final ``kk`` indices (and scores), then ``-1`` padding.

A warm start (``_warm_threshold``) sets each long row's first threshold from a sample of its keys; a row left with
fewer than ``kk`` candidates is re-run from ``-inf``, so the result is exact either way. Ties at a row's ``kk``-th
score go to the lowest key indices. docs/hytopk.md explains the design.

Tile names: ``o_`` offsets, ``m_`` masks, ``b_`` loaded or computed tiles; ``kk`` is topk. Tuples passed between
the functions:

* ``blk`` (a row block's scoring inputs): ``(k_ptr, lo, hi, b_start, b_end, b_qT, b_w, o_n, o_d)``: the key tensor,
  the block's key range [lo, hi), its rows' bounds [R], the query tile [D_P2, R * H], the head weights [R * H]
  (fp32) and the offsets of a key tile [BLOCK_N] and of the head dim [D_P2];
* ``scr`` (the program's scratch rows): ``(key_rows, idx_rows, key_base, idx_base)``: [R] row pointers of the
  candidates' fp32 bits and key indices, and the block's first row of each (the split selects' halves);
* ``buf`` (the candidate buffers' state): ``(cnt, cnt_g, reg0, F, thr)``: per row the packed prefix [R], each key
  group's region count [KEY_GROUPS, R], the regions' first slot and width (scalars) and the threshold key [R].
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

INT32_MIN = tl.constexpr(-2147483648)
INT32_MAX = tl.constexpr(2147483647)
RAW_NONE = tl.constexpr(-1)  # an empty buffer slot: the fp32 bits of a NaN, whose key is INT32_MIN (never counted)
# key groups per tile, each appending to its own region of a row's buffer: the 4 warps of one warpgroup along the
# MMA's M side (a wgmma warp holds 16 consecutive keys of a 64-key tile), so a group's slots stay inside one warp
KEY_GROUPS = tl.constexpr(4)
WARM_Z = tl.constexpr(4.0)  # warm start: the sample rank's margin in binomial standard deviations above a row's share
WARM_MIN = tl.constexpr(16)  # warm start: fewest visible sample keys a row needs to use it


@triton.jit
def _score_to_key(sc):
    """fp32 -> int32 key with the same order (-0.0 folded onto +0.0 so the two tie)."""
    sc = tl.where(sc == 0.0, 0.0, sc)
    bits = sc.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


# True when Triton runs this module in its CPU interpreter (TRITON_INTERPRET=1 when the kernels were defined): no
# inline PTX there, and no `range` over runtime bounds
INTERPRETED = tl.constexpr(type(_score_to_key).__name__ == "InterpretedFunction")


@triton.jit
def _key_to_score(key):
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _thr_score(thr):
    """The fp32 bound equivalent to ``key > thr``: score >= the score of key thr + 1 (-inf for INT32_MIN: every
    score; key INT32_MAX + 1 wraps to a NaN bound: none). -0.0 and +0.0 compare equal, as their keys do."""
    return tl.where(thr == INT32_MIN, float("-inf"), _key_to_score(thr + 1))


@triton.jit
def _below_key(x):
    """The largest score whose key is below key x [R] (x > INT32_MIN): the score of key x - 1, except at x = 0,
    where key -1 is the score -0.0 (which ties +0.0, key 0): key -2 (the negative denormal next to 0) instead."""
    return _key_to_score(tl.where(x == 0, -2, x - 1))


@triton.jit
def _load_keys(ptrs, mask):
    """Buffered candidates (raw fp32 bits) as int32 keys; INT32_MIN where masked or empty."""
    return _score_to_key(tl.load(ptrs, mask=mask, other=RAW_NONE).to(tl.float32, bitcast=True))


@triton.jit
def _n_buffered(cnt, cnt_g):
    """Candidates held per row [R]: the packed prefix plus every key group's region."""
    return cnt + tl.sum(cnt_g, axis=0)


@triton.jit
def _popc32(x):
    """Set bits of each int32 [any shape] -> int32 (POPC on the GPU, a SWAR count under the interpreter)."""
    if INTERPRETED:
        v = x.to(tl.uint32, bitcast=True)
        v = v - ((v >> 1) & 0x55555555)
        v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
        v = (v + (v >> 4)) & 0x0F0F0F0F
        return ((v * 0x01010101) >> 24).to(tl.int32)
    else:
        return libdevice.popc(x)


@triton.jit
def _store1(p_a, v_a, m):
    """Masked scatter of one int32 tensor (m: bool or int32 0 / 1), as _store2."""
    if INTERPRETED:
        tl.store(p_a, v_a, mask=m != 0)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }", "=r,l,r,r",
            [p_a.to(tl.int64), v_a, m.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store2(p_a, v_a, p_b, v_b, m):
    """Masked scatter of two int32 tensors of one shape. Compiled: inline PTX in the operands' own (MMA-derived)
    layout; a tl.store would first convert them to a coalesced layout through shared memory, for nothing: the
    addresses are data-dependent slots."""
    if INTERPRETED:
        tl.store(p_a, v_a, mask=m != 0)
        tl.store(p_b, v_b, mask=m != 0)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $5, 0; @p st.global.b32 [$1], $2; @p st.global.b32 [$3], $4; "
            "mov.b32 $0, 0; }", "=r,l,r,l,r,r", [p_a.to(tl.int64), v_a, p_b.to(tl.int64), v_b, m.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)


# ------------------------------------------------------------------------------------------------ scoring


@triton.jit
def _block_columns(R: tl.constexpr, H: tl.constexpr):
    """Flattened (row * H + head) of each column of the score tile's MMA, [R * H] int32.

    With 4 | R and an even H ("lane rows"): column c = ((head // 2) * (R // 4) + row // 4) * 8 + (row % 4) * 2
    + head % 2. An MMA accumulator gives lane l of a quad the column pairs {8j + 2l, 8j + 2l + 1}: in this order
    lane l holds every head of rows l, l + 4, ... and no other row, so the head sum stays inside the thread and
    each (key, row) score lives in one thread only. Otherwise (row, head) order."""
    o_c = tl.arange(0, R * H)  # [R * H]
    if R % 4 == 0 and H % 2 == 0:
        g: tl.constexpr = R // 4
        row = ((o_c // 8) % g) * 4 + (o_c % 8) // 2
        head = (o_c // (8 * g)) * 2 + o_c % 2
        return row * H + head
    return o_c


@triton.jit
def _scores(b_k, b_qT, b_w, R: tl.constexpr, RELU: tl.constexpr):
    """Scores of one key tile for the block's rows: [BLOCK_N, R] fp32 (columns as _block_columns).
    fp32 inputs multiply in IEEE fp32 (no TF32). Lane rows: the even and the odd heads of a (key, row) are summed
    as two in-thread chains, then added."""
    BLOCK_N: tl.constexpr = b_k.shape[0]
    H: tl.constexpr = b_w.shape[0] // R
    if b_k.dtype == tl.float32:
        acc = tl.dot(b_k, b_qT, input_precision="ieee")  # [BLOCK_N, R * H]
    else:
        acc = tl.dot(b_k, b_qT)  # [BLOCK_N, R * H]
    if RELU:
        acc = tl.maximum(acc, 0.0)
    acc = acc * b_w[None, :]
    if R % 4 == 0 and H % 2 == 0:  # [BLOCK_N, head pair, row group, row in group, head parity]
        acc = tl.reshape(acc, [BLOCK_N, H // 2, R // 4, 4, 2])
        sc = tl.sum(tl.sum(acc, axis=1), axis=3)  # [BLOCK_N, R // 4, 4]
        return tl.reshape(sc, [BLOCK_N, R])
    return tl.sum(tl.reshape(acc, [BLOCK_N, R, H]), axis=2)  # [BLOCK_N, R]


@triton.jit
def _row_block(i_blk, q_ptr, w_ptr, k_ptr, starts_ptr, ends_ptr, T, S, H: tl.constexpr, D: tl.constexpr,
               D_P2: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row block i_blk: its query rows o_t [R], their mask m_t [R], its key tiles' count and its scoring inputs
    ``blk`` (module docstring). The key range [lo, hi) spans the live rows' bounds (a row with starts == ends is
    masked). The offsets in blk are computed once here, outside the key loop, and shared by its tiles."""
    o_t = i_blk * R + tl.arange(0, R)  # [R] query rows
    m_t = o_t < T
    b_start = tl.load(starts_ptr + o_t, mask=m_t, other=0)  # [R]
    b_end = tl.load(ends_ptr + o_t, mask=m_t, other=0)  # [R]
    m_live = b_end > b_start
    lo = tl.min(tl.where(m_live, b_start, S), axis=0)
    hi = tl.max(tl.where(m_live, b_end, 0), axis=0)
    n_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    o_d = tl.arange(0, D_P2)  # [D_P2]
    o_m = i_blk * (R * H) + _block_columns(R, H)  # [R * H] flattened (row, head), in the tile's column order
    m_m = o_m < T * H
    b_q = tl.load(q_ptr + o_m.to(tl.int64)[:, None] * D + o_d[None, :],
                  mask=m_m[:, None] & (o_d < D)[None, :], other=0.0)  # [R * H, D_P2]
    b_qT = tl.trans(b_q)  # [D_P2, R * H]
    b_w = tl.load(w_ptr + o_m, mask=m_m, other=0.0).to(tl.float32)  # [R * H]
    o_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    return o_t, m_t, n_tiles, (k_ptr, lo, hi, b_start, b_end, b_qT, b_w, o_n, o_d)


@triton.jit
def _tile_start(i_n, lo, hi, BLOCK_N: tl.constexpr):
    """The first key of key tile i_n as loaded: its nominal start lo + i_n BLOCK_N, or for the last tile,
    hi - BLOCK_N (at least 0), so that the tile ends at the block's range."""
    return tl.maximum(tl.minimum(lo + i_n * BLOCK_N, hi - BLOCK_N), 0)


@triton.jit
def _tile_scores(i_n, blk, D: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr):
    """Key tile i_n: its key indices [BLOCK_N], scores [BLOCK_N, R] and visibility [BLOCK_N, R].

    The tile nominally covers keys [lo + i_n BLOCK_N, + BLOCK_N); the last one, past hi, is moved down to end at hi
    (at 0 at the lowest: op.py pads k to BLOCK_N rows), and the keys it shares with the tile before are not
    visible (m_vis starts at the nominal start). So every load is in bounds and unmasked, its addresses one base
    plus per-thread constants. Offsets are int32 (S x D < 2^31, checked by op.py)."""
    k_ptr, lo, hi, b_start, b_end, b_qT, b_w, o_n, o_d = blk
    i_0 = lo + i_n * BLOCK_N  # the nominal start
    i_s = _tile_start(i_n, lo, hi, BLOCK_N)  # the loaded tile's first key
    o_s = i_s + o_n  # [BLOCK_N] key indices
    b_k = tl.load(k_ptr + i_s * D + (o_n[:, None] * D + o_d[None, :]), mask=(o_d < D)[None, :],
                  other=0.0)  # [BLOCK_N, D_P2]
    sc = _scores(b_k, b_qT, b_w, b_start.shape[0], RELU)  # [BLOCK_N, R]
    m_vis = (o_s[:, None] >= tl.maximum(b_start, i_0)[None, :]) & (o_s[:, None] < b_end[None, :])  # [BLOCK_N, R]
    return o_s, sc, m_vis


# ------------------------------------------------------------------------------------------------ append


# the sm_90a layouts of the [KEY_GROUPS, 16, R] candidate tile that the ballot slots' lane arithmetic assumes (op.py
# checks each compiled kernel's TTGIR against them), by rows per tile R: register bit -> key + 8 (R 8: a second
# register bit -> row + 4), lane bits -> row + 1, row + 2, key + 1, key + 2, key + 4, warp bits -> group + 1,
# group + 2. So key j, row r of a group sit in lane 4 (j % 8) + r % 4, register (j >= 8) + 2 (r >= 4) of its warp.
BALLOT_LAYOUTS = {
    4: "register = [[0, 8, 0]], lane = [[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]], "
       "warp = [[1, 0, 0], [2, 0, 0]]",
    8: "register = [[0, 8, 0], [0, 0, 4]], lane = [[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]], "
       "warp = [[1, 0, 0], [2, 0, 0]]",
}
_BALLOT_ASM = tl.constexpr(
    # $0 $1: slot offsets of the thread's keys j, j + 8 (earlier candidates of its (group, row)); $2 $3: the group's
    # candidates in that row; $4 $5: the keys' candidate flags; $6 (= $7): the lanes of the thread's row
    # (0x11111111 << lane % 4); $8 (= $9): %lanemask_lt. Lane l holds row l % 4, keys l // 4 and l // 4 + 8 (pack 2
    # takes a thread's registers in pairs: registers 0, 1 = keys j, j + 8 of a row; with 8 rows 2, 3 the same for
    # row + 4, whose ballots are the pair's own)
    "{ .reg .pred p0, p1; .reg .b32 b0, b1, c0; "
    "setp.ne.b32 p0, $4, 0; setp.ne.b32 p1, $5, 0; "
    "vote.sync.ballot.b32 b0, p0, 0xffffffff; vote.sync.ballot.b32 b1, p1, 0xffffffff; "
    "and.b32 b0, b0, $6; and.b32 b1, b1, $6; popc.b32 c0, b0; "
    "and.b32 $0, b0, $8; popc.b32 $0, $0; and.b32 $1, b1, $8; popc.b32 $1, $1; add.s32 $1, $1, c0; "
    "popc.b32 $2, b1; add.s32 $2, $2, c0; mov.b32 $3, $2; }")


@triton.jit
def _ballot_model(m_c):
    """The interpreter's model of _BALLOT_ASM on the layout BALLOT_LAYOUTS[R]: (slot offsets, group counts), both
    [KEY_GROUPS, 16, R] int32, from each group's 4 ballots (registers 0 .. 3; 2 and 3 empty with 4 rows)."""
    NG: tl.constexpr = m_c.shape[1]
    R: tl.constexpr = m_c.shape[2]
    o_j = tl.arange(0, NG)[None, :, None]  # [1, NG, 1]
    o_r = tl.arange(0, R)[None, None, :]  # [1, 1, R]
    lane = 4 * (o_j % 8) + o_r % 4  # [1, NG, R]
    b_lane = tl.full(m_c.shape, 1, tl.int32) << lane  # [KG, NG, R] the lane's ballot bit
    hi = o_j >= 8  # [1, NG, 1] register bit 0: key + 8
    rh = o_r >= 4  # [1, 1, R] register bit 1 (8 rows): row + 4
    # distinct lanes: a sum is an OR
    b00 = tl.sum(tl.sum(tl.where(m_c & ~hi & ~rh, b_lane, 0), axis=2), axis=1)  # [KG]
    b01 = tl.sum(tl.sum(tl.where(m_c & hi & ~rh, b_lane, 0), axis=2), axis=1)
    b10 = tl.sum(tl.sum(tl.where(m_c & ~hi & rh, b_lane, 0), axis=2), axis=1)
    b11 = tl.sum(tl.sum(tl.where(m_c & hi & rh, b_lane, 0), axis=2), axis=1)
    rm = tl.full([1, 1, R], 0x11111111, tl.int32) << (o_r % 4)  # [1, 1, R] the lanes of the thread's row
    lt = b_lane - 1  # [KG, NG, R] %lanemask_lt (bit 31: INT32_MIN - 1 wraps to 0x7FFFFFFF)
    b_lo = tl.where(rh, b10[:, None, None], b00[:, None, None]) & rm  # [KG, 1, R] the row's keys j < 8
    b_hi = tl.where(rh, b11[:, None, None], b01[:, None, None]) & rm  # [KG, 1, R] its keys j >= 8
    c0 = _popc32(b_lo)  # [KG, 1, R]
    c1 = _popc32(b_hi)
    b_own = tl.where(hi, b_hi, b_lo)  # [KG, NG, R]
    off = _popc32(b_own & lt) + tl.where(hi, c0, 0)
    return off, c0 + c1 + tl.zeros(m_c.shape, tl.int32)


@triton.jit
def _group_slots_ballot(m_c):
    """Ballot slots: each candidate's offset in its (group, row) region and the group's candidate count, both
    [KEY_GROUPS, NG, R] int32 (the count repeated along NG), from two warp ballots (vote.sync) instead of a mask
    sum over the warp's lanes (3 dependent shuffle levels). Needs NG = 16, R = 4 or 8 and the layout
    BALLOT_LAYOUTS[R] (op.py checks the compiled kernel). The lane constants come from the layout's index
    arithmetic, not from %laneid inside the asm: plain arithmetic on the thread index leaves the key loop."""
    if INTERPRETED:
        return _ballot_model(m_c)
    NG: tl.constexpr = m_c.shape[1]
    R: tl.constexpr = m_c.shape[2]
    o_j = tl.arange(0, NG)[None, :, None]  # [1, NG, 1]
    o_r = tl.arange(0, R)[None, None, :]  # [1, 1, R]
    rm = tl.zeros(m_c.shape, tl.int32) + (0x11111111 << (o_r % 4))  # [KG, NG, R] the lanes of the element's row
    lt = tl.zeros(m_c.shape, tl.int32) + ((1 << (4 * (o_j % 8) + o_r % 4)) - 1)  # its %lanemask_lt
    return tl.inline_asm_elementwise(_BALLOT_ASM, "=r,=r,=r,=r,r,r,r,r,r,r", [m_c.to(tl.int32), rm, lt],
                                     dtype=(tl.int32, tl.int32), is_pure=True, pack=2)


@triton.jit
def _append_tile(i_n, blk, rows, nxt, thr_f, D: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr,
                 BALLOT: tl.constexpr):
    """Key tile i_n: score it and append each row's candidates (score >= thr_f [R], the fp32 form of key > thr:
    strict, so a later key that ties the threshold loses) per key group. Returns the next free slots.

    The tile's keys form KEY_GROUPS groups of NG consecutive keys. Group g's candidates of a row go to the row's
    region g from its next free slot nxt [KEY_GROUPS, R], in ascending key order within the region: slot = nxt +
    popc(the group's int32 mask below the key); nothing crosses groups, so no cross-warp reduction or barrier per
    tile. BALLOT: nxt is [KEY_GROUPS, NG, R] (repeated along NG) and the slots come from _group_slots_ballot."""
    NG: tl.constexpr = BLOCK_N // KEY_GROUPS
    R: tl.constexpr = thr_f.shape[0]
    key_rows, idx_rows = rows
    o_s, sc, m_vis = _tile_scores(i_n, blk, D, BLOCK_N, RELU)
    m_c = tl.reshape(m_vis & (sc >= thr_f[None, :]), [KEY_GROUPS, NG, R])  # [KG, NG, R]
    key = tl.reshape(sc.to(tl.int32, bitcast=True), [KEY_GROUPS, NG, R])  # what the buffer holds
    o_g = tl.arange(0, KEY_GROUPS)
    o_j = tl.arange(0, NG)
    o_k = _tile_start(i_n, blk[1], blk[2], BLOCK_N) + o_g[:, None] * NG + o_j[None, :]  # [KG, NG] key indices
    if BALLOT:
        off, n = _group_slots_ballot(m_c)  # [KG, NG, R] each
        pos = nxt + off
        nxt_new = nxt + n
    else:
        b_bit = tl.full([KEY_GROUPS, NG, R], 1, tl.int32) << o_j[None, :, None]  # [KG, NG, R] each key's bit
        b_mask = tl.sum(tl.where(m_c, b_bit, 0), axis=1)  # [KG, R] the group's candidates (distinct bits)
        pos = nxt[:, None, :] + _popc32(b_mask[:, None, :] & (b_bit - 1))  # [KG, NG, R]
        nxt_new = nxt + _popc32(b_mask)
    _store2(key_rows[None, None, :] + pos, key, idx_rows[None, None, :] + pos, o_k[:, :, None] + tl.zeros_like(pos),
            m_c)
    return nxt_new


@triton.jit
def _fill_none(key_rows, n_keep, CAP: tl.constexpr, CHUNK: tl.constexpr):
    """Slots [n_keep[r], CAP) of each row's buffer become empty (RAW_NONE), so that the regions' unused slots read
    as no candidate. Plain stores; the caller puts a barrier before the next appends."""
    R: tl.constexpr = n_keep.shape[0]
    o_h = tl.arange(0, CHUNK)
    for i_c in range(0, CAP, CHUNK):
        o_cc = i_c + o_h  # [CHUNK]
        tl.store(key_rows[:, None] + o_cc[None, :], tl.full([R, CHUNK], RAW_NONE, tl.int32),
                 mask=o_cc[None, :] >= n_keep[:, None])


# ------------------------------------------------------------------------------------------------ k-th search


@triton.jit
def _radix_pass(b_keys, pre, c_lo, c_hi, kk, i_b):
    """One 2-bit pass at bits (i_b + 1, i_b): the largest of the 4 sub-buckets of prefix pre [R] (biased, unsigned
    order) with at least kk keys >= its lower bound. Returns the new (pre, c_lo, c_hi): the chosen bucket's prefix
    and the counts at its lower and upper bounds (3 counts over the row's keys b_keys [R, CAP])."""
    one = tl.full(pre.shape, 1, dtype=tl.int32)  # int32 shifts: bit 31 wraps to INT32_MIN, as meant
    a1 = pre | (one << i_b)
    a2 = pre | ((one << i_b) << 1)
    a3 = a2 | a1
    n1 = tl.sum((b_keys >= (a1 ^ INT32_MIN)[:, None]).to(tl.int32), axis=1)  # [R]
    n2 = tl.sum((b_keys >= (a2 ^ INT32_MIN)[:, None]).to(tl.int32), axis=1)
    n3 = tl.sum((b_keys >= (a3 ^ INT32_MIN)[:, None]).to(tl.int32), axis=1)
    m3 = n3 >= kk
    m2 = n2 >= kk
    m1 = n1 >= kk
    p_new = tl.where(m3, a3, tl.where(m2, a2, tl.where(m1, a1, pre)))
    lo_new = tl.where(m3, n3, tl.where(m2, n2, tl.where(m1, n1, c_lo)))
    hi_new = tl.where(m3, c_hi, tl.where(m2, n3, tl.where(m1, n2, n1)))
    return p_new, lo_new, hi_new


@triton.jit
def _kth_radix(key_rows, cnt, cnt_g, kk, CAP: tl.constexpr, SAMPLE: tl.constexpr):
    """Each row's kk-th largest buffered key by 2-bit radix passes from the top (16 at most).

    Keeps the largest prefix with at least kk keys >= it. Empty slots (INT32_MIN) never count: every bound is above
    them. A row stops early once the lower bound L of its prefix bucket has exactly kk keys at or above it: its top kk
    are then {keys >= L}, whatever the lower bits. A row that never stops decides all 32 bits.

    Returns (kth [R], n_gt [R], rank [R] bool): the row's top kk are its keys > kth plus its first kk - n_gt keys
    equal to kth; ``rank`` marks rows with more keys equal to kth than fit. Stopped rows: kth = L - 1, n_gt = kk.
    Rows with no more than kk keys are left unspecified (the caller keeps all their keys). n_gt comes from the
    passes' own counts. Buffers (not SAMPLE): cnt is the packed prefix, cnt_g the regions' counts and every slot is
    read; SAMPLE (the warm start's sample): the first cnt slots, no regions."""
    o_all = tl.arange(0, CAP)  # [CAP]
    if SAMPLE:
        m_all = o_all[None, :] < cnt[:, None]  # [R, CAP]
    else:
        m_all = (o_all[None, :] >= 0) & (cnt[:, None] >= 0)
        cnt = _n_buffered(cnt, cnt_g)
    pre = tl.zeros_like(cnt)  # [R] biased prefix
    c_lo = cnt  # [R] keys >= the bucket's lower bound (every buffered key for the empty prefix)
    c_hi = tl.zeros_like(cnt)  # [R] keys >= the bucket's upper bound (none above the full range)
    done = cnt <= kk
    n_open = tl.sum((~done).to(tl.int32), axis=0)
    # the buffer read once into registers (a while loop would otherwise reload it from L2 every pass)
    b_keys = _load_keys(key_rows[:, None] + o_all[None, :], m_all)  # [R, CAP]
    i_b = 30
    while (n_open > 0) & (i_b >= 0):  # bits (i_b + 1, i_b): (31, 30) ... (1, 0), all 32
        p_new, lo_new, hi_new = _radix_pass(b_keys, pre, c_lo, c_hi, kk, i_b)
        pre = tl.where(done, pre, p_new)
        c_lo = tl.where(done, c_lo, lo_new)
        c_hi = tl.where(done, c_hi, hi_new)
        done = done | ((c_lo == kk) & (pre != 0))  # pre != 0: a real bound (cnt > kk rows only get here)
        n_open = tl.sum((~done).to(tl.int32), axis=0)
        i_b -= 2
    stop = (c_lo == kk) & (pre != 0)  # [R] exactly kk keys >= L (also after all 32 bits)
    key = pre ^ INT32_MIN
    kth = tl.where(stop, key - 1, key)
    n_gt = tl.where(stop, kk, c_hi)
    return kth, n_gt, (~stop) & (c_lo > kk)


@triton.jit
def _interp_probe(lo, hm, g_lo, g_hi, w_prev, target, live):
    """The bracketed interpolation's next probe x [R] int32 in [lo + 1, hm] (hm = the upper end - 1): where the
    line through (lo, g_lo) and (hm + 1, g_hi) crosses target, or the bracket's middle when the last step cut less
    than 1/16 of it (so the number of passes stays bounded whatever the distribution). Returns (x, width): width =
    the bracket's width as fp32, the w_prev of the next pass. 32-bit throughout (the wrapping difference hm - lo is
    exact as uint32); fp32 rounding of the step only moves the probe, the clamp keeps it inside."""
    gap = hm.to(tl.uint32, bitcast=True) - lo.to(tl.uint32, bitcast=True)  # [R] >= 1 on live rows
    width = gap.to(tl.float32) + 1.0  # [R]
    t = tl.where(live, (g_lo - target) / tl.maximum(g_lo - g_hi, 1e-6), 0.5)  # (0, 1) on live rows
    t = tl.where(16.0 * width > 15.0 * w_prev, 0.5, t)
    step = tl.minimum(tl.maximum((width * t).to(tl.uint32), 1), gap)  # [R] uint32
    return (lo.to(tl.uint32, bitcast=True) + step).to(tl.int32, bitcast=True), width


@triton.jit
def _illinois_update(x, c, up, dn, bracket, target):
    """Move the bracket end that probe x (count c) replaces: lo = x where up, hm = x - 1 where dn. An end kept twice
    in a row has its count moved halfway to target (the Illinois rule: regula falsi does not stall on one side).
    bracket = (lo, hm, g_lo, g_hi, side), returned updated; side: the end the last pass moved (1 lo, -1 hi)."""
    lo, hm, g_lo, g_hi, side = bracket
    lo = tl.where(up, x, lo)
    hm = tl.where(dn, x - 1, hm)
    g_hi = tl.where(up, tl.where(side == 1, (g_hi + target) * 0.5, g_hi), tl.where(dn, c.to(tl.float32), g_hi))
    g_lo = tl.where(dn, tl.where(side == -1, (g_lo + target) * 0.5, g_lo), tl.where(up, c.to(tl.float32), g_lo))
    side = tl.where(up, 1, tl.where(dn, -1, side))
    return lo, hm, g_lo, g_hi, side


@triton.jit
def _sum_rows(b):
    """[R, C0, C1] -> [R]: a row's sum: over C0 first (within each thread: C1 independent chains), then over C1
    (one warp reduction)."""
    return tl.sum(tl.sum(b, axis=1), axis=1)


@triton.jit
def _count_ge(b_s, x):
    """Per row r: how many of the fp32 scores b_s[r] ([R, C0, C1], NaN: empty) have a key >= x[r] (int32), for
    probes above the row's smallest key (x - 1 is then a real score's key or above it).

    Compiled: t - s with t = _below_key(x) (IEEE fp32, no flush to zero) has its sign bit set exactly when s > t,
    i.e. key(s) >= x: a nonzero difference has the exact sign, s == t gives +0, a NaN gives the canonical NaN (sign
    clear), -0.0 scores count as +0.0 because t is never -0.0. The bit is shifted down and summed as an integer: 2
    independent instructions per element, no predicate. The interpreter compares with the score of key x."""
    if INTERPRETED:
        return _sum_rows((b_s >= _key_to_score(x)[:, None, None]).to(tl.int32))
    t = _below_key(x)  # [R]
    b = tl.inline_asm_elementwise(
        "{ .reg .f32 d; .reg .b32 b; sub.f32 d, $1, $2; mov.b32 b, d; shr.b32 $0, b, 31; }", "=r,f,f",
        [t[:, None, None] + tl.zeros_like(b_s), b_s], dtype=tl.int32, is_pure=True, pack=1)
    return _sum_rows(b)


@triton.jit
def _load_rows(key_rows, cnt, cnt_g, CAP: tl.constexpr, SAMPLE: tl.constexpr):
    """The rows' buffers as fp32 scores [R, CAP // LW, LW] (NaN: empty), with the buffered count n_buf and the real
    keys' count n_real [R] (as _kth_radix's SAMPLE). Slot i * LW + j: a row's LW consecutive slots span one warp's
    lanes and the layout gives the rows the warps, so a row's counts reduce inside its warp."""
    LW: tl.constexpr = 128 if CAP >= 128 else CAP
    o_all = tl.arange(0, CAP // LW)[None, :, None] * LW + tl.arange(0, LW)[None, None, :]  # [1, CAP // LW, LW]
    if SAMPLE:
        m_all = o_all < cnt[:, None, None]
    else:  # every slot (the regions' unused slots are empty)
        m_all = (o_all >= 0) & (cnt[:, None, None] >= 0)  # [R, CAP // LW, LW]
    p_all = key_rows[:, None, None] + o_all  # [R, CAP // LW, LW]
    if SAMPLE:
        n_buf = cnt
    else:
        n_buf = _n_buffered(cnt, cnt_g)  # [R]
    b_s = tl.load(p_all, mask=m_all, other=RAW_NONE).to(tl.float32, bitcast=True)
    if SAMPLE:  # slots of sample keys the row does not see are empty
        n_real = _sum_rows((b_s == b_s).to(tl.int32))  # [R]
    else:  # every buffered entry is a real score (the append's test rejects NaN)
        n_real = n_buf
    return b_s, n_buf, n_real


@triton.jit
def _kth_interp(key_rows, cnt, cnt_g, kk, CAP: tl.constexpr, SAMPLE: tl.constexpr):
    """_kth_radix's contract (kth, n_gt, rank) by a bracketed interpolation search, one count per pass.

    f(x) = #keys >= x falls as x grows. Each searching row keeps lo < hi with f(lo) > kk > f(hi) (to start: its
    smallest real key and its largest + 1) and counts f at one point between them per pass: where the line through
    (lo, f(lo)) and (hi, f(hi)) crosses kk (the int32 keys of fp32 scores are linear in the score within an
    exponent, and a row's candidates span few exponents), with the Illinois rule, or the midpoint when the last
    step cut less than 1/16 of the bracket (at most ~64 passes whatever the distribution). f(x) == kk ends the row:
    its top kk are its keys >= x (kth = x - 1, n_gt = kk); hi == lo + 1 ends it at the exact kk-th key lo (kth = lo,
    n_gt = f(hi), rank). The ends are kept as lo and hm = hi - 1 (hi = INT32_MAX + 1 would not fit). Rows with no
    more than kk real keys but more than kk slots (invisible samples) get kth INT32_MIN, n_gt = their real keys."""
    b_keys, n_buf, n_real = _load_rows(key_rows, cnt, cnt_g, CAP, SAMPLE)
    # the bracket's ends from the fp32 min / max (NaN drops out; -0.0 and +0.0 both give key 0), keyed per row
    lo = _score_to_key(tl.min(tl.min(b_keys, axis=1), axis=1))  # [R] f(lo) = n_real (rows without keys: unused)
    hm = _score_to_key(tl.max(tl.max(b_keys, axis=1), axis=1))  # [R] the upper end - 1: f(hm + 1) = 0
    f_hi = tl.zeros_like(n_real)
    g_lo = n_real.to(tl.float32)  # [R] the ends' counts as the interpolation uses them (Illinois)
    g_hi = f_hi.to(tl.float32)
    side = tl.zeros_like(n_real)  # [R] the end the last pass moved: 1 lo, -1 hi
    search = (n_buf > kk) & (n_real >= kk)
    found = search & (n_real == kk)  # every real key is in the top kk: x = the smallest
    x_hit = lo
    live = search & ~found & (hm > lo)  # [R] rows still searching
    w_prev = tl.full(lo.shape, float("inf"), tl.float32)  # the first step interpolates
    n_live = tl.sum(live.to(tl.int32), axis=0)
    while n_live > 0:
        x, width = _interp_probe(lo, hm, g_lo, g_hi, w_prev, kk, live)  # x in (lo, hm + 1)
        c = _count_ge(b_keys, x)  # [R] f(x)
        hit = live & (c == kk)
        up = live & (c > kk)
        dn = live & (c < kk)
        x_hit = tl.where(hit, x, x_hit)
        found = found | hit
        w_prev = tl.where(live, width, w_prev)
        f_hi = tl.where(dn, c, f_hi)
        lo, hm, g_lo, g_hi, side = _illinois_update(x, c, up, dn, (lo, hm, g_lo, g_hi, side), kk)
        live = live & ~hit & (hm > lo)
        n_live = tl.sum(live.to(tl.int32), axis=0)
    edge = search & ~found  # hm == lo: lo is the exact kk-th key, f(lo) > kk
    kth = tl.where(found, x_hit - 1, tl.where(edge, lo, INT32_MIN))
    n_gt = tl.where(found, kk, tl.where(edge, f_hi, n_real))
    return kth, n_gt, (n_buf > kk) & ~found


@triton.jit
def _kth_search(key_rows, cnt, cnt_g, kk, CAP: tl.constexpr, SAMPLE: tl.constexpr, KTH_INTERP: tl.constexpr):
    """Each row's kk-th largest buffered key: (kth, n_gt, rank) as _kth_radix returns them."""
    if KTH_INTERP:
        return _kth_interp(key_rows, cnt, cnt_g, kk, CAP, SAMPLE)
    return _kth_radix(key_rows, cnt, cnt_g, kk, CAP, SAMPLE)


# ------------------------------------------------------------------------------------------------ select


@triton.jit
def _tie_index_bound(rows, kth, n_eq, m_r, CAP: tl.constexpr, CHUNK: tl.constexpr):
    """Rows m_r keep n_eq of their buffered keys equal to kth, the lowest key indices (the tie rule) wherever they
    sit in the buffer. Returns the n_eq-th smallest such index [R] (INT32_MAX elsewhere): the largest x with fewer
    than n_eq tied indices < x, bit by bit from the top (indices are distinct within a row). Chunked counting passes;
    only rows with more ties at the k-th key than fit get here."""
    key_rows, idx_rows = rows
    R: tl.constexpr = kth.shape[0]
    o_h = tl.arange(0, CHUNK)
    pre = tl.zeros_like(kth)  # [R]
    one = tl.full([R], 1, dtype=tl.int32)
    for i_b in range(30, -1, -1):  # key indices are >= 0: bit 31 is never set
        cand = pre | (one << i_b)  # [R]
        c_acc = tl.zeros([R, CHUNK], dtype=tl.int32)  # [R, CHUNK] partial counts
        for i_c in range(0, CAP, CHUNK):
            o_cc = i_c + o_h  # [CHUNK]
            b_k = _load_keys(key_rows[:, None] + o_cc[None, :], o_cc[None, :] < CAP)  # [R, CHUNK] (empty: INT32_MIN)
            b_i = tl.load(idx_rows[:, None] + o_cc[None, :])  # [R, CHUNK]
            c_acc += ((b_k == kth[:, None]) & (b_i < cand[:, None])).to(tl.int32)
        pre = tl.where(tl.sum(c_acc, axis=1) < n_eq, cand, pre)
    return tl.where(m_r, pre, INT32_MAX)


@triton.jit
def _rewrite(rows, dst, m_rows, bounds, FINAL: tl.constexpr, WRITE_SCORES: tl.constexpr, CAP: tl.constexpr,
             CHUNK: tl.constexpr):
    """The select's stable rewrite: keep each row's scores >= t_gt [R] (key > kth) and, where n_eq [R] > 0, those
    >= t_ge (key == kth) whose key index is <= x_tie [R] (bounds = (t_gt, t_ge, n_eq, x_tie)); every slot is read
    (empty ones are NaN: no comparison holds). Writes them to dst = (key or score rows, index rows) [R] pointers:
    the buffer itself (compaction, in place) or FINAL the output rows. Returns the kept count [R].

    The masks are int32 0 / 1 tensors (as booleans, the compares stay live as predicates across the prefix sum and
    the barrier, and ptxas spills them). A chunk is held as [R, CHUNK // LW, LW] (slot i * LW + j), _load_rows'
    layout (a row per warp): the prefix sum of the kept entries is a scan over each run of LW slots (inside a warp)
    plus the runs' totals before it (inside each thread), with no cross-warp scan."""
    key_rows, idx_rows = rows
    dst_key, dst_idx = dst
    t_gt, t_ge, n_eq, x_tie = bounds
    LW: tl.constexpr = 128 if CHUNK >= 128 else CHUNK
    o_h = tl.arange(0, CHUNK // LW)[None, :, None] * LW + tl.arange(0, LW)[None, None, :]  # [1, CHUNK // LW, LW]
    base = tl.zeros_like(n_eq)  # [R] kept so far
    take = (n_eq > 0).to(tl.int32)[:, None, None]  # [R, 1, 1] rows that keep some keys equal to kth
    # chunk i_c + CHUNK is loaded while chunk i_c is ranked and stored: safe in place, as chunk i_c's kept entries
    # land at or below its own slots. Unmasked: the last one reads the CHUNK slots past the row (the next row's, or
    # the scratch's CHUNK spare slots), never used
    b_raw_n = tl.load(key_rows[:, None, None] + o_h)  # [R, CHUNK // LW, LW] fp32 bits
    b_i_n = tl.load(idx_rows[:, None, None] + o_h)
    for i_c in range(0, CAP, CHUNK):
        b_raw = b_raw_n
        b_i = b_i_n
        o_nx = i_c + CHUNK + o_h  # the next chunk's slots
        b_raw_n = tl.load(key_rows[:, None, None] + o_nx)
        b_i_n = tl.load(idx_rows[:, None, None] + o_nx)
        b_s = b_raw.to(tl.float32, bitcast=True)
        k_gt = (b_s >= t_gt[:, None, None]).to(tl.int32)  # [R, CHUNK // LW, LW] 1: key > kth
        k_eq = (b_s >= t_ge[:, None, None]).to(tl.int32) - k_gt  # 1: key == kth (NaN: 0 - 0)
        # key index <= x_tie <=> x_tie - b_i >= 0 (both >= 0: no overflow): the sign bit, no compare
        k_keep = k_gt | (k_eq & take & ~((x_tie[:, None, None] - b_i) >> 31))  # 0 / 1
        n_run = tl.sum(k_keep, axis=2)  # [R, CHUNK // LW] kept per run
        pos = (base[:, None] + tl.cumsum(n_run, axis=1) - n_run)[:, :, None] + tl.cumsum(k_keep, axis=2) - 1
        tl.debug_barrier()  # whole chunk read before any of it is overwritten (in place)
        m_st = k_keep & m_rows.to(tl.int32)[:, None, None]  # 0 / 1
        if FINAL:
            if WRITE_SCORES:
                p_s = (dst_key[:, None, None] + pos).to(tl.pointer_type(tl.int32))  # fp32 scores stored as bits
                b_sc = tl.where(b_s == 0.0, 0.0, b_s)  # the key's score: -0.0 folded onto +0.0
                _store2(dst_idx[:, None, None] + pos, b_i, p_s, b_sc.to(tl.int32, bitcast=True), m_st)
            else:
                _store1(dst_idx[:, None, None] + pos, b_i, m_st)
        else:
            _store2(dst_key[:, None, None] + pos, b_raw, dst_idx[:, None, None] + pos, b_i, m_st)
        base += tl.sum(n_run, axis=1)
    return base


@triton.jit
def _select(rows, cnt, cnt_g, kk, dst, m_rows, FINAL: tl.constexpr, WRITE_SCORES: tl.constexpr,
            CAP: tl.constexpr, CHUNK: tl.constexpr, KTH_INTERP: tl.constexpr):
    """Keep each row's exact top kk of its buffer (all of it where it holds no more), stably: its keys > the kk-th
    and, of those equal to it, the lowest key indices. rows = (key rows, index rows) [R] pointers; the buffer is the
    packed prefix [0, cnt) plus the key groups' regions (cnt_g [KEY_GROUPS, R]), every other slot empty. dst as
    _rewrite's. Compacting (not FINAL), every row is packed and its slots past the kept ones emptied. Returns
    (kth, kept) [R]: the kk-th key (INT32_MIN where nothing was dropped) and the entries kept."""
    R: tl.constexpr = cnt.shape[0]
    n_tot = _n_buffered(cnt, cnt_g)  # [R]
    need = n_tot > kk  # [R]
    kth = tl.full([R], INT32_MIN, dtype=tl.int32)
    n_eq = tl.full([R], CAP, dtype=tl.int32)  # keys equal to kth still to keep
    x_tie = tl.full([R], INT32_MAX, dtype=tl.int32)  # keys equal to kth are kept up to this key index
    if tl.max(n_tot, axis=0) > kk:
        kth_s, n_gt, rank = _kth_search(rows[0], cnt, cnt_g, kk, CAP, False, KTH_INTERP)
        kth = tl.where(need, kth_s, INT32_MIN)
        n_rank = tl.sum((need & rank).to(tl.int32), axis=0)  # rows whose keys equal to kth must be ranked
        n_eq = tl.where(need, kk - n_gt, CAP)
        if n_rank > 0:
            x_tie = _tie_index_bound(rows, kth, n_eq, need & rank, CAP, CHUNK)
    # key > kth <=> score >= _thr_score(kth); key == kth <=> key > kth - 1 and not key > kth (kth INT32_MIN: a NaN
    # bound, nothing equal)
    bounds = (_thr_score(kth), _thr_score(kth - 1), n_eq, x_tie)
    base = _rewrite(rows, dst, m_rows, bounds, FINAL, WRITE_SCORES, CAP, CHUNK)
    if not FINAL:  # the slots after the kept ones become empty for the next regions
        tl.debug_barrier()
        _fill_none(rows[0], base, CAP, CHUNK)
    tl.debug_barrier()  # the rewritten buffer visible to every thread before the next appends
    return kth, base


@triton.jit
def _halves(x):
    """[R] -> ([R // 2] even rows, [R // 2] odd rows)."""
    return tl.split(tl.reshape(x, [x.shape[0] // 2, 2]))


@triton.jit
def _halves2(x):
    """[KG, R] -> ([KG, R // 2] even rows, [KG, R // 2] odd rows)."""
    return tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))


@triton.jit
def _select_rows(scr, cnt, cnt_g, kk, dst, m_rows, FINAL: tl.constexpr, WRITE_SCORES: tl.constexpr,
                 CAP: tl.constexpr, CHUNK: tl.constexpr, KTH_INTERP: tl.constexpr, SPLIT: tl.constexpr):
    """_select on the row block's rows, or (SPLIT 2) on its even rows, then its odd rows: each select then holds
    [R / 2, CAP] keys in registers instead of [R, CAP] (8-row tiles at CAP 4096 spill otherwise). Same results, in
    row order. The halves' row pointers come from the block's first scratch row (scalars), so the compiler keeps
    their alignment (split pointer vectors lose it, and the buffer loads come out unvectorized)."""
    key_rows, idx_rows, key_base, idx_base = scr
    if SPLIT == 1:
        return _select((key_rows, idx_rows), cnt, cnt_g, kk, dst, m_rows, FINAL, WRITE_SCORES, CAP, CHUNK,
                       KTH_INTERP)
    R: tl.constexpr = cnt.shape[0]
    o_e = (2 * tl.arange(0, R // 2)).to(tl.int64) * CAP  # [R // 2] the even rows' offsets
    kr0 = key_base + o_e
    kr1 = key_base + o_e + CAP
    ir0 = idx_base + o_e
    ir1 = idx_base + o_e + CAP
    c0, c1 = _halves(cnt)
    dk0, dk1 = _halves(dst[0])
    di0, di1 = _halves(dst[1])
    m0, m1 = _halves(m_rows.to(tl.int32))
    g0, g1 = _halves2(cnt_g)
    kth0, base0 = _select((kr0, ir0), c0, g0, kk, (dk0, di0), m0 != 0, FINAL, WRITE_SCORES, CAP, CHUNK, KTH_INTERP)
    kth1, base1 = _select((kr1, ir1), c1, g1, kk, (dk1, di1), m1 != 0, FINAL, WRITE_SCORES, CAP, CHUNK, KTH_INTERP)
    return tl.reshape(tl.join(kth0, kth1), [R]), tl.reshape(tl.join(base0, base1), [R])


# ------------------------------------------------------------------------------------------------ warm start


@triton.jit
def _sample_tile(i_t, span, blk, key_rows, D: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr,
                 WARM: tl.constexpr):
    """Warm-start sample slots [i_t, i_t + BLOCK_N) of WARM: key index lo + slot * (span // WARM), scored with the
    key loop's code and written to slot ``slot`` of each row's buffer (empty where the row does not see the key).
    Returns the visibility [BLOCK_N, R] as int32 (1: a sample); the caller sums it after the sample loop."""
    k_ptr, lo, hi, b_start, b_end, b_qT, b_w, o_n, o_d = blk
    o_i = i_t + o_n  # [BLOCK_N] sample slots
    m_i = o_i < WARM
    o_s = lo + o_i * (span // WARM)  # [BLOCK_N] distinct key indices (span > CAP >= WARM)
    b_k = tl.load(k_ptr + o_s.to(tl.int64)[:, None] * D + o_d[None, :],
                  mask=m_i[:, None] & (o_d < D)[None, :], other=0.0)  # [BLOCK_N, D_P2]
    sc = _scores(b_k, b_qT, b_w, b_start.shape[0], RELU)  # [BLOCK_N, R]
    m_vis = m_i[:, None] & (o_s[:, None] >= b_start[None, :]) & (o_s[:, None] < b_end[None, :])
    key = tl.where(m_vis, sc.to(tl.int32, bitcast=True), RAW_NONE)  # [BLOCK_N, R] the buffer's format
    _store1(key_rows[None, :] + o_i[:, None], key, tl.broadcast_to(m_i[:, None], key.shape))
    return m_vis.to(tl.int32)


@triton.jit
def _warm_rank(n_vis, m_smp, kk, CAP: tl.constexpr):
    """The sample rank j [R] whose key bounds the row's threshold, and the rows that use it [R] (see
    _warm_threshold): n_vis visible keys, m_smp of them sampled."""
    p0 = kk / tl.maximum(n_vis, 1).to(tl.float32)  # [R] fraction of the row's keys that is kept
    mu = m_smp.to(tl.float32) * p0
    j = (mu + WARM_Z * tl.sqrt(tl.maximum(mu * (1.0 - p0), 0.0))).to(tl.int32) + 1  # [R]
    return j, (n_vis > CAP) & (m_smp >= WARM_MIN) & (2 * j <= m_smp)


@triton.jit
def _warm_threshold(blk, kk, key_rows, D: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr,
                    CAP: tl.constexpr, WARM: tl.constexpr, KTH_INTERP: tl.constexpr):
    """Each row's starting threshold key tau [R] (INT32_MIN: no warm start for that row) from WARM keys spread evenly
    over the block's key range [lo, hi). Only run when some row sees more than CAP keys, so hi - lo > CAP >= WARM.

    Row r with n visible keys and m visible samples: the fraction p of its keys above the j-th largest sample is
    Beta(j, m + 1 - j), and P(fewer than kk keys above) = P(Binomial(m, kk / n) >= j). j = floor(mu + WARM_Z sd) + 1
    with mu = m kk / n, sd = sqrt(mu (1 - kk / n)) puts j WARM_Z standard deviations above the boundary. Used where
    n > CAP, m >= WARM_MIN and 2 j <= m. tau = (j-th largest sample key) - 1, so the key loop's strict ``key > tau``
    takes the keys tied with that sample key too (a repeated value, e.g. ReLU zeros, would otherwise send the row to
    the re-run); a search that stops early at a bucket bound L gives tau = L - 2, a few more candidates."""
    k_ptr, lo, hi, b_start, b_end, b_qT, b_w, o_n, o_d = blk
    R: tl.constexpr = b_start.shape[0]
    n_vis = tl.where(b_end > b_start, b_end - b_start, 0)  # [R]
    span = hi - lo
    m_smp = tl.zeros([BLOCK_N, R], dtype=tl.int32)  # visible samples per row and tile position
    for i_t in range(0, WARM, BLOCK_N):
        m_smp += _sample_tile(i_t, span, blk, key_rows, D, BLOCK_N, RELU, WARM)
    m_smp = tl.sum(m_smp, axis=0)  # [R]
    tl.debug_barrier()  # sample keys visible to every thread
    j, on = _warm_rank(n_vis, m_smp, kk, CAP)
    j = tl.where(on, j, 1)
    n_smp = tl.full([R], WARM, dtype=tl.int32)  # the sample's slots
    tau, _, _ = _kth_search(key_rows, n_smp, None, j, WARM, True, KTH_INTERP)
    thr = tl.where(on, tau - 1, INT32_MIN)
    tl.debug_barrier()  # the search done reading before the key loop overwrites the slots
    return thr


# ------------------------------------------------------------------------------------------------ key loop


@triton.jit
def _segment(i_n, n_seg, blk, rows, nxt, thr_f, D: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr,
             BALLOT: tl.constexpr):
    """Tiles [i_n, i_n + n_seg) appended with a fixed threshold: a loop free of branches and barriers, so that it
    software-pipelines. Returns (the next tile, the next free slots)."""
    if INTERPRETED:  # the interpreter cannot `range` over runtime bounds
        i_e = i_n + n_seg
        while i_n < i_e:
            nxt = _append_tile(i_n, blk, rows, nxt, thr_f, D, BLOCK_N, RELU, BALLOT)
            i_n += 1
    else:
        for i_j in range(i_n, i_n + n_seg):
            nxt = _append_tile(i_j, blk, rows, nxt, thr_f, D, BLOCK_N, RELU, BALLOT)
        i_n += n_seg
    return i_n, nxt


@triton.jit
def _compact(scr, buf, kk, m_t, CAP: tl.constexpr, CHUNK: tl.constexpr, KTH_INTERP: tl.constexpr,
             SPLIT: tl.constexpr):
    """Every row keeps its top kk candidates, packed at the front of its buffer, and its threshold rises to its
    kk-th key; the free slots after them are split anew into the key groups' regions. Returns the new buf."""
    cnt, cnt_g, reg0, F, thr = buf
    tl.debug_barrier()  # appends of earlier tiles visible to all threads
    kth, _ = _select_rows(scr, cnt, cnt_g, kk, (scr[0], scr[1]), m_t, False, False, CAP, CHUNK, KTH_INTERP, SPLIT)
    thr = tl.maximum(thr, kth)
    cnt = tl.minimum(_n_buffered(cnt, cnt_g), kk)
    cnt_g = cnt_g * 0
    reg0 = tl.max(cnt, axis=0)
    F = (CAP - reg0) // KEY_GROUPS  # >= MIN_FREE // KEY_GROUPS + NG (CAP >= kk + 2 MIN_FREE)
    return cnt, cnt_g, reg0, F, thr


@triton.jit
def _key_loop(n_tiles, kk, blk, scr, buf, m_t, D: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr,
              CAP: tl.constexpr, CHUNK: tl.constexpr, MIN_FREE: tl.constexpr, KTH_INTERP: tl.constexpr,
              BALLOT: tl.constexpr, SPLIT: tl.constexpr):
    """The row block's key tiles in ascending order, in segments that cannot overflow any region: a compaction
    first where the fullest region has fewer than MIN_FREE // KEY_GROUPS free slots. Each key group g appends to
    its region [reg0 + g F, reg0 + (g + 1) F). Returns the final buf."""
    NG: tl.constexpr = BLOCK_N // KEY_GROUPS
    R: tl.constexpr = m_t.shape[0]
    cnt, cnt_g, reg0, F, thr = buf
    i_n = 0
    while i_n < n_tiles:
        n_seg = n_tiles - i_n
        free = F - tl.max(tl.max(cnt_g, axis=1), axis=0)  # the fullest region's; a tile adds <= NG keys to each
        if free < MIN_FREE // KEY_GROUPS:
            cnt, cnt_g, reg0, F, thr = _compact(scr, (cnt, cnt_g, reg0, F, thr), kk, m_t, CAP, CHUNK, KTH_INTERP,
                                                SPLIT)
            free = F
        n_seg = tl.minimum(n_seg, free // NG)
        thr_f = _thr_score(thr)  # [R] the segment's fp32 bound
        cnt_g += reg0 + (tl.arange(0, KEY_GROUPS) * F)[:, None]  # counts -> next free slots
        if BALLOT:
            nxt = cnt_g[:, None, :] + tl.zeros([KEY_GROUPS, NG, R], dtype=tl.int32)  # [KG, NG, R]
        else:
            nxt = cnt_g
        i_n, nxt = _segment(i_n, n_seg, blk, (scr[0], scr[1]), nxt, thr_f, D, BLOCK_N, RELU, BALLOT)
        if BALLOT:
            cnt_g = tl.max(nxt, axis=1)  # [KG, R] (repeated along NG)
        else:
            cnt_g = nxt
        cnt_g -= reg0 + (tl.arange(0, KEY_GROUPS) * F)[:, None]
    return cnt, cnt_g, reg0, F, thr


@triton.jit
def _block_topk(n_tiles, kk, blk, scr, m_t, stats_ptr, D: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr,
                CAP: tl.constexpr, CHUNK: tl.constexpr, MIN_FREE: tl.constexpr, WARM: tl.constexpr,
                KTH_INTERP: tl.constexpr, BALLOT: tl.constexpr, SPLIT: tl.constexpr):
    """The row block's candidate buffers after its key loop: (cnt, cnt_g), each row holding its top kk or all its
    keys. Rows warm-started (WARM > 0) that end with fewer than kk candidates are re-run from -inf in a second pass;
    the other rows append nothing more (no key is > INT32_MAX). stats_ptr [3] += rows warm-started, rows re-run,
    row blocks re-run."""
    b_start, b_end = blk[3], blk[4]
    R: tl.constexpr = m_t.shape[0]
    cnt = tl.zeros([R], dtype=tl.int32)  # [R] candidates in the packed prefix
    cnt_g = tl.zeros([KEY_GROUPS, R], dtype=tl.int32)  # [KG, R] candidates in each key group's region
    reg0 = tl.max(cnt, axis=0)  # the regions' first slot and width
    F = (CAP - reg0) // KEY_GROUPS
    thr = tl.full([R], INT32_MIN, dtype=tl.int32)  # [R] running threshold key
    if WARM > 0:
        if tl.max(tl.where(b_end > b_start, b_end - b_start, 0), axis=0) > CAP:  # some row can compact
            thr = _warm_threshold(blk, kk, scr[0], D, BLOCK_N, RELU, CAP, WARM, KTH_INTERP)
    _fill_none(scr[0], cnt, CAP, CHUNK)  # every slot empty before the regions fill
    tl.debug_barrier()
    on = thr > INT32_MIN  # [R] rows started from a sampled threshold
    n_on = tl.sum(on.to(tl.int32), axis=0)
    n_fail = n_on * 0
    n_pass = n_on * 0 + 1
    i_pass = n_on * 0
    while i_pass < n_pass:
        cnt, cnt_g, reg0, F, thr = _key_loop(n_tiles, kk, blk, scr, (cnt, cnt_g, reg0, F, thr), m_t, D, BLOCK_N,
                                             RELU, CAP, CHUNK, MIN_FREE, KTH_INTERP, BALLOT, SPLIT)
        fail = on & (_n_buffered(cnt, cnt_g) < kk)  # [R]; all False after the first pass
        n_f = tl.sum(fail.to(tl.int32), axis=0)
        n_fail += n_f
        n_pass += (n_f > 0).to(tl.int32)
        cnt = tl.where(fail, 0, cnt)
        cnt_g = tl.where(fail[None, :], 0, cnt_g)
        if n_f > 0:  # the failed rows' buffers back to empty
            _fill_none(scr[0], tl.where(fail, 0, CAP), CAP, CHUNK)
            tl.debug_barrier()
        thr = tl.where(fail, INT32_MIN, tl.where(n_f > 0, INT32_MAX, thr))
        on = fail & (cnt < 0)
        i_pass += 1
    tl.atomic_add(stats_ptr, n_on)
    tl.atomic_add(stats_ptr + 1, n_fail)
    tl.atomic_add(stats_ptr + 2, (n_fail > 0).to(tl.int32))
    return cnt, cnt_g


# ------------------------------------------------------------------------------------------------ kernel


@triton.jit
def _write_rows(scr, cnt, cnt_g, kk, o_t, m_t, out_idx_ptr, out_val_ptr, CAP: tl.constexpr, CHUNK: tl.constexpr,
                KTH_INTERP: tl.constexpr, SPLIT: tl.constexpr, WRITE_SCORES: tl.constexpr):
    """The final select: each row's top kk indices (and scores) to its output row, then -1 (-inf) padding."""
    R: tl.constexpr = m_t.shape[0]
    tl.debug_barrier()
    o_out = o_t.to(tl.int64) * kk  # [R] output row offsets
    _select_rows(scr, cnt, cnt_g, kk, (out_val_ptr + o_out, out_idx_ptr + o_out), m_t, True, WRITE_SCORES, CAP,
                 CHUNK, KTH_INTERP, SPLIT)
    n_keep = tl.minimum(_n_buffered(cnt, cnt_g), kk)  # [R]
    o_h = tl.arange(0, CHUNK)
    if tl.min(tl.where(m_t, n_keep, kk), axis=0) < kk:  # some row has fewer than kk keys
        for i_c in range(0, CAP, CHUNK):
            o_cc = i_c + o_h  # [CHUNK]
            m_pad = (o_cc[None, :] >= n_keep[:, None]) & (o_cc[None, :] < kk) & m_t[:, None]
            tl.store(out_idx_ptr + o_out[:, None] + o_cc[None, :], tl.full([R, CHUNK], -1, tl.int32), mask=m_pad)
            if WRITE_SCORES:
                tl.store(out_val_ptr + o_out[:, None] + o_cc[None, :], tl.full([R, CHUNK], float("-inf"), tl.float32),
                         mask=m_pad)
    tl.debug_barrier()  # the next row block reuses the scratch


@triton.jit
def hytopk_kernel(
    q_ptr, w_ptr, k_ptr, starts_ptr, ends_ptr,  # q [T, H, D], w [T, H], k [S, D] (>= BLOCK_N rows), int32 [T] bounds
    out_idx_ptr, out_val_ptr,  # int32 [T, kk]; fp32 [T, kk] (WRITE_SCORES)
    buf_key_ptr, buf_idx_ptr,  # int32 scratch [programs, R, CAP] each (+ CHUNK spare slots after the index half)
    stats_ptr,  # int32 [3] += rows warm-started, rows re-run from -inf, row blocks re-run
    T, S, kk, n_blocks, n_p,  # kk: topk; n_blocks = cdiv(T, R); n_p: programs in the (persistent) grid
    H: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, R: tl.constexpr,  # heads, head dim (and its pow2), rows
    BLOCK_N: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,  # keys per tile, slots per row, select chunk
    MIN_FREE: tl.constexpr, WARM: tl.constexpr,  # compaction margin (slots), warm-start sample keys (0: off)
    RELU: tl.constexpr, WRITE_SCORES: tl.constexpr, KTH_INTERP: tl.constexpr,  # activation, outputs, k-th search
    BALLOT: tl.constexpr, SPLIT: tl.constexpr,  # ballot append slots; selects on halves of the rows (1 or 2)
):
    """Exact top-kk of each query row's indexer scores (op.hytopk documents the contract)."""
    i_p = tl.program_id(0)
    o_r = tl.arange(0, R)  # [R]
    # this program's scratch rows, reused for every row block it owns
    key_rows = buf_key_ptr + (i_p * R + o_r).to(tl.int64) * CAP  # [R] row pointers
    idx_rows = buf_idx_ptr + (i_p * R + o_r).to(tl.int64) * CAP  # [R]
    key_base = buf_key_ptr + (i_p * R).to(tl.int64) * CAP  # the block's first row (split selects' halves)
    idx_base = buf_idx_ptr + (i_p * R).to(tl.int64) * CAP
    scr = (key_rows, idx_rows, key_base, idx_base)
    i_w = i_p
    while i_w < n_blocks:  # row blocks in descending order: with causal bounds the costliest first, for balance
        i_blk = n_blocks - 1 - i_w
        o_t, m_t, n_tiles, blk = _row_block(i_blk, q_ptr, w_ptr, k_ptr, starts_ptr, ends_ptr, T, S, H, D, D_P2, R,
                                            BLOCK_N)
        cnt, cnt_g = _block_topk(n_tiles, kk, blk, scr, m_t, stats_ptr, D, BLOCK_N, RELU, CAP, CHUNK, MIN_FREE, WARM,
                                 KTH_INTERP, BALLOT, SPLIT)
        _write_rows(scr, cnt, cnt_g, kk, o_t, m_t, out_idx_ptr, out_val_ptr, CAP, CHUNK, KTH_INTERP, SPLIT,
                    WRITE_SCORES)
        i_w += n_p
