"""Scaled dot-product attention, flash style (online softmax, no T x T matrix).

q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) with Hq a multiple of Hkv (grouped-query).
Causal attention is aligned to the end: query i sees keys 0..Tk-Tq+i, which covers
full prefill (Tq = Tk), chunked prefill and decode. Key tiles entirely above the
diagonal are never visited; only tiles that cross it (or the ragged end) are masked.
k/v may be views into a longer KV cache (unit stride on the last axis only).

Tq = 1 (decode) takes a split-KV path: the key range is cut into chunks processed by
separate blocks, one query head each, in fp32 on CUDA cores (one query row would fill a
sixteenth of a tensor-core tile), so a single query still fills the GPU; the last block of
a head to finish, counted with an atomic, merges the partial softmax states (a one-chunk
plan is normalised in place). (The tensor-core kernel over all query heads of a KV head was
tried and measured slower.)

decode_attention is that decode path fed straight from the new token's fused QKV
projection: RoPE, the KV-cache write and the split-KV attention in one kernel, the cached
keys' first tile requested before the kernel waits for its inputs.
"""
from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from ._arrays import (array_module, backend, check, inputs_ready, last_block_counters, last_in_group, launch,
                      next_pow2, release_dependents, reset_count, sm_count, wait_for_inputs)
from .activations import fast_div
from .precision import precise, tf32_mma
from .qkv import check_fused_qkv, rope_rows, split_qkv_reference
from .rope import rotate_half

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
LOG2E = 1.0 / math.log(2.0)
NEG_INF = -float("inf")
MAX_SPLITS = 64     # the merging block holds all splits of one head in one tile
MAX_CHUNK_TILES = 8     # batched or long caches: more chunks rather than longer serial loops


def visible_keys(tq: int, tk: int, causal: bool, kv_start: np.ndarray) -> np.ndarray:
    """(B, 1, Tq, Tk) mask: the keys each query attends to (the spec the kernels follow).

    Keys before kv_start[b] are left padding: hidden from real queries; padding queries
    (positions before kv_start[b]) see them, so no row is ever empty.
    """
    key = np.arange(tk)[None, None, None, :]
    row = (np.arange(tq) + tk - tq)[None, None, :, None]
    start = np.asarray(kv_start).reshape(-1, 1, 1, 1)
    ok = (key >= start) | (row < start)
    return ok & (key <= row) if causal else ok


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool,
                        scale: float, kv_start: np.ndarray) -> np.ndarray:
    group = q.shape[1] // k.shape[1]
    k64 = np.repeat(k.astype(np.float64), group, axis=1)
    v64 = np.repeat(v.astype(np.float64), group, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k64) * scale
    s = np.where(visible_keys(q.shape[2], k.shape[2], causal, kv_start), s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", s, v64).astype(np.float32)


def online_softmax_step(s, v, m, l, acc, PRECISE):
    """Fold one key tile (scores s, log2 units, masked entries -inf; values v (TILE_N, D))
    into the running row max m, sum l and output acc; a row with no visible key so far stays
    at (-inf, 0, 0)."""
    m_new = ct.maximum(m, ct.max(s, axis=1, keepdims=True))
    m_safe = ct.where(m_new == NEG_INF, 0.0, m_new)
    p = ct.exp2(s - m_safe)
    alpha = ct.exp2(m - m_safe)
    acc = tf32_mma(p, v, acc * alpha, PRECISE)
    return m_new, l * alpha + ct.sum(p, axis=1, keepdims=True), acc


@ct.kernel
def flash_kernel(Q, K, V, O, KS, scale_log2: float, group: int,
                 D: ConstInt, TILE_M: ConstInt, TILE_N: ConstInt, CAUSAL: ConstBool, PRECISE: ConstBool):
    """One TILE_M block of queries of one (batch, head) against all visible keys; O is
    (B, Tq, Hq, D), the layout the output projection reads."""
    inputs_ready()
    mt = ct.bid(0)
    b = ct.bid(1) // Q.shape[1]
    h = ct.bid(1) % Q.shape[1]
    kvh = h // group
    tk = K.shape[2]
    offset = tk - Q.shape[2]
    q = ct.load(Q, index=(b, h, mt, 0), shape=(1, 1, TILE_M, D), padding_mode=ct.PaddingMode.ZERO)
    q = ct.reshape(q, (TILE_M, D))
    kstart = ct.load(KS, index=(b,), shape=())
    rows = offset + mt * TILE_M + ct.arange(TILE_M, dtype=ct.int32)[:, None]
    cols = ct.arange(TILE_N, dtype=ct.int32)[None, :]
    if CAUSAL:
        end = min(tk, offset + (mt + 1) * TILE_M)
        unmasked = min(tk, offset + mt * TILE_M + 1) // TILE_N
    else:
        end = tk
        unmasked = tk // TILE_N
    m = ct.full((TILE_M, 1), NEG_INF, dtype=ct.float32)
    l = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((TILE_M, D), 0.0, dtype=ct.float32)
    for j in range(ct.cdiv(end, TILE_N)):
        k = ct.load(K, index=(b, kvh, 0, j), shape=(1, 1, D, TILE_N), order=(0, 1, 3, 2),
                    padding_mode=ct.PaddingMode.ZERO)
        s = tf32_mma(q, ct.reshape(k, (D, TILE_N)), ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32),
                     PRECISE) * scale_log2
        if j >= unmasked or j * TILE_N < kstart:
            key = j * TILE_N + cols
            visible = (key < tk) & ((key >= kstart) | (rows < kstart))
            if CAUSAL:
                visible = visible & (key <= rows)
            s = ct.where(visible, s, NEG_INF)
        v = ct.load(V, index=(b, kvh, j, 0), shape=(1, 1, TILE_N, D), padding_mode=ct.PaddingMode.ZERO)
        m, l, acc = online_softmax_step(s, ct.reshape(v, (TILE_N, D)), m, l, acc, PRECISE)
    # one reciprocal a row: dividing the tile elementwise took the slow division path per element
    ct.store(O, index=(b, mt, h, 0), tile=ct.reshape(acc * fast_div(1.0, l), (1, TILE_M, 1, D)))


