"""Matrix-multiply precision of the tensor-core kernels (linear, attention, conv1d), named as
torch.set_float32_matmul_precision names them.

'high' (default): TF32 inputs (10-bit mantissa), fp32 accumulation, as torch does with
allow_tf32. 'highest': 3xTF32, each input split into a TF32 high part and a TF32 remainder,
a @ b ~ ah@bh + ah@bl + al@bh, which recovers fp32 accuracy for three times the tensor-core
work. Deep models drift from an fp32 reference under TF32 (GLM-ASR's 60 layers reach ~3e-3
relative error in the logits); 'highest' is how to match it. 'medium': the large products
(more than DECODE_ROWS rows: encoders, prefills) of bfloat16 weights take bfloat16 inputs,
fp32 accumulation, at twice TF32's tensor-core rate; their inputs are stored in bfloat16 by
the kernels that produce them (norms, the first MLP projection) and rounded once otherwise.
Decode steps, which stream weights and gain nothing from it, keep TF32, and so does attention:
the residual stream, every accumulation and every norm stay float32 (torch's bf16 autocast
rounds all of them).
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

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


def mma_mode(weight_dtype=None, large: bool = False) -> int:
    """The kernels' MMA mode for a product by a weight of weight_dtype (None: attention); large:
    a sequence's product (a prompt, an encoder window) or one of more than DECODE_ROWS rows.
    BF16 only at 'medium', for a large product of a bfloat16 weight."""
    p = _state["precision"]
    if p == "highest":
        return TF32X3
    if p == "medium" and large and weight_dtype is not None and np.dtype(weight_dtype).itemsize == 2:
        return BF16
    return TF32


def input_dtype(x_shape: tuple, weight) -> np.dtype:
    """The dtype a product's input (of shape x_shape) is best produced in: bfloat16 where the
    product runs in BF16 mode."""
    from .weights import BF16 as BF16_DTYPE

    rows = int(np.prod(x_shape[:-1]))
    large = (len(x_shape) >= 3 and x_shape[-2] > 1) or rows > DECODE_ROWS
    return BF16_DTYPE if mma_mode(weight.dtype, large) == BF16 else np.dtype(np.float32)


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
