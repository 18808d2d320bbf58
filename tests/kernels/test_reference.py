"""The numpy references (the specification) against independent float64 computations."""
import math

import numpy as np
import pytest
from numerics import rel_err

import tilekernels as tk
from tilekernels.sampling import kept, penalized

SIZES = [1, 7, 769, 1281]


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("n", SIZES)
def test_layernorm(rng, n):
    x, w, b = f32(rng, 5, n), f32(rng, n), f32(rng, n)
    x64 = x.astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    ref = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b
    y = tk.layernorm(x, w, b, 1e-5)
    assert y.dtype == np.float32 and rel_err(y, ref) <= 1e-6
    assert rel_err(tk.LayerNorm(w, b)(x), ref) <= 1e-6


@pytest.mark.parametrize("n", SIZES)
def test_rmsnorm(rng, n):
    x, w = f32(rng, 3, 2, n), f32(rng, n)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w
    assert rel_err(tk.rmsnorm(x, w, 1e-6), ref) <= 1e-6
    assert rel_err(tk.RMSNorm(w, 1e-6)(x), ref) <= 1e-6


@pytest.mark.parametrize("n", [2, 14, 770])
def test_linear_with_norm_swiglu_and_residual(rng, n):
    x, w, nw = f32(rng, 3, 7, 33), f32(rng, n, 33, scale=0.3), f32(rng, 33)
    r = f32(rng, 3, 7, n // 2)
    x64 = x.astype(np.float64)
    h = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * nw
    g, u = np.split(h @ w.T.astype(np.float64), 2, axis=-1)
    ref = r + g / (1 + np.exp(-g)) * u
    out = tk.linear(x, w, activation="swiglu", norm=tk.RMSNorm(nw, 1e-6), residual=r)
    assert out.dtype == np.float32 and out.shape == (3, 7, n // 2) and rel_err(out, ref) <= 1e-6


def test_linear_stores_a_residual_stream_twice_and_norms_take_bfloat16(rng):
    """out_dtype (float32, bfloat16): the result and its bfloat16 rounding; one dtype twice: the
    result twice. Norms and normed products take bfloat16 x as its float32 widening."""
    bf16 = tk.weights.BF16
    x, w, r = f32(rng, 2, 5, 33), f32(rng, 7, 33, scale=0.3), f32(rng, 2, 5, 7)
    one = tk.linear(x, w, residual=r)
    y, y16 = tk.linear(x, w, residual=r, out_dtype=(np.float32, bf16))
    np.testing.assert_array_equal(y, one)
    assert y16.dtype == bf16
    np.testing.assert_array_equal(y16, one.astype(bf16))
    for a in tk.linear(x, w, residual=r, out_dtype=(np.float32, np.float32)):
        np.testing.assert_array_equal(a, one)
    with pytest.raises(ValueError, match="out_dtype: a pair is"):
        tk.linear(x, w, out_dtype=(bf16, np.float32))
    wide = y16.astype(np.float32)
    nw = f32(rng, 7)
    np.testing.assert_array_equal(tk.rmsnorm(y16, nw), tk.rmsnorm(wide, nw))
    np.testing.assert_array_equal(tk.layernorm(y16, nw, nw), tk.layernorm(wide, nw, nw))
    np.testing.assert_array_equal(tk.linear(y16, w.T.copy(), norm=tk.RMSNorm(nw)),
                                  tk.linear(wide, w.T.copy(), norm=tk.RMSNorm(nw)))
    y_, y16_, xs = tk.linear(x, w, residual=r, out_dtype=(np.float32, bf16), scaled_by=nw)    # scaled for a next norm
    np.testing.assert_array_equal(y_, one)
    np.testing.assert_array_equal(y16_, y16)
    assert y_.dtype == np.float32 and xs.dtype == bf16
    np.testing.assert_array_equal(xs, (wide * nw).astype(bf16))
    np.testing.assert_array_equal(tk.linear(y16, w.T.copy(), norm=tk.RMSNorm(nw), scaled=xs),
                                  tk.linear(y16, w.T.copy(), norm=tk.RMSNorm(nw)))


@pytest.mark.parametrize("n", SIZES)
def test_gelu_silu_swiglu(rng, n):
    x, u = f32(rng, n, scale=4.0), f32(rng, n)
    x64 = x.astype(np.float64)
    # the cancellation-free forms: 1 + erf(z) = erfc(-z), 1 + tanh(u) = 2 sigmoid(2u)
    exact = 0.5 * x64 * np.vectorize(math.erfc)(-x64 / math.sqrt(2))
    with np.errstate(over="ignore"):
        tanh = x64 / (1 + np.exp(-2 * math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    silu = x64 / (1 + np.exp(-x64))
    assert rel_err(tk.gelu(x, approximate="none"), exact) <= 1e-6
    assert rel_err(tk.gelu(x), tanh) <= 1e-6
    assert rel_err(tk.silu(x), silu) <= 1e-6
    assert rel_err(tk.swiglu(x, u), silu * u) <= 1e-6


def test_exact_gelu_is_pointwise_accurate():
    """The erfc fit behind exact GELU is good to fp32 rounding, tails included."""
    x = np.linspace(-12, 12, 20001).astype(np.float32)
    x64 = x.astype(np.float64)
    exact = 0.5 * x64 * np.vectorize(math.erfc)(-x64 / math.sqrt(2))
    got = tk.gelu(x, approximate="none").astype(np.float64)
    big = np.abs(exact) > 1e-30
    assert np.max(np.abs(got[big] - exact[big]) / np.abs(exact[big])) < 5e-7


@pytest.mark.parametrize("m,k,n", [(1, 7, 1), (7, 769, 13), (16, 1281, 769), (33, 64, 7)])
@pytest.mark.parametrize("act", [None, "gelu", "gelu_tanh", "relu", "sigmoid"])
def test_linear(rng, m, k, n, act):
    """The product against float64, then the fused activation against float64 applied to that
    product: a one-element output deep in GELU's tail would turn the product's last-bit
    rounding into a large relative error, whatever the activation's accuracy. The product's error
    is measured against the sum of its terms' magnitudes: a single output (M = N = 1) whose terms
    cancel has no relative error bound in float32."""
    x, w, b = f32(rng, m, k), f32(rng, n, k), f32(rng, n)
    pre = tk.linear(x, w, b)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    scale = np.abs(x64) @ np.abs(w64).T + np.abs(b)
    assert np.all(np.abs(pre - (x64 @ w64.T + b)) <= 1e-5 * scale)
    ref = pre.astype(np.float64)
    if act == "gelu":
        ref = 0.5 * ref * np.vectorize(math.erfc)(-ref / math.sqrt(2))
    elif act == "gelu_tanh":
        with np.errstate(over="ignore"):
            ref = ref / (1 + np.exp(-2 * math.sqrt(2 / math.pi) * (ref + 0.044715 * ref ** 3)))
    elif act == "relu":
        ref = np.maximum(ref, 0)
    elif act == "sigmoid":
        ref = 1 / (1 + np.exp(-ref))
    assert rel_err(tk.linear(x, w, b, activation=act), ref) <= 1e-5
    assert tk.linear(x.reshape(1, m, k), w).shape == (1, m, n)


def test_sample_top_k_keeps_ties_and_top_p_the_smallest_nucleus():
    x = np.array([[1.0, 3.0, 3.0, 2.0, 0.0]], np.float32)
    assert kept(x, 1.0, 2, 1.0).tolist() == [[False, True, True, False, False]]
    assert kept(x, 1.0, 1, 1.0).sum() == 2                  # the k-th largest is tied: both stay
    assert kept(x, 1.0, 0, 1.0).all() and kept(x, 1.0, 5, 1.0).all()
    p = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    assert kept(p, 1.0, 0, 0.75).tolist() == [[True, True, False, False]]
    assert kept(p, 1.0, 0, 0.8).tolist() == [[True, True, False, False]]     # 0.5 + 0.3 reaches 0.8
    assert kept(p, 1.0, 0, 0.01).sum() == 1                 # always the largest
    assert kept(p, 1.0, 0, 0.84).tolist() == [[True, True, True, False]]
    assert kept(p, 1.0, 3, 0.84).tolist() == [[True, True, False, False]]   # 0.8 >= 0.84 of the 0.95 top-k left
    assert kept(p, 1.0, 0, 0.6).tolist() == [[True, True, False, False]]
    assert kept(p, 0.5, 0, 0.6).tolist() == [[True, False, False, False]]   # colder: the first holds 0.68


def test_sample_draws_the_inverse_cdf():
    """Uniforms spread evenly over [0, 1) land on each kept token in proportion to its probability."""
    x = np.log(np.array([0.1, 0.6, 0.05, 0.25], np.float32))[None]
    u = ((np.arange(10000) + 0.5) / 10000).astype(np.float32)
    for temperature, top_k, want in ((1.0, 0, [0.1, 0.6, 0.05, 0.25]), (1.0, 2, [0, 0.6 / 0.85, 0, 0.25 / 0.85]),
                                     (0.5, 0, np.array([0.01, 0.36, 0.0025, 0.0625]) / 0.435)):
        y = [int(tk.sample(x, u[i:i + 1], temperature=temperature, top_k=top_k)[0]) for i in range(len(u))]
        assert np.abs(np.bincount(y, minlength=4) / len(u) - want).max() < 2e-4
    assert tk.sample(x, np.zeros(1, np.float32)).tolist() == [0]                 # the first kept index
    assert tk.sample(x, np.array([np.nextafter(np.float32(1), 0)])).tolist() == [3]
    assert tk.sample(x, np.ones(1, np.float32), top_k=2).tolist() == [3]          # 1 itself: the last kept


def test_sample_penalty_greedy_and_marks():
    x = np.array([[2.0, -2.0, 1.5], [0.5, 3.0, -1.0]], np.float32)
    seen = np.array([[1, 1, 0], [0, 1, 0]], np.uint8)
    assert penalized(x, seen, 2.0).tolist() == [[1.0, -4.0, 1.5], [0.5, 1.5, -1.0]]
    assert tk.sample(x, temperature=0, penalty=2.0, seen=seen).tolist() == [2, 1]
    assert seen.tolist() == [[1, 1, 1], [0, 1, 0]]
    assert tk.sample(x, temperature=0, penalty=8.0, seen=seen).tolist() == [0, 0]    # 3 / 8 < 0.5
    assert tk.sample(x, temperature=0).tolist() == [0, 1]


def test_sample_min_p_presence_frequency_and_bias():
    """min_p keeps what is at least min_p times as likely as the likeliest; presence and
    frequency penalties lower counted tokens (OpenAI's); the bias is added; chosen tokens are
    counted."""
    x = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    last = np.array([np.nextafter(np.float32(1), 0)])
    assert tk.sample(x, last).tolist() == [3]
    assert tk.sample(x, last, min_p=0.2).tolist() == [2]                 # 0.15 >= 0.1, 0.05 < 0.1
    assert tk.sample(x, last, min_p=0.7).tolist() == [0]                 # the likeliest always stays
    counts = np.array([[2, 0, 0, 0]], np.float32)
    assert tk.sample(x, temperature=0, frequency=0.1, counts=counts.copy()).tolist() == [0]
    assert tk.sample(x, temperature=0, frequency=0.3, counts=counts.copy()).tolist() == [1]    # -0.69 - 0.6 < -1.2
    assert tk.sample(x, temperature=0, presence=0.6, counts=counts.copy()).tolist() == [1]
    assert tk.sample(x, temperature=0, presence=0.6, frequency=-1.0, counts=counts.copy()).tolist() == [0]
    bias = np.array([[0, 0, 0, 5]], np.float32)
    marks = np.zeros((1, 4), np.float32)
    assert tk.sample(x, temperature=0, bias=bias, counts=marks).tolist() == [3] and marks.tolist() == [[0, 0, 0, 1]]
    with pytest.raises(ValueError, match="counts: needed"):
        tk.sample(x, temperature=0, presence=0.5)
    with pytest.raises(ValueError, match="min_p: expected"):
        tk.sample(x, temperature=0, min_p=1.5)


def test_sample_step_tail(rng):
    x, table = f32(rng, 2, 50), f32(rng, 50, 7)
    positions, counters = np.array([3, 8], np.int64), np.array([5], np.int32)
    rows = np.full((2, 7), np.nan, np.float32)
    ids = tk.sample(x, rng.random(2, dtype=np.float32), top_k=5, positions=positions, counters=counters,
                    embed=(table, None, rows))
    assert positions.tolist() == [4, 9] and counters.tolist() == [6] and np.array_equal(rows, table[ids])
    assert all(x[r, ids[r]] >= np.sort(x[r])[-5] for r in range(2))


@pytest.mark.parametrize("n", [1, 7, 769, 50257])
def test_logprobs(rng, n):
    """log_softmax at the chosen tokens and at the row's largest logits, largest first, ties to
    the smaller id; out= takes wider top buffers and leaves their extra columns alone."""
    x = f32(rng, 3, n) * 4
    tokens = rng.integers(0, n, 3)
    top = min(5, n)
    if n > 1:
        x[2, [n - 1, 0]] = 50.0             # a tie: id 0 comes first
    chosen, values, ids = tk.logprobs(x, tokens, top)
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum(-1, keepdims=True))
    assert chosen.dtype == values.dtype == np.float32 and ids.dtype == np.int64 and ids.shape == (3, top)
    assert np.allclose(chosen, ref[np.arange(3), tokens], rtol=1e-6, atol=1e-6)
    for r in range(3):
        want = sorted(range(n), key=lambda i: (-x[r, i], i))[:top]
        assert ids[r].tolist() == want
        assert np.allclose(values[r], ref[r, want], rtol=1e-6, atol=1e-6)
    assert np.allclose(np.exp(ref).sum(-1), 1.0)
    out = (np.full(3, np.nan, np.float32), np.full((3, 20), 7, np.float32), np.full((3, 20), -1, np.int64))
    assert tk.logprobs(x, tokens, top, out=out) is out
    assert np.array_equal(out[0], chosen) and np.array_equal(out[2][:, :top], ids) and (out[2][:, top:] == -1).all()
    assert tk.logprobs(x, tokens)[1].shape == (3, 0)
    for bad in (-1, 21, n + 1, 2.0, True):
        with pytest.raises(ValueError, match="top must be"):
            tk.logprobs(x, tokens, bad)
    with pytest.raises(ValueError, match="tokens must be"):
        tk.logprobs(x, np.full(3, n, np.int64))


@pytest.mark.parametrize("n", SIZES + [50257])
def test_argmax(rng, n):
    x = f32(rng, 3, n)
    x[1, n // 2:] = x[1].max()          # ties: the first index wins
    assert np.array_equal(tk.argmax(x), np.argmax(x, -1))
    out = np.full(3, -1, np.int64)
    assert tk.argmax(x, out=out) is out and np.array_equal(out, np.argmax(x, -1))
    assert tk.argmax(x[0]).shape == () and int(tk.argmax(x[0])) == int(np.argmax(x[0]))


def test_argmax_step_tail(rng):
    """positions and counters advance by one; embed gathers the chosen rows at the new positions."""
    x, table, pos_table = f32(rng, 3, 50), f32(rng, 50, 7), f32(rng, 9, 7)
    positions, counters = np.array([0, 4, 7], np.int64), np.array([5, 9], np.int32)
    rows = np.full((3, 7), np.nan, np.float32)
    ids = tk.argmax(x, positions=positions, counters=counters, embed=(table, pos_table, rows))
    assert positions.tolist() == [1, 5, 8] and counters.tolist() == [6, 10] and counters.dtype == np.int32
    assert np.array_equal(rows, table[np.argmax(x, -1)] + pos_table[[1, 5, 8]])
    tk.argmax(x, embed=(table, None, rows))
    assert np.array_equal(rows, table[ids]) and positions.tolist() == [1, 5, 8]


@pytest.mark.parametrize("n", SIZES + [50257])
def test_softmax(rng, n):
    x = f32(rng, 3, n, scale=10.0)
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(-1, keepdims=True))
    assert rel_err(tk.softmax(x), e / e.sum(-1, keepdims=True)) <= 1e-6
    e0 = np.exp(x64 - x64.max(0, keepdims=True))
    assert rel_err(tk.softmax(x, axis=0), e0 / e0.sum(0, keepdims=True)) <= 1e-6


def _rope64(x, pos, rd, theta):
    inv = 1.0 / theta ** (np.arange(0, rd, 2) / rd)
    ang = pos[..., None].astype(np.float64) * inv           # (B, T, rd/2)
    cos, sin = np.cos(ang)[:, :, None, :], np.sin(ang)[:, :, None, :]
    out = x.astype(np.float64).copy()
    x1, x2 = x[..., : rd // 2].astype(np.float64), x[..., rd // 2: rd].astype(np.float64)
    out[..., : rd // 2] = x1 * cos - x2 * sin
    out[..., rd // 2: rd] = x2 * cos + x1 * sin
    return out


@pytest.mark.parametrize("heads,d,rd", [(1, 8, 8), (3, 64, 32), (4, 128, 128)])
def test_rope_partial_and_positions(rng, heads, d, rd):
    x = f32(rng, 2, 7, heads, d)
    pos = np.stack([np.arange(7), np.arange(100, 107)])          # ragged starting points
    cos, sin = tk.rope_cos_sin(pos, rd, 10000.0)
    y = tk.rope(x, cos, sin, rd)
    assert rel_err(y, _rope64(x, pos, rd, 10000.0)) <= 1e-5
    np.testing.assert_array_equal(y[..., rd:], x[..., rd:])


def _attn64(q, k, v, causal, scale):
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, 1).astype(np.float64), np.repeat(v, g, 1).astype(np.float64)
    s = q.astype(np.float64) @ k.transpose(0, 1, 3, 2) * scale
    tq, tk_ = q.shape[2], k.shape[2]
    if causal:
        s[..., np.arange(tk_)[None, :] > np.arange(tq)[:, None] + tk_ - tq] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("tq,tk_,causal", [(1, 1, True), (7, 7, True), (5, 77, True), (1, 769, True),
                                           (13, 29, False)])
def test_attention_gqa_causal_offset(rng, tq, tk_, causal):
    q, k, v = f32(rng, 2, 4, tq, 16), f32(rng, 2, 2, tk_, 16), f32(rng, 2, 2, tk_, 16)
    got = tk.attention(q, k, v, causal=causal, scale=0.3)
    assert rel_err(got, _attn64(q, k, v, causal, 0.3)) <= 1e-5


def test_attention_of_bfloat16_inputs_is_bfloat16(rng):
    """bfloat16 q, k, v give the float32 attention of their values, rounded to bfloat16; split_qkv
    hands q over in bfloat16 the same way (rounded once, from the float32 q)."""
    bf16 = tk.weights.BF16
    q, k, v = (f32(rng, 2, 4, t, 16).astype(bf16) for t in (7, 9, 9))
    got = tk.attention(q, k, v, causal=True)
    assert got.dtype == bf16
    wide = tk.attention(*(a.astype(np.float32) for a in (q, k, v)), causal=True)
    np.testing.assert_array_equal(got, wide.astype(bf16))
    qkv = f32(rng, 2, 3, 8 * 8)
    caches = [np.zeros((2, 2, 6, 8), bf16) for _ in range(2)]
    q16 = tk.split_qkv(qkv, *caches, np.array([1], np.int32), 4, q_dtype=bf16)
    q32 = tk.split_qkv(qkv, *[np.zeros((2, 2, 6, 8), np.float32) for _ in range(2)], np.array([1], np.int32), 4)
    assert q16.dtype == bf16
    np.testing.assert_array_equal(q16, q32.astype(bf16))
    half = qkv.astype(bf16)         # a bfloat16 projection: as its float32 widening
    for q_dtype in (np.float32, bf16):
        np.testing.assert_array_equal(
            tk.split_qkv(half, *[np.zeros((2, 2, 6, 8), bf16) for _ in range(2)], np.array([1], np.int32), 4,
                         q_dtype=q_dtype),
            tk.split_qkv(half.astype(np.float32), *[np.zeros((2, 2, 6, 8), bf16) for _ in range(2)],
                         np.array([1], np.int32), 4, q_dtype=q_dtype))


@pytest.mark.parametrize("t,stride", [(7, 1), (7, 2), (30, 2), (1, 1)])
def test_conv1d(rng, t, stride):
    x, w, b = f32(rng, 2, 5, t), f32(rng, 6, 5, 3), f32(rng, 6)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1)))
    t_out = (t + 2 - 3) // stride + 1
    ref = np.zeros((2, 6, t_out))
    for o in range(t_out):
        ref[:, :, o] = np.einsum("bck,ock->bo", xp[:, :, o * stride: o * stride + 3], w) + b
    assert rel_err(tk.conv1d(x, w, b, stride=stride, padding=1), ref) <= 1e-6
    view = np.ascontiguousarray(x.transpose(0, 2, 1)).transpose(0, 2, 1)      # what the GPU path returns
    assert rel_err(tk.conv1d(view, w, b, stride=stride, padding=1), ref) <= 1e-6


def test_attention_left_padding_equals_unpadded(rng):
    """Real rows of a left-padded sequence attend exactly as the unpadded sequence does."""
    q, k, v = f32(rng, 2, 2, 9, 8), f32(rng, 2, 2, 9, 8), f32(rng, 2, 2, 9, 8)
    start = np.array([0, 4], np.int32)
    got = tk.attention(q, k, v, causal=True, kv_start=start)
    c = np.ascontiguousarray
    alone = tk.attention(c(q[1:, :, 4:]), c(k[1:, :, 4:]), c(v[1:, :, 4:]), causal=True)
    np.testing.assert_allclose(got[1:, :, 4:], alone, rtol=1e-5, atol=1e-6)
    assert np.isfinite(got).all()
    decode = tk.attention(c(q[:, :, -1:]), k, v, causal=True, kv_start=start)
    np.testing.assert_allclose(decode, got[:, :, -1:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_fold_norm_keeps_the_projection(rng, norm):
    x = (rng.standard_normal((5, 40)) + 7).astype(np.float32)
    w, b = rng.standard_normal((24, 40)).astype(np.float32), rng.standard_normal(24).astype(np.float32)
    g, beta = rng.standard_normal(40).astype(np.float32), rng.standard_normal(40).astype(np.float32)
    n = tk.LayerNorm(g, beta, 1e-5) if norm == "layer" else tk.RMSNorm(g, 1e-5)
    plain, fw, fb = tk.fold_norm(n, w, b)
    assert not plain.affine and plain.eps == n.eps
    assert rel_err(tk.linear(x, fw, fb, norm=plain), tk.linear(x, w, b, norm=n)) <= 1e-6
    assert tk.fold_norm(plain, fw, fb)[1] is fw        # nothing left to fold


def test_split_qkv_rotates_and_stores(rng):
    b, t, hq, hkv, d = 2, 3, 4, 2, 8
    qkv = rng.standard_normal((b, t, (hq + 2 * hkv) * d)).astype(np.float32)
    kc, vc = np.zeros((b, hkv, 6, d), np.float32), np.zeros((b, hkv, 6, d), np.float32)
    table = tk.rope_cos_sin(np.arange(6), 4)
    kv_start = np.array([0, 1], np.int32)                       # sequence 1 is left padded by one
    q = tk.split_qkv(qkv, kc, vc, np.array([2], np.int32), hq, *table, rotary_dim=4, kv_start=kv_start)
    heads = qkv.reshape(b, t, hq + 2 * hkv, d)
    cos, sin = tk.rope_cos_sin(np.arange(2, 2 + t)[None] - kv_start[:, None], 4)     # slot - kv_start

    def rotated(a):
        return tk.rope(np.ascontiguousarray(a), cos, sin, 4).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(q, rotated(heads[:, :, :hq]), rtol=1e-6)
    np.testing.assert_allclose(kc[:, :, 2:5], rotated(heads[:, :, hq:hq + hkv]), rtol=1e-6)
    np.testing.assert_array_equal(vc[:, :, 2:5], heads[:, :, hq + hkv:].transpose(0, 2, 1, 3))
    assert not kc[:, :, :2].any() and not vc[:, :, 5:].any()


@pytest.mark.parametrize("rope", [0, 4, 8])
def test_decode_attention_is_split_qkv_then_attention(rng, rope):
    """One new token per sequence: its k, v land at slot `start` (k rotated at position
    start - kv_start), and q (rotated too) attends to slots kv_start..start, in float64."""
    b, hq, hkv, d, t_max, s = 2, 4, 2, 8, 9, 6
    qkv = f32(rng, b, 1, (hq + 2 * hkv) * d)
    kc, vc = f32(rng, b, hkv, t_max, d), f32(rng, b, hkv, t_max, d)
    k0, v0 = kc.copy(), vc.copy()
    kv_start = np.array([0, 2], np.int32)
    table = tk.rope_cos_sin(np.arange(t_max), rope) if rope else (None, None)
    out = tk.decode_attention(qkv, kc, vc, np.array([s], np.int32), hq, 0.3, kv_start, *table, rope or None)
    x = qkv.reshape(b, hq + 2 * hkv, d).astype(np.float64)
    for i in range(b):
        q, k, v = x[i, :hq], x[i, hq:hq + hkv], x[i, hq + hkv:]
        if rope:
            half, angle = rope // 2, (s - kv_start[i]) * 10000.0 ** (-np.arange(0, rope, 2) / rope)

            def rot(a):
                a = a.copy()
                a1, a2 = a[:, :half].copy(), a[:, half:rope].copy()
                a[:, :half] = a1 * np.cos(angle) - a2 * np.sin(angle)
                a[:, half:rope] = a2 * np.cos(angle) + a1 * np.sin(angle)
                return a
            q, k = rot(q), rot(k)
        np.testing.assert_allclose(kc[i, :, s], k, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(vc[i, :, s], v)
        keys = np.concatenate([k0[i, :, kv_start[i]:s], k[:, None]], axis=1)
        vals = np.concatenate([v0[i, :, kv_start[i]:s], v[:, None]], axis=1)
        for h in range(hq):
            w = np.exp(0.3 * keys[h // 2] @ q[h] - (0.3 * keys[h // 2] @ q[h]).max())
            assert rel_err(out[i, h, 0], w @ vals[h // 2] / w.sum()) <= 1e-5
    others = np.arange(t_max) != s
    np.testing.assert_array_equal(kc[:, :, others], k0[:, :, others])


def test_fold_layernorm_without_bias(rng):
    x = rng.standard_normal((3, 16)).astype(np.float32)
    w, g = rng.standard_normal((5, 16)).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    plain, fw, fb = tk.fold_norm(tk.LayerNorm(g, None), w)
    assert fb is None
    assert rel_err(tk.linear(x, fw, norm=plain), tk.linear(x, w, norm=tk.LayerNorm(g, None))) <= 1e-6


@pytest.mark.parametrize("c", SIZES)
def test_embedding_rows_plus_positions(rng, c):
    table, pos = f32(rng, 50, c), f32(rng, 9, c)
    ids, positions = rng.integers(0, 50, (2, 9)), np.tile(np.arange(9), (2, 1))
    assert tk.embedding(ids, table).shape == (2, 9, c)
    assert np.array_equal(tk.embedding(ids, table), table[ids])
    ref = table[ids].astype(np.float64) + pos[positions]
    assert rel_err(tk.embedding(ids.astype(np.int32), table, positions, pos), ref) <= 1e-7


def test_compact_keeps_exactly_the_bfloat16_matrices(rng):
    """A float32 matrix of bfloat16 values compacts to bfloat16 and widens back bit for bit;
    one value off the bfloat16 grid keeps the matrix float32."""
    w = rng.standard_normal((33, 17)).astype(tk.weights.BF16).astype(np.float32)
    c = tk.compact(w)
    assert c.dtype == tk.weights.BF16
    np.testing.assert_array_equal(tk.widen(c), w)
    w[3, 5] = np.nextafter(w[3, 5], np.float32(np.inf))
    assert tk.compact(w) is w
    assert tk.compact(w.astype(np.float64)).dtype == np.float64


def test_stack_rows_keeps_each_dtype(rng):
    """Stacked q, k and v rows: float32 as np.concatenate gives them, bfloat16 bit for bit."""
    parts = [rng.standard_normal((n, 5)).astype(np.float32) for n in (1, 7, 3)]
    assert np.array_equal(tk.stack_rows(parts), np.concatenate(parts))
    halves = [p.astype(tk.weights.BF16) for p in parts]
    got = tk.stack_rows(halves)
    assert got.dtype == tk.weights.BF16 and got.shape == (11, 5)
    assert np.array_equal(tk.widen(got), np.concatenate([tk.widen(h) for h in halves]))


def test_ops_take_bfloat16_weights(rng):
    """linear and embedding give the same result for a bfloat16 weight as for its float32 copy."""
    x = rng.standard_normal((3, 40)).astype(np.float32)
    w = tk.compact(rng.standard_normal((24, 40)).astype(tk.weights.BF16).astype(np.float32))
    g = rng.standard_normal(40).astype(np.float32)
    np.testing.assert_array_equal(tk.linear(x, w, norm=tk.RMSNorm(g)), tk.linear(x, tk.widen(w), norm=tk.RMSNorm(g)))
    ids = np.array([[0, 5, 23]])
    np.testing.assert_array_equal(tk.embedding(ids, w), tk.widen(w)[ids])


def test_sample_settings_per_row_equal_each_row_alone():
    """Settings given per row (arrays) draw, row by row, what each row's settings draw alone."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 97)) * 2).astype(np.float32)
    u = rng.random(5, dtype=np.float32)
    cfg = dict(temperature=np.array([0, 1.0, 0.7, 1.3, 0], np.float32), top_k=np.array([0, 5, 0, 20, 3], np.int32),
               top_p=np.array([1, 1, 0.6, 0.9, 1], np.float32), penalty=np.array([1, 1.5, 1, 1, 2], np.float32))
    seen = (rng.random((5, 97)) < 0.2).astype(np.uint8)
    got = tk.sample(x, u, seen=seen.copy(), **cfg)
    for r in range(5):
        one = {k: v[r].item() for k, v in cfg.items()}
        assert got[r] == tk.sample(x[r:r + 1], u[r:r + 1], seen=seen[r:r + 1].copy(), **one)[0]
    assert len(set(got.tolist())) > 2


def lstm64(gates, w_hh, h, c):
    """torch.nn.LSTM's recurrence (gates i, f, g, o) in float64."""
    sig = lambda v: 1 / (1 + np.exp(-v))        # noqa: E731
    hid = w_hh.shape[1]
    hs = []
    for g in gates.astype(np.float64):
        g = g + h @ w_hh.T.astype(np.float64)
        c = sig(g[:, hid:2 * hid]) * c + sig(g[:, :hid]) * np.tanh(g[:, 2 * hid:3 * hid])
        h = sig(g[:, 3 * hid:]) * np.tanh(c)
        hs.append(h)
    return np.stack(hs), h, c


@pytest.mark.parametrize("t,b,hid", [(1, 1, 16), (7, 3, 32), (300, 37, 128)])
def test_lstm(rng, t, b, hid):
    """Against float64, from zeros and from a given state; T steps in two calls (the state handed
    on) are one call of T steps."""
    gates, w = f32(rng, t, b, 4 * hid), (f32(rng, 4 * hid, hid) / np.sqrt(hid)).astype(np.float32)
    h0, c0 = f32(rng, b, hid), f32(rng, b, hid)
    for state in ((None, None), (h0, c0)):
        hs, h, c = tk.lstm(gates, w, *state)
        ref = lstm64(gates, w, *(np.zeros((b, hid)) if s is None else s for s in state))
        for got, want in zip((hs, h, c), ref):
            assert got.dtype == np.float32 and rel_err(got, want) <= 1e-5
    k = t // 2
    hs1, h1, c1 = tk.lstm(gates[:k], w, h0, c0)
    hs2, h2, c2 = tk.lstm(gates[k:], w, h1, c1)
    hs, h, c = tk.lstm(gates, w, h0, c0)
    assert np.array_equal(np.concatenate([hs1, hs2]), hs) and np.array_equal(h2, h) and np.array_equal(c2, c)


def test_lstm_refuses_bad_shapes(rng):
    with pytest.raises(ValueError, match="power of two"):
        tk.lstm(f32(rng, 2, 3, 4 * 24), f32(rng, 96, 24))
    with pytest.raises(ValueError, match=r"weight_hh: expected shape \(128, 32\)"):
        tk.lstm(f32(rng, 2, 3, 128), f32(rng, 128, 16))
    with pytest.raises(ValueError, match=r"h0: expected shape \(3, 32\)"):
        tk.lstm(f32(rng, 2, 3, 128), f32(rng, 128, 32), f32(rng, 2, 32))


def test_block_hands_attend_its_projection_in_qkv_dtype(rng):
    """Block(x, attend, qkv_dtype): attend gets the fused projection rounded to that dtype (the
    encoder's bfloat16 path), the rest of the layer as with float32; and the dtype its o
    projection takes (float32 weights: float32)."""
    bf16 = tk.weights.BF16
    c, heads, d = 8, 2, 4
    lin = [(f32(rng, n, k) * 0.3, f32(rng, n)) for n, k in ((3 * c, c), (c, c), (16, c), (c, 16))]
    block = tk.Block(tk.LayerNorm(None, None), lin[0], lin[1], tk.LayerNorm(None, None), lin[2], lin[3], "gelu")
    x = f32(rng, 2, 3, c)
    seen = {}

    def attend(qkv, out_dtype):
        assert out_dtype == np.float32
        seen[qkv.dtype] = qkv
        return np.ascontiguousarray(qkv[..., :c].astype(np.float32).reshape(2, 3, heads, d).transpose(0, 2, 1, 3))
    plain, narrow = block(x, attend), block(x, attend, qkv_dtype=bf16)
    np.testing.assert_array_equal(seen[bf16], seen[np.dtype(np.float32)].astype(bf16))
    assert rel_err(narrow, plain) < 1e-2