def decode_tile(q, k, v, j, m, l, acc, tk, kstart, scale_log2, TILE_N):
    """Fold cached keys j * TILE_N ... into (m, l, acc) of the query row q (1, D), on CUDA
    cores in fp32: keys k and values v (TILE_N, D) as stored, scores (TILE_N, 1) in log2
    units. Keys kstart .. tk - 1 count; slots past tk (stale, or never written) are masked
    in the scores and zeroed in the values."""
    key = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[:, None]
    s = ct.sum(k * q, axis=1, keepdims=True) * scale_log2
    s = ct.where((key < tk) & (key >= kstart), s, NEG_INF)
    m_new = ct.maximum(m, ct.max(s, axis=0, keepdims=True))
    m_safe = ct.where(m_new == NEG_INF, 0.0, m_new)
    p = ct.exp2(s - m_safe)
    alpha = ct.exp2(m - m_safe)
    v = ct.where(key < tk, v, 0.0)
    acc = acc * alpha + ct.sum(p * v, axis=0, keepdims=True)
    return m_new, l * alpha + ct.sum(p, axis=0, keepdims=True), acc


def kv_rows(K, V, b, kvh, j, D, TILE_N):
    """Keys and values j * TILE_N ... as stored, (TILE_N, D) each, in registers (plain loads:
    issued before the dependency wait they are in flight while the kernel waits)."""
    k = ct.load(K, index=(b, kvh, j, 0), shape=(1, 1, TILE_N, D), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)
    v = ct.load(V, index=(b, kvh, j, 0), shape=(1, 1, TILE_N, D), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)
    return ct.reshape(k, (TILE_N, D)), ct.reshape(v, (TILE_N, D))


