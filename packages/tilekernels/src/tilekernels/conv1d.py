"""1-D convolution in torch Conv1d layout, as an implicit GEMM on TF32 tensor cores.

x (B, C_in, T), weight (C_out, C_in, KW) -> (B, C_out, T_out) with
T_out = (T + 2 * padding - KW) // stride + 1. For each kernel tap the block multiplies
a (C_out, C_in) weight tile by an input tile gathered at t * stride + tap - padding;
out-of-range positions read as zero, which is the padding. Bias and an activation
(GLM-ASR's stem uses exact GELU) are fused into the epilogue.
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from ._arrays import backend, check, launch, inputs_ready
from .activations import activation_code, apply_activation_reference, tile_activation
from .precision import precise, tf32_mma

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
TILE_CO, TILE_T, TILE_CI = 64, 64, 32


def conv1d_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, stride: int,
                     padding: int, activation: str | None = None) -> np.ndarray:
    bsz, c_in, t = x.shape
    kw = weight.shape[2]
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding)))
    t_out = (t + 2 * padding - kw) // stride + 1
    y = np.zeros((bsz, weight.shape[0], t_out), dtype=np.float32)
    for tap in range(kw):
        cols = xp[:, :, tap: tap + stride * (t_out - 1) + 1: stride]      # (B, C_in, T_out)
        y += np.einsum("oc,bct->bot", weight[:, :, tap], cols, optimize=True)
    if bias is not None:
        y += bias[None, :, None]
    return apply_activation_reference(y, activation)


@ct.kernel
def conv1d_kernel(X, WT, Bias, Y, stride: int, padding: int, KW: ConstInt,
                  HAS_BIAS: ConstBool, ACT: ConstInt, PRECISE: ConstBool):
    """WT is the weight viewed as (KW, C_out, C_in); one (TILE_CO, TILE_T) output tile."""
    inputs_ready()
    b = ct.bid(2)
    co = ct.bid(0)
    tt = ct.bid(1)
    c_in = X.shape[1]
    t_pos = (tt * TILE_T + ct.arange(TILE_T, dtype=ct.int32))[None, :] * stride - padding
    ci_base = ct.arange(TILE_CI, dtype=ct.int32)[:, None]
    acc = ct.full((TILE_CO, TILE_T), 0.0, dtype=ct.float32)
    for c in range(ct.cdiv(c_in, TILE_CI)):
        ci = c * TILE_CI + ci_base
        for tap in range(KW):
            w = ct.load(WT, index=(tap, co, c), shape=(1, TILE_CO, TILE_CI), padding_mode=ct.PaddingMode.ZERO)
            xs = ct.gather(X, (b, ci, t_pos + tap))
            acc = tf32_mma(ct.reshape(w, (TILE_CO, TILE_CI)), xs, acc, PRECISE)
    if HAS_BIAS:
        acc = acc + ct.load(Bias, index=(co,), shape=(TILE_CO,), padding_mode=ct.PaddingMode.ZERO)[:, None]
    ct.store(Y, index=(b, co, tt), tile=ct.reshape(tile_activation(acc, ACT), (1, TILE_CO, TILE_T)))


def conv1d(x, weight, bias=None, stride: int = 1, padding: int = 0, activation: str | None = None):
    """torch.nn.functional.conv1d(x, weight, bias, stride, padding), then an optional activation."""
    kind = backend(x=x, weight=weight, bias=bias)
    code = activation_code(activation)
    check("x", x, ndim=3)
    check("weight", weight, ndim=3)
    check("weight", weight, shape=(None, x.shape[1], None))
    if bias is not None:
        check("bias", bias, shape=(weight.shape[0],))
    if stride < 1 or padding < 0:
        raise ValueError(f"stride must be >= 1 and padding >= 0, got stride={stride}, padding={padding}")
    t_out = (x.shape[2] + 2 * padding - weight.shape[2]) // stride + 1
    if t_out < 1:
        raise ValueError(f"x: length {x.shape[2]} is too short for kernel {weight.shape[2]} "
                         f"with padding {padding}")
    if kind == "numpy":
        return conv1d_reference(x, weight, bias, stride, padding, activation)
    import cupy

    bsz, c_out = x.shape[0], weight.shape[0]
    y = cupy.empty((bsz, c_out, t_out), dtype=cupy.float32)
    wt = weight.transpose(2, 0, 1)          # strided view, no copy
    grid = (-(-c_out // TILE_CO), -(-t_out // TILE_T), bsz)
    launch(grid, conv1d_kernel, (x, wt, weight if bias is None else bias, y, stride, padding,
                                 weight.shape[2], bias is not None, code, precise()))
    return y
