"""y = residual + act(norm(x) @ weight.T + bias), the one projection both models are built of.

weight is (N, K), the torch nn.Linear layout, float32 or bfloat16 (weights.compact: a
bfloat16 checkpoint kept as it was published; the kernels widen a weight tile to float32 as
they load it, or at precision 'medium' multiply bfloat16 inputs by it directly). Bias,
activation, a gated unit (activation 'swiglu': weight stacks [gate; up], y = silu(gate) * up)
and the residual add are fused into the kernel's epilogue. The decode kernel computes a norm
itself when it is an RMSNorm, or a LayerNorm without parameters (fold_norm moved its scale and
shift into the weights and centred the weight rows): each block sums the row's statistics from
the x tiles it streams anyway, scales x by the norm's weight as it loads it, and scales the
result in the epilogue. Any other norm, and any norm ahead of the tiles kernel, runs as its
own kernel first (storing bfloat16 where the product takes it).

Two kernels, by what the product is (linear_plan):
- a decode step's (one token a sequence, up to DECODE_ROWS = 128 rows, batch 1 included): the
  skinny kernel, weights as the A operand of a TF32 mma (bfloat16 at 'medium' for bfloat16
  weights), 64 output columns (32 gated; twice that for wide bfloat16 weights; half at up to 16
  rows without a norm in the kernel) per block against up to 32 of the bucket's rows of x, K
  split over blocks (deterministically merged) where N alone leaves the GPU short of weight loads
  in flight, one block an SM while they fit the SMs, two otherwise. A row's arithmetic is the
  same in every bucket.
- a sequence's (prompts, encoder windows) and any of more rows: 128x128 tiles in grouped
  order for L2 reuse (fewer rows or columns where they are too few for the SMs), TF32 (or
  bfloat16 at 'medium'), split over K only for decode-shaped products with too few output tiles.
How each kernel tiles a product: tiling.py; figures: benchmarks/results/ and docs/performance.md.
"""
from __future__ import annotations


import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import (backend, check, inputs_ready, last_block_counters, last_in_group, launch, reset_count, sm_count)
from ._reduce import pairwise_row_sums, sums2
from .activations import SILU, activation_code, apply_activation_reference, tile_activation
from .norm import LayerNorm, RMSNorm
from .precision import BF16 as BF16_MMA, TF32X3, mma, mma_mode, operand
from .tiling import NARROW_ROWS, REDUCE_TILE, skinny_block_n, skinny_block_k, skinny_splits, linear_plan
from .weights import BF16, WEIGHT_DTYPES, bf16, empty, f32, like, narrow, result_dtype, to_bf16, widen
from .interop import any_array

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
GROUP_M = 8
RESID_PARTS = 4     # row slices in which linear_kernel's epilogue adds the residual


