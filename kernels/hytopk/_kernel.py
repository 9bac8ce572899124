"""Triton kernel: indexer scores tile by tile with each query row's exact top-k kept on the fly.

One persistent program owns ``R`` query rows at a time (a "row block") for the whole key loop:

* scoring: per key tile, ``acc[BLOCK_N, R*H] = K_tile @ Q_block^T`` on the tensor cores (keys
  are the MMA's M side, so the head sum is a reduction along the accumulator's columns, which
  stays inside a thread and its quad), then ``relu``, the head weight and the head sum give
  ``sc[BLOCK_N, R]``;
* selection: scores become order-preserving int32 keys; a key enters its row's candidate buffer
  (global scratch, ``CAP`` >= topk + BLOCK_N slots per row, reused by the next row block) only
  if it beats the row's running threshold. Keys are visited in ascending index order, so a
  later key that *ties* the threshold loses to the ``topk`` earlier ones: the test is strict.
  Positions come from a prefix sum, so the buffer stays in ascending key-index order;
* compaction: when a tile could overflow a row's buffer, an exact radix select (two bits per
  counting pass over the buffer held in registers, rows stopping as soon as their top ``topk``
  are known; Config.search_bits=1: 32 one-bit passes) finds each full row's k-th key; the row
  keeps exactly ``topk`` entries (ties to the lowest index) and the threshold rises to it;
* output: the same select writes the final ``topk``, -1 padded: ascending key index with the "mask" / "tile"
  appends; with "warps" (Config.append, the default since session 15: each key group of a tile appends to its own
  region of the buffer) the buffer's order, deterministic, ties at the k-th key ranked by key index.
  Config.kth_search picks how a select finds the k-th key: the 2-bit radix passes or an interpolation search.

Optional warm start (``WARM`` > 0, Config.warm_start): before the key loop, ``WARM`` keys spread
evenly over the row block's key range are scored with the same code and each row's threshold
starts at the j-th largest of its visible sample keys (j from a binomial quantile margin, so that
fewer than ``topk`` keys above it is improbable). A row that still ends with fewer than ``topk``
candidates is re-run from -inf (a second pass over that row block; the other rows append
nothing). Exact and deterministic either way; see ``_warm_threshold`` for the tie argument.

Nothing of size [rows, S] is ever stored: scratch is O(programs * R * CAP).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

INT32_MIN = tl.constexpr(-2147483648)
INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _score_to_key(sc):
    """fp32 -> int32 key with the same order (-0.0 folded onto +0.0 so the two tie)."""
    sc = tl.where(sc == 0.0, 0.0, sc)
    bits = sc.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _key_to_score(key):
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _clock(PROFILE: tl.constexpr, INTERP: tl.constexpr):
    """PROFILE (op.hytopk_profile, bench/topk.py --parts profile): the SM's cycle counter (clock64); 0 under the
    interpreter. Read right after a barrier, it brackets a phase of the program (async copies / MMAs in flight
    are charged to the phase that waits for them)."""
    if PROFILE and not INTERP:
        return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.full([], 0, tl.int64)


# PROFILE: the int64 counters of prof_ptr (summed over programs; op.PROFILE_PHASES names them)
P_TOTAL = tl.constexpr(0)  # cycles: each program, start to end
P_SETUP = tl.constexpr(1)  # cycles: row block set-up (bounds, Q / weight loads, buffer holes)
P_SAMPLE = tl.constexpr(2)  # cycles: warm-start sample scoring
P_WSEL = tl.constexpr(3)  # cycles: warm-start threshold select
P_LOOP = tl.constexpr(4)  # cycles: the key loop's first pass (compactions included)
P_CMP = tl.constexpr(5)  # cycles: compactions (part of P_LOOP / P_RERUN)
P_RERUN = tl.constexpr(6)  # cycles: key-loop passes re-run from -inf (warm-start fallback)
P_FINAL = tl.constexpr(7)  # cycles: final select, output writes, padding
P_BLOCKS = tl.constexpr(8)  # count: row blocks
P_NCMP = tl.constexpr(9)  # count: compactions
P_NSEG = tl.constexpr(10)  # count: key-loop segments (each restarts the tile loop's software pipeline)
P_FSEARCH = tl.constexpr(11)  # cycles: the final select's k-th search with its buffer load (part of P_FINAL)
P_N = tl.constexpr(12)


RAW_NONE = tl.constexpr(-1)  # RAW buffers: the fp32 bits (a NaN) whose key is INT32_MIN (never counted)
# Config.append="warps": key groups per tile, each appending to its own region of a row's buffer. 4 = the warps
# of one warpgroup along the MMA's M side (a wgmma warp holds 16 consecutive keys of a 64-key tile), so a
# group's mask, counts and slots stay inside one warp: no cross-warp exchange in the key loop.
KEY_GROUPS = tl.constexpr(4)


@triton.jit
def _load_keys(ptrs, mask, RAW: tl.constexpr):
    """Buffered candidates as int32 keys (INT32_MIN where masked). RAW (Config.raw_keys): the buffer holds the
    scores' raw fp32 bits, converted here (the key loop then skips the conversion for every score)."""
    if RAW:
        return _score_to_key(tl.load(ptrs, mask=mask, other=RAW_NONE).to(tl.float32, bitcast=True))
    else:
        return tl.load(ptrs, mask=mask, other=INT32_MIN)


@triton.jit
def _slot_valid(o_c, cnt, WARPS: tl.constexpr):
    """[R, C] which slots o_c [C] to read: a row's packed prefix [0, cnt) or, WARPS (append="warps"), every slot:
    the key groups' regions leave holes, which hold RAW_NONE (key INT32_MIN: never counted, never kept)."""
    if WARPS:
        return (o_c[None, :] >= 0) & (cnt[:, None] >= 0)
    return o_c[None, :] < cnt[:, None]


@triton.jit
def _fill_none(key_rows, n_keep, R: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr):
    """append="warps": slots [n_keep[r], CAP) of each row's buffer get RAW_NONE, so that the regions' unused
    slots (holes) read as no candidate. Plain stores; the caller puts a barrier before the next appends."""
    o_h = tl.arange(0, CHUNK)
    for i_c in range(0, CAP, CHUNK):
        o_cc = i_c + o_h  # [CHUNK]
        tl.store(key_rows[:, None] + o_cc[None, :], tl.full([R, CHUNK], RAW_NONE, tl.int32),
                 mask=o_cc[None, :] >= n_keep[:, None])


@triton.jit
def _n_buffered(cnt, cnt_g, WARPS: tl.constexpr):
    """Candidates held per row [R]: the packed prefix plus (WARPS) every key group's region."""
    if WARPS:
        return cnt + tl.sum(cnt_g, axis=0)
    return cnt


@triton.jit
def _thr_score(thr):
    """RAW: the fp32 bound equivalent to ``key > thr``, i.e. score >= the score of key thr + 1 (-inf for
    INT32_MIN: every score; key INT32_MAX + 1 wraps to a NaN bound: none). -0.0 and +0.0 compare equal,
    as their keys do (both fold onto key 0; no score has key -1)."""
    return tl.where(thr == INT32_MIN, float("-inf"), _key_to_score(thr + 1))


@triton.jit
def _count_ge(key_rows, cnt, bound, o_h, R: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
              RAW: tl.constexpr = False):
    """Per row: how many of its cnt buffered keys are >= bound[r]. [R] int32."""
    c_acc = tl.zeros([R, CHUNK], dtype=tl.int32)  # [R, CHUNK] partial counts
    for i_c in range(0, CAP, CHUNK):
        o_cc = i_c + o_h  # [CHUNK]
        m_v = o_cc[None, :] < cnt[:, None]  # [R, CHUNK]
        b_k = _load_keys(key_rows[:, None] + o_cc[None, :], m_v, RAW)  # [R, CHUNK]
        c_acc += (b_k >= bound[:, None]).to(tl.int32)
    return tl.sum(c_acc, axis=1)


@triton.jit
def _kth_key(key_rows, cnt, kk, o_h, R: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
             RAW: tl.constexpr = False):
    """Exact kk-th largest buffered key of each row [R] (INT32_MIN where a row has < kk keys).

    Radix select one bit at a time from the top, in the biased (unsigned-order) domain: keep the
    largest prefix with at least kk keys >= it. Padding (INT32_MIN) never counts: every
    candidate bound is above it.
    """
    c = _count_ge(key_rows, cnt, tl.zeros_like(cnt), o_h, R, CAP, CHUNK, RAW)  # bit 31: keys >= 0
    pre = tl.where(c >= kk, INT32_MIN, 0)  # [R] biased prefix
    for i_b in range(30, -1, -1):
        cand = pre | (1 << i_b)  # [R]
        c = _count_ge(key_rows, cnt, cand ^ INT32_MIN, o_h, R, CAP, CHUNK, RAW)
        pre = tl.where(c >= kk, cand, pre)
    return pre ^ INT32_MIN


@triton.jit
def _clz32(x):
    """Leading zero bits of each int32 [any shape] (32 for 0): smear the top set bit down, count the set bits
    (_popc32's SWAR count: the same code on the GPU and under the interpreter; only run on [R] vectors)."""
    v = x.to(tl.uint32, bitcast=True)
    v = v | (v >> 1)
    v = v | (v >> 2)
    v = v | (v >> 4)
    v = v | (v >> 8)
    v = v | (v >> 16)
    return 32 - _popc32(v.to(tl.int32, bitcast=True), False)


@triton.jit
def _kth_key2(key_rows, cnt, kk, R: tl.constexpr, CAP: tl.constexpr, RAW: tl.constexpr = False, cnt_g=None,
              WARPS: tl.constexpr = False, KTH: tl.constexpr = 0, HW: tl.constexpr = False):
    """Radix select of each row's top kk buffered keys, two bits per pass (16 passes at most).
    KTH (Config.kth_search / select_prefix): 0 the passes from the top, 1 from the shared prefix (below), 2 the
    interpolation search (_kth_interp: the same contract, one count per pass).

    Two bits per pass from the top, in the biased (unsigned-order) domain: keep the largest prefix
    with at least kk keys >= it. Padding (INT32_MIN) never counts: every candidate bound is above
    it. A row stops early once the lower bound L of its prefix bucket has exactly kk keys at or
    above it: its top kk are then {keys >= L}, whatever the lower bits. A row that never stops
    decides all 32 bits (until session 5 the passes ended at bits (3, 2) plus a pass for bit 0
    only: bit 1 was never set, the cause of an H200 mismatch; tests/test_hytopk_search2.py).

    Returns (kth [R], n_gt [R], rank [R] bool): the row's top kk are its keys > kth plus its first
    kk - n_gt keys equal to kth (buffer order); ``rank`` marks rows where more keys equal kth than
    fit (only those need the tie ranking). Stopped rows: kth = L - 1, n_gt = kk. Rows with
    cnt <= kk are left unspecified (the caller keeps all their keys). n_gt comes from the passes'
    own counts: no extra counting pass. WARPS: cnt is the packed prefix, cnt_g the regions' counts; every slot
    is read (_slot_valid).

    KTH 1 (Config.select_prefix): the passes start below the leading bits that every searching row's smallest
    and largest key share (one min / max reduction; the fewest such bits over the rows, rounded down to a pass
    boundary). Every pass over such a shared bit pair would pick that pair's bucket with c_lo = all keys and
    c_hi = 0 and never stop there, so the state after the skipped passes is known: same result, fewer passes
    (a row's candidates all lie above its threshold, so their keys share the top 8-12 bits).
    """
    if KTH == 2:
        return _kth_interp(key_rows, cnt, kk, R, CAP, RAW, cnt_g, WARPS, HW)
    o_all = tl.arange(0, CAP)  # [CAP]
    m_all = _slot_valid(o_all, cnt, WARPS)  # [R, CAP]
    cnt = _n_buffered(cnt, cnt_g, WARPS)
    pre = tl.zeros_like(cnt)  # [R] biased prefix
    c_lo = cnt  # [R] keys >= the bucket's lower bound (every buffered key for the empty prefix)
    c_hi = tl.zeros_like(cnt)  # [R] keys >= the bucket's upper bound (none above the full range)
    one = tl.full([R], 1, dtype=tl.int32)  # int32 shifts: bit 31 wraps to INT32_MIN, as meant
    done = cnt <= kk
    n_open = tl.sum((~done).to(tl.int32), axis=0)
    # the buffer read once into registers (a while loop would otherwise reload it from L2 every pass)
    b_keys = _load_keys(key_rows[:, None] + o_all[None, :], m_all, RAW)  # [R, CAP]
    i_b = 30
    if KTH == 1:
        m_key = b_keys != INT32_MIN  # [R, CAP] real keys (not padding, holes or invisible samples)
        n_real = tl.sum(m_key.to(tl.int32), axis=1)  # [R]
        k_hi = tl.max(tl.where(m_key, b_keys, INT32_MIN), axis=1)  # [R]
        k_lo = tl.min(tl.where(m_key, b_keys, INT32_MAX), axis=1)  # [R]
        # shared leading bits (the bias flips bit 31 of both: the xor is the same); rows with <= kk real keys
        # (a warm sample) take the passes from the top
        n_same = tl.where(done, 32, tl.where(n_real > kk, _clz32(k_lo ^ k_hi), 0))  # [R]
        n_fix = tl.min(n_same, axis=0)
        n_fix = n_fix - n_fix % 2  # whole passes: bits (31, 30) ... (1, 0)
        top = tl.where(n_fix > 0, (one << 31) >> tl.maximum(n_fix - 1, 0), 0)  # [R] top n_fix bits (arith. shift)
        pre = tl.where(done, pre, (k_hi ^ INT32_MIN) & top)
        c_lo = tl.where(done | (n_fix == 0), c_lo, n_real)  # every real key is >= the bucket's lower bound
        i_b = 30 - n_fix
    while (n_open > 0) & (i_b >= 0):  # bits (i_b + 1, i_b): (31, 30) ... (1, 0), all 32
        a1 = pre | (one << i_b)
        a2 = pre | ((one << i_b) << 1)
        a3 = a2 | a1
        n1 = tl.sum((b_keys >= (a1 ^ INT32_MIN)[:, None]).to(tl.int32), axis=1)  # [R]
        n2 = tl.sum((b_keys >= (a2 ^ INT32_MIN)[:, None]).to(tl.int32), axis=1)
        n3 = tl.sum((b_keys >= (a3 ^ INT32_MIN)[:, None]).to(tl.int32), axis=1)
        m3 = n3 >= kk
        m2 = n2 >= kk
        m1 = n1 >= kk
        # the chosen bucket [lower, upper): its lower bound's count and its upper bound's count
        p_new = tl.where(m3, a3, tl.where(m2, a2, tl.where(m1, a1, pre)))
        lo_new = tl.where(m3, n3, tl.where(m2, n2, tl.where(m1, n1, c_lo)))
        hi_new = tl.where(m3, c_hi, tl.where(m2, n3, tl.where(m1, n2, n1)))
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
def _bracket_gap(lo, hm):
    """Probe points strictly inside a bracket of int32 keys: hm - lo [R] as uint32 (hm = the upper end - 1, so that
    the ends need no int64; the wrapping difference is exact: hm >= lo)."""
    return hm.to(tl.uint32, bitcast=True) - lo.to(tl.uint32, bitcast=True)


