"""LayerNorm and RMSNorm over the last axis.

The models hold their norms as LayerNorm / RMSNorm objects and hand them to linear(norm=...),
which fuses the norm into its decode kernels; these kernels serve the larger row counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
def norm_kernel(X, W, B, Y, eps: float, inv_n: float, ROWS: ConstInt, TILE_N: ConstInt, RMS: ConstBool):
    """ROWS rows per block, each row held whole in one TILE_N tile (zero padded)."""
    i = ct.bid(0)
    x = ct.load(X, index=(i, 0), shape=(ROWS, TILE_N), padding_mode=ct.PaddingMode.ZERO)
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


def _norm_cupy(x, weight, bias, eps, rms):
    import cupy

    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    y = cupy.empty_like(x2)
    rows, tile_n = norm_config(n)
    grid = ((x2.shape[0] + rows - 1) // rows, 1, 1)
    launch(grid, norm_kernel, (x2, weight, weight if bias is None else bias, y, float(eps), 1.0 / n,
                               rows, tile_n, rms))
    return y.reshape(x.shape)


# ---------------------------------------------------------------- public ops
def _validate(x, weight, bias):
    kind = backend(x=x, weight=weight, bias=bias)
    check("x", x, ndim=tuple(range(1, 8)))
    n = x.shape[-1]
    if n > MAX_DIM:
        raise ValueError(f"x: last dimension at most {MAX_DIM} supported, got {n}")
    check("weight", weight, shape=(n,))
    if bias is not None:
        check("bias", bias, shape=(n,))
    return kind


def layernorm(x, weight, bias, eps: float = 1e-5):
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias."""
    if _validate(x, weight, bias) == "numpy":
        return layernorm_reference(x, weight, bias, eps)
    return _norm_cupy(x, weight, bias, eps, rms=False)


def rmsnorm(x, weight, eps: float = 1e-6):
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    if _validate(x, weight, None) == "numpy":
        return rmsnorm_reference(x, weight, eps)
    return _norm_cupy(x, weight, None, eps, rms=True)


@dataclass(frozen=True)
class LayerNorm:
    """A LayerNorm's parameters; calling it normalises x. linear(norm=...) fuses it."""
    weight: Any
    bias: Any
    eps: float = 1e-5

    def __call__(self, x):
        return layernorm(x, self.weight, self.bias, self.eps)


@dataclass(frozen=True)
class RMSNorm:
    """An RMSNorm's parameters; calling it normalises x. linear(norm=...) fuses it."""
    weight: Any
    eps: float = 1e-6

    def __call__(self, x):
        return rmsnorm(x, self.weight, self.eps)
