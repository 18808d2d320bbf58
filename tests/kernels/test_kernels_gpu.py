"""Each cuTile kernel against the float64 computation, on fresh random inputs, with every
cupy allocation poisoned to NaN first so an unwritten output element fails the check."""
import numpy as np
import pytest
from numerics import rel_err

import tilekernels as tk

pytestmark = pytest.mark.gpu
FP32, TF32 = 1e-5, 1e-3


def pair(rng, *shape, scale=1.0):
    import cupy

    a = (rng.standard_normal(shape) * scale).astype(np.float32)
    return a, cupy.asarray(a)


@pytest.mark.parametrize("rows,n", [(1, 1), (7, 7), (769, 768), (33, 1281), (8, 2048), (3, 6144)])
def test_norms(poisoned, rng, rows, n):
    (x, gx), (r, gr), (w, gw), (b, gb) = (pair(rng, rows, n), pair(rng, rows, n), pair(rng, n), pair(rng, n))
    s64 = x.astype(np.float64) + r
    assert rel_err(tk.layernorm(gx, gw, gb), tk.layernorm(x, w, b)) <= FP32
    gs, gy = tk.add_layernorm(gx, gr, gw, gb)
    assert rel_err(gs, s64) <= FP32
    mu = s64.mean(-1, keepdims=True)
    assert rel_err(gy, (s64 - mu) / np.sqrt(((s64 - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b) <= FP32
    gs, gy = tk.add_rmsnorm(gx, gr, gw, 1e-5)
    assert rel_err(gy, s64 / np.sqrt((s64 ** 2).mean(-1, keepdims=True) + 1e-5) * w) <= FP32


@pytest.mark.parametrize("n", [1, 7, 769, 1281, 4096 * 3 + 5])
def test_activations(poisoned, rng, n):
    (x, gx), (u, gu) = pair(rng, n, scale=4.0), pair(rng, n)
    for name, got, ref in [
        ("gelu_tanh", tk.gelu(gx), tk.gelu(x)),
        ("gelu_erf", tk.gelu(gx, approximate="none"), tk.gelu(x, approximate="none")),
        ("silu", tk.silu(gx), tk.silu(x)),
        ("swiglu", tk.swiglu(gx, gu), tk.swiglu(x, u)),
    ]:
        assert rel_err(got, ref) <= FP32, name


@pytest.mark.parametrize("m", [1, 7, 16, 17, 769])
@pytest.mark.parametrize("k,n", [(7, 1), (768, 2304), (1281, 769), (5120, 4096)])
@pytest.mark.parametrize("act", [None, "gelu"])
def test_linear(poisoned, rng, m, k, n, act):
    (x, gx), (w, gw), (b, gb) = pair(rng, m, k), pair(rng, n, k), pair(rng, n)
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + b
    if act:
        ref = tk.gelu(ref.astype(np.float32), approximate="none")
    out = tk.linear(gx, gw, gb, activation=act)
    # TF32 rounds each operand to 2^-11: the error of a sum of products is bounded relative
    # to sum |x||w|, which matters when few outputs (M = N = 1) exhibit cancellation
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T + np.abs(b)
    assert np.linalg.norm(out.get() - ref) / np.linalg.norm(scale) <= TF32
    assert rel_err(out, ref) <= TF32 or m * n < 64


def test_linear_without_bias_tanh(poisoned, rng):
    (x, gx), (w, gw) = pair(rng, 5, 768), pair(rng, 3072, 768)
    assert rel_err(tk.linear(gx, gw, activation="gelu_tanh"), tk.linear(x, w, activation="gelu_tanh")) <= TF32


@pytest.mark.parametrize("rows,n", [(1, 1), (7, 769), (2, 50257), (4, 59264)])
def test_softmax(poisoned, rng, rows, n):
    x, gx = pair(rng, rows, n, scale=5.0)
    assert rel_err(tk.softmax(gx), tk.softmax(x)) <= FP32


@pytest.mark.parametrize("heads,d,rd", [(20, 64, 32), (16, 128, 128), (3, 8, 4)])
def test_rope(poisoned, rng, heads, d, rd):
    import cupy

    x, gx = pair(rng, 2, 37, heads, d)
    pos = np.stack([np.arange(37), np.arange(1000, 1037)])
    cos, sin = tk.rope_cos_sin(pos, rd)
    gcos, gsin = tk.rope_cos_sin(cupy.asarray(pos), rd)
    assert rel_err(gcos, cos) <= FP32
    assert rel_err(tk.rope(gx, gcos, gsin, rd), tk.rope(x, cos, sin, rd)) <= FP32


@pytest.mark.parametrize("b,hq,hkv,tq,tk_,d,causal", [
    (1, 1, 1, 1, 1, 64, True), (2, 4, 2, 7, 7, 64, True), (1, 12, 12, 769, 769, 64, True),
    (2, 16, 4, 33, 1281, 128, True), (1, 20, 20, 1500, 1500, 64, False), (3, 2, 1, 5, 9, 128, False),
    (1, 16, 4, 1, 4096, 128, True), (8, 12, 12, 1, 1024, 64, True), (2, 16, 4, 1, 777, 128, False),
])
def test_attention(poisoned, rng, b, hq, hkv, tq, tk_, d, causal):
    (q, gq), (k, gk), (v, gv) = pair(rng, b, hq, tq, d), pair(rng, b, hkv, tk_, d), pair(rng, b, hkv, tk_, d)
    ref = tk.attention(q, k, v, causal=causal)
    assert rel_err(tk.attention(gq, gk, gv, causal=causal), ref) <= TF32


def test_attention_on_cache_views(poisoned, rng):
    """k/v as prefixes of a longer pre-allocated cache (strided views), decode and chunk."""
    (kc, gkc), (vc, gvc) = pair(rng, 2, 4, 2048, 128), pair(rng, 2, 4, 2048, 128)
    for tq, t in [(1, 1000), (16, 555)]:
        q, gq = pair(rng, 2, 16, tq, 128)
        ref = tk.attention(q, np.ascontiguousarray(kc[:, :, :t]), np.ascontiguousarray(vc[:, :, :t]), causal=True)
        assert rel_err(tk.attention(gq, gkc[:, :, :t], gvc[:, :, :t], causal=True), ref) <= TF32


@pytest.mark.parametrize("b,cin,cout,t,stride", [(1, 128, 1280, 3000, 1), (1, 1280, 1280, 3000, 2),
                                                 (2, 7, 9, 13, 2), (1, 3, 5, 1, 1)])
def test_conv1d(poisoned, rng, b, cin, cout, t, stride):
    (x, gx), (w, gw), (bias, gb) = pair(rng, b, cin, t), pair(rng, cout, cin, 3), pair(rng, cout)
    ref = tk.conv1d(x, w, bias, stride=stride, padding=1, activation="gelu")
    assert rel_err(tk.conv1d(gx, gw, gb, stride=stride, padding=1, activation="gelu"), ref) <= TF32


@pytest.mark.parametrize("tq,tk_", [(40, 40), (1, 300), (3, 130)])
def test_attention_left_padding(poisoned, rng, tq, tk_):
    import cupy

    (q, gq), (k, gk), (v, gv) = pair(rng, 3, 8, tq, 64), pair(rng, 3, 2, tk_, 64), pair(rng, 3, 2, tk_, 64)
    start = np.array([0, 17, tk_ - tq], np.int32)
    ref = tk.attention(q, k, v, causal=True, kv_start=start)
    got = tk.attention(gq, gk, gv, causal=True, kv_start=cupy.asarray(start))
    assert rel_err(got, ref) <= TF32


def test_decode_with_device_length(poisoned, rng):
    """kv_len in device memory: the full cache is passed, only the first kv_len keys count."""
    import cupy

    (q, gq), (k, gk), (v, gv) = pair(rng, 2, 16, 1, 128), pair(rng, 2, 4, 1024, 128), pair(rng, 2, 4, 1024, 128)
    for n in (1, 63, 64, 65, 700, 1024):
        ref = tk.attention(q, np.ascontiguousarray(k[:, :, :n]), np.ascontiguousarray(v[:, :, :n]), causal=True)
        got = tk.attention(gq, gk, gv, causal=True, kv_len=cupy.full(1, n, cupy.int32))
        assert rel_err(got, ref) <= TF32, n
