"""LayerNorm and RMSNorm over the last axis, optionally fused with the residual add.

Both models normalise after adding a residual every layer, so the fused form reads
x and r once and writes both s = x + r and norm(s).
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from ._arrays import backend, check, launch, next_pow2

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
MAX_DIM = 16384


# ---------------------------------------------------------------- numpy reference
def layernorm_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True, dtype=np.float64)
    d = x - mean
    var = (d * d).mean(axis=-1, keepdims=True)
    return (d / np.sqrt(var + eps) * weight + bias).astype(np.float32)


def rmsnorm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    ms = np.square(x, dtype=np.float64).mean(axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps) * weight).astype(np.float32)


# ---------------------------------------------------------------- cuTile kernel
@ct.kernel
def norm_kernel(X, R, S, W, B, Y, eps: float, inv_n: float,
                ROWS: ConstInt, TILE_N: ConstInt, RMS: ConstBool, RESIDUAL: ConstBool):
    """ROWS rows per block, each row held whole in one TILE_N tile (zero padded)."""
    i = ct.bid(0)
    x = ct.load(X, index=(i, 0), shape=(ROWS, TILE_N), padding_mode=ct.PaddingMode.ZERO)
    if RESIDUAL:
        x = x + ct.load(R, index=(i, 0), shape=(ROWS, TILE_N), padding_mode=ct.PaddingMode.ZERO)
        ct.store(S, index=(i, 0), tile=x)
    w = ct.load(W, index=(0,), shape=(TILE_N,), padding_mode=ct.PaddingMode.ZERO)
    if RMS:
        rstd = ct.rsqrt(ct.sum(x * x, axis=1, keepdims=True) * inv_n + eps)
        y = x * rstd * w[None, :]
    else:
        mask = ct.arange(TILE_N, dtype=ct.int32) < X.shape[1]
        mean = ct.sum(x, axis=1, keepdims=True) * inv_n
        d = ct.where(mask[None, :], x - mean, 0.0)
        rstd = ct.rsqrt(ct.sum(d * d, axis=1, keepdims=True) * inv_n + eps)
        b = ct.load(B, index=(0,), shape=(TILE_N,), padding_mode=ct.PaddingMode.ZERO)
        y = d * rstd * w[None, :] + b[None, :]
    ct.store(Y, index=(i, 0), tile=y)


def norm_config(n: int) -> tuple[int, int]:
    """(ROWS, TILE_N): about 4096 elements per block, whole rows."""
    tile_n = next_pow2(n)
    return max(1, 4096 // tile_n), tile_n


def _norm_cupy(x, residual, weight, bias, eps, rms):
    import cupy

    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    y = cupy.empty_like(x2)
    s = cupy.empty_like(x2) if residual is not None else y
    r2 = residual.reshape(-1, n) if residual is not None else x2
    rows, tile_n = norm_config(n)
    grid = ((x2.shape[0] + rows - 1) // rows, 1, 1)
    b = weight if bias is None else bias
    launch(grid, norm_kernel, (x2, r2, s, weight, b, y, float(eps), 1.0 / n,
                               rows, tile_n, rms, residual is not None))
    y = y.reshape(x.shape)
    return (s.reshape(x.shape), y) if residual is not None else y


# ---------------------------------------------------------------- public ops
def _validate(x, residual, weight, bias):
    kind = backend(x=x, residual=residual, weight=weight, bias=bias)
    check("x", x, ndim=tuple(range(1, 8)))
    n = x.shape[-1]
    if n > MAX_DIM:
        raise ValueError(f"x: last dimension at most {MAX_DIM} supported, got {n}")
    if residual is not None:
        check("residual", residual, shape=tuple(x.shape))
    check("weight", weight, shape=(n,))
    if bias is not None:
        check("bias", bias, shape=(n,))
    return kind


def layernorm(x, weight, bias, eps: float = 1e-5):
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias."""
    if _validate(x, None, weight, bias) == "numpy":
        return layernorm_reference(x, weight, bias, eps)
    return _norm_cupy(x, None, weight, bias, eps, rms=False)


def add_layernorm(x, residual, weight, bias, eps: float = 1e-5):
    """s = x + residual; returns (s, layernorm(s))."""
    if _validate(x, residual, weight, bias) == "numpy":
        s = x + residual
        return s, layernorm_reference(s, weight, bias, eps)
    return _norm_cupy(x, residual, weight, bias, eps, rms=False)


def rmsnorm(x, weight, eps: float = 1e-6):
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    if _validate(x, None, weight, None) == "numpy":
        return rmsnorm_reference(x, weight, eps)
    return _norm_cupy(x, None, weight, None, eps, rms=True)


def add_rmsnorm(x, residual, weight, eps: float = 1e-6):
    """s = x + residual; returns (s, rmsnorm(s))."""
    if _validate(x, residual, weight, None) == "numpy":
        s = x + residual
        return s, rmsnorm_reference(s, weight, eps)
    return _norm_cupy(x, residual, weight, None, eps, rms=True)
