"""y = residual + act(norm(x) @ weight.T + bias), the one projection both models are built of.

weight is (N, K), the torch nn.Linear layout. Bias, activation, a gated unit (activation
'swiglu': weight stacks [gate; up], y = silu(gate) * up) and the residual add are fused
into the kernel's epilogue. The norm runs as its own kernel first: fused into the decode
kernels as a prologue it cost more than it saved (every block recomputes the row
statistics before streaming weights: +9 us per GPT-2 projection on an H200).

Three kernels by the number of rows M:
- M = 1 (decode at batch 1): a weight-streaming GEMV on CUDA cores in plain fp32; each
  block owns a few output rows over all of K, so there is no split-K reduction.
- M <= 16 (batched decode, and M = 1 with a wide N): weights as the A operand of a TF32
  mma, 64 output columns per block against up to 16 rows of x.
- larger M: 128x128 TF32 tiles in grouped order for L2 reuse, split over K (second
  kernel reduces and applies the epilogue) when the output tiles cannot fill the GPU;
Measured on an H200 (benchmarks/results/kernels-h200.md) to pick these shapes.
"""
from __future__ import annotations


import cuda.tile as ct
import numpy as np

from ._arrays import backend, check, launch, sm_count
from .activations import SILU, activation_code, apply_activation_reference, tile_activation
from .norm import LayerNorm, RMSNorm
from .precision import precise, tf32_mma

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
GROUP_M = 8


def linear_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None,
                     activation: str | None = None, norm=None, residual: np.ndarray | None = None) -> np.ndarray:
    if norm is not None:
        x = norm(x)
    y = x @ weight.T
    if bias is not None:
        y = y + bias
    if activation == "swiglu":
        half = y.shape[-1] // 2
        y = apply_activation_reference(y[..., :half].astype(np.float32), "silu").astype(np.float64) * y[..., half:]
    else:
        y = apply_activation_reference(y.astype(np.float32), activation)
    if residual is not None:
        y = residual + y
    return y.astype(np.float32)


# ---------------------------------------------------------------- tile helpers
def epilogue(acc, up, Bias, R, Y, bm, bn, TILE_M: int, TILE_N: int,
             HAS_BIAS: bool, ACT: int, GLU: bool, RESID: bool):
    """Store residual + act(acc + bias) [* up] as output tile (bm, bn)."""
    if HAS_BIAS:
        acc = acc + ct.load(Bias, index=(bn,), shape=(TILE_N,), padding_mode=ct.PaddingMode.ZERO)[None, :]
    acc = tile_activation(acc, ACT)
    if GLU:
        acc = acc * up
    if RESID:
        acc = acc + ct.load(R, index=(bm, bn), shape=(TILE_M, TILE_N), padding_mode=ct.PaddingMode.ZERO)
    ct.store(Y, index=(bm, bn), tile=acc)


# ---------------------------------------------------------------- kernels
@ct.kernel
def gemv_kernel(X, W, W2, Bias, R, Y, TILE_N: ConstInt, TILE_K: ConstInt,
                HAS_BIAS: ConstBool, ACT: ConstInt, GLU: ConstBool, RESID: ConstBool):
    """TILE_N outputs of row bid(1) over all of K in fp32 FMAs: products accumulate
    elementwise in a (TILE_N, TILE_K) tile and are summed across K once at the end."""
    bn = ct.bid(0)
    m = ct.bid(1)
    acc = ct.full((TILE_N, TILE_K), 0.0, dtype=ct.float32)
    acc2 = ct.full((TILE_N, TILE_K), 0.0, dtype=ct.float32)
    for k in range(ct.cdiv(X.shape[1], TILE_K)):
        x = ct.load(X, index=(m, k), shape=(1, TILE_K), padding_mode=ct.PaddingMode.ZERO)
        acc = acc + ct.load(W, index=(bn, k), shape=(TILE_N, TILE_K), padding_mode=ct.PaddingMode.ZERO) * x
        if GLU:
            acc2 = acc2 + ct.load(W2, index=(bn, k), shape=(TILE_N, TILE_K), padding_mode=ct.PaddingMode.ZERO) * x
    y = ct.reshape(ct.sum(acc, axis=1), (1, TILE_N))
    up = ct.reshape(ct.sum(acc2, axis=1), (1, TILE_N))
    epilogue(y, up, Bias, R, Y, m, bn, 1, TILE_N, HAS_BIAS, ACT, GLU, RESID)


