"""Numerically stable softmax along one axis.

The kernel streams a row in chunks twice: an online pass for the running max and sum
(so rows as long as a 59k-token vocabulary never sit in registers whole), then a pass
that writes exp(x - max) / sum. Few long rows (a batch of logits) would leave most of the
GPU idle a block a row: there each row is cut into splits of blocks of their own, one kernel
storing each split's max and sum, the next merging a row's (in split order: the same result
every run) and writing its split.
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import array_module, backend, check, launch, next_pow2, inputs_ready, sm_count
from .interop import any_array

ConstInt = ct.Constant[int]
MAX_TILE = 4096
SPLIT_TILE = 1024       # a split row's chunk


def softmax_reference(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


def online_stats(X, row, c0, c1, TILE: int):
    """Tile helper: (max, sum of exp(x - max)) of chunks c0 .. c1 - 1 of a row, (1, 1) each."""
    m = ct.full((1, 1), -float("inf"), dtype=ct.float32)
    s = ct.full((1, 1), 0.0, dtype=ct.float32)
    for c in range(c0, c1):
        x = ct.load(X, index=(row, c), shape=(1, TILE), padding_mode=ct.PaddingMode.NEG_INF)
        m_new = ct.maximum(m, ct.max(x, axis=1, keepdims=True))
        s = s * ct.exp(m - m_new) + ct.sum(ct.exp(x - m_new), axis=1, keepdims=True)
        m = m_new
    return m, s


@kernel
def softmax_kernel(X, Y, TILE: ConstInt):
    inputs_ready()
    row = ct.bid(0)
    chunks = ct.cdiv(X.shape[1], TILE)
    m, s = online_stats(X, row, 0, chunks, TILE)
    inv = 1.0 / s
    for c in range(chunks):
        x = ct.load(X, index=(row, c), shape=(1, TILE), padding_mode=ct.PaddingMode.NEG_INF)
        ct.store(Y, index=(row, c), tile=ct.exp(x - m) * inv)


@kernel
def softmax_stats_kernel(X, M, S, PER: ConstInt, TILE: ConstInt):
    """Split (axis 1) of a row (axis 0): its max and sum into M, S (rows, splits)."""
    inputs_ready()
    row, split = ct.bid(0), ct.bid(1)
    c0 = split * PER
    m, s = online_stats(X, row, c0, min(c0 + PER, ct.cdiv(X.shape[1], TILE)), TILE)
    ct.store(M, index=(row, split), tile=ct.reshape(m, (1, 1)))
    ct.store(S, index=(row, split), tile=ct.reshape(s, (1, 1)))


@kernel
def softmax_split_kernel(X, Y, M, S, PER: ConstInt, TILE: ConstInt, SPLITS: ConstInt):
    """Split (axis 1) of a row (axis 0) written from the row's merged max and sum (SPLITS: the
    splits rounded up to a power of two; the rest load as max -inf, sum 0)."""
    inputs_ready()
    row, split = ct.bid(0), ct.bid(1)
    ms = ct.load(M, index=(row, 0), shape=(1, SPLITS), padding_mode=ct.PaddingMode.NEG_INF)
    ss = ct.load(S, index=(row, 0), shape=(1, SPLITS), padding_mode=ct.PaddingMode.ZERO)
    m = ct.max(ms, axis=1, keepdims=True)
    inv = 1.0 / ct.sum(ss * ct.exp(ms - m), axis=1, keepdims=True)
    c0 = split * PER
    for c in range(c0, min(c0 + PER, ct.cdiv(X.shape[1], TILE))):
        x = ct.load(X, index=(row, c), shape=(1, TILE), padding_mode=ct.PaddingMode.NEG_INF)
        ct.store(Y, index=(row, c), tile=ct.exp(x - m) * inv)


def softmax_splits(rows: int, n: int, sms: int) -> tuple[int, int]:
    """(chunks a split, splits) of a row of n: one split while rows fill half the SMs, else about
    two blocks an SM over all rows, at least two chunks a split."""
    chunks = -(-n // SPLIT_TILE)
    if 2 * rows >= sms or chunks < 4:
        return chunks, 1
    per = max(2, -(-chunks // -(-2 * sms // rows)))
    return per, -(-chunks // per)


def _softmax_cupy(x):
    import cupy

    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    y = cupy.empty_like(x2)
    if not x2.size:
        return y.reshape(x.shape)
    rows = x2.shape[0]
    per, splits = softmax_splits(rows, n, sm_count())
    if splits == 1:
        launch((rows, 1, 1), softmax_kernel, (x2, y, min(next_pow2(n), MAX_TILE)))
    else:
        m = cupy.empty((rows, splits), cupy.float32)
        s = cupy.empty((rows, splits), cupy.float32)
        launch((rows, splits, 1), softmax_stats_kernel, (x2, m, s, per, SPLIT_TILE))
        launch((rows, splits, 1), softmax_split_kernel, (x2, y, m, s, per, SPLIT_TILE, next_pow2(splits)))
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
