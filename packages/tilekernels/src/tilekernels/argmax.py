"""Index of the largest value along the last axis: greedy decoding's choice of token.

A vocabulary row is split over many blocks, each writing its chunk's best value and index;
the last block of a row to finish (an atomic count) picks the first of the largest, so the
whole argmax is one dependent launch (cupy's argmax in a decode graph cost 39 us of a 346 us
GPT-2 step, decode-profile-gpt2-b1-h100-one-reduction-argmax.json). Ties go to the smallest
index and a NaN counts as largest, as numpy's argmax does.
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from ._arrays import (array_module, backend, check, inputs_ready, last_block_counters, last_in_group, launch,
                      next_pow2, reset_count)

ConstInt = ct.Constant[int]
MIN_TILE = 1024
MAX_CHUNKS = 64     # chunks of a row (the picking block reads them as one tile)


@ct.kernel
def argmax_kernel(X, PV, PI, C, OUT, TILE: ConstInt, CHUNKS: ConstInt):
    """Best value and index of chunk bid(0) of row bid(1); the row's last chunk to finish
    (counted in C[row]) writes OUT[row], the index of the first chunk holding the largest
    value, and sets the count back to zero."""
    inputs_ready()
    c = ct.bid(0)
    r = ct.bid(1)
    x = ct.load(X, index=(r, c), shape=(1, TILE), padding_mode=ct.PaddingMode.NEG_INF)
    j = ct.argmax(x, axis=1, keepdims=True, propagate_nan=True)
    ct.store(PV, index=(r, c), tile=ct.max(x, axis=1, keepdims=True, propagate_nan=True), allow_tma=False)
    ct.store(PI, index=(r, c), tile=j + c * TILE, allow_tma=False)
    if last_in_group(C, r):
        v = ct.load(PV, index=(r, 0), shape=(1, CHUNKS), padding_mode=ct.PaddingMode.NEG_INF, allow_tma=False)
        i = ct.load(PI, index=(r, 0), shape=(1, CHUNKS), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)
        best = ct.argmax(v, axis=1, keepdims=True, propagate_nan=True)
        pick = ct.where(ct.arange(CHUNKS, dtype=ct.int32)[None, :] == best, i, 0)
        ct.store(OUT, index=(r,), tile=ct.astype(ct.reshape(ct.sum(pick, axis=1), (1,)), ct.int64), allow_tma=False)
        reset_count(C, r)


def chunk_tile(n: int) -> int:
    """Elements per chunk: at least MIN_TILE, and few enough chunks for one tile."""
    return max(MIN_TILE, next_pow2(-(-n // MAX_CHUNKS)))


def argmax(x, out=None):
    """int64 indices (x.shape[:-1]) of the largest value along the last axis of x (float32,
    last axis non-empty); ties go to the first, NaN counts as largest (numpy's rule).

    out: an int64 array of that shape to write into (a decode graph's token buffer);
    contiguous on the GPU.
    """
    kind = backend(x=x, out=out)
    check("x", x, ndim=tuple(range(1, 8)))
    if x.shape[-1] == 0:
        raise ValueError(f"x: expected a non-empty last axis, got shape {tuple(x.shape)}")
    if out is not None:
        check("out", out, shape=tuple(x.shape[:-1]), dtype=np.int64)
    if kind == "numpy":
        y = np.asarray(np.argmax(x, axis=-1), dtype=np.int64)
        if out is None:
            return y
        out[...] = y
        return out
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
               (x2, pv, pi, last_block_counters(rows), y.reshape(rows), tile, next_pow2(chunks)))
    return y
