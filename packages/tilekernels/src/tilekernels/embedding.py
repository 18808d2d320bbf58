"""Token embedding: rows of a table by token id, plus rows of a position table (GPT-2's
learned positions) in the same kernel, so a decode step starts with one launch instead of
two gathers and an add.
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import array_module, backend, check, inputs_ready, launch, next_pow2
from .weights import WEIGHT_DTYPES, f32, widen
from .interop import any_array

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
MAX_TILE = 1024


def embedding_reference(ids: np.ndarray, table: np.ndarray, positions: np.ndarray | None = None,
                        pos_table: np.ndarray | None = None) -> np.ndarray:
    y = widen(table[ids]).astype(np.float64)
    if pos_table is not None:
        y = y + widen(pos_table[positions])
    return y.astype(np.float32)


@kernel
def embedding_kernel(IDS, POS, T, P, Y, HAS_POS: ConstBool, TILE: ConstInt):
    """Channels bid(1) of token bid(0): T[ids] (+ P[positions]), in float32 whatever the
    tables' storage (weights.compact)."""
    inputs_ready()
    r = ct.bid(0)
    j = ct.bid(1)
    x = ct.load(T, index=(ct.load(IDS, index=(r,), shape=()), j), shape=(1, TILE), padding_mode=ct.PaddingMode.ZERO)
    x = f32(x)
    if HAS_POS:
        x = x + f32(ct.load(P, index=(ct.load(POS, index=(r,), shape=()), j), shape=(1, TILE),
                            padding_mode=ct.PaddingMode.ZERO))
    ct.store(Y, index=(r, j), tile=x)


def _check_ids(name: str, ids, rows: int, kind: str) -> None:
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got {ids.dtype}")
    if kind == "numpy" and ids.size and (ids.min() < 0 or ids.max() >= rows):
        raise ValueError(f"{name}: expected values in 0..{rows - 1}, got {ids.min()}..{ids.max()}")


@any_array
def embedding(ids, table, positions=None, pos_table=None):
    """table[ids] (+ pos_table[positions]), shape ids.shape + (C,).

    ids, positions: integer arrays of one shape; table (V, C), pos_table (P, C) float32 or
    bfloat16 (weights.compact); the rows come out float32.
    The numpy path rejects ids outside the table; the GPU does not check them (they are
    device data; ids from a tokenizer or an argmax are in range).
    """
    kind = backend(ids=ids, table=table, positions=positions, pos_table=pos_table)
    check("table", table, ndim=2, dtype=WEIGHT_DTYPES)
    _check_ids("ids", ids, table.shape[0], kind)
    if (positions is None) != (pos_table is None):
        raise ValueError("positions and pos_table: pass both or neither")
    if pos_table is not None:
        check("pos_table", pos_table, shape=(None, table.shape[1]), dtype=WEIGHT_DTYPES)
        if positions.shape != ids.shape:
            raise ValueError(f"positions: expected shape {tuple(ids.shape)} (as ids), got {tuple(positions.shape)}")
        _check_ids("positions", positions, pos_table.shape[0], kind)
    if kind == "numpy":
        return embedding_reference(ids, table, positions, pos_table)
    xp = array_module(table)
    c = table.shape[1]
    y = xp.empty((ids.size, c), dtype=xp.float32)
    if ids.size:
        tile = min(next_pow2(c), MAX_TILE)
        flat = xp.ascontiguousarray(ids).reshape(-1)
        pos = flat if positions is None else xp.ascontiguousarray(positions).reshape(-1)
        launch((ids.size, -(-c // tile), 1), embedding_kernel,
               (flat, pos, table, table if pos_table is None else pos_table, y, pos_table is not None, tile))
    return y.reshape(*ids.shape, c)
