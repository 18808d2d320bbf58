"""y = residual + act(norm(x) @ weight.T + bias), the one projection both models are built of.

weight is (N, K), the torch nn.Linear layout, float32 or bfloat16 (weights.compact: a
bfloat16 checkpoint kept as it was published; every kernel widens a weight tile to float32
as it loads it, so the arithmetic is float32 either way and the bytes streamed halve).
Bias, activation, a gated unit (activation 'swiglu': weight stacks [gate; up],
y = silu(gate) * up) and the residual add are fused into the kernel's epilogue. The decode
kernels compute a norm themselves when it is an RMSNorm, or a LayerNorm without parameters
(fold_norm moved its scale and shift into the weights and centred the weight rows): each
block sums the row's statistics from the x tiles it streams anyway, scales x by the norm's
weight as it loads it, and scales the result in the epilogue. Any other norm, and any norm
ahead of the large-M kernel, runs as its own kernel first. The GEMV issues its weight loads
before waiting for x (dependent launch: see _arrays.launch).

Three kernels by the number of rows M:
- M = 1 (decode at batch 1): a weight-streaming GEMV on CUDA cores in plain fp32; each
  block owns one or two output rows over all of K, so there is no split-K reduction.
- M <= 16 (batched decode, and M = 1 with a bfloat16 vocabulary-wide N): weights as the A operand
  of a TF32 mma, 64 output columns per block against up to 16 rows of x.
- larger M: 128x128 TF32 tiles in grouped order for L2 reuse, split over K (second
  kernel reduces and applies the epilogue) only when the output tiles cover under a quarter
  of the SMs.
Measured on an H200 (benchmarks/results/kernels-h200.md at 4f7986f) and an H100 (gemm-sweep-h100.json at 4f7986f,
gemv-sweep-h100.json at 4f7986f) to pick these shapes.
"""
from __future__ import annotations


import cuda.tile as ct
import numpy as np

from ._arrays import backend, check, inputs_ready, launch, next_pow2, sm_count
from ._reduce import sums2, sums4
from .activations import SILU, activation_code, apply_activation_reference, tile_activation
from .norm import LayerNorm, RMSNorm
from .precision import precise, tf32_mma
from .weights import WEIGHT_DTYPES, f32, widen

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
GROUP_M = 8
RESID_PARTS = 4     # row slices in which linear_kernel's epilogue adds the residual


def linear_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None,
                     activation: str | None = None, norm=None, residual: np.ndarray | None = None) -> np.ndarray:
    if norm is not None:
        x = norm(x)
    y = x @ widen(weight).T
    if bias is not None:
        y = y + bias
    if activation == "swiglu":
        half = y.shape[-1] // 2
        y = apply_activation_reference(y[..., :half].astype(np.float32), "silu").astype(np.float64) * y[..., half:]
    else:
        y = apply_activation_reference(y.astype(np.float32), activation)
    if residual is not None:
        y = residual + y
    return y.astype(np.float32)


# ---------------------------------------------------------------- tile helpers
NO_NORM, LAYER, RMS = 0, 1, 2


def norm_input(x, x0, G, k, s1, s2, k_total, TILE_K: int, NORM: int, SCALE: bool):
    """Chunk k of the rows x as the product sees it, and the running sums for norm_scale
    (elementwise: reduced once at the end, with the product where possible: _reduce).

    LAYER shifts x by x0, each row's first element: with the weight rows centred by
    fold_norm, (x - x0) @ w.T equals (x - mean) @ w.T, and sums of x - x0 keep the variance
    of a row far from zero exact to fp32 rounding. RMS leaves x as it is. SCALE (RMS)
    multiplies x by the norm's weight G after the sums: rms(x) is of x unscaled."""
    if NORM == LAYER:
        cols = ct.arange(TILE_K, dtype=ct.int32)[None, :]
        x = ct.where(k * TILE_K + cols < k_total, x - x0, 0.0)
        s1 = s1 + x
    if NORM != NO_NORM:
        s2 = s2 + x * x
    if SCALE:
        x = x * ct.load(G, index=(k,), shape=(TILE_K,), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)[None, :]
    return x, s1, s2


