"""Matrix-multiply precision of the tensor-core kernels (linear, attention, conv1d), named as
torch.set_float32_matmul_precision names them.

'high' (default): TF32 inputs (10-bit mantissa), fp32 accumulation, as torch does with
allow_tf32. 'highest': 3xTF32, each input split into a TF32 high part and a TF32 remainder,
a @ b ~ ah@bh + ah@bl + al@bh, which recovers fp32 accuracy for three times the tensor-core
work. Deep models drift from an fp32 reference under TF32 (GLM-ASR's 60 layers reach ~3e-3
relative error in the logits); 'highest' is how to match it. 'medium': the products of
bfloat16 weights take bfloat16 inputs, fp32 accumulation: twice TF32's tensor-core rate for
the large products (encoders, prefills), whose inputs the kernels producing them store in
bfloat16 (norms, the first MLP projection), and for a decode step's products no widening of
the weight tiles, only x rounded in registers. Attention takes bfloat16 inputs where its caller
stores q, k and v so, TF32 otherwise. The residual stream (of which a decode step's gate/up reads
a bfloat16 copy), every accumulation, every norm's sums and the softmax stay float32 (torch's
bf16 autocast rounds them all).
"""
from __future__ import annotations

import contextlib
import threading

import cuda.tile as ct
import numpy as np

from .weights import bf16, f32

_PRECISIONS = ("high", "highest", "medium")
TF32, TF32X3, BF16 = 0, 1, 2          # the kernels' MMA compile-time mode
DECODE_ROWS = 128                      # the largest decode batch bucket (runtime.runner.BUCKETS)
_state = {"precision": "high"}      # the process's setting
_local = threading.local()          # a thread's, inside matmul_precision blocks


def _checked(precision: str) -> str:
    if precision not in _PRECISIONS:
        raise ValueError(f"matmul precision: expected one of {_PRECISIONS}, got {precision!r}")
    return precision


def set_matmul_precision(precision: str) -> None:
    """'high' (TF32, the default), 'highest' (3xTF32, fp32-accurate) or 'medium' (bfloat16 inputs
    for large products of bfloat16 weights), like torch's setting: the process's, for every
    thread outside a matmul_precision block."""
    _state["precision"] = _checked(precision)


def get_matmul_precision() -> str:
    """The precision kernels launched from this thread now take."""
    return getattr(_local, "precision", None) or _state["precision"]


@contextlib.contextmanager
def matmul_precision(precision: str):
    """`precision` for the kernels this thread launches inside the block, whatever other threads
    or the process's setting say: how a model keeps the precision it was loaded with."""
    before = getattr(_local, "precision", None)
    _local.precision = _checked(precision)
    try:
        yield
    finally:
        _local.precision = before


def mma_mode(weight_dtype=None) -> int:
    """The kernels' MMA mode for a product by a weight of weight_dtype (None: attention): BF16
    only at 'medium', for a bfloat16 weight."""
    p = get_matmul_precision()
    if p == "highest":
        return TF32X3
    if p == "medium" and weight_dtype is not None and np.dtype(weight_dtype).itemsize == 2:
        return BF16
    return TF32


def input_dtype(weight) -> np.dtype:
    """The dtype the input of a product by `weight` is best produced in: bfloat16 where the
    product runs in BF16 mode (it rounds its input so anyway)."""
    from .weights import BF16 as BF16_DTYPE

    return BF16_DTYPE if mma_mode(weight.dtype) == BF16 else np.dtype(np.float32)


def operand(tile, MODE: int):
    """Tile helper: a loaded tile as the mma takes it: bfloat16 in BF16 mode (loaded from a
    bfloat16 array), float32 otherwise (widened from bfloat16)."""
    return bf16(tile) if MODE == BF16 else f32(tile)


def mma(a, b, acc, MODE):
    """acc + a @ b on the tensor cores: float32 tiles as TF32 (TF32X3 adds the two cross terms
    of the hi/lo split; the lo @ lo term is below fp32 rounding); BF16: both tiles already
    bfloat16 (as loaded from bfloat16 arrays: weights.bf16)."""
    if MODE == 2:
        return ct.mma(a, b, acc)
    ah = ct.astype(a, ct.tfloat32)
    bh = ct.astype(b, ct.tfloat32)
    if MODE == 1:
        al = ct.astype(a - ct.astype(ah, ct.float32), ct.tfloat32)
        bl = ct.astype(b - ct.astype(bh, ct.float32), ct.tfloat32)
        acc = ct.mma(al, bh, acc)
        acc = ct.mma(ah, bl, acc)
    return ct.mma(ah, bh, acc)