@triton.jit
def _interp_probe(lo, gap, g_lo, g_hi, w_prev, target, live):
    """The bracketed interpolation's next probe x [R] int32 in [lo + 1, lo + gap] (gap = _bracket_gap >= 1 on live
    rows): where the line through (lo, g_lo) and (lo + gap + 1, g_hi) crosses target, or the bracket's middle when
    the last step cut less than 1/16 of it (so the number of passes stays bounded whatever the distribution).
    Returns (x, width): width = gap + 1 as fp32, the w_prev of the next pass. 32-bit throughout (until session 18
    the ends were int64: half of a pass's instructions went to 64-bit converts, compares and selects); fp32
    rounding of the step only moves the probe, the clamp keeps it inside."""
    width = gap.to(tl.float32) + 1.0  # [R]
    t = tl.where(live, (g_lo - target) / tl.maximum(g_lo - g_hi, 1e-6), 0.5)  # (0, 1) on live rows
    t = tl.where(16.0 * width > 15.0 * w_prev, 0.5, t)
    step = tl.minimum(tl.maximum((width * t).to(tl.uint32), 1), gap)  # [R] uint32
    return (lo.to(tl.uint32, bitcast=True) + step).to(tl.int32, bitcast=True), width


@triton.jit
def _illinois_update(x, c, up, dn, lo, hm, g_lo, g_hi, side, target):
    """Move the bracket end that probe x (count c) replaces: lo = x where up, hm = x - 1 where dn. An end kept twice
    in a row has its count moved halfway to target (the Illinois rule: regula falsi does not stall on one side).
    Returns (lo, hm, g_lo, g_hi, side); side: the end the last pass moved (1 lo, -1 hi)."""
    lo = tl.where(up, x, lo)
    hm = tl.where(dn, x - 1, hm)
    g_hi = tl.where(up, tl.where(side == 1, (g_hi + target) * 0.5, g_hi), tl.where(dn, c.to(tl.float32), g_hi))
    g_lo = tl.where(dn, tl.where(side == -1, (g_lo + target) * 0.5, g_lo), tl.where(up, c.to(tl.float32), g_lo))
    side = tl.where(up, 1, tl.where(dn, -1, side))
    return lo, hm, g_lo, g_hi, side


@triton.jit
def _below_key(x):
    """The largest score whose key is below key x [R] (x > INT32_MIN): the score of key x - 1, except at x = 0,
    where key -1 is the score -0.0 (which ties +0.0, key 0): key -2 (the negative denormal next to 0) instead."""
    return _key_to_score(tl.where(x == 0, -2, x - 1))


@triton.jit
def _sum_rows(b):
    """[R, C0, C1] -> [R]: a row's sum: over C0 first (within each thread: C1 independent chains), then over C1
    (one warp reduction; summed over C1 first, each of the C0 columns took a warp reduction of its own)."""
    return tl.sum(tl.sum(b, axis=1), axis=1)


@triton.jit
def _count_ge_f32_rows(b_s, x, HW: tl.constexpr):
    """Per row r: how many of the fp32 scores b_s[r] ([R, C0, C1], the row layout of _kth_interp) have a key >= x[r]
    (int32; NaN holes: never), for probes above the row's smallest key (the searches probe inside (lo, hm]: key
    x - 1 is then a real score's or above it).

    HW: no predicate per element. t - s with t = _below_key(x) (IEEE fp32 subtraction, no flush to zero) has its
    sign bit set exactly when s > t, i.e. key(s) >= x: a nonzero difference has the exact sign; s == t gives +0;
    a NaN hole gives the canonical NaN (sign clear); -0.0 scores count as +0.0 because t is never -0.0; infinities
    follow. The bit is shifted down and summed as an integer: 2 instructions per element (FADD, then a
    shift-and-add), independent across elements. Until session 19: PTX set.ge.u32.f32, which ptxas compiled to
    FSETP + SEL on one predicate register, each SEL waiting on its FSETP (~2.5 instructions per element, serial).
    The interpreter compares the scores with the score of key x."""
    if HW:
        t = _below_key(x)  # [R]
        b = tl.inline_asm_elementwise(
            "{ .reg .f32 d; .reg .b32 b; sub.f32 d, $1, $2; mov.b32 b, d; shr.b32 $0, b, 31; }", "=r,f,f",
            [t[:, None, None] + tl.zeros_like(b_s), b_s], dtype=tl.int32, is_pure=True, pack=1)
        return _sum_rows(b)
    return _sum_rows((b_s >= _key_to_score(x)[:, None, None]).to(tl.int32))