def norm_scale(t1, t2, k_total, eps: float):
    """1/std (LAYER) or 1/rms (RMS, t1 = 0) of each row from the row sums t1, t2 of
    norm_input's s1, s2, (rows, 1)."""
    inv_k = 1.0 / k_total
    mean = t1 * inv_k
    var = ct.maximum(t2 * inv_k - mean * mean, 0.0)
    return ct.rsqrt(var + eps)


def first_column(X, bm, TILE_M: int, NORM: int):
    """x0 of norm_input: each row's first element for LAYER (zeros otherwise)."""
    x0 = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    if NORM == LAYER:
        x0 = ct.load(X, index=(bm, 0), shape=(TILE_M, 1), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)
    return x0


def bias_tile(Bias, bn, TILE_N: int, HAS_BIAS: bool):
    """The bias of output columns bn, (1, TILE_N); a constant, so it may load before the wait."""
    bias = ct.full((1, TILE_N), 0.0, dtype=ct.float32)
    if HAS_BIAS:
        bias = ct.load(Bias, index=(bn,), shape=(TILE_N,), padding_mode=ct.PaddingMode.ZERO,
                       allow_tma=False)[None, :]
    return bias


def residual_tile(R, bm, bn, TILE_M: int, TILE_N: int, RESID: bool):
    """The residual of output tile (bm, bn), loaded early so its latency overlaps the product's."""
    res = ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32)
    if RESID:
        res = ct.load(R, index=(bm, bn), shape=(TILE_M, TILE_N), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)
    return res


def epilogue(acc, up, rstd, bias, res, Y, bm, bn, HAS_BIAS: bool, ACT: int, GLU: bool, RESID: bool, NORM: int,
             TMA: bool = True):
    """Store res + act(acc [* rstd] + bias) [* up] as output tile (bm, bn) (bias and res from
    bias_tile and residual_tile). TMA=False stores plainly: a TMA store of a tile of 16 bytes or
    more turns a GEMV warp-specialised (SASS: 256 threads, 255 registers, one block an SM)."""
    if NORM != NO_NORM:
        acc = acc * rstd
        up = up * rstd
    if HAS_BIAS:
        acc = acc + bias
    acc = tile_activation(acc, ACT)
    if GLU:
        acc = acc * up
    if RESID:
        acc = acc + res
    ct.store(Y, index=(bm, bn), tile=acc, allow_tma=TMA)


def weight_tiles(W, W2, bn, k, TILE_N: int, TILE_K: int, GLU: bool, TMA: bool):
    """Weight tile k of rows bn (and of the up half for GLU) as stored; zeros past the end
    of K. TMA=False loads straight into registers: plain loads issued before inputs_ready()
    are in flight while the kernel waits, where the compiler's TMA pipeline only starts
    after the wait (seen in the SASS)."""
    w = ct.load(W, index=(bn, k), shape=(TILE_N, TILE_K), padding_mode=ct.PaddingMode.ZERO, allow_tma=TMA)
    w2 = w
    if GLU:
        w2 = ct.load(W2, index=(bn, k), shape=(TILE_N, TILE_K), padding_mode=ct.PaddingMode.ZERO, allow_tma=TMA)
    return w, w2


# ---------------------------------------------------------------- kernels
def gemv_chunk(X, G, m, k, w, w2, acc, acc2, s1, s2, x0, TILE_K: int, GLU: bool, NORM: int, SCALE: bool):
    x = ct.load(X, index=(m, k), shape=(1, TILE_K), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)
    x, s1, s2 = norm_input(x, x0, G, k, s1, s2, X.shape[1], TILE_K, NORM, SCALE)
    acc = acc + f32(w) * x
    if GLU:
        acc2 = acc2 + f32(w2) * x
    return acc, acc2, s1, s2


