"""Tile helpers that reduce several tiles in one block reduction.

Each ct.sum over a tile spread across a block is a round of shuffles and barriers of its own;
ct.reduce over a tuple of tiles does all of them in one round (the LN-fused batch-1 GEMV, since
replaced by the skinny kernel, went from 14 barriers to 5 in its SASS).
"""
from __future__ import annotations

import cuda.tile as ct


def _add2(a, b, c, d):
    return a + c, b + d


def sums2(a, b, axis: int):
    """(sum(a), sum(b)) along axis, kept as a size-1 axis; a and b broadcast to one shape."""
    return ct.reduce((a, b), axis=axis, func=_add2, identity=(0.0, 0.0), keepdims=True)