@triton.jit
def _kth_interp(key_rows, cnt, kk, R: tl.constexpr, CAP: tl.constexpr, RAW: tl.constexpr = False, cnt_g=None,
                WARPS: tl.constexpr = False, HW: tl.constexpr = False):
    """Config.kth_search="interp": _kth_key2's contract (kth, n_gt, rank) by a bracketed interpolation search.

    f(x) = #keys >= x falls as x grows. Each searching row keeps lo < hi with f(lo) > kk > f(hi) (to start: its
    smallest real key and its largest + 1) and counts f at one point between them per pass: where the line
    through (lo, f(lo)) and (hi, f(hi)) crosses kk (the int32 keys of fp32 scores are linear in the score within
    an exponent, and a row's candidates, all above its threshold, span few exponents), with the Illinois rule (an
    end kept twice in a row has its count moved halfway to kk, so regula falsi does not stall on one side), or
    the midpoint when the last step cut less than 1/16 of the bracket (so at most ~64 passes whatever the
    distribution; ~8 on simulated 64K candidate sets vs ~11 radix passes of 3 counts each). f(x) == kk
    ends the row: its top kk are its keys >= x (kth = x - 1, n_gt = kk, as the radix's early stop); hi == lo + 1
    ends it at the exact kk-th key lo (kth = lo, n_gt = f(hi), more keys equal to lo than fit: rank). The ends are
    int32 keys lo and hm = hi - 1 (hi = INT32_MAX + 1 would not fit), the probe arithmetic 32-bit. One count
    per pass instead of the radix's three for two bits. Rows with no more than kk real keys but more than kk
    buffered slots (invisible warm samples) get kth INT32_MIN, n_gt = their real keys, rank, as from the radix."""
    # the buffer as [R, CAP // LW, LW] (slot = i * LW + j): a row's LW consecutive slots span one warp's lanes (4
    # each), and the load's layout orders the dims by contiguity, ties by index (2, 0, 1), so the rows get the warps
    # (R = num_warps): a row's counts reduce inside its warp (no shared memory or barrier per pass) and each thread
    # works out its own row's probe only. As [R, CAP] every warp held a quarter of every row
    LW: tl.constexpr = 128 if CAP >= 128 else CAP
    o_all = tl.arange(0, CAP // LW)[None, :, None] * LW + tl.arange(0, LW)[None, None, :]  # [1, CAP // LW, LW]
    if WARPS:  # every slot (holes hold RAW_NONE)
        m_all = (o_all >= 0) & (cnt[:, None, None] >= 0)  # [R, CAP // LW, LW]
    else:
        m_all = o_all < cnt[:, None, None]
    p_all = key_rows[:, None, None] + o_all  # [R, CAP // LW, LW]
    n_buf = _n_buffered(cnt, cnt_g, WARPS)  # [R]
    if RAW:  # the raw fp32 scores (holes: NaN), compared as floats: the key order without converting
        b_keys = tl.load(p_all, mask=m_all, other=RAW_NONE).to(tl.float32, bitcast=True)
        if WARPS:  # every buffered entry is a real score (the key loop's test rejects NaN), every other slot a hole
            n_real = n_buf
        else:  # the warm sample: slots of keys the row does not see hold holes
            n_real = _sum_rows((b_keys == b_keys).to(tl.int32))  # [R]
        # the bracket's ends from the fp32 min / max (minnum / maxnum: the NaN holes drop out; -0.0 and +0.0 both give
        # key 0), keyed per row: an int key per element first cost ~1000 sm_90a instructions and spills per select
        lo = _score_to_key(tl.min(tl.min(b_keys, axis=1), axis=1))  # [R] f(lo) = n_real (rows without keys: unused)
        hm = _score_to_key(tl.max(tl.max(b_keys, axis=1), axis=1))  # [R] the upper end - 1: f(hm + 1) = 0
    else:
        b_keys = _load_keys(p_all, m_all, RAW)  # [R, CAP // LW, LW] (INT32_MIN: no key)
        m_key = b_keys != INT32_MIN
        n_real = _sum_rows(m_key.to(tl.int32))  # [R]
        lo = tl.min(tl.min(tl.where(m_key, b_keys, INT32_MAX), axis=1), axis=1)  # [R] f(lo) = n_real
        hm = tl.max(tl.max(tl.where(m_key, b_keys, INT32_MIN), axis=1), axis=1)  # [R] the upper end - 1: f(hm + 1) = 0
    f_hi = tl.zeros_like(n_real)
    g_lo = n_real.to(tl.float32)  # [R] the ends' counts as the interpolation uses them (Illinois)
    g_hi = f_hi.to(tl.float32)
    side = tl.zeros_like(n_real)  # [R] the end the last pass moved: 1 lo, -1 hi
    search = (n_buf > kk) & (n_real >= kk)
    found = search & (n_real == kk)  # every real key is in the top kk: x = the smallest
    x_hit = lo
    live = search & ~found & (hm > lo)  # [R] rows still searching
    w_prev = tl.full([R], float("inf"), tl.float32)  # the first step interpolates
    n_live = tl.sum(live.to(tl.int32), axis=0)
    while n_live > 0:
        x, width = _interp_probe(lo, _bracket_gap(lo, hm), g_lo, g_hi, w_prev, kk, live)  # x in (lo, hm + 1)
        if RAW:
            c = _count_ge_f32_rows(b_keys, x, HW)  # [R] f(x)
        else:
            c = _sum_rows((b_keys >= x[:, None, None]).to(tl.int32))  # [R] f(x)
        hit = live & (c == kk)
        up = live & (c > kk)
        dn = live & (c < kk)
        x_hit = tl.where(hit, x, x_hit)
        found = found | hit
        w_prev = tl.where(live, width, w_prev)
        f_hi = tl.where(dn, c, f_hi)
        lo, hm, g_lo, g_hi, side = _illinois_update(x, c, up, dn, lo, hm, g_lo, g_hi, side, kk)
        live = live & ~hit & (hm > lo)
        n_live = tl.sum(live.to(tl.int32), axis=0)
    edge = search & ~found  # hm == lo: lo is the exact kk-th key, f(lo) > kk
    kth = tl.where(found, x_hit - 1, tl.where(edge, lo, INT32_MIN))
    n_gt = tl.where(found, kk, tl.where(edge, f_hi, n_real))
    return kth, n_gt, (n_buf > kk) & ~found


@triton.jit
def _tie_index_bound(key_rows, idx_rows, kth, n_eq, m_r, R: tl.constexpr, CAP: tl.constexpr,
                     CHUNK: tl.constexpr, RAW: tl.constexpr):
    """append="warps": rows m_r keep n_eq of their buffered keys equal to kth, the lowest key indices (the tie
    rule) wherever they sit in the buffer. Returns the n_eq-th smallest such index [R] (INT32_MAX elsewhere): the
    largest x with fewer than n_eq tied indices < x, bit by bit from the top (indices are distinct within a row).
    Chunked counting passes (no [R, CAP] tile held): only rows with more ties at the k-th key than fit get here."""
    o_h = tl.arange(0, CHUNK)
    pre = tl.zeros_like(kth)  # [R]
    one = tl.full([R], 1, dtype=tl.int32)
    for i_b in range(30, -1, -1):  # key indices are >= 0: bit 31 is never set
        cand = pre | (one << i_b)  # [R]
        c_acc = tl.zeros([R, CHUNK], dtype=tl.int32)  # [R, CHUNK] partial counts
        for i_c in range(0, CAP, CHUNK):
            o_cc = i_c + o_h  # [CHUNK]
            b_k = _load_keys(key_rows[:, None] + o_cc[None, :], o_cc[None, :] < CAP, RAW)  # [R, CHUNK] (holes:
            b_i = tl.load(idx_rows[:, None] + o_cc[None, :])  # [R, CHUNK]                  INT32_MIN != kth)
            c_acc += ((b_k == kth[:, None]) & (b_i < cand[:, None])).to(tl.int32)
        pre = tl.where(tl.sum(c_acc, axis=1) < n_eq, cand, pre)
    return tl.where(m_r, pre, INT32_MAX)


@triton.jit
def _rewrite_warps_raw(key_rows, idx_rows, dst_key, dst_idx, m_rows, t_gt, t_ge, n_eq, x_tie,
                       FINAL: tl.constexpr, WRITE_SCORES: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
                       HW: tl.constexpr):
    """_select_store's stable rewrite for append="warps" raw-score buffers (every slot read; holes are NaN, so no
    comparison holds for them): keep each row's scores >= t_gt [R] (key > kth) and, where n_eq [R] > 0, those >= t_ge
    (key == kth) whose key index is <= x_tie [R]. Returns the kept count [R].

    The masks are int32 0 / 1 tensors from the start: as booleans, the [R, CHUNK] compares stayed live as predicates
    across the prefix sum and the barrier, and ptxas spilled them to registers and back (P2R / SEL / ISETP: ~190 of
    the final rewrite's 548 sm_90a instructions per 512-slot chunk were that one compare's line).
    A chunk is held as [R, CHUNK // LW, LW] (slot i * LW + j), the row layout of _kth_interp (a row per warp): the
    prefix sum of the kept entries is a scan over each run of LW slots (inside a warp) plus the runs' totals before
    it (inside each thread), with no cross-warp scan (shared memory and barriers) as [R, CHUNK] needed."""
    LW: tl.constexpr = 128 if CHUNK >= 128 else CHUNK
    o_h = tl.arange(0, CHUNK // LW)[None, :, None] * LW + tl.arange(0, LW)[None, None, :]  # [1, CHUNK // LW, LW]
    base = tl.zeros_like(n_eq)  # [R] kept so far
    take = (n_eq > 0).to(tl.int32)[:, None, None]  # [R, 1, 1] rows that keep some keys equal to kth
    # chunk i_c + CHUNK is loaded while chunk i_c is ranked and stored (its L2 latency hidden): safe in place too,
    # as chunk i_c's kept entries land at or below its own slots. Unmasked: the last one reads the CHUNK slots past
    # the row (the next row's, or the scratch's padding: op._launch allocates CHUNK spare slots), never used
    b_raw_n = tl.load(key_rows[:, None, None] + o_h)  # [R, CHUNK // LW, LW] fp32 bits (all scratch memory)
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
        m_st = k_keep & m_rows.to(tl.int32)[:, None, None]  # 0 / 1 (the stores test it != 0)
        if FINAL:
            if WRITE_SCORES:
                p_s = (dst_key[:, None, None] + pos).to(tl.pointer_type(tl.int32))  # fp32 scores stored as their bits
                b_sc = tl.where(b_s == 0.0, 0.0, b_s)  # the key's score: -0.0 folded onto +0.0
                _store2(dst_idx[:, None, None] + pos, b_i, p_s, b_sc.to(tl.int32, bitcast=True), m_st, HW)
            else:
                _store1(dst_idx[:, None, None] + pos, b_i, m_st, HW)
        else:
            _store2(dst_key[:, None, None] + pos, b_raw, dst_idx[:, None, None] + pos, b_i, m_st, HW)
        base += tl.sum(n_run, axis=1)
    return base


@triton.jit
def _select_store(key_rows, idx_rows, cnt, kk, dst_key, dst_idx, m_rows,
                  FINAL: tl.constexpr, WRITE_SCORES: tl.constexpr, R: tl.constexpr, CAP: tl.constexpr,
                  CHUNK: tl.constexpr, SEARCH2: tl.constexpr, RAW: tl.constexpr = False, cnt_g=None,
                  WARPS: tl.constexpr = False, KTH: tl.constexpr = 0, FILTER: tl.constexpr = False, thr_keep=None,
                  HW: tl.constexpr = False, PROFILE: tl.constexpr = False, prof_ptr=None):
    """Keep each row's exact top-kk of its buffer (all of it where cnt <= kk), stably. Returns (kth, kept [R]).

    key_rows/idx_rows: [R] pointers to the rows' buffers. dst_*: [R] row pointers of the
    destination: the buffer itself when compacting in place, the output rows when FINAL (keys
    become fp32 scores there). kth: the kk-th key [R] (INT32_MIN where nothing was dropped); kept: entries kept.
    FILTER (Config.warm_sample="head"; not FINAL): no search: keep the keys > thr_keep [R] (every key where
    thr_keep is INT32_MIN), ties included, and return thr_keep as kth.
    WARPS (append="warps", SEARCH2, RAW only): the buffer is the packed prefix [0, cnt) plus the key groups'
    regions (cnt_g [KEY_GROUPS, R] keys in each), every other slot RAW_NONE; buffer order is then not key-index
    order, so the keys equal to the kk-th that fit are the ones with the lowest key indices (_tie_index_bound).
    Compacting, every row is packed (the holes removed) and its slots past the kept ones reset to RAW_NONE.
    HW (compiled, not the interpreter): the rewrite's scattered stores are inline PTX in the chunk's own layout
    (_store1 / _store2); a tl.store first converted the pointers, values and mask to another layout through shared
    memory (sm_90a final rewrite 742 -> 577 instrs per chunk, bench/NOTES_hytopk.md session 18).
    PROFILE (op.hytopk_profile): the cycles up to the end of the search are added to prof_ptr[P_FSEARCH].
    """
    t_enter = _clock(PROFILE, not HW)
    o_h = tl.arange(0, CHUNK)
    n_tot = _n_buffered(cnt, cnt_g, WARPS)  # [R]
    need = n_tot > kk  # [R]
    kth = tl.full([R], INT32_MIN, dtype=tl.int32)
    n_eq = tl.full([R], CAP, dtype=tl.int32)  # keys equal to kth still to keep
    n_rank = 0  # SEARCH2: rows whose keys equal to kth must be ranked (more of them than fit)
    x_tie = tl.full([R], INT32_MAX, dtype=tl.int32)  # WARPS: keys equal to kth are kept up to this key index
    if FILTER:
        kth = thr_keep
        need = thr_keep > INT32_MIN
        n_eq = tl.where(need, 0, CAP)  # no key equal to thr_keep is kept (keys > thr_keep only)
    elif tl.max(n_tot, axis=0) > kk:
        if SEARCH2:
            kth_2, n_gt, rank = _kth_key2(key_rows, cnt, kk, R, CAP, RAW, cnt_g, WARPS, KTH, HW)
            kth = tl.where(need, kth_2, INT32_MIN)
            n_rank = tl.sum((need & rank).to(tl.int32), axis=0)
        else:
            kth = tl.where(need, _kth_key(key_rows, cnt, kk, o_h, R, CAP, CHUNK, RAW), INT32_MIN)
            n_gt = _count_ge(key_rows, cnt, kth + 1, o_h, R, CAP, CHUNK, RAW)  # kth < INT32_MAX always
        n_eq = tl.where(need, kk - n_gt, CAP)
        if WARPS:
            if n_rank > 0:
                x_tie = _tie_index_bound(key_rows, idx_rows, kth, n_eq, need & rank, R, CAP, CHUNK, RAW)
    if PROFILE:
        tl.debug_barrier()
        tl.atomic_add(prof_ptr + P_FSEARCH, _clock(PROFILE, not HW) - t_enter)
    # stable rewrite, chunk by chunk: an entry only moves down, past chunks already read
    base = tl.zeros_like(cnt)  # [R] kept so far
    eq_seen = tl.zeros_like(cnt)  # [R] entries equal to kth seen so far
    # RAW: the rewrite compares the raw fp32 scores (key > kth <=> score >= _thr_score(kth); key == kth <=> key > kth - 1
    # and not key > kth; holes are NaN: no comparison holds), no int key per entry (sm_90a final rewrite chunk
    # 597 -> 550 instrs)
    t_gt = _thr_score(kth)  # [R] fp32
    t_ge = _thr_score(kth - 1)  # [R] (kth INT32_MIN: a NaN bound, nothing equal, as no real key is INT32_MIN)
    tl.static_assert(RAW or not WARPS, "append='warps' buffers hold raw scores (op.check_config)")
    if WARPS:  # the default buffers (raw scores): int32 0 / 1 masks (see _rewrite_warps_raw)
        base = _rewrite_warps_raw(key_rows, idx_rows, dst_key, dst_idx, m_rows, t_gt, t_ge, n_eq, x_tie,
                                  FINAL, WRITE_SCORES, CAP, CHUNK, HW)
        if not FINAL:  # the slots after the kept ones become holes for the next regions
            tl.debug_barrier()
            _fill_none(key_rows, base, R, CAP, CHUNK)
        tl.debug_barrier()  # compacted buffer visible to every thread before the next appends
        return kth, base
    for i_c in range(0, CAP, CHUNK):
        o_cc = i_c + o_h  # [CHUNK]
        m_v = _slot_valid(o_cc, cnt, WARPS)  # [R, CHUNK]
        if RAW:
            b_raw = tl.load(key_rows[:, None] + o_cc[None, :], mask=m_v, other=RAW_NONE)  # [R, CHUNK] fp32 bits
            b_s = b_raw.to(tl.float32, bitcast=True)  # [R, CHUNK] scores
            m_gt = b_s >= t_gt[:, None]  # [R, CHUNK] key > kth
            m_eq = (b_s >= t_ge[:, None]) & ~m_gt & m_v  # key == kth
        else:
            b_raw = tl.load(key_rows[:, None] + o_cc[None, :], mask=m_v, other=INT32_MIN)  # [R, CHUNK]
            b_k = b_raw
            m_gt = b_k > kth[:, None]
            m_eq = (b_k == kth[:, None]) & m_v
        # unmasked (every slot is scratch memory; entries outside m_v are never used): vector loads
        b_i = tl.load(idx_rows[:, None] + o_cc[None, :])  # [R, CHUNK]
        if SEARCH2:
            if n_rank > 0:
                r_eq = eq_seen[:, None] + tl.cumsum(m_eq.to(tl.int32), axis=1)  # [R, CHUNK] 1-based rank
                m_take = m_eq & (r_eq <= n_eq[:, None])
            else:  # every row keeps all or none of its keys equal to kth: no ranking scan
                m_take = m_eq & (n_eq[:, None] > 0)
        else:
            r_eq = eq_seen[:, None] + tl.cumsum(m_eq.to(tl.int32), axis=1)  # [R, CHUNK] 1-based rank
            m_take = m_eq & (r_eq <= n_eq[:, None])
        m_keep = m_v & (m_gt | m_take)
        pos = base[:, None] + tl.cumsum(m_keep.to(tl.int32), axis=1) - 1  # [R, CHUNK]
        tl.debug_barrier()  # whole chunk read before any of it is overwritten (in place)
        m_st = m_keep & m_rows[:, None]
        if FINAL:
            if WRITE_SCORES:
                p_s = (dst_key[:, None] + pos).to(tl.pointer_type(tl.int32))  # fp32 scores stored as their bits
                if RAW:
                    b_sc = tl.where(b_s == 0.0, 0.0, b_s)  # the key's score: -0.0 folded onto +0.0
                else:
                    b_sc = _key_to_score(b_k)
                _store2(dst_idx[:, None] + pos, b_i, p_s, b_sc.to(tl.int32, bitcast=True), m_st, HW)
            else:
                _store1(dst_idx[:, None] + pos, b_i, m_st, HW)
        else:
            m_st = m_st & need[:, None]  # rows that keep everything stay where they are
            # the buffer's own format (keys or RAW bits)
            _store2(dst_key[:, None] + pos, b_raw, dst_idx[:, None] + pos, b_i, m_st, HW)
        base += tl.sum(m_keep.to(tl.int32), axis=1)
        eq_seen += tl.sum(m_eq.to(tl.int32), axis=1)
    tl.debug_barrier()  # compacted buffer visible to every thread before the next appends
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
def _select_store_rows(key_rows, idx_rows, cnt, kk, dst_key, dst_idx, m_rows,
                       FINAL: tl.constexpr, WRITE_SCORES: tl.constexpr, R: tl.constexpr, CAP: tl.constexpr,
                       CHUNK: tl.constexpr, SEARCH2: tl.constexpr, RAW: tl.constexpr = False, cnt_g=None,
                       WARPS: tl.constexpr = False, KTH: tl.constexpr = 0, FILTER: tl.constexpr = False,
                       thr_keep=None, HW: tl.constexpr = False, PROFILE: tl.constexpr = False, prof_ptr=None,
                       SPLIT: tl.constexpr = 1, key_base=None, idx_base=None):
    """_select_store on the row block's rows, or (SPLIT 2, Config.select_split) on its even rows, then its odd rows:
    each select then holds [R / 2, CAP] keys in registers instead of [R, CAP] (8-row tiles at CAP 4096 spill
    otherwise). Same results, in row order. key_base / idx_base (scalars: the block's first scratch row; needed
    with SPLIT 2): the halves' row pointers are computed from them, so the compiler keeps their alignment (split
    pointer vectors lose it, and the buffer loads then come out unvectorized with the rows spread over all warps:
    sm_90a select pass 572 instructions instead of 335)."""
    if SPLIT == 1:
        return _select_store(key_rows, idx_rows, cnt, kk, dst_key, dst_idx, m_rows, FINAL, WRITE_SCORES, R, CAP,
                             CHUNK, SEARCH2, RAW, cnt_g, WARPS, KTH, FILTER=FILTER, thr_keep=thr_keep, HW=HW,
                             PROFILE=PROFILE, prof_ptr=prof_ptr)
    o_e = (2 * tl.arange(0, R // 2)).to(tl.int64) * CAP  # [R // 2] the even rows' offsets
    kr0 = key_base + o_e
    kr1 = key_base + o_e + CAP
    ir0 = idx_base + o_e
    ir1 = idx_base + o_e + CAP
    c0, c1 = _halves(cnt)
    dk0, dk1 = _halves(dst_key)
    di0, di1 = _halves(dst_idx)
    m0, m1 = _halves(m_rows.to(tl.int32))
    g0 = cnt_g
    g1 = cnt_g
    if WARPS:
        g0, g1 = _halves2(cnt_g)
    t0 = thr_keep
    t1 = thr_keep
    if FILTER:
        t0, t1 = _halves(thr_keep)
    kth0, base0 = _select_store(kr0, ir0, c0, kk, dk0, di0, m0 != 0, FINAL, WRITE_SCORES, R // 2, CAP, CHUNK,
                                SEARCH2, RAW, g0, WARPS, KTH, FILTER=FILTER, thr_keep=t0, HW=HW, PROFILE=PROFILE,
                                prof_ptr=prof_ptr)
    kth1, base1 = _select_store(kr1, ir1, c1, kk, dk1, di1, m1 != 0, FINAL, WRITE_SCORES, R // 2, CAP, CHUNK,
                                SEARCH2, RAW, g1, WARPS, KTH, FILTER=FILTER, thr_keep=t1, HW=HW, PROFILE=PROFILE,
                                prof_ptr=prof_ptr)
    return tl.reshape(tl.join(kth0, kth1), [R]), tl.reshape(tl.join(base0, base1), [R])


@triton.jit
def _block_columns(R: tl.constexpr, H: tl.constexpr, LANE_ROWS: tl.constexpr):
    """Flattened (row * H + head) of each column of the score tile's MMA, [R*H] int32.

    LANE_ROWS (1 or 2: Config.head_sum's order; R % 4 == 0, H even): column c = ((head // 2) * (R // 4) + row // 4)
    * 8 + (row % 4) * 2 + head % 2. An MMA accumulator gives lane l of a quad the column pairs {8j + 2l, 8j + 2l + 1}: with this
    order lane l holds every head of rows l, l + 4, ... and no other row, so the head sum stays inside the
    thread and each (key, row) score lives in one thread only. In (row, head) order the four lanes share
    every row: the sum needs shuffles and leaves each score in four threads, which then all ran the
    selection and the stores (4x the per-key work in the sm_90a key loop)."""
    o_c = tl.arange(0, R * H)  # [R*H]
    if LANE_ROWS:
        g: tl.constexpr = R // 4
        row = ((o_c // 8) % g) * 4 + (o_c % 8) // 2
        head = (o_c // (8 * g)) * 2 + o_c % 2
        return row * H + head
    return o_c


@triton.jit
def _row_block_scores(b_k, b_qT, b_w, H: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr,
                      RELU: tl.constexpr, IEEE: tl.constexpr, LANE_ROWS: tl.constexpr):
    """Scores of one key tile for the block's rows: sc[BLOCK_N, R] fp32 (columns as _block_columns)."""
    if IEEE:
        acc = tl.dot(b_k, b_qT, input_precision="ieee")  # [BLOCK_N, R*H]
    else:
        acc = tl.dot(b_k, b_qT)  # [BLOCK_N, R*H]
    if RELU:
        acc = tl.maximum(acc, 0.0)
    acc = acc * b_w[None, :]
    if LANE_ROWS:  # [BLOCK_N, head pair, row group, row in group, head parity]: sum the heads, keep the rows
        acc = tl.reshape(acc, [BLOCK_N, H // 2, R // 4, 4, 2])
        if LANE_ROWS == 2:  # Config.head_sum "chains": even and odd heads as two in-thread FFMA chains, then add
            sc = tl.sum(tl.sum(acc, axis=1), axis=3)  # [BLOCK_N, R//4, 4]
        else:  # "pairs": FMUL + FFMA per head pair, then a FADD chain over the pairs
            sc = tl.sum(tl.sum(acc, axis=4), axis=1)  # [BLOCK_N, R//4, 4]
        return tl.reshape(sc, [BLOCK_N, R])
    return tl.sum(tl.reshape(acc, [BLOCK_N, R, H]), axis=2)  # [BLOCK_N, R]


@triton.jit
def _tile_start(i_n, lo, hi, BLOCK_N: tl.constexpr):
    """The first key of key tile i_n as loaded (_tile_scores): its nominal start lo + i_n BLOCK_N, or for the last
    tile, hi - BLOCK_N (at least 0), so that the tile ends at the block's range."""
    return tl.maximum(tl.minimum(lo + i_n * BLOCK_N, hi - BLOCK_N), 0)


@triton.jit
def _tile_scores(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, o_n, o_d, m_d, H: tl.constexpr, D: tl.constexpr,
                 R: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr, IEEE: tl.constexpr,
                 LANE_ROWS: tl.constexpr, K_TMA: tl.constexpr = False):
    """Key tile i_n: its key indices [BLOCK_N], scores [BLOCK_N, R] and visibility [BLOCK_N, R].

    The tile nominally covers keys [lo + i_n BLOCK_N, + BLOCK_N); the last one, past hi, is moved down to end at hi
    (at 0 at the lowest: op._launch pads k to BLOCK_N rows), and the keys it shares with the tile before are not
    visible (m_vis starts at the nominal start). So every load is in bounds and unmasked, its addresses one base plus
    per-thread constants (the 8 row loads of a thread differ by immediates): a masked or clamped row load cost a
    compare / select or a min, and its own 64-bit address, per row and tile. Offsets are int32 (S x D < 2^31,
    op._check_key_offsets)."""
    i_0 = lo + i_n * BLOCK_N  # the nominal start
    i_s = _tile_start(i_n, lo, hi, BLOCK_N)  # the loaded tile's first key
    o_s = i_s + o_n  # [BLOCK_N] key indices
    if K_TMA:  # Config.k_tma: k_ptr is a tensor descriptor of k [S, D] with block [BLOCK_N, D]: one bulk copy
        b_k = k_ptr.load([i_s, 0])  # [BLOCK_N, D]
    else:
        b_k = tl.load(k_ptr + i_s * D + (o_n[:, None] * D + o_d[None, :]), mask=m_d[None, :],
                      other=0.0)  # [BLOCK_N, D_P2]
    sc = _row_block_scores(b_k, b_qT, b_w, H, R, BLOCK_N, RELU, IEEE, LANE_ROWS=LANE_ROWS)  # [BLOCK_N, R]
    m_vis = (o_s[:, None] >= tl.maximum(b_start, i_0)[None, :]) & (o_s[:, None] < b_end[None, :])  # [BLOCK_N, R]
    return o_s, sc, m_vis


@triton.jit
def _key_tile(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, cnt, thr, b_max, key_rows, idx_rows,
              o_n, o_d, m_d, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr,
              RELU: tl.constexpr, SELECT: tl.constexpr, IEEE: tl.constexpr, LANE_ROWS: tl.constexpr,
              LAZY_MAX: tl.constexpr = False, K_TMA: tl.constexpr = False):
    """One key tile: score it and append each row's new candidates (the caller made room). The floor
    (SELECT=False) keeps a running max instead: per row [R] (a cross-warp max every tile) or, LAZY_MAX,
    per element [BLOCK_N, R] (no per-tile reduction; reduced once after the key loop)."""
    o_s, sc, m_vis = _tile_scores(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, o_n, o_d, m_d,
                                  H, D, R, BLOCK_N, RELU, IEEE, LANE_ROWS=LANE_ROWS, K_TMA=K_TMA)
    if SELECT:
        key = tl.where(m_vis, _score_to_key(sc), INT32_MIN)  # [BLOCK_N, R]
        m_c = key > thr[None, :]  # strict: a later key that ties the threshold loses
        pos = cnt[None, :] + tl.cumsum(m_c.to(tl.int32), axis=0) - 1  # [BLOCK_N, R]
        tl.store(key_rows[None, :] + pos, key, mask=m_c)
        tl.store(idx_rows[None, :] + pos, o_s[:, None] + tl.zeros_like(pos), mask=m_c)
        cnt += tl.sum(m_c.to(tl.int32), axis=0)
    elif LAZY_MAX:
        b_max = tl.maximum(b_max, tl.where(m_vis, sc, float("-inf")))  # [BLOCK_N, R]
    else:
        b_max = tl.maximum(b_max, tl.max(tl.where(m_vis, sc, float("-inf")), axis=0))
    return cnt, thr, b_max


@triton.jit
def _tile_keys(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, o_n, o_d, m_d, H: tl.constexpr, D: tl.constexpr,
               R: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr, IEEE: tl.constexpr, LANE_ROWS: tl.constexpr,
               K_TMA: tl.constexpr = False):
    """Key tile i_n scored as in _key_tile: int32 keys [BLOCK_N, R], INT32_MIN where not visible."""
    o_s, sc, m_vis = _tile_scores(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, o_n, o_d, m_d,
                                  H, D, R, BLOCK_N, RELU, IEEE, LANE_ROWS=LANE_ROWS, K_TMA=K_TMA)
    return tl.where(m_vis, _score_to_key(sc), INT32_MIN)


@triton.jit
def _popc64(x, HW: tl.constexpr):
    """Set bits of each int64 [any shape] -> int32: POPC on the GPU; the interpreter has no popc, so
    a SWAR count on each unsigned 32-bit half there."""
    if HW:
        return libdevice.popc(x.to(tl.int32)) + libdevice.popc((x >> 32).to(tl.int32))
    else:
        n = tl.zeros(x.shape, dtype=tl.int32)
        for i_h in tl.static_range(2):
            v = ((x >> (32 * i_h)) & 0xFFFFFFFF).to(tl.uint32)
            v = v - ((v >> 1) & 0x55555555)
            v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
            v = (v + (v >> 4)) & 0x0F0F0F0F
            n += ((v * 0x01010101) >> 24).to(tl.int32)
        return n


@triton.jit
def _store1(p_a, v_a, m, HW: tl.constexpr):
    """Masked scatter of one int32 tensor, as _store2 (HW: inline PTX in the operands' own layout)."""
    if HW:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }", "=r,l,r,r",
            [p_a.to(tl.int64), v_a, m.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(p_a, v_a, mask=m != 0)  # m: bool or an int32 0 / 1 mask


@triton.jit
def _store2(p_a, v_a, p_b, v_b, m, HW: tl.constexpr):
    """Masked scatter of two int32 tensors of one shape. HW: inline PTX, run in the operands' own
    (MMA-derived) layout; a tl.store would first be converted to a coalesced layout through shared
    memory and barriers, for nothing: the addresses are data-dependent slots."""
    if HW:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $5, 0; @p st.global.b32 [$1], $2; @p st.global.b32 [$3], $4; "
            "mov.b32 $0, 0; }", "=r,l,r,l,r,r", [p_a.to(tl.int64), v_a, p_b.to(tl.int64), v_b, m.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(p_a, v_a, mask=m != 0)  # m: bool or an int32 0 / 1 mask
        tl.store(p_b, v_b, mask=m != 0)


@triton.jit
def _key_mask(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, cnt, thr, key_rows, idx_rows, o_n, o_d, m_d,
              H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr,
              IEEE: tl.constexpr, HW: tl.constexpr, LANE_ROWS: tl.constexpr, RAW: tl.constexpr = False, thr_f=None,
              K_TMA: tl.constexpr = False):
    """Key tile i_n with a bit-mask append (Config.append="mask", BLOCK_N <= 64): no prefix sum.

    Each row's candidates become one int64 mask (bit j = key j of the tile) by a sum over the tile's
    keys, which stays in the scores' MMA-derived layout (no conversion for a scan); a candidate's
    slot is cnt + popc(mask & bits below its own). Same slots as the prefix sum of _key_tile.
    RAW: the test runs on the fp32 score against thr_f (_thr_score(thr)) and the buffer gets the raw bits:
    no int key conversion per score (the select converts the few buffered ones)."""
    if RAW:
        o_s, sc, m_vis = _tile_scores(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, o_n, o_d, m_d,
                                      H, D, R, BLOCK_N, RELU, IEEE, LANE_ROWS=LANE_ROWS, K_TMA=K_TMA)
        m_c = m_vis & (sc >= thr_f[None, :])  # [BLOCK_N, R] = key > thr (strict: a later tie loses)
        key = sc.to(tl.int32, bitcast=True)  # [BLOCK_N, R] what the buffer holds
    else:
        key = _tile_keys(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, o_n, o_d, m_d,
                         H, D, R, BLOCK_N, RELU, IEEE, LANE_ROWS=LANE_ROWS, K_TMA=K_TMA)  # [BLOCK_N, R]
        m_c = key > thr[None, :]  # strict: a later key that ties the threshold loses
    o_s = _tile_start(i_n, lo, hi, BLOCK_N) + o_n  # [BLOCK_N] key indices
    b_bit = tl.full([BLOCK_N, R], 1, tl.int64) << o_n.to(tl.int64)[:, None]  # [BLOCK_N, R] each key's bit
    b_mask = tl.sum(tl.where(m_c, b_bit, 0), axis=0)  # [R] the row's candidates (bits are distinct)
    pos = cnt[None, :] + _popc64(b_mask[None, :] & (b_bit - 1), HW)  # [BLOCK_N, R] earlier candidates
    _store2(key_rows[None, :] + pos, key, idx_rows[None, :] + pos, o_s[:, None] + tl.zeros_like(pos), m_c, HW)
    return cnt + _popc64(b_mask, HW)


@triton.jit
def _popc32(x, HW: tl.constexpr):
    """Set bits of each int32 [any shape] -> int32 (POPC on the GPU, a SWAR count under the interpreter)."""
    if HW:
        return libdevice.popc(x)
    else:
        v = x.to(tl.uint32, bitcast=True)
        v = v - ((v >> 1) & 0x55555555)
        v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
        v = (v + (v >> 4)) & 0x0F0F0F0F
        return ((v * 0x01010101) >> 24).to(tl.int32)


# append="warps", group_mask="ballot": the sm_90a layouts of the [KEY_GROUPS, NG, R] candidate tile that the ballot's
# lane arithmetic assumes (op._check_ballot_layout compares the compiled TTGIR against them), by rows per tile R:
# register bit -> key + 8 (R 8: a second register bit -> row + 4), lane bits -> row + 1, row + 2, key + 1, key + 2,
# key + 4, warp bits -> group + 1, group + 2. So key j, row r of a group sit in lane 4 (j % 8) + r % 4, register
# (j >= 8) + 2 (r >= 4) of the group's warp.
BALLOT_LAYOUTS = {
    4: "register = [[0, 8, 0]], lane = [[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]], "
       "warp = [[1, 0, 0], [2, 0, 0]]",
    8: "register = [[0, 8, 0], [0, 0, 4]], lane = [[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]], "
       "warp = [[1, 0, 0], [2, 0, 0]]",
}
BALLOT_LAYOUT = BALLOT_LAYOUTS[4]
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
def _group_slots_ballot(m_c, HW: tl.constexpr):
    """Config.group_mask="ballot": each candidate's slot offset in its (group, row) region and the group's candidate
    count, both [KEY_GROUPS, NG, R] int32 (the count repeated along NG), from two warp ballots (vote.sync) instead of
    a mask sum over the warp's lanes (3 dependent shuffle levels). Needs NG = 16, R = 4 or 8 and the layout
    BALLOT_LAYOUTS[R] (op checks the compiled kernel). The interpreter runs the same lane arithmetic on that layout's
    model: key j of a group and row r sit in lane 4 (j % 8) + r % 4, register (j >= 8) + 2 (r >= 4) of the group's
    warp (4 ballots per group with 8 rows)."""
    if HW:
        # the lane constants from the layout's index arithmetic (lane = 4 (j % 8) + r), not from %laneid /
        # %lanemask_lt inside the asm: plain arithmetic on the thread index is loop-invariant and leaves the key loop
        # (read in the asm, 2 S2R and 4 ALU instructions ran every tile)
        NG: tl.constexpr = m_c.shape[1]
        R: tl.constexpr = m_c.shape[2]
        o_j = tl.arange(0, NG)[None, :, None]  # [1, NG, 1]
        o_r = tl.arange(0, R)[None, None, :]  # [1, 1, R]
        rm = tl.zeros(m_c.shape, tl.int32) + (0x11111111 << (o_r % 4))  # [KG, NG, R] the lanes of the element's row
        lt = tl.zeros(m_c.shape, tl.int32) + ((1 << (4 * (o_j % 8) + o_r % 4)) - 1)  # its %lanemask_lt
        off, n = tl.inline_asm_elementwise(_BALLOT_ASM, "=r,=r,=r,=r,r,r,r,r,r,r", [m_c.to(tl.int32), rm, lt],
                                           dtype=(tl.int32, tl.int32), is_pure=True, pack=2)
    else:
        NG: tl.constexpr = m_c.shape[1]
        R: tl.constexpr = m_c.shape[2]
        o_j = tl.arange(0, NG)[None, :, None]  # [1, NG, 1]
        o_r = tl.arange(0, R)[None, None, :]  # [1, 1, R]
        lane = 4 * (o_j % 8) + o_r % 4  # [1, NG, R]
        b_lane = tl.full(m_c.shape, 1, tl.int32) << lane  # [KG, NG, R] the lane's ballot bit
        hi = o_j >= 8  # [1, NG, 1] register bit 0: key + 8
        rh = o_r >= 4  # [1, 1, R] register bit 1 (8 rows): row + 4
        # the group's 4 ballots (register 0 .. 3; 2 and 3 empty with 4 rows): distinct lanes, so a sum is an OR
        b00 = tl.sum(tl.sum(tl.where(m_c & ~hi & ~rh, b_lane, 0), axis=2), axis=1)  # [KG]
        b01 = tl.sum(tl.sum(tl.where(m_c & hi & ~rh, b_lane, 0), axis=2), axis=1)
        b10 = tl.sum(tl.sum(tl.where(m_c & ~hi & rh, b_lane, 0), axis=2), axis=1)
        b11 = tl.sum(tl.sum(tl.where(m_c & hi & rh, b_lane, 0), axis=2), axis=1)
        rm = tl.full([1, 1, R], 0x11111111, tl.int32) << (o_r % 4)  # [1, 1, R] the lanes of the thread's row
        lt = b_lane - 1  # [KG, NG, R] %lanemask_lt (bit 31: INT32_MIN - 1 wraps to 0x7FFFFFFF)
        b_lo = tl.where(rh, b10[:, None, None], b00[:, None, None]) & rm  # [KG, 1, R] the row's keys j < 8
        b_hi = tl.where(rh, b11[:, None, None], b01[:, None, None]) & rm  # [KG, 1, R] its keys j >= 8
        c0 = _popc32(b_lo, HW)  # [KG, 1, R]
        c1 = _popc32(b_hi, HW)
        b_own = tl.where(hi, b_hi, b_lo)  # [KG, NG, R]
        off = _popc32(b_own & lt, HW) + tl.where(hi, c0, 0)
        n = c0 + c1 + tl.zeros(m_c.shape, tl.int32)
    return off, n


@triton.jit
def _key_warps(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, nxt, key_rows, idx_rows, o_n, o_d, m_d,
               H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr,
               IEEE: tl.constexpr, HW: tl.constexpr, LANE_ROWS: tl.constexpr, thr_f, BALLOT: tl.constexpr = False,
               K_TMA: tl.constexpr = False):
    """Key tile i_n appended per key group (Config.append="warps"; raw-bit buffers, the fp32 bound thr_f).

    The tile's keys split into KEY_GROUPS groups of NG consecutive keys (on the GPU: one warp's MMA rows each).
    Group g's candidates of a row go to the row's region g from its next free slot nxt[g] [KEY_GROUPS, R], in
    ascending key order within the region: a slot is nxt + popc(the group's int32 mask below the key). No count
    crosses groups, so no cross-warp reduction or barrier per tile (the "mask" append sums a 64-bit mask over the
    whole tile). Only nxt is carried through the tile loop (not the regions' base and width: registers are
    scarce there). Returns the next free slots. BALLOT (Config.group_mask="ballot"): nxt is [KEY_GROUPS, NG, R]
    (repeated along NG: no reduction over the warp's lanes), the slots from _group_slots_ballot."""
    NG: tl.constexpr = BLOCK_N // KEY_GROUPS
    o_s, sc, m_vis = _tile_scores(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, o_n, o_d, m_d,
                                  H, D, R, BLOCK_N, RELU, IEEE, LANE_ROWS=LANE_ROWS, K_TMA=K_TMA)
    m_c = tl.reshape(m_vis & (sc >= thr_f[None, :]), [KEY_GROUPS, NG, R])  # key > thr (strict: a later tie loses)
    key = tl.reshape(sc.to(tl.int32, bitcast=True), [KEY_GROUPS, NG, R])  # what the buffer holds
    o_g = tl.arange(0, KEY_GROUPS)
    o_j = tl.arange(0, NG)
    o_k = _tile_start(i_n, lo, hi, BLOCK_N) + o_g[:, None] * NG + o_j[None, :]  # [KG, NG] key indices
    if BALLOT:
        off, n = _group_slots_ballot(m_c, HW)  # [KG, NG, R] each
        pos = nxt + off
        nxt_new = nxt + n
    else:
        b_bit = tl.full([KEY_GROUPS, NG, R], 1, tl.int32) << o_j[None, :, None]  # [KG, NG, R] each key's bit
        b_mask = tl.sum(tl.where(m_c, b_bit, 0), axis=1)  # [KG, R] the group's candidates (distinct bits)
        pos = nxt[:, None, :] + _popc32(b_mask[:, None, :] & (b_bit - 1), HW)  # [KG, NG, R]
        nxt_new = nxt + _popc32(b_mask, HW)
    _store2(key_rows[None, None, :] + pos, key, idx_rows[None, None, :] + pos, o_k[:, :, None] + tl.zeros_like(pos),
            m_c, HW)
    return nxt_new


@triton.jit
def _sample_tile(i_t, lo, span, k_ptr, b_qT, b_w, b_start, b_end, key_rows, o_n, o_d, m_d,
                 H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, WARM: tl.constexpr,
                 RELU: tl.constexpr, IEEE: tl.constexpr, LANE_ROWS: tl.constexpr, RAW: tl.constexpr, m_w,
                 HW: tl.constexpr = False):
    """Warm-start sample slots [i_t, i_t + BLOCK_N) of m_w (WARM, or Config.warm_mu's size: <= WARM, a multiple of
    BLOCK_N): key index lo + slot * (span // m_w) (until session 17 lo + slot * span // WARM: a 64-bit product and
    division per key, and spills in the sample loop).

    Scores them with the main loop's code (same MMA, activation, weights, head sum, int32 key)
    and writes each row's key into slot ``slot`` of its buffer (INT32_MIN where the key is not
    visible to the row: never counted by the select). Returns the visibility [BLOCK_N, R] as int32 (1: a sample).
    """
    o_i = i_t + o_n  # [BLOCK_N] sample slots
    m_i = o_i < m_w
    o_s = lo + o_i * (span // m_w)  # [BLOCK_N] distinct key indices (span > CAP >= WARM >= m_w)
    b_k = tl.load(k_ptr + o_s.to(tl.int64)[:, None] * D + o_d[None, :],
                  mask=m_i[:, None] & m_d[None, :], other=0.0)  # [BLOCK_N, D_P2]
    sc = _row_block_scores(b_k, b_qT, b_w, H, R, BLOCK_N, RELU, IEEE, LANE_ROWS=LANE_ROWS)  # [BLOCK_N, R]
    m_vis = m_i[:, None] & (o_s[:, None] >= b_start[None, :]) & (o_s[:, None] < b_end[None, :])
    if RAW:  # the buffer's format: raw fp32 bits, RAW_NONE (key INT32_MIN) where not visible
        key = tl.where(m_vis, sc.to(tl.int32, bitcast=True), RAW_NONE)  # [BLOCK_N, R]
    else:
        key = tl.where(m_vis, _score_to_key(sc), INT32_MIN)  # [BLOCK_N, R]
    # HW: inline PTX stores in the scores' MMA layout (a tl.store converted the tile through shared memory and
    # barriers first); the visible count is summed by the caller after the sample loop (no reduction per tile)
    _store1(key_rows[None, :] + o_i[:, None], key, tl.broadcast_to(m_i[:, None], key.shape), HW)
    return m_vis.to(tl.int32)


@triton.jit
def _warm_rank(n_vis, m_smp, kk, CAP: tl.constexpr, WARM_Z: tl.constexpr, WARM_MIN: tl.constexpr):
    """The sample rank j [R] whose key bounds the row's threshold, and the rows that use it [R] (see
    _warm_threshold): n_vis visible keys, m_smp of them sampled."""
    p0 = kk / tl.maximum(n_vis, 1).to(tl.float32)  # [R] fraction of the row's keys that is kept
    mu = m_smp.to(tl.float32) * p0
    j = (mu + WARM_Z * tl.sqrt(tl.maximum(mu * (1.0 - p0), 0.0))).to(tl.int32) + 1  # [R]
    return j, (n_vis > CAP) & (m_smp >= WARM_MIN) & (2 * j <= m_smp)


@triton.jit
def _head_threshold(key_rows, idx_rows, cnt, cnt_g, kk, n_vis, m_t, R: tl.constexpr, CAP: tl.constexpr,
                    CHUNK: tl.constexpr, WARM_Z: tl.constexpr, WARM_MIN: tl.constexpr, SEARCH2: tl.constexpr,
                    RAW: tl.constexpr, WARPS: tl.constexpr, KTH: tl.constexpr, SPLIT: tl.constexpr = 1,
                    key_base=None, idx_base=None):
    """Config.warm_sample="head": the buffers hold every visible key of the row block's first tiles (appended from
    -inf); each row's threshold tau is set from them as _warm_threshold sets it from its spread sample (the j-th
    largest - 1, same rank rule), and the buffer is filtered to its keys > tau in place (stable; WARPS: packed).
    The state is then exactly what the key loop would hold had it started at tau: every key > tau of those tiles, in
    order; the key loop goes on from the next tile and the usual fallback (fewer than kk keys at the end: re-run from
    -inf) keeps it exact. No extra scoring: the sample is the first tiles themselves (a contiguous sample, so
    position-dependent scores move tau; the fallback guards exactness, not time).
    Returns (tau [R], INT32_MIN where off; cnt; cnt_g; reg0; F) for the key loop."""
    tl.debug_barrier()  # appends of the first tiles visible to every thread
    m_smp = _n_buffered(cnt, cnt_g, WARPS)  # [R] visible keys of the first tiles (all appended)
    j, on = _warm_rank(n_vis, m_smp, kk, CAP, WARM_Z, WARM_MIN)
    j = tl.where(on, j, CAP)  # rows off: no search (at most CAP keys)
    if SEARCH2:
        kth, _, _ = _kth_key2(key_rows, cnt, j, R, CAP, RAW, cnt_g, WARPS, KTH)
    else:
        kth = _kth_key(key_rows, cnt, j, tl.arange(0, CHUNK), R, CAP, CHUNK, RAW)
    tau = tl.where(on, kth - 1, INT32_MIN)  # keys tied with the j-th stay (as in _warm_threshold)
    tl.debug_barrier()  # the search done reading before the filter rewrites the buffer
    _, kept = _select_store_rows(key_rows, idx_rows, cnt, kk, key_rows, idx_rows, m_t, False, False, R, CAP, CHUNK,
                                 SEARCH2, RAW, cnt_g, WARPS, KTH, FILTER=True, thr_keep=tau, SPLIT=SPLIT,
                                 key_base=key_base, idx_base=idx_base)
    cnt_g = cnt_g * 0
    reg0 = tl.max(kept, axis=0)
    return tau, kept, cnt_g, reg0, (CAP - reg0) // KEY_GROUPS


@triton.jit
def _norm_tail_z(p):
    """z with P(N(0, 1) > z) = p, p in (0, 0.5] (Abramowitz & Stegun 26.2.23: |error| < 4.5e-4)."""
    t = tl.sqrt(-2.0 * tl.log(p))
    return t - (2.515517 + t * (0.802853 + t * 0.010328)) / (1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)))


@triton.jit
def _warm_window(key_rows, j, on, R: tl.constexpr, WARM: tl.constexpr, SLACK: tl.constexpr, RAW: tl.constexpr,
                 m_w):
    """Config.warm_search="window": per row a key x whose count of sample keys >= x lies in [j, j + SLACK j]; the
    threshold is x - 1. Rows off (on False) get INT32_MIN. The sample: slots [0, m_w).

    Any such x is at or below the j-th largest sample key, so _warm_threshold's argument holds unchanged (at least
    as many keys reach the key loop as with the j-th key itself, at most ~SLACK more); the window only lets the
    search stop early. First probe: the row's sample mean + z sd, z the normal quantile of the window's middle rank
    (one pass over the sample gives the moments, with its min / max); then _kth_interp's bracketed interpolation
    (Illinois) aimed at the window's middle. If the bracket closes (hm = lo) without a count in the window, lo
    (more than j + SLACK j keys >= it) is taken."""
    o_w = tl.arange(0, WARM)  # [WARM]
    b_keys = _load_keys(key_rows[:, None] + o_w[None, :], (o_w[None, :] < m_w) & on[:, None], RAW)  # [R, WARM]
    m_key = b_keys != INT32_MIN  # visible sample keys (on rows only)
    n_real = tl.sum(m_key.to(tl.int32), axis=1)  # [R]
    k_max = tl.max(tl.where(m_key, b_keys, INT32_MIN), axis=1)  # [R]
    lo = tl.min(tl.where(m_key, b_keys, INT32_MAX), axis=1)  # [R] f(lo) = n_real
    hm = k_max  # [R] the upper end - 1: f(hm + 1) = 0
    # moments about the row's max (fp32 sums of values <= 0: no cancellation against a large mean)
    s_max = _key_to_score(k_max)  # [R]
    b_d = tl.where(m_key, _key_to_score(b_keys) - s_max[:, None], 0.0)  # [R, WARM]
    n_f = tl.maximum(n_real, 1).to(tl.float32)
    d_mean = tl.sum(b_d, axis=1) / n_f
    sd = tl.sqrt(tl.maximum(tl.sum(b_d * b_d, axis=1) / n_f - d_mean * d_mean, 0.0))  # [R]
    j_hi = j + (j.to(tl.float32) * SLACK).to(tl.int32)  # [R] the window [j, j_hi]
    target = (j + j_hi).to(tl.float32) * 0.5
    z = _norm_tail_z(tl.minimum(tl.maximum(target / n_f, 1e-6), 0.5))
    x0 = _score_to_key(s_max + d_mean + z * sd)  # [R] the first probe
    found = ~on | (n_real <= j_hi)  # off rows: no search; tiny samples: lo (every key) is in the window
    x_res = lo
    live = ~found & (hm > lo)  # [R]
    f_lo = n_real.to(tl.float32)  # [R] the ends' counts as the interpolation uses them (Illinois)
    f_hi = tl.zeros_like(f_lo)
    side = tl.zeros_like(n_real)  # [R] the end the last pass moved: 1 lo, -1 hi
    w_prev = tl.full([R], float("inf"), tl.float32)
    i_pass = 0
    n_live = tl.sum(live.to(tl.int32), axis=0)
    while n_live > 0:
        x, width = _interp_probe(lo, _bracket_gap(lo, hm), f_lo, f_hi, w_prev, target, live)  # x in (lo, hm + 1)
        if i_pass == 0:
            x = tl.minimum(tl.maximum(x0, lo + 1), hm)
        c = tl.sum((b_keys >= x[:, None]).to(tl.int32), axis=1)  # [R] sample keys >= x
        hit = live & (c >= j) & (c <= j_hi)
        up = live & (c > j_hi)
        dn = live & (c < j)
        x_res = tl.where(hit, x, x_res)
        w_prev = tl.where(live, width, w_prev)
        lo, hm, f_lo, f_hi, side = _illinois_update(x, c, up, dn, lo, hm, f_lo, f_hi, side, target)
        x_res = tl.where(live & ~hit & (hm <= lo), lo, x_res)  # closed: lo, more than j_hi keys >= it
        live = live & ~hit & (hm > lo)
        n_live = tl.sum(live.to(tl.int32), axis=0)
        i_pass += 1
    return tl.where(on, x_res - 1, INT32_MIN)


@triton.jit
def _warm_threshold(lo, hi, kk, k_ptr, b_qT, b_w, b_start, b_end, m_live, key_rows, o_n, o_d, m_d,
                    H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, CAP: tl.constexpr,
                    WARM: tl.constexpr, CHUNK_W: tl.constexpr, WARM_Z: tl.constexpr, WARM_MIN: tl.constexpr,
                    RELU: tl.constexpr, IEEE: tl.constexpr, SEARCH2: tl.constexpr, LANE_ROWS: tl.constexpr,
                    RAW: tl.constexpr = False, KTH: tl.constexpr = 0, PROFILE: tl.constexpr = False,
                    INTERP: tl.constexpr = False, WARM_WIN: tl.constexpr = False, WARM_SLACK: tl.constexpr = 0.25,
                    WARM_MU: tl.constexpr = 0.0):
    """Each row's starting threshold key tau [R] (INT32_MIN: no warm start for that row), and (PROFILE) the
    cycles of the sample's scoring and of its select.

    The sample: WARM keys, or (WARM_MU > 0, Config.warm_mu) m = WARM_MU * (hi - lo) / kk rounded up to whole tiles,
    at least 2 tiles and at most WARM, so that a row's expected sample count above its k-th key (mu below) is about
    WARM_MU whatever its length: the sample costs each row block the same fraction of its key loop (a fixed WARM
    over-samples short rows), and the margin, hence the candidates per row (~ topk (1 + WARM_Z / sqrt(mu))), stays
    the same at 128K as at 8K.

    Only run when some row sees more than CAP keys (fewer never compact), so hi - lo > CAP >=
    WARM and the WARM sample indices are distinct. Row r with n visible keys and m visible
    samples: the fraction p of its keys above the j-th largest sample is Beta(j, m + 1 - j), and
    P(fewer than topk keys above) = P(p < topk/n) = P(Binomial(m, topk/n) >= j). j = floor(mu +
    WARM_Z * sd) + 1 with mu = m * topk / n, sd = sqrt(mu * (1 - topk/n)) puts j WARM_Z
    standard deviations above the boundary; about n * j / (m + 1) keys end up above tau.
    Used where n > CAP, m >= WARM_MIN and 2 j <= m (the threshold cuts at least half the keys).

    Returns tau = (j-th largest sample key) - 1, so the key loop's strict ``key > tau`` takes keys
    >= the sample quantile (ties with it included). SEARCH2: a row whose 2-bit search stops early
    (exactly j sample keys >= its bucket bound L) gets tau = L - 2 <= the j-th key - 1: a few more
    candidates, the same argument.

    Exactness and ties: the key loop then appends keys strictly above tau. If at least topk
    visible keys are > tau, the row's topk-th largest key v satisfies v > tau, so every key >= v
    (all keys tied at v included) is appended, in ascending index order as before: the buffer
    holds every key the -inf start would have kept and the same compaction / lowest-index tie
    rule gives the same set. Otherwise the row ends with cnt < topk and the caller re-runs it
    from -inf. The sample itself is only a heuristic; it cannot change the result.
    """
    t0 = _clock(PROFILE, INTERP)
    n_vis = tl.where(m_live, b_end - b_start, 0)  # [R]
    span = hi - lo
    if WARM_MU > 0:  # tiles of the sample: WARM_MU expected keys above each row's k-th
        n_wt = tl.cdiv((WARM_MU * span.to(tl.float32) / kk).to(tl.int32), BLOCK_N)
        m_w = tl.minimum(tl.maximum(n_wt, 2), WARM // BLOCK_N) * BLOCK_N
    else:
        m_w = span * 0 + WARM
    m_smp = tl.zeros([BLOCK_N, R], dtype=tl.int32)  # visible samples per row and tile position (summed below)
    if WARM_MU == 0:
        for i_t in range(0, WARM, BLOCK_N):
            m_smp += _sample_tile(i_t, lo, span, k_ptr, b_qT, b_w, b_start, b_end, key_rows, o_n, o_d, m_d,
                                  H, D, R, BLOCK_N, WARM, RELU, IEEE, LANE_ROWS, RAW, WARM, not INTERP)
    elif INTERP:  # the interpreter cannot `range` over runtime bounds
        i_t = m_w * 0
        while i_t < m_w:
            m_smp += _sample_tile(i_t, lo, span, k_ptr, b_qT, b_w, b_start, b_end, key_rows, o_n, o_d, m_d,
                                  H, D, R, BLOCK_N, WARM, RELU, IEEE, LANE_ROWS, RAW, m_w, not INTERP)
            i_t += BLOCK_N
    else:
        for i_t in range(0, m_w, BLOCK_N):
            m_smp += _sample_tile(i_t, lo, span, k_ptr, b_qT, b_w, b_start, b_end, key_rows, o_n, o_d, m_d,
                                  H, D, R, BLOCK_N, WARM, RELU, IEEE, LANE_ROWS, RAW, m_w, not INTERP)
    m_smp = tl.sum(m_smp, axis=0)  # [R]
    tl.debug_barrier()  # sample keys visible to every thread
    t1 = _clock(PROFILE, INTERP)
    j, on = _warm_rank(n_vis, m_smp, kk, CAP, WARM_Z, WARM_MIN)
    if WARM_WIN:  # Config.warm_search="window": a threshold whose sample count is in a window above j
        thr = _warm_window(key_rows, j, on, R, WARM, WARM_SLACK, RAW, m_w)
    else:
        j = tl.where(on, j, 1)
        n_smp = tl.full([R], 0, dtype=tl.int32) + m_w  # slots [m_w, WARM) hold no sample
        if SEARCH2:
            tau, _, _ = _kth_key2(key_rows, n_smp, j, R, WARM, RAW, KTH=KTH, HW=not INTERP)
        else:
            o_hw = tl.arange(0, CHUNK_W)
            tau = _kth_key(key_rows, n_smp, j, o_hw, R, WARM, CHUNK_W, RAW)
        # tau - 1: keys tied with the j-th sample key pass too (a sample value repeated across
        # many keys, e.g. ReLU zeros, would otherwise send the row to the -inf re-run)
        thr = tl.where(on, tau - 1, INT32_MIN)
    tl.debug_barrier()  # select done reading before the key loop overwrites the slots
    t2 = _clock(PROFILE, INTERP)
    return thr, t1 - t0, t2 - t1


@triton.jit
def _append_step(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, cnt, cnt_g, thr, b_max, key_rows, idx_rows,
                 o_n, o_d, m_d, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr,
                 RELU: tl.constexpr, SELECT: tl.constexpr, IEEE: tl.constexpr, APPEND: tl.constexpr, HW: tl.constexpr,
                 LANE_ROWS: tl.constexpr, LAZY_MAX: tl.constexpr = False, RAW: tl.constexpr = False, thr_f=None,
                 BALLOT: tl.constexpr = False, K_TMA: tl.constexpr = False):
    """One step of the key loop from tile i_n: Config.append's way (the floor, SELECT=False, always tiles).
    APPEND 2 ("warps"): cnt_g holds the key groups' next free slots [KEY_GROUPS, R] (BALLOT: [KEY_GROUPS, NG, R],
    see _key_loop)."""
    if APPEND == 2 and SELECT:
        cnt_g = _key_warps(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, cnt_g, key_rows, idx_rows,
                           o_n, o_d, m_d, H, D, R, BLOCK_N, RELU, IEEE, HW, LANE_ROWS, thr_f,
                           BALLOT=BALLOT, K_TMA=K_TMA)  # cnt_g: next slots
    elif APPEND == 1 and SELECT:
        cnt = _key_mask(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, cnt, thr, key_rows, idx_rows,
                        o_n, o_d, m_d, H, D, R, BLOCK_N, RELU, IEEE, HW, LANE_ROWS=LANE_ROWS, RAW=RAW, thr_f=thr_f,
                        K_TMA=K_TMA)
    else:
        cnt, thr, b_max = _key_tile(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, cnt, thr, b_max,
                                    key_rows, idx_rows, o_n, o_d, m_d, H, D, R, BLOCK_N, RELU, SELECT, IEEE,
                                    LANE_ROWS=LANE_ROWS, LAZY_MAX=LAZY_MAX, K_TMA=K_TMA)
    return cnt, cnt_g, thr, b_max


@triton.jit
def _key_loop(n_tiles, lo, hi, kk, k_ptr, b_qT, b_w, b_start, b_end, cnt, cnt_g, reg0, F, thr, b_max, key_rows,
              idx_rows, m_t, o_n, o_d, m_d, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr,
              CAP: tl.constexpr, CHUNK: tl.constexpr, MIN_FREE: tl.constexpr, RELU: tl.constexpr,
              SELECT: tl.constexpr, IEEE: tl.constexpr, WHILE_LOOPS: tl.constexpr, SEARCH2: tl.constexpr,
              APPEND: tl.constexpr, LANE_ROWS: tl.constexpr, LAZY_MAX: tl.constexpr = False,
              RAW: tl.constexpr = False, KTH: tl.constexpr = 0, ABLATE: tl.constexpr = 0, i_first=0,
              BALLOT: tl.constexpr = False, PROFILE: tl.constexpr = False, c_cmp=0, n_cmp=0, n_seg_run=0,
              SPLIT: tl.constexpr = 1, K_TMA: tl.constexpr = False, key_base=None, idx_base=None):
    """The row block's key loop (its tiles from i_first, ascending), compacting between segments.

    APPEND (Config.append): 0 "tile" (_key_tile), 1 "mask" (_key_mask), 2 "warps" (_key_warps: the key groups'
    regions of KEY_GROUPS x F slots from reg0, counts cnt_g; a compaction packs them into the prefix [0, cnt) and
    splits the free rest anew). RAW (mask, warps): raw-bit buffers, the candidate test against the segment's fp32
    bound. BALLOT (warps, Config.group_mask="ballot"): the tile loop carries the next free slots as [KEY_GROUPS, NG, R]
    (_key_warps). ABLATE >= 6 (benchmarks, no candidates): one segment, no free-space bound. PROFILE: c_cmp / n_cmp
    (int64) gain the compactions' cycles and count, n_seg_run (int64) the segments. K_TMA (Config.k_tma): k_ptr is
    a tensor descriptor of k (the tiles by bulk copies, _tile_scores). Returns (cnt, cnt_g, reg0, F, thr, b_max,
    c_cmp, n_cmp, n_seg_run)."""
    WARPS: tl.constexpr = APPEND == 2
    NG: tl.constexpr = BLOCK_N // KEY_GROUPS
    i_n = i_first
    while i_n < n_tiles:
        # a segment of tiles that cannot overflow any row's buffer: the tile loop itself
        # stays free of branches and barriers, so it software-pipelines
        n_seg = n_tiles - i_n
        if SELECT:
            if WARPS:  # free slots of the fullest region; a tile adds at most NG keys to each
                free = F - tl.max(tl.max(cnt_g, axis=1), axis=0)
                if free < MIN_FREE // KEY_GROUPS:
                    tl.debug_barrier()  # appends of earlier tiles visible to all threads
                    t0 = _clock(PROFILE, WHILE_LOOPS)
                    kth, _ = _select_store_rows(key_rows, idx_rows, cnt, kk, key_rows, idx_rows, m_t, False, False, R,
                                                CAP, CHUNK, SEARCH2, RAW, cnt_g, True, KTH, HW=not WHILE_LOOPS,
                                                SPLIT=SPLIT, key_base=key_base, idx_base=idx_base)
                    thr = tl.maximum(thr, kth)
                    cnt = tl.minimum(_n_buffered(cnt, cnt_g, True), kk)
                    cnt_g = cnt_g * 0
                    reg0 = tl.max(cnt, axis=0)
                    F = (CAP - reg0) // KEY_GROUPS  # >= MIN_FREE // KEY_GROUPS + NG (CAP >= kk + 2 MIN_FREE)
                    free = F
                    if PROFILE:
                        tl.debug_barrier()
                        c_cmp += _clock(PROFILE, WHILE_LOOPS) - t0
                        n_cmp += 1
                n_seg = tl.minimum(n_seg, free // NG)
            else:
                if CAP - tl.max(cnt, axis=0) < MIN_FREE:
                    tl.debug_barrier()  # appends of earlier tiles visible to all threads
                    t0 = _clock(PROFILE, WHILE_LOOPS)
                    kth, _ = _select_store(key_rows, idx_rows, cnt, kk, key_rows, idx_rows, m_t,
                                        False, False, R, CAP, CHUNK, SEARCH2, RAW, KTH=KTH, HW=not WHILE_LOOPS)
                    thr = tl.maximum(thr, kth)
                    cnt = tl.minimum(cnt, kk)
                    if PROFILE:
                        tl.debug_barrier()
                        c_cmp += _clock(PROFILE, WHILE_LOOPS) - t0
                        n_cmp += 1
                n_seg = tl.minimum(n_seg, (CAP - tl.max(cnt, axis=0)) // BLOCK_N)
            if ABLATE >= 6:  # ablation (no candidates: nothing can overflow): the rest of the tiles in one segment
                n_seg = n_tiles - i_n
        thr_f = _thr_score(thr)  # [R] RAW: the segment's fp32 bound (thr is fixed within a segment)
        if ABLATE >= 2:  # ablation (benchmarks only): no score passes the bound, every loop instruction still runs
            thr_f = tl.where(thr_f == thr_f, float("inf"), thr_f)
        if WARPS:  # counts -> next free slots for the tile loop (and back after it)
            cnt_g += reg0 + (tl.arange(0, KEY_GROUPS) * F)[:, None]
        if BALLOT:
            nxt = cnt_g[:, None, :] + tl.zeros([KEY_GROUPS, NG, R], dtype=tl.int32)  # [KG, NG, R]
        else:
            nxt = cnt_g
        if WHILE_LOOPS:  # the interpreter (numpy >= 2.5) cannot `range` over runtime bounds
            i_e = i_n + n_seg
            while i_n < i_e:
                cnt, nxt, thr, b_max = _append_step(i_n, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, cnt, nxt,
                                                    thr, b_max, key_rows, idx_rows, o_n, o_d, m_d, H, D,
                                                    R, BLOCK_N, RELU, SELECT, IEEE, APPEND, not WHILE_LOOPS,
                                                    LANE_ROWS=LANE_ROWS, LAZY_MAX=LAZY_MAX, RAW=RAW, thr_f=thr_f,
                                                    BALLOT=BALLOT, K_TMA=K_TMA)
                i_n += 1
        else:
            for i_j in range(i_n, i_n + n_seg):
                cnt, nxt, thr, b_max = _append_step(i_j, lo, hi, k_ptr, b_qT, b_w, b_start, b_end, cnt, nxt,
                                                    thr, b_max, key_rows, idx_rows, o_n, o_d, m_d, H, D,
                                                    R, BLOCK_N, RELU, SELECT, IEEE, APPEND, not WHILE_LOOPS,
                                                    LANE_ROWS=LANE_ROWS, LAZY_MAX=LAZY_MAX, RAW=RAW, thr_f=thr_f,
                                                    BALLOT=BALLOT, K_TMA=K_TMA)
            i_n += n_seg
        if BALLOT:
            cnt_g = tl.max(nxt, axis=1)  # [KG, R] (repeated along NG)
        else:
            cnt_g = nxt
        if WARPS:
            cnt_g -= reg0 + (tl.arange(0, KEY_GROUPS) * F)[:, None]
        n_seg_run += 1
    return cnt, cnt_g, reg0, F, thr, b_max, c_cmp, n_cmp, n_seg_run


@triton.jit
def hytopk_kernel(
    q_ptr, w_ptr, k_ptr, starts_ptr, ends_ptr,  # q [T,H,D], w [T,H], k [S,D], bounds int32 [T]
    out_idx_ptr, out_val_ptr,  # SELECT: [T, topk] int32 / fp32 (WRITE_SCORES); floor: out_val [T] row max
    buf_key_ptr, buf_idx_ptr,  # scratch int32 [programs, R, CAP]
    stats_ptr,  # WARM: int32 [3] += rows warm-started, rows re-run from -inf, row blocks re-run
    prof_ptr,  # PROFILE: int64 [P_N] += cycles / counts per phase (the P_* constants)
    T, S, kk, n_blocks, n_p,  # n_p: programs in the (persistent) grid
    H: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, R: tl.constexpr,
    BLOCK_N: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr, MIN_FREE: tl.constexpr,
    RELU: tl.constexpr, SELECT: tl.constexpr, WRITE_SCORES: tl.constexpr, IEEE: tl.constexpr,
    WHILE_LOOPS: tl.constexpr, SEARCH2: tl.constexpr,
    WARM: tl.constexpr = 0, CHUNK_W: tl.constexpr = 1, WARM_Z: tl.constexpr = 4.0, WARM_MIN: tl.constexpr = 16,
    APPEND: tl.constexpr = 0, LANE_ROWS: tl.constexpr = False, LAZY_MAX: tl.constexpr = False,
    RAW: tl.constexpr = False, KTH: tl.constexpr = 0, ABLATE: tl.constexpr = 0, WARM_HEAD: tl.constexpr = False,
    BALLOT: tl.constexpr = False, PROFILE: tl.constexpr = False, WARM_WIN: tl.constexpr = False,
    WARM_SLACK: tl.constexpr = 0.25, WARM_MU: tl.constexpr = 0.0, SELECT_SPLIT: tl.constexpr = 1,
    k_desc=None, K_TMA: tl.constexpr = False,  # Config.k_tma: a tensor descriptor of k, block [BLOCK_N, D]
):
    """ABLATE (bench/topk.py --parts ablate only, via op.hytopk_ablation; the output is not a valid selection): 1 skips
    the final select and its output writes, 2 lets no key become a candidate in the key loop (no appends, hence no
    compactions; every instruction of the loop still runs), 3 both; 6 / 7: 2 / 3 with the key loop in one segment
    (no segment bound: the cost of the segments' pipeline restarts). Timing these against the full kernel splits
    its cost over the key loop's code, its appends and compactions, and the final select.
    PROFILE (op.hytopk_profile; the output stays the selection): each program adds its phases' clock64 cycles and
    counts to prof_ptr (P_*)."""
    t_start = _clock(PROFILE, WHILE_LOOPS)
    c_setup = t_start * 0  # PROFILE: int64 cycle / count accumulators (P_*)
    c_smp = c_setup
    c_wsel = c_setup
    c_loop = c_setup
    c_cmp = c_setup
    c_rerun = c_setup
    c_final = c_setup
    n_blk = c_setup
    n_cmp = c_setup
    n_seg_run = c_setup
    i_p = tl.program_id(0)
    if K_TMA:  # the key loop's K tiles through the descriptor (the warm sample's gathered rows keep k_ptr)
        k_src = k_desc
    else:
        k_src = k_ptr
    RH: tl.constexpr = R * H
    o_d = tl.arange(0, D_P2)  # [D_P2]
    m_d = o_d < D
    o_rh = _block_columns(R, H, LANE_ROWS)  # [RH] (row, head) of each score-tile column
    o_r = tl.arange(0, R)  # [R]
    o_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    # this program's scratch rows, reused for every row block it owns
    key_rows = buf_key_ptr + (i_p * R + o_r).to(tl.int64) * CAP  # [R] row pointers
    idx_rows = buf_idx_ptr + (i_p * R + o_r).to(tl.int64) * CAP  # [R]
    key_base = buf_key_ptr + (i_p * R).to(tl.int64) * CAP  # the block's first row (Config.select_split's halves)
    idx_base = buf_idx_ptr + (i_p * R).to(tl.int64) * CAP

    # row blocks in descending order: with causal bounds the costliest first, for balance
    i_w = i_p
    while i_w < n_blocks:
        t0 = _clock(PROFILE, WHILE_LOOPS)
        i_blk = n_blocks - 1 - i_w
        o_t = i_blk * R + o_r  # [R] query rows
        m_t = o_t < T
        b_start = tl.load(starts_ptr + o_t, mask=m_t, other=0)  # [R]
        b_end = tl.load(ends_ptr + o_t, mask=m_t, other=0)  # [R]
        m_live = b_end > b_start
        lo = tl.min(tl.where(m_live, b_start, S), axis=0)
        hi = tl.max(tl.where(m_live, b_end, 0), axis=0)
        n_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)

        o_m = i_blk * RH + o_rh  # [RH] flattened (row, head), in the tile's column order
        m_m = o_m < T * H
        b_q = tl.load(q_ptr + o_m.to(tl.int64)[:, None] * D + o_d[None, :],
                      mask=m_m[:, None] & m_d[None, :], other=0.0)  # [RH, D_P2]
        b_qT = tl.trans(b_q)  # [D_P2, RH]
        b_w = tl.load(w_ptr + o_m, mask=m_m, other=0.0).to(tl.float32)  # [RH]

        cnt = tl.zeros([R], dtype=tl.int32)  # candidates held per row (append="warps": in the packed prefix)
        cnt_g = tl.zeros([KEY_GROUPS, R], dtype=tl.int32)  # append="warps": candidates in each key group's region
        reg0 = tl.max(cnt, axis=0)  # append="warps": the regions' first slot (scalar) and width
        F = (CAP - reg0) // KEY_GROUPS
        thr = tl.full([R], INT32_MIN, dtype=tl.int32)  # running threshold key per row
        if LAZY_MAX:  # floor mode only (LAZY_MAX: per element, reduced after the key loop)
            b_max = tl.full([BLOCK_N, R], float("-inf"), dtype=tl.float32)
        else:
            b_max = tl.full([R], float("-inf"), dtype=tl.float32)
        if WARM > 0 and SELECT:
            i_first = n_tiles * 0  # the key loop's first tile (WARM_HEAD: after the sampled first tiles)
            warm_on = tl.max(tl.where(m_live, b_end - b_start, 0), axis=0) > CAP
            if WARM_HEAD:  # Config.warm_sample="head": the first tiles are the sample (_head_threshold)
                if APPEND == 2:
                    _fill_none(key_rows, cnt, R, CAP, CHUNK)
                    tl.debug_barrier()
                if warm_on:
                    t1 = _clock(PROFILE, WHILE_LOOPS)
                    c_setup += t1 - t0
                    n_head = tl.minimum(n_tiles, WARM // BLOCK_N)  # WARM <= CAP: no compaction among them
                    cnt, cnt_g, reg0, F, thr, b_max, c_cmp, n_cmp, n_seg_run = _key_loop(
                        n_head, lo, hi, kk, k_src, b_qT, b_w, b_start, b_end, cnt, cnt_g, reg0, F, thr, b_max,
                        key_rows, idx_rows, m_t, o_n, o_d, m_d, H, D, R, BLOCK_N, CAP, CHUNK, MIN_FREE, RELU,
                        SELECT, IEEE, WHILE_LOOPS, SEARCH2, APPEND, LANE_ROWS=LANE_ROWS, RAW=RAW, KTH=KTH,
                        ABLATE=ABLATE, BALLOT=BALLOT, PROFILE=PROFILE, K_TMA=K_TMA, c_cmp=c_cmp, n_cmp=n_cmp,
                        n_seg_run=n_seg_run, SPLIT=SELECT_SPLIT, key_base=key_base, idx_base=idx_base)
                    thr, cnt, cnt_g, reg0, F = _head_threshold(
                        key_rows, idx_rows, cnt, cnt_g, kk, tl.where(m_live, b_end - b_start, 0), m_t, R, CAP, CHUNK,
                        WARM_Z, WARM_MIN, SEARCH2, RAW, APPEND == 2, KTH, SPLIT=SELECT_SPLIT, key_base=key_base,
                        idx_base=idx_base)
                    i_first = n_head
                    t0 = _clock(PROFILE, WHILE_LOOPS)
                    c_smp += t0 - t1  # the head's tiles and threshold (its select: P_SAMPLE too)
            else:
                if warm_on:
                    c_setup += _clock(PROFILE, WHILE_LOOPS) - t0
                    thr, dt_smp, dt_sel = _warm_threshold(
                        lo, hi, kk, k_ptr, b_qT, b_w, b_start, b_end, m_live, key_rows, o_n, o_d, m_d, H, D, R,
                        BLOCK_N, CAP, WARM, CHUNK_W, WARM_Z, WARM_MIN, RELU, IEEE, SEARCH2, LANE_ROWS=LANE_ROWS,
                        RAW=RAW, KTH=KTH, PROFILE=PROFILE, INTERP=WHILE_LOOPS, WARM_WIN=WARM_WIN,
                        WARM_SLACK=WARM_SLACK, WARM_MU=WARM_MU)
                    c_smp += dt_smp
                    c_wsel += dt_sel
                    t0 = _clock(PROFILE, WHILE_LOOPS)
                if APPEND == 2:  # append="warps": every slot a hole (RAW_NONE) before the regions fill (after
                    _fill_none(key_rows, cnt, R, CAP, CHUNK)  # the warm sample's select read its slots)
                    tl.debug_barrier()
            c_setup += _clock(PROFILE, WHILE_LOOPS) - t0
            on = thr > INT32_MIN  # [R] rows started from a sampled threshold
            n_on = tl.sum(on.to(tl.int32), axis=0)
            n_fail = n_on * 0
            n_pass = n_on * 0 + 1
            i_pass = n_on * 0
            while i_pass < n_pass:
                t0 = _clock(PROFILE, WHILE_LOOPS)
                cnt, cnt_g, reg0, F, thr, b_max, c_cmp, n_cmp, n_seg_run = _key_loop(
                    n_tiles, lo, hi, kk, k_src, b_qT, b_w, b_start, b_end, cnt, cnt_g, reg0, F, thr, b_max, key_rows,
                    idx_rows, m_t, o_n, o_d, m_d, H, D, R, BLOCK_N, CAP, CHUNK, MIN_FREE, RELU, SELECT, IEEE,
                    WHILE_LOOPS, SEARCH2, APPEND, LANE_ROWS=LANE_ROWS, RAW=RAW, KTH=KTH, ABLATE=ABLATE,
                    i_first=i_first, BALLOT=BALLOT, PROFILE=PROFILE, K_TMA=K_TMA, c_cmp=c_cmp, n_cmp=n_cmp,
                    n_seg_run=n_seg_run, SPLIT=SELECT_SPLIT, key_base=key_base, idx_base=idx_base)
                if PROFILE:
                    tl.debug_barrier()
                    dt = _clock(PROFILE, WHILE_LOOPS) - t0
                    c_loop += tl.where(i_pass == 0, dt, 0)
                    c_rerun += tl.where(i_pass == 0, 0, dt)
                i_first = i_first * 0  # a re-run starts from the first tile
                # fewer than topk keys above tau: re-run the row from -inf; rows that succeeded
                # keep their buffers and append nothing more (no key is > INT32_MAX)
                fail = on & (_n_buffered(cnt, cnt_g, APPEND == 2) < kk)  # [R]; all False after the first pass
                if ABLATE >= 2:  # ablation: no candidates by design, no re-run
                    fail = on & (cnt < 0)
                n_f = tl.sum(fail.to(tl.int32), axis=0)
                n_fail += n_f
                n_pass += (n_f > 0).to(tl.int32)
                cnt = tl.where(fail, 0, cnt)
                cnt_g = tl.where(fail[None, :], 0, cnt_g)
                if APPEND == 2:
                    if n_f > 0:  # the failed rows' buffers back to holes
                        _fill_none(key_rows, tl.where(fail, 0, CAP), R, CAP, CHUNK)
                        tl.debug_barrier()
                thr = tl.where(fail, INT32_MIN, tl.where(n_f > 0, INT32_MAX, thr))
                on = fail & (cnt < 0)
                i_pass += 1
            tl.atomic_add(stats_ptr, n_on)
            tl.atomic_add(stats_ptr + 1, n_fail)
            tl.atomic_add(stats_ptr + 2, (n_fail > 0).to(tl.int32))
        else:
            if APPEND == 2 and SELECT:
                _fill_none(key_rows, cnt, R, CAP, CHUNK)
                tl.debug_barrier()
            t1 = _clock(PROFILE, WHILE_LOOPS)
            c_setup += t1 - t0
            cnt, cnt_g, reg0, F, thr, b_max, c_cmp, n_cmp, n_seg_run = _key_loop(
                n_tiles, lo, hi, kk, k_src, b_qT, b_w, b_start, b_end, cnt, cnt_g, reg0, F, thr, b_max, key_rows,
                idx_rows, m_t, o_n, o_d, m_d, H, D, R, BLOCK_N, CAP, CHUNK, MIN_FREE, RELU, SELECT, IEEE,
                WHILE_LOOPS, SEARCH2, APPEND, LANE_ROWS=LANE_ROWS, LAZY_MAX=LAZY_MAX, RAW=RAW, KTH=KTH,
                ABLATE=ABLATE, BALLOT=BALLOT, PROFILE=PROFILE, K_TMA=K_TMA, c_cmp=c_cmp, n_cmp=n_cmp,
                n_seg_run=n_seg_run, SPLIT=SELECT_SPLIT, key_base=key_base, idx_base=idx_base)
            if PROFILE:
                tl.debug_barrier()
                c_loop += _clock(PROFILE, WHILE_LOOPS) - t1

        t0 = _clock(PROFILE, WHILE_LOOPS)
        if SELECT and (ABLATE % 2 == 1):
            tl.debug_barrier()  # ablation: no final select, no output (the next row block reuses the scratch)
        elif SELECT:
            tl.debug_barrier()
            o_out = o_t.to(tl.int64) * kk  # [R] output row offsets
            _select_store_rows(key_rows, idx_rows, cnt, kk, out_val_ptr + o_out, out_idx_ptr + o_out, m_t,
                               True, WRITE_SCORES, R, CAP, CHUNK, SEARCH2, RAW, cnt_g, APPEND == 2, KTH,
                               HW=not WHILE_LOOPS, PROFILE=PROFILE, prof_ptr=prof_ptr, SPLIT=SELECT_SPLIT,
                               key_base=key_base, idx_base=idx_base)
            # -1 / -inf padding after the kept entries
            n_keep = tl.minimum(_n_buffered(cnt, cnt_g, APPEND == 2), kk)  # [R]
            o_h = tl.arange(0, CHUNK)
            if tl.min(tl.where(m_t, n_keep, kk), axis=0) < kk:  # some row has fewer than kk keys
                for i_c in range(0, CAP, CHUNK):
                    o_cc = i_c + o_h  # [CHUNK]
                    m_pad = (o_cc[None, :] >= n_keep[:, None]) & (o_cc[None, :] < kk) & m_t[:, None]
                    tl.store(out_idx_ptr + o_out[:, None] + o_cc[None, :], tl.full([R, CHUNK], -1, tl.int32),
                             mask=m_pad)
                    if WRITE_SCORES:
                        tl.store(out_val_ptr + o_out[:, None] + o_cc[None, :],
                                 tl.full([R, CHUNK], float("-inf"), tl.float32), mask=m_pad)
            tl.debug_barrier()  # the next row block reuses the scratch
        else:
            if LAZY_MAX:
                tl.store(out_val_ptr + o_t, tl.max(b_max, axis=0), mask=m_t)
            else:
                tl.store(out_val_ptr + o_t, b_max, mask=m_t)
        if PROFILE:
            c_final += _clock(PROFILE, WHILE_LOOPS) - t0
            n_blk += 1
        i_w += n_p
    if PROFILE:
        tl.atomic_add(prof_ptr + P_TOTAL, _clock(PROFILE, WHILE_LOOPS) - t_start)
        tl.atomic_add(prof_ptr + P_SETUP, c_setup)
        tl.atomic_add(prof_ptr + P_SAMPLE, c_smp)
        tl.atomic_add(prof_ptr + P_WSEL, c_wsel)
        tl.atomic_add(prof_ptr + P_LOOP, c_loop)
        tl.atomic_add(prof_ptr + P_CMP, c_cmp)
        tl.atomic_add(prof_ptr + P_RERUN, c_rerun)
        tl.atomic_add(prof_ptr + P_FINAL, c_final)
        tl.atomic_add(prof_ptr + P_BLOCKS, n_blk)
        tl.atomic_add(prof_ptr + P_NCMP, n_cmp)
        tl.atomic_add(prof_ptr + P_NSEG, n_seg_run)
