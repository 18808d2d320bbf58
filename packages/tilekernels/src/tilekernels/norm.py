"""LayerNorm and RMSNorm over the last axis.

The models hold their norms as LayerNorm / RMSNorm objects and hand them to linear(norm=...).
fold_norm moves a norm's scale and shift into the projection that follows it (W diag(g),
b + W beta), leaving a norm without parameters, whose row statistics the decode kernels of
linear compute themselves: no separate norm kernel on the decode path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import array_module, backend, check, inputs_ready, launch, next_pow2
from .weights import WEIGHT_DTYPES, empty, f32, like, result_dtype, widen
from .interop import any_array

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
MAX_DIM = 16384


# ---------------------------------------------------------------- numpy reference
def layernorm_reference(x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None,
                        eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True, dtype=np.float64)
    d = x - mean
    y = d / np.sqrt((d * d).mean(axis=-1, keepdims=True) + eps)
    y = y if weight is None else y * weight
    return (y if bias is None else y + bias).astype(np.float32)


def rmsnorm_reference(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    ms = np.square(x, dtype=np.float64).mean(axis=-1, keepdims=True)
    y = x / np.sqrt(ms + eps)
    return (y if weight is None else y * weight).astype(np.float32)


# ---------------------------------------------------------------- cuTile kernel
@kernel
def norm_kernel(X, W, B, Y, eps: float, inv_n: float, ROWS: ConstInt, TILE_N: ConstInt, RMS: ConstBool,
                AFFINE: ConstBool):
    """ROWS rows per block, each row held whole in one TILE_N tile (zero padded). Plain loads
    and stores: a block's rows are too few to amortise a TMA round trip."""
    inputs_ready()
    i = ct.bid(0)
    x = f32(ct.load(X, index=(i, 0), shape=(ROWS, TILE_N), padding_mode=ct.PaddingMode.ZERO, allow_tma=False))
    if RMS:
        y = x * ct.rsqrt(ct.sum(x * x, axis=1, keepdims=True) * inv_n + eps)
    else:
        mask = ct.arange(TILE_N, dtype=ct.int32) < X.shape[1]
        mean = ct.sum(x, axis=1, keepdims=True) * inv_n
        d = ct.where(mask[None, :], x - mean, 0.0)
        y = d * ct.rsqrt(ct.sum(d * d, axis=1, keepdims=True) * inv_n + eps)
    if AFFINE:
        y = y * ct.load(W, index=(0,), shape=(TILE_N,), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)[None, :]
        if not RMS:
            y = y + ct.load(B, index=(0,), shape=(TILE_N,), padding_mode=ct.PaddingMode.ZERO,
                            allow_tma=False)[None, :]
    ct.store(Y, index=(i, 0), tile=like(Y, y), allow_tma=False)