def linear_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None,
                     activation: str | None = None, norm=None, residual: np.ndarray | None = None,
                     out_dtype=np.float32) -> np.ndarray:
    x = widen(x)
    if norm is not None:
        x = norm(x)
    y = x @ widen(weight).T
    if bias is not None:
        y = y + bias
    if activation == "swiglu":
        half = y.shape[-1] // 2
        y = apply_activation_reference(y[..., :half].astype(np.float32), "silu").astype(np.float64) * y[..., half:]
    else:
        y = apply_activation_reference(y.astype(np.float32, copy=False), activation)
    if residual is not None:
        y = residual + y
    return y.astype(np.float32, copy=False).astype(out_dtype, copy=False)


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
        x0 = f32(ct.load(X, index=(bm, 0), shape=(TILE_M, 1), padding_mode=ct.PaddingMode.ZERO, allow_tma=False))
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
    bias_tile and residual_tile), rounded to bfloat16 for a bfloat16 Y, and return it in float32.
    TMA=False stores plainly (a skinny block's small tile)."""
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
    ct.store(Y, index=(bm, bn), tile=like(Y, acc), allow_tma=TMA)
    return acc


def weight_tiles(W, W2, bn, k, TILE_N: int, TILE_K: int, GLU: bool):
    """Weight tile k of rows bn (and of the up half for GLU) as stored; zeros past the end of K."""
    w = ct.load(W, index=(bn, k), shape=(TILE_N, TILE_K), padding_mode=ct.PaddingMode.ZERO)
    w2 = w
    if GLU:
        w2 = ct.load(W2, index=(bn, k), shape=(TILE_N, TILE_K), padding_mode=ct.PaddingMode.ZERO)
    return w, w2


# ---------------------------------------------------------------- kernels
def skinny_chunk(X, XS, G, bm, k, w, w2, acc, acc2, e1, e2, x0, TILE_M: int, TILE_K: int, GLU: bool, NORM: int,
                 SCALE: bool, MMA: int, XS_IN: bool):
    """Fold K chunk k into the (TILE_N, TILE_M) accumulators and the norm's sums e1, e2, kept
    elementwise (TILE_M, TILE_K) and reduced once after the last chunk (a block reduction a
    chunk held every chunk's mma back). XS_IN: the operand is XS, x scaled by G and rounded to
    bfloat16 ahead (the same values), loaded as stored; x feeds only the sums."""
    x = ct.load(X, index=(bm, k), shape=(TILE_M, TILE_K), padding_mode=ct.PaddingMode.ZERO)
    if XS_IN:
        xt = ct.transpose(bf16(ct.load(XS, index=(bm, k), shape=(TILE_M, TILE_K), padding_mode=ct.PaddingMode.ZERO)))
        _, e1, e2 = norm_input(f32(x), x0, G, k, e1, e2, X.shape[1], TILE_K, NORM, False)
    elif MMA == BF16_MMA and NORM == NO_NORM and X.dtype == ct.uint16:
        xt = ct.transpose(bf16(x))      # bfloat16 as stored: the operand, never widened
    else:
        x, e1, e2 = norm_input(f32(x), x0, G, k, e1, e2, X.shape[1], TILE_K, NORM, SCALE)
        xt = ct.transpose(x)
        if MMA == BF16_MMA:
            xt = ct.astype(xt, ct.bfloat16)
    acc = mma(operand(w, MMA), xt, acc, MMA)
    if GLU:
        acc2 = mma(operand(w2, MMA), xt, acc2, MMA)
    return acc, acc2, e1, e2


@kernel(occupancy=2)    # two blocks an SM; skinny_kernel_one_an_sm below: the same arithmetic
def skinny_kernel(X, W, W2, G, Bias, R, Y, Y2, XS, P, P2, S, C, eps: float, k_tiles_per_split: int, TILE_M: ConstInt,
                  TILE_N: ConstInt, TILE_K: ConstInt, HAS_BIAS: ConstBool, ACT: ConstInt, GLU: ConstBool,
                  RESID: ConstBool, NORM: ConstInt, SCALE: ConstBool, MMA: ConstInt, SPLITS: ConstInt,
                  TWO: ConstBool, XS_IN: ConstBool, XS_OUT: ConstBool):
    """Up to TILE_M rows of x (batched decode: M = 2..128) against TILE_N weight rows over one
    K range (axis 2 of the grid): the weight tile is the mma's A operand (TILE_N, TILE_K), x
    transposed the B operand, so N fills the tensor-core M and one pass over the weights serves
    every row. The weights stream at bandwidth only with enough blocks in flight: SPLITS > 1 cuts
    K into ranges of blocks of their own (skinny_splits), each storing its partial sums (P, P2;
    the norm's row sums in S); the last block of an output tile to finish (counted in C) loads
    them MERGE_LOADS at a time and adds them in split order, so the result is the same on every
    run, and applies the epilogue.
    Axis 0 is the row blocks (64 and 128 rows): the blocks of one weight tile run side by side,
    the second reading it from L2 rather than HBM. TWO: the result is stored in Y2 too (a residual
    stream kept in float32 and in bfloat16 for the normed product it feeds); XS_OUT: and that
    bfloat16 copy times G (no norm here: the next product's RMSNorm weight) rounded to bfloat16
    in XS, which that product takes as its operand (XS_IN, skinny_chunk): at 32 rows a block
    its own scaling and the operand's trip back to shared memory made the gated product slower."""
    bm = ct.bid(0)
    bn = ct.bid(1)
    split = ct.bid(2)
    k0 = split * k_tiles_per_split
    k1 = min(k0 + k_tiles_per_split, ct.cdiv(X.shape[1], TILE_K))
    w, w2 = weight_tiles(W, W2, bn, k0, TILE_N, TILE_K, GLU)
    inputs_ready()
    x0 = first_column(X, bm, TILE_M, NORM)
    zero = ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32)
    stats = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    sums = ct.full((TILE_M, TILE_K), 0.0, dtype=ct.float32)
    acc, acc2, e1, e2 = skinny_chunk(X, XS, G, bm, k0, w, w2, zero, zero, sums, sums, x0, TILE_M, TILE_K, GLU, NORM,
                                     SCALE, MMA, XS_IN)
    for k in range(k0 + 1, k1):
        w, w2 = weight_tiles(W, W2, bn, k, TILE_N, TILE_K, GLU)
        acc, acc2, e1, e2 = skinny_chunk(X, XS, G, bm, k, w, w2, acc, acc2, e1, e2, x0, TILE_M, TILE_K, GLU, NORM,
                                         SCALE, MMA, XS_IN)
    s1, s2 = stats, stats
    if NORM == RMS:     # in a fixed order: the layout, and so a sum's order, changes with XS_IN
        s2 = pairwise_row_sums(e2)
    elif NORM == LAYER:
        s1, s2 = sums2(e1, e2, axis=1)
    done = True
    if SPLITS > 1:
        ct.store(P, index=(split, bn, bm), tile=ct.reshape(acc, (1, TILE_N, TILE_M)), allow_tma=False)
        if GLU:
            ct.store(P2, index=(split, bn, bm), tile=ct.reshape(acc2, (1, TILE_N, TILE_M)), allow_tma=False)
        if NORM != NO_NORM:
            ct.store(S, index=(split, 0, bm), tile=ct.reshape(s1, (1, 1, TILE_M)), allow_tma=False)
            ct.store(S, index=(split, 1, bm), tile=ct.reshape(s2, (1, 1, TILE_M)), allow_tma=False)
        tile = bn * ct.num_blocks(0) + bm
        done = last_in_group(C, tile, SPLITS)
        if done:
            # the splits' partials load MERGE_LOADS at a time (one round trip each; a loop loading one
            # and adding it took one a split); the block's own come from registers: read back through
            # memory, another thread of the block may see them unwritten (wrong sums at two blocks an
            # SM, H100 and H200), so what it loads of them is dropped
            own, own2, own1, own2s = acc, acc2, s1, s2
            acc, acc2, s1, s2 = zero, zero, stats, stats
            for j0 in ct.static_iter(range(0, SPLITS, MERGE_LOADS)):
                parts = ()
                for j in ct.static_iter(range(j0, min(j0 + MERGE_LOADS, SPLITS))):
                    p = ct.reshape(ct.load(P, index=(j, bn, bm), shape=(1, TILE_N, TILE_M), allow_tma=False),
                                   (TILE_N, TILE_M))
                    p2, t1, t2 = p, stats, stats
                    if GLU:
                        p2 = ct.reshape(ct.load(P2, index=(j, bn, bm), shape=(1, TILE_N, TILE_M), allow_tma=False),
                                        (TILE_N, TILE_M))
                    if NORM != NO_NORM:
                        t1 = ct.reshape(ct.load(S, index=(j, 0, bm), shape=(1, 1, TILE_M), allow_tma=False),
                                        (TILE_M, 1))
                        t2 = ct.reshape(ct.load(S, index=(j, 1, bm), shape=(1, 1, TILE_M), allow_tma=False),
                                        (TILE_M, 1))
                    parts += ((j, p, p2, t1, t2),)
                for j, p, p2, t1, t2 in ct.static_iter(parts):
                    mine = split == j
                    acc = acc + ct.where(mine, own, p)
                    if GLU:
                        acc2 = acc2 + ct.where(mine, own2, p2)
                    if NORM != NO_NORM:
                        s1, s2 = s1 + ct.where(mine, own1, t1), s2 + ct.where(mine, own2s, t2)
            reset_count(C, tile)
    if done:
        y = epilogue(ct.transpose(acc), ct.transpose(acc2), norm_scale(s1, s2, X.shape[1], eps),
                     bias_tile(Bias, bn, TILE_N, HAS_BIAS), residual_tile(R, bm, bn, TILE_M, TILE_N, RESID), Y, bm,
                     bn, HAS_BIAS, ACT, GLU, RESID, NORM, False)
        if TWO:
            y2 = like(Y2, y)
            ct.store(Y2, index=(bm, bn), tile=y2, allow_tma=False)
            if XS_OUT:
                g = f32(ct.load(G, index=(bn,), shape=(TILE_N,), padding_mode=ct.PaddingMode.ZERO, allow_tma=False))
                ct.store(XS, index=(bm, bn), tile=narrow(f32(y2) * g[None, :]), allow_tma=False)


