"""Matrix-multiply precision of the tensor-core kernels (linear, attention, conv1d).

'high' (default): TF32 inputs (10-bit mantissa), fp32 accumulation, as torch does with
allow_tf32. 'highest': 3xTF32, each input split into a TF32 high part and a TF32
remainder, a @ b ~ ah@bh + ah@bl + al@bh, which recovers fp32 accuracy for three times
the tensor-core work. Deep models drift from an fp32 reference under TF32 (GLM-ASR's 60
layers reach ~3e-3 relative error in the logits); 'highest' is how to match it.
Memory-bound decode (M = 1) runs on CUDA cores in fp32 either way.
"""
from __future__ import annotations

import cuda.tile as ct

_PRECISIONS = ("high", "highest")
_state = {"precision": "high"}


def set_matmul_precision(precision: str) -> None:
    """'high' (TF32, the default) or 'highest' (3xTF32, fp32-accurate), like torch's setting."""
    if precision not in _PRECISIONS:
        raise ValueError(f"matmul precision: expected one of {_PRECISIONS}, got {precision!r}")
    _state["precision"] = precision


def get_matmul_precision() -> str:
    return _state["precision"]


def precise() -> bool:
    """The kernels' PRECISE compile-time flag."""
    return _state["precision"] == "highest"


def tf32_mma(a, b, acc, PRECISE):
    """acc + a @ b for float32 tiles on TF32 tensor cores; PRECISE adds the two
    cross terms of the hi/lo split (the lo @ lo term is below fp32 rounding)."""
    ah = ct.astype(a, ct.tfloat32)
    bh = ct.astype(b, ct.tfloat32)
    if PRECISE:
        al = ct.astype(a - ct.astype(ah, ct.float32), ct.tfloat32)
        bl = ct.astype(b - ct.astype(bh, ct.float32), ct.tfloat32)
        acc = ct.mma(al, bh, acc)
        acc = ct.mma(ah, bl, acc)
    return ct.mma(ah, bh, acc)
