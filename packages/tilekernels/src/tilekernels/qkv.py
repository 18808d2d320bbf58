"""From a fused QKV projection to attention's inputs in one kernel: split the heads, rotate q
and k (RoPE, half-split form, optional), store k and v into the KV cache, return q.

A prefill or an encoder layer otherwise spends a handful of small kernels here (slices made
contiguous, two RoPE passes, two cache scatters); one launch does it all, TILE_T tokens of one
head per block. The cache position comes from device memory. (Decode, one token at a time, has
all of this inside its attention kernel: attention.decode_attention.)
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import array_module, backend, check, inputs_ready, launch
from .rope import rope_reference, rotate_half, rotate_half_tile
from .weights import KV_DTYPES, empty, f32, like, result_dtype
from .interop import any_array

ConstInt = ct.Constant[int]


def split_qkv_reference(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int, heads: int,
                        cos: np.ndarray | None, sin: np.ndarray | None, rotary_dim: int) -> np.ndarray:
    b, t, _ = qkv.shape
    kv_heads, d = k_cache.shape[1], k_cache.shape[3]
    x = qkv.astype(np.float32, copy=False).reshape(b, t, heads + 2 * kv_heads, d)
    q, k, v = x[:, :, :heads], x[:, :, heads:heads + kv_heads], x[:, :, heads + kv_heads:]
    if cos is not None:
        q, k = rope_reference(q, cos, sin, rotary_dim), rope_reference(k, cos, sin, rotary_dim)
    k_cache[:, :, start:start + t] = k.transpose(0, 2, 1, 3).astype(k_cache.dtype)     # bfloat16: nearest even
    v_cache[:, :, start:start + t] = v.transpose(0, 2, 1, 3).astype(v_cache.dtype)
    return np.ascontiguousarray(q.transpose(0, 2, 1, 3), dtype=np.float32)


def split_tile_t(d: int) -> int:
    """Tokens a split_qkv block: 1,024 values of one head (the fastest for GLM-ASR's encoder,
    D = 64, and its decoder's prefill, D = 128)."""
    return max(8, 1024 // d)


@kernel
def split_qkv_kernel(QKV, KC, VC, Q, START, KS, COS, SIN, TILE_T: ConstInt, D: ConstInt, HALF: ConstInt):
    """TILE_T tokens of one head (axis 1 of the grid: q heads, then k heads, then v heads).
    HALF: half the rotary channels (0: no RoPE); 2 * HALF a power of two rotates in registers
    (rope.rotate_half_tile), any other even width gathers the partner channels."""
    inputs_ready()
    b = ct.bid(0) // ct.cdiv(QKV.shape[1], TILE_T)
    tt = ct.bid(0) % ct.cdiv(QKV.shape[1], TILE_T)
    h = ct.bid(1)
    hq, hkv = Q.shape[1], KC.shape[1]
    t = tt * TILE_T + ct.arange(TILE_T, dtype=ct.int32)[:, None]
    c = ct.arange(D, dtype=ct.int32)[None, :]
    pos = ct.load(START, index=(0,), shape=()) + t          # cache slots
    x = f32(ct.reshape(ct.load(QKV, index=(b, tt, h, 0), shape=(1, TILE_T, 1, D), padding_mode=ct.PaddingMode.ZERO),
                       (TILE_T, D)))
    if HALF > 0:
        if h < hq + hkv:
            position = ct.maximum(pos - ct.load(KS, index=(b,), shape=()), 0)
            if ((2 * HALF) & (2 * HALF - 1)) == 0:
                f = ct.arange(HALF, dtype=ct.int32)[None, :]
                x = rotate_half_tile(x, ct.gather(COS, (0, position, f)), ct.gather(SIN, (0, position, f)), HALF)
            else:
                x = rotate_half(QKV, x, b, t, h, c, COS, SIN, 0, position, HALF)
    if h < hq:
        ct.store(Q, index=(b, h, tt, 0), tile=like(Q, ct.reshape(x, (1, 1, TILE_T, D))))
    else:
        real = t < QKV.shape[1]      # the tile's tail past T must not touch the cache
        if h < hq + hkv:
            ct.scatter(KC, (b, h - hq, pos, c), like(KC, x), mask=real)
        else:
            ct.scatter(VC, (b, h - hq - hkv, pos, c), like(VC, x), mask=real)


def check_fused_qkv(qkv, k_cache, v_cache, start, heads: int, kv_start, cos, sin, rotary_dim,
                    qkv_dtypes=np.float32):
    """Validate split_qkv's and decode_attention's common arguments; returns
    (kv_start, rotary_dim), the defaults filled in."""
    check("qkv", qkv, ndim=3, dtype=qkv_dtypes)
    check("k_cache", k_cache, ndim=4, dtype=KV_DTYPES)
    bsz, _, width = qkv.shape
    _, kv_heads, t_max, d = k_cache.shape
    check("k_cache", k_cache, shape=(bsz, None, None, None), dtype=KV_DTYPES)
    check("v_cache", v_cache, shape=tuple(k_cache.shape), dtype=k_cache.dtype)
    check("start", start, shape=(1,), dtype=np.int32)
    if heads <= 0 or kv_heads == 0 or heads % kv_heads or width != (heads + 2 * kv_heads) * d:
        raise ValueError(f"qkv: expected last dimension (heads + 2 * kv heads) * head dim = "
                         f"({heads} + 2 * {kv_heads}) * {d} with heads a multiple of kv heads, got {width}")
    if kv_start is None:
        kv_start = array_module(qkv).zeros(bsz, dtype=np.int32)
    check("kv_start", kv_start, shape=(bsz,), dtype=np.int32)
    if (cos is None) != (sin is None):
        raise ValueError("cos, sin: give both or neither")
    rotary_dim = d if rotary_dim is None else rotary_dim
    if cos is not None:
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d:
            raise ValueError(f"rotary_dim: expected an even number in 2..{d}, got {rotary_dim}")
        check("cos", cos, shape=(None, rotary_dim // 2))
        check("sin", sin, shape=tuple(cos.shape))
        if cos.shape[0] < t_max:
            raise ValueError(f"cos: expected a table of at least {t_max} positions (the cache length), "
                             f"got {cos.shape[0]}")
    return kv_start, rotary_dim


def rope_rows(cos, sin, start: int, t: int, kv_start: np.ndarray):
    """The (B, T, half) rows of the tables for the t tokens from cache slot start (numpy)."""
    if cos is None:
        return None, None
    pos = np.maximum(start + np.arange(t)[None, :] - np.asarray(kv_start)[:, None], 0)
    return cos[pos], sin[pos]


@any_array
def split_qkv(qkv, k_cache, v_cache, start, heads: int, cos=None, sin=None, rotary_dim: int | None = None,
              kv_start=None, q_dtype=np.float32):
    """q (B, Hq, T, D) from a fused projection qkv (B, T, (Hq + 2 Hkv) D), float32 or
    bfloat16, storing k and v into k_cache, v_cache (B, Hkv, T_max, D) at slots start[0] ..
    start[0] + T - 1.

    heads: Hq; Hkv and D come from the cache. cos, sin: tables (P >= T_max, rotary_dim/2) by
    position, e.g. rope_cos_sin(arange(P)), rotating the first rotary_dim (default D) channels
    of q and k; the token in slot s of sequence b sits at position s - kv_start[b] (left
    padding; kv_start defaults to zeros). start: int32 (1,), read on the device; the caller
    keeps start[0] + T <= T_max. D must be a power of two on the GPU. q_dtype: float32, or
    bfloat16 (rounded to nearest even, as a bfloat16 cache's keys are) for attention with
    bfloat16 products.
    """
    kind = backend(qkv=qkv, k_cache=k_cache, v_cache=v_cache, start=start, kv_start=kv_start, cos=cos, sin=sin)
    kv_start, rotary_dim = check_fused_qkv(qkv, k_cache, v_cache, start, heads, kv_start, cos, sin, rotary_dim,
                                           KV_DTYPES)
    q_dtype = result_dtype(q_dtype, "q_dtype")
    bsz, t, _ = qkv.shape
    _, kv_heads, t_max, d = k_cache.shape
    if kind == "numpy":
        s = int(start[0])
        if s < 0 or s + t > t_max:
            raise ValueError(f"start: positions {s}..{s + t - 1} do not fit a cache of {t_max}")
        q = split_qkv_reference(qkv, k_cache, v_cache, s, heads, *rope_rows(cos, sin, s, t, kv_start), rotary_dim)
        return q.astype(q_dtype, copy=False)
    if d & (d - 1):
        raise ValueError(f"k_cache: head dim must be a power of two on the GPU, got {d}")
    xp = array_module(qkv)
    q = empty(xp, (bsz, heads, t, d), q_dtype)
    if q.size:
        rope = cos is not None
        tile_t = split_tile_t(d)
        launch((bsz * -(-t // tile_t), heads + 2 * kv_heads, 1), split_qkv_kernel,
               (qkv.reshape(bsz, t, -1, d), k_cache, v_cache, q, start, kv_start, cos[None] if rope else qkv,
                sin[None] if rope else qkv, tile_t, d, rotary_dim // 2 if rope else 0))
    return q
