"""y = act(x @ weight.T + bias) on TF32 tensor cores with fp32 accumulation.

weight is (N, K), the torch nn.Linear layout. Large M uses 128x128 tiles with a grouped
block order for L2 reuse; small M (decode) is a weight-bandwidth problem, so it splits
K across blocks until the GPU is full and reduces the partial sums in a second kernel
that also applies bias and activation.
"""
from __future__ import annotations


import cuda.tile as ct
import numpy as np

from ._arrays import backend, check, launch, sm_count
from .activations import activation_code, apply_activation_reference, tile_activation

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
GROUP_M = 8


def linear_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None,
                     activation: str | None = None) -> np.ndarray:
    y = x @ weight.T
    if bias is not None:
        y = y + bias
    return apply_activation_reference(y.astype(np.float32), activation)


def _grouped(tile_id, num_m, num_n):
    """Grouped ordering: GROUP_M row-tiles share each column of W while it is in L2."""
    in_group = GROUP_M * num_n
    first_m = (tile_id // in_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + (tile_id % size_m), (tile_id % in_group) // size_m


@ct.kernel
def linear_kernel(X, W, Bias, Y, k_tiles_per_split: int,
                  TILE_M: ConstInt, TILE_N: ConstInt, TILE_K: ConstInt,
                  HAS_BIAS: ConstBool, ACT: ConstInt, PARTIAL: ConstBool):
    """One (TILE_M, TILE_N) output tile over one K range (axis 1 of the grid)."""
    num_m = ct.cdiv(X.shape[0], TILE_M)
    num_n = ct.cdiv(W.shape[0], TILE_N)
    bm, bn = _grouped(ct.bid(0), num_m, num_n)
    split = ct.bid(1)
    k_tiles = ct.cdiv(X.shape[1], TILE_K)
    k0 = split * k_tiles_per_split
    k1 = min(k0 + k_tiles_per_split, k_tiles)
    acc = ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32)
    for k in range(k0, k1):
        a = ct.load(X, index=(bm, k), shape=(TILE_M, TILE_K), padding_mode=ct.PaddingMode.ZERO)
        b = ct.load(W, index=(k, bn), shape=(TILE_K, TILE_N), order=(1, 0),
                    padding_mode=ct.PaddingMode.ZERO)
        acc = ct.mma(ct.astype(a, ct.tfloat32), ct.astype(b, ct.tfloat32), acc)
    if PARTIAL:
        ct.store(Y, index=(split, bm, bn), tile=ct.reshape(acc, (1, TILE_M, TILE_N)))
    else:
        if HAS_BIAS:
            bias = ct.load(Bias, index=(bn,), shape=(TILE_N,), padding_mode=ct.PaddingMode.ZERO)
            acc = acc + bias[None, :]
        ct.store(Y, index=(bm, bn), tile=tile_activation(acc, ACT))


@ct.kernel
def splitk_reduce_kernel(P, Bias, Y, TILE_N: ConstInt, HAS_BIAS: ConstBool, ACT: ConstInt):
    """Y[m, n-tile] = act(sum over splits of P[:, m, n-tile] + bias)."""
    m = ct.bid(0)
    j = ct.bid(1)
    acc = ct.full((1, TILE_N), 0.0, dtype=ct.float32)
    for s in range(P.shape[0]):
        p = ct.load(P, index=(s, m, j), shape=(1, 1, TILE_N), padding_mode=ct.PaddingMode.ZERO)
        acc = acc + ct.reshape(p, (1, TILE_N))
    if HAS_BIAS:
        acc = acc + ct.load(Bias, index=(j,), shape=(TILE_N,), padding_mode=ct.PaddingMode.ZERO)[None, :]
    ct.store(Y, index=(m, j), tile=tile_activation(acc, ACT))


SMALL_M = (16, 64, 64)     # (TILE_M, TILE_N, TILE_K) for decode-sized M
LARGE_M = (128, 128, 32)



def linear_plan(m: int, n: int, k: int, sms: int = 132) -> tuple[tuple[int, int, int], int, int]:
    """Tile config, K tiles per split and number of splits for an (M, N, K) product."""
    tiles = SMALL_M if m <= 16 else LARGE_M
    tm, tn, tk = tiles
    out_tiles = -(-m // tm) * -(-n // tn)
    k_tiles = -(-k // tk)
    want = max(1, -(-2 * sms // out_tiles))
    split = min(k_tiles, want, 64)
    per = -(-k_tiles // split)
    return tiles, per, -(-k_tiles // per)


def _linear_cupy(x, weight, bias, code):
    import cupy

    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = cupy.empty((m, n), dtype=cupy.float32)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    (tm, tn, tk), per, split = linear_plan(m, n, k, sm_count())
    grid = (-(-m // tm) * -(-n // tn), split, 1)
    b = weight if bias is None else bias
    if split == 1:
        launch(grid, linear_kernel, (x2, weight, b, y, per, tm, tn, tk, bias is not None, code, False))
    else:
        part = cupy.empty((split, m, n), dtype=cupy.float32)
        launch(grid, linear_kernel, (x2, weight, b, part, per, tm, tn, tk, False, 0, True))
        rt = 256
        launch((m, -(-n // rt), 1), splitk_reduce_kernel,
               (part, b, y, rt, bias is not None, code))
    return y.reshape(*x.shape[:-1], n)


def linear(x, weight, bias=None, activation: str | None = None):
    """act(x @ weight.T + bias); x (..., K), weight (N, K), bias (N,) or None.

    activation: None, 'gelu' (exact), 'gelu_tanh' or 'silu', fused into the epilogue.
    """
    kind = backend(x=x, weight=weight, bias=bias)
    code = activation_code(activation)
    check("x", x, ndim=tuple(range(1, 8)))
    check("weight", weight, shape=(None, x.shape[-1]))
    if bias is not None:
        check("bias", bias, shape=(weight.shape[0],))
    if kind == "numpy":
        return linear_reference(x, weight, bias, activation)
    return _linear_cupy(x, weight, bias, code)
