"""Decode attention: one new query per sequence against its KV cache, at any batch size.

One kernel serves every batch (a decode step's arithmetic is then the same whatever decodes
beside a sequence, and so are its logits): a block takes one KV head of one sequence, all the
query heads of that KV head as the rows of one tile (grouped-query attention reads each key
once for the group, where a block a query head re-read GLM-ASR's cache four times from L2),
and one chunk of CHUNK_KEYS cached keys, flash style on tensor cores. Only the chunks holding
the sequence's own keys, kv_start[b] up to the cache length, do anything (the grid covers the
whole cache, the others exit at once), so a row costs what its keys do wherever it sits in the
cache. With more than one chunk, each writes its partial softmax state and the last block of
the head to finish (an atomic count) merges them in chunk order: the result is the same on
every run. Once the (sequence, KV head) pairs fill the SMs a block folds two chunks itself, in
the same order and arithmetic (chunks_a_block): the same bits, fewer blocks and merges.

decode_attention feeds it straight from the new token's fused QKV projection: RoPE on q and the
new key (on halves of channels where it turns all: the first key tile's load then waits for the
row's length only), the new key and value stored at their slot and folded in from registers (its
score summed exactly: row_dot), in the same launch (a decode step has no split_qkv kernel).
Keys and values may be bfloat16; at precision 'medium' such a cache's products take q and the
probabilities in bfloat16 (as flash attention does) and the result may be stored in bfloat16
for the o projection.
"""
from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import (backend, check, inputs_ready, last_block_counters, last_in_group, launch, reset_count,
                      sm_count)
from .activations import fast_div
from .precision import BF16 as BF16_MMA, TF32, TF32X3, mma, mma_mode, operand
from .qkv import check_fused_qkv, rope_rows, split_qkv_reference
from .rope import rotate_half, rotate_half_tile
from .weights import empty, f32, like, narrow, result_dtype
from .interop import any_array

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
LOG2E = 1.0 / math.log(2.0)
NEG_INF = -float("inf")
CHUNK_KEYS = 256        # cached keys a block folds in


