"""Scaled dot-product attention, flash style (online softmax, no T x T matrix).

q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) with Hq a multiple of Hkv (grouped-query).
Causal attention is aligned to the end: query i sees keys 0..Tk-Tq+i, which covers
full prefill (Tq = Tk), chunked prefill and decode. Key tiles entirely above the
diagonal are never visited; only tiles that cross it (or the ragged end) are masked.
k/v may be views into a longer KV cache (unit stride on the last axis only).

k, v may be float32 or bfloat16 (a bfloat16 KV cache). q, k and v all bfloat16 take bfloat16
products (fp32 accumulation, the probabilities rounded to bfloat16 for the second product) and
give a bfloat16 result, as torch's attention does for bfloat16 inputs; otherwise the products
run at the matmul precision (TF32 by default) and the result is float32. Tq = 1 with float32 q
(decode) takes the decode kernel (decode_attention.py), which also serves decode_attention.
"""
from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import array_module, backend, check, inputs_ready, launch
from .activations import fast_div
from .decode_attention import LOG2E, NEG_INF, decode_cupy, online_softmax_step
from .precision import BF16 as BF16_MMA, mma, mma_mode, operand
from .weights import BF16, KV_DTYPES, empty, like
from .interop import any_array

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]


def visible_keys(tq: int, tk: int, causal: bool, kv_start: np.ndarray) -> np.ndarray:
    """(B, 1, Tq, Tk) mask: the keys each query attends to (the spec the kernels follow).

    Keys before kv_start[b] are left padding: hidden from real queries; padding queries
    (positions before kv_start[b]) see them, so no row is ever empty.
    """
    key = np.arange(tk)[None, None, None, :]
    row = (np.arange(tq) + tk - tq)[None, None, :, None]
    start = np.asarray(kv_start).reshape(-1, 1, 1, 1)
    ok = (key >= start) | (row < start)
    return ok & (key <= row) if causal else ok


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool,
                        scale: float, kv_start: np.ndarray) -> np.ndarray:
    group = q.shape[1] // k.shape[1]
    k64 = np.repeat(k.astype(np.float64), group, axis=1)
    v64 = np.repeat(v.astype(np.float64), group, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k64) * scale
    s = np.where(visible_keys(q.shape[2], k.shape[2], causal, kv_start), s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", s, v64).astype(np.float32).astype(q.dtype)


@kernel
def flash_kernel(Q, K, V, O, KS, scale_log2: float, group: int,
                 D: ConstInt, TILE_M: ConstInt, TILE_N: ConstInt, CAUSAL: ConstBool, MMA: ConstInt):
    """One TILE_M block of queries of one (batch, head) against all visible keys; O is
    (B, Tq, Hq, D), the layout the output projection reads."""
    inputs_ready()
    mt = ct.bid(0)
    b = ct.bid(1) // Q.shape[1]
    h = ct.bid(1) % Q.shape[1]
    kvh = h // group
    tk = K.shape[2]
    offset = tk - Q.shape[2]
    q = ct.load(Q, index=(b, h, mt, 0), shape=(1, 1, TILE_M, D), padding_mode=ct.PaddingMode.ZERO)
    q = operand(ct.reshape(q, (TILE_M, D)), MMA)
    kstart = ct.load(KS, index=(b,), shape=())
    rows = offset + mt * TILE_M + ct.arange(TILE_M, dtype=ct.int32)[:, None]
    cols = ct.arange(TILE_N, dtype=ct.int32)[None, :]
    if CAUSAL:
        end = min(tk, offset + (mt + 1) * TILE_M)
        unmasked = min(tk, offset + mt * TILE_M + 1) // TILE_N
    else:
        end = tk
        unmasked = tk // TILE_N
    m = ct.full((TILE_M, 1), NEG_INF, dtype=ct.float32)
    l = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((TILE_M, D), 0.0, dtype=ct.float32)
    for j in range(ct.cdiv(end, TILE_N)):
        k = ct.load(K, index=(b, kvh, 0, j), shape=(1, 1, D, TILE_N), order=(0, 1, 3, 2),
                    padding_mode=ct.PaddingMode.ZERO)
        s = mma(q, operand(ct.reshape(k, (D, TILE_N)), MMA), ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32),
                MMA) * scale_log2
        if j >= unmasked or j * TILE_N < kstart:
            key = j * TILE_N + cols
            visible = (key < tk) & ((key >= kstart) | (rows < kstart))
            if CAUSAL:
                visible = visible & (key <= rows)
            s = ct.where(visible, s, NEG_INF)
        v = ct.load(V, index=(b, kvh, j, 0), shape=(1, 1, TILE_N, D), padding_mode=ct.PaddingMode.ZERO)
        m, l, acc = online_softmax_step(s, operand(ct.reshape(v, (TILE_N, D)), MMA), m, l, acc, MMA)
    # one reciprocal a row: dividing the tile elementwise took the slow division path per element
    ct.store(O, index=(b, mt, h, 0), tile=like(O, ct.reshape(acc * fast_div(1.0, l), (1, TILE_M, 1, D))))