@ct.kernel
def skinny_kernel(X, W, W2, Bias, R, Y, TILE_M: ConstInt, TILE_N: ConstInt, TILE_K: ConstInt,
                  HAS_BIAS: ConstBool, ACT: ConstInt, GLU: ConstBool, RESID: ConstBool, PRECISE: ConstBool):
    """Up to TILE_M rows of x against TILE_N weight rows: the weight tile is the mma's
    A operand (TILE_N, TILE_K), x transposed the B operand, so N fills the tensor-core M."""
    bn = ct.bid(0)
    bm = ct.bid(1)
    acc = ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32)
    acc2 = ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32)
    for k in range(ct.cdiv(X.shape[1], TILE_K)):
        xt = ct.transpose(ct.load(X, index=(bm, k), shape=(TILE_M, TILE_K), padding_mode=ct.PaddingMode.ZERO))
        w = ct.load(W, index=(bn, k), shape=(TILE_N, TILE_K), padding_mode=ct.PaddingMode.ZERO)
        acc = tf32_mma(w, xt, acc, PRECISE)
        if GLU:
            w2 = ct.load(W2, index=(bn, k), shape=(TILE_N, TILE_K), padding_mode=ct.PaddingMode.ZERO)
            acc2 = tf32_mma(w2, xt, acc2, PRECISE)
    epilogue(ct.transpose(acc), ct.transpose(acc2), Bias, R, Y, bm, bn, TILE_M, TILE_N, HAS_BIAS, ACT, GLU, RESID)


def _grouped(tile_id, num_m, num_n):
    """Grouped ordering: GROUP_M row-tiles share each column of W while it is in L2."""
    in_group = GROUP_M * num_n
    first_m = (tile_id // in_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + (tile_id % size_m), (tile_id % in_group) // size_m


@ct.kernel
def linear_kernel(X, W, W2, Bias, R, Y, k_tiles_per_split: int,
                  TILE_M: ConstInt, TILE_N: ConstInt, TILE_K: ConstInt, HAS_BIAS: ConstBool, ACT: ConstInt,
                  GLU: ConstBool, RESID: ConstBool, PARTIAL: ConstBool, PRECISE: ConstBool):
    """One (TILE_M, TILE_N) output tile over one K range (axis 1 of the grid); PARTIAL
    stores the raw sum for splitk_reduce_kernel instead of the epilogue."""
    num_m = ct.cdiv(X.shape[0], TILE_M)
    num_n = ct.cdiv(W.shape[0], TILE_N)
    bm, bn = _grouped(ct.bid(0), num_m, num_n)
    split = ct.bid(1)
    k_tiles = ct.cdiv(X.shape[1], TILE_K)
    k0 = split * k_tiles_per_split
    k1 = min(k0 + k_tiles_per_split, k_tiles)
    acc = ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32)
    acc2 = ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32)
    for k in range(k0, k1):
        a = ct.load(X, index=(bm, k), shape=(TILE_M, TILE_K), padding_mode=ct.PaddingMode.ZERO)
        b = ct.load(W, index=(k, bn), shape=(TILE_K, TILE_N), order=(1, 0), padding_mode=ct.PaddingMode.ZERO)
        acc = tf32_mma(a, b, acc, PRECISE)
        if GLU:
            b2 = ct.load(W2, index=(k, bn), shape=(TILE_K, TILE_N), order=(1, 0), padding_mode=ct.PaddingMode.ZERO)
            acc2 = tf32_mma(a, b2, acc2, PRECISE)
    if PARTIAL:
        ct.store(Y, index=(split, bm, bn), tile=ct.reshape(acc, (1, TILE_M, TILE_N)))
    else:
        epilogue(acc, acc2, Bias, R, Y, bm, bn, TILE_M, TILE_N, HAS_BIAS, ACT, GLU, RESID)


@ct.kernel
def splitk_reduce_kernel(P, Bias, R, Y, TILE_N: ConstInt, HAS_BIAS: ConstBool, ACT: ConstInt, RESID: ConstBool):
    """Y[m, n-tile] = residual + act(sum over splits of P[:, m, n-tile] + bias)."""
    m = ct.bid(0)
    j = ct.bid(1)
    acc = ct.full((1, TILE_N), 0.0, dtype=ct.float32)
    for s in range(P.shape[0]):
        p = ct.load(P, index=(s, m, j), shape=(1, 1, TILE_N), padding_mode=ct.PaddingMode.ZERO)
        acc = acc + ct.reshape(p, (1, TILE_N))
    epilogue(acc, acc, Bias, R, Y, m, j, 1, TILE_N, HAS_BIAS, ACT, False, RESID)


# ---------------------------------------------------------------- planning and launch
LARGE_M = (128, 128, 32)     # (TILE_M, TILE_N, TILE_K)
GLU_LARGE_M = (128, 64, 32)  # two accumulators
SKINNY = (16, 64, 128)
SKINNY_GLU = (16, 32, 128)
GEMV_TILE_K = 256
REDUCE_TILE = 256


