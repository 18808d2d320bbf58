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
    """`a` as float32 if it is bfloat16 (exact), else `a` itself."""
    return a.astype(np.float32) if a.dtype == BF16 else a


def f32(tile):
    """Tile helper: a weight tile in float32 (exact from bfloat16; nothing to do for float32).
    A bfloat16 array reaches a kernel as its uint16 bit patterns (_arrays.launch: the array
    interface has no bfloat16 type code), so uint16 tiles are read as bfloat16."""
    if tile.dtype == ct.uint16:
        tile = ct.bitcast(tile, ct.bfloat16)
    return tile if tile.dtype == ct.float32 else ct.astype(tile, ct.float32)
