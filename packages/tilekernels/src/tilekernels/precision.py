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

import cuda.tile as ct
import numpy as np

from .weights import bf16, f32

_PRECISIONS = ("high", "highest", "medium")
TF32, TF32X3, BF16 = 0, 1, 2          # the kernels' MMA compile-time mode
DECODE_ROWS = 128                      # the largest decode batch bucket (runtime.runner.BUCKETS)
_state = {"precision": "high"}


def set_matmul_precision(precision: str) -> None:
    """'high' (TF32, the default), 'highest' (3xTF32, fp32-accurate) or 'medium' (bfloat16 inputs
    for large products of bfloat16 weights), like torch's setting."""
    if precision not in _PRECISIONS:
        raise ValueError(f"matmul precision: expected one of {_PRECISIONS}, got {precision!r}")
    _state["precision"] = precision


def get_matmul_precision() -> str:
    return _state["precision"]


@contextlib.contextmanager
def matmul_precision(precision: str):
    """set_matmul_precision(precision) for the kernels launched inside the block (the setting is
    the process's: launch nothing from other threads meanwhile)."""
    before = get_matmul_precision()
    set_matmul_precision(precision)
    try:
        yield
    finally:
        set_matmul_precision(before)


def mma_mode(weight_dtype=None) -> int:
    """The kernels' MMA mode for a product by a weight of weight_dtype (None: attention): BF16
    only at 'medium', for a bfloat16 weight."""
    p = _state["precision"]
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
