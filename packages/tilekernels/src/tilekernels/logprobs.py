"""Log-probabilities of tokens under the raw logits: log_softmax(x)[token] of each row, and
the row's `top` most likely tokens with theirs, without writing the (rows, V) log-softmax.

What a scoring client needs (OpenAI's completions logprobs, lm-evaluation-harness): the
chosen token's log-probability under the model whatever the sampling settings, and the
alternatives. A vocabulary row is split over many blocks as in argmax: each block writes its
chunk's largest value, the sum of exp(x - that value) and its own `top` best (value, index),
a pass of argmax per alternative over a chunk held on chip; the row's last block to finish
merges them into log-sum-exp, the chosen token's log-probability and the row's best `top`.
One launch, and a decode graph can run it after its sampler (runtime.graphs): the chosen
token is read where the sampler wrote it.
"""
from __future__ import annotations

import cuda.tile as ct
import numpy as np

from .cubins import kernel
from ._arrays import array_module, backend, check, inputs_ready, last_block_counters, last_in_group, launch, \
    next_pow2, reset_count
from .argmax import chunk_tile
from .interop import any_array

ConstInt = ct.Constant[int]
MAX_TOP = 20        # alternatives a row at most (OpenAI's limit)


# ---------------------------------------------------------------------- reference
def logprobs_reference(x: np.ndarray, tokens: np.ndarray, top: int) -> tuple:
    """(chosen (rows,) float32, top values (rows, top) float32, top ids (rows, top) int64):
    log_softmax of each row of x in float64 at tokens, and at its `top` largest logits
    (largest first, ties to the smaller id)."""
    x64 = x.astype(np.float64)
    m = x64.max(-1, keepdims=True)
    lp = x64 - (m + np.log(np.exp(x64 - m).sum(-1, keepdims=True)))
    rows = np.arange(x.shape[0])
    ids = np.argsort(-x, axis=-1, kind="stable")[:, :top].astype(np.int64)
    return (lp[rows, np.asarray(tokens, np.int64)].astype(np.float32),
            np.take_along_axis(lp, ids, -1).astype(np.float32), ids)