@ct.kernel
def gemv_kernel(X, W, W2, G, Bias, R, Y, eps: float, TILE_N: ConstInt, TILE_K: ConstInt,
                HAS_BIAS: ConstBool, ACT: ConstInt, GLU: ConstBool, RESID: ConstBool, NORM: ConstInt,
                SCALE: ConstBool, TMA: ConstBool, ONE_TILE: ConstBool):
    """TILE_N outputs of row bid(1) over all of K in fp32 FMAs: products accumulate
    elementwise in a (TILE_N, TILE_K) tile and are summed across K once at the end. The
    first weight tile (all of K when TILE_K covers it) and the bias are requested before
    the kernel waits for x (dependent launch), the residual with x; see weight_tiles for TMA.
    ONE_TILE (TILE_K covers K) compiles the K loop out: its code alone held registers (GPT-2's
    LayerNorm-fused GEMV: 96 -> 40 a thread, 5 -> 12 blocks an SM, so every block of a
    2304- or 3072-row projection is resident and streaming its weights before the wait).
    bfloat16 weights go through TMA (linear_plan): loaded plainly, each thread fetches 2 bytes
    at a time (SASS: LDG.E.U16) and holds as many registers a byte as float32 needs for 4."""
    bn = ct.bid(0)
    m = ct.bid(1)
    w, w2 = weight_tiles(W, W2, bn, 0, TILE_N, TILE_K, GLU, TMA)
    bias = bias_tile(Bias, bn, TILE_N, HAS_BIAS)
    inputs_ready()
    res = residual_tile(R, m, bn, 1, TILE_N, RESID)
    x0 = first_column(X, m, 1, NORM)
    zero = ct.full((TILE_N, TILE_K), 0.0, dtype=ct.float32)
    stats = ct.full((1, TILE_K), 0.0, dtype=ct.float32)
    acc, acc2, s1, s2 = gemv_chunk(X, G, m, 0, w, w2, zero, zero, stats, stats, x0, TILE_K, GLU, NORM, SCALE)
    if not ONE_TILE:
        for k in range(1, ct.cdiv(X.shape[1], TILE_K)):
            w, w2 = weight_tiles(W, W2, bn, k, TILE_N, TILE_K, GLU, TMA)
            acc, acc2, s1, s2 = gemv_chunk(X, G, m, k, w, w2, acc, acc2, s1, s2, x0, TILE_K, GLU, NORM, SCALE)
    y, up, t1, t2 = sums4(acc, acc2, s1, s2, axis=1)      # (TILE_N, 1) each; t1, t2 the same in every row
    epilogue(ct.transpose(y), ct.transpose(up), ct.transpose(norm_scale(t1, t2, X.shape[1], eps)), bias, res, Y,
             m, bn, HAS_BIAS, ACT, GLU, RESID, NORM, TMA)


def skinny_chunk(X, G, bm, k, w, w2, acc, acc2, s1, s2, x0, TILE_M: int, TILE_K: int, GLU: bool, NORM: int,
                 SCALE: bool, PRECISE: bool):
    x = ct.load(X, index=(bm, k), shape=(TILE_M, TILE_K), padding_mode=ct.PaddingMode.ZERO)
    x, s1, s2 = norm_input(x, x0, G, k, s1, s2, X.shape[1], TILE_K, NORM, SCALE)
    xt = ct.transpose(x)
    acc = tf32_mma(f32(w), xt, acc, PRECISE)
    if GLU:
        acc2 = tf32_mma(f32(w2), xt, acc2, PRECISE)
    return acc, acc2, s1, s2


