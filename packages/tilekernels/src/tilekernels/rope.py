"""Rotary position embedding, half-split (`rotate_half`) form, with partial rotary.

x is (B, T, H, D), the layout a QKV projection produces. Only the first `rotary_dim`
channels of each head rotate; the rest pass through. cos/sin are per token, (B, T,
rotary_dim/2), built from explicit positions so decode and chunked prefill share it.
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import array_module, backend, check, launch, next_pow2, inputs_ready
from .weights import f32
from .interop import any_array

ConstInt = ct.Constant[int]


@any_array
def rope_cos_sin(positions, rotary_dim: int, theta: float = 10000.0):
    """cos, sin of shape positions.shape + (rotary_dim/2,), float32, as HF computes them
    (positions: integers; rotary_dim: even)."""
    backend(positions=positions)
    if positions.dtype.kind not in "iu":
        raise TypeError(f"positions: expected integer positions, got dtype {positions.dtype}")
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)) or rotary_dim < 2 \
            or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even number >= 2, got {rotary_dim!r}")
    xp = array_module(positions)
    exponent = xp.arange(0, rotary_dim, 2, dtype=xp.float32) / xp.float32(rotary_dim)
    inv_freq = (1.0 / (xp.float32(theta) ** exponent)).astype(xp.float32)
    freqs = positions.astype(xp.float32)[..., None] * inv_freq
    return xp.cos(freqs).astype(xp.float32), xp.sin(freqs).astype(xp.float32)


def rope_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int) -> np.ndarray:
    half = rotary_dim // 2
    c = cos[:, :, None, :].astype(np.float64)
    s = sin[:, :, None, :].astype(np.float64)
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    out = x.copy()
    out[..., :half] = x1 * c - x2 * s
    out[..., half:rotary_dim] = x2 * c + x1 * s
    return out


def rotate_half(X, x, i0, i1, i2, c, COS, SIN, j0, j1, half):
    """Tile helper: x, channels c of X[i0, i1, i2] (X 4-D, heads on axis 2), rotated in the
    half-split form over the first 2 * half channels (the rest pass through); the partner
    channels are gathered from X, cos and sin from COS[j0, j1], SIN[j0, j1] (3-D, channel last)."""
    first = c < half
    rotated = c < 2 * half
    partner = ct.where(first, c + half, ct.where(rotated, c - half, c))
    freq = ct.where(first, c, c - half)
    cos = ct.where(rotated, ct.gather(COS, (j0, j1, freq)), 1.0)
    sin = ct.where(rotated, ct.gather(SIN, (j0, j1, freq)), 0.0)
    xr = f32(ct.gather(X, (i0, i1, i2, partner)))
    return x * cos + ct.where(first, -1.0, 1.0) * xr * sin


def rotate_half_tile(x, cos, sin, HALF: int):
    """Tile helper: rotate_half on a whole (T, D) tile x in registers, cos and sin (T, HALF)
    for its rows; 2 * HALF must be a power of two. The partner channels come from x itself
    (halves extracted and joined): gathering them from memory made split_qkv gather-bound."""
    t, d = x.shape[0], x.shape[1]
    xr = x if 2 * HALF == d else ct.extract(x, (0, 0), shape=(t, 2 * HALF))
    a = ct.extract(xr, (0, 0), shape=(t, HALF))
    b = ct.extract(xr, (0, 1), shape=(t, HALF))
    rotated = ct.cat((a * cos - b * sin, b * cos + a * sin), 1)
    if 2 * HALF == d:
        return rotated
    wide = rotated
    for _ in ct.static_iter(range((d // (2 * HALF)).bit_length() - 1)):      # repeat up to D channels
        wide = ct.cat((wide, wide), 1)
    return ct.where(ct.arange(d, dtype=ct.int32)[None, :] < 2 * HALF, wide, x)


@kernel
def rope_kernel(X, COS, SIN, Y, half: int, H_PAD: ConstInt, D_PAD: ConstInt):
    """One token per block: all heads and channels as one (H_PAD, D_PAD) tile."""
    inputs_ready()
    tok = ct.bid(0)
    b = tok // X.shape[1]
    t = tok % X.shape[1]
    h = ct.arange(H_PAD, dtype=ct.int32)[:, None]
    c = ct.arange(D_PAD, dtype=ct.int32)[None, :]
    x = ct.gather(X, (b, t, h, c))
    ct.scatter(Y, (b, t, h, c), rotate_half(X, x, b, t, h, c, COS, SIN, b, t, half))


@any_array
def rope(x, cos, sin, rotary_dim: int | None = None):
    """Rotate the first rotary_dim channels of each head of x (B, T, H, D).

    cos, sin: (B, T, rotary_dim/2) or (T, rotary_dim/2), e.g. from rope_cos_sin.
    """
    kind = backend(x=x, cos=cos, sin=sin)
    check("x", x, ndim=4)
    bsz, t, heads, d = x.shape
    rotary_dim = d if rotary_dim is None else rotary_dim
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d:
        raise ValueError(f"rotary_dim: expected an even number in 2..{d}, got {rotary_dim}")
    half = rotary_dim // 2
    check("cos", cos, ndim=(2, 3))
    want = (bsz, t, half) if cos.ndim == 3 else (t, half)
    check("cos", cos, shape=want)
    check("sin", sin, shape=want)
    xp = array_module(x)
    if cos.ndim == 2:
        cos = xp.ascontiguousarray(xp.broadcast_to(cos, (bsz, t, half)))
        sin = xp.ascontiguousarray(xp.broadcast_to(sin, (bsz, t, half)))
    if kind == "numpy":
        return rope_reference(x, cos, sin, rotary_dim)
    y = xp.empty_like(x)
    if x.size:
        launch((bsz * t, 1, 1), rope_kernel, (x, cos, sin, y, half, next_pow2(heads), next_pow2(d)))
    return y
