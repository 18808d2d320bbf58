"""Tile helpers for sums across a block.

Each ct.sum over a tile spread across a block is a round of shuffles and barriers of its own;
ct.reduce over a tuple of tiles does all of them in one round (fewer barriers in the SASS). A
float32 sum adds in its register layout's order, which the compiler picks from how a tile is
used; pairwise_row_sums gives the same bits whatever the layout.
"""
from __future__ import annotations

import cuda.tile as ct


def _add2(a, b, c, d):
    return a + c, b + d


def sums2(a, b, axis: int):
    """(sum(a), sum(b)) along axis, kept as a size-1 axis; a and b broadcast to one shape."""
    return ct.reduce((a, b), axis=axis, func=_add2, identity=(0.0, 0.0), keepdims=True)


def pairwise_row_sums(p):
    """The row sums (rows, 1) of p in a fixed tree (neighbours, then neighbouring pairs' sums, ...;
    p's width a power of two): each add is of two values, so the bits are the same in any
    register layout (a float32 sum's order otherwise follows the layout)."""
    for _ in ct.static_iter(range(p.shape[1].bit_length() - 1)):
        p = ct.sum(ct.reshape(p, (p.shape[0], p.shape[1] // 2, 2)), axis=2)
    return p