@ct.kernel
def skinny_kernel(X, W, W2, G, Bias, R, Y, eps: float, TILE_M: ConstInt, TILE_N: ConstInt, TILE_K: ConstInt,
                  HAS_BIAS: ConstBool, ACT: ConstInt, GLU: ConstBool, RESID: ConstBool, NORM: ConstInt,
                  SCALE: ConstBool, PRECISE: ConstBool):
    """Up to TILE_M rows of x against TILE_N weight rows: the weight tile is the mma's
    A operand (TILE_N, TILE_K), x transposed the B operand, so N fills the tensor-core M."""
    bn = ct.bid(0)
    bm = ct.bid(1)
    w, w2 = weight_tiles(W, W2, bn, 0, TILE_N, TILE_K, GLU, True)
    inputs_ready()
    x0 = first_column(X, bm, TILE_M, NORM)
    zero = ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32)
    stats = ct.full((TILE_M, TILE_K), 0.0, dtype=ct.float32)
    acc, acc2, s1, s2 = skinny_chunk(X, G, bm, 0, w, w2, zero, zero, stats, stats, x0, TILE_M, TILE_K, GLU, NORM,
                                     SCALE, PRECISE)
    for k in range(1, ct.cdiv(X.shape[1], TILE_K)):
        w, w2 = weight_tiles(W, W2, bn, k, TILE_N, TILE_K, GLU, True)
        acc, acc2, s1, s2 = skinny_chunk(X, G, bm, k, w, w2, acc, acc2, s1, s2, x0, TILE_M, TILE_K, GLU, NORM,
                                         SCALE, PRECISE)
    epilogue(ct.transpose(acc), ct.transpose(acc2), norm_scale(*sums2(s1, s2, axis=1), X.shape[1], eps),
             bias_tile(Bias, bn, TILE_N, HAS_BIAS), residual_tile(R, bm, bn, TILE_M, TILE_N, RESID), Y, bm, bn,
             HAS_BIAS, ACT, GLU, RESID, NORM)


def _grouped(tile_id, num_m, num_n):
    """Grouped ordering: GROUP_M row-tiles share each column of W while it is in L2."""
    in_group = GROUP_M * num_n
    first_m = (tile_id // in_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + (tile_id % size_m), (tile_id % in_group) // size_m


@ct.kernel
def linear_kernel(X, W, W2, Bias, R, Y, k_tiles_per_split: int,
                  TILE_M: ConstInt, TILE_N: ConstInt, TILE_K: ConstInt, HAS_BIAS: ConstBool, ACT: ConstInt,
                  GLU: ConstBool, RESID: ConstBool, PARTIAL: ConstBool, PRECISE: ConstBool):
    """One (TILE_M, TILE_N) output tile over one K range (axis 1 of the grid); PARTIAL
    stores the raw sum for splitk_reduce_kernel instead of the epilogue."""
    inputs_ready()
    num_m = ct.cdiv(X.shape[0], TILE_M)
    num_n = ct.cdiv(W.shape[0], TILE_N)
    bm, bn = _grouped(ct.bid(0), num_m, num_n)
    split = ct.bid(1)
    k_tiles = ct.cdiv(X.shape[1], TILE_K)
    k0 = split * k_tiles_per_split
    k1 = min(k0 + k_tiles_per_split, k_tiles)
    acc = ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32)
    acc2 = ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32)
    for k in range(k0, k1):
        a = ct.load(X, index=(bm, k), shape=(TILE_M, TILE_K), padding_mode=ct.PaddingMode.ZERO)
        b = ct.load(W, index=(k, bn), shape=(TILE_K, TILE_N), order=(1, 0), padding_mode=ct.PaddingMode.ZERO)
        acc = tf32_mma(a, f32(b), acc, PRECISE)
        if GLU:
            b2 = ct.load(W2, index=(k, bn), shape=(TILE_K, TILE_N), order=(1, 0), padding_mode=ct.PaddingMode.ZERO)
            acc2 = tf32_mma(a, f32(b2), acc2, PRECISE)
    if PARTIAL:
        ct.store(Y, index=(split, bm, bn), tile=ct.reshape(acc, (1, TILE_M, TILE_N)))
    else:
        bias = bias_tile(Bias, bn, TILE_N, HAS_BIAS)
        # the residual joins a slice of rows at a time: a whole residual tile beside the
        # accumulator spilled registers (SASS), ~11 us of the encoder's 1500 x 5120 -> 1280
        parts = RESID_PARTS if RESID else 1
        rows = TILE_M // parts
        for part in ct.static_iter(range(parts)):
            a = ct.extract(acc, (part, 0), shape=(rows, TILE_N))
            up = ct.extract(acc2, (part, 0), shape=(rows, TILE_N))
            r = bm * parts + part
            epilogue(a, up, a, bias, residual_tile(R, r, bn, rows, TILE_N, RESID), Y, r, bn,
                     HAS_BIAS, ACT, GLU, RESID, NO_NORM)


