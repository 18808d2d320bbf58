"""Each cuTile kernel against the float64 computation, on fresh random inputs, with every
cupy allocation poisoned to NaN first so an unwritten output element fails the check."""
from importlib import import_module

import numpy as np
import pytest
from numerics import rel_err

import tilekernels as tk
from tilekernels._arrays import sm_count

decode_attn = import_module("tilekernels.decode_attention")      # the op shadows its module's name on the package

pytestmark = pytest.mark.gpu
FP32, TF32 = 1e-5, 1e-3


def pair(rng, *shape, scale=1.0):
    import cupy

    a = (rng.standard_normal(shape) * scale).astype(np.float32)
    return a, cupy.asarray(a)


@pytest.mark.parametrize("rows,n", [(1, 1), (7, 7), (769, 768), (33, 1281), (8, 2048), (3, 6144)])
def test_norms(poisoned, rng, rows, n):
    (x, gx), (w, gw), (b, gb) = pair(rng, rows, n), pair(rng, n), pair(rng, n)
    x64 = x.astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    ln = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b
    assert rel_err(tk.layernorm(gx, gw, gb), ln) <= FP32
    assert rel_err(tk.rmsnorm(gx, gw, 1e-5), x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * w) <= FP32
    x16 = tk.weights.to_bf16(gx)        # bfloat16 x: as its float32 widening
    wide = tk.widen(x16)
    assert rel_err(tk.rmsnorm(x16, gw, 1e-5), tk.rmsnorm(wide, gw, 1e-5).get()) <= FP32
    assert rel_err(tk.layernorm(x16, gw, gb), tk.layernorm(wide, gw, gb).get()) <= FP32


@pytest.mark.parametrize("c,dtype", [(1, np.int64), (7, np.int32), (768, np.int64), (769, np.int32),
                                     (1281, np.int64), (2048, np.int64)])
def test_embedding(poisoned, rng, c, dtype):
    """Rows by token id, plus position rows; ragged widths past one channel tile."""
    import cupy

    (table, gt), (pos, gp) = pair(rng, 50257, c), pair(rng, 1024, c)
    ids = rng.integers(0, 50257, (3, 7)).astype(dtype)
    positions = (rng.integers(0, 1000, (3, 1)) + np.arange(7)).astype(dtype)
    assert rel_err(tk.embedding(cupy.asarray(ids), gt), table[ids]) == 0.0
    ref = table[ids].astype(np.float64) + pos[positions]
    assert rel_err(tk.embedding(cupy.asarray(ids), gt, cupy.asarray(positions), gp), ref) <= FP32


def bf16_pair(rng, *shape, scale=1.0):
    """A float32 matrix of bfloat16 values and its bfloat16 copy on the GPU (tk.compact)."""
    import cupy

    a = (rng.standard_normal(shape) * scale).astype(tk.weights.BF16).astype(np.float32)
    g = tk.compact(cupy.asarray(a))
    assert g.dtype == tk.weights.BF16
    return a, g


@pytest.mark.parametrize("c", [1, 769, 2048])
def test_embedding_of_a_bfloat16_table(poisoned, rng, c):
    import cupy

    (table, gt), (pos, gp) = bf16_pair(rng, 1000, c), bf16_pair(rng, 64, c)
    ids = rng.integers(0, 1000, (2, 5))
    positions = rng.integers(0, 64, (2, 5))
    assert rel_err(tk.embedding(cupy.asarray(ids), gt), table[ids]) == 0.0
    ref = table[ids].astype(np.float64) + pos[positions]
    assert rel_err(tk.embedding(cupy.asarray(ids), gt, cupy.asarray(positions), gp), ref) <= FP32


@pytest.mark.parametrize("m", [1, 7, 16, 64, 128, 300])
@pytest.mark.parametrize("k,n,act,res", [
    (2048, 3072, None, False),         # GLM qkv (RMSNorm applied in the decode kernels)
    (2048, 12288, "swiglu", False),    # GLM gate/up
    (6144, 2048, None, True),          # GLM down + residual: one 8192-wide K tile
    (1281, 769, None, True),           # ragged K and N
    (2048, 5000, None, False),         # a vocabulary-wide head at M = 1 (the mma kernel)
    (768, 2304, None, False),          # GPT-2 sizes: K in splits of 256
    (768, 768, None, True),
])
def test_linear_with_bfloat16_weights(poisoned, rng, m, k, n, act, res):
    """bfloat16 weights widened in the kernels: the same products as their float32 values,
    with an RMSNorm (its weight applied in-kernel at M <= 16, by the norm kernel above)."""
    (x, gx), (w, gw), (nw, gnw) = pair(rng, m, k, scale=2.0), bf16_pair(rng, n, k, scale=0.05), pair(rng, k)
    n_out = n // 2 if act == "swiglu" else n
    r, gr = pair(rng, m, n_out) if res else (None, None)
    out = tk.linear(gx, gw, activation=act, norm=tk.RMSNorm(gnw, 1e-5), residual=gr)
    ref = fused_reference(x, w, None, act, (nw, None), 1e-5, r)
    assert rel_err(out, ref) <= TF32
    f32 = tk.linear(gx, tk.widen(gw), activation=act, norm=tk.RMSNorm(gnw, 1e-5), residual=gr)
    assert rel_err(out, f32.get()) <= (1e-6 if m == 1 and n_out <= 4096 else TF32)


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
@pytest.mark.parametrize("k,n", [(7, 1), (768, 2304), (1281, 769), (5120, 4096), (9000, 33)])
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


def fused_reference(x, w, b, act, norm, eps, residual):
    """float64: residual + act(norm(x) @ w.T + b), act 'swiglu' splitting the output in halves."""
    x = x.astype(np.float64)
    if norm is not None:
        nw, nb = norm
        mu = x.mean(-1, keepdims=True) if nb is not None else 0.0
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        x = (x - mu) / np.sqrt(var + eps) * nw + (nb if nb is not None else 0.0)
    y = x @ w.T.astype(np.float64) + (0.0 if b is None else b)
    if act == "swiglu":
        g, u = np.split(y, 2, axis=-1)
        y = g / (1 + np.exp(-g)) * u
    elif act == "gelu_tanh":
        y = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3)))
    return y if residual is None else y + residual


@pytest.mark.parametrize("m", [1, 2, 7, 16, 17, 64, 127, 300])
@pytest.mark.parametrize("k,n,norm,act,bias,res", [
    (768, 2304, "layer", None, True, False),        # GPT-2 qkv with ln_1
    (768, 3072, "layer", "gelu_tanh", True, False),  # GPT-2 fc with ln_2
    (3072, 769, None, None, True, True),             # projection + residual, ragged N
    (1281, 770, "rms", "swiglu", False, False),      # gated unit, ragged K and N
    (2048, 12288, "rms", "swiglu", False, False),    # GLM gate/up
    (2048, 2048, None, None, False, True),           # GLM o_proj + residual
    (768, 50257, "layer", None, False, False),       # GPT-2 head with ln_f
])
def test_linear_fused(poisoned, rng, m, k, n, norm, act, bias, res):
    (x, gx), (w, gw) = pair(rng, m, k, scale=2.0), pair(rng, n, k, scale=0.05)
    b, gb = pair(rng, n) if bias else (None, None)
    n_out = n // 2 if act == "swiglu" else n
    r, gr = pair(rng, m, n_out) if res else (None, None)
    (nw, gnw), (nb, gnb) = pair(rng, k), pair(rng, k)
    spec = {"layer": ((nw, nb), tk.LayerNorm(gnw, gnb, 1e-5)), "rms": ((nw, None), tk.RMSNorm(gnw, 1e-5)),
            None: (None, None)}[norm]
    out = tk.linear(gx, gw, gb, activation=act, norm=spec[1], residual=gr)
    ref = fused_reference(x, w, b, act, spec[0], 1e-5, r)
    assert rel_err(out, ref) <= TF32