def merge_chunks(PO, PM, PL, O, b, h, live, D: int, S_TILE: int):
    """O[b, h] = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s over the first `live` chunks
    of one query head (the others hold what earlier launches left; plain loads: they follow
    the acquiring atomic of the caller)."""
    m = ct.load(PM, index=(b, h, 0), shape=(1, 1, S_TILE), padding_mode=ct.PaddingMode.NEG_INF, allow_tma=False)
    l = ct.load(PL, index=(b, h, 0), shape=(1, 1, S_TILE), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)
    o = ct.load(PO, index=(b, h, 0, 0), shape=(1, 1, S_TILE, D), padding_mode=ct.PaddingMode.ZERO,
                allow_tma=False)
    ok = ct.arange(S_TILE, dtype=ct.int32)[:, None] < live
    m = ct.where(ok, ct.reshape(m, (S_TILE, 1)), NEG_INF)
    w = ct.exp2(m - ct.max(m, axis=0, keepdims=True))      # chunks past `live` weigh 0
    total = ct.sum(w * ct.where(ok, ct.reshape(l, (S_TILE, 1)), 0.0), axis=0, keepdims=True)
    out = ct.sum(w * ct.where(ok, ct.reshape(o, (S_TILE, D)), 0.0), axis=0, keepdims=True) * fast_div(1.0, total)
    ct.store(O, index=(b, h, 0, 0), tile=ct.reshape(out, (1, 1, 1, D)), allow_tma=False)