@ct.kernel
def splitk_reduce_kernel(P, Bias, R, Y, TILE_N: ConstInt, HAS_BIAS: ConstBool, ACT: ConstInt, RESID: ConstBool):
    """Y[m, n-tile] = residual + act(sum over splits of P[:, m, n-tile] + bias)."""
    inputs_ready()
    m = ct.bid(0)
    j = ct.bid(1)
    acc = ct.full((1, TILE_N), 0.0, dtype=ct.float32)
    for s in range(P.shape[0]):
        p = ct.load(P, index=(s, m, j), shape=(1, 1, TILE_N), padding_mode=ct.PaddingMode.ZERO)
        acc = acc + ct.reshape(p, (1, TILE_N))
    epilogue(acc, acc, acc, bias_tile(Bias, j, TILE_N, HAS_BIAS), residual_tile(R, m, j, 1, TILE_N, RESID),
             Y, m, j, HAS_BIAS, ACT, False, RESID, NO_NORM)


# ---------------------------------------------------------------- planning and launch
LARGE_M = (128, 128, 32)     # (TILE_M, TILE_N, TILE_K)
GLU_LARGE_M = (128, 64, 32)  # two accumulators
SKINNY = (16, 64, 128)
SKINNY_GLU = (16, 32, 128)
BF16_GEMV = (16, 512)       # (TILE_N, TILE_K) of the batch-1 GEMV on bfloat16 weights
REDUCE_TILE = 256