def _grouped(tile_id, num_m, num_n):
    """Grouped ordering: GROUP_M row-tiles share each column of W while it is in L2."""
    in_group = GROUP_M * num_n
    first_m = (tile_id // in_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + (tile_id % size_m), (tile_id % in_group) // size_m


@kernel
def linear_kernel(X, W, W2, Bias, R, Y, k_tiles_per_split: int,
                  TILE_M: ConstInt, TILE_N: ConstInt, TILE_K: ConstInt, HAS_BIAS: ConstBool, ACT: ConstInt,
                  GLU: ConstBool, RESID: ConstBool, PARTIAL: ConstBool, MMA: ConstInt):
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
        a = operand(ct.load(X, index=(bm, k), shape=(TILE_M, TILE_K), padding_mode=ct.PaddingMode.ZERO), MMA)
        b = ct.load(W, index=(k, bn), shape=(TILE_K, TILE_N), order=(1, 0), padding_mode=ct.PaddingMode.ZERO)
        acc = mma(a, operand(b, MMA), acc, MMA)
        if GLU:
            b2 = ct.load(W2, index=(k, bn), shape=(TILE_K, TILE_N), order=(1, 0), padding_mode=ct.PaddingMode.ZERO)
            acc2 = mma(a, operand(b2, MMA), acc2, MMA)
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


@kernel
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


MERGE_LOADS = 4                      # split partials the skinny kernel's merging block loads at once


# bfloat16 operands and 3xTF32's 64-row tiles run faster two blocks an SM than one (docs/performance.md)
linear_kernel_occupancy2 = linear_kernel.replace_hints(occupancy=2)
# one block an SM while a skinny grid's blocks fit the SMs (its TMA pipeline gets the SM's shared
# memory: faster at 1 and 32 rows), two where more blocks than SMs take turns (faster at 64 rows).
# Without a hint the compiler emits the same SASS as for occupancy=1 (sm_90, tileiras 13.5.37).
skinny_kernel_one_an_sm = skinny_kernel.replace_hints(occupancy=None)


def _results(y, y2, xs, also):
    """What linear returns: y, (y, y2) or (y, y2, xs), the copies in y's shape."""
    if also is None:
        return y
    return (y, y2.reshape(y.shape)) if xs is None else (y, y2.reshape(y.shape), xs.reshape(y.shape))


def _linear_cupy(x, weight, bias, act, glu, norm, residual, out_dtype, also=None, scaled=None, scaled_by=None):
    """The GPU product; `also`: a second dtype the result is stored in too (returned second);
    scaled, scaled_by: linear's."""
    import cupy

    k = x.shape[-1]
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = empty(cupy, (m, n), out_dtype)
    two = also is not None and np.dtype(also) != y.dtype       # (float32, bfloat16)
    y2 = empty(cupy, (m, n), also) if two else y
    xs_out = empty(cupy, (m, n), BF16) if scaled_by is not None else None
    if m == 0:
        return _results(y.reshape(*x.shape[:-1], n), y2, xs_out, also)
    sequence = x.ndim >= 3 and x.shape[-2] > 1
    mode = mma_mode(weight.dtype)
    x3 = mode == TF32X3
    rms = isinstance(norm, RMSNorm)
    foldable = norm is not None and (rms or not norm.affine)      # the skinny kernel can apply it
    plan = linear_plan(m, n, k, glu, sm_count(), mode == BF16_MMA, sequence, weight.dtype.itemsize,
                       foldable and not rms, x3)
    in_kernel = foldable and plan[0] != "tiles"
    if norm is not None and not in_kernel:
        x2 = norm(x2, out_dtype=BF16 if mode == BF16_MMA else np.float32)
    elif mode == BF16_MMA and plan[0] == "tiles":     # the skinny kernel rounds x as it loads it
        x2 = to_bf16(x2)
    code = (RMS if rms else LAYER) if in_kernel else NO_NORM
    eps = float(norm.eps) if in_kernel else 0.0
    scale = in_kernel and norm.affine
    g = norm.weight if scale else scaled_by if scaled_by is not None else x2
    w, w2 = (weight[:n], weight[n:]) if glu else (weight, weight)
    b = x2 if bias is None else bias
    r = y if residual is None else residual.reshape(m, n)
    flags = (bias is not None, act, glu, residual is not None)
    if plan[0] == "skinny":
        tm, tn, tk = plan[1]
        per, split = skinny_splits(n, k, tn, tk, glu, sm_count())
        tn = skinny_block_n(m, tn, in_kernel)
        tk, per = skinny_block_k(m, k, tk, per, in_kernel, split, glu, x3)
        n_blocks, m_blocks = -(-n // tn), -(-m // tm)
        p = p2 = s_ = c = y
        if split > 1:
            p = cupy.empty((split, n_blocks * tn, m_blocks * tm), dtype=cupy.float32)
            p2 = cupy.empty_like(p) if glu else p
            s_ = cupy.empty((split, 2, m_blocks * tm), dtype=cupy.float32)
            c = last_block_counters(n_blocks * m_blocks)
        one_an_sm = m_blocks * n_blocks * split <= sm_count()
        # the scaled operand where a block holds 32 rows (at one row its second load cost more)
        xs_in = scaled is not None and scale and code == RMS and mode == BF16_MMA and m > NARROW_ROWS
        xs = scaled.reshape(m, k) if xs_in else xs_out if scaled_by is not None else y
        launch((m_blocks, n_blocks, split), skinny_kernel_one_an_sm if one_an_sm else skinny_kernel,
               (x2, w, w2, g, b, r, y, y2, xs, p, p2, s_, c, eps, per, tm, tn, tk, *flags, code, scale, mode, split, two,
                xs_in, scaled_by is not None))
    else:
        _, (tm, tn, tk), per, split = plan
        grid = (-(-m // tm) * -(-n // tn), split, 1)
        two_an_sm = mode == BF16_MMA or (x3 and not glu)
        kernel = linear_kernel_occupancy2 if two_an_sm else linear_kernel
        if split == 1:
            launch(grid, kernel, (x2, w, w2, b, r, y, per, tm, tn, tk, *flags, False, mode))
        else:
            part = cupy.empty((split, m, n), dtype=cupy.float32)
            launch(grid, kernel, (x2, w, w2, b, r, part, per, tm, tn, tk, False, 0, False, False, True, mode))
            launch((m, -(-n // REDUCE_TILE), 1), splitk_reduce_kernel,
                   (part, b, r, y, REDUCE_TILE, flags[0], act, flags[3]))
    if two and plan[0] == "tiles":      # the second copy in one pass of its own (the skinny kernel stores it)
        y2 = to_bf16(y)
    if scaled_by is not None and plan[0] == "tiles":
        xs_out = to_bf16(widen(y2) * scaled_by)
    return _results(y.reshape(*x.shape[:-1], n), y2, xs_out, also)


@any_array
def linear(x, weight, bias=None, activation: str | None = None, *, norm: LayerNorm | RMSNorm | None = None,
           residual=None, out_dtype=np.float32, scaled=None, scaled_by=None):
    """residual + act(norm(x) @ weight.T + bias); x (..., K), weight (N, K), bias (N,).

    activation: None, 'gelu' (exact), 'gelu_tanh', 'silu', or 'swiglu': weight stacks the
    gate and up projections (2I, K) and the result is silu(gate) * up, (..., I).
    norm: a LayerNorm or RMSNorm applied to x first; the decode kernels (M <= 128) compute an
    RMSNorm or a LayerNorm without parameters (see fold_norm) themselves, otherwise it runs first.
    residual: (..., N_out), added last.
    x may be bfloat16 (a product's input kept so by precision 'medium'); out_dtype float32 or
    bfloat16 (the result rounded as it is stored, for a next product that takes bfloat16), or a
    pair of them, (float32, bfloat16) or one dtype twice: the result in both, returned as a pair
    (a residual stream kept in float32 whose next normed product reads half the bytes).
    scaled_by (N,), with out_dtype (float32, bfloat16): a third result, the bfloat16 one times
    scaled_by rounded to bfloat16; a next product normed by RMSNorm(scaled_by) takes it as
    `scaled` beside that bfloat16 x, and the decode kernel then multiplies it as it is rather
    than scaling x itself (the same result, faster at 32+ rows).
    """
    if norm is not None and not isinstance(norm, (LayerNorm, RMSNorm)):
        raise TypeError(f"norm: expected a LayerNorm or RMSNorm, got {type(norm).__name__}")
    kind = backend(x=x, weight=weight, bias=bias, residual=residual,
                   norm_weight=None if norm is None else norm.weight,
                   norm_bias=getattr(norm, "bias", None), scaled=scaled, scaled_by=scaled_by)
    glu = activation == "swiglu"
    act = SILU if glu else activation_code(activation)
    check("x", x, ndim=tuple(range(1, 8)), dtype=WEIGHT_DTYPES)
    check("weight", weight, shape=(None, x.shape[-1]), dtype=WEIGHT_DTYPES)
    also = None
    if isinstance(out_dtype, (tuple, list)):
        out_dtype, also = (result_dtype(d) for d in out_dtype)
        if also not in (out_dtype, BF16):
            raise ValueError(f"out_dtype: a pair is (float32, bfloat16) or one dtype twice, got {out_dtype}, {also}")
    out_dtype = result_dtype(out_dtype)
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
    if scaled_by is not None:
        check("scaled_by", scaled_by, shape=(n,), dtype=(np.dtype(np.float32),))
        if (out_dtype, also) != (np.dtype(np.float32), BF16):
            raise ValueError("scaled_by: needs out_dtype (float32, bfloat16), the bfloat16 copy being what it scales")
        if norm is not None:
            raise ValueError("scaled_by: a product without a norm of its own (the kernel has one weight to scale by)")
    if scaled is not None:
        check("scaled", scaled, shape=x.shape, dtype=(BF16,))
        if not isinstance(norm, RMSNorm) or not norm.affine:
            raise ValueError("scaled: x times an RMSNorm's weight, for a product normed by that RMSNorm")
    if kind == "numpy":
        y = linear_reference(x, weight, bias, activation, norm, residual)
        if also is None:
            return y.astype(out_dtype, copy=False)
        y, y2 = y.astype(out_dtype), y.astype(also)
        return (y, y2) if scaled_by is None else (y, y2, (widen(y2) * scaled_by).astype(BF16))
    return _linear_cupy(x, weight, bias, act, glu, norm, residual, out_dtype, also, scaled, scaled_by)
