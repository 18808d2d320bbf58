"""GELU (tanh and exact erf forms), SiLU, SwiGLU, ReLU and the sigmoid, elementwise.

cuTile has no erf, so the exact GELU uses erfc from the Chebyshev fit in Numerical
Recipes (fractional error < 1.2e-7 everywhere, i.e. fp32 rounding): gelu(x) =
0.5 * x * erfc(-x / sqrt(2)). The same tile functions serve the linear epilogue.
"""
from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import backend, check, launch, inputs_ready
from .weights import like
from .interop import any_array

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

# activation codes shared with linear and conv1d epilogues
NONE, GELU_TANH, GELU_ERF, SILU, RELU, SIGMOID = 0, 1, 2, 3, 4, 5
_CODES = {None: NONE, "gelu_tanh": GELU_TANH, "gelu": GELU_ERF, "silu": SILU, "relu": RELU, "sigmoid": SIGMOID}
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
INV_SQRT2 = 1.0 / math.sqrt(2.0)
_ERFC = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
         0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def activation_code(activation: str | None) -> int:
    """Map an activation name (None, 'gelu', 'gelu_tanh', 'silu', 'relu', 'sigmoid') to its kernel code."""
    if activation not in _CODES:
        raise ValueError(f"activation: expected one of {sorted(k for k in _CODES if k)} or None, "
                         f"got {activation!r}")
    return _CODES[activation]


# ---------------------------------------------------------------- numpy reference
def _erfc_reference(z: np.ndarray) -> np.ndarray:
    a = np.abs(z)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = _ERFC[-1]
    for c in _ERFC[-2::-1]:
        poly = c + t * poly
    r = t * np.exp(-a * a + poly)
    return np.where(z >= 0, r, 2.0 - r)


def gelu_reference(x: np.ndarray, approximate: str = "tanh") -> np.ndarray:
    x64 = x.astype(np.float64)
    if approximate == "tanh":    # 0.5 (1 + tanh u) as sigmoid(2u), exact in the negative tail too
        with np.errstate(over="ignore"):
            y = x64 / (1.0 + np.exp(-2.0 * SQRT_2_OVER_PI * (x64 + 0.044715 * x64 ** 3)))
    else:
        y = 0.5 * x64 * _erfc_reference(-x64 * INV_SQRT2)
    return y.astype(np.float32)


def silu_reference(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return (x64 / (1.0 + np.exp(-x64))).astype(np.float32)


def sigmoid_reference(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def apply_activation_reference(x: np.ndarray, activation: str | None) -> np.ndarray:
    code = activation_code(activation)
    if code == RELU:
        return np.maximum(x, 0).astype(np.float32, copy=False)
    if code == SIGMOID:
        return sigmoid_reference(x)
    if code == GELU_TANH:
        return gelu_reference(x, "tanh")
    if code == GELU_ERF:
        return gelu_reference(x, "none")
    if code == SILU:
        return silu_reference(x)
    return x


# ---------------------------------------------------------------- tile functions
def fast_div(x, y):
    """x / y to 2 ulp (div.full: one reciprocal and a multiply). The IEEE-rounded division
    branches to a slow path per element, which serialises a tile epilogue."""
    return ct.truediv(x, y, rounding_mode=ct.RoundingMode.FULL)


def tile_erfc(z):
    a = ct.abs(z)
    t = fast_div(1.0, 1.0 + 0.5 * a)
    poly = t * 0.17087277 - 0.82215223
    poly = poly * t + 1.48851587
    poly = poly * t - 1.13520398
    poly = poly * t + 0.27886807
    poly = poly * t - 0.18628806
    poly = poly * t + 0.09678418
    poly = poly * t + 0.37409196
    poly = poly * t + 1.00002368
    poly = poly * t - 1.26551223
    r = t * ct.exp(poly - a * a)
    return ct.where(z >= 0.0, r, 2.0 - r)


def tile_activation(x, ACT):
    """Apply activation code ACT (a compile-time constant) to a float32 tile."""
    if ACT == GELU_TANH:    # 0.5 (1 + tanh u) = sigmoid(2u): no cancellation in the negative tail
        return fast_div(x, 1.0 + ct.exp(-2.0 * SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
    elif ACT == GELU_ERF:
        return 0.5 * x * tile_erfc(x * -INV_SQRT2)
    elif ACT == SILU:
        return fast_div(x, 1.0 + ct.exp(-x))
    elif ACT == RELU:
        return ct.maximum(x, 0.0)
    elif ACT == SIGMOID:
        return fast_div(1.0, 1.0 + ct.exp(-x))
    else:
        return x


@kernel
def activation_kernel(X, U, Y, TILE: ConstInt, ACT: ConstInt, GATED: ConstBool):
    """y = act(x), or act(x) * u when GATED; flat 1-D arrays, TILE elements per block; Y may be
    bfloat16 (ACT none: a cast)."""
    inputs_ready()
    i = ct.bid(0)
    x = ct.load(X, index=(i,), shape=(TILE,), padding_mode=ct.PaddingMode.ZERO)
    y = tile_activation(x, ACT)
    if GATED:
        y = y * ct.load(U, index=(i,), shape=(TILE,), padding_mode=ct.PaddingMode.ZERO)
    ct.store(Y, index=(i,), tile=like(Y, y))


ELEMENTWISE_TILE = 1024     # elements a block: as fast as 4096 or faster for each activation (docs/performance.md)


def _activation_cupy(x, u, code, out=None):
    import cupy

    xf = x.reshape(-1)
    y = cupy.empty_like(xf) if out is None else out.reshape(-1)
    grid = ((xf.size + ELEMENTWISE_TILE - 1) // ELEMENTWISE_TILE, 1, 1)
    if xf.size:
        uf = xf if u is None else u.reshape(-1)
        launch(grid, activation_kernel, (xf, uf, y, ELEMENTWISE_TILE, code, u is not None))
    return y.reshape(x.shape)


# ---------------------------------------------------------------- public ops
@any_array
def gelu(x, approximate: str = "tanh"):
    """GELU; approximate='tanh' (GPT-2's gelu_new) or 'none' (exact erf form)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate: expected 'tanh' or 'none', got {approximate!r}")
    kind = backend(x=x)
    check("x", x)
    if kind == "numpy":
        return gelu_reference(x, approximate)
    return _activation_cupy(x, None, GELU_TANH if approximate == "tanh" else GELU_ERF)


@any_array
def silu(x):
    """SiLU: x * sigmoid(x)."""
    kind = backend(x=x)
    check("x", x)
    if kind == "numpy":
        return silu_reference(x)
    return _activation_cupy(x, None, SILU)


@any_array
def swiglu(gate, up):
    """silu(gate) * up, the gated MLP of Llama-style decoders."""
    kind = backend(gate=gate, up=up)
    check("gate", gate)
    check("up", up, shape=tuple(gate.shape))
    if kind == "numpy":
        return (silu_reference(gate).astype(np.float64) * up).astype(np.float32)
    return _activation_cupy(gate, up, SILU)