def linear_plan(m: int, n: int, k: int, glu: bool = False, sms: int = 132, itemsize: int = 4):
    """Which kernel and tiles for an (M, N outputs, K) product: ('gemv', (TILE_N, TILE_K), tma),
    ('skinny', tiles) or ('tiles', tiles, K tiles per split, splits).

    Batch-1 projections: GEMV blocks whose weight slice is one tile over all of K, loaded
    without TMA so the loads are issued before the kernel waits for x: four rows for K <= 1024
    (one where N <= K: GPT-2's attention output, right after the attention kernel's few blocks),
    two up to K = 4096, one beyond (gpt2 step 274 -> 256 us against (2, 1024) and one row for
    K > 1024, the best of 29 mixes, decode-profile-gpt2-b1-h100-gemv-rows-*.json); bfloat16
    weights in (16, 512) tiles through TMA
    (plain loads of 2-byte elements streamed at ~1.6 TB/s; GLM-ASR step 2004 -> 1720 us, the
    best of 14 tile shapes, decode-profile-glm-asr-b1-h100-bf16-tiles.json at 4f7986f). float32 vocabulary
    heads take the GEMV too (gpt2 step 275.9 -> 271.5 us once its K loop was compiled out,
    decode-profile-gpt2-b1-h100-one-tile-gemv-merge-in-split.json at 4f7986f); bfloat16 ones (N > 4096)
    the mma kernel.
    Chosen on whole decode steps (tools/profile_decode.py --plans, benchmarks/results/
    decode-profile-*.json), tiles from tools/sweep_gemv.py at 4f7986f."""
    if m == 1 and itemsize == 2 and n <= (8192 if glu else 4096):
        return "gemv", BF16_GEMV, True
    if m == 1 and itemsize == 4:
        tk = min(next_pow2(k), 8192)
        tn = 1 if tk > 4096 else 2 if tk > 1024 else 1 if n <= k else 4
        return "gemv", (tn, tk), False
    if m <= 16:
        return "skinny", SKINNY_GLU if glu else SKINNY
    tm, tn, tk = tiles = GLU_LARGE_M if glu else LARGE_M
    out_tiles = -(-m // tm) * -(-n // tn)
    k_tiles = -(-k // tk)
    # split-K only for a grid under a quarter of the SMs: its partial sums cost a pass over
    # memory and a reduce kernel, measured slower from half a wave up (tools/sweep_gemm.py at 4f7986f)
    split = 1 if glu or 4 * out_tiles > sms else min(k_tiles, -(-2 * sms // out_tiles), 64)
    per = -(-k_tiles // split)
    return "tiles", tiles, per, -(-k_tiles // per)


def _linear_cupy(x, weight, bias, act, glu, norm, residual):
    import cupy

    k = x.shape[-1]
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = cupy.empty((m, n), dtype=cupy.float32)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    plan = linear_plan(m, n, k, glu, sm_count(), weight.dtype.itemsize)
    rms = isinstance(norm, RMSNorm)
    in_kernel = norm is not None and (rms or not norm.affine) and plan[0] != "tiles"
    if norm is not None and not in_kernel:
        x2 = norm(x2)
    code = (RMS if rms else LAYER) if in_kernel else NO_NORM
    eps = float(norm.eps) if in_kernel else 0.0
    scale = in_kernel and norm.affine
    g = norm.weight if scale else x2
    w, w2 = (weight[:n], weight[n:]) if glu else (weight, weight)
    b = x2 if bias is None else bias
    r = y if residual is None else residual.reshape(m, n)
    flags = (bias is not None, act, glu, residual is not None)
    if plan[0] == "gemv":
        (tn, tk), tma = plan[1:]
        launch((-(-n // tn), m, 1), gemv_kernel,
               (x2, w, w2, g, b, r, y, eps, tn, tk, *flags, code, scale, tma, tk >= k))
    elif plan[0] == "skinny":
        tm, tn, tk = plan[1]
        launch((-(-n // tn), -(-m // tm), 1), skinny_kernel,
               (x2, w, w2, g, b, r, y, eps, tm, tn, tk, *flags, code, scale, precise()))
    else:
        _, (tm, tn, tk), per, split = plan
        grid = (-(-m // tm) * -(-n // tn), split, 1)
        if split == 1:
            launch(grid, linear_kernel, (x2, w, w2, b, r, y, per, tm, tn, tk, *flags, False, precise()))
        else:
            part = cupy.empty((split, m, n), dtype=cupy.float32)
            launch(grid, linear_kernel, (x2, w, w2, b, r, part, per, tm, tn, tk, False, 0, False, False, True,
                                         precise()))
            launch((m, -(-n // REDUCE_TILE), 1), splitk_reduce_kernel,
                   (part, b, r, y, REDUCE_TILE, flags[0], act, flags[3]))
    return y.reshape(*x.shape[:-1], n)


def linear(x, weight, bias=None, activation: str | None = None, *, norm: LayerNorm | RMSNorm | None = None,
           residual=None):
    """residual + act(norm(x) @ weight.T + bias); x (..., K), weight (N, K), bias (N,).

    activation: None, 'gelu' (exact), 'gelu_tanh', 'silu', or 'swiglu': weight stacks the
    gate and up projections (2I, K) and the result is silu(gate) * up, (..., I).
    norm: a LayerNorm or RMSNorm applied to x first; the decode kernels (M <= 16) compute an
    RMSNorm or a LayerNorm without parameters (see fold_norm) themselves, otherwise it runs first.
    residual: (..., N_out), added last.
    """
    if norm is not None and not isinstance(norm, (LayerNorm, RMSNorm)):
        raise TypeError(f"norm: expected a LayerNorm or RMSNorm, got {type(norm).__name__}")
    kind = backend(x=x, weight=weight, bias=bias, residual=residual,
                   norm_weight=None if norm is None else norm.weight,
                   norm_bias=getattr(norm, "bias", None))
    glu = activation == "swiglu"
    act = SILU if glu else activation_code(activation)
    check("x", x, ndim=tuple(range(1, 8)))
    check("weight", weight, shape=(None, x.shape[-1]), dtype=WEIGHT_DTYPES)
    n = weight.shape[0]
    if glu:
        if n % 2:
            raise ValueError(f"weight: 'swiglu' needs the gate and up rows stacked (even rows), got {n}")
        if bias is not None:
            raise ValueError("bias: 'swiglu' takes no bias")
        n //= 2
    if bias is not None:
        check("bias", bias, shape=(weight.shape[0],))
    if norm is not None and norm.affine:
        check("norm weight", norm.weight, shape=(x.shape[-1],))
        if isinstance(norm, LayerNorm) and norm.bias is not None:
            check("norm bias", norm.bias, shape=(x.shape[-1],))
    if residual is not None:
        check("residual", residual, shape=(*x.shape[:-1], n))
    if kind == "numpy":
        return linear_reference(x, weight, bias, activation, norm, residual)
    return _linear_cupy(x, weight, bias, act, glu, norm, residual)