def linear_plan(m: int, n: int, k: int, glu: bool = False, sms: int = 132):
    """Which kernel and tiles for an (M, N outputs, K) product: ('gemv', (TILE_N,)),
    ('skinny', tiles) or ('tiles', tiles, K tiles per split, splits)."""
    if m == 1 and n <= 4096:
        return "gemv", (8 if n < 1024 else 16,)
    if m <= 16:
        return "skinny", SKINNY_GLU if glu else SKINNY
    tm, tn, tk = tiles = GLU_LARGE_M if glu else LARGE_M
    out_tiles = -(-m // tm) * -(-n // tn)
    k_tiles = -(-k // tk)
    split = 1 if glu else min(k_tiles, max(1, -(-2 * sms // out_tiles)), 64)
    per = -(-k_tiles // split)
    return "tiles", tiles, per, -(-k_tiles // per)


def _linear_cupy(x, weight, bias, act, glu, norm, residual):
    import cupy

    k = x.shape[-1]
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = cupy.empty((m, n), dtype=cupy.float32)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    if norm is not None:
        x2 = norm(x2)
    w, w2 = (weight[:n], weight[n:]) if glu else (weight, weight)
    b = weight if bias is None else bias
    r = y if residual is None else residual.reshape(m, n)
    plan = linear_plan(m, n, k, glu, sm_count())
    flags = (bias is not None, act, glu, residual is not None)
    if plan[0] == "gemv":
        (tn,) = plan[1]
        launch((-(-n // tn), m, 1), gemv_kernel, (x2, w, w2, b, r, y, tn, GEMV_TILE_K, *flags))
    elif plan[0] == "skinny":
        tm, tn, tk = plan[1]
        launch((-(-n // tn), -(-m // tm), 1), skinny_kernel, (x2, w, w2, b, r, y, tm, tn, tk, *flags, precise()))
    else:
        _, (tm, tn, tk), per, split = plan
        grid = (-(-m // tm) * -(-n // tn), split, 1)
        if split == 1:
            launch(grid, linear_kernel, (x2, w, w2, b, r, y, per, tm, tn, tk, *flags, False, precise()))
        else:
            part = cupy.empty((split, m, n), dtype=cupy.float32)
            launch(grid, linear_kernel, (x2, w, w2, b, r, part, per, tm, tn, tk, False, 0, False, False, True,
                                         precise()))
            launch((m, -(-n // REDUCE_TILE), 1), splitk_reduce_kernel,
                   (part, b, r, y, REDUCE_TILE, flags[0], act, flags[3]))
    return y.reshape(*x.shape[:-1], n)


def linear(x, weight, bias=None, activation: str | None = None, *, norm: LayerNorm | RMSNorm | None = None,
           residual=None):
    """residual + act(norm(x) @ weight.T + bias); x (..., K), weight (N, K), bias (N,).

    activation: None, 'gelu' (exact), 'gelu_tanh', 'silu', or 'swiglu': weight stacks the
    gate and up projections (2I, K) and the result is silu(gate) * up, (..., I).
    norm: a LayerNorm or RMSNorm applied to x first.
    residual: (..., N_out), added last.
    """
    if norm is not None and not isinstance(norm, (LayerNorm, RMSNorm)):
        raise TypeError(f"norm: expected a LayerNorm or RMSNorm, got {type(norm).__name__}")
    kind = backend(x=x, weight=weight, bias=bias, residual=residual,
                   norm_weight=None if norm is None else norm.weight,
                   norm_bias=getattr(norm, "bias", None))
    glu = activation == "swiglu"
    act = SILU if glu else activation_code(activation)
    check("x", x, ndim=tuple(range(1, 8)))
    check("weight", weight, shape=(None, x.shape[-1]))
    n = weight.shape[0]
    if glu:
        if n % 2:
            raise ValueError(f"weight: 'swiglu' needs the gate and up rows stacked (even rows), got {n}")
        if bias is not None:
            raise ValueError("bias: 'swiglu' takes no bias")
        n //= 2
    if bias is not None:
        check("bias", bias, shape=(weight.shape[0],))
    if norm is not None:
        check("norm weight", norm.weight, shape=(x.shape[-1],))
        if isinstance(norm, LayerNorm):
            check("norm bias", norm.bias, shape=(x.shape[-1],))
    if residual is not None:
        check("residual", residual, shape=(*x.shape[:-1], n))
    if kind == "numpy":
        return linear_reference(x, weight, bias, activation, norm, residual)
    return _linear_cupy(x, weight, bias, act, glu, norm, residual)