# ---------------------------------------------------------------------- kernel
@kernel
def logprobs_kernel(X, TOK, PM, PS, PV, PI, C, LP, TV, TI, TILE: ConstInt, CHUNKS: ConstInt, TOP: ConstInt,
                    TOP_P2: ConstInt):
    """Chunk bid(0) of row bid(1): its largest value PM, sum of exp(x - PM) PS and TOP best
    (value PV, index PI), first of equals first; the row's last block writes LP[row] =
    x[row, TOK[row]] - logsumexp(row) and the row's TOP best as log-probabilities TV, ids TI."""
    inputs_ready()
    c = ct.bid(0)
    r = ct.bid(1)
    x = ct.load(X, index=(r, c), shape=(1, TILE), padding_mode=ct.PaddingMode.NEG_INF)
    m = ct.max(x, axis=1, keepdims=True)
    ct.store(PM, index=(r, c), tile=m, allow_tma=False)
    ct.store(PS, index=(r, c), tile=ct.sum(ct.exp(x - m), axis=1, keepdims=True), allow_tma=False)
    if TOP > 0:
        at = ct.arange(TILE, dtype=ct.int32)[None, :]
        ks = ct.arange(TOP_P2, dtype=ct.int32)[None, :]
        vals = ct.full((1, TOP_P2), -np.inf, ct.float32)
        idx = ct.zeros((1, TOP_P2), ct.int32)
        for k in ct.static_iter(range(TOP)):
            j = ct.argmax(x, axis=1, keepdims=True)
            vals = ct.where(ks == k, ct.max(x, axis=1, keepdims=True), vals)
            idx = ct.where(ks == k, j + c * TILE, idx)
            x = ct.where(at == j, -np.inf, x)
        ct.store(PV, index=(r, c, 0), tile=ct.reshape(vals, (1, 1, TOP_P2)), allow_tma=False)
        ct.store(PI, index=(r, c, 0), tile=ct.reshape(idx, (1, 1, TOP_P2)), allow_tma=False)
    if last_in_group(C, r, ct.num_blocks(0)):
        valid = ct.arange(CHUNKS, dtype=ct.int32)[None, :] < ct.num_blocks(0)
        pm = ct.load(PM, index=(r, 0), shape=(1, CHUNKS), padding_mode=ct.PaddingMode.NEG_INF, allow_tma=False)
        ps = ct.load(PS, index=(r, 0), shape=(1, CHUNKS), padding_mode=ct.PaddingMode.ZERO, allow_tma=False)
        top = ct.max(ct.where(valid, pm, -np.inf))
        lse = top + ct.log(ct.sum(ct.where(valid, ps * ct.exp(pm - top), 0.0)))
        token = ct.astype(ct.load(TOK, index=(r,), shape=(), allow_tma=False), ct.int32)
        xt = ct.load(X, index=(r, token), shape=(1, 1), allow_tma=False)
        ct.store(LP, index=(r,), tile=ct.reshape(xt - lse, (1,)), allow_tma=False)
        if TOP > 0:
            span = CHUNKS * TOP_P2
            pv = ct.reshape(ct.load(PV, index=(r, 0, 0), shape=(1, CHUNKS, TOP_P2),
                                    padding_mode=ct.PaddingMode.NEG_INF, allow_tma=False), (1, span))
            pi = ct.reshape(ct.load(PI, index=(r, 0, 0), shape=(1, CHUNKS, TOP_P2),
                                    padding_mode=ct.PaddingMode.ZERO, allow_tma=False), (1, span))
            flat = ct.arange(span, dtype=ct.int32)[None, :]
            # entries of chunks past the row's end and of a chunk's unused places are not candidates
            pv = ct.where((flat // TOP_P2 < ct.num_blocks(0)) & (flat % TOP_P2 < TOP), pv, -np.inf)
            ks = ct.arange(TOP_P2, dtype=ct.int32)[None, :]
            vals = ct.zeros((1, TOP_P2), ct.float32)
            ids = ct.zeros((1, TOP_P2), ct.int64)
            for k in ct.static_iter(range(TOP)):
                best = ct.argmax(pv, axis=1, keepdims=True)
                vals = ct.where(ks == k, ct.max(pv, axis=1, keepdims=True) - lse, vals)
                ids = ct.where(ks == k, ct.astype(ct.sum(ct.where(flat == best, pi, 0)), ct.int64), ids)
                pv = ct.where(flat == best, -np.inf, pv)
            ct.store(TV, index=(r, 0), tile=vals, allow_tma=False)
            ct.store(TI, index=(r, 0), tile=ids, allow_tma=False)
        reset_count(C, r)


# ---------------------------------------------------------------------- op
@any_array
def logprobs(x, tokens, top: int = 0, out: tuple | None = None) -> tuple:
    """Log-probabilities under logits x (rows, V) float32: (chosen, top_values, top_ids) with
    chosen (rows,) float32 = log_softmax(x)[row, tokens[row]] (tokens int64 (rows,)),
    top_values (rows, top) float32 and top_ids (rows, top) int64 the row's `top` (0 to
    MAX_TOP, at most V) most likely tokens, largest first, ties to the smaller id.
    out: those three arrays to write into (a decode graph's buffers); top_values and
    top_ids are then (rows, top_width) with top_width >= top, of which the first top columns
    hold the result (the GPU kernel may write the next ones up to a power of two: scratch)."""
    kind = backend(x=x, tokens=tokens, **({} if out is None else dict(zip(("chosen", "top_values", "top_ids"), out))))
    check("x", x, ndim=2, dtype=np.float32)
    rows, n = x.shape
    check("tokens", tokens, shape=(rows,), dtype=np.int64)
    if n == 0:
        raise ValueError(f"x: expected a non-empty last axis, got shape {tuple(x.shape)}")
    if isinstance(top, bool) or not isinstance(top, (int, np.integer)) or not 0 <= top <= min(MAX_TOP, n):
        raise ValueError(f"top must be an integer in [0, {min(MAX_TOP, n)}], got {top!r}")
    if out is not None:
        check("chosen", out[0], shape=(rows,), dtype=np.float32)
        check("top_values", out[1], shape=(rows, None), dtype=np.float32)
        check("top_ids", out[2], shape=(rows, out[1].shape[1]), dtype=np.int64)
        if out[1].shape[1] < top:
            raise ValueError(f"top_values: {out[1].shape[1]} columns for top={top}")
    if kind == "numpy":
        t = np.asarray(tokens)
        if rows and not 0 <= t.min() <= t.max() < n:
            raise ValueError(f"tokens must be in [0, {n}), got {t.min()}..{t.max()}")
        got = logprobs_reference(x, t, top)
        if out is None:
            return got
        out[0][...] = got[0]
        out[1][:, :top], out[2][:, :top] = got[1], got[2]
        return out
    xp = array_module(x)
    chosen, tv, ti = out if out is not None else (
        xp.empty(rows, np.float32), xp.empty((rows, top), np.float32), xp.empty((rows, top), np.int64))
    if rows:
        tile = chunk_tile(n)
        chunks = -(-n // tile)
        width = next_pow2(max(top, 1))
        launch((chunks, rows, 1), logprobs_kernel,
               (x, tokens, xp.empty((rows, chunks), np.float32), xp.empty((rows, chunks), np.float32),
                xp.empty((rows, chunks, width), np.float32), xp.empty((rows, chunks, width), np.int32),
                last_block_counters(rows), chosen, tv if top else chosen.reshape(rows, 1),
                ti if top else xp.empty((rows, 1), np.int64), tile, next_pow2(chunks), top, width))
    return chosen, tv, ti
