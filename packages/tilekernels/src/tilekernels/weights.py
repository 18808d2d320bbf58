"""Weight storage: a matrix whose every value is a bfloat16 value is kept in bfloat16.

Checkpoints published in bfloat16 (GLM-ASR-Nano) are widened to float32 on load; storing
such a matrix back in bfloat16 on the GPU is lossless, halves the bytes a memory-bound
decode step streams, and the kernels widen each tile to float32 as they load it, so every
product is computed on exactly the float32 numbers the reference sees. A matrix with any
value off the bfloat16 grid (float32 checkpoints, norms folded into weights) stays float32.
"""
from __future__ import annotations

from typing import Any

import cuda.tile as ct
import ml_dtypes
import numpy as np

from ._arrays import array_module

BF16 = np.dtype(ml_dtypes.bfloat16)
WEIGHT_DTYPES = (np.dtype(np.float32), BF16)
KV_DTYPES = WEIGHT_DTYPES       # a KV cache holds float32 or bfloat16 keys and values


def compact(a: Any) -> Any:
    """`a` (float32, numpy or cupy) as bfloat16 when that loses nothing (the low 16 bits of
    every value are zero), else `a` itself."""
    xp = array_module(a)
    if a.dtype != np.float32 or a.size == 0:
        return a
    bits = xp.ascontiguousarray(a).view(xp.uint32)
    if bool((bits & 0xFFFF).any()):
        return a
    return (bits >> 16).astype(xp.uint16).view(BF16)


def widen(a: Any) -> Any:
    """`a` (numpy or cupy) as float32 if it is bfloat16 (exact: its bits are a float32's top
    half), else `a` itself."""
    if a.dtype != BF16:
        return a
    xp = array_module(a)
    return (xp.ascontiguousarray(a).view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


def stack_rows(arrays: list) -> Any:
    """Matrices (numpy or cupy, all float32 or all bfloat16) stacked along their rows, as one
    concatenates q, k and v projections into one; bfloat16 ones through their bits."""
    xp = array_module(arrays[0])
    if arrays[0].dtype == BF16:
        return xp.concatenate([a.view(xp.uint16) for a in arrays]).view(BF16)
    return xp.concatenate(arrays)


def result_dtype(dtype, name: str = "out_dtype") -> np.dtype:
    """dtype as the dtype of an op's result (the argument `name`): float32 or bfloat16
    (ValueError for any other)."""
    if np.dtype(dtype) not in WEIGHT_DTYPES:
        raise ValueError(f"{name}: expected float32 or bfloat16, got {np.dtype(dtype)}")
    return np.dtype(dtype)


def empty(xp, shape, dtype=np.float32) -> Any:
    """An uninitialised float32 or bfloat16 array (cupy has no bfloat16: its uint16 bits, viewed)."""
    return xp.empty(shape, np.uint16).view(BF16) if np.dtype(dtype) == BF16 else xp.empty(shape, dtype)


def to_bf16(a: Any) -> Any:
    """A float32 array rounded to bfloat16 (nearest even), as the kernels' narrow stores round."""
    xp = array_module(a)
    if a.dtype == BF16:
        return a
    if xp is np:
        return a.astype(BF16)
    from .activations import NONE, _activation_cupy      # one elementwise kernel storing bfloat16

    out = empty(xp, a.shape, BF16)
    return _activation_cupy(xp.ascontiguousarray(a, dtype=np.float32), None, NONE, out)


def f32(tile):
    """Tile helper: a weight tile in float32 (exact from bfloat16; nothing to do for float32).
    A bfloat16 array reaches a kernel as its uint16 bit patterns (_arrays.launch: the array
    interface has no bfloat16 type code), so uint16 tiles are read as bfloat16."""
    if tile.dtype == ct.uint16:
        tile = ct.bitcast(tile, ct.bfloat16)
    return tile if tile.dtype == ct.float32 else ct.astype(tile, ct.float32)


def bf16(tile):
    """Tile helper: a tile loaded from a bfloat16 array (its uint16 bits) as bfloat16."""
    return ct.bitcast(tile, ct.bfloat16) if tile.dtype == ct.uint16 else tile


def narrow(tile):
    """Tile helper: a float32 tile as the bit patterns (uint16) of its bfloat16 rounding
    (nearest even), as a bfloat16 array stores it."""
    return ct.bitcast(ct.astype(tile, ct.bfloat16), ct.uint16)


def like(A, tile):
    """Tile helper: a float32 tile as array A stores it (narrowed for a bfloat16 array)."""
    return narrow(tile) if A.dtype == ct.uint16 else tile
