"""Index of the largest value along the last axis: greedy decoding's choice of token, and
optionally the rest of a decode step's tail in the same launch.

A vocabulary row is split over many blocks, each writing its chunk's best value and index;
the last block of a row to finish (an atomic count) picks the first of the largest, so the
whole argmax is one dependent launch (cupy's argmax took a large share of a batch-1 decode
step). Ties go to the smallest index and a NaN counts as largest, as numpy's argmax does.

The picking block can also advance the row's position and the step counters and gather the
chosen token's embedding for the next step: a decode step then ends in this one launch and
leaves everything the next step reads on the device, so several steps chain in one CUDA graph
(runtime.graphs.DecodeGraph), each token cheaper than from single-step graphs.
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import (array_module, backend, check, inputs_ready, last_block_counters, last_in_group, launch,
                      next_pow2, reset_count)
from .embedding import embedding_reference
from .weights import WEIGHT_DTYPES, f32
from .interop import any_array

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
MIN_TILE = 1024
MAX_CHUNKS = 64     # chunks of a row (the picking block reads them as one tile)
MAX_COUNTERS = 4096
EMBED_TILE = 1024   # channels a step of the embedding gather


@kernel
def argmax_kernel(X, PV, PI, C, OUT, POS, CNT, T, P, Y, TILE_CNT: ConstInt, TILE_C: ConstInt, ADVANCE: ConstBool,
                  COUNT: ConstBool, EMBED: ConstBool, HAS_P: ConstBool, TILE: ConstInt, CHUNKS: ConstInt):
    """Best value and index of chunk bid(0) of row bid(1); the row's last chunk to finish
    (counted in C[row]) writes OUT[row], the index of the first chunk holding the largest
    value, and sets the count back to zero. That block also adds one to POS[row] (ADVANCE),
    to every counter in CNT (COUNT, row 0's block), and writes Y[row] = T[token]
    (+ P[POS[row]], the advanced position) in float32 (EMBED)."""
    inputs_ready()
    c = ct.bid(0)
    r = ct.bid(1)
    x = ct.load(X, index=(r, c), shape=(1, TILE), padding_mode=ct.PaddingMode.NEG_INF)
    j = ct.argmax(x, axis=1, keepdims=True, propagate_nan=True)
    ct.store(PV, index=(r, c), tile=ct.max(x, axis=1, keepdims=True, propagate_nan=True), allow_tma=False)
    ct.store(PI, index=(r, c), tile=j + c * TILE, allow_tma=False)
    if last_in_group(C, r, ct.num_blocks(0)):
        v = ct.load(PV, index=(r, 0), shape=(1, CHUNKS), padding_mode=ct.PaddingMode.NEG_INF, allow_tma=False)
        i = ct.load(PI, index=(r, 0), shape=(1, CHUNKS), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)
        best = ct.argmax(v, axis=1, keepdims=True, propagate_nan=True)
        token = ct.sum(ct.where(ct.arange(CHUNKS, dtype=ct.int32)[None, :] == best, i, 0))
        step_tail(r, token, OUT, POS, CNT, T, P, Y, TILE_CNT, TILE_C, ADVANCE, COUNT, EMBED, HAS_P)
        reset_count(C, r)


def step_tail(r, token, OUT, POS, CNT, T, P, Y, TILE_CNT, TILE_C, ADVANCE, COUNT, EMBED, HAS_P):
    """Tile helper, a decode step's last work once row r's token (a 0-d int32 tile) is known:
    OUT[r] = token; POS[r] += 1 (ADVANCE); every counter in CNT += 1 (COUNT, by row 0);
    Y[r] = T[token] (+ P[POS[r]], advanced) in float32 (EMBED), the next step's input."""
    ct.store(OUT, index=(r,), tile=ct.astype(ct.reshape(token, (1,)), ct.int64), allow_tma=False)
    position = ct.load(POS, index=(r,), shape=(1,), allow_tma=False)
    if ADVANCE:
        position = position + 1
        ct.store(POS, index=(r,), tile=position, allow_tma=False)
    if COUNT:
        if r == 0:
            n = ct.load(CNT, index=(0,), shape=(TILE_CNT,), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)
            ct.store(CNT, index=(0,), tile=n + 1, allow_tma=False)
    if EMBED:
        at = ct.reshape(position, ())
        for k in range(ct.cdiv(Y.shape[1], TILE_C)):
            e = f32(ct.load(T, index=(token, k), shape=(1, TILE_C), padding_mode=ct.PaddingMode.ZERO,
                            allow_tma=False))
            if HAS_P:
                e = e + f32(ct.load(P, index=(at, k), shape=(1, TILE_C), padding_mode=ct.PaddingMode.ZERO,
                                    allow_tma=False))
            ct.store(Y, index=(r, k), tile=e, allow_tma=False)


def chunk_tile(n: int) -> int:
    """Elements per chunk: at least MIN_TILE, and few enough chunks for one tile."""
    return max(MIN_TILE, next_pow2(-(-n // MAX_CHUNKS)))


def check_tail(rows: int, positions, counters, embed) -> None:
    """Validate a decode step's tail arguments (argmax's and sample's) for `rows` rows."""
    if positions is not None:
        check("positions", positions, shape=(rows,), dtype=np.int64)
    if counters is not None:
        check("counters", counters, ndim=1, dtype=np.int32)
        if not 1 <= counters.size <= MAX_COUNTERS:
            raise ValueError(f"counters: expected 1..{MAX_COUNTERS} elements, got {counters.size}")
    if embed is not None:
        table, pos_table, y = embed
        check("embed table", table, ndim=2, dtype=WEIGHT_DTYPES)
        if pos_table is not None:
            check("embed pos_table", pos_table, shape=(None, table.shape[1]), dtype=WEIGHT_DTYPES)
            if positions is None:
                raise ValueError("embed: a pos_table needs positions")
        check("embed out", y, shape=(rows, table.shape[1]))


@any_array
def argmax(x, out=None, *, positions=None, counters=None, embed=None):
    """int64 indices (x.shape[:-1]) of the largest value along the last axis of x (float32,
    last axis non-empty); ties go to the first, NaN counts as largest (numpy's rule).

    out: an int64 array of that shape to write into (a decode graph's token buffer);
    contiguous on the GPU.
    The rest of a greedy decode step, in the same launch (x 2-D, one row a sequence):
    positions: int64 (rows,), each advanced by one. counters: int32 (up to 4096), each
    advanced by one (a KV cache's span). embed: (table (V, C), pos_table (P, C) or None,
    y (rows, C) float32): y[r] = table[index r] (+ pos_table[positions[r]], advanced), the
    next step's input.
    """
    kind = backend(x=x, **tail_arrays(out, positions, counters, embed))
    check("x", x, ndim=tuple(range(1, 8)))
    if x.shape[-1] == 0:
        raise ValueError(f"x: expected a non-empty last axis, got shape {tuple(x.shape)}")
    if out is not None:
        check("out", out, shape=tuple(x.shape[:-1]), dtype=np.int64)
    tail = positions is not None or counters is not None or embed is not None
    if tail and x.ndim != 2:
        raise ValueError(f"x: positions, counters and embed need 2-D logits (rows, V), got shape {tuple(x.shape)}")
    check_tail(x.shape[0], positions, counters, embed)
    if kind == "numpy":
        y = np.asarray(np.argmax(x, axis=-1), dtype=np.int64)
        return tail_reference(y, out, positions, counters, embed)
    xp = array_module(x)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    y = xp.empty(x.shape[:-1], dtype=np.int64) if out is None else out
    if rows:
        tile = chunk_tile(n)
        chunks = -(-n // tile)
        pv = xp.empty((rows, chunks), dtype=np.float32)
        pi = xp.empty((rows, chunks), dtype=np.int32)
        launch((chunks, rows, 1), argmax_kernel,
               (x2, pv, pi, last_block_counters(rows), *tail_args(y.reshape(rows), positions, counters, embed, x2),
                tile, next_pow2(chunks)))
    return y


def tail_arrays(out, positions, counters, embed) -> dict:
    """A step tail's arrays by the names its errors use (for backend), argmax's and sample's."""
    named = {"out": out, "positions": positions, "counters": counters}
    if embed is not None:
        named.update({"embed table": embed[0], "embed pos_table": embed[1], "embed out": embed[2]})
    return named


def tail_reference(y: np.ndarray, out, positions, counters, embed) -> np.ndarray:
    """The step tail on the CPU (argmax's and sample's): y (the chosen int64 ids) into out,
    then positions and counters advanced and the next input embedded, in place (ids and positions
    checked against the tables first, so a bad one changes nothing)."""
    if embed is not None:
        table, pos_table, _ = embed
        if not np.all((0 <= y) & (y < len(table))):
            raise ValueError(f"embed: a chosen id is outside the table's {len(table)} rows")
        if pos_table is not None and positions is not None and not np.all(positions + 1 < len(pos_table)):
            raise ValueError(f"positions: the next position is outside the pos_table's {len(pos_table)} rows")
    if out is not None:
        out[...] = y
        y = out
    if positions is not None:
        positions += 1
    if counters is not None:
        counters += 1
    if embed is not None:
        table, pos_table, rows = embed
        rows[...] = embedding_reference(y, table, positions, pos_table)
    return y


def tail_args(out, positions, counters, embed, spare) -> tuple:
    """step_tail's kernel arguments: OUT, POS, CNT, T, P, Y, then its constants TILE_CNT,
    TILE_C, ADVANCE, COUNT, EMBED, HAS_P. Absent arrays are stood in for by others of their
    kind, never touched: out for the int64 ones, spare (float32, 2-D) for the tables."""
    pos = out if positions is None else positions
    cnt = pos if counters is None else counters
    table, pos_table, e = (spare, None, spare) if embed is None else embed
    return (out, pos, cnt, table, table if pos_table is None else pos_table, e, next_pow2(cnt.size),
            min(next_pow2(e.shape[1]), EMBED_TILE), positions is not None, counters is not None,
            embed is not None, pos_table is not None)
