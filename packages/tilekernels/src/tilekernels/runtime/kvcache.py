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
    lengths (B,) int64: set for the engine's slots (slots.py), each row's keys cached at
    [0, lengths[b]); a decode step stores row b's new key at lengths[b] and the span is unused.
    last (B,) int: set for a right-padded prompt batch, each row's last real token (final).
    every: final keeps every position (a prefill that scores its prompts' tokens).
    """
    k: object
    v: object
    span: object
    kv_start: object
    rope: tuple | None = None
    length: int = 0          # positions filled so far
    lengths: object = None
    last: object = None
    every: bool = False

    @classmethod
    def allocate(cls, xp, layers: int, batch: int, heads: int, length: int, head_dim: int,
                 kv_start=None, rope_theta: float | None = None, dtype=np.float32) -> "KVCache":
        """Zeroed keys and values of dtype float32 or bfloat16 (half the bytes every decode step
        reads; each key and value rounded to nearest as it is stored); rope_theta also builds
        the RoPE tables (full head_dim rotary)."""
        shape = (layers, batch, heads, length, head_dim)
        start = xp.zeros(batch, np.int32) if kv_start is None else xp.asarray(kv_start, np.int32)
        rope = None if rope_theta is None else tk.rope_cos_sin(xp.arange(length), head_dim, rope_theta)
        bf16 = np.dtype(dtype) == tk.weights.BF16

        def zeros():
            return xp.zeros(shape, np.uint16).view(tk.weights.BF16) if bf16 else xp.zeros(shape, np.float32)
        return cls(zeros(), zeros(), xp.zeros(2, np.int32), start, rope)

    def raw(self) -> tuple:
        """(keys, values) as plain arrays to copy between (bfloat16 ones as their uint16 bits)."""
        return tuple(a.view(np.uint16) if a.dtype == tk.weights.BF16 else a for a in (self.k, self.v))

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

    def attend(self, layer: int, qkv, heads: int, scale: float, out_dtype=np.float32):
        """Causal attention (B, Hq, T, D) of the new tokens over everything cached so far, from
        their fused projection qkv (B, T, (Hq + 2 Hkv) D): their k, v go into `layer` at the
        announced span first (rotated by RoPE when the cache has tables, and q with them).
        A decode step (T = 1) is one kernel at any batch (tk.decode_attention: the same
        arithmetic for a sequence whatever decodes beside it), its slot and length on the device
        (graph replay); a prompt is split_qkv then flash attention. out_dtype: what the o
        projection takes (bfloat16 at precision 'medium'). Over a bfloat16 cache a prompt's q is
        then stored in bfloat16 too, so flash attention multiplies in bfloat16 as the decode
        kernel does (GLM-ASR's 450-token prompt: docs/performance.md); else it is float32."""
        t = qkv.shape[1]
        cos, sin = self.rope or (None, None)
        if t == 1:
            return tk.decode_attention(qkv, self.k[layer], self.v[layer], self.span[:1], heads, scale,
                                       self.kv_start, cos, sin, lengths=self.lengths, out_dtype=out_dtype)
        bf16 = np.dtype(out_dtype) == tk.weights.BF16 and self.k.dtype == tk.weights.BF16
        q = tk.split_qkv(qkv, self.k[layer], self.v[layer], self.span[:1], heads, cos, sin, kv_start=self.kv_start,
                         q_dtype=tk.weights.BF16 if bf16 else np.float32)
        end = self.length + t
        return tk.attention(q, self.k[layer, :, :, :end], self.v[layer, :, :, :end], True, scale, self.kv_start)

    def final(self, x):
        """The hidden state (B, C) each row's next token is predicted from, of x (B, T, C): its
        last column, or column last[b] of a right-padded prompt batch; all of x when every."""
        xp = tk.array_module(x)
        if self.every:
            return x
        if self.last is None:
            return xp.ascontiguousarray(x[:, -1])
        return x[xp.arange(x.shape[0]), self.last]
