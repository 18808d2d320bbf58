"""Dispatch and argument validation: errors name the argument, what was expected, what came."""
import numpy as np
import pytest

import tilekernels as tk

x = np.zeros((4, 8), np.float32)
w = np.ones(8, np.float32)


class ndarray:  # noqa: N801
    """Stands in for a cupy array (same module and class name) to test mixing without a GPU."""
    __module__ = "cupy._core.core"


FakeCupy = ndarray


def test_numpy_in_numpy_out():
    y = tk.layernorm(x + 1, w, w)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == x.shape


@pytest.mark.parametrize("call,match", [
    (lambda: tk.layernorm(x.astype(np.float64), w, w), "x: expected dtype float32 or bfloat16, got float64"),
    (lambda: tk.layernorm(x, np.ones(7, np.float32), w), r"weight: expected shape \(8\), got \(7,\)"),
    (lambda: tk.rmsnorm(x[:, ::2], w[:4]), "x: expected a C-contiguous array"),
    (lambda: tk.linear(x, np.ones((3, 7), np.float32)), r"weight: expected shape \(\*, 8\)"),
    (lambda: tk.linear(x, np.ones((3, 8), np.float32), activation="tanh"), "activation: expected one of"),
    (lambda: tk.linear(x, np.ones((3, 8), np.float32), activation="swiglu"), "swiglu' needs the gate and up rows"),
    (lambda: tk.linear(x, np.ones((4, 8), np.float32), np.ones(4, np.float32), activation="swiglu"),
     "swiglu' takes no bias"),
    (lambda: tk.linear(x, np.ones((4, 8), np.float32), norm=(w, w)), "norm: expected a LayerNorm or RMSNorm"),
    (lambda: tk.linear(x, np.ones((4, 8), np.float32), norm=tk.RMSNorm(w[:5])), r"norm weight: expected shape \(8\)"),
    (lambda: tk.linear(x, np.ones((4, 8), np.float32), residual=np.ones((2, 3), np.float32)),
     r"residual: expected shape"),
    (lambda: tk.linear(x, np.ones((4, 8), np.float32), scaled_by=np.ones(4, np.float32)),
     r"scaled_by: needs out_dtype \(float32, bfloat16\)"),
    (lambda: tk.linear(x, np.ones((4, 8), np.float32), norm=tk.RMSNorm(w), out_dtype=(np.float32, tk.weights.BF16),
                       scaled_by=np.ones(4, np.float32)), "scaled_by: a product without a norm of its own"),
    (lambda: tk.linear(x, np.ones((4, 8), np.float32), scaled=tk.weights.to_bf16(x)),
     "scaled: x times an RMSNorm's weight"),
    (lambda: tk.linear(x, np.ones((4, 8), np.float32), norm=tk.RMSNorm(w), scaled=x), "scaled: expected dtype bfloat16"),
    (lambda: tk.set_matmul_precision("low"), "matmul precision: expected one of"),
    (lambda: tk.split_qkv(np.zeros((1, 2, 40), np.float32), *[np.zeros((1, 2, 4, 8), np.float32)] * 2,
                          np.zeros(1, np.int32), 4), r"qkv: expected last dimension \(heads \+ 2 \* kv heads\)"),
    (lambda: tk.split_qkv(np.zeros((1, 2, 64), np.float32), *[np.zeros((1, 2, 4, 8), np.float32)] * 2,
                          np.array([3], np.int32), 4), r"start: positions 3..4 do not fit a cache of 4"),
    (lambda: tk.split_qkv(np.zeros((1, 2, 64), np.float32), *[np.zeros((1, 2, 4, 8), np.float32)] * 2,
                          np.zeros(1, np.int64), 4), "start: expected dtype int32"),
    (lambda: tk.decode_attention(np.zeros((1, 2, 64), np.float32), *[np.zeros((1, 2, 4, 8), np.float32)] * 2,
                                 np.zeros(1, np.int32), 4), r"qkv: expected one new token per sequence"),
    (lambda: tk.decode_attention(np.zeros((1, 1, 56), np.float32), *[np.zeros((1, 2, 4, 8), np.float32)] * 2,
                                 np.zeros(1, np.int32), 3), r"with heads a multiple of kv heads, got 56"),
    (lambda: tk.decode_attention(np.zeros((1, 1, 64), np.float32), *[np.zeros((1, 2, 4, 8), np.float32)] * 2,
                                 np.array([4], np.int32), 4), "start: slot 4 is outside a cache of 4"),
    (lambda: tk.decode_attention(np.zeros((1, 1, 64), np.float32), *[np.zeros((1, 2, 4, 8), np.float32)] * 2,
                                 np.zeros(1, np.int32), 4, cos=np.zeros((3, 4), np.float32),
                                 sin=np.zeros((3, 4), np.float32)), "cos: expected a table of at least 4 positions"),
    (lambda: tk.layernorm(x, None, w), "bias: a norm with a bias needs its weight too"),
    (lambda: tk.fold_norm((w, w), np.ones((4, 8), np.float32)), "norm: expected a LayerNorm or RMSNorm"),
    (lambda: tk.fold_norm(tk.RMSNorm(w), np.ones((4, 5), np.float32)), r"weight: expected shape \(\*, 8\)"),
    (lambda: tk.gelu(x, approximate="fast"), "approximate: expected 'tanh' or 'none'"),
    (lambda: tk.attention(np.zeros((1, 3, 2, 8), np.float32), np.zeros((1, 2, 2, 8), np.float32),
                          np.zeros((1, 2, 2, 8), np.float32)), "multiple of key/value heads"),
    (lambda: tk.attention(np.zeros((1, 2, 5, 8), np.float32), np.zeros((1, 2, 3, 8), np.float32),
                          np.zeros((1, 2, 3, 8), np.float32), causal=True), "Tq <= Tk"),
    (lambda: tk.attention(np.zeros((2, 8), np.float32), x, x), "q: expected 4 dimensions"),
    (lambda: tk.attention(np.zeros((1, 2, 2, 8), tk.weights.BF16), np.zeros((1, 2, 2, 8), np.float32),
                          np.zeros((1, 2, 2, 8), np.float32)), "bfloat16 queries need bfloat16 keys and values"),
    (lambda: tk.attention(*[np.zeros((1, 2, 1, 8), tk.weights.BF16)] * 3, kv_len=np.ones(1, np.int32)),
     r"kv_len: only for decode \(Tq = 1, float32 q\)"),
    (lambda: tk.split_qkv(np.zeros((1, 2, 64), np.float32), *[np.zeros((1, 2, 4, 8), np.float32)] * 2,
                          np.zeros(1, np.int32), 4, q_dtype=np.float16), "q_dtype: expected float32 or bfloat16"),
    (lambda: tk.conv1d(np.zeros((1, 4, 2), np.float32), np.zeros((5, 4, 3), np.float32)), "too short"),
    (lambda: tk.rope(np.zeros((1, 2, 1, 8), np.float32), np.zeros((2, 4), np.float32),
                     np.zeros((2, 4), np.float32), rotary_dim=7), "rotary_dim: expected an even"),
    (lambda: tk.softmax(x, axis=2), "axis: expected"),
    (lambda: tk.silu([1.0, 2.0]), "x: expected a numpy or cupy array, got list"),
    (lambda: tk.swiglu(x, FakeCupy()), "all be numpy or all be cupy"),
    (lambda: tk.embedding(np.zeros(3, np.float32), x), "ids: expected an integer array, got float32"),
    (lambda: tk.argmax(x.astype(np.float64)), "x: expected dtype float32, got float64"),
    (lambda: tk.linear(x, np.zeros((3, 8), np.float16)), "weight: expected dtype float32 or bfloat16, got float16"),
    (lambda: tk.argmax(x, positions=np.zeros(4, np.int32)), "positions: expected dtype int64, got int32"),
    (lambda: tk.argmax(x, counters=np.zeros(5000, np.int32)), r"counters: expected 1..4096 elements"),
    (lambda: tk.argmax(x[None], counters=np.zeros(2, np.int32)), r"x: positions, counters and embed need 2-D"),
    (lambda: tk.argmax(x, embed=(x, x, np.zeros((4, 8), np.float32))), "embed: a pos_table needs positions"),
    (lambda: tk.argmax(x, embed=(x, None, np.zeros((4, 7), np.float32))), r"embed out: expected shape \(4, 8\)"),
    (lambda: tk.argmax(np.zeros((2, 0), np.float32)), r"x: expected a non-empty last axis, got shape \(2, 0\)"),
    (lambda: tk.argmax(x, out=np.zeros(4, np.int32)), "out: expected dtype int64, got int32"),
    (lambda: tk.argmax(x, out=np.zeros(3, np.int64)), r"out: expected shape \(4\), got \(3,\)"),
    (lambda: tk.sample(x), "uniforms: needed when temperature > 0"),
    (lambda: tk.sample(x, np.zeros(3, np.float32)), r"uniforms: expected shape \(4\), got \(3,\)"),
    (lambda: tk.sample(x, temperature=0, penalty=1.2), "seen: needed when penalty != 1"),
    (lambda: tk.sample(x, temperature=0, seen=np.zeros((4, 8), bool)), "seen: expected dtype uint8, got bool"),
    (lambda: tk.sample(x, temperature=-1), "temperature: expected >= 0, got -1"),
    (lambda: tk.sample(x, temperature=0, top_p=0), r"top_p: expected 0 < top_p <= 1, got 0"),
    (lambda: tk.sample(x, np.zeros(4, np.float32), temperature=np.ones(3, np.float32)),
     r"temperature: expected shape \(4\)"),
    (lambda: tk.sample(x, np.zeros(4, np.float32), temperature=np.array([1, -1, 1, 1], np.float32)),
     "temperature: expected >= 0 in every row"),
    (lambda: tk.sample(x, temperature=0, top_k=np.zeros(4, np.int64)), "top_k: expected dtype int32"),
    (lambda: tk.sample(x[0], temperature=0), r"x: expected 2 dimensions, got shape \(8,\)"),
    (lambda: tk.embedding(np.array([0, 4]), x), r"ids: expected values in 0..3, got 0..4"),
    (lambda: tk.embedding(np.array([0, -1]), x), r"ids: expected values in 0..3, got -1..0"),
    (lambda: tk.embedding(np.array([0, 1]), x, np.array([0, 1])), "positions and pos_table: pass both"),
    (lambda: tk.embedding(np.array([0, 1]), x, np.array([0]), x), r"positions: expected shape \(2,\)"),
    (lambda: tk.embedding(np.array([0, 1]), x, np.array([0, 1]), np.zeros((4, 7), np.float32)),
     r"pos_table: expected shape \(\*, 8\)"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_bad_lengths_positions_and_settings_fail_before_any_write():
    """kv_len out of range, a decode row's length past its cache, a step tail whose next position or
    chosen id falls outside its tables, a float top_k, odd rotary_dim: one error naming the
    argument, and nothing written before it."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 9, 8)).astype(np.float32)
    for n in (0, -2, 12):
        with pytest.raises(ValueError, match="kv_len"):
            tk.attention(q, k, k, kv_len=np.array([n], np.int32))
    qkv = rng.standard_normal((2, 1, 3 * 16)).astype(np.float32)
    cache = np.zeros((2, 2, 6, 8), np.float32)
    with pytest.raises(ValueError, match="lengths"):
        tk.decode_attention(qkv, cache, cache.copy(), np.zeros(1, np.int32), 2, lengths=np.array([1, 6], np.int64))
    assert not cache.any()
    logits = rng.standard_normal((2, 5)).astype(np.float32)
    out, positions = np.full(2, -1, np.int64), np.array([4, 0], np.int64)
    table, pos_table, rows = np.ones((5, 3), np.float32), np.ones((5, 3), np.float32), np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="positions"):
        tk.argmax(logits, out, positions=positions, embed=(table, pos_table, rows))
    assert (out == -1).all() and positions.tolist() == [4, 0]
    with pytest.raises(TypeError, match="top_k"):
        tk.sample(logits, np.zeros(2, np.float32), top_k=2.0)
    with pytest.raises(ValueError, match="rotary_dim"):
        tk.rope_cos_sin(np.arange(4), 5)
