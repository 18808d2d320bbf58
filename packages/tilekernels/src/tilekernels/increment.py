"""Add one in place to small integer arrays: the counters a captured decode step advances
(token positions, the KV cache's span) for the next replay.

One dependent launch for up to two arrays: a cupy `+= 1` in a decode graph is an ordinary
launch that the next step's first kernel cannot overlap (two of them cost 1 to 4 us a step,
benchmarks/results/decode-profile-*-b1-h100-increment-gemv-heads.json).
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from ._arrays import backend, check, inputs_ready, launch, next_pow2

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
MAX_SIZE = 4096


@ct.kernel
def increment_kernel(A, B, TILE_A: ConstInt, TILE_B: ConstInt, TWO: ConstBool):
    inputs_ready()
    a = ct.load(A, index=(0,), shape=(TILE_A,), padding_mode=ct.PaddingMode.ZERO)
    ct.store(A, index=(0,), tile=a + 1)
    if TWO:
        b = ct.load(B, index=(0,), shape=(TILE_B,), padding_mode=ct.PaddingMode.ZERO)
        ct.store(B, index=(0,), tile=b + 1)


def increment(*arrays) -> None:
    """a += 1 for each of one or two contiguous int32 or int64 arrays of up to 4096 elements."""
    if not 1 <= len(arrays) <= 2:
        raise ValueError(f"increment: expected one or two arrays, got {len(arrays)}")
    kind = backend(**{f"arrays[{i}]": a for i, a in enumerate(arrays)})
    for i, a in enumerate(arrays):
        if a.dtype not in (np.int32, np.int64):
            raise TypeError(f"arrays[{i}]: expected dtype int32 or int64, got {a.dtype}")
        check(f"arrays[{i}]", a, dtype=a.dtype)
        if not 1 <= a.size <= MAX_SIZE:
            raise ValueError(f"arrays[{i}]: expected 1..{MAX_SIZE} elements, got {a.size}")
    if kind == "numpy":
        for a in arrays:
            a += 1
        return
    a, b = arrays[0].reshape(-1), arrays[-1].reshape(-1)
    launch((1, 1, 1), increment_kernel, (a, b, next_pow2(a.size), next_pow2(b.size), len(arrays) == 2))
