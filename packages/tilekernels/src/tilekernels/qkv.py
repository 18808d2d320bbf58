"""From a fused QKV projection to attention's inputs in one kernel: split the heads, rotate q
and k (RoPE, half-split form, optional), store k and v into the KV cache, return q.

The decode step of a model otherwise spends a handful of small kernels per layer here
(slices made contiguous, two RoPE passes, two cache scatters); one launch does it all. The
cache position comes from device memory, so a captured decode graph writes the right slot on
every replay.
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from ._arrays import array_module, backend, check, inputs_ready, launch
from .rope import rope_reference, rotate_half

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]


def split_qkv_reference(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int, heads: int,
                        cos: np.ndarray | None, sin: np.ndarray | None, rotary_dim: int) -> np.ndarray:
    b, t, _ = qkv.shape
    kv_heads, d = k_cache.shape[1], k_cache.shape[3]
    x = qkv.reshape(b, t, heads + 2 * kv_heads, d)
    q, k, v = x[:, :, :heads], x[:, :, heads:heads + kv_heads], x[:, :, heads + kv_heads:]
    if cos is not None:
        q, k = rope_reference(q, cos, sin, rotary_dim), rope_reference(k, cos, sin, rotary_dim)
    k_cache[:, :, start:start + t] = k.transpose(0, 2, 1, 3)
    v_cache[:, :, start:start + t] = v.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(q.transpose(0, 2, 1, 3), dtype=np.float32)


@ct.kernel
def split_qkv_kernel(QKV, KC, VC, Q, START, COS, SIN, half: int, D: ConstInt, ROPE: ConstBool):
    """One head (axis 1 of the grid: q heads, then k heads, then v heads) of one token."""
    inputs_ready()
    tok = ct.bid(0)
    h = ct.bid(1)
    b = tok // QKV.shape[1]
    t = tok % QKV.shape[1]
    hq, hkv = Q.shape[1], KC.shape[1]
    c = ct.arange(D, dtype=ct.int32)
    x = ct.reshape(ct.load(QKV, index=(b, t, h, 0), shape=(1, 1, 1, D)), (D,))
    if ROPE:
        x = ct.where(h < hq + hkv, rotate_half(QKV, x, b, t, h, c, COS, SIN, b, t, half), x)
    y = ct.reshape(x, (1, 1, 1, D))
    if h < hq:
        ct.store(Q, index=(b, h, t, 0), tile=y)
    else:
        pos = ct.load(START, index=(0,), shape=()) + t
        if h < hq + hkv:
            ct.store(KC, index=(b, h - hq, pos, 0), tile=y)
        else:
            ct.store(VC, index=(b, h - hq - hkv, pos, 0), tile=y)


def split_qkv(qkv, k_cache, v_cache, start, heads: int, cos=None, sin=None, rotary_dim: int | None = None):
    """q (B, Hq, T, D) from a fused projection qkv (B, T, (Hq + 2 Hkv) D), storing k and v
    into k_cache, v_cache (B, Hkv, T_max, D) at positions start[0] .. start[0] + T - 1.

    heads: Hq; Hkv and D come from the cache. cos, sin (B, T, rotary_dim/2), e.g. from
    rope_cos_sin, rotate the first rotary_dim (default D) channels of q and k. start: int32
    (1,), read on the device; the caller keeps start[0] + T <= T_max. D must be a power of
    two on the GPU.
    """
    kind = backend(qkv=qkv, k_cache=k_cache, v_cache=v_cache, start=start, cos=cos, sin=sin)
    check("qkv", qkv, ndim=3)
    check("k_cache", k_cache, ndim=4)
    bsz, t, width = qkv.shape
    _, kv_heads, t_max, d = k_cache.shape
    check("k_cache", k_cache, shape=(bsz, None, None, None))
    check("v_cache", v_cache, shape=tuple(k_cache.shape))
    check("start", start, shape=(1,), dtype=np.int32)
    if heads <= 0 or kv_heads == 0 or width != (heads + 2 * kv_heads) * d:
        raise ValueError(f"qkv: expected last dimension (heads + 2 * kv heads) * head dim = "
                         f"({heads} + 2 * {kv_heads}) * {d}, got {width}")
    if (cos is None) != (sin is None):
        raise ValueError("cos, sin: give both or neither")
    rotary_dim = d if rotary_dim is None else rotary_dim
    half = rotary_dim // 2
    if cos is not None:
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d:
            raise ValueError(f"rotary_dim: expected an even number in 2..{d}, got {rotary_dim}")
        check("cos", cos, shape=(bsz, t, half))
        check("sin", sin, shape=(bsz, t, half))
    if kind == "numpy":
        s = int(start[0])
        if s < 0 or s + t > t_max:
            raise ValueError(f"start: positions {s}..{s + t - 1} do not fit a cache of {t_max}")
        return split_qkv_reference(qkv, k_cache, v_cache, s, heads, cos, sin, rotary_dim)
    if d & (d - 1):
        raise ValueError(f"k_cache: head dim must be a power of two on the GPU, got {d}")
    xp = array_module(qkv)
    q = xp.empty((bsz, heads, t, d), dtype=np.float32)
    if q.size:
        rope = cos is not None
        launch((bsz * t, heads + 2 * kv_heads, 1), split_qkv_kernel,
               (qkv.reshape(bsz, t, -1, d), k_cache, v_cache, q, start, cos if rope else qkv,
                sin if rope else qkv, half, d, rope))
    return q