flash_kernel_occupancy2 = flash_kernel.replace_hints(occupancy=2)


def flash_plan(d: int, causal: bool, bf16: bool = False):
    """(TILE_M, TILE_N, kernel) of the flash kernel for head dim d, the fastest tried
    (docs/performance.md): a bidirectional 64-wide encoder runs 128-query blocks two to an SM
    (faster than 64 x 64 tiles) over 32-key tiles, or 64-key tiles in bfloat16 (each the faster key
    width at its precision); causal and 128-wide heads take 128-key tiles."""
    if d == 64 and not causal:
        return 128, 64 if bf16 else 32, flash_kernel_occupancy2
    return (64, 128, flash_kernel) if d <= 128 else (64, 64, flash_kernel)



def _attention_cupy(q, k, v, causal, scale, kv_start, kv_len):
    import cupy

    bsz, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if q.size == 0:
        return empty(cupy, q.shape, q.dtype)
    scale_log2 = float(scale) * LOG2E
    bf16 = q.dtype == BF16
    if tq == 1 and not bf16:
        if kv_len is None:
            kv_len = cupy.full(1, tk, dtype=cupy.int32)
        return decode_cupy(cupy.ascontiguousarray(q).reshape(bsz, hkv, hq // hkv, d), k, v, kv_start, kv_len,
                           scale_log2)
    out = empty(cupy, (bsz, tq, hq, d), q.dtype)
    tm, tn, kernel = flash_plan(d, bool(causal), bf16)
    launch((-(-tq // tm), bsz * hq, 1), kernel,
           (q, k, v, out, kv_start, scale_log2, hq // hkv, d, tm, tn, bool(causal), BF16_MMA if bf16 else mma_mode()))
    return out.transpose(0, 2, 1, 3)


@any_array
def attention(q, k, v, causal: bool = False, scale: float | None = None, kv_start=None, kv_len=None):
    """softmax(q k^T * scale [+ causal mask]) v, grouped-query aware.

    q (B, Hq, Tq, D) contiguous; k, v (B, Hkv, Tk, D), unit stride on the last axis.
    kv_start: optional int32 (B,), the first real key of each sequence (left padding).
    kv_len: optional int32 (1,) array, decode only (Tq = 1, float32 q): only the first kv_len[0]
    keys are valid, the length living in device memory so a captured graph can be replayed.
    q float32, or bfloat16 with k and v bfloat16 (bfloat16 products and result).
    D must be a power of two up to 256 on the GPU. scale defaults to 1/sqrt(D).
    Returns (B, Hq, Tq, D) of q's dtype; on the GPU a transposed view of a contiguous (B, Tq, Hq, D), so
    heads merge back into (B, Tq, Hq * D) without a copy.
    """
    kind = backend(q=q, k=k, v=v, kv_start=kv_start, kv_len=kv_len)
    check("q", q, ndim=4, dtype=KV_DTYPES)
    bsz, hq, tq, d = q.shape
    check("k", k, ndim=4, contiguous=False, inner_contiguous=True, dtype=KV_DTYPES)
    check("k", k, shape=(bsz, None, None, d), contiguous=False, dtype=KV_DTYPES)
    check("v", v, shape=tuple(k.shape), contiguous=False, inner_contiguous=True, dtype=k.dtype)
    if q.dtype == BF16 and k.dtype != BF16:
        raise ValueError(f"q: bfloat16 queries need bfloat16 keys and values, got {k.dtype}")
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"k: query heads ({hq}) must be a multiple of key/value heads ({k.shape[1]})")
    if causal and tq > k.shape[2]:
        raise ValueError(f"q: causal attention needs Tq <= Tk, got Tq={tq}, Tk={k.shape[2]}")
    if kv_start is None:
        kv_start = array_module(q).zeros(bsz, dtype=np.int32)
    check("kv_start", kv_start, shape=(bsz,), dtype=np.int32)
    if kv_len is not None:
        check("kv_len", kv_len, shape=(1,), dtype=np.int32)
        if tq != 1 or q.dtype == BF16:
            raise ValueError(f"kv_len: only for decode (Tq = 1, float32 q), got Tq={tq}, q {q.dtype}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if kind == "numpy":
        if kv_len is not None:
            if not 1 <= int(kv_len[0]) <= k.shape[2]:
                raise ValueError(f"kv_len: must be from 1 to Tk={k.shape[2]}, got {int(kv_len[0])}")
            k, v = k[:, :, : int(kv_len[0])], v[:, :, : int(kv_len[0])]
        return attention_reference(q, k, v, causal, scale, kv_start)
    if d & (d - 1) or d > 256:
        raise ValueError(f"q: head dim must be a power of two up to 256 on the GPU, got {d}")
    return _attention_cupy(q, k, v, causal, scale, kv_start, kv_len)
