"""Numerically stable softmax along one axis.

The kernel streams a row in chunks twice: an online pass for the running max and sum
(so rows as long as a 59k-token vocabulary never sit in registers whole), then a pass
that writes exp(x - max) / sum.
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import array_module, backend, check, launch, next_pow2, inputs_ready
from .interop import any_array

ConstInt = ct.Constant[int]
MAX_TILE = 4096


def softmax_reference(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


@kernel
def softmax_kernel(X, Y, TILE: ConstInt):
    inputs_ready()
    row = ct.bid(0)
    chunks = ct.cdiv(X.shape[1], TILE)
    m = ct.full((1, 1), -float("inf"), dtype=ct.float32)
    s = ct.full((1, 1), 0.0, dtype=ct.float32)
    for c in range(chunks):
        x = ct.load(X, index=(row, c), shape=(1, TILE), padding_mode=ct.PaddingMode.NEG_INF)
        m_new = ct.maximum(m, ct.max(x, axis=1, keepdims=True))
        s = s * ct.exp(m - m_new) + ct.sum(ct.exp(x - m_new), axis=1, keepdims=True)
        m = m_new
    inv = 1.0 / s
    for c in range(chunks):
        x = ct.load(X, index=(row, c), shape=(1, TILE), padding_mode=ct.PaddingMode.NEG_INF)
        ct.store(Y, index=(row, c), tile=ct.exp(x - m) * inv)


def _softmax_cupy(x):
    import cupy

    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    y = cupy.empty_like(x2)
    if x2.size:
        launch((x2.shape[0], 1, 1), softmax_kernel, (x2, y, min(next_pow2(n), MAX_TILE)))
    return y.reshape(x.shape)


@any_array
def softmax(x, axis: int = -1):
    """exp(x - max) / sum(exp(x - max)) along `axis`."""
    kind = backend(x=x)
    check("x", x, ndim=tuple(range(1, 8)), contiguous=False)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis: expected -{x.ndim}..{x.ndim - 1} for a {x.ndim}-d array, got {axis}")
    if kind == "numpy":
        return softmax_reference(x, axis)
    xp = array_module(x)
    moved = xp.ascontiguousarray(xp.moveaxis(x, axis, -1))
    return xp.moveaxis(_softmax_cupy(moved), -1, axis)
