"""The pre-norm transformer layer both models are made of, written once against the ops.

    x = x + o(attend(qkv(norm1(x))))
    x = x + fc2(act(fc1(norm2(x))))

GPT-2 (LayerNorm, tanh GELU, biases), GLM-ASR's audio encoder (LayerNorm, exact GELU) and
its Llama decoder (RMSNorm, SwiGLU, no biases) differ only in these weights and in how the
heads attend: causal over a KV cache, or bidirectional within a window, which the caller
passes as `attend`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ._arrays import array_module
from .linear import linear
from .norm import LayerNorm, RMSNorm
from .precision import input_dtype
from .weights import BF16


@dataclass
class Block:
    """One layer's weights. Each projection is (weight (N, K), bias (N,) or None); norm1 and
    norm2 are applied inside the projections after them (fused into tk.linear)."""
    norm1: LayerNorm | RMSNorm
    qkv: tuple          # q, k and v stacked: ((Hq + 2 Hkv) D, C)
    o: tuple
    norm2: LayerNorm | RMSNorm
    fc1: tuple          # (2I, C) gate and up stacked when activation is 'swiglu'
    fc2: tuple
    activation: str

    def __call__(self, x, attend: Callable, qkv_dtype=np.float32):
        """The layer on x (B, T, C); attend(qkv, out_dtype) -> (B, H, T, D) is the attention of
        the new tokens given their fused projection (writing a cache, rotating, masking as it
        needs), which it takes in qkv_dtype (bfloat16 for attention that multiplies in bfloat16)
        and returns in float32 or out_dtype, the dtype the o projection takes (bfloat16 at
        precision 'medium')."""
        b, t, _ = x.shape
        y = attend(linear(x, *self.qkv, norm=self.norm1, out_dtype=qkv_dtype), out_dtype=input_dtype(self.o[0]))
        y = array_module(x).ascontiguousarray(y.transpose(0, 2, 1, 3)).reshape(b, t, -1)
        # a decode step keeps the residual stream in float32 and as fc1 takes it: fc1's blocks each
        # stream x beside a weight tile, bfloat16 where fc1 multiplies so (a sequence's norm runs first),
        # and then also times an RMSNorm's weight, the operand fc1's kernel would make of it
        xn_dtype = input_dtype(self.fc1[0]) if t == 1 else x.dtype
        scale = self.norm2.weight if xn_dtype == BF16 and isinstance(self.norm2, RMSNorm) else None
        x, xn, *xs = linear(y, *self.o, residual=x, out_dtype=(np.float32, xn_dtype), scaled_by=scale)
        h = linear(xn, *self.fc1, activation=self.activation, norm=self.norm2, scaled=xs[0] if xs else None,
                   out_dtype=input_dtype(self.fc2[0]))      # bfloat16 where fc2 takes it so
        return linear(h, *self.fc2, residual=x)
