"""Tile helpers that reduce several tiles in one block reduction.

Each ct.sum over a tile spread across a block is a round of shuffles and barriers of its own;
ct.reduce over a tuple of tiles does all of them in one round (the LN-fused decode GEMV went
from 14 barriers to 5 in its SASS, see linear.gemv_kernel).
"""
from __future__ import annotations

import cuda.tile as ct


def _add2(a, b, c, d):
    return a + c, b + d


def _add4(a, b, c, d, e, f, g, h):
    return a + e, b + f, c + g, d + h


def sums2(a, b, axis: int):
    """(sum(a), sum(b)) along axis, kept as a size-1 axis; a and b broadcast to one shape."""
    return ct.reduce((a, b), axis=axis, func=_add2, identity=(0.0, 0.0), keepdims=True)


def sums4(a, b, c, d, axis: int):
    """sums2 for four tiles."""
    return ct.reduce((a, b, c, d), axis=axis, func=_add4, identity=(0.0, 0.0, 0.0, 0.0), keepdims=True)