@ct.kernel(occupancy=2)     # 128 registers a thread: two key tiles in flight without spilling
def decode_split_kernel(Q, K, V, KN, VN, PO, PM, PL, O, C, KS, KL, COS, SIN, scale_log2: float, group: int,
                        tiles_per_split: int, half: int, D: ConstInt, TILE_N: ConstInt, S_TILE: ConstInt,
                        FINAL: ConstBool, NEW: ConstBool, ROPE: ConstBool):
    """Partial attention of one query head over one chunk of cached keys, in fp32 on CUDA
    cores (a decode query is a single row, which a tensor-core mma would pad to 16; measured
    faster, tools/sweep_decode_attention.py at 4f7986f). The next key tile is requested before the
    current one is folded in.

    Q, O (B, Hq, 1, D); partial outputs PO (B, Hq, S, D) are unnormalised, with their max PM
    and sum PL (B, Hq, S), in log2 units. KL[0] is the number of cached keys (with the new
    one when not NEW), read on the device so that one captured CUDA graph serves every
    decode step. The grid covers the whole cache, but only the chunks holding keys up to
    KL[0] ("live") do anything: the others exit at once, so a step costs what its keys do,
    not what the cache could hold. One live chunk normalises into O itself; otherwise the
    last live block of a head to finish (counted in C[bid(1)], an acquire-release atomic
    after its partial stores) merges the head's chunks into O and sets its counter back to
    zero: no merge kernel, no kernel boundary. FINAL (a single chunk covers the cache)
    compiles the merge out.
    NEW: KN, VN (B, Hkv, 1, D) are views of the new token's fused projection (Q too); the
    last live chunk folds its key in, and that of the KV head's first query head stores k, v
    at slot KL[0]. Every cached key and KL were then written by an earlier step (whose
    kernels have all finished: see _arrays.full_wait_next), so KL and the chunk's first key
    tile load before the dependency wait. Without NEW the keys may come from the kernel just
    before (split_qkv), so everything loads after it.
    ROPE (with NEW): q and the new key rotate first, cos and sin gathered from the tables
    COS, SIN (1, P, half) at the token's position KL[0] - KS[b].
    """
    split = ct.bid(0)
    b = ct.bid(1) // Q.shape[1]
    h = ct.bid(1) % Q.shape[1]
    kvh = h // group
    j0 = split * tiles_per_split       # < the cache's tiles: splits cover K.shape[2]
    if NEW:
        release_dependents()        # first: the cache length loads before anything else
    else:
        inputs_ready()
    tk = ct.load(KL, index=(0,), shape=())
    last_key = tk if NEW else max(tk - 1, 0)     # NEW: the new key's slot
    live = min(last_key // TILE_N // tiles_per_split + 1, ct.num_blocks(0))
    if split < live:
        kstart = ct.load(KS, index=(b,), shape=())
        k, v = kv_rows(K, V, b, kvh, j0, D, TILE_N)
        if NEW:
            wait_for_inputs()
        j1 = min(j0 + tiles_per_split, ct.cdiv(tk, TILE_N))     # j1 <= j0: an empty chunk, its one tile masked out
        c = ct.arange(D, dtype=ct.int32)[None, :]
        q = ct.reshape(ct.load(Q, index=(b, h, 0, 0), shape=(1, 1, 1, D), allow_tma=False), (1, D))
        kn, vn = q, q
        if NEW:     # requested with q, so the last chunk's wait for them overlaps q's (every chunk loads them)
            kn = ct.reshape(ct.load(KN, index=(b, kvh, 0, 0), shape=(1, 1, 1, D), allow_tma=False), (1, D))
            vn = ct.reshape(ct.load(VN, index=(b, kvh, 0, 0), shape=(1, 1, 1, D), allow_tma=False), (1, D))
        position = max(tk - kstart, 0)
        if ROPE:
            q = rotate_half(Q, q, b, h, 0, c, COS, SIN, 0, position, half)
        m = ct.full((1, 1), NEG_INF, dtype=ct.float32)
        l = ct.full((1, 1), 0.0, dtype=ct.float32)
        acc = ct.full((1, D), 0.0, dtype=ct.float32)
        for j in range(j0 + 1, j1):
            k2, v2 = kv_rows(K, V, b, kvh, j, D, TILE_N)
            m, l, acc = decode_tile(q, k, v, j - 1, m, l, acc, tk, kstart, scale_log2, TILE_N)
            k, v = k2, v2
        m, l, acc = decode_tile(q, k, v, max(j1 - 1, j0), m, l, acc, tk, kstart, scale_log2, TILE_N)
        if NEW:
            if split == live - 1:
                if ROPE:
                    kn = rotate_half(KN, kn, b, kvh, 0, c, COS, SIN, 0, position, half)
                s = ct.sum(q * kn, axis=1, keepdims=True) * scale_log2
                m_new = ct.maximum(m, s)
                alpha = ct.exp2(m - m_new)
                p = ct.exp2(s - m_new)
                m, l, acc = m_new, l * alpha + p, acc * alpha + p * vn
                if h % group == 0:      # one store per KV head; the other heads mask slot tk out
                    ct.store(K, index=(b, kvh, tk, 0), tile=ct.reshape(kn, (1, 1, 1, D)), allow_tma=False)
                    ct.store(V, index=(b, kvh, tk, 0), tile=ct.reshape(vn, (1, 1, 1, D)), allow_tma=False)
        if FINAL or live == 1:
            ct.store(O, index=(b, h, 0, 0), tile=ct.reshape(acc / l, (1, 1, 1, D)), allow_tma=False)
        else:
            ct.store(PO, index=(b, h, split, 0), tile=ct.reshape(acc, (1, 1, 1, D)), allow_tma=False)
            ct.store(PM, index=(b, h, split), tile=ct.reshape(m, (1, 1, 1)), allow_tma=False)
            ct.store(PL, index=(b, h, split), tile=ct.reshape(l, (1, 1, 1)), allow_tma=False)
            if last_in_group(C, ct.bid(1), live):
                merge_chunks(PO, PM, PL, O, b, h, live, D, S_TILE)
                reset_count(C, ct.bid(1))


flash_kernel_occupancy2 = ct.kernel(flash_kernel._pyfunc, occupancy=2)


def flash_plan(d: int, causal: bool):
    """(TILE_M, TILE_N, kernel) of the flash kernel for head dim d, from tools/sweep_attention.py at 4f7986f
    (attention-sweep-h100.json at 4f7986f): a bidirectional 64-wide encoder runs 128-query blocks two to
    an SM (1.8x the 64 x 64 tiles) over 32-key tiles (GLM-ASR's encoder: 76.9 vs 84.4 us for
    64-key tiles, flash-gelu-sweep-h100.json at 4f7986f); causal and 128-wide heads take 128-key tiles."""
    if d == 64 and not causal:
        return 128, 32, flash_kernel_occupancy2
    return (64, 128, flash_kernel) if d <= 128 else (64, 64, flash_kernel)



def decode_tile_keys(d: int) -> int:
    """Keys per decode tile: 4096 elements of a (keys, head dim) tile, 16 KB."""
    return max(1, 4096 // d)


def decode_splits(tk: int, units: int, sms: int = 132, tile_n: int = 64) -> tuple[int, int]:
    """(key tiles per split, number of splits) so that units * splits fills the GPU twice and
    no chunk runs more than MAX_CHUNK_TILES tiles. tk is the cache's capacity: at run time
    only the chunks holding keys do anything (decode_split_kernel).

    tools/sweep_decode_attention.py at 4f7986f: a block's key tiles run one after another, latency
    bound (~1.2 us a tile), so many short chunks and a merge beat long chunks; a cache of
    one tile is one chunk, normalised in place."""
    tiles = -(-tk // tile_n)
    want = min(tiles, MAX_SPLITS, max(1, -(-2 * sms // units), -(-tiles // MAX_CHUNK_TILES)))
    per = -(-tiles // want)
    return per, -(-tiles // per)


def decode_cupy(q, k, v, kv_start, kv_len, scale_log2: float, per: int, splits: int, new=None, rope=None):
    """Decode attention (Tq = 1) in `splits` chunks of `per` key tiles (decode_tile_keys)
    each, merged by the last block of each head (tools time plans through this).

    q (B, Hq, 1, D), may be a strided view. new: the new token's (k, v), (B, Hkv, 1, D)
    views, stored at slot kv_len[0] and attended to after the kv_len[0] cached keys.
    rope (with new): (cos, sin, half), tables (1, P, half) rotating q and the new key.
    """
    import cupy

    bsz, hq, _, d = q.shape
    hkv = k.shape[1]
    out = cupy.empty((bsz, hq, 1, d), dtype=cupy.float32)
    kn, vn = new if new is not None else (q, q)
    cos, sin, half = rope if rope is not None else (q, q, 0)
    if splits == 1:     # the kernel normalises into out itself
        po = pm = pl = q
        counters = kv_len
    else:
        po = cupy.empty((bsz, hq, splits, d), dtype=cupy.float32)
        pm = cupy.empty((bsz, hq, splits), dtype=cupy.float32)
        pl = cupy.empty_like(pm)
        counters = last_block_counters(bsz * hq)
    launch((splits, bsz * hq, 1), decode_split_kernel,
           (q, k, v, kn, vn, po, pm, pl, out, counters, kv_start, kv_len, cos, sin, scale_log2, hq // hkv, per,
            half, d, decode_tile_keys(d), next_pow2(splits), splits == 1, new is not None, rope is not None))
    return out


def _attention_cupy(q, k, v, causal, scale, kv_start, kv_len):
    import cupy

    bsz, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if q.size == 0:
        return cupy.empty_like(q)
    scale_log2 = float(scale) * LOG2E
    if tq == 1:
        if kv_len is None:
            kv_len = cupy.full(1, tk, dtype=cupy.int32)
        return decode_cupy(q, k, v, kv_start, kv_len, scale_log2,
                           *decode_splits(tk, bsz * hq, sm_count(), decode_tile_keys(d)))
    out = cupy.empty((bsz, tq, hq, d), dtype=cupy.float32)
    tm, tn, kernel = flash_plan(d, bool(causal))
    launch((-(-tq // tm), bsz * hq, 1), kernel,
           (q, k, v, out, kv_start, scale_log2, hq // hkv, d, tm, tn, bool(causal), precise()))
    return out.transpose(0, 2, 1, 3)


def attention(q, k, v, causal: bool = False, scale: float | None = None, kv_start=None, kv_len=None):
    """softmax(q k^T * scale [+ causal mask]) v, grouped-query aware.

    q (B, Hq, Tq, D) contiguous; k, v (B, Hkv, Tk, D), unit stride on the last axis.
    kv_start: optional int32 (B,), the first real key of each sequence (left padding).
    kv_len: optional int32 (1,) array, decode only (Tq = 1): only the first kv_len[0] keys
    are valid, the length living in device memory so a captured graph can be replayed.
    D must be a power of two up to 256 on the GPU. scale defaults to 1/sqrt(D).
    Returns (B, Hq, Tq, D); on the GPU a transposed view of a contiguous (B, Tq, Hq, D), so
    heads merge back into (B, Tq, Hq * D) without a copy.
    """
    kind = backend(q=q, k=k, v=v, kv_start=kv_start, kv_len=kv_len)
    check("q", q, ndim=4)
    bsz, hq, tq, d = q.shape
    check("k", k, ndim=4, contiguous=False, inner_contiguous=True)
    check("k", k, shape=(bsz, None, None, d), contiguous=False)
    check("v", v, shape=tuple(k.shape), contiguous=False, inner_contiguous=True)
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"k: query heads ({hq}) must be a multiple of key/value heads ({k.shape[1]})")
    if causal and tq > k.shape[2]:
        raise ValueError(f"q: causal attention needs Tq <= Tk, got Tq={tq}, Tk={k.shape[2]}")
    if kv_start is None:
        kv_start = array_module(q).zeros(bsz, dtype=np.int32)
    check("kv_start", kv_start, shape=(bsz,), dtype=np.int32)
    if kv_len is not None:
        check("kv_len", kv_len, shape=(1,), dtype=np.int32)
        if tq != 1:
            raise ValueError(f"kv_len: only for decode (Tq = 1), got Tq={tq}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if kind == "numpy":
        if kv_len is not None:
            k, v = k[:, :, : int(kv_len[0])], v[:, :, : int(kv_len[0])]
        return attention_reference(q, k, v, causal, scale, kv_start)
    if d & (d - 1) or d > 256:
        raise ValueError(f"q: head dim must be a power of two up to 256 on the GPU, got {d}")
    return _attention_cupy(q, k, v, causal, scale, kv_start, kv_len)


def decode_attention(qkv, k_cache, v_cache, start, heads: int, scale: float | None = None, kv_start=None,
                     cos=None, sin=None, rotary_dim: int | None = None):
    """Attention (B, Hq, 1, D) of one new token per sequence over its KV cache, from its fused
    projection qkv (B, 1, (Hq + 2 Hkv) D): what split_qkv then attention compute, in one
    kernel.

    The token's k, v are stored at slot start[0] of k_cache, v_cache (B, Hkv, T_max, D)
    (rotated by RoPE with q, when cos, sin are given) and q attends to slots kv_start[b] ..
    start[0]. start: int32 (1,), read on the device (a captured graph serves every step).
    cos, sin: tables (P, rotary_dim/2) by position, e.g. rope_cos_sin(arange(P)); the token
    of sequence b sits at position start[0] - kv_start[b]. D must be a power of two up to
    256 on the GPU.
    """
    kind = backend(qkv=qkv, k_cache=k_cache, v_cache=v_cache, start=start, kv_start=kv_start, cos=cos, sin=sin)
    kv_start, rotary_dim = check_fused_qkv(qkv, k_cache, v_cache, start, heads, kv_start, cos, sin, rotary_dim)
    bsz, t, _ = qkv.shape
    _, hkv, t_max, d = k_cache.shape
    if t != 1:
        raise ValueError(f"qkv: expected one new token per sequence (B, 1, width), got shape {tuple(qkv.shape)}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if kind == "numpy":
        s = int(start[0])
        if not 0 <= s < t_max:
            raise ValueError(f"start: slot {s} is outside a cache of {t_max}")
        q = split_qkv_reference(qkv, k_cache, v_cache, s, heads, *rope_rows(cos, sin, s, 1, kv_start), rotary_dim)
        return attention_reference(q, k_cache[:, :, :s + 1], v_cache[:, :, :s + 1], True, scale, kv_start)
    if d & (d - 1) or d > 256:
        raise ValueError(f"k_cache: head dim must be a power of two up to 256 on the GPU, got {d}")
    x = qkv.reshape(bsz, heads + 2 * hkv, 1, d)
    new = (x[:, heads:heads + hkv], x[:, heads + hkv:])
    rope = (cos[None], sin[None], rotary_dim // 2) if cos is not None else None
    return decode_cupy(x[:, :heads], k_cache, v_cache, kv_start, start, float(scale) * LOG2E,
                       *decode_splits(t_max, bsz * heads, sm_count(), decode_tile_keys(d)), new=new, rope=rope)
