"""The KV cache both models decode with, and the attention call that goes through it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import tilekernels as tk


@dataclass
class KVCache:
    """Keys and values for every layer, allocated once at full length: (L, B, H, T_max, D).

    span holds [start, end) of the tokens being added, in device memory on the GPU, so a
    decode step captured once as a CUDA graph writes and reads the right positions on
    every replay. kv_start (B,) is each sequence's first real position (left padding).
    """
    k: object
    v: object
    span: object
    kv_start: object
    length: int = 0          # positions filled so far

    @classmethod
    def allocate(cls, xp, layers: int, batch: int, heads: int, length: int, head_dim: int,
                 kv_start=None) -> "KVCache":
        shape = (layers, batch, heads, length, head_dim)
        start = xp.zeros(batch, np.int32) if kv_start is None else xp.asarray(kv_start, np.int32)
        return cls(xp.zeros(shape, np.float32), xp.zeros(shape, np.float32), xp.zeros(2, np.int32), start)

    def begin(self, new_tokens: int) -> None:
        """Announce the next new_tokens positions (host to device: outside any graph)."""
        end = self.length + new_tokens
        if end > self.k.shape[3]:
            raise ValueError(f"sequence of {end} tokens exceeds the cache ({self.k.shape[3]})")
        span = np.array([self.length, end], np.int32)
        if tk.is_device(self.span):
            self.span.set(span)
        else:
            self.span[...] = span

    def attend(self, layer: int, qkv, heads: int, scale: float, cos=None, sin=None):
        """Causal attention (B, Hq, T, D) of the new tokens over everything cached so far, from
        their fused projection qkv (B, T, (Hq + 2 Hkv) D): their k, v go into `layer` at the
        announced span first (rotated by RoPE with cos, sin when given, and q with them)."""
        t = qkv.shape[1]
        q = tk.split_qkv(qkv, self.k[layer], self.v[layer], self.span[:1], heads, cos, sin)
        if t == 1:      # decode: position and valid length live on the device (graph replay)
            return tk.attention(q, self.k[layer], self.v[layer], True, scale, self.kv_start, self.span[1:])
        end = self.length + t
        return tk.attention(q, self.k[layer, :, :, :end], self.v[layer, :, :, :end], True, scale, self.kv_start)
