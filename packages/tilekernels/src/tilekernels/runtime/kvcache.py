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
    rope: (cos, sin) tables by position (T_max, head_dim/2) for models with RoPE; the kernels
    gather their rows on the device, so no step recomputes them.
    """
    k: object
    v: object
    span: object
    kv_start: object
    rope: tuple | None = None
    length: int = 0          # positions filled so far

    @classmethod
    def allocate(cls, xp, layers: int, batch: int, heads: int, length: int, head_dim: int,
                 kv_start=None, rope_theta: float | None = None) -> "KVCache":
        """Zeroed keys and values; rope_theta also builds the RoPE tables (full head_dim rotary)."""
        shape = (layers, batch, heads, length, head_dim)
        start = xp.zeros(batch, np.int32) if kv_start is None else xp.asarray(kv_start, np.int32)
        rope = None if rope_theta is None else tk.rope_cos_sin(xp.arange(length), head_dim, rope_theta)
        return cls(xp.zeros(shape, np.float32), xp.zeros(shape, np.float32), xp.zeros(2, np.int32), start, rope)

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

    def attend(self, layer: int, qkv, heads: int, scale: float):
        """Causal attention (B, Hq, T, D) of the new tokens over everything cached so far, from
        their fused projection qkv (B, T, (Hq + 2 Hkv) D): their k, v go into `layer` at the
        announced span first (rotated by RoPE when the cache has tables, and q with them)."""
        b, t = qkv.shape[:2]
        if t == 1 and b == 1:
            return self.fused_decode(layer, qkv, heads, scale)
        return self.split_then_attend(layer, qkv, heads, scale)

    def fused_decode(self, layer: int, qkv, heads: int, scale: float):
        """attend for one new token per sequence in one kernel (decode_attention; its merge
        aside): batch-1 decode. Slot and length live on the device (graph replay)."""
        cos, sin = self.rope or (None, None)
        return tk.decode_attention(qkv, self.k[layer], self.v[layer], self.span[:1], heads, scale,
                                   self.kv_start, cos, sin)

    def split_then_attend(self, layer: int, qkv, heads: int, scale: float):
        """attend in two ops, split_qkv storing k, v then attention: prefill, and batched decode,
        where split_qkv's own kernel measured faster than the fused one (profile_decode --batch 8)."""
        t = qkv.shape[1]
        cos, sin = self.rope or (None, None)
        q = tk.split_qkv(qkv, self.k[layer], self.v[layer], self.span[:1], heads, cos, sin, kv_start=self.kv_start)
        if t == 1:      # decode: the valid length lives on the device (graph replay)
            return tk.attention(q, self.k[layer], self.v[layer], True, scale, self.kv_start, self.span[1:])
        end = self.length + t
        return tk.attention(q, self.k[layer, :, :, :end], self.v[layer, :, :, :end], True, scale, self.kv_start)