def norm_config(n: int) -> tuple[int, int]:
    """(ROWS, TILE_N): about 2048 elements per block, whole rows (one row from 1024 up: the
    fewer rows a block, the faster, down to one)."""
    tile_n = next_pow2(n)
    return max(1, 2048 // tile_n), tile_n


def _norm_cupy(x, weight, bias, eps, rms, out_dtype):
    import cupy

    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    y = empty(cupy, x2.shape, out_dtype)
    rows, tile_n = norm_config(n)
    grid = ((x2.shape[0] + rows - 1) // rows, 1, 1)
    w = x2 if weight is None else weight
    launch(grid, norm_kernel, (x2, w, w if bias is None else bias, y, float(eps), 1.0 / n,
                               rows, tile_n, rms, weight is not None))
    return y.reshape(x.shape)


# ---------------------------------------------------------------- public ops
def _validate(x, weight, bias, out_dtype):
    kind = backend(x=x, weight=weight, bias=bias)
    result_dtype(out_dtype)
    check("x", x, ndim=tuple(range(1, 8)), dtype=WEIGHT_DTYPES)
    n = x.shape[-1]
    if n > MAX_DIM:
        raise ValueError(f"x: last dimension at most {MAX_DIM} supported, got {n}")
    if weight is None and bias is not None:
        raise ValueError("bias: a norm with a bias needs its weight too")
    for name, a in (("weight", weight), ("bias", bias)):
        if a is not None:
            check(name, a, shape=(n,))
    return kind


@any_array
def layernorm(x, weight=None, bias=None, eps: float = 1e-5, out_dtype=np.float32):
    """LayerNorm over the last axis of x (float32 or bfloat16): (x - mean) / sqrt(var + eps)
    [* weight + bias], stored in out_dtype (float32, or bfloat16 for a product that takes bfloat16 inputs)."""
    if _validate(x, weight, bias, out_dtype) == "numpy":
        return layernorm_reference(widen(x), weight, bias, eps).astype(out_dtype)
    if weight is not None and bias is None:        # the kernel's affine step adds a bias
        bias = array_module(weight).zeros_like(weight)
    return _norm_cupy(x, weight, bias, eps, False, out_dtype)


@any_array
def rmsnorm(x, weight=None, eps: float = 1e-6, out_dtype=np.float32):
    """RMSNorm over the last axis of x (float32 or bfloat16): x / sqrt(mean(x^2) + eps) [* weight],
    stored in out_dtype."""
    if _validate(x, weight, None, out_dtype) == "numpy":
        return rmsnorm_reference(widen(x), weight, eps).astype(out_dtype)
    return _norm_cupy(x, weight, None, eps, True, out_dtype)


@dataclass(frozen=True)
class LayerNorm:
    """A LayerNorm (weight and bias both None: statistics only); calling it normalises x."""
    weight: Any = None
    bias: Any = None
    eps: float = 1e-5

    def __call__(self, x, out_dtype=np.float32):
        return layernorm(x, self.weight, self.bias, self.eps, out_dtype)

    @property
    def affine(self) -> bool:
        return self.weight is not None


@dataclass(frozen=True)
class RMSNorm:
    """An RMSNorm (weight None: statistics only); calling it normalises x."""
    weight: Any = None
    eps: float = 1e-6

    def __call__(self, x, out_dtype=np.float32):
        return rmsnorm(x, self.weight, self.eps, out_dtype)

    @property
    def affine(self) -> bool:
        return self.weight is not None


def fold_norm(norm: LayerNorm | RMSNorm, weight, bias=None):
    """(plain norm, weight', bias') with linear(x, weight', bias', norm=plain norm) equal to
    linear(x, weight, bias, norm=norm), as one folds a LayerNorm ahead of quantisation.

    The norm's scale g and shift beta move into the projection: weight (N, K) -> weight * g,
    bias -> bias + weight @ beta. For a LayerNorm each weight row is also centred (its mean
    taken out), so that x @ weight'.T = (x - mean(x)) @ (weight * g).T for any x: the decode
    kernels then need only the row's variance, summed on the fly, and no separate pass to
    subtract the mean. The plain norm only standardises, so the decode path runs no norm kernel.
    """
    if not isinstance(norm, (LayerNorm, RMSNorm)):
        raise TypeError(f"norm: expected a LayerNorm or RMSNorm, got {type(norm).__name__}")
    if not norm.affine:
        return norm, weight, bias
    backend(weight=weight, bias=bias, norm_weight=norm.weight)
    check("weight", weight, shape=(None, norm.weight.shape[0]))
    w64 = weight.astype(np.float64)
    scaled = w64 * norm.weight.astype(np.float64)
    if isinstance(norm, RMSNorm):
        return RMSNorm(None, norm.eps), scaled.astype(np.float32), bias
    centred = (scaled - scaled.mean(axis=1, keepdims=True)).astype(np.float32)
    shift = None if norm.bias is None else w64 @ norm.bias.astype(np.float64)
    if bias is not None:
        shift = bias if shift is None else shift + bias
    return LayerNorm(None, None, norm.eps), centred, None if shift is None else shift.astype(np.float32)