@pytest.mark.parametrize("m", [1, 7, 16, 33, 128, 300])
@pytest.mark.parametrize("k,n,norm,act,offset", [
    (768, 2304, "layer", None, 0.0),          # GPT-2 qkv with ln_1 folded in
    (768, 3072, "layer", "gelu_tanh", 30.0),   # rows far from zero: the variance must keep its digits
    (1281, 769, "layer", None, 0.0),          # ragged K and N
    (768, 50257, "layer", None, 0.0),         # GPT-2 head with ln_f folded in
    (2048, 3072, "rms", None, 0.0),           # GLM qkv
    (2048, 12288, "rms", "swiglu", 0.0),      # GLM gate/up
])
def test_linear_with_folded_norm(poisoned, rng, m, k, n, norm, act, offset):
    """linear(x, fold_norm(norm, W, b)) computes the norm's statistics inside the decode kernels
    (M <= 16) and runs a statistics-only norm kernel ahead of the large-M one."""
    (x, gx), (w, gw) = pair(rng, m, k, scale=2.0), pair(rng, n, k, scale=0.05)
    x = x + np.float32(offset)
    gx = gx + np.float32(offset)
    (nw, gnw), (nb, gnb) = pair(rng, k), pair(rng, k)
    if norm == "layer":
        (b, gb) = pair(rng, n)
        spec, plain, fw, fb = (nw, nb), *tk.fold_norm(tk.LayerNorm(gnw, gnb, 1e-5), gw, gb)
    else:
        b = gb = None
        spec, plain, fw, fb = (nw, None), *tk.fold_norm(tk.RMSNorm(gnw, 1e-5), gw)
    assert not plain.affine
    out = tk.linear(gx, fw, fb, activation=act, norm=plain)
    ref = fused_reference(x, w, b, act, spec, 1e-5, None)
    assert rel_err(out, ref) <= TF32


@pytest.mark.parametrize("b,t,hq,hkv,d,rope", [(1, 1, 12, 12, 64, 0), (2, 7, 12, 12, 64, 0),      # GPT-2
                                               (1, 1, 16, 4, 128, 128), (1, 769, 16, 4, 128, 128),  # GLM decoder
                                               (2, 1500, 20, 20, 64, 32), (2, 3, 4, 2, 64, 16),    # GLM encoder
                                               (1, 9, 4, 4, 128, 32), (2, 5, 4, 2, 64, 24)])       # a quarter; gathered
def test_split_qkv(poisoned, rng, b, t, hq, hkv, d, rope):
    """q comes back rotated; k (rotated) and v land in the cache at start..start+T-1 and no
    other slot changes (the rest of the cache keeps its poison)."""
    import cupy

    (qkv, gqkv) = pair(rng, b, t, (hq + 2 * hkv) * d)
    t_max, start = t + 13, 5
    kc, vc = cupy.full((b, hkv, t_max, d), np.nan, np.float32), cupy.full((b, hkv, t_max, d), np.nan, np.float32)
    cos = sin = gcos = gsin = None
    if rope:
        cos, sin = tk.rope_cos_sin(np.arange(t_max), rope)
        gcos, gsin = cupy.asarray(cos), cupy.asarray(sin)
    kv_start = np.arange(b, dtype=np.int32) * 3          # left padding: positions start at slot 3 b
    kr, vr = np.full(kc.shape, np.nan, np.float32), np.full(vc.shape, np.nan, np.float32)
    q_ref = tk.split_qkv(qkv, kr, vr, np.array([start], np.int32), hq, cos, sin, rope or None, kv_start)
    q = tk.split_qkv(gqkv, kc, vc, cupy.array([start], np.int32), hq, gcos, gsin, rope or None,
                     cupy.asarray(kv_start))
    assert rel_err(q, q_ref) <= FP32
    span = slice(start, start + t)
    assert rel_err(kc[:, :, span], kr[:, :, span]) <= FP32
    assert rel_err(vc[:, :, span], vr[:, :, span]) == 0.0
    for c in (kc, vc):
        rest = cupy.concatenate([c[:, :, :start], c[:, :, start + t:]], axis=2)
        assert bool(cupy.isnan(rest).all())


@pytest.mark.parametrize("b,hq,hkv,d,t_max,rope", [(1, 12, 12, 64, 1024, 0), (1, 16, 4, 128, 777, 128),
                                                   (3, 8, 2, 64, 300, 32), (2, 2, 1, 128, 1, 128),
                                                   (1, 16, 4, 128, 200, 128)])     # split plans, one-pass plans