def tile_keys(d: int, itemsize: int, mode: int = TF32) -> int:
    """Keys a tile: 16 KB of keys as stored, at most 64 bfloat16 ones (D = 128 tiles of 128
    float32 keys spilled registers). 16 at 'highest' (TF32X3): 32-key tiles at D = 128 came out
    wrong there (relative error 0.2-0.7; 16 keys: 1e-6). BF16 mode (a bfloat16 cache at
    'medium'): square tiles up to 32 KB (GLM-ASR's 128 keys, gpt2's 64)."""
    if mode == TF32X3:
        return 16
    if mode == BF16_MMA:
        return max(16, min(d, 32768 // (d * 2)))
    if itemsize == 2:
        return max(16, min(64, 16384 // (d * 2)))
    return max(16, 16384 // (d * 4))


def group_rows(group: int) -> int:
    """Rows of the query tile: the group's heads, at least 16 (an mma's width)."""
    return max(16, 1 << max(0, group - 1).bit_length())


def online_softmax_step(s, v, m, l, acc, MMA):
    """Fold one key tile (scores s, log2 units, masked entries -inf; values v (TILE_N, D), as
    the mma takes them) into the running row max m, sum l and output acc; a row with no visible
    key so far stays at (-inf, 0, 0). In BF16 mode the probabilities enter the product rounded
    to bfloat16 (the sum l keeps them unrounded)."""
    m_new = ct.maximum(m, ct.max(s, axis=1, keepdims=True))
    m_safe = ct.where(m_new == NEG_INF, 0.0, m_new)
    p = ct.exp2(s - m_safe)
    alpha = ct.exp2(m - m_safe)
    acc = mma(ct.astype(p, ct.bfloat16) if MMA == BF16_MMA else p, v, acc * alpha, MMA)
    return m_new, l * alpha + ct.sum(p, axis=1, keepdims=True), acc


def fold_tile(K, V, qm, qm2, m, l, acc, b, kvh, j, kstart, tk, scale_log2: float, D: int, TILE_G: int,
              TILE_N: int, MMA: int, SPLIT: bool):
    """Tile helper: the softmax state (m, l, acc) with key tile j (TILE_N keys from key j * TILE_N) of
    the row's cached keys kstart .. tk - 1 folded in; SPLIT: q as two halves of channels (qm, qm2)."""
    k = operand(ct.reshape(ct.load(K, index=(b, kvh, 0, j), shape=(1, 1, D, TILE_N), order=(0, 1, 3, 2),
                                   padding_mode=ct.PaddingMode.ZERO), (D, TILE_N)), MMA)
    v = operand(ct.reshape(ct.load(V, index=(b, kvh, j, 0), shape=(1, 1, TILE_N, D),
                                   padding_mode=ct.PaddingMode.ZERO), (TILE_N, D)), MMA)
    if SPLIT:
        ka = ct.extract(k, (0, 0), shape=(D // 2, TILE_N))
        kb = ct.extract(k, (1, 0), shape=(D // 2, TILE_N))
        s = mma(qm2, kb, mma(qm, ka, ct.full((TILE_G, TILE_N), 0.0, dtype=ct.float32), MMA), MMA) * scale_log2
    else:
        s = mma(qm, k, ct.full((TILE_G, TILE_N), 0.0, dtype=ct.float32), MMA) * scale_log2
    # masks on every tile in TF32 mode (only past the row's ends: GLM-ASR at batch 64 47.1 ->
    # 50.4 us there), on the tiles past the row's ends in BF16 mode (measured so)
    if MMA != BF16_MMA or ((j + 1) * TILE_N > tk) | (j * TILE_N < kstart):
        cols = ct.arange(TILE_N, dtype=ct.int32)[None, :]
        keys = ct.arange(TILE_N, dtype=ct.int32)[:, None]
        s = ct.where((j * TILE_N + cols < tk) & (j * TILE_N + cols >= kstart), s, NEG_INF)
        # slots outside the row's keys weigh 0; their values (stale, or never written) must not reach acc
        v = ct.where((j * TILE_N + keys < tk) & (j * TILE_N + keys >= kstart), v,
                     ct.full((TILE_N, D), 0.0, dtype=v.dtype))
    return online_softmax_step(s, v, m, l, acc, MMA)


def chunk_state(K, V, qm, qm2, b, kvh, lo, hi, kstart, tk, scale_log2: float, D: int, TILE_G: int, TILE_N: int,
                MMA: int, SPLIT: bool):
    """Tile helper: the softmax state (m, l, acc; log2 units) of the query tile qm over key
    tiles lo .. hi - 1 of the row's cached keys kstart .. tk - 1. In BF16 mode a row's last tile
    is read at half width where its keys fit (a 30 s window's ~420 keys: 448 read, not 512); it
    depends on the row's own length, so a row's bits do not depend on the rows beside it."""
    m = ct.full((TILE_G, 1), NEG_INF, dtype=ct.float32)
    l = ct.full((TILE_G, 1), 0.0, dtype=ct.float32)
    acc = ct.full((TILE_G, D), 0.0, dtype=ct.float32)
    HALF_N = TILE_N // 2
    full = hi
    if MMA == BF16_MMA:
        if (hi > lo) & (hi * TILE_N >= tk) & (tk - (hi - 1) * TILE_N <= HALF_N):
            full = hi - 1
    for j in range(lo, full):
        m, l, acc = fold_tile(K, V, qm, qm2, m, l, acc, b, kvh, j, kstart, tk, scale_log2, D, TILE_G, TILE_N, MMA,
                              SPLIT)
    if MMA == BF16_MMA:
        if full < hi:
            m, l, acc = fold_tile(K, V, qm, qm2, m, l, acc, b, kvh, 2 * full, kstart, tk, scale_log2, D, TILE_G,
                                  HALF_N, MMA, SPLIT)
    return m, l, acc


def exact_grid(top):
    """Tile helper: (2^(44 - e), 2^(e - 44)) for e the exponent of top: the fixed-point grid
    row_dot cuts products on."""
    e = ct.bitwise_rshift(ct.bitcast(ct.maximum(top, 1e-200), ct.int64), 52)       # its biased exponent
    return (ct.bitcast(ct.bitwise_lshift(2090 - e, 52), ct.float64),
            ct.bitcast(ct.bitwise_lshift(e - 44, 52), ct.float64))


def exact_products(a, b):
    """Tile helper: a * b in float64 (exact for float32 values)."""
    return ct.astype(a, ct.float64) * ct.astype(b, ct.float64)


def exact_sums(p, up):
    """Tile helper: p's row sums on exact_grid's grid (whole numbers: exact in any order)."""
    return ct.sum(ct.floor(p * up), axis=1, keepdims=True)


def row_dot(a, b):
    """Tile helper: the row sums of a * b (float32) with the same bits whatever order they add
    in: the products, exact in float64, cut to multiples of 2^-44 of the row's largest power of
    two, add exactly. (A float32 sum adds in its register layout's order, which differs between
    the kernel's copies: gpt2's heads gave other bits at two blocks an SM than at four.)"""
    p = exact_products(a, b)
    up, down = exact_grid(ct.max(ct.abs(p), axis=1, keepdims=True))
    return ct.astype(exact_sums(p, up) * down, ct.float32)


def row_dot2(a, b, a2, b2):
    """Tile helper: row_dot of the rows (a, a2) . (b, b2), their channels in two halves: the
    same bits (one grid, that of both halves' largest product; every sum exact)."""
    p, p2 = exact_products(a, b), exact_products(a2, b2)
    up, down = exact_grid(ct.maximum(ct.max(ct.abs(p), axis=1, keepdims=True),
                                     ct.max(ct.abs(p2), axis=1, keepdims=True)))
    return ct.astype((exact_sums(p, up) + exact_sums(p2, up)) * down, ct.float32)


def head_rows(A, b, kvh, rows: int, width: int, part):
    """Tile helper: rows x width channels of A[b, kvh] from channel part * width: the group's
    query heads (padded with zeros to the tile's rows), or the new key or value (one row)."""
    if rows == 1:
        return ct.reshape(ct.load(A, index=(b, kvh, 0, part), shape=(1, 1, 1, width), allow_tma=False), (1, width))
    return ct.reshape(ct.load(A, index=(b, kvh, 0, part), shape=(1, 1, rows, width), padding_mode=ct.PaddingMode.ZERO,
                              allow_tma=False), (rows, width))


def merge_state(m, l, acc, ms, ls, os):
    """Tile helper: state (m, l, acc) with the next chunk's (ms, ls, os) folded in. From the
    empty state (-inf, 0, 0) it gives the chunk's own bits, so a row's chunks fold to one
    result whether one block takes them all or a block each."""
    m_new = ct.maximum(m, ms)
    a, w = ct.exp2(m - m_new), ct.exp2(ms - m_new)
    return m_new, l * a + ls * w, acc * a + os * w


@kernel
def decode_kernel(Q, K, V, KN, VN, O, PO, PM, PL, C, KS, KL, COS, SIN, scale_log2: float, tiles_per_chunk: int,
                  chunks_per_block: int, D: ConstInt, HALF: ConstInt, TILE_G: ConstInt, TILE_N: ConstInt,
                  MMA: ConstInt, NEW: ConstBool, ROPE: ConstBool, ROWS: ConstBool):
    """Query heads Q[b, kvh] (B, Hkv, G, D), padded to TILE_G rows, against chunks
    bid(1) * chunks_per_block onwards of their KV head's cached keys: slots KS[b] .. KL[0] - 1.
    Chunks fold with the merge's arithmetic in one order, pairs (2i, 2i + 1) first, then pair
    after pair, so one block a chunk (the head's last block merges the others' partial states)
    and one block a pair of chunks (chunks_per_block 2, for full grids) give the same bits, from the
    same code. NEW: KL[0] is also the new token's slot; KN, VN (B, Hkv, 1, D) are its key and value
    from the fused projection (as Q is), rotated with q (ROPE: tables COS, SIN (1, P, HALF) at
    position KL[0] - KS[b]; where 2 * HALF = D on halves of channels loaded apart, in registers
    where 2 * HALF is a power of two, else the partner channels gathered), folded into the last
    chunk, whose block stores them at slot KL[0] (rounded to bfloat16 first for a bfloat16 cache,
    and attended to as stored). O (B, Hkv, G, D); partial states PO (B, Hkv, blocks, TILE_G, D), PM,
    PL (B, Hkv, blocks, TILE_G) in log2 units, merged by the head's last block (counted in
    C[bid(0)], set back to zero after). ROWS: KL (B,) holds each row's own length (its keys at slots
    0 .. KL[b] - 1, the engine's slots; KS unused), so chunks and tiles split a row's keys at the
    same places wherever and whenever it runs."""
    bh = ct.bid(0)
    blk = ct.bid(1)
    b = bh // K.shape[1]
    kvh = bh % K.shape[1]
    inputs_ready()
    # RoPE over all channels on halves of channels: whole tiles rotated through shared memory, and
    # the first key tile's load waited for that (SASS; GLM-ASR at 64 rows 29.8 -> 27.8 us alone)
    SPLIT = ROPE and 2 * HALF == D
    DH = D // 2
    # q and the new key and value load with the row's length: one round trip, not two (SASS)
    W = DH if SPLIT else D
    q = q2 = head_rows(Q, b, kvh, TILE_G, W, 0)
    if SPLIT:
        q2 = head_rows(Q, b, kvh, TILE_G, W, 1)
    kn = kn2 = head_rows(KN, b, kvh, 1, W, 0)
    if SPLIT:
        kn2 = head_rows(KN, b, kvh, 1, W, 1)
    vn = head_rows(VN, b, kvh, 1, D, 0)
    if ROWS:
        tk = ct.astype(ct.load(KL, index=(b,), shape=()), ct.int32)
        kstart = 0
    else:
        tk = ct.load(KL, index=(0,), shape=())
        kstart = ct.load(KS, index=(b,), shape=())
    span = TILE_N * tiles_per_chunk
    last_key = tk if NEW else max(tk - 1, 0)
    last = last_key // span
    first = min(kstart // span, last)
    lo = max(blk * chunks_per_block, first)            # this block's chunks: lo .. hi
    hi = min((blk + 1) * chunks_per_block - 1, last)
    if lo <= hi:
        rows = ct.arange(TILE_G, dtype=ct.int32)[:, None]
        c = ct.arange(D, dtype=ct.int32)[None, :]
        position = max(tk - kstart, 0)
        if SPLIT:
            f = ct.arange(DH, dtype=ct.int32)[None, :]
            cos, sin = ct.gather(COS, (0, position, f)), ct.gather(SIN, (0, position, f))
            q, q2 = q * cos - q2 * sin, q2 * cos + q * sin
            kn, kn2 = kn * cos - kn2 * sin, kn2 * cos + kn * sin
        elif ROPE:
            if ((2 * HALF) & (2 * HALF - 1)) == 0:      # padding rows of q are zeros, rotated to zeros
                f = ct.arange(HALF, dtype=ct.int32)[None, :]
                cos, sin = ct.gather(COS, (0, position, f)), ct.gather(SIN, (0, position, f))
                q, kn = rotate_half_tile(q, cos, sin, HALF), rotate_half_tile(kn, cos, sin, HALF)
            else:
                q = rotate_half(Q, q, b, kvh, ct.minimum(rows, Q.shape[2] - 1), c, COS, SIN, 0, position, HALF)
                kn = rotate_half(KN, kn, b, kvh, 0, c, COS, SIN, 0, position, HALF)
        if K.dtype == ct.uint16:        # a bfloat16 cache: attend to the new key as it is stored
            kn, kn2, vn = f32(narrow(kn)), f32(narrow(kn2)), f32(narrow(vn))
        qm, qm2 = q, q2
        if MMA == BF16_MMA:     # q as the products take it (the new key's score below too)
            qm, qm2 = ct.astype(q, ct.bfloat16), ct.astype(q2, ct.bfloat16)
            q, q2 = f32(qm), f32(qm2)
        if SPLIT:               # the new key's score (used by the last chunk's block)
            sn = row_dot2(q, kn, q2, kn2) * scale_log2
        else:
            sn = row_dot(q, kn) * scale_log2
        m = ct.full((TILE_G, 1), NEG_INF, dtype=ct.float32)
        l = ct.full((TILE_G, 1), 0.0, dtype=ct.float32)
        acc = ct.full((TILE_G, D), 0.0, dtype=ct.float32)
        for s_ in range(lo, hi + 1):
            ms, ls, os = chunk_state(K, V, qm, qm2, b, kvh, max(s_ * tiles_per_chunk, kstart // TILE_N),
                                     min((s_ + 1) * tiles_per_chunk, ct.cdiv(tk, TILE_N)), kstart, tk, scale_log2,
                                     D, TILE_G, TILE_N, MMA, SPLIT)
            if NEW:
                if s_ == last:
                    m_new = ct.maximum(ms, sn)
                    alpha = ct.exp2(ms - m_new)
                    p = ct.exp2(sn - m_new)
                    ms, ls, os = m_new, ls * alpha + p, os * alpha + p * vn
            m, l, acc = merge_state(m, l, acc, ms, ls, os)
        if NEW:
            if hi == last:
                if SPLIT:
                    ct.store(K, index=(b, kvh, tk, 0), tile=ct.reshape(like(K, kn), (1, 1, 1, DH)), allow_tma=False)
                    ct.store(K, index=(b, kvh, tk, 1), tile=ct.reshape(like(K, kn2), (1, 1, 1, DH)), allow_tma=False)
                else:
                    ct.store(K, index=(b, kvh, tk, 0), tile=ct.reshape(like(K, kn), (1, 1, 1, D)), allow_tma=False)
                ct.store(V, index=(b, kvh, tk, 0), tile=ct.reshape(like(V, vn), (1, 1, 1, D)), allow_tma=False)
        g_first, g_last = first // chunks_per_block, last // chunks_per_block
        if g_first == g_last:
            ct.store(O, index=(b, kvh, 0, 0), tile=ct.reshape(like(O, acc * fast_div(1.0, l)), (1, 1, TILE_G, D)),
                     allow_tma=False)
        else:
            ct.store(PO, index=(b, kvh, blk, 0, 0), tile=ct.reshape(acc, (1, 1, 1, TILE_G, D)), allow_tma=False)
            ct.store(PM, index=(b, kvh, blk, 0), tile=ct.reshape(m, (1, 1, 1, TILE_G)), allow_tma=False)
            ct.store(PL, index=(b, kvh, blk, 0), tile=ct.reshape(l, (1, 1, 1, TILE_G)), allow_tma=False)
            if last_in_group(C, bh, g_last - g_first + 1):
                own_m, own_l, own_acc = m, l, acc
                m = ct.full((TILE_G, 1), NEG_INF, dtype=ct.float32)
                l = ct.full((TILE_G, 1), 0.0, dtype=ct.float32)
                acc = ct.full((TILE_G, D), 0.0, dtype=ct.float32)
                gm, gl, gacc = m, l, acc
                for g_ in range(g_first, g_last + 1):     # in order: the same sum on every run
                    ms, ls, os = own_m, own_l, own_acc  # its own state from registers (linear.skinny_kernel)
                    if g_ != blk:
                        ms = ct.reshape(ct.load(PM, index=(b, kvh, g_, 0), shape=(1, 1, 1, TILE_G),
                                                allow_tma=False), (TILE_G, 1))
                        ls = ct.reshape(ct.load(PL, index=(b, kvh, g_, 0), shape=(1, 1, 1, TILE_G),
                                                allow_tma=False), (TILE_G, 1))
                        os = ct.reshape(ct.load(PO, index=(b, kvh, g_, 0, 0), shape=(1, 1, 1, TILE_G, D),
                                                allow_tma=False), (TILE_G, D))
                    # chunks fold in pairs (2i, 2i + 1), as a block of two folds them, then pair after pair
                    if (g_ * chunks_per_block) % 2 == 0 or g_ == g_first:
                        gm, gl, gacc = ms, ls, os
                    else:
                        gm, gl, gacc = merge_state(gm, gl, gacc, ms, ls, os)
                    if ((g_ + 1) * chunks_per_block) % 2 == 0 or g_ == g_last:
                        m, l, acc = merge_state(m, l, acc, gm, gl, gacc)
                ct.store(O, index=(b, kvh, 0, 0), tile=ct.reshape(like(O, acc * fast_div(1.0, l)),
                                                                  (1, 1, TILE_G, D)), allow_tma=False)
                reset_count(C, bh)


# Blocks an SM, chosen by the grid's size (the arithmetic is the same whatever the hint). A
# bfloat16 cache: one block an SM while the pairs take at most half the SMs, else two; at D <= 64
# four there and past two pairs an SM (that copy compiles without the others' register spills:
# docs/performance.md). A float32 cache keeps one (at two the merged output at D = 128 came out
# wrong now and then under tileiras 13.4.92).
decode_kernel_occupancy2 = decode_kernel.replace_hints(occupancy=2)
decode_kernel_occupancy4 = decode_kernel.replace_hints(occupancy=4)


def chunks_a_block(pairs: int, sms: int) -> int:
    """Chunks of a (sequence, KV head) pair a block folds: one while the pairs leave SMs idle,
    two (the kernel's pairs of chunks: the same bits) once they fill them: fewer blocks and
    merges."""
    return 2 if pairs >= sms else 1


def decode_kernel_for(itemsize: int, d: int, pairs: int, sms: int):
    """The decode kernel's copy (blocks an SM) for a cache of itemsize bytes a value, head dim d,
    `pairs` (sequence, KV head) pairs in the grid and sms multiprocessors."""
    if itemsize == 4:
        return decode_kernel
    if d <= 64 and (2 * pairs <= sms or pairs > 2 * sms):
        return decode_kernel_occupancy4
    return decode_kernel if 2 * pairs <= sms else decode_kernel_occupancy2


def decode_cupy(q, k, v, kv_start, kv_len, scale_log2: float, new=None, rope=None, rows: bool = False,
                out_dtype=np.float32):
    """Decode attention (B, Hq, 1, D) for queries q, a (B, Hkv, G, D) view of the group's
    heads; k, v the cache (B, Hkv, T_max, D). new: the new token's (k, v), (B, Hkv, 1, D) views,
    stored at slot kv_len[0] and attended to after the kv_len[0] cached keys (rows: kv_len[b],
    each row's own length, keys from slot 0). rope (with new): (cos, sin, half), tables
    (1, P, half) rotating q and the new key. The result in out_dtype: float32, or bfloat16 for a
    product that rounds its input so."""
    import cupy

    bsz, hkv, group, d = q.shape
    t_max = k.shape[2]
    mode = mma_mode(k.dtype)
    tile_n = tile_keys(d, k.dtype.itemsize, mode)
    per = max(1, CHUNK_KEYS // tile_n)
    chunks = -(-t_max // (tile_n * per))
    tile_g = group_rows(group)
    out = empty(cupy, (bsz, hkv, group, d), out_dtype)
    po = cupy.empty((bsz, hkv, chunks, tile_g, d), dtype=cupy.float32)     # partial states (unused at 1 chunk)
    pm = cupy.empty((bsz, hkv, chunks, tile_g), dtype=cupy.float32)
    pl = cupy.empty_like(pm)
    counters = last_block_counters(bsz * hkv)
    kn, vn = new if new is not None else (q, q)
    cos, sin, half = rope if rope is not None else (q, q, 0)
    per_block = chunks_a_block(bsz * hkv, sm_count())
    launch((bsz * hkv, -(-chunks // per_block), 1), decode_kernel_for(k.dtype.itemsize, d, bsz * hkv, sm_count()),
           (q, k, v, kn, vn, out, po, pm, pl, counters, kv_start, kv_len, cos, sin, scale_log2, per, per_block, d, half,
            tile_g, tile_n, mode, new is not None, rope is not None, rows))
    return out.reshape(bsz, hkv * group, 1, d)


@any_array
def decode_attention(qkv, k_cache, v_cache, start, heads: int, scale: float | None = None, kv_start=None,
                     cos=None, sin=None, rotary_dim: int | None = None, lengths=None, out_dtype=np.float32):
    """Attention (B, Hq, 1, D) of one new token per sequence over its KV cache, from its fused
    projection qkv (B, 1, (Hq + 2 Hkv) D): what split_qkv then attention compute, in one
    kernel.

    The token's k, v are stored at slot start[0] of k_cache, v_cache (B, Hkv, T_max, D),
    float32 or bfloat16 (rotated by RoPE with q, when cos, sin are given) and q attends to
    slots kv_start[b] .. start[0]. start: int32 (1,), read on the device (a captured graph
    serves every step). cos, sin: tables (P, rotary_dim/2) by position, e.g.
    rope_cos_sin(arange(P)); the token of sequence b sits at position start[0] - kv_start[b].
    lengths (B,) int64 instead: each row's own length, its keys at slots 0 .. lengths[b] - 1 and
    its token at slot and position lengths[b] (start and kv_start unused): the engine's slots.
    D must be a power of two up to 256 on the GPU. out_dtype: float32, or bfloat16 (the o
    projection's input at precision 'medium', which rounds it so anyway).
    """
    from .attention import attention_reference

    kind = backend(qkv=qkv, k_cache=k_cache, v_cache=v_cache, start=start, kv_start=kv_start, cos=cos, sin=sin,
                   lengths=lengths)
    kv_start, rotary_dim = check_fused_qkv(qkv, k_cache, v_cache, start, heads, kv_start, cos, sin, rotary_dim)
    bsz, t, _ = qkv.shape
    _, hkv, t_max, d = k_cache.shape
    if t != 1:
        raise ValueError(f"qkv: expected one new token per sequence (B, 1, width), got shape {tuple(qkv.shape)}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if lengths is not None:
        check("lengths", lengths, shape=(bsz,), dtype=np.int64)
    out_dtype = result_dtype(out_dtype)
    if kind == "numpy" and lengths is not None:
        if not np.all((0 <= lengths) & (lengths < t_max)):       # checked before any row's cache is written
            raise ValueError(f"lengths: each must be from 0 to {t_max - 1} (a cache of {t_max}), got {lengths}")
        return np.concatenate([decode_attention(qkv[b:b + 1], k_cache[b:b + 1], v_cache[b:b + 1],
                                                np.array([n], np.int32), heads, scale, None, cos, sin, rotary_dim,
                                                out_dtype=out_dtype)
                               for b, n in enumerate(np.asarray(lengths))])
    if kind == "numpy":
        s = int(start[0])
        if not 0 <= s < t_max:
            raise ValueError(f"start: slot {s} is outside a cache of {t_max}")
        q = split_qkv_reference(qkv, k_cache, v_cache, s, heads, *rope_rows(cos, sin, s, 1, kv_start), rotary_dim)
        return attention_reference(q, k_cache[:, :, :s + 1], v_cache[:, :, :s + 1], True, scale,
                                   kv_start).astype(out_dtype)
    if d & (d - 1) or d > 256:
        raise ValueError(f"k_cache: head dim must be a power of two up to 256 on the GPU, got {d}")
    x = qkv.reshape(bsz, heads + 2 * hkv, d)
    q = x[:, :heads].reshape(bsz, hkv, heads // hkv, d)
    new = (x[:, heads:heads + hkv, None], x[:, heads + hkv:, None])
    rope = (cos[None], sin[None], rotary_dim // 2) if cos is not None else None
    rows = lengths is not None
    return decode_cupy(q, k_cache, v_cache, kv_start, lengths if rows else start, float(scale) * LOG2E, new=new,
                       rope=rope, rows=rows, out_dtype=out_dtype)
