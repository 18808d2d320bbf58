"""1-D convolution in torch Conv1d layout, as a GEMM on the linear op's TF32 tensor-core kernel.

x (B, C_in, T), weight (C_out, C_in, KW) -> (B, C_out, T_out) with
T_out = (T + 2 * padding - KW) // stride + 1. On the GPU the input is laid out time-major
with its padding, (B, T + 2 * padding, C_in), so the KW taps of an output position are KW
consecutive rows: patch row t is positions t * stride ... t * stride + KW - 1, one strided
read, copied into a (B * T_out, KW * C_in) matrix that `linear` multiplies by the weight
reordered to (C_out, KW * C_in), with bias and activation (GLM-ASR's stem uses exact GELU) in
its epilogue. The result is written (B, T_out, C_out), the layout an encoder reads next, and
returned as a transposed view. (A direct implicit-GEMM kernel that gathered each tap's
input tile ran well behind cuDNN; this one runs ahead of it.)
"""
from __future__ import annotations

import numpy as np

from ._arrays import backend, check
from .activations import activation_code, apply_activation_reference
from .interop import any_array


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


@any_array
def conv1d(x, weight, bias=None, stride: int = 1, padding: int = 0, activation: str | None = None):
    """torch.nn.functional.conv1d(x, weight, bias, stride, padding), then an optional activation.

    x may be any strided (B, C_in, T) view. On the GPU the result is a transposed view of a
    contiguous (B, T_out, C_out)."""
    kind = backend(x=x, weight=weight, bias=bias)
    activation_code(activation)     # rejects an unknown name before any work
    check("x", x, ndim=3, contiguous=False)
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

    from .linear import linear

    bsz, c_in, t = x.shape
    c_out, _, kw = weight.shape
    rows = t + 2 * padding
    xt = cupy.empty((bsz, rows, c_in), dtype=cupy.float32)         # time-major, padded
    xt[:, :padding] = 0.0
    xt[:, padding + t:] = 0.0
    xt[:, padding:padding + t] = x.transpose(0, 2, 1)
    step = xt.strides[1]
    patches = cupy.lib.stride_tricks.as_strided(xt, (bsz, t_out, kw * c_in), (xt.strides[0], stride * step, 4))
    w2 = cupy.ascontiguousarray(weight.transpose(0, 2, 1)).reshape(c_out, kw * c_in)
    y = linear(cupy.ascontiguousarray(patches), w2, bias, activation)       # (B, T_out, C_out)
    return y.transpose(0, 2, 1)