def test_decode_attention(poisoned, rng, b, hq, hkv, d, t_max, rope):
    """The fused decode kernel against split_qkv + attention in float64: the new k, v land at
    slot `start` and nowhere else; slots past it hold NaN, which must never reach the output.
    Only the chunks holding keys up to `start` run (the others' partials, never written, hold NaN
    and must not reach the merge); the last of them leaves the head's counter at zero."""
    import cupy

    from tilekernels._arrays import last_block_counters

    for s in sorted({0, 1, 63, 64, 65, 127, 128, 255, 256, 300, t_max - 1} & set(range(t_max))):
        (qkv, gqkv) = pair(rng, b, 1, (hq + 2 * hkv) * d)
        kc, vc = rng.standard_normal((2, b, hkv, t_max, d)).astype(np.float32)
        kc[:, :, s:] = vc[:, :, s:] = np.nan
        gk, gv = cupy.asarray(kc), cupy.asarray(vc)
        kv_start = np.array([0, s // 3, s][:b], np.int32)
        table = tk.rope_cos_sin(np.arange(t_max), rope) if rope else (None, None)
        gtable = tuple(cupy.asarray(a) for a in table) if rope else table
        ref = tk.decode_attention(qkv, kc, vc, np.array([s], np.int32), hq, None, kv_start, *table, rope or None)
        got = tk.decode_attention(gqkv, gk, gv, cupy.array([s], np.int32), hq, None, cupy.asarray(kv_start),
                                  *gtable, rope or None)
        assert rel_err(got, ref) <= TF32, s
        assert rel_err(gk[:, :, s], kc[:, :, s]) <= FP32, s
        assert rel_err(gv[:, :, :s + 1], vc[:, :, :s + 1]) == 0.0, s
        assert bool(cupy.isnan(gk[:, :, s + 1:]).all()) and bool(cupy.isnan(gv[:, :, s + 1:]).all()), s
        assert not last_block_counters(b * hq).any(), s


@pytest.fixture(params=["high", "highest"])
def precision(request):
    """Each matmul precision in turn (the default 'high' restored after)."""
    tk.set_matmul_precision(request.param)
    yield request.param
    tk.set_matmul_precision("high")


@pytest.fixture
def highest():
    tk.set_matmul_precision("highest")
    yield
    tk.set_matmul_precision("high")


BF16 = 2 ** -7     # bfloat16 inputs: 8-bit mantissas, relative rounding up to 2^-9 each; sums of
                   # K products with random signs keep the relative error near that (bound with margin)


@pytest.fixture
def medium():
    tk.set_matmul_precision("medium")
    yield
    tk.set_matmul_precision("high")


def test_medium_precision_takes_bf16_inputs_for_products_of_bf16_weights(poisoned, rng):
    """'medium': a product by a bfloat16 weight runs on bfloat16 inputs, large (tiles kernel) and
    decode-sized (skinny kernel, <= 128 rows) alike: within bf16's error of the float64 reference
    and measurably less exact than TF32, the same whether its input comes float32 (rounded by the
    kernel) or already bfloat16; float32 weights and attention are as at 'high'."""
    import cupy

    (x, gx), (w, gw), (b, gb) = pair(rng, 769, 1281), bf16_pair(rng, 2304, 1281, scale=0.05), pair(rng, 2304)
    (w32, gw32) = pair(rng, 2304, 1281)
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + b
    gs = gx[:7].copy()
    high, small, f32w = tk.linear(gx, gw, gb), tk.linear(gs, gw, gb), tk.linear(gx, gw32, gb)
    (_, gq), (_, gk), (_, gv) = pair(rng, 2, 8, 77, 64), pair(rng, 2, 2, 300, 64), pair(rng, 2, 2, 300, 64)
    att_high = tk.attention(gq, gk, gv, causal=True)
    tk.set_matmul_precision("medium")
    try:
        med, small_med = tk.linear(gx, gw, gb), tk.linear(gs, gw, gb)
        assert cupy.array_equal(tk.linear(tk.weights.to_bf16(gx), gw, gb), med)
        assert cupy.array_equal(tk.linear(tk.weights.to_bf16(gs), gw, gb), small_med)
        assert cupy.array_equal(tk.linear(gx, gw32, gb), f32w)
        assert cupy.array_equal(tk.attention(gq, gk, gv, causal=True), att_high)
    finally:
        tk.set_matmul_precision("high")
    for got, want, tf32 in ((med, ref, high), (small_med, ref[:7], small)):
        assert TF32 / 8 < rel_err(got, want) <= BF16 and rel_err(got, want) > 2 * rel_err(tf32, want)


@pytest.mark.parametrize("act,glu", [(None, False), ("gelu", False), ("swiglu", True)])
def test_bfloat16_outputs_round_the_float32_result(poisoned, rng, medium, act, glu):
    """out_dtype bfloat16 stores exactly the float32 result rounded to nearest: a norm, and the
    large products of both modes (the MLP's first projection feeding the second)."""
    import cupy

    bf = tk.weights.BF16
    (_, gx), (_, gnw) = pair(rng, 300, 1280, scale=2.0), pair(rng, 1280)
    for norm in (tk.RMSNorm(gnw, 1e-5), tk.LayerNorm(gnw, gnw, 1e-5)):
        assert cupy.array_equal(norm(gx, out_dtype=bf).view(cupy.uint16), tk.weights.to_bf16(norm(gx)).view(cupy.uint16))
    for weights in (bf16_pair(rng, 2 * 640 if glu else 1281, 1280, scale=0.05), pair(rng, 2 * 640 if glu else 1281, 1280, scale=0.05)):
        gw = weights[1]
        got = tk.linear(gx, gw, activation=act, out_dtype=bf)
        assert got.dtype == bf and got.shape == (300, 640 if glu else 1281)
        want = tk.weights.to_bf16(tk.linear(gx, gw, activation=act))
        assert cupy.array_equal(got.view(cupy.uint16), want.view(cupy.uint16))


@pytest.mark.parametrize("precision", ["high", "medium"], indirect=True)
@pytest.mark.parametrize("k,n,act,res", [(1280, 1280, None, True), (1280, 5120, "gelu", False),
                                         (2048, 2 * 6144, "swiglu", False), (1281, 769, None, False)])
def test_sequence_rows_do_not_depend_on_the_other_rows(poisoned, rng, precision, k, n, act, res):
    """A sequence product's rows are the same bits in the tiles of few rows (a window's
    encoder, a prompt: half rows, or 64 columns) as in those of many: a prompt's logits do not
    depend on the prompts joining its prefill."""
    import cupy

    from tilekernels.linear import linear_plan

    gx, gw = pair(rng, 1, 12000, k)[1], bf16_pair(rng, n, k, scale=0.05)[1]
    n_out = n // 2 if act == "swiglu" else n
    gr = pair(rng, 1, 12000, n_out)[1] if res else None
    medium = precision == "medium"
    tiles = {linear_plan(m, n_out, k, act == "swiglu", bf16_mma=medium, sequence=True)[1][:2] for m in (12000, 7)}
    assert len(tiles) == 1 + (act != "swiglu" or not medium)      # a gated unit's bfloat16 tiles: 128 x 64 at any M
    full = tk.linear(gx, gw, activation=act, residual=gr)
    for m in (2, 7, 400, 1500):         # one row is a decode product (the skinny kernel)
        got = tk.linear(gx[:, :m].copy(), gw, activation=act, residual=None if gr is None else gr[:, :m].copy())
        assert cupy.array_equal(got, full[:, :m]), m


def test_batched_decode_rows_do_not_depend_on_the_batch(poisoned, rng):
    """A row's result is bit for bit the same in every decode bucket from 2 to 128 rows: the
    skinny kernel adds the same split-K partial sums in the same order whatever its tile of
    rows (so a request's logits do not depend on what decodes beside it)."""
    import cupy

    (x, gx), (_, gnw) = pair(rng, 128, 2048, scale=2.0), pair(rng, 2048)
    rms = tk.RMSNorm(gnw, 1e-5)
    x16 = tk.weights.to_bf16(gx)        # an o projection's input: bfloat16, no norm (narrow blocks at <= 16 rows)
    for (w, gw), act, xs, norm in ((bf16_pair(rng, 3072, 2048, scale=0.05), None, gx, rms),
                                   (bf16_pair(rng, 2 * 6144, 2048, scale=0.05), "swiglu", gx, rms),
                                   (bf16_pair(rng, 2048, 2048, scale=0.05), None, x16, None),
                                   (bf16_pair(rng, 2 * 6144, 2048, scale=0.05), "swiglu", x16, rms),
                                   (bf16_pair(rng, 2048, 6144, scale=0.05), None, cupy.asarray(np.tile(x, (1, 3))), None),
                                   (pair(rng, 768, 2048), None, gx, None), (pair(rng, 2304, 2048), "gelu_tanh", gx, rms)):
        full = tk.linear(xs, gw, activation=act, norm=norm)
        for m in (1, 2, 3, 8, 16, 17, 32, 64, 100):
            assert cupy.array_equal(tk.linear(xs[:m].copy(), gw, activation=act, norm=norm), full[:m]), (w.shape, m)
    # GPT-2's decode products (K = 768 cut in splits of 256; a LayerNorm folded into qkv and fc1)
    ln, x768 = tk.LayerNorm(None, None, 1e-5), cupy.ascontiguousarray(gx[:, :768])
    for (w, gw), act, xs, norm in ((bf16_pair(rng, 2304, 768, scale=0.05), None, x768, ln),
                                   (bf16_pair(rng, 768, 768, scale=0.05), None, tk.weights.to_bf16(x768), None),
                                   (bf16_pair(rng, 3072, 768, scale=0.05), "gelu_tanh", x768, ln),
                                   (bf16_pair(rng, 768, 3072, scale=0.05), None, cupy.asarray(np.tile(x[:, :768], (1, 4))),
                                    None)):
        full = tk.linear(xs, gw, activation=act, norm=norm)
        for m in (1, 2, 7, 16, 17, 64, 100):
            assert cupy.array_equal(tk.linear(xs[:m].copy(), gw, activation=act, norm=norm), full[:m]), (w.shape, m)


def test_residual_stream_stored_twice(poisoned, rng):
    """out_dtype (float32, bfloat16): the float32 result and its bfloat16 rounding, bit for bit,
    from the skinny kernel (decode rows) and a sequence's product."""
    import cupy

    (_, gx), (r, gr) = pair(rng, 400, 2048), pair(rng, 400, 2048)
    w, gw = bf16_pair(rng, 2048, 2048, scale=0.05)
    x16 = tk.weights.to_bf16(gx)
    for m in (1, 7, 64, 100):
        one = tk.linear(x16[:m].copy(), gw, residual=gr[:m].copy())
        y, y16 = tk.linear(x16[:m].copy(), gw, residual=gr[:m].copy(), out_dtype=(np.float32, tk.weights.BF16))
        assert cupy.array_equal(y, one), m
        assert y16.dtype == tk.weights.BF16 and cupy.array_equal(y16.view(cupy.uint16),
                                                                 tk.weights.to_bf16(one).view(cupy.uint16)), m
    seq = tk.linear(x16[None], gw, residual=gr[None], out_dtype=(np.float32, tk.weights.BF16))
    assert cupy.array_equal(seq[1].view(cupy.uint16), tk.weights.to_bf16(seq[0]).view(cupy.uint16))
    assert rel_err(seq[0][0], r.astype(np.float64) + tk.weights.widen(x16.get()).astype(np.float64) @ w.T) <= TF32


def test_residual_stream_scaled_for_the_next_norm(poisoned, rng, medium):
    """scaled_by: the third result is the bfloat16 copy times the next RMSNorm's weight, rounded
    to bfloat16; a product normed by that RMSNorm gives the same bits taking it as `scaled` as
    scaling x itself, at every bucket (GLM-ASR's decode MLP), from bfloat16 and float32 x."""
    import cupy

    bf = tk.weights.BF16
    (_, gh), (_, gr), (_, gg) = pair(rng, 129, 2048), pair(rng, 129, 2048, scale=2.0), pair(rng, 2048)
    wo, wq = bf16_pair(rng, 2048, 2048, scale=0.05)[1], bf16_pair(rng, 3072, 2048, scale=0.05)[1]
    wfc = bf16_pair(rng, 2 * 6144, 2048, scale=0.05)[1]
    rms = tk.RMSNorm(gg, 1e-5)
    h16 = tk.weights.to_bf16(gh)
    for m in (1, 7, 16, 17, 64, 100, 128, 129):
        h, r = h16[:m].copy(), gr[:m].copy()
        y, y16 = tk.linear(h, wo, residual=r, out_dtype=(np.float32, bf))
        y_, y16_, xs = tk.linear(h, wo, residual=r, out_dtype=(np.float32, bf), scaled_by=gg)
        assert cupy.array_equal(y_, y) and cupy.array_equal(y16_.view(cupy.uint16), y16.view(cupy.uint16)), m
        assert xs.dtype == bf and cupy.array_equal(xs.view(cupy.uint16),
                                                   tk.weights.to_bf16(tk.widen(y16) * gg).view(cupy.uint16)), m
        for x, x_scaled in ((y16, xs), (y, tk.weights.to_bf16(y * gg))):
            for w, act in ((wfc, "swiglu"), (wq, None)):
                plain = tk.linear(x, w, activation=act, norm=rms, out_dtype=bf)
                got = tk.linear(x, w, activation=act, norm=rms, out_dtype=bf, scaled=x_scaled)
                assert cupy.array_equal(got.view(cupy.uint16), plain.view(cupy.uint16)), (m, x.dtype, act)


def test_decode_layer_rows_do_not_depend_on_the_batch(poisoned, rng, medium):
    """GLM-ASR's decoder layer at its sizes (RMSNorms, SwiGLU, bfloat16 weights), one token a row:
    each row's output is the same bits alone and among 7, 17, 64 or 128 rows, though from 17 rows
    fc1 takes the operand o scaled ahead (attention stood in for by a function of each row's own
    projection)."""
    import cupy

    c, inter, hq, hkv, d = 2048, 6144, 16, 4, 128
    w = [bf16_pair(rng, n, k, scale=0.03)[1] for n, k in (((hq + 2 * hkv) * d, c), (c, hq * d), (2 * inter, c),
                                                              (c, inter))]
    norms = [tk.RMSNorm(cupy.asarray(1 + 0.1 * rng.standard_normal(c).astype(np.float32)), 1e-5) for _ in range(2)]
    block = tk.Block(norms[0], (w[0], None), (w[1], None), norms[1], (w[2], None), (w[3], None), "swiglu")

    def attend(qkv, out_dtype):      # (B, 1, width) float32 -> (B, H, 1, D): each row's own q, as o takes it
        q = cupy.ascontiguousarray(qkv[..., :hq * d]).reshape(-1, 1, hq, d).transpose(0, 2, 1, 3)
        return tk.weights.to_bf16(cupy.ascontiguousarray(q))

    x = pair(rng, 128, 1, c, scale=2.0)[1]
    full = block(x, attend)
    for m in (1, 7, 17, 64):
        got = block(x[:m].copy(), attend)
        assert cupy.array_equal(got, full[:m]), m
    assert bool(cupy.isfinite(full).all()) and float(cupy.abs(full).max()) > 0


@pytest.mark.parametrize("bsz,hq,hkv,d", [(2, 12, 12, 64), (8, 16, 4, 128), (64, 16, 4, 128), (3, 4, 1, 64)])
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_batched_decode_attention(poisoned, rng, bsz, hq, hkv, d, kv):
    """Tq = 1 (decode.decode_kernel): each row attends to its own keys
    kv_start[b] .. kv_len - 1 only (NaN outside them must never reach the output), the query
    heads of a KV head together, from a float32 or a bfloat16 cache."""
    import cupy

    t_max, length = 700, 611
    q = rng.standard_normal((bsz, hq, 1, d)).astype(np.float32)
    k, v = rng.standard_normal((2, bsz, hkv, t_max, d)).astype(np.float32)
    start = rng.integers(0, length - 1, bsz).astype(np.int32)
    start[0] = 0
    if kv == "bfloat16":
        k, v = k.astype(tk.weights.BF16), v.astype(tk.weights.BF16)
    ref = tk.attention(q, k[:, :, :length], v[:, :, :length], True, None, start)
    for c in (k, v):
        c[:, :, length:] = np.nan
        for r in range(bsz):
            c[r, :, :start[r]] = np.nan
    dev = [cupy.asarray(a) if kv == "float32" else cupy.asarray(a.view(np.uint16)).view(tk.weights.BF16) for a in (k, v)]
    kv_len = cupy.array([length], np.int32)
    got = tk.attention(cupy.asarray(q), dev[0], dev[1], True, None, cupy.asarray(start), kv_len)
    assert rel_err(got, ref) <= TF32
    for r in (0, bsz - 1):      # a row alone: the same bits (one kernel, one arithmetic, at any batch)
        one = tk.attention(cupy.asarray(q[r:r + 1]), dev[0][r:r + 1], dev[1][r:r + 1], True, None,
                           cupy.asarray(start[r:r + 1]), kv_len)
        assert cupy.array_equal(one, got[r:r + 1]), r


@pytest.mark.parametrize("hq,hkv,d", [(16, 4, 128), (12, 12, 64)])
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
@pytest.mark.parametrize("precision", ["high", "highest", "medium"], indirect=True)
def test_decode_attention_over_slots_of_their_own_lengths(poisoned, rng, kv, precision, hq, hkv, d):
    """The engine's slots (lengths (B,)): row b attends to its keys 0 .. lengths[b] - 1 and its new
    token, stored at lengths[b] and rotated at that position; NaN past a row's keys never reaches
    it, and a row's result is the same bits alone and beside any other rows. At 'highest' it is
    fp32-accurate (GLM-ASR's greedy tokens against transformers' rest on it; 32-key tiles at
    D = 128 once gave errors of 0.2-0.7 there); at 'medium' a bfloat16 cache's products take q and
    the probabilities rounded to bfloat16, within bfloat16's error."""
    import cupy

    t_max = 800
    lengths = np.array([0, 1, 7, 255, 256, 257, 600, 769 - 1], np.int64)
    bsz = len(lengths)
    qkv = rng.standard_normal((bsz, 1, (hq + 2 * hkv) * d)).astype(np.float32)
    k, v = rng.standard_normal((2, bsz, hkv, t_max, d)).astype(np.float32)
    if kv == "bfloat16":
        k, v = k.astype(tk.weights.BF16), v.astype(tk.weights.BF16)
    table = tk.rope_cos_sin(np.arange(t_max), d)
    kr, vr = k.copy(), v.copy()
    ref = tk.decode_attention(qkv, kr, vr, np.array([0], np.int32), hq, None, None, *table, d, lengths=lengths)
    for c in (k, v):
        for r in range(bsz):
            c[r, :, lengths[r]:] = np.nan

    def dev(a, rows):
        a = a[rows]
        return cupy.asarray(a) if kv == "float32" else cupy.asarray(a.view(np.uint16)).view(tk.weights.BF16)

    def run(rows):
        gk, gv = dev(k, rows), dev(v, rows)
        out = tk.decode_attention(cupy.asarray(qkv[rows]), gk, gv, cupy.zeros(1, np.int32), hq, None, None,
                                  *(cupy.asarray(t) for t in table), d, lengths=cupy.asarray(lengths[rows]))
        return out, gk, gv

    got, gk, gv = run(list(range(bsz)))
    bf16_products = precision == "medium" and kv == "bfloat16"
    assert rel_err(got, ref) <= (FP32 if precision == "highest" else BF16 if bf16_products else TF32)
    if bf16_products:       # the products did round q and the probabilities
        assert rel_err(got, ref) > TF32 / 8
    for r in range(bsz):
        for have, want in ((gk, kr), (gv, vr)):
            h = have[r, :, lengths[r]]
            h = h.view(cupy.uint16).get() if kv == "bfloat16" else h.get()
            w = want[r, :, lengths[r]]
            if kv == "bfloat16":        # rounded as stored: the same bits save a rounding tie
                assert np.abs(h.view(tk.weights.BF16).astype(np.float32) - w.astype(np.float32)).max() <= \
                    2.0 ** -7 * np.abs(w.astype(np.float32)).max(), r
            else:
                assert rel_err(h, w) <= FP32, r
    for rows in ([3], [6, 3, 0], [5, 4]):
        part, _, _ = run(rows)
        assert cupy.array_equal(part, got[rows]), rows
    many = list(range(bsz)) * 5         # 40 rows: the pairs fill the SMs, a block folds several chunks
    assert decode_attn.chunks_a_block(len(many) * hkv, sm_count()) > decode_attn.chunks_a_block(bsz * hkv, sm_count())
    part, _, _ = run(many)
    assert cupy.array_equal(part, got[many])


def test_decode_attention_with_a_bfloat16_cache(poisoned, rng):
    """The batch-1 fused decode kernel over a bfloat16 cache: the new key and value are stored
    rounded to bfloat16 and attended to as stored; chunks before kv_start are skipped."""
    import cupy

    hq, hkv, d, t_max, s = 16, 4, 128, 900, 700
    (qkv, gqkv) = pair(rng, 1, 1, (hq + 2 * hkv) * d)
    kc, vc = rng.standard_normal((2, 1, hkv, t_max, d)).astype(np.float32).astype(tk.weights.BF16)
    kv_start = np.array([450], np.int32)
    table = tk.rope_cos_sin(np.arange(t_max), d)
    kr, vr = kc.copy(), vc.copy()
    ref = tk.decode_attention(qkv, kr, vr, np.array([s], np.int32), hq, None, kv_start, *table, d)
    kc[:, :, :kv_start[0]] = vc[:, :, :kv_start[0]] = np.nan        # skipped chunks: never read
    gk, gv = (cupy.asarray(a.view(np.uint16)).view(tk.weights.BF16) for a in (kc, vc))
    got = tk.decode_attention(gqkv, gk, gv, cupy.array([s], np.int32), hq, None, cupy.asarray(kv_start),
                              *(cupy.asarray(a) for a in table), d)
    assert rel_err(got, ref) <= TF32
    assert np.array_equal(gk[:, :, s].view(cupy.uint16).get(), kr[:, :, s].view(np.uint16))
    assert np.array_equal(gv[:, :, s].view(cupy.uint16).get(), vr[:, :, s].view(np.uint16))


@pytest.mark.parametrize("m", [7, 769])
def test_linear_highest_precision_is_fp32(poisoned, rng, highest, m):
    (x, gx), (w, gw), (b, gb), (r, gr) = pair(rng, m, 1281), pair(rng, 2304, 1281), pair(rng, 2304), pair(rng, m, 2304)
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + b + r
    assert rel_err(tk.linear(gx, gw, gb, residual=gr), ref) <= FP32
    (w2, gw2) = pair(rng, 2 * 769, 1281)
    # silu(gate) * up multiplies two fp32-accurate sums: their errors add
    ref = fused_reference(x, w2, None, "swiglu", None, 0, None)
    assert rel_err(tk.linear(gx, gw2, activation="swiglu"), ref) <= 2 * FP32


def test_attention_and_conv_highest_precision_are_fp32(poisoned, rng, highest):
    (q, gq), (k, gk), (v, gv) = pair(rng, 2, 8, 77, 64), pair(rng, 2, 2, 300, 64), pair(rng, 2, 2, 300, 64)
    assert rel_err(tk.attention(gq, gk, gv, causal=True), tk.attention(q, k, v, causal=True)) <= FP32
    assert rel_err(tk.attention(gq[:, :, :1].copy(), gk, gv, causal=True),
                   tk.attention(q[:, :, :1].copy(), k, v, causal=True)) <= FP32
    (x, gx), (w, gw), (b, gb) = pair(rng, 2, 129, 301), pair(rng, 96, 129, 3, scale=0.1), pair(rng, 96)
    ref = tk.conv1d(x.astype(np.float64).astype(np.float32), w, b, 2, 1)
    assert rel_err(tk.conv1d(gx, gw, gb, 2, 1), ref) <= FP32


@pytest.mark.parametrize("t,b,hid", [(1, 1, 128), (5, 7, 32), (300, 37, 128), (33, 769, 64)])
def test_lstm(poisoned, rng, precision, t, b, hid):
    """Every step's hidden state and the final state against float64 (the same recurrence as
    test_reference's), from zeros and from a given state: fp32-accurate at 'highest'; at 'high'
    (TF32 products) within TF32's bound, the recurrence compounding it over 300 steps."""
    import cupy
    from test_reference import lstm64

    (g, gg), (h0, gh0), (c0, gc0) = pair(rng, t, b, 4 * hid), pair(rng, b, hid), pair(rng, b, hid)
    w, gw = pair(rng, 4 * hid, hid, scale=1 / np.sqrt(hid))
    bound = FP32 if precision == "highest" else 10 * TF32
    for state, ref_state in (((None, None), (np.zeros((b, hid)),) * 2), ((gh0, gc0), (h0, c0))):
        got = tk.lstm(gg, gw, *state)
        for out, want in zip(got, lstm64(g, w, *ref_state)):
            assert isinstance(out, cupy.ndarray) and rel_err(out, want) <= bound


def test_linear_without_bias_tanh(poisoned, rng):
    (x, gx), (w, gw) = pair(rng, 5, 768), pair(rng, 3072, 768)
    assert rel_err(tk.linear(gx, gw, activation="gelu_tanh"), tk.linear(x, w, activation="gelu_tanh")) <= TF32


@pytest.mark.parametrize("m,n", [(7, 1), (769, 129)])
def test_linear_relu_and_sigmoid(poisoned, rng, highest, m, n):
    (x, gx), (w, gw), (b, gb) = pair(rng, m, 387), pair(rng, n, 387, scale=0.1), pair(rng, n)
    pre = x.astype(np.float64) @ w.T.astype(np.float64) + b
    # against the product's scale: relu(pre) of 7 rows may all be near zero
    relu = tk.linear(gx, gw, gb, activation="relu").get()
    assert np.linalg.norm(relu - np.maximum(pre, 0)) <= FP32 * np.linalg.norm(pre)
    assert rel_err(tk.linear(gx, gw, gb, activation="sigmoid"), 1 / (1 + np.exp(-pre))) <= FP32


@pytest.mark.parametrize("rows,n", [(1, 1), (7, 769), (2, 50257), (4, 59264), (8, 50257), (1, 4097), (64, 8191),
                                    (200, 3000)])
def test_softmax(poisoned, rng, rows, n):
    """Rows a block each, and few long rows cut into splits (softmax_splits), short last split too."""
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


@pytest.mark.parametrize("b,hq,hkv,tq,tk_,d,causal", [
    (1, 1, 1, 1, 1, 64, False), (2, 4, 2, 7, 7, 64, True), (1, 20, 20, 1500, 1500, 64, False),
    (3, 2, 1, 769, 769, 64, False), (2, 16, 4, 33, 1281, 128, True), (1, 4, 4, 1, 300, 128, True),
    (1, 16, 4, 450, 450, 128, True),        # GLM-ASR's prompt over a bfloat16 cache at precision bf16
])
def test_attention_of_bfloat16_inputs(poisoned, rng, b, hq, hkv, tq, tk_, d, causal):
    """bfloat16 q, k, v (GLM-ASR's encoder at precision bf16): bfloat16 products with fp32 sums
    against float64 on the same values. The probabilities enter the second product rounded to
    bfloat16 (each weight off by at most 2^-9 of itself: the output by at most 2^-9 of max |v|)
    and the result is rounded to bfloat16 (2^-9 of itself): 2^-8 of max |v| bounds the error."""
    import cupy

    q, k, v = (bf16_pair(rng, *shape)[0] for shape in ((b, hq, tq, d), (b, hkv, tk_, d), (b, hkv, tk_, d)))
    got = tk.attention(*(tk.compact(cupy.asarray(a)) for a in (q, k, v)), causal=causal)
    assert got.dtype == tk.weights.BF16
    got = cupy.asnumpy(got.view(cupy.uint16)).view(tk.weights.BF16).astype(np.float64)
    ref = tk.attention(q, k, v, causal=causal).astype(np.float64)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() <= 2 ** -8 * np.abs(v).max()


def test_split_qkv_hands_q_over_in_bfloat16(poisoned, rng):
    """q rounded to bfloat16 once, from the float32 q (the encoder's scratch at precision bf16)."""
    import cupy

    bf16 = tk.weights.BF16
    qkv, gqkv = pair(rng, 2, 37, 60 * 64)
    start = cupy.zeros(1, np.int32)
    caches = [cupy.zeros((2, 20, 37, 64), np.uint16).view(bf16) for _ in range(2)]
    q32 = tk.split_qkv(gqkv, *[cupy.zeros((2, 20, 37, 64), np.float32) for _ in range(2)], start, 20)
    q16 = tk.split_qkv(gqkv, *caches, start, 20, q_dtype=bf16)
    assert q16.dtype == bf16
    assert cupy.array_equal(q16.view(cupy.uint16), tk.weights.to_bf16(q32).view(cupy.uint16))


@pytest.mark.parametrize("rope", [32, 24])      # rotated in registers; gathered
def test_split_qkv_of_a_bfloat16_projection(poisoned, rng, rope):
    """A bfloat16 projection (the encoder's at precision bf16) gives what its float32 widening does,
    bit for bit: q, k and v in bfloat16, k rotated."""
    import cupy

    bf16 = tk.weights.BF16
    gqkv = tk.weights.to_bf16(pair(rng, 2, 37, 12 * 64)[1])
    cos, sin = (cupy.asarray(a) for a in tk.rope_cos_sin(np.arange(37), rope))
    start = cupy.zeros(1, np.int32)
    outs = []
    for qkv in (gqkv, tk.widen(gqkv)):
        caches = [cupy.full((2, 4, 37, 64), 0xFFFF, np.uint16).view(bf16) for _ in range(2)]
        outs.append([a.view(cupy.uint16) for a in (tk.split_qkv(qkv, *caches, start, 4, cos, sin, rope,
                                                               q_dtype=bf16), *caches)])
    for got, want in zip(*outs):
        assert cupy.array_equal(got, want)


def test_attention_on_cache_views(poisoned, rng):
    """k/v as prefixes of a longer pre-allocated cache (strided views), decode and chunk."""
    (kc, gkc), (vc, gvc) = pair(rng, 2, 4, 2048, 128), pair(rng, 2, 4, 2048, 128)
    for tq, t in [(1, 1000), (16, 555)]:
        q, gq = pair(rng, 2, 16, tq, 128)
        ref = tk.attention(q, np.ascontiguousarray(kc[:, :, :t]), np.ascontiguousarray(vc[:, :, :t]), causal=True)
        assert rel_err(tk.attention(gq, gkc[:, :, :t], gvc[:, :, :t], causal=True), ref) <= TF32


@pytest.mark.parametrize("b,cin,cout,t,stride", [(1, 128, 1280, 3000, 1), (1, 1280, 1280, 3000, 2),
                                                 (2, 7, 9, 13, 2), (1, 3, 5, 1, 1), (3, 129, 769, 1281, 2)])
def test_conv1d(poisoned, rng, b, cin, cout, t, stride):
    (x, gx), (w, gw), (bias, gb) = pair(rng, b, cin, t), pair(rng, cout, cin, 3), pair(rng, cout)
    ref = tk.conv1d(x, w, bias, stride=stride, padding=1, activation="gelu")
    assert rel_err(tk.conv1d(gx, gw, gb, stride=stride, padding=1, activation="gelu"), ref) <= TF32
    # the encoder's second convolution reads the first one's output, a transposed view
    view = gx.transpose(0, 2, 1).copy().transpose(0, 2, 1)
    assert rel_err(tk.conv1d(view, gw, gb, stride=stride, padding=1), tk.conv1d(x, w, bias, stride, 1)) <= TF32


@pytest.mark.parametrize("tq,tk_", [(40, 40), (1, 300), (3, 130)])
def test_attention_left_padding(poisoned, rng, tq, tk_):
    import cupy

    (q, gq), (k, gk), (v, gv) = pair(rng, 3, 8, tq, 64), pair(rng, 3, 2, tk_, 64), pair(rng, 3, 2, tk_, 64)
    start = np.array([0, 17, tk_ - tq], np.int32)
    ref = tk.attention(q, k, v, causal=True, kv_start=start)
    got = tk.attention(gq, gk, gv, causal=True, kv_start=cupy.asarray(start))
    assert rel_err(got, ref) <= TF32


@pytest.mark.parametrize("case", ["down-64-rows", "down-32-rows", "down-1-row", "decode-float32-cache"])
def test_merging_kernels_give_one_result_every_call(poisoned, rng, precision, case):
    """200 calls on the same inputs, one result: the split-K product (GLM-ASR's down projection,
    bfloat16 weights, 4 K splits; one block an SM up to 32 rows, two at 64) and decode attention
    over a float32 cache (GLM-ASR's heads, two chunks merged). Compiled by tileiras 13.4.92 both
    came out wrong and different on nearly every call (H100: 996 and 999 of 1,000 at 'high');
    by 13.5.37 exact every time."""
    import cupy

    if case.startswith("down"):
        m = int(case.split("-")[1])
        w, gw = bf16_pair(rng, 2048, 6144, scale=0.02)
        x, gx = pair(rng, m, 6144)
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
        call = lambda: tk.linear(gx, gw)  # noqa: E731
    else:
        hq, hkv, d, t_max, rot = 16, 4, 128, 1088, 64
        qkv, gqkv = pair(rng, 1, 1, (hq + 2 * hkv) * d)
        k, gk = pair(rng, 1, hkv, t_max, d)
        v, gv = pair(rng, 1, hkv, t_max, d)
        cos, sin = tk.rope_cos_sin(np.arange(t_max, dtype=np.int64), rot)
        lengths = np.array([457], np.int64)
        ref = tk.decode_attention(qkv, k.copy(), v.copy(), np.zeros(1, np.int32), hq, cos=cos, sin=sin,
                                  rotary_dim=rot, lengths=lengths)
        args = (gqkv, gk, gv, cupy.zeros(1, cupy.int32), hq)
        kw = dict(cos=cupy.asarray(cos), sin=cupy.asarray(sin), rotary_dim=rot, lengths=cupy.asarray(lengths))
        call = lambda: tk.decode_attention(*args, **kw)  # noqa: E731
    first = call()
    assert rel_err(first, ref) <= (FP32 if precision == "highest" else TF32)
    same = [bool(cupy.array_equal(call(), first)) for _ in range(200)]
    assert all(same), f"{same.count(False)} of 200 calls differ"


def test_decode_merges_repeatedly_from_a_graph(rng):
    """Replays of one captured decode attention (a decode step's) at lengths of one chunk and
    of several each merge once: the counters the last blocks reset serve the next replay."""
    import cupy

    (q, gq), (k, gk), (v, gv) = pair(rng, 2, 8, 1, 64), pair(rng, 2, 2, 1100, 64), pair(rng, 2, 2, 1100, 64)
    length = cupy.full(1, 100, cupy.int32)
    start = np.array([0, 3], np.int32)
    gstart = cupy.asarray(start)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        tk.attention(gq, gk, gv, True, None, gstart, length)     # first use, outside capture
        stream.begin_capture()
        out = tk.attention(gq, gk, gv, True, None, gstart, length)
        graph = stream.end_capture()
        for n in (4, 64, 65, 300, 513, 1100, 7):
            length.fill(n)
            out.fill(cupy.nan)
            graph.launch(stream)
            ref = tk.attention(q, np.ascontiguousarray(k[:, :, :n]), np.ascontiguousarray(v[:, :, :n]), True, None,
                               start)
            assert rel_err(out, ref) <= TF32, n


def test_decode_with_device_length(poisoned, rng):
    """kv_len in device memory: the full cache is passed, only the first kv_len keys count."""
    import cupy

    (q, gq), (k, gk), (v, gv) = pair(rng, 2, 16, 1, 128), pair(rng, 2, 4, 1024, 128), pair(rng, 2, 4, 1024, 128)
    for n in (1, 63, 64, 65, 700, 1024):
        ref = tk.attention(q, np.ascontiguousarray(k[:, :, :n]), np.ascontiguousarray(v[:, :, :n]), causal=True)
        got = tk.attention(gq, gk, gv, causal=True, kv_len=cupy.full(1, n, cupy.int32))
        assert rel_err(got, ref) <= TF32, n


@pytest.mark.parametrize("rows,n,top", [(1, 1, 1), (3, 7, 7), (2, 769, 0), (7, 1281, 5), (64, 50257, 20),
                                        (1, 59264, 20), (2, 300000, 3)])
def test_logprobs(poisoned, rng, rows, n, top):
    """log_softmax at the chosen tokens and the row's top ids against float64, across chunk
    boundaries, with a tie in two chunks (the smaller id first) and into a decode graph's wider
    buffers."""
    import cupy

    from tilekernels.logprobs import logprobs_reference

    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    if n > 1:
        x[0, [n - 1, n // 3]] = 40.0
    tokens = rng.integers(0, n, rows).astype(np.int64)
    want = logprobs_reference(x, tokens, top)
    got = tk.logprobs(cupy.asarray(x), cupy.asarray(tokens), top)

    def close(a, b):        # relative to the log-probability's size, near 0 absolute
        return bool((np.abs(a.get() - b) <= FP32 * (1 + np.abs(b))).all())
    assert close(got[0], want[0]) and close(got[1], want[1])
    assert np.array_equal(got[2].get(), want[2])
    out = (cupy.full(rows, np.nan, cupy.float32), cupy.full((rows, 32), np.nan, cupy.float32),
           cupy.full((rows, 32), -1, cupy.int64))
    tk.logprobs(cupy.asarray(x), cupy.asarray(tokens), top, out=out)
    assert np.array_equal(out[0].get(), got[0].get()) and np.array_equal(out[2][:, :top].get(), want[2])
    assert np.array_equal(out[1][:, :top].get(), got[1].get())      # the wider buffers' row stride
    width = max(1 << max(top - 1, 0).bit_length(), 1)                # columns past it untouched
    assert (out[2][:, width:] == -1).all() and cupy.isnan(out[1][:, width:]).all()
    from tilekernels._arrays import last_block_counters

    assert not last_block_counters(rows).any()


@pytest.mark.parametrize("rows,n", [(1, 1), (3, 7), (2, 769), (1, 1281), (4, 50257), (1, 59264), (2, 300000)])
def test_argmax(poisoned, rng, rows, n):
    """First index of the largest value, across chunk boundaries, ties and NaN as numpy."""
    import cupy

    x = rng.standard_normal((rows, n)).astype(np.float32)
    assert np.array_equal(tk.argmax(cupy.asarray(x)).get(), np.argmax(x, -1))
    if n > 1:
        x[0, [n - 1, n // 3]] = 100.0           # a tie in two chunks: the first wins
        x[-1, :] = -np.inf
        assert np.array_equal(tk.argmax(cupy.asarray(x)).get(), np.argmax(x, -1))
        x[0, [n - 1, n // 2]] = np.nan
        out = cupy.asarray(np.full(rows, -1, np.int64))
        assert tk.argmax(cupy.asarray(x), out=out) is out
        assert np.array_equal(out.get(), np.argmax(x, -1))
    from tilekernels._arrays import last_block_counters

    assert not last_block_counters(rows).any()      # the picking blocks left their counts at zero


@pytest.mark.parametrize("rows,n,c,counters,bf16", [(1, 50257, 768, 2, False), (8, 769, 7, 2, False),
                                                    (3, 59264, 2048, 1281, True), (1, 1, 1, 1, False)])
def test_argmax_step_tail(poisoned, rng, rows, n, c, counters, bf16):
    """The picking blocks advance positions and counters and gather the chosen rows (embed) at
    the advanced positions, as the numpy op does; with and without a position table."""
    import cupy

    x = rng.standard_normal((rows, n)).astype(np.float32)
    table, pos_table = rng.standard_normal((n, c)).astype(np.float32), rng.standard_normal((40, c)).astype(np.float32)
    if bf16:
        table = tk.compact((table.view(np.uint32) & 0xFFFF0000).view(np.float32))
    for pt in (pos_table, None):
        pos, cnt = rng.integers(0, 30, rows).astype(np.int64), rng.integers(-5, 5, counters).astype(np.int32)
        want = np.full((rows, c), np.nan, np.float32)
        ids = tk.argmax(x, positions=pos.copy(), counters=cnt.copy(), embed=(table, pt, want))
        dev = [cupy.asarray(a) for a in (x, pos, cnt, table)]
        got = cupy.empty((rows, c), cupy.float32)        # NaN until written (poisoned)
        dp = None if pt is None else cupy.asarray(pt)
        out = tk.argmax(dev[0], positions=dev[1], counters=dev[2], embed=(dev[3], dp, got))
        assert np.array_equal(out.get(), ids)
        assert np.array_equal(dev[1].get(), pos + 1) and np.array_equal(dev[2].get(), cnt + 1)
        assert np.array_equal(got.get(), want)


SAMPLERS = [dict(temperature=0, penalty=1.3), dict(temperature=1.0), dict(temperature=0.8, top_k=200),
            dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=50, top_p=0.8, penalty=1.2),
            dict(temperature=1.0, top_k=1), dict(temperature=2.0, top_p=0.05), dict(temperature=1.5, top_k=7),
            dict(temperature=1.0, min_p=0.05), dict(temperature=0.9, top_p=0.9, min_p=0.2, presence=0.5, frequency=0.3),
            dict(temperature=0, frequency=1.5, bias=True), dict(temperature=1.2, penalty=1.1, presence=-0.5, bias=True)]


def sampled_logits(rng, rows, n):
    """Spread logits with ties (every fifth value rounded) and, past 7 values, -inf ones."""
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    x[:, ::5] = np.round(x[:, ::5])
    if n > 7:
        x[0, :3] = -np.inf
    return x


@pytest.mark.parametrize("cfg", SAMPLERS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("rows,n", [(1, 1), (7, 7), (3, 769), (2, 1281), (4, 50257), (1, 59264)])
def test_sample(poisoned, rng, rows, n, cfg):
    """The token the numpy reference draws with the same uniform, for every filter combination,
    sizes across chunk boundaries, ties and -inf logits; the chosen tokens marked in seen. A
    different token is allowed only where u sits within float32 rounding of a CDF step."""
    import cupy

    from tilekernels.sampling import adjusted, kept, sample_reference

    x = sampled_logits(rng, rows, n)
    u = rng.random(rows, dtype=np.float32)
    cfg = dict(cfg)
    seen = (rng.random((rows, n)) < 0.1).astype(np.uint8) if "penalty" in cfg else None
    counted = "presence" in cfg or "frequency" in cfg
    counts = rng.integers(0, 3, (rows, n)).astype(np.float32) * (rng.random((rows, n)) < 0.2) if counted else None
    bias = (rng.uniform(-5, 5, (rows, n)) * (rng.random((rows, n)) < 0.05)).astype(np.float32) \
        if cfg.pop("bias", False) else None
    args = dict(temperature=cfg["temperature"], top_k=cfg.get("top_k", 0), top_p=cfg.get("top_p", 1.0),
                penalty=cfg.get("penalty", 1.0))
    extra = dict(min_p=cfg.get("min_p", 0.0), presence=cfg.get("presence", 0.0), frequency=cfg.get("frequency", 0.0))
    want_seen, want_counts = (None if a is None else a.copy() for a in (seen, counts))
    want = sample_reference(x, u.astype(np.float64), **args, seen=want_seen, counts=want_counts, bias=bias, **extra)
    dseen, dcounts = (None if a is None else cupy.asarray(a) for a in (seen, counts))
    got = tk.sample(cupy.asarray(x), cupy.asarray(u), **cfg, seen=dseen, counts=dcounts,
                    bias=None if bias is None else cupy.asarray(bias)).get()
    xp_ = adjusted(x, seen, args["penalty"], counts, extra["presence"], extra["frequency"], bias)
    for r in range(rows):
        if got[r] == want[r]:
            continue
        assert cfg["temperature"] > 0, (r, got[r], want[r])
        keep = kept(xp_[r:r + 1], args["temperature"], args["top_k"], args["top_p"], extra["min_p"])[0]
        w = np.where(keep, np.exp((xp_[r].astype(np.float64) - xp_[r].max()) / args["temperature"]), 0)
        cdf = np.cumsum(w) / w.sum()
        g = got[r]
        assert keep[g] and cdf[g] - w[g] / w.sum() - 1e-5 <= u[r] <= cdf[g] + 1e-5, (r, g, want[r], u[r])
    if seen is not None:
        assert np.array_equal(dseen.get(), np.maximum(seen, np.eye(n, dtype=np.uint8)[got]))
    if counts is not None:
        assert np.array_equal(dcounts.get(), counts + np.eye(n, dtype=np.float32)[got])
    from tilekernels._arrays import last_block_counters

    assert not last_block_counters(rows).any()


def test_sample_rows_with_settings_of_their_own(poisoned, rng):
    """Per-row settings in one call (greedy, penalised, biased, top-k, top-p, min-p rows
    together) draw what each row's settings draw alone, with the searches run for every row."""
    import cupy

    rows, n = len(SAMPLERS), 50257
    x = sampled_logits(rng, rows, n)
    u = rng.random(rows, dtype=np.float32)
    seen = (rng.random((rows, n)) < 0.1).astype(np.uint8)
    counts = (rng.integers(0, 3, (rows, n)) * (rng.random((rows, n)) < 0.2)).astype(np.float32)
    bias = np.array([rng.uniform(-5, 5, n) * (rng.random(n) < 0.05) * bool(c.get("bias")) for c in SAMPLERS],
                    np.float32)
    col = {k: np.array([c.get(k, d) for c in SAMPLERS], dt)
           for k, d, dt in (("temperature", 1.0, np.float32), ("top_k", 0, np.int32), ("top_p", 1.0, np.float32),
                            ("penalty", 1.0, np.float32), ("min_p", 0.0, np.float32), ("presence", 0.0, np.float32),
                            ("frequency", 0.0, np.float32))}
    dseen, dcounts = cupy.asarray(seen), cupy.asarray(counts)
    got = tk.sample(cupy.asarray(x), cupy.asarray(u), seen=dseen, counts=dcounts, bias=cupy.asarray(bias),
                    **{k: cupy.asarray(v) for k, v in col.items()}).get()
    for r, cfg in enumerate(SAMPLERS):
        alone = tk.sample(cupy.asarray(x[r:r + 1]), cupy.asarray(u[r:r + 1]), **{k: col[k][r].item() for k in col},
                          seen=cupy.asarray(seen[r:r + 1]), counts=cupy.asarray(counts[r:r + 1]),
                          bias=cupy.asarray(bias[r:r + 1])).get()
        assert got[r] == alone[0], (r, cfg)
    assert dseen.get()[np.arange(rows), got].all()
    assert np.array_equal(dcounts.get(), counts + np.eye(n, dtype=np.float32)[got])


def test_sample_distribution(rng):
    """Fresh uniforms over many rows: top-k 3 of 5 tokens drawn at the filtered softmax's rates."""
    import cupy

    rows = 4096
    x = np.tile(np.array([[0.0, 1.0, 2.0, -1.0, 0.5]], np.float32), (rows, 1))
    got = tk.sample(cupy.asarray(x), cupy.asarray(rng.random(rows, dtype=np.float32)), top_k=3).get()
    p = np.exp(x[0]) * [0, 1, 1, 0, 1]
    p /= p.sum()
    counts = np.bincount(got, minlength=5)
    assert counts[[0, 3]].sum() == 0
    assert np.abs(counts / rows - p).max() < 4 * np.sqrt(0.25 / rows)


def test_sample_takes_minus_zero_for_plus_zero():
    """-0.0 and +0.0 are equal logits, as the reference compares them: the first of them wins a
    greedy pick, and top_k counts them as one value's ties."""
    import cupy

    x = np.array([[-0.0, 0.0, -1.0], [1.0, 0.0, -0.0]], np.float32)
    bias = np.zeros_like(x)
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_k=2)):
        u = np.array([0.999, 0.999], np.float32)
        want = tk.sample(x, u, bias=bias, **kw)
        got = tk.sample(cupy.asarray(x), cupy.asarray(u), bias=cupy.asarray(bias), **kw).get()
        assert np.array_equal(got, want), kw


@pytest.mark.parametrize("rows,n,c", [(1, 50257, 768), (3, 769, 7)])
def test_sample_step_tail(poisoned, rng, rows, n, c):
    """Positions, counters and the next input's embedding, as the numpy op leaves them."""
    import cupy

    x = sampled_logits(rng, rows, n)
    u = rng.random(rows, dtype=np.float32)
    table, pos_table = rng.standard_normal((n, c)).astype(np.float32), rng.standard_normal((40, c)).astype(np.float32)
    pos, cnt = rng.integers(0, 30, rows).astype(np.int64), rng.integers(-5, 5, 2).astype(np.int32)
    seen = np.zeros((rows, n), np.uint8)
    want = np.full((rows, c), np.nan, np.float32)
    cfg = dict(temperature=0.9, top_k=40, top_p=0.95, penalty=1.1)
    ids = tk.sample(x, u, **cfg, seen=seen.copy(), positions=pos.copy(), counters=cnt.copy(),
                    embed=(table, pos_table, want))
    dev = [cupy.asarray(a) for a in (x, u, pos, cnt, table, pos_table, seen)]
    got = cupy.empty((rows, c), cupy.float32)
    out = cupy.empty(rows, cupy.int64)
    assert tk.sample(dev[0], dev[1], **cfg, seen=dev[6], out=out, positions=dev[2], counters=dev[3],
                     embed=(dev[4], dev[5], got)) is out
    assert np.array_equal(out.get(), ids)
    assert np.array_equal(dev[2].get(), pos + 1) and np.array_equal(dev[3].get(), cnt + 1)
    assert np.array_equal(got.get(), want) and dev[6].get()[np.arange(rows), ids].all()
